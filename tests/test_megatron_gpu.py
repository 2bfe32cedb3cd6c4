"""Opt-in GPU checks of the megatron backend: `pytest -m gpu tests/test_megatron_gpu.py -s` on a GPU host.

Same checks as the CPU ones, on CUDA/ROCm with NCCL: parity of one step with the torch trainer
(fp32), the built-in task end to end through `python -m pipeline.launch --train-backend megatron
--trainer-device cuda`, and the step time of both backends on a Qwen3-0.6B-shaped model
(printed; copy it into BENCHMARKS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest

from tests.test_megatron import ROOT, _check, _launch

pytestmark = pytest.mark.gpu


def test_one_step_on_the_gpu_matches_the_torch_trainer(tmp_path):
    import torch

    assert torch.cuda.is_available(), "torch sees no GPU"
    r = _check(tmp_path, 1, 1, 3, "cuda")
    for key in ("loss", "grad_norm", "tis_mean", "pg_clipfrac"):
        assert r["megatron"][key] == pytest.approx(r["torch"][key], rel=1e-3, abs=1e-5), key
    assert r["logprob_diff"] < 1e-3 and r["weights_diff"] < 1e-3


def test_the_built_in_task_learns_with_megatron_on_the_gpu(tmp_path):
    records = _launch(tmp_path, "--trainer-device", "cuda")
    first = sum(r["reward/mean"] for r in records[:3]) / 3
    last = sum(r["reward/mean"] for r in records[-3:]) / 3
    print(
        f"megatron on GPU: reward {first:.3f} -> {last:.3f}; "
        f"train step {sum(r['time/train'] for r in records) / len(records):.3f}s"
    )
    assert last > first + 0.05, (first, last)
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3


def test_step_time_of_both_backends_on_a_0_6b_model():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.trainer_backends", "--device", "cuda", "--steps", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = orjson.loads(done.stdout.strip().splitlines()[-1])
    print("trainer backends:", result)
    assert result["torch"]["median_s"] > 0 and result["megatron"]["median_s"] > 0
