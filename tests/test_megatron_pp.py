"""Pipeline parallel on CPU (gloo): PP=2 ranks take the step a single rank takes, save the same folder, resume.

Each layout runs in a fresh process (tests/megatron_pp_check.py): megatron's parallel state and
the process group are process-wide. The reference is one rank (PP=1), which tests/test_megatron.py
holds to the torch trainer. The built-in tiny model ties its embeddings, so these runs also cover
the tied embedding's two copies (first and last stage) and the sum of their gradients.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parent.parent


def _run(out: Path, name: str, world: int, tp: int, pp: int, start: Path | None = None, loss: str = "default") -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    args = [str(out), name, str(world), str(tp), str(pp), str(start or "none"), "float32", loss]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "megatron_pp_check.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return orjson.loads((out / f"{name}.json").read_bytes())


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _assert_same_step(a: dict, b: dict) -> None:
    assert set(a["metrics"]) == set(b["metrics"])
    for key, value in a["metrics"].items():
        assert b["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    diff = max(abs(x - y) for p, q in zip(a["logprobs"], b["logprobs"], strict=True) for x, y in zip(p, q, strict=True))
    assert diff < 1e-5


def _assert_same_folder(a: Path, b: Path, *, moved_from: Path, tolerance: float = 1e-5) -> None:
    wa, wb, base = _weights(a), _weights(b), _weights(moved_from)
    assert sorted(wa) == sorted(wb) == sorted(base)  # the same HF names (tied: no lm_head) ...
    assert all(wa[k].shape == wb[k].shape for k in wa)  # ... and shapes
    # Adam's step moves every weight by ~lr = 1e-2; the layouts land within 0.1% of that (by default).
    assert max(float((wa[k] - base[k]).abs().max()) for k in wa) > 5e-3
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < tolerance
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("pp")
    return out, _run(out, "pp1", 1, 1, 1)


def test_two_stages_take_the_single_rank_step_and_save_its_folder(single_rank):
    """PP=2 (one layer per stage): the same log-probs, metrics (loss, grad norm over both stages,
    two optimizer steps with proximal log-probs) and saved HF folder as one rank; every rank
    writes an optimizer shard that records the layout; a publish equals the saved folder."""
    out, one = single_rank
    two = _run(out, "pp2", 2, 1, 2)
    assert one["metrics"]["optimizer_steps"] == 2 and one["metrics"]["grad_norm"] > 1.0  # the clip acts
    _assert_same_step(one, two)
    _assert_same_folder(out / "pp1", out / "pp2", moved_from=out / "model")
    assert two["published_equals_saved"] and one["published_equals_saved"]
    assert sorted(two["shards"]) == ["rank0.json", "rank1.json"]
    assert {(s["world"], s["tp"], s["pp"], s["trainer_steps"]) for s in two["shards"].values()} == {(2, 1, 2, 1)}


def test_two_stages_resume_from_their_optimizer_shards(single_rank):
    """A second step from the saved folders: PP=2 ranks restore each stage's AdamW shard and take
    the step the single rank takes from its own (a stage that started Adam afresh would not)."""
    out, _ = single_rank
    if not (out / "pp2").exists():
        _run(out, "pp2", 2, 1, 2)
    one = _run(out, "pp1-resumed", 1, 1, 1, start=out / "pp1")
    two = _run(out, "pp2-resumed", 2, 1, 2, start=out / "pp2")
    assert one["steps"] == two["steps"] == 2
    _assert_same_step(one, two)
    _assert_same_folder(out / "pp1-resumed", out / "pp2-resumed", moved_from=out / "pp1")


@pytest.mark.slow
def test_pipeline_and_data_parallel_on_four_ranks_take_the_data_parallel_step(single_rank):
    """TP=1 x PP=2 x DP=2: each pipeline takes every other row. The reference is DP=2 without
    PP: summing gradients over DP ranks rounds differently from one rank's sum, and Adam's first
    steps magnify that in weights with tiny gradients (up to ~3e-4 against one rank here), while
    the pipeline itself changes nothing: the two runs agree to the last bit or nearly."""
    out, one = single_rank
    dp = _run(out, "dp2", 2, 1, 1)
    four = _run(out, "pp2-dp2", 4, 1, 2)
    _assert_same_step(one, four)
    _assert_same_step(dp, four)
    _assert_same_folder(out / "dp2", out / "pp2-dp2", moved_from=out / "model")
    assert sorted(four["shards"]) == [f"rank{r}.json" for r in range(4)]


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_on_four_ranks_take_the_single_rank_step(single_rank):
    """TP=2 x PP=2: each stage's layers split over two ranks (q/k norm gradients summed over TP,
    the norm over TP and PP, each stage joined over TP before the stages are joined on rank 0)."""
    out, one = single_rank
    four = _run(out, "tp2-pp2", 4, 2, 2)
    _assert_same_step(one, four)
    assert four["published_equals_saved"]
    # TP splits the sums of each matmul: within 1% of Adam's step of the single rank (3.4e-5 seen).
    _assert_same_folder(out / "pp1", out / "tp2-pp2", moved_from=out / "model", tolerance=1e-4)


def test_two_stages_take_the_single_rank_step_with_the_reference_kl_and_entropy(tmp_path):
    """The reference model's forward goes through the stages like the policy's; its log-probs and
    the entropy term's gradient land on the last stage, where the loss is."""
    one = _run(tmp_path, "kl1", 1, 1, 1, loss="kl")
    two = _run(tmp_path, "kl2", 2, 1, 2, loss="kl")
    assert one["metrics"]["kl_loss"] != 0 and one["metrics"]["entropy_loss"] > 0
    for r in (one, two):
        r["metrics"].pop("ref_log_probs_time")  # seconds, measured on each
    _assert_same_step(one, two)
    _assert_same_folder(tmp_path / "kl1", tmp_path / "kl2", moved_from=tmp_path / "model")


def test_layers_that_do_not_split_evenly_over_the_stages_are_refused_with_both_numbers():
    from transformers import Qwen3Config

    from core.errors import ConfigError
    from trainers.megatron.qwen3 import Qwen3Shape

    shape = Qwen3Shape.from_hf(Qwen3Config(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    shape.check_pipeline_parallel(3)
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size=2: the model's 3 layers are not divisible"):
        shape.check_pipeline_parallel(2)
