"""The trainer's forward at the response rows only, and micro-batches of like length."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.types import FinishReason, Sample, Segment
from pipeline.tasks.tiny_model import make_model_folder
from trainers.response_rows import micro_batches, response_logits


def _sample(index: int, prompt_len: int, response_len: int) -> Sample:
    sample = Sample(index=index, prompt_ids=tuple(range(3, 3 + prompt_len)))
    seg = Segment(tuple([5] * response_len), tuple([-1.0] * response_len), FinishReason.STOP, 0)
    return sample.extended(seg, max_response_len=64)


def test_micro_batches_sort_by_length_and_keep_each_within_both_limits():
    lengths = [(4, 30), (4, 2), (4, 9), (4, 1), (4, 20), (4, 3), (4, 50)]
    samples = [_sample(i, p, r) for i, (p, r) in enumerate(lengths)]
    tokens = [p + r for p, r in lengths]
    micros = micro_batches(samples, range(len(samples)), max_samples=3, max_tokens=40)
    flat = [i for m in micros for i in m]
    assert sorted(flat) == list(range(len(samples)))  # each sample once
    assert [tokens[i] for i in flat] == sorted(tokens)  # shortest first
    for m in micros:
        assert len(m) <= 3
        assert len(m) * max(tokens[i] for i in m) <= 40 or len(m) == 1  # alone: longer than the budget
    assert [len(m) for m in micros] == [3, 1, 1, 1, 1]  # 5,6,7 | 13 (2 x 24 > 40) | 24 | 34 | 54 (alone)
    # No limits: one micro-batch of every index given, sorted.
    assert micro_batches(samples, [6, 0, 2], max_samples=None, max_tokens=None) == [[2, 0, 6]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_model_folder(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


class _HeadHidden(torch.nn.Module):
    """A causal LM that computes its logits without calling an output-embedding module."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        hidden = self.inner.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return type("Out", (), {"logits": hidden @ self.inner.lm_head.weight.T})()


def test_response_logits_equal_the_full_logits_at_those_rows_with_and_without_the_head_hook(model):
    torch.manual_seed(0)
    ids = torch.randint(3, 30, (3, 11))
    attention = torch.ones_like(ids)
    attention[1, 7:] = 0  # right padding
    positions = torch.tensor([2, 5, 10, 11 + 3, 11 + 6, 22 + 0, 22 + 10])
    full = model(input_ids=ids, attention_mask=attention).logits.reshape(-1, model.config.vocab_size)
    picked = response_logits(model, ids, attention, positions)
    assert picked.shape == (len(positions), model.config.vocab_size)
    torch.testing.assert_close(picked, full[positions], rtol=1e-5, atol=1e-5)
    # The hook is gone after the call: the next plain forward computes every row.
    assert model(input_ids=ids, attention_mask=attention).logits.shape == (3, 11, model.config.vocab_size)
    # A model that never calls its head module: the rows are gathered from the full logits.
    torch.testing.assert_close(response_logits(_HeadHidden(model), ids, attention, positions), full[positions])


def test_the_trainers_forward_builds_no_kv_cache(model, monkeypatch):
    """transformers builds a KV cache in train mode too unless told not to: every layer's K and V
    copied into it, and under `--trainer-compile` a graph per layer (tests/test_layer_compile.py)."""
    from transformers import cache_utils

    updates: list[int] = []
    real = cache_utils.DynamicLayer.update

    def counted(self, *args, **kwargs):
        updates.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicLayer, "update", counted)
    model.train()
    ids = torch.randint(3, 30, (2, 9))
    model(input_ids=ids)  # the check can fail: a plain train-mode forward does build one
    assert updates, "transformers no longer builds a cache in train mode: this test checks nothing"
    updates.clear()
    response_logits(model, ids, None, torch.tensor([3, 8, 9 + 4])).sum().backward()
    assert updates == []


