"""Publish stall: how long admission stays closed per publish beyond the weight transfer, per pause mode.

    python -m benchmarks.publish_stall [--steps 8] [--time-scale 0.05] [--weight-update-time 2.0]

Async mode under load, against the simulated engine subprocess (`engines.sim`), whose weight
update takes a known `--weight-update-time` engine seconds. The figures are the controller's own
records, per step: `time/publish_gate_closed` (the clock's gate, from closing admission to opening
it) minus `time/publish_update` (the `update_weights_from_disk` call). What is left is coordination:
pause, flush, continue, and whatever waits between them. Printed per pause mode: median and max of
that excess in wall ms and in engine ms (wall / time scale), and where it went: the median wall ms
of each engine call the publish made (timed by a thin wrapper around the fleet).

Target (issue 5): under 50 ms beyond the weight transfer in abort mode.

Reading the engine-ms columns: only time the simulator models (a forward that a pause waits for,
the weight update) scales with `--time-scale`; CPU work (the engine rendering every aborted answer,
the controller parsing them, HTTP round trips) takes the same wall time at any scale, so dividing
it by the scale inflates it. Run two scales: what stays put in wall ms is CPU, not engine time.
In abort mode the pause returns only once every aborted `/generate` has its answer, so it grows
with the requests in flight (`--slots`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import structlog

from benchmarks.modes_sim import SimulatedTrainer, reward, workload
from launch.builtin_engine import start_engine
from pipeline import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from stages.sglang_client import PAUSE_MODES, EngineFleet
from storage import AsyncStore, MemoryStore

CALLS = ("pause", "flush_cache", "update_weights_from_disk", "continue_generation")


class TimedFleet:
    """The fleet, with the wall time of each publish call recorded (generation passes straight through)."""

    def __init__(self, fleet: EngineFleet) -> None:
        self._fleet = fleet
        self.calls: dict[str, list[float]] = defaultdict(list)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        return await self._fleet.generate(*args, **kwargs)

    async def abort_all(self) -> None:
        await self._fleet.abort_all()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._fleet, name)
        if name not in CALLS:
            return method

        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                self.calls[name].append(time.perf_counter() - t0)

        return timed


async def run_mode(pause_mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    scale = args.time_scale
    engine = await start_engine(
        "simulated", module="engines.sim", max_running_requests=args.slots,
        extra_args=["--time-scale", str(scale), "--weight-update-time", str(args.weight_update_time)],
    )  # fmt: skip
    plan = RolloutPlan(
        mode="async", batch_size=args.batch, n_samples=args.group, num_steps=args.steps, slots=args.slots,
        max_response_len=args.max_len, sampling_params={"temperature": 1.0}, prefetch=args.batch,
        pause_mode=pause_mode,
    )  # fmt: skip
    async with engine, EngineFleet([engine.url], concurrency=args.slots) as fleet:
        timed = TimedFleet(fleet)
        sink = MetricsSink(None)
        await run_pipeline(
            plan,
            engines=timed,
            store=AsyncStore(MemoryStore()),
            trainer=SimulatedTrainer(args.train_time * scale, work),
            dataset=workload(4096, args.prompt_len, 0),
            reward_fn=reward,
            filter_fn=None,
            weights_dir=work,
            metrics=sink,
        )
    excess = [r["time/publish_gate_closed"] - r["time/publish_update"] for r in sink.records]
    updates = [r["time/publish_update"] for r in sink.records]
    in_flight = [r["queue/in_flight"] for r in sink.records]
    return {"excess": excess, "update": updates, "calls": dict(timed.calls), "in_flight": in_flight}


async def main(args: argparse.Namespace) -> None:
    work = Path(args.work)
    await anyio.Path(work).mkdir(parents=True, exist_ok=True)
    scale = args.time_scale
    print(
        f"async, {args.steps} steps of {args.batch} groups x {args.group} samples, {args.slots} slots; "
        f"weight update {args.weight_update_time} engine s, time scale {scale} (1 engine ms = {scale:g} wall ms)"
    )
    head = f"{'pause mode':11}" + "".join(
        f"{c:>12}" for c in ("excess med", "excess max", "engine med", "engine max", "update med")
    )
    head += "".join(f"{c.split('_')[0][:8]:>10}" for c in CALLS)
    print("excess = gate closed - weight update, wall ms (engine ms = wall / scale); per call: median wall ms")
    print(head, flush=True)
    for mode in args.modes.split(","):
        r = await run_mode(mode, args, work)
        ex = [x * 1e3 for x in r["excess"]]
        med, mx = statistics.median(ex), max(ex)
        row = f"{mode:11}{med:>12.1f}{mx:>12.1f}{med / scale:>12.1f}{mx / scale:>12.1f}"
        row += f"{statistics.median(r['update']) * 1e3:>12.1f}"
        for c in CALLS:
            xs = r["calls"].get(c)
            row += f"{statistics.median(xs) * 1e3:>10.1f}" if xs else f"{'-':>10}"
        print(row, flush=True)
        if args.verbose:
            print(f"  per step excess ms: {[round(x, 1) for x in ex]}; in flight: {r['in_flight']}")
            print(f"  calls ms: { {k: [round(x * 1e3, 1) for x in v] for k, v in r['calls'].items()} }")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(PAUSE_MODES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="groups per step")
    parser.add_argument("--group", type=int, default=8, help="samples per group")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--train-time", type=float, default=10.0, help="engine seconds per training step")
    parser.add_argument("--weight-update-time", type=float, default=2.0, help="engine seconds per weight update")
    parser.add_argument("--time-scale", type=float, default=0.05, help="wall seconds per engine second")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--work", default=tempfile.gettempdir() + "/bench-publish-stall")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    anyio.run(main, parser.parse_args())
