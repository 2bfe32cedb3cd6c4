"""Opt-in GPU checks of the megatron backend: `pytest -m gpu tests/test_megatron_gpu.py -s` on a GPU host.

Same checks as the CPU ones, on CUDA/ROCm with NCCL: parity of one step with the torch trainer
(fp32), the built-in task end to end through `python -m pipeline.launch --train-backend megatron
--trainer-device cuda` in fp32 and in bf16 (`--trainer-dtype bfloat16`), and the step time of both
backends on a Qwen3-0.6B-shaped model, bf16 then fp32 (printed; copy it into docs/benchmarks/09-trainer-backends.md).
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_built_in_task_learns_with_megatron_on_the_gpu(tmp_path, dtype):
    records = _launch(tmp_path, "--trainer-device", "cuda", "--trainer-dtype", dtype)
    first = sum(r["rollout/raw_reward"] for r in records[:3]) / 3
    last = sum(r["rollout/raw_reward"] for r in records[-3:]) / 3
    steps = [r["perf/train_time"] for r in records]
    print(
        f"megatron on GPU, {dtype}: reward {first:.3f} -> {last:.3f}; train+save per step "
        f"{sum(steps) / len(steps):.3f}s (median {sorted(steps)[len(steps) // 2]:.3f}s); "
        f"optimizer steps per batch {records[0]['train/optimizer_steps']:.0f}; "
        f"logprob abs diff max {max(r['train/train_rollout_logprob_abs_diff'] for r in records):.2e}"
    )
    assert last > first + 0.05, (first, last)
    # bf16: the trainer computes in bf16, the engine samples from the fp32 masters it publishes.
    tolerance = 0.05 if dtype == "bfloat16" else 1e-3
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < tolerance


def test_the_moe_toy_learns_with_megatron_on_the_gpu_replaying_the_engines_routes(tmp_path):
    """Megatron's MoE layers on CUDA, each router replaying the route the engine's forward chose (R3):
    the trainer's log-probs of the rollout tokens are the engine's up to fp32 noise (without the
    replay a router whose top two experts nearly tie picks the other one and a token moves by far
    more), and the reward rises as on the CPU (tests/test_moe_launch.py)."""
    records = _launch(
        tmp_path, "--num-rollout", "30", "--trainer-device", "cuda", "--num-experts", "8", "--moe-router-topk", "2",
        "--use-rollout-routing-replay",
    )  # fmt: skip
    first = sum(r["rollout/raw_reward"] for r in records[:5]) / 5
    last = sum(r["rollout/raw_reward"] for r in records[-5:]) / 5
    worst = max(r["train/train_rollout_logprob_abs_diff"] for r in records)
    print(f"megatron MoE on GPU with R3: reward {first:.3f} -> {last:.3f}; logprob abs diff max {worst:.2e}")
    assert last > first + 0.1, (first, last)
    # The engine samples on the CPU, the trainer computes on the GPU: different kernels, same routes.
    assert worst < 1e-3


def test_step_time_of_both_backends_on_a_0_6b_model():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-m", "benchmarks.trainer_backends", "--device", "cuda", "--steps", "3"]
    done = subprocess.run(
        [*command, "--dtype", "bfloat16,float32"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [orjson.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]
    for result in results:
        print("trainer backends:", orjson.dumps(result).decode())
        assert result["torch"]["median_s"] > 0 and result["megatron"]["median_s"] > 0
    assert [r["dtype"] for r in results] == ["bfloat16", "float32"]
