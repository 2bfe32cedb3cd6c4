"""Fused q/k/v and gate/up projections (`engines/fused_projections.py`) on a real tiny Qwen3 at fp32:
the cached decode over the fused model gives the unfused recompute path's tokens, a publish into the
live tensors reaches the fused weights, and names stay distinct weights (only true ties are tied)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engines.fused_projections import fuse_projections
from engines.kv_forward import KVCacheForward
from engines.torch_model import ModelRunner
from pipeline.tasks.tiny_model import make_model_folder
from tests.test_kv_forward import _run_batched


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("fp") / "m", hidden_size=32, num_layers=2, seed=0)


def _fused(folder: Path) -> ModelRunner:
    runner = ModelRunner(folder)
    assert fuse_projections(runner.model) == 2 * 2  # q/k/v and gate/up in each of 2 layers
    runner.refresh_live_weights()
    return runner


def test_fused_cached_decode_equals_unfused_recompute(model_dir: Path) -> None:
    rng = random.Random(3)
    prompts = [tuple(rng.randrange(3, 60) for _ in range(rng.randrange(1, 40))) for _ in range(9)]
    reference = _run_batched(ModelRunner(model_dir), prompts, slots=len(prompts))
    kv = KVCacheForward(_fused(model_dir), max_running_requests=3)
    for ref, got in zip(reference, _run_batched(kv, prompts, slots=3), strict=True):
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref, strict=True)) < 1e-5


def test_a_publish_reaches_the_fused_weights(model_dir: Path, tmp_path: Path) -> None:
    runner = _fused(model_dir)
    other = make_model_folder(tmp_path / "v1", hidden_size=32, num_layers=2, seed=1)
    runner.apply_weights(runner.read_weights(other))
    fresh = ModelRunner(other)
    ids = torch.tensor([[5, 9, 11, 4]])
    with torch.inference_mode():
        got = runner.model(input_ids=ids).logits
        want = fresh.model(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    attn = runner.model.model.layers[0].self_attn
    fused = attn.q_proj._fused_group.weight
    torch.testing.assert_close(fused[: attn.q_proj.out_features], fresh.model.model.layers[0].self_attn.q_proj.weight)


def test_only_true_ties_are_tied_after_fusing(model_dir: Path) -> None:
    before = sorted(sorted(g) for g in ModelRunner(model_dir).tied_groups())
    after = sorted(sorted(g) for g in _fused(model_dir).tied_groups())
    assert after == before  # q, k and v share a storage now, yet are three weights
    assert any(name.endswith("q_proj.weight") and len(g) == 1 for g in after for name in g)


def test_a_projection_called_alone_or_out_of_order_computes_its_own(model_dir: Path) -> None:
    runner = _fused(model_dir)
    attn = runner.model.model.layers[0].self_attn
    x, y = torch.randn(2, 32), torch.randn(2, 32)
    with torch.no_grad():
        v_alone = attn.v_proj(y)  # nothing pending for y: its own product
        q = attn.q_proj(x)
        k_other = attn.k_proj(y)  # pending slices are x's, not y's
        v = attn.v_proj(x)
    lin = torch.nn.functional.linear
    torch.testing.assert_close(v_alone, lin(y, attn.v_proj.weight))
    torch.testing.assert_close(k_other, lin(y, attn.k_proj.weight))
    torch.testing.assert_close(q, lin(x, attn.q_proj.weight))
    torch.testing.assert_close(v, lin(x, attn.v_proj.weight))
