"""The trainer's forward without padding (trainers/packed_attention.py): the samples end to end in
one row, attention in blocks of like length; the same log-probs and the same step as the padded
forward, and a model it cannot pack is left padded or refused, never attended across samples."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
from pipeline.tasks.tiny_model import make_model_folder
from tests.adam_bound import adam_tolerance, gradient_excess, moments_apart, record_gradients, weight_excess
from trainers import GRPOTrainer
from trainers.packed_attention import PackedLayout, packed, packs
from trainers.response_rows import ResponseBatch

pytestmark = pytest.mark.usefixtures("restore_torch_threads")

MAX_LEN = 96


def _long_tailed_batch(groups: int = 3, group: int = 4, seed: int = 0) -> Batch:
    """Prompts of 3-12 tokens, responses of 1-96 (one at the limit in each group), rewards spread."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(3, 60) for _ in range(rng.randint(3, 12)))
        samples = []
        for i in range(group):
            n = MAX_LEN if i == 0 else rng.choice([1, 2, 5, 9, 17, 30, 55])
            reason = FinishReason.LENGTH if n == MAX_LEN else FinishReason.STOP
            ids = tuple(rng.randrange(3, 60) for _ in range(n))
            seg = Segment(ids, tuple(-rng.uniform(0.5, 3.0) for _ in ids), reason, 0)
            sample = Sample(index=i, prompt_ids=prompt).extended(seg, max_response_len=MAX_LEN)
            samples.append(dataclasses.replace(sample, reward=rng.random()))
        task = PromptTask(index=g, prompt_ids=prompt, label=None)
        out.append(Group.fresh(task, epoch=0, n_samples=group, version=0, seq=g).with_samples(samples))
    return Batch(0, tuple(out))


def test_the_layout_cuts_blocks_of_like_length_and_places_every_token_once():
    lengths = [3, 4, 5, 40, 41, 90, 2]
    layout = PackedLayout.of(lengths)
    assert [b for b, _ in layout.blocks] and sum(b for b, _ in layout.blocks) == len(lengths)
    start = 0
    for count, width in layout.blocks:  # each block: its samples' longest, at most SLACK x their attention
        block = lengths[start : start + count]
        assert width == max(block) and count * width**2 <= PackedLayout.SLACK * sum(n * n for n in block)
        start += count
    # 3 x 90^2 > 2 x (40^2 + 41^2 + 90^2); a short one after the longest adds little to its block
    assert layout.blocks == ((3, 5), (2, 41), (2, 90))
    area = sum(b * w for b, w in layout.blocks)
    assert layout.scatter.unique().numel() == sum(lengths) and int(layout.scatter.max()) < area
    assert layout.position_ids[0].tolist() == [t for n in lengths for t in range(n)]
    assert layout.padded_rows().tolist() == [b * 90 + t for b, n in enumerate(lengths) for t in range(n)]


def test_a_packed_batch_reads_its_targets_where_the_padded_one_does():
    batch = _long_tailed_batch()
    samples = list(batch.samples)
    pad, pack = ResponseBatch.of(samples, 0), ResponseBatch.of(samples, 0, packed=True)
    assert pack.ids.shape == (1, sum(len(s.prompt_ids) + s.response_len for s in samples)) and pad.layout is None
    for b in (pad, pack):  # the row before each target predicts it
        assert torch.equal(b.ids.view(-1)[b.rows + 1], b.targets)
    assert torch.equal(pad.targets, pack.targets) and torch.equal(pad.sample, pack.sample)
    assert bool(pack.attention.all())


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_packed_log_probs_equal_the_padded_ones(tmp_path, arch):
    model = make_model_folder(tmp_path / arch, arch=arch, seed=1)
    samples = list(_long_tailed_batch().samples)
    padded = GRPOTrainer(model, pack=False).logprobs(samples)
    packed_ = GRPOTrainer(model).logprobs(samples)
    for a, b in zip(padded, packed_, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-5)


