"""The mode comparison on the simulated engine: one run per mode and seed, the same workload
(`python -m benchmarks.modes`, which describes the columns). `modes_builtin` reuses `plans` and
`run_mode` for its simulated twin, and `publish_stall` the trainer, reward and workload.
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request
import zlib
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import anyio
import orjson

from core.types import PromptTask
from launch.builtin_engine import start_engine
from pipeline import RolloutPlan, run_pipeline
from pipeline.events import EventLog
from pipeline.metrics import MetricsSink
from pipeline.timeline import render_timeline, slot_busy_fraction, work_span
from stages.sglang_client import EngineFleet
from storage import AsyncStore, GroupState, MemoryStore

__all__ = ["SimulatedTrainer", "main", "plans", "reward", "run_mode", "workload"]


class SimulatedTrainer:
    """Takes `seconds` of (scaled) time per step, or `seconds[step]` given one per step (the last
    for any step beyond them); the weights it publishes are a placeholder path. With `slowdown`
    (the engine's URL and a factor) the simulated engine runs that much slower while it trains: a
    trainer on the engine's GPU (`/sim/slowdown`)."""

    def __init__(
        self, seconds: float | Sequence[float], weights: Path, *, slowdown: tuple[str, float] | None = None
    ) -> None:
        self._seconds = [seconds] if isinstance(seconds, int | float) else list(seconds)
        if not self._seconds:
            raise ValueError("SimulatedTrainer needs a training time, got an empty list")
        self._weights = weights
        self._slowdown = slowdown

    def train_step(self, batch):
        # Runs on a worker thread: this sleep *is* the modelled training time.
        seconds = self._seconds[min(batch.step, len(self._seconds) - 1)]
        if self._slowdown is None:
            time.sleep(seconds)
            return {}
        url, factor = self._slowdown
        _set_slowdown(url, factor)
        try:
            time.sleep(seconds)
        finally:
            _set_slowdown(url, 1.0)
        return {}

    def save_weights(self, path: Path) -> Path:
        return self._weights


def _set_slowdown(url: str, factor: float) -> None:
    body = orjson.dumps({"factor": factor})
    request = urllib.request.Request(f"{url}/sim/slowdown", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


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


async def run_mode(
    name: str,
    plan: RolloutPlan,
    args: argparse.Namespace,
    seed: int,
    work: Path,
    dataset: list[PromptTask] | None = None,
) -> dict:
    """One mode on a fresh simulated engine; `dataset` replaces the synthetic prompts (the twin
    gives the real run's, so that every sample draws the length it drew there)."""
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
            trainer=SimulatedTrainer(_scaled(args.train_time, scale), work, slowdown=_slowdown(args, engine.url)),
            dataset=dataset if dataset is not None else workload(4096, args.prompt_len, seed),
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
        stem = name.replace(" ", "").replace(",", "-").replace("<=", "le")
        page = Path(args.timeline_dir) / f"timeline-{stem}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        title = f"{name}: {plan.num_steps} steps (wall seconds, time scale {scale})"
        page.write_text(render_timeline(events.events, title=title))
        # The events beside the page: the twin's steps are compared with the real run's from these.
        page.with_name(f"events-{stem}.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events.events))
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
        # The first step holds the pipeline's fill (and async's first window): a twin that
        # extrapolates to more steps takes the rest as the steady step (benchmarks/cluster_twin.py).
        "first step s": sink.records[0]["perf/step_time"] / scale,
    }


def _slowdown(args: argparse.Namespace, url: str) -> tuple[str, float] | None:
    factor = getattr(args, "train_slowdown", 1.0)
    return (url, factor) if factor != 1.0 else None


def _scaled(seconds: float | Sequence[float], scale: float) -> float | list[float]:
    return seconds * scale if isinstance(seconds, int | float) else [t * scale for t in seconds]


def plans(args: argparse.Namespace) -> dict[str, RolloutPlan]:
    common = dict(
        batch_size=args.batch,
        n_samples=args.group,
        num_steps=args.steps,
        slots=args.slots,
        max_response_len=args.max_len,
        sampling_params={"temperature": 1.0},
        # The run's seed keys every sample's sampling seed, and so its drawn length: the twin of a
        # real run takes that run's seed (and prompts) to draw the same lengths.
        seed=getattr(args, "rollout_seed", 1),
    )
    return {
        "sync": RolloutPlan(mode="sync", **common),
        "sync+partial": RolloutPlan(mode="sync", partial=True, over_sampling=2 * args.batch, **common),
        "sync+partial/slime": RolloutPlan(
            mode="sync", partial=True, over_sampling=2 * args.batch, fill_idle_slots=False, **common
        ),
        "async": RolloutPlan(mode="async", prefetch=args.batch, **common),
        # The window ahead of the trainer always at its ceiling (`--no-async-pacing`).
        "async, unpaced": RolloutPlan(mode="async", prefetch=args.batch, pace_async=False, **common),
        "async, stale<=1": RolloutPlan(mode="async", prefetch=args.batch, max_staleness=1, **common),
        "async, stale<=2": RolloutPlan(mode="async", prefetch=args.batch, max_staleness=2, **common),
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
