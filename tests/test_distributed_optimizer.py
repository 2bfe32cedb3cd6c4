"""`--use-distributed-optimizer`: megatron-core's DDP and distributed optimizer (GPU ranks only).

The config rules run everywhere; the rest is opt-in on a GPU host (`pytest -m gpu
tests/test_distributed_optimizer.py -s`): one step equals the hand-rolled path's, a resumed
checkpoint continues exactly, and the built-in task learns end to end in bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest

from core.errors import ConfigError
from pipeline.config import load_config
from tests.test_megatron import ROOT, _launch


def test_the_flag_is_the_megatron_backends_on_gpu_ranks():
    assert load_config([]).trainer.use_distributed_optimizer is False
    with pytest.raises(ConfigError, match=r"--use-distributed-optimizer=True with --trainer-device='cpu'"):
        load_config(["--train-backend", "megatron", "--use-distributed-optimizer"])
    with pytest.raises(ConfigError, match=r"--use-distributed-optimizer=True with --train-backend=torch"):
        load_config(["--use-distributed-optimizer"])


@pytest.mark.gpu
def test_the_flag_loads_for_megatron_on_a_gpu():
    megatron_gpu = ["--train-backend", "megatron", "--trainer-device", "cuda", "--use-distributed-optimizer"]
    assert load_config(megatron_gpu).trainer.use_distributed_optimizer is True


def _check(tmp_path, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "distopt_check.py"), str(tmp_path), dtype],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return orjson.loads((tmp_path / "result.json").read_bytes())


@pytest.mark.gpu
def test_one_step_matches_the_hand_rolled_path_and_a_resume_continues_exactly(tmp_path):
    r = _check(tmp_path, "float32")
    print(orjson.dumps({k: v for k, v in r.items() if k != "metrics"}).decode())
    hand, sharded = r["metrics"]["hand"], r["metrics"]["distributed"]
    for key in ("loss", "grad_norm", "tis_mean", "pg_clipfrac"):
        key = next(k for k in hand[0] if k.endswith(key))
        assert sharded[0][key] == pytest.approx(hand[0][key], rel=1e-4, abs=1e-6), key
        assert sharded[1][key] == pytest.approx(hand[1][key], rel=1e-3, abs=1e-5), key
    assert r["moved_1"] > 1e-3  # the step did something, so equal weights mean the same step
    assert r["hand_vs_distributed_1"] < 1e-5
    # Resumed from the folder saved after step 1: masters and Adam moments restored, so step 2 equals.
    assert r["resumed_steps"] == 1
    assert r["moved_2"] > 1e-4
    assert r["distributed2_vs_resumed2"] < 1e-6
    assert r["metrics"]["resumed"][0] == pytest.approx(sharded[1], rel=1e-5, abs=1e-7)
    assert r["optimizer_files"] == ["rank0.json", "rank0.safetensors"]


@pytest.mark.gpu
def test_the_built_in_task_learns_with_the_distributed_optimizer_in_bf16(tmp_path):
    records = _launch(
        tmp_path, "--trainer-device", "cuda", "--trainer-dtype", "bfloat16", "--use-distributed-optimizer"
    )
    first = sum(r["rollout/raw_reward"] for r in records[:3]) / 3
    last = sum(r["rollout/raw_reward"] for r in records[-3:]) / 3
    print(f"distributed optimizer, bf16: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.05, (first, last)