def test_a_packed_step_is_the_padded_step(tiny_model_dir):
    """Two optimizer steps with the step-KL check: the gradients within fp32's rounding of the
    same sums, the weights within what AdamW makes of that (tests/adam_bound.py)."""
    batch = _long_tailed_batch(seed=2)
    results = []
    for pack in (False, True):
        trainer = GRPOTrainer(tiny_model_dir, lr=0.05, global_batch_size=6, max_step_kl=0.2, pack=pack)
        assert packs(trainer.model)  # the flag alone decides here
        grads = record_gradients(trainer.optimizer, trainer.model.named_parameters())
        metrics = trainer.train_step(batch)
        results.append((metrics, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, grads))
    (m_pad, w_pad, g_pad), (m_pack, w_pack, g_pack) = results
    assert m_pad["optimizer_steps"] == m_pack["optimizer_steps"] == 2
    for key in ("loss", "pg_loss", "grad_norm", "step_kl_max", "train_rollout_logprob_abs_diff"):
        assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-4, abs=1e-7), key
    positions = sum(len(s.prompt_ids) + s.response_len for s in batch.samples[:6])
    assert gradient_excess(g_pad[0], g_pack[0], positions=positions) <= 1.0
    roundings = 2 + int(m_pad["step_kl_halvings"])
    tolerance = adam_tolerance(g_pad, moments_apart(g_pad, g_pack), w_pad, lr=0.05, roundings=roundings)
    assert weight_excess(w_pack, w_pad, tolerance) <= 1.0