def test_gradients_reach_the_weights_only_through_the_picked_rows(model):
    ids = torch.randint(3, 30, (2, 9))
    attention = torch.ones_like(ids)
    positions = torch.tensor([4, 8, 9 + 6])
    model.zero_grad()
    response_logits(model, ids, attention, positions).logsumexp(-1).sum().backward()
    picked = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    full = model(input_ids=ids, attention_mask=attention).logits.reshape(-1, model.config.vocab_size)
    full[positions].logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(picked[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_token_budget_reaches_both_trainers(tmp_path):
    from core.errors import ConfigError
    from pipeline.config import load_config
    from pipeline.trainer_settings import build_trainer, megatron_settings

    assert load_config([]).trainer.max_tokens_per_gpu is None
    assert load_config(["--max-tokens-per-gpu", "4096"]).trainer.max_tokens_per_gpu == 4096
    megatron = load_config(["--train-backend", "megatron", "--max-tokens-per-gpu", "4096"])
    assert megatron_settings(megatron)["max_tokens_per_gpu"] == 4096
    with pytest.raises(ConfigError, match="max-tokens-per-gpu"):
        load_config(["--max-tokens-per-gpu", "0"])
    folder = make_model_folder(tmp_path / "m")
    trainer = build_trainer(folder, {"trainer": {"max_tokens_per_gpu": 512}, "rollout": {}})
    assert trainer.max_tokens_per_gpu == 512


def test_a_response_batch_names_each_response_token_and_the_row_that_predicts_it():
    from trainers.response_rows import ResponseBatch

    a, b = _sample(0, 2, 3), _sample(1, 4, 1)  # 2 + 3 and 4 + 1 tokens: L = 5
    batch = ResponseBatch.of([a, b], pad_id=0)
    assert batch.ids.shape == batch.attention.shape == (2, 5)
    assert batch.attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.sample.tolist() == [0, 0, 0, 1]
    assert batch.position.tolist() == [0, 1, 2, 0]
    assert batch.rows.tolist() == [1, 2, 3, 5 + 3]  # the position before each token, flat over [B, L]
    flat = batch.ids.reshape(-1)
    assert flat[batch.rows + 1].tolist() == batch.targets.tolist() == [5, 5, 5, 5]
    with pytest.raises(ValueError, match="sample 7 has an empty prompt"):
        ResponseBatch.of([Sample(index=7, prompt_ids=())], pad_id=0)


def _laid_out_one_by_one(samples: list[Sample], pad_id: int, packed: bool) -> dict[str, list[int]]:
    """The layout by its definition, sample after sample: what `ResponseBatch.of` computes at once."""
    lengths = [len(s.prompt_ids) + s.response_len for s in samples]
    width = sum(lengths) if packed else max(lengths)
    ids = [pad_id] * (width if packed else width * len(samples))
    attention = [0] * len(ids)
    out: dict[str, list[int]] = {"sample": [], "position": [], "rows": [], "targets": []}
    start = 0
    for i, s in enumerate(samples):
        tokens = [*s.prompt_ids, *s.response_ids]
        ids[start : start + len(tokens)] = tokens
        attention[start : start + len(tokens)] = [1] * len(tokens)
        for t in range(s.response_len):
            out["sample"].append(i)
            out["position"].append(t)
            out["rows"].append(start + len(s.prompt_ids) - 1 + t)
            out["targets"].append(s.response_ids[t])
        start += len(tokens) if packed else width
    return {"ids": ids, "attention": attention, **out}


@pytest.mark.parametrize("packed", [False, True])
def test_a_response_batch_is_laid_out_as_sample_after_sample(packed: bool) -> None:
    """Computed for the whole batch at once, the layout is the one its definition gives sample by
    sample, a response of no tokens and a one-token prompt included."""
    from trainers.response_rows import ResponseBatch

    def sample(index: int, prompt_len: int, response_len: int) -> Sample:  # every token its own id
        base = 20 * index
        seg = Segment(tuple(range(base + 10, base + 10 + response_len)), (-1.0,) * response_len, FinishReason.STOP, 0)
        return Sample(index=index, prompt_ids=tuple(range(base, base + prompt_len))).extended(seg, max_response_len=64)

    samples = [sample(0, 3, 4), sample(1, 1, 0), sample(2, 5, 1), sample(3, 2, 7), sample(4, 1, 1)]
    for chosen in (samples, samples[1:2], samples[2:3]):
        batch = ResponseBatch.of(chosen, pad_id=9, packed=packed)
        expected = _laid_out_one_by_one(chosen, 9, packed)
        got = {name: getattr(batch, name).reshape(-1).tolist() for name in expected}
        assert got == expected
        assert all(getattr(batch, name).dtype == torch.long for name in expected)


def test_megatron_packs_cut_in_order_within_rows_and_tokens():
    from trainers.megatron.packing import packs
    from trainers.megatron.rows import Row

    def row(n: int) -> Row:
        return Row(
            prompt_ids=[3] * 4,
            response_ids=[5] * (n - 4),
            behaviour=[0.0] * (n - 4),
            mask=[True] * (n - 4),
            advantage=1.0,
        )

    rows = [row(n) for n in (11, 12, 13, 17, 40, 11, 12)]
    cut = packs(rows, max_rows=8, max_tokens=30)
    assert [[len(r.prompt_ids) + len(r.response_ids) for r in c] for c in cut] == [[11, 12], [13, 17], [40], [11, 12]]
    assert [len(c) for c in packs(rows, max_rows=3, max_tokens=None)] == [3, 3, 1]


def test_the_trainer_scores_a_right_padded_batch_without_a_padding_mask_as_each_sample_alone(tmp_path):
    """No padding mask reaches the model (SDPA keeps its causal kernels: no explicit [B, 1, L, L]
    mask, no K/V copies for GQA), and each sample's log-probs are those it gets alone, unpadded."""
    from trainers import GRPOTrainer

    rng = torch.Generator().manual_seed(0)
    samples = []
    for i, (p, r) in enumerate([(3, 9), (7, 2), (5, 14), (2, 1)]):  # padded to 19 positions
        ids = torch.randint(3, 40, (p + r,), generator=rng).tolist()
        seg = Segment(tuple(ids[p:]), tuple([-1.0] * r), FinishReason.STOP, 0)
        samples.append(Sample(index=i, prompt_ids=tuple(ids[:p])).extended(seg, max_response_len=64))
    trainer = GRPOTrainer(make_model_folder(tmp_path / "m"))
    masks = []
    hook = trainer.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    try:
        together = trainer.logprobs(samples)
    finally:
        hook.remove()
    assert masks and all(m is None for m in masks)
    for sample, scores in zip(samples, together, strict=True):
        (alone,) = trainer.logprobs([sample])
        assert len(scores) == sample.response_len
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(alone), rtol=0, atol=1e-5)
