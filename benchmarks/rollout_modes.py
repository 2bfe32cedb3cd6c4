"""Sync vs sync + partial vs async rollout, side by side in one process, on the built-in engine.

    python -m benchmarks.rollout_modes [--steps 6] [--batch 8] [--group 8] [--max-len 128]

Both modes run the real pipeline over real HTTP against the same built-in engine, the same tiny
model and the same prompts. The trainer is a stand-in that republishes the base weights: it keeps
the policy (and so the long-tailed response lengths of the random model) identical across modes,
so the only difference measured is the rollout policy. Reported per mode: accepted groups per
second (whole steps: rollout and publish), generated tokens per second, the ratio to sync,
engine slot occupancy, off-policy token share and the largest staleness.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path

import anyio
import structlog

from launch.builtin_engine import start_engines
from pipeline import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import toy_dataset, toy_reward
from stages.sglang_client import EngineFleet
from storage import AsyncStore, MemoryStore


class RepublishingTrainer:
    """Trains nothing; hands the base weights back so every mode samples from the same policy."""

    def __init__(self, base: Path) -> None:
        self._base = base

    def train_step(self, batch):
        return {}

    def save_weights(self, path: Path) -> Path:
        if not path.exists():
            shutil.copytree(self._base, path)
        return path


async def measure(name: str, plan: RolloutPlan, fleet: EngineFleet, model: Path, work: Path) -> dict[str, float]:
    await fleet.update_weights_from_disk(str(model), weight_version="0")
    sink = MetricsSink(None)
    started = time.perf_counter()
    await run_pipeline(
        plan,
        engines=fleet,
        store=AsyncStore(MemoryStore()),
        trainer=RepublishingTrainer(model),
        dataset=toy_dataset(256, seed=1),
        reward_fn=toy_reward,
        filter_fn=None,
        weights_dir=work / name,
        metrics=sink,
    )
    wall = time.perf_counter() - started
    # End to end per step (the stand-in trainer takes no time, so this is rollout plus publishing).
    rollout = sum(r["perf/step_time"] for r in sink.records)
    groups = plan.batch_size * len(sink.records)
    tokens = sink.records[-1]["tokens/generated_total"]
    return {
        "groups_per_s": groups / rollout,
        "tokens_per_s": tokens / rollout,
        "rollout_s": rollout,
        "wall_s": wall,
        "busy": sum(r["engine/busy_frac"] * r["perf/step_time"] for r in sink.records)
        / sum(r["perf/step_time"] for r in sink.records),
        "off_policy": sum(r["off_policy_token_frac"] for r in sink.records) / len(sink.records),
        "stale_max": max(r["staleness/max"] for r in sink.records),
    }


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-modes-"))
    try:
        model = make_model_folder(work / "model", seed=0)
        (engine,) = await start_engines(1, model, max_running_requests=args.slots)
        async with engine, EngineFleet([engine.url], concurrency=args.slots) as fleet:
            common = dict(
                batch_size=args.batch,
                n_samples=args.group,
                num_steps=args.steps,
                slots=args.slots,
                max_response_len=args.max_len,
                sampling_params={"temperature": 1.0},
                seed=3,
            )
            plans = {
                "sync": RolloutPlan(mode="sync", **common),
                "sync+partial": RolloutPlan(mode="sync", partial=True, over_sampling=args.batch * 2, **common),
                "async": RolloutPlan(mode="async", **common),
            }
            results = {name: await measure(name, plan, fleet, model, work) for name, plan in plans.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["sync"]["groups_per_s"]
    print(
        f"{'mode':14} {'groups/s':>9} {'tokens/s':>9} {'ratio':>6} {'engine busy':>11} {'off-policy':>10} "
        f"{'stale max':>9} {'rollout s':>9}"
    )
    for name, r in results.items():
        print(
            f"{name:14} {r['groups_per_s']:9.2f} {r['tokens_per_s']:9.0f} {r['groups_per_s'] / base:6.2f} "
            f"{r['busy']:11.2f} {r['off_policy']:10.2f} {r['stale_max']:9d} {r['rollout_s']:9.1f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="groups per step")
    parser.add_argument("--group", type=int, default=8, help="samples per group")
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=64)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    anyio.run(main, parser.parse_args())