def test_without_the_layout_the_packed_row_would_attend_across_samples(tiny_model_dir):
    """What packing guards against, shown: the same [1, T] row under plain causal attention gives
    the later samples other logits; under `packed` each sample's are its own."""
    net = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lengths = [7, 3, 12]
    row = torch.randint(3, 60, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    layout = PackedLayout.of(lengths)
    with torch.no_grad():
        alone = torch.cat([net(input_ids=part).logits[0] for part in row.split(lengths, dim=1)])
    with torch.no_grad(), packed(net, layout):
        together = net(input_ids=row, position_ids=layout.position_ids).logits[0]
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    with torch.no_grad():
        crossed = net(input_ids=row, position_ids=layout.position_ids).logits[0]
    assert float((crossed[lengths[0] :] - alone[lengths[0] :]).abs().max()) > 1e-3
    assert net.config._attn_implementation == "sdpa"  # restored after the packed forward


def reference_varlen(q, k, v, starts, starts_k, longest, longest_k, scale=None):
    """The variable-length kernel's contract in plain tensor code, for a CPU: q [T, Hq, D], k and
    v [T, Hkv, D], each sample causal over its own tokens between `starts`. Traceable by dynamo,
    as the real kernel (a custom op) is."""
    positions = torch.arange(q.shape[0], device=q.device, dtype=starts.dtype)
    sample = torch.searchsorted(starts[1:], positions, right=True)
    allowed = (sample[:, None] == sample[None, :]) & (positions[None, :] <= positions[:, None])
    q_, k_, v_ = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def on_the_kernels_path(monkeypatch, kernel=reference_varlen):
    """Sends every packed forward down the kernel's path with `kernel` in fp32, as a GPU's bf16
    forward goes with the real one; the blocks refuse to run."""
    from trainers import packed_attention

    def no_blocks(*args, **kwargs):
        raise AssertionError("the packed forward attended in blocks")

    monkeypatch.setattr(
        packed_attention, "_kernel_for", lambda net, layout: packed_attention._Kernel(kernel, torch.float32)
    )
    monkeypatch.setattr(packed_attention, "_outside_graphs", no_blocks)


def test_the_kernels_path_gives_the_padded_log_probs_and_step(tmp_path, monkeypatch):
    """The path a GPU's bf16 forward takes (the samples' boundaries handed down the model's keyword
    arguments to its attention), run on a CPU with the kernel's contract written out: the padded
    forward's log-probs, every layer's attention by the kernel, and a step as the padded one."""
    model = make_model_folder(tmp_path / "m", arch="moe", seed=1)
    samples = list(_long_tailed_batch().samples)
    padded = GRPOTrainer(model, pack=False)
    calls = []

    def counted(q, *args, **kwargs):
        calls.append(q.shape)
        return reference_varlen(q, *args, **kwargs)

    on_the_kernels_path(monkeypatch, counted)
    kernel = GRPOTrainer(model)
    for a, b in zip(padded.logprobs(samples), kernel.logprobs(samples), strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-5)
    layers = kernel.model.config.num_hidden_layers
    assert len(calls) % layers == 0 and len(calls) >= layers
    batch = _long_tailed_batch(seed=2)
    m_pad, m_kernel = padded.train_step(batch), kernel.train_step(batch)
    for key in ("loss", "pg_loss", "grad_norm"):
        assert m_kernel[key] == pytest.approx(m_pad[key], rel=1e-4, abs=1e-7), key


def test_a_kernel_that_fails_its_trial_leaves_the_blocks_and_says_why(monkeypatch, caplog):
    from trainers import packed_attention

    monkeypatch.setattr(packed_attention, "_refused", [])
    monkeypatch.setattr(packed_attention, "_trials", {})
    cpu = torch.device("cpu")
    assert packed_attention._tried(reference_varlen, cpu, torch.float32, 4, 2, 8)

    def old_keywords(*args, is_causal=True, **kwargs):
        raise TypeError("varlen_attn() got an unexpected keyword argument 'window_size'")

    assert not packed_attention._tried(old_keywords, cpu, torch.float32, 4, 2, 8)
    assert packed_attention._refused == ["TypeError: varlen_attn() got an unexpected keyword argument 'window_size'"]
    assert "variable-length attention refused" in caplog.text
    # Once refused, no forward takes the kernel's path, on any device.
    layout = PackedLayout.of([2, 3])
    assert packed_attention._kernel_for(_NoRegistry(), layout) is None


class _NoRegistry(torch.nn.Module):
    """Claims transformers' attention registry but attends with a layer of its own."""

    _supports_attention_backend = True

    def __init__(self) -> None:
        super().__init__()
        self.config = Qwen3Config(vocab_size=16, hidden_size=8, num_attention_heads=2, num_key_value_heads=2)
        self.config._attn_implementation = "sdpa"
        self.embed = torch.nn.Embedding(16, 8)

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.embed(input_ids)


@pytest.mark.parametrize("path", ["blocks", "kernel"])
def test_a_model_that_never_calls_the_registry_is_refused_and_left_as_it_was(monkeypatch, path):
    if path == "kernel":
        on_the_kernels_path(monkeypatch)
    net = _NoRegistry()
    with pytest.raises(RuntimeError, match="_NoRegistry ran a packed forward without calling attention"):
        with packed(net, PackedLayout.of([2, 3])) as arguments:
            net(torch.zeros(1, 5, dtype=torch.long), **arguments)
    assert net.config._attn_implementation == "sdpa"


def test_sliding_windows_and_soft_caps_stay_padded():
    plain = Qwen3Config(num_hidden_layers=2)
    sliding = Qwen3Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    class_ = type("Net", (torch.nn.Module,), {"_supports_attention_backend": True})
    nets = {}
    for name, config in {"plain": plain, "sliding": sliding}.items():
        nets[name] = class_()
        nets[name].config = config
    assert packs(nets["plain"]) and not packs(nets["sliding"])
    nets["plain"].config.attn_logit_softcapping = 30.0
    assert not packs(nets["plain"])
    assert not packs(torch.nn.Linear(2, 2))  # no config, no registry


def test_a_model_under_gradient_checkpointing_stays_padded(tiny_model_dir):
    """Its backward runs each layer's forward again, after the packed forward has closed."""
    net = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert packs(net)
    enable = getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable
    enable()
    assert not packs(net)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_gpu_packed_log_probs_equal_the_padded_ones(tmp_path, dtype, monkeypatch):
    """The same check on the device (CUDA or ROCm), in fp32 and under bf16 autocast, where the
    padded and packed layouts run other kernels (bf16: torch's variable-length flash attention,
    grouped-query heads included, and it did run; fp32: the padded blocks): within 1e-4 in fp32,
    0.05 nats in bf16."""
    from trainers import packed_attention

    model = make_model_folder(tmp_path / "gpu", seed=1)
    samples = list(_long_tailed_batch().samples)
    padded = GRPOTrainer(model, device="cuda", dtype=dtype, pack=False).logprobs(samples)
    calls = []
    kernel = packed_attention._varlen_kernel()

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "_varlen_kernel", lambda: None if kernel is None else counted)
    packed_ = GRPOTrainer(model, device="cuda", dtype=dtype).logprobs(samples)
    atol = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(padded, packed_, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=atol)
    if dtype == "bfloat16" and kernel is not None:  # every layer's attention by the kernel, in bf16
        assert packed_attention._refused == [], f"the variable-length kernel refused: {packed_attention._refused}"
        assert calls and set(calls) == {torch.bfloat16}
    else:
        assert calls == []  # fp32: the blocks
