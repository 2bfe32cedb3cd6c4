"""Controller CPU per trained sample with producers on Ray, W = 1, 2, 4, against the local mode.

    python -m benchmarks.ray_producers [--steps 6] [--batch 16] [--group 8] [--tokens 1024]
        [--producers 1 2 4] [--stores memory,lmdb-sync] [--batches paced,mailbox] [--repeats 1]

The engine is the instant engine (`engines/instant.py`) in its own process: it answers at
once, so every CPU second is the pipeline's. The trainer does nothing. What is measured is the
controller process's CPU time (all its threads: the event loop, the store's writer thread, Ray's
driver threads) per trained sample, from the end of step 0 to the end of the last step. With
`local` the controller does everything (HTTP, parsing, reward, filter); with Ray producers it
hands groups out, takes results back as codec bytes and commits them. The CPU of the producers'
processes and of the mailbox's is measured the same way (`/proc`), in columns of their own.
Producers share this machine's cores, so wall-clock rates with W > cores say little; CPU per
sample is the figure.

Axes, run side by side in one process: `--stores` (memory; lmdb-sync is LMDB with fsync on, in a
temporary folder), `--batches` (`single`: `RolloutPlan.store_batch=1`, one store call and one Ray
call per group, the path before batching; `batch`: 64, whatever is waiting goes in one call, each
producer's results taken back as soon as it has one; `paced` (`--no-producer-mailbox`): as `batch`,
with the results of all producers taken back at most `--producer-takes-per-second` (100) times a
second, so a busy run's calls carry more groups, not more calls; `mailbox`, the default path: as
`paced`, through the producers' mailbox, one call each way for all producers). For each W and
store, the batches alternate, `--repeats` times; the table shows the median. Only Ray and this
package are needed, so the same command runs on a bigger machine, e.g. `--producers 1 2 4 8`.

`--cpu N` puts the controller (every thread of this process) on CPU N and everything it starts
(Ray, the mailbox, the producers, the engine) on the other cores: then `samples/s` is what one
controller core sustains, and `cpu share` near 1 says that core is what limits the run (issue 13's
"5,000 samples/s on one core with LMDB synced", side by side with the local mode on that core).
`--gc` sets the controller's collector as the launcher does (the default) or leaves CPython's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio

from benchmarks.controller_overhead import NullTrainer, reward, stat_cpu_seconds, workload
from launch.builtin_engine import start_engine
from launch.gc_settings import settle_gc
from launch.ray_cluster import RaySettings, group_slots, open_ray_producers
from launch.ray_producer import ProducerSpec
from launch.ray_producers import DEFAULT_TAKES_PER_SECOND
from pipeline import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from stages.sglang_client import EngineFleet
from storage import AsyncStore, LmdbStore, MemoryStore

# (RolloutPlan.store_batch, RayProducers takes_per_second, through the mailbox): `mailbox` is the default path.
BATCHES = {
    "single": (1, math.inf, False),
    "batch": (64, math.inf, False),
    "paced": (64, DEFAULT_TAKES_PER_SECOND, False),
    "mailbox": (64, DEFAULT_TAKES_PER_SECOND, True),
}
STORES = ("memory", "lmdb-sync")


def open_store(kind: str, folder: Path) -> Any:
    if kind == "memory":
        return MemoryStore()
    if kind == "lmdb-sync":
        return LmdbStore(folder / "store", sync=True)
    raise ValueError(f"--stores: {kind!r} is not one of {', '.join(STORES)}")


async def run_one(
    producers: int, store_kind: str, batch: str, args: argparse.Namespace, fleet: EngineFleet, work: Path
) -> dict[str, float]:
    # Each run starts its own clock at version 0. The instant engine holds no weights, so its label
    # is all there is to reset; a real engine is never relabelled (pipeline/run/run_engines.py).
    await fleet.update_weight_version("0")
    plan = RolloutPlan(
        mode=args.mode,
        batch_size=args.batch,
        n_samples=args.group,
        num_steps=args.steps,
        slots=args.slots,
        max_response_len=args.tokens,
        sampling_params={"temperature": 1.0},
        store_batch=BATCHES[batch][0],
    )
    folder = Path(tempfile.mkdtemp(prefix=f"ray-producers-{store_kind}-", dir=work))
    store = AsyncStore(open_store(store_kind, folder))
    marks: list[tuple[float, float]] = []
    last: dict[str, Any] = {}

    threads: list[dict[str, float]] = []  # CPU by thread at the first step and at the latest

    others: list[dict[str, float]] = []  # CPU of the mailbox and the producers at the first step and the last

    def on_step(record: dict[str, Any]) -> None:
        marks.append((time.perf_counter(), time.process_time()))
        if producers and len(marks) in (1, args.steps):
            # Only where the figures are read: a scan of /proc runs in this process, whose CPU is measured.
            others.append(actor_cpu())
        if args.threads:
            now = thread_cpu()
            threads[:] = [threads[0] if threads else now, now]
        last.update(record)

    async def go(factory: Any = None) -> None:
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

    try:
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

            _, takes, mailbox = BATCHES[batch]
            takes = args.takes_per_second if takes == DEFAULT_TAKES_PER_SECOND else takes
            settings = RaySettings(
                None, producers, lease_seconds=30.0, deadline_seconds=60.0, takes_per_second=takes, mailbox=mailbox
            )
            async with open_ray_producers(
                settings, spec_for, store=store, n_samples=plan.n_samples, store_batch=plan.store_batch
            ) as make:
                await go(make)
        transactions = store.statistics().transactions
    finally:
        await store.aclose()
        shutil.rmtree(folder, ignore_errors=True)
    (w0, p0), (w1, p1) = marks[0], marks[-1]
    if threads:
        samples_run = (len(marks) - 1) * args.batch * args.group
        spent = {name: 1000 * (cpu - threads[0].get(name, 0.0)) / samples_run for name, cpu in threads[1].items()}
        top = sorted(spent.items(), key=lambda kv: -kv[1])[:8]
        print("    cpu-ms/sample by thread: " + ", ".join(f"{name} {ms:.3f}" for name, ms in top if ms > 0.001))
    samples = (len(marks) - 1) * args.batch * args.group
    spent = {k: 1000 * (others[-1].get(k, 0.0) - others[0].get(k, 0.0)) / samples for k in ACTORS} if others else {}
    return {
        "samples/s": samples / (w1 - w0),
        "cpu-ms/sample": 1000 * (p1 - p0) / samples,
        # The controller's CPU over the wall clock: near 1 with `--cpu`, its one core is what limits the run.
        "cpu share": (p1 - p0) / (w1 - w0),
        # The other side of the calls, measured the same way: the mailbox's process, and the producers'
        # together (their parsing and rewards, which the local mode does on the controller).
        "mailbox ms": spent.get("Mailbox", 0.0),
        "producers ms": spent.get("ProducerActor", 0.0),
        # Store transactions per group trained (whole run): what the batched moves cut.
        "txn/group": transactions / (args.steps * args.batch),
        # Groups per Ray call (whole run): 1 when nothing waits, growing as the controller gets busy.
        "per submit": last.get("producers/groups_per_submit", 0.0),
        "per take": last.get("producers/results_per_take", 0.0),
    }


def pin_process(cpu: int) -> None:
    """Every thread of this process onto `cpu` (the event loop, the store's writer, Ray's driver
    threads); threads started later inherit it from the thread that starts them."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(int(task.name), {cpu})


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed by thread name (Linux /proc; Ray's own
    threads included, which no Python profiler sees)."""
    python_names = {t.native_id: t.name.split(" ")[0] for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = python_names.get(int(task.name)) or (task / "comm").read_text().strip()
            cpu = stat_cpu_seconds(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + cpu
    return out


ACTORS = ("Mailbox", "ProducerActor")


def actor_cpu() -> dict[str, float]:
    """CPU seconds so far of this machine's Ray actor processes, summed by actor class (Ray titles an
    actor's worker `ray::Class` or `ray::Class.method`)."""
    out: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if not title.startswith("ray::"):
                continue
            cpu = stat_cpu_seconds(proc / "stat")
        except OSError:  # the process ended meanwhile
            continue
        actor = title.removeprefix("ray::").split(".")[0].split(" ")[0]
        if actor in ACTORS:
            out[actor] = out.get(actor, 0.0) + cpu
    return out


