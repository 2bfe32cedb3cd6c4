"""`--trainer-compile` (trainers/layer_compile.py): the torch trainer's decoder layers compiled in
place, attention inside the graphs where the variable-length kernel serves and eager between them
where the blocks do; the same log-probs and step as the eager trainer, the
same parameter names, and a model or backend it cannot serve refused by name."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from pipeline.config import config_to_dict, load_config
from pipeline.trainer_settings import build_trainer
from tests.test_packed_attention import _long_tailed_batch, on_the_kernels_path
from trainers import GRPOTrainer
from trainers.layer_compile import compile_decoder_layers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("restore_torch_threads")]


def test_compiled_layers_score_and_step_as_the_eager_ones(tiny_model_dir):
    """The flag reaches the trainer; the packed forward's log-probs within 1e-5 of the eager
    trainer's, and one train step (two optimizer steps) lands on the same metrics."""
    config = config_to_dict(load_config(["--trainer-compile", "--global-batch-size", "6"]))
    compiled = build_trainer(tiny_model_dir, config)
    eager = build_trainer(tiny_model_dir, config_to_dict(load_config(["--global-batch-size", "6"])))
    layers = [m for m in compiled.model.modules() if type(m).__name__ == "Qwen3DecoderLayer"]
    assert layers and all(m._compiled_call_impl is not None for m in layers)
    assert compiled.model.state_dict().keys() == eager.model.state_dict().keys()  # checkpoints read the same
    samples = list(_long_tailed_batch().samples)
    for a, b in zip(eager.logprobs(samples), compiled.logprobs(samples), strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-5)
    batch = _long_tailed_batch(seed=2)
    m_eager, m_compiled = eager.train_step(batch), compiled.train_step(batch)
    assert m_compiled["optimizer_steps"] == m_eager["optimizer_steps"] == 2
    for key in ("loss", "pg_loss", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert m_compiled[key] == pytest.approx(m_eager[key], rel=1e-4, abs=1e-6), key


def test_one_set_of_graphs_serves_every_decoder_layer(tmp_path):
    """The layers share one code object, so their graphs are shared too, unless a guard tells the
    layers apart: a KV cache's per-layer slot did (each layer compiled anew, and past torch's
    recompile limit of 8 the rest ran eagerly: 20 of a 28-layer model's). As many graphs for four
    layers as for two."""
    from torch._dynamo.utils import counters

    from pipeline.tasks.tiny_model import make_model_folder

    samples = list(_long_tailed_batch().samples)
    graphs = []
    for layers in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        trainer = GRPOTrainer(make_model_folder(tmp_path / f"m{layers}", num_layers=layers), compile_layers=True)
        trainer.logprobs(samples)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0
    assert graphs[1] == graphs[0], f"graphs compiled for 2 and 4 layers: {graphs}"


def test_on_the_kernels_path_attention_stays_inside_the_layers_graphs(tmp_path, monkeypatch):
    """Where the variable-length kernel serves (a GPU in bf16), each compiled layer is one graph,
    attention included: the samples' boundaries come as the forward's tensors and ints, not from a
    context variable, and nothing in the path reads back what it writes. The blocks break each
    layer's graph in two at the attention (the count is what this test would see if the kernel's
    path broke too). The compiled layers score and step as the eager ones."""
    from torch._dynamo.utils import counters

    from pipeline.tasks.tiny_model import make_model_folder

    model = make_model_folder(tmp_path / "m", num_layers=3)
    samples = list(_long_tailed_batch().samples)
    breaks = {}
    for path in ("blocks", "kernel"):
        if path == "kernel":
            on_the_kernels_path(monkeypatch)
        torch._dynamo.reset()
        counters.clear()
        compiled = GRPOTrainer(model, compile_layers=True, global_batch_size=6)
        scored = compiled.logprobs(samples)
        metrics = compiled.train_step(_long_tailed_batch(seed=2))
        breaks[path] = sum(counters["graph_break"].values())
    assert breaks["blocks"] > 0 and breaks["kernel"] == 0, breaks
    eager = GRPOTrainer(model, global_batch_size=6)  # the kernel's path still, eagerly
    for a, b in zip(eager.logprobs(samples), scored, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-5)
    m_eager = eager.train_step(_long_tailed_batch(seed=2))
    for key in ("loss", "pg_loss", "grad_norm"):
        assert metrics[key] == pytest.approx(m_eager[key], rel=1e-4, abs=1e-6), key


def test_a_model_that_names_no_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="--trainer-compile: Sequential names no decoder layer class"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_the_flag_is_the_torch_trainers_and_off_by_default(tiny_model_dir):
    with pytest.raises(ConfigError, match="--trainer-compile=True with --train-backend=megatron"):
        load_config(["--trainer-compile", "--train-backend", "megatron"])
    eager = GRPOTrainer(tiny_model_dir)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in eager.model.modules())


@pytest.mark.gpu
def test_on_a_gpu_compiled_layers_score_as_the_eager_ones(tiny_model_dir):
    """On the device under bf16 autocast (CUDA or ROCm: triton compiles the fused kernels), the
    compiled layers' log-probs within 0.05 nats of the eager ones, and a step runs; where torch
    has the variable-length kernel, its call inside the layers' graphs (no graph break)."""
    from torch._dynamo.utils import counters

    from trainers import packed_attention

    eager = GRPOTrainer(tiny_model_dir, device="cuda", dtype="bfloat16")
    torch._dynamo.reset()
    counters.clear()
    compiled = GRPOTrainer(tiny_model_dir, device="cuda", dtype="bfloat16", compile_layers=True)
    samples = list(_long_tailed_batch().samples)
    for a, b in zip(eager.logprobs(samples), compiled.logprobs(samples), strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=0.05)
    assert compiled.train_step(_long_tailed_batch(seed=2))["optimizer_steps"] >= 1
    if packed_attention._varlen_kernel() is not None:
        assert packed_attention._refused == [], packed_attention._refused
        assert dict(counters["graph_break"]) == {}
