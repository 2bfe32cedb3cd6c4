"""Controller CPU per trained sample with producers on Ray, W = 1, 2, 4, against the local mode.

    python -m benchmarks.ray_producers [--steps 6] [--batch 16] [--group 8] [--tokens 1024] [--producers 1 2 4]

The engine is the instant engine (`launch/engines/instant.py`) in its own process: it answers at
once, so every CPU second is the pipeline's. The trainer does nothing. What is measured is the
controller process's CPU time (all its threads: the event loop, the store's writer thread, Ray's
driver threads) per trained sample, from the end of step 0 to the end of the last step. With
`local` the controller does everything (HTTP, parsing, reward, filter); with Ray producers it
hands groups out, takes results back as codec bytes and commits them. Producers share this
machine's cores, so wall-clock rates with W > cores say little; CPU per sample is the figure.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import anyio

from benchmarks.controller_overhead import NullTrainer, reward, workload
from launch.engine_process import start_engine
from launch.ray_cluster import RaySettings, group_slots, open_ray_producers
from launch.ray_producer import ProducerSpec
from pipeline.controller import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from stages.sglang import EngineFleet
from storage import AsyncStore, MemoryStore


async def run_one(producers: int, args: argparse.Namespace, fleet: EngineFleet, work: Path) -> dict[str, float]:
    await fleet.update_weight_version("0")
    plan = RolloutPlan(
        mode="sync",
        batch_size=args.batch,
        n_samples=args.group,
        num_steps=args.steps,
        slots=args.slots,
        max_response_len=args.tokens,
        sampling_params={"temperature": 1.0},
    )
    store = AsyncStore(MemoryStore())
    marks: list[tuple[float, float]] = []

    def on_step(record: dict) -> None:
        marks.append((time.perf_counter(), time.process_time()))

    async def go(factory=None) -> None:
        await run_pipeline(
            plan,
            engines=fleet,
            store=store,
            trainer=NullTrainer(work),
            dataset=workload(args.batch * (args.steps + 4), 128),
            reward_fn=reward,
            filter_fn=None,
            weights_dir=work,
            metrics=MetricsSink(None),
            on_step=on_step,
            producers=factory,
        )

    if producers == 0:
        await go()
    else:

        def spec_for(i: int, count: int) -> ProducerSpec:
            return ProducerSpec(
                name=f"producer-{i}",
                engine_urls=(fleet.worker_urls[0],),
                router_url=None,
                group_slots=group_slots(plan.slots, plan.n_samples, count)[i],
                n_samples=plan.n_samples,
                sampling_params=plan.sampling_params,
                max_response_len=plan.max_response_len,
                reward_path="benchmarks.controller_overhead:reward",
            )

        settings = RaySettings(None, producers, lease_seconds=30.0, deadline_seconds=60.0)
        async with open_ray_producers(settings, spec_for, store=store, n_samples=plan.n_samples) as make:
            await go(make)
    (w0, p0), (w1, p1) = marks[0], marks[-1]
    samples = (len(marks) - 1) * args.batch * args.group
    return {"samples/s": samples / (w1 - w0), "controller cpu-ms/sample": 1000 * (p1 - p0) / samples}


async def main(args: argparse.Namespace) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=max(args.producers), include_dashboard=False, log_to_driver=False)
    work = Path(tempfile.mkdtemp(prefix="ray-producers-"))
    engine = await start_engine("instant", module="launch.engines.instant", extra_args=["--tokens", str(args.tokens)])
    rows = []
    try:
        async with engine, EngineFleet([engine.url], concurrency=args.slots) as fleet:
            for w in (0, *args.producers):
                rows.append((w, await run_one(w, args, fleet, work)))
    finally:
        ray.shutdown()
    print(
        f"{args.steps} steps x {args.batch} groups x {args.group} samples x {args.tokens} tokens, {args.slots} slots, "
        f"memory store, {os.cpu_count()} cores"
    )
    print(f"{'producers':>10} {'samples/s':>12} {'controller cpu-ms/sample':>26}")
    for w, r in rows:
        print(f"{'local' if w == 0 else w:>10} {r['samples/s']:>12,.1f} {r['controller cpu-ms/sample']:>26.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--producers", type=int, nargs="+", default=[1, 2, 4])
    anyio.run(main, p.parse_args())