async def idle_cost(producers: int, args: argparse.Namespace, fleet: EngineFleet, work: Path) -> float:
    """The controller's CPU share (cores) while W started producers sit idle for `--idle` seconds:
    what Ray's driver spends per producer (connections, heartbeats, leases) with no work at all."""
    store = AsyncStore(MemoryStore())
    spec = ProducerSpec(
        name="idle",
        engine_urls=(fleet.worker_urls[0],),
        router_url=None,
        group_slots=1,
        n_samples=args.group,
        sampling_params={},
        max_response_len=args.tokens,
        reward_path="benchmarks.controller_overhead:reward",
    )
    settings = RaySettings(None, producers, lease_seconds=30.0, deadline_seconds=60.0)
    try:
        async with open_ray_producers(
            settings, lambda i, _: dataclasses.replace(spec, name=f"idle-{i}"), store=store, n_samples=args.group
        ):
            await anyio.sleep(1.0)  # start-up settles
            w0, p0 = time.perf_counter(), time.process_time()
            await anyio.sleep(args.idle)
            return (time.process_time() - p0) / (time.perf_counter() - w0)
    finally:
        await store.aclose()


async def main(args: argparse.Namespace) -> None:
    import ray

    stores = args.stores.split(",")
    batches = args.batches.split(",")
    for b in batches:
        if b not in BATCHES:
            raise SystemExit(f"--batches: {b!r} is not one of {', '.join(BATCHES)}")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.cpu >= 0:
        # Everything started from here (Ray's processes, the producers, the mailbox, the engine)
        # inherits this mask and stays off the controller's core; the controller moves onto it below.
        os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - {args.cpu})
    # address="local": a cluster of its own, never one that happens to run on this machine
    ray.init(address="local", num_cpus=max(args.producers), include_dashboard=False, log_to_driver=False)
    work = Path(tempfile.mkdtemp(prefix="ray-producers-"))
    engine = await start_engine("instant", module="engines.instant", extra_args=["--tokens", str(args.tokens)])
    if args.cpu >= 0:
        pin_process(args.cpu)
    if args.gc == "launcher":
        settle_gc()  # as `pipeline.run.cli` does once start-up is done (and each producer does in its actor)
    rows: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    load_before = os.getloadavg()
    try:
        async with engine, EngineFleet([engine.url], concurrency=args.slots) as fleet:
            for w in ((0,) if args.local else ()) + tuple(args.producers):
                for store_kind in stores:
                    for _ in range(args.repeats):
                        for b in batches:  # interleaved: single and batch see the same machine
                            result = await run_one(w, store_kind, b, args, fleet, work)
                            rows.setdefault((store_kind, b, w), []).append(result)
                            print(f"  {store_kind} {b} W={w or 'local'}: {result}", flush=True)
            idle = {w: await idle_cost(w, args, fleet, work) for w in args.producers} if args.idle > 0 else {}
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    print(
        f"\n{args.mode}, {args.steps} steps x {args.batch} groups x {args.group} samples x {args.tokens} tokens, "
        f"{args.slots} slots, {os.cpu_count()} cores, median of {args.repeats}; "
        + (f"controller on CPU {args.cpu}, everything else off it; " if args.cpu >= 0 else "")
        + f"gc {args.gc}; "
        + f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min)"
    )
    print(
        f"{'store':>10} {'batches':>8} {'producers':>10} {'samples/s':>11} {'cpu-ms/sample':>14} {'cpu share':>10} "
        f"{'txn/group':>10} "
        f"{'groups/submit':>14} {'results/take':>13} {'mailbox ms':>11} {'producers ms':>13}"
    )
    for (store_kind, b, w), results in rows.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(
            f"{store_kind:>10} {b:>8} {'local' if w == 0 else w:>10} {med['samples/s']:>11,.1f} "
            f"{med['cpu-ms/sample']:>14.3f} {med['cpu share']:>10.2f} {med['txn/group']:>10.2f} "
            + (
                f"{'-':>14} {'-':>13} {'-':>11} {'-':>13}"
                if w == 0
                else f"{med['per submit']:>14.2f} {med['per take']:>13.2f} {med['mailbox ms']:>11.3f} "
                f"{med['producers ms']:>13.3f}"
            )
        )
    for w, share in idle.items():
        print(f"idle, {w} producers: controller CPU {share:.3f} cores over {args.idle:g} s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--producers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--stores", default="memory,lmdb-sync", help=f"comma-separated, of {', '.join(STORES)}")
    p.add_argument(
        "--batches",
        default="paced,mailbox",
        help="comma-separated: single (store_batch=1), batch (64), paced (64, results taken back at most "
        f"{DEFAULT_TAKES_PER_SECOND:g} times a second), mailbox (as paced, through the producers' mailbox: "
        "one call each way for all producers; the default path)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--mode",
        choices=["sync", "async"],
        default="sync",
        help="async: no round ends, so the calls each producer makes per step do not grow with W",
    )
    p.add_argument("--takes-per-second", type=float, default=DEFAULT_TAKES_PER_SECOND, help="of the paced path")
    p.add_argument("--no-local", dest="local", action="store_false", help="leave out the local mode (for a profile)")
    p.add_argument(
        "--cpu",
        type=int,
        default=-1,
        help="pin the controller (every thread) to this CPU and everything else off it: its samples/s is "
        "then what one controller core sustains (-1: no pinning)",
    )
    p.add_argument(
        "--gc",
        choices=["launcher", "python"],
        default="launcher",
        help="the controller's collector: launcher (as `python -m pipeline.launch` sets it: start-up heap "
        "frozen, gen-0 threshold 100,000) or python (CPython's defaults)",
    )
    p.add_argument("--threads", action="store_true", help="print each run's CPU per sample by thread name (Linux)")
    p.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="also measure the controller's CPU share with W producers started and no work, over this many seconds",
    )
    anyio.run(main, p.parse_args())
