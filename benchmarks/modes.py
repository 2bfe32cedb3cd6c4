"""Sync vs sync + partial vs async rollout on the simulated engine: one run, same workload.

    python -m benchmarks.modes [--seeds 3] [--steps 10] [--time-scale 0.02] [--timeline-dir DIR] [--only NAME]
    python -m benchmarks.modes --engine builtin [--device cuda] [--model-size 0.6b] [--quick]  (modes_builtin.py)

Every mode runs the real pipeline over real HTTP against a fresh simulated engine subprocess with
the same GPU-like decode-time model, the same long-tailed response lengths, the same prompts and
the same simulated trainer (a fixed training time per step, then a real weight publish). Times
below are *engine* seconds (wall seconds divided by the time scale), so the figures read as they
would on the modelled GPU. Each mode runs once per seed; the table shows medians.

Columns:
- groups/s, tokens/s: accepted groups and trained response tokens per engine second, end to end
  (rollout, training and publishing all included: that is what a user waits for);
- ratio: groups/s over sync's;
- busy: the share of engine time spent in forward passes (1.0 is the physical limit);
- off-pol: share of trained tokens produced by an older policy version than the one trained;
- stale mean/max: staleness of trained groups in versions;
- wasted: generated tokens neither trained nor kept in the store for later (lost work).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import zlib
from pathlib import Path

import aiohttp
import anyio
import orjson
import structlog

from core.types import PromptTask
from launch.engine_process import start_engine
from pipeline import RolloutPlan, run_pipeline
from pipeline.events import EventLog
from pipeline.metrics import MetricsSink
from pipeline.timeline import render_timeline, slot_busy_fraction, work_span
from stages.sglang import EngineFleet
from storage import AsyncStore, GroupState, MemoryStore


class SimulatedTrainer:
    """Takes `seconds` of (scaled) time per step; the weights it publishes are a placeholder path."""

    def __init__(self, seconds: float, weights: Path) -> None:
        self._seconds = seconds
        self._weights = weights

    def train_step(self, batch):
        time.sleep(self._seconds)  # runs on a worker thread: this *is* the modelled training time
        return {}

    def save_weights(self, path: Path) -> Path:
        return self._weights


def reward(task, sample) -> float:
    return (zlib.crc32(bytes(str(sample.response_ids[-4:]), "ascii")) % 1000) / 1000.0


def workload(n: int, prompt_len: int, seed: int) -> list[PromptTask]:
    return [
        PromptTask(
            index=i,
            prompt_ids=tuple(1000 + (zlib.crc32(f"{seed}:{i}:{j}".encode()) % 50000) for j in range(prompt_len)),
        )
        for i in range(n)
    ]


async def sim_stats(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/sim/stats") as r:
        return orjson.loads(await r.read())


async def run_mode(name: str, plan: RolloutPlan, args: argparse.Namespace, seed: int, work: Path) -> dict:
    scale = args.time_scale
    staged = ["--staged-weight-updates"] if plan.overlap_publish else []
    engine = await start_engine(
        "simulated",
        module="engines.sim",
        max_running_requests=args.slots,
        extra_args=["--time-scale", str(scale), "--random-seed", str(seed), *staged, *getattr(args, "sim_flags", [])],
    )
    async with engine, EngineFleet([engine.url], concurrency=args.slots) as fleet:
        store = MemoryStore()
        sink = MetricsSink(None)
        events = EventLog(None)
        before = await sim_stats(engine.url)
        t0 = time.perf_counter()
        await run_pipeline(
            plan,
            engines=fleet,
            store=AsyncStore(store),
            trainer=SimulatedTrainer(args.train_time * scale, work),
            dataset=workload(4096, args.prompt_len, seed),
            reward_fn=reward,
            filter_fn=None,
            weights_dir=work,
            metrics=sink,
            events=events,
        )
        wall = time.perf_counter() - t0
        after = await sim_stats(engine.url)
    engine_seconds = wall / scale
    if args.timeline_dir and seed == 0:
        out = Path(args.timeline_dir) / f"timeline-{name.replace(' ', '').replace(',', '-').replace('<=', 'le')}.html"
        out.parent.mkdir(parents=True, exist_ok=True)
        title = f"{name}: {plan.num_steps} steps (wall seconds, time scale {scale})"
        out.write_text(render_timeline(events.events, title=title))
    batches = [store.batch(s) for s in range(plan.num_steps)]
    trained = sum(s.response_len for b in batches for s in b.samples)
    kept = sum(
        s.response_len for st in (GroupState.PARTIAL, GroupState.READY) for g in store.groups(st) for s in g.samples
    )
    generated = after["generated_tokens"] - before["generated_tokens"]
    off = sum(r["off_policy_token_frac"] * r["batch/tokens"] for r in sink.records)
    return {
        "groups/s": plan.batch_size * plan.num_steps / engine_seconds,
        "tokens/s": trained / engine_seconds,
        "busy": (after["busy_time"] - before["busy_time"]) / max(after["engine_time"] - before["engine_time"], 1e-9),
        "off-pol": off / trained if trained else 0.0,
        "stale mean": statistics.fmean(r["staleness/mean"] for r in sink.records),
        "stale max": max(r["staleness/max"] for r in sink.records),
        "wasted": max(0, generated - trained - kept),
        "late": after.get("late_forwards", 0) - before.get("late_forwards", 0),
        "slot busy": slot_busy_fraction(events.events),  # as the built-in engine's benchmark measures it
        "span": work_span(events.events),
    }


def plans(args: argparse.Namespace) -> dict[str, RolloutPlan]:
    common = dict(
        batch_size=args.batch,
        n_samples=args.group,
        num_steps=args.steps,
        slots=args.slots,
        max_response_len=args.max_len,
        sampling_params={"temperature": 1.0},
        seed=1,
    )
    return {
        "sync": RolloutPlan(mode="sync", **common),
        "sync+partial": RolloutPlan(mode="sync", partial=True, over_sampling=2 * args.batch, **common),
        "sync+partial/slime": RolloutPlan(
            mode="sync", partial=True, over_sampling=2 * args.batch, fill_idle_slots=False, **common
        ),
        "async": RolloutPlan(mode="async", prefetch=args.batch, **common),
        "async, stale<=1": RolloutPlan(mode="async", prefetch=args.batch, max_staleness=1, **common),
        # The engine receives the weights beside decoding and swaps between two steps: no pause.
        "async, overlap": RolloutPlan(mode="async", prefetch=args.batch, overlap_publish=True, **common),
    }


async def main(args: argparse.Namespace) -> None:
    work = Path(args.work)
    await anyio.Path(work).mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for seed in range(args.seeds):
        for name, plan in plans(args).items():
            if args.only and name not in args.only:
                continue
            results.setdefault(name, []).append(await run_mode(name, plan, args, seed, work))
            print(f"seed {seed} {name}: {results[name][-1]['groups/s']:.3f} groups/s", flush=True)
    cols = ["groups/s", "tokens/s", "ratio", "busy", "off-pol", "stale mean", "stale max", "wasted"]
    print(
        f"\nmedians over {args.seeds} seeds; {args.steps} steps of {args.batch} groups x {args.group} samples, "
        f"max {args.max_len} tokens, {args.slots} slots, training {args.train_time}s per step (engine time)"
    )
    print(f"{'mode':20}" + "".join(f"{c:>11}" for c in cols))
    base = statistics.median(r["groups/s"] for r in results.get("sync", next(iter(results.values()))))
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        med["ratio"] = med["groups/s"] / base
        cells = (f"{med[c]:>11.3f}" if isinstance(med[c], float) else f"{med[c]:>11}" for c in cols)
        print(f"{name:20}" + "".join(cells))
    late = sum(r["late"] for runs in results.values() for r in runs)
    if late:
        print(f"note: the simulated engine ran late on {late} forwards; raise --time-scale for exact timing")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="groups per step")
    parser.add_argument("--group", type=int, default=8, help="samples per group")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=128, help="concurrent requests (C x E)")
    parser.add_argument("--train-time", type=float, default=10.0, help="engine seconds per training step")
    parser.add_argument("--time-scale", type=float, default=0.02, help="wall seconds per engine second")
    parser.add_argument("--work", default="/tmp/bench-modes")
    parser.add_argument("--only", action="append", default=[], help="run only this mode (repeatable)")
    parser.add_argument("--timeline-dir", default=None, help="write one timeline HTML per mode (seed 0)")
    parser.add_argument(
        "--engine",
        default="sim",
        choices=["sim", "builtin"],
        help="builtin: real engine, trainer and publishes (benchmarks/modes_builtin.py)",
    )
    parser.add_argument("--device", default="cpu", help="builtin: cpu, cuda or cuda:N")
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "0.6b"], help="builtin: the model")
    parser.add_argument("--quick", action="store_true", help="builtin: the tiny model, 3 short steps")
    parser.add_argument(
        "--length-tail",
        default=None,
        metavar="DIST",
        help="builtin: end samples at lengths from the simulated engine's distribution (e.g. lognormal:-1.9,0.8)",
    )
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    parsed = parser.parse_args()
    if parsed.engine == "builtin":
        from benchmarks.modes_builtin import main as builtin_main

        builtin_main(parsed)
    else:
        anyio.run(main, parsed)
