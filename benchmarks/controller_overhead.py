"""Controller overhead: samples per second through the whole stage graph when the engine costs nothing.

    python -m benchmarks.controller_overhead [--steps 20] [--batch 64] [--group 8] [--tokens 1024]
        [--modes sync,async] [--stores memory,lmdb-sync,lmdb-nosync] [--profile /tmp/overhead.prof]
        [--clients aiohttp,lean] [--commits single,group] [--batches single,batch] [--repeats 3]

The engine is `engines.instant` in its own process (pinned to `--engine-cpu`): it answers
every `/generate` at once with exactly `--tokens` tokens and their log-probs, over real HTTP. The
trainer does nothing and publishes a placeholder path, which the instant engine accepts. So every
second measured is the controller's own: HTTP client, JSON parsing, building samples, the stages,
the store (memory, or LMDB with and without fsync), publishing. The controller is pinned to one
core (`--cpu`). This is the local mode, one process doing everything; the same measure with the
generating side on Ray producers (HTTP, parsing and rewards off the controller's core), the
`local` row beside it, is `python -m benchmarks.ray_producers --cpu N` (BENCHMARKS.md section 11).

Figures, per (mode, store), over the steps after the first (start-up excluded):
- samples/s and tokens/s in wall time;
- engine share: the engine process's CPU seconds per wall second (near 1.0: the engine, not the
  controller, is the bottleneck, and the figures are a lower bound);
- samples per CPU second of the controller process (all its threads): the same figure measured
  against the work done rather than the clock, so it holds even when other processes share the
  core; on an otherwise idle core the two agree.

Old and new paths side by side, in one run: `--clients` picks how `/generate` goes out (`aiohttp`,
today's client before issue 13, or `lean`, `stages.sglang_client.http1`), `--commits` how the LMDB store
commits (`single`: one transaction per store call, as before; `group`: group commit, see
`storage.async_store`), `--batches` how many groups one store call carries (`single`: one group
per `admit` and per `put_ready`, `RolloutPlan.store_batch=1`, as before; `batch`: the dispenser
admits every free ticket's group in one call and the collector stores every group already
waiting in one, `store_batch=64`). Every combination runs `--repeats` times, interleaved (each repeat runs
them all once, in turn), and the table gives medians, so a load that comes and goes on a shared
machine hits them alike.

`--gc` sets the collector as the launcher does once start-up is done (`launcher`, the default:
`launch.gc_settings.settle_gc`, start-up heap frozen and a gen-0 threshold of 100,000) or leaves
CPython's defaults (`python`; the tables in BENCHMARKS.md before the lean-path subsection ran so).

`--profile FILE` runs one extra (mode, store) under cProfile (`--profile-run`, default async with
LMDB sync=False): the event loop's thread and, separately, the store's worker thread (FILE.store).
The top 15 functions by cumulative time are printed; the full text summary goes to FILE.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import os
import pstats
import shutil
import statistics
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import anyio
import structlog

from core.types import FinishReason, Group, PromptTask, Segment
from launch.builtin_engine import start_engine
from launch.gc_settings import settle_gc
from pipeline import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from stages.sglang_client import EngineFleet
from storage import AsyncStore, Cursor, LmdbStore, MemoryStore

STORES = ("memory", "lmdb-sync", "lmdb-nosync")
BATCHES = {"single": 1, "batch": 64}  # RolloutPlan.store_batch
MODES = ("sync", "async")


class NullTrainer:
    """Trains nothing; its weights are a path the instant engine accepts without reading it."""

    def __init__(self, weights: Path) -> None:
        self._weights = weights

    def train_step(self, batch):
        return {}

    def save_weights(self, path: Path) -> Path:
        return self._weights


def reward(task, sample) -> float:
    return float(sample.response_ids[-1] & 1)


def workload(n: int, prompt_len: int) -> list[PromptTask]:
    return [
        PromptTask(index=i, prompt_ids=tuple(1000 + zlib.crc32(f"{i}:{j}".encode()) % 50000 for j in range(prompt_len)))
        for i in range(n)
    ]


class _ProfiledStore:
    """Forwards every call to `store` under one cProfile, in whichever thread makes the call.

    AsyncStore runs an LMDB store's calls one at a time on a worker thread, which the event loop's
    profiler cannot see; this gives that thread its own profile."""

    def __init__(self, store: Any, profile: cProfile.Profile) -> None:
        self._store, self._profile = store, profile
        self._lock = threading.Lock()
        self._grouping = False  # set by `_ProfiledGroupStore` on its worker thread, while a group runs

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            # Inside a profiled group it is already profiled; on the event loop's thread (the
            # synchronous `statistics()`) this profiler would take the place of the loop's own.
            if self._grouping or threading.current_thread() is threading.main_thread():
                return attr(*args, **kwargs)
            with self._lock:
                return self._profile.runcall(attr, *args, **kwargs)

        return call


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc)."""
    return stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def stat_cpu_seconds(stat: Path) -> float:
    """User + system CPU seconds from a /proc `stat` file (a process's, or a thread's under task/)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _ProfiledGroupStore(_ProfiledStore):
    """`_ProfiledStore` for a store with group commit: `AsyncStore` finds `run_grouped` on the class."""

    def run_grouped(self, calls: list[Any]) -> Any:
        with self._lock:
            self._grouping = True
            try:
                return self._profile.runcall(self._store.run_grouped, calls)
            finally:
                self._grouping = False


def open_store(kind: str, folder: Path) -> Any:
    if kind == "memory":
        return MemoryStore()
    return LmdbStore(folder / "store", sync=(kind == "lmdb-sync"))


async def run_one(
    mode: str,
    store_kind: str,
    commit: str,
    batch: str,
    args: argparse.Namespace,
    fleet: EngineFleet,
    work: Path,
    engine_pid: int,
    dataset: list[PromptTask],
    profile: tuple[cProfile.Profile, cProfile.Profile] | None = None,
) -> dict[str, float]:
    # Each run starts its own clock at version 0. The instant engine holds no weights, so its label
    # is all there is to reset; a real engine is never relabelled (pipeline/run/run_engines.py).
    await fleet.update_weight_version("0")
    folder = Path(tempfile.mkdtemp(prefix=f"overhead-{store_kind}-", dir=args.work))
    raw = open_store(store_kind, folder)
    group_commit = commit == "group"
    if profile and store_kind != "memory":
        raw = (_ProfiledGroupStore if group_commit else _ProfiledStore)(raw, profile[1])
    store = AsyncStore(raw, group_commit=group_commit)
    plan = RolloutPlan(
        mode=mode,
        batch_size=args.batch,
        n_samples=args.group,
        num_steps=args.steps,
        slots=args.slots,
        max_response_len=args.tokens,
        sampling_params={"temperature": 1.0},
        prefetch=args.batch,
        store_batch=BATCHES[batch],
    )
    marks: list[tuple[float, float]] = []

    def on_step(record: dict) -> None:
        marks.append((time.perf_counter(), time.process_time(), process_cpu_seconds(engine_pid)))

    try:
        if profile:
            profile[0].enable()
        t0 = time.perf_counter()
        await run_pipeline(
            plan,
            engines=fleet,
            store=store,
            trainer=NullTrainer(work),
            dataset=dataset,
            reward_fn=reward,
            filter_fn=None,
            weights_dir=work,
            metrics=MetricsSink(None),
            on_step=on_step,
        )
        t1 = time.perf_counter()
        transactions = store.statistics().transactions
    finally:
        if profile:
            profile[0].disable()
        await store.aclose()
        shutil.rmtree(folder, ignore_errors=True)
    grouping = store.group_commit_statistics()
    # Steady state: from the end of step 0 to the end of the last step.
    (w0, p0, e0), (w1, p1, e1) = marks[0], marks[-1]
    samples = (len(marks) - 1) * args.batch * args.group
    return {
        "samples/s": samples / (w1 - w0),
        "tokens/s": samples * args.tokens / (w1 - w0),
        "samples/cpu-s": samples / max(p1 - p0, 1e-9),
        "total s": t1 - t0,
        "cpu share": (p1 - p0) / (w1 - w0),
        "engine share": (e1 - e0) / (w1 - w0),
        "startup s": marks[0][0] - t0,
        # Store calls per transaction under group commit (whole run, start-up included).
        "calls/txn": grouping.calls / max(grouping.groups, 1) if grouping is not None else 1.0,
        # Store transactions per group trained (whole run): what batching and group commit cut.
        "txn/group": transactions / (args.steps * args.batch),
    }


def aborted_group(task: PromptTask, *, n: int, tokens: int) -> Group:
    """A group as an abort stores it: `n` samples with `tokens` generated tokens each."""
    group = Group.fresh(task, epoch=0, n_samples=n, version=0, seq=task.index)
    lps = tuple(-0.001 * (i % 97) for i in range(tokens))
    samples = [
        s.resumed().extended(
            Segment(tuple(1000 + (task.index * 31 + s.index * 7 + i) % 50_000 for i in range(tokens)),
                    lps, FinishReason.ABORT, 0),
            max_response_len=tokens * 2,
        )
        for s in group.samples
    ]  # fmt: skip
    return group.with_samples(samples)


async def store_burst(args: argparse.Namespace, commit: str, groups: list[Group]) -> tuple[float, int]:
    """Wall seconds and transactions for storing `groups` all at once as partial groups (what an
    abort does with the groups in flight), with LMDB sync on: where group commit pays."""
    folder = Path(tempfile.mkdtemp(prefix="overhead-burst-", dir=args.work))
    store = AsyncStore(LmdbStore(folder / "store", sync=True), group_commit=commit == "group")
    try:
        fresh = [Group.fresh(g.task, epoch=0, n_samples=len(g.samples), version=0, seq=g.seq) for g in groups]
        await store.admit(fresh, Cursor(0, len(groups), len(groups)))
        before = store.statistics().transactions
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for g in groups:
                tg.start_soon(store.put_partial, g)
        return time.perf_counter() - t0, store.statistics().transactions - before
    finally:
        await store.aclose()
        shutil.rmtree(folder, ignore_errors=True)


async def print_bursts(args: argparse.Namespace) -> None:
    tasks = workload(args.burst, args.prompt_len)
    groups = [aborted_group(t, n=args.group, tokens=args.tokens) for t in tasks]
    commits = args.commits.split(",")
    done: dict[str, list[tuple[float, int]]] = {c: [] for c in commits}
    for _ in range(args.repeats):
        for commit in commits:
            done[commit].append(await store_burst(args, commit, groups))
    print(
        f"\n{args.burst} groups stored at once (put_partial, {args.group} x {args.tokens} tokens each), "
        "lmdb-sync; medians"
    )
    print(f"{'commit':8}{'ms':>10}{'transactions':>14}{'groups/s':>12}")
    for commit, runs in done.items():
        wall = statistics.median(r[0] for r in runs)
        txns = statistics.median(r[1] for r in runs)
        print(f"{commit:8}{wall * 1e3:>10.1f}{txns:>14.0f}{args.burst / wall:>12,.0f}")


def print_profile(profile: cProfile.Profile, title: str, out: Path, top: int = 15) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    out.write_text(text.getvalue())
    profile.dump_stats(str(out.with_suffix(".prof")))
    short = io.StringIO()
    pstats.Stats(profile, stream=short).sort_stats("cumulative").print_stats(top)
    body = short.getvalue()
    print(f"\n--- {title}: top {top} by cumulative time (full: {out}) ---")
    print(body[body.find("   ncalls") :].rstrip())


async def main(args: argparse.Namespace) -> None:
    work = Path(args.work)
    await anyio.Path(work).mkdir(parents=True, exist_ok=True)
    dataset = workload(args.dataset or (args.steps + 4) * args.batch * 2, args.prompt_len)
    engine = await start_engine(
        "instant", module="engines.instant",
        extra_args=["--tokens", str(args.tokens), "--finish", args.finish]
        + (["--cpu", str(args.engine_cpu)] if args.engine_cpu >= 0 else []),
    )  # fmt: skip
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    if args.gc == "launcher":
        settle_gc()  # as `pipeline.run.cli` does once start-up is done
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    if args.gc_freeze:
        gc.freeze()
    configs = [
        (mode, store, client, commit, batch)
        for mode in args.modes.split(",")
        for store in args.stores.split(",")
        for client in args.clients.split(",")
        for commit in (["-"] if store == "memory" else args.commits.split(","))
        for batch in args.batches.split(",")
    ]
    print(
        f"{args.steps} steps x {args.batch} groups x {args.group} samples x {args.tokens} tokens, "
        f"{args.slots} slots, prompt {args.prompt_len} tokens; controller on CPU {args.cpu}, "
        f"engine on CPU {args.engine_cpu}; gc {args.gc} (gen-0 threshold {gc.get_threshold()[0]}, "
        f"{gc.get_freeze_count()} frozen); load average {os.getloadavg()[0]:.2f}; {args.repeats} repeats "
        "(interleaved), medians"
    )
    cols = [
        "samples/s",
        "tokens/s",
        "samples/cpu-s",
        "cpu share",
        "engine share",
        "startup s",
        "calls/txn",
        "txn/group",
    ]
    async with (
        engine,
        EngineFleet([engine.url], concurrency=args.slots, lean_generate=False) as old_fleet,
        EngineFleet([engine.url], concurrency=args.slots, lean_generate=True) as lean_fleet,
    ):
        fleets = {"aiohttp": old_fleet, "lean": lean_fleet}
        runs: dict[tuple[str, ...], list[dict[str, float]]] = {c: [] for c in configs}
        for _ in range(args.repeats):
            for mode, store_kind, client, commit, batch in configs:
                one = (mode, store_kind, commit, batch, args, fleets[client], work, engine.pid, dataset)
                runs[(mode, store_kind, client, commit, batch)].append(await run_one(*one))
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        head = f"{'mode':7}{'store':13}{'client':9}{'commit':8}{'batches':9}"
        print(head + "".join(f"{c:>15}" for c in cols))
        for (mode, store_kind, client, commit, batch), done in runs.items():
            med = {k: statistics.median(r[k] for r in done) for k in done[0]}
            row = f"{mode:7}{store_kind:13}{client:9}{commit:8}{batch:9}" + "".join(f"{med[c]:>15,.2f}" for c in cols)
            print(row, flush=True)
        print(f"client: {lean_fleet.statistics()}")
        if args.burst and any(st != "memory" for st in args.stores.split(",")):
            await print_bursts(args)
        if args.profile:
            parts = args.profile_run.split(":")
            mode, store_kind, client, commit, batch = parts + ["lean", "group", "batch"][len(parts) - 2 :]
            loop_prof, store_prof = cProfile.Profile(), cProfile.Profile()
            one = (mode, store_kind, commit, batch, args, fleets[client], work, engine.pid, dataset)
            res = await run_one(*one, profile=(loop_prof, store_prof))
            print(
                f"\nprofiled run ({mode}, {store_kind}, {client}, {commit}, {batch}): "
                f"{res['samples/s']:,.0f} samples/s under cProfile"
            )
            out = Path(args.profile)
            out.parent.mkdir(parents=True, exist_ok=True)
            print_profile(loop_prof, "event loop thread", out.with_suffix(".txt"))
            if store_kind != "memory":
                print_profile(store_prof, "store worker thread", out.with_suffix(".store.txt"), top=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="groups per step")
    parser.add_argument("--group", type=int, default=8, help="samples per group")
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens per sample")
    parser.add_argument("--finish", choices=["length", "stop"], default="length")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=128, help="concurrent requests")
    parser.add_argument("--dataset", type=int, default=0, help="prompts (default: enough for every step)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--clients", default="aiohttp,lean", help="/generate over aiohttp (before), lean (after)")
    parser.add_argument("--commits", default="single,group", help="LMDB: one transaction per call, or group commit")
    parser.add_argument(
        "--batches", default="single,batch", help="one group per store call (before), or what waits, up to 64"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--burst", type=int, default=64, help="groups stored at once in the group-commit table (0: none)"
    )
    parser.add_argument("--cpu", type=int, default=0, help="pin the controller here (-1: no pinning)")
    parser.add_argument("--engine-cpu", type=int, default=1, help="pin the engine here (-1: no pinning)")
    parser.add_argument("--profile", default=None, help="write a cProfile summary of one extra run here")
    parser.add_argument(
        "--profile-run", default="async:lmdb-nosync", help="MODE:STORE[:CLIENT:COMMIT:BATCHES] to profile"
    )
    parser.add_argument(
        "--gc",
        choices=["launcher", "python"],
        default="launcher",
        help="the collector as the launcher sets it (launch.gc_settings), or CPython's defaults",
    )
    parser.add_argument("--gc-threshold", type=int, default=0, help="CPython gen-0 GC threshold (0: default)")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after start-up")
    parser.add_argument("--work", default=tempfile.gettempdir() + "/bench-overhead")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(main, parser.parse_args())
