"""Production payloads through one controller (issue 49): how far one core goes, and what takes over.

    python -m benchmarks.production_payloads [--engines 64] [--engine-processes 4] [--shape 48x8/128]
        [--length-limit 28672] [--lengths lognormal:-1.9,0.8] [--batch 64] [--group 16] [--steps 6]
        [--slots 2048] [--mode sync] [--store lmdb-sync] [--producers 0 2 4 8] [--cpu 0] [--work DIR]
        [--gc-keep-steps K]

The engines are the instant engine in its production-payload mode (`engines/instant.py`,
`engines/production_payloads.py`): answers of a long-tailed length up to `--max-tokens`, with
`output_ids`, per-token log-probs, version spans, R3 routes at `--shape` (base64 int32, as SGLang
sends them) and SC heads with `--sc-top-k`, encoded once and cut per request, so the engines cost
next to nothing. `--engines` of them are served by `--engine-processes` processes (one process
answers for many ports) behind the real sglang-router. (With R3, sglang-router 0.3.2 drops the
routes' fields, and the fleet sends `/generate` to the engines directly: the project's own path.)
The trainer does nothing. The store is LMDB (synced by default) in `--work`: put it on the disk
to measure.

`--producers 0` is the controller alone (HTTP, JSON, base64, packing, rewards and the store on its
core); W >= 1 puts the generating side on W Ray producers (`launch.ray_producers`), which send
packed codec records back, and leaves the controller the store and the step loop. `--cpu N`
pins the controller (every thread) to CPU N and everything else off it: the issue's "one
controller core".

Printed per W, over the steps after the first (start-up excluded):
- response tokens/s and samples/s trained (wall), and the ratio to the 128-GPU DAPO run
  (0.5M tokens/s) and to the goal (1M tokens/s);
- store write MB/s (what the controller wrote: /proc/self/io `wchar`, LMDB's pwrites) and the
  store's size (data.mdb; with --gc-keep-steps also the pages its trees hold);
- controller RSS (anonymous, and file-backed: LMDB's map), its peak;
- event-loop lag: a task that sleeps 10 ms and measures how late it wakes (p50, p99, max);
- busy fractions: the controller's CPU / wall (the whole process; near 1.0 on one pinned core:
  the core is the limit), its event-loop thread's, the store writer's (wall time inside store
  calls on its worker thread, fsyncs included), the engine processes' (the busiest one: near 1.0,
  the load generator is the limit and the figures are a lower bound), the producers' (each);
- `saturated`: the first of these at >= 0.9, else "engines (waiting on answers)".

`--gc-keep-steps K` collects trained groups older than the last K steps after every step (as
`--rollout-gc-keep-steps` does) and prints the store's size step by step: its steady state.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson
import structlog

from benchmarks.controller_overhead import reward, stat_cpu_seconds, workload
from benchmarks.ray_producers import actor_cpu, pin_process, thread_cpu
from benchmarks.store_at_size import live_bytes
from engines.production_payloads import RouteShape
from launch.builtin_engine import EngineProcess, free_port, start_engine
from launch.gc_settings import settle_gc
from launch.router_process import start_router
from pipeline import RolloutPlan, run_pipeline
from pipeline.checkpoints import CheckpointPolicy, checkpoint_versions
from pipeline.metrics import MetricsSink
from pipeline.run.parts import garbage_collector
from stages.sglang_client import EngineFleet
from stages.sglang_client.payloads import TokenPayloads
from storage import AsyncStore, GroupState, LmdbStore, MemoryStore

GOAL_TOKENS_S = 1_000_000  # the goal: twice the 128-GPU run
DAPO_128_GPU_TOKENS_S = 500_000  # verl's DAPO setup on 128 GPUs (7B, 28k limit, ~8k samples / ~150 s)
SATURATED = 0.9


class FolderTrainer:
    """Trains nothing; saves a small real folder (a checkpoint's shape: config, optimizer), so that
    the checkpoint policy's cadence and retention (`--save-interval`, `--save-keep-last`) run as in
    a launched run, and the instant engines accept its path."""

    def __init__(self, weights_bytes: int) -> None:
        self._weights = b"\0" * weights_bytes

    def train_step(self, batch: Any) -> dict[str, float]:
        return {}

    def save_weights(self, path: Path) -> Path:
        (path / "optimizer").mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_bytes(b"{}")
        (path / "model.safetensors").write_bytes(self._weights)
        return path


class TimedStore:
    """Forwards every call to `store`, adding up the wall time of those made on a worker thread
    (the store writer's transactions, fsyncs included); the event loop's `statistics()` is not
    counted. `run_grouped` is spelled out: `AsyncStore` looks for it on the class."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.busy = 0.0

    @property
    def store(self) -> Any:
        return self._store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                return attr(*args, **kwargs)
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start

        return call

    def run_grouped(self, calls: list[Any]) -> Any:
        start = time.perf_counter()
        try:
            return self._store.run_grouped(calls)
        finally:
            self.busy += time.perf_counter() - start


@dataclass
class Probe:
    """Event-loop lag (how late a 10 ms sleep wakes) and the process's RSS, sampled as it runs."""

    period: float = 0.01
    lags: list[float] = field(default_factory=list)
    rss_peak: dict[str, int] = field(default_factory=dict)

    async def run(self) -> None:
        next_rss = 0.0
        while True:
            start = anyio.current_time()
            await anyio.sleep(self.period)
            now = anyio.current_time()
            self.lags.append(now - start - self.period)
            if now >= next_rss:
                for key, kb in rss_kb().items():
                    self.rss_peak[key] = max(self.rss_peak.get(key, 0), kb)
                next_rss = now + 1.0


def rss_kb() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in kB (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0])
    return out


def written_bytes() -> int:
    """Bytes this process passed to write calls so far (/proc/self/io `wchar`: LMDB's pwrites)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.asynccontextmanager
async def engines_and_router(args: argparse.Namespace) -> Any:
    """`--engines` production-payload engines over `--engine-processes` processes, and the real
    router in front of them (none for a single engine). Yields (urls, router url, processes)."""
    processes = max(1, min(args.engine_processes, args.engines))
    ports = [free_port() for _ in range(args.engines)]
    shares = [ports[i::processes] for i in range(processes)]
    flags = ["--max-tokens", str(args.max_tokens), "--length-limit", str(args.length_limit)]
    flags += ["--lengths", args.lengths, "--truncate-frac", str(args.truncate_frac)]
    flags += ["--max-prompt", str(args.prompt_len + 1)]
    if args.shape != "none":
        flags += ["--routes", args.shape]
    started: list[EngineProcess] = []
    async with contextlib.AsyncExitStack() as stack:
        async with anyio.create_task_group() as tg:

            async def one(share: list[int]) -> None:
                extra = ["--extra-ports", ",".join(map(str, share[1:]))] if len(share) > 1 else []
                engine = await start_engine(
                    "instant", module="engines.instant", port=share[0], extra_args=[*flags, *extra]
                )
                started.append(engine)

            for share in shares:
                tg.start_soon(one, share)
        for engine in started:
            stack.push_async_callback(engine.stop)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        router_url = None
        if len(urls) > 1:
            router = await start_router(urls, startup_timeout=120.0)
            stack.push_async_callback(router.stop)
            router_url = router.url
        yield urls, router_url, started


def engine_cpu(processes: list[EngineProcess]) -> list[float]:
    return [stat_cpu_seconds(Path(f"/proc/{e.pid}/stat")) for e in processes]


def open_store(kind: str, folder: Path) -> Any:
    if kind == "memory":
        return MemoryStore()
    return LmdbStore(folder / "store", sync=kind == "lmdb-sync", map_size=1 << 34)


async def run_one(
    producers: int, args: argparse.Namespace, urls: list[str], router_url: str | None, engines: list[EngineProcess]
) -> dict[str, Any]:
    shape = None if args.shape == "none" else RouteShape.parse(args.shape)
    payloads = TokenPayloads(
        routed_experts_top_k=None if shape is None else shape.top_k,
        sampler_top_k=args.sc_top_k or None,
        routed_experts_count=None if shape is None else shape.experts,
    )
    plan = RolloutPlan(
        mode=args.mode,
        batch_size=args.batch,
        n_samples=args.group,
        num_steps=args.steps,
        slots=args.slots,
        max_response_len=args.length_limit,
        sampling_params={"temperature": 1.0},
        payloads=payloads,
    )
    folder = Path(tempfile.mkdtemp(prefix="production-payloads-", dir=args.work))
    timed = TimedStore(open_store(args.store, folder))
    store = AsyncStore(timed)  # type: ignore[arg-type]  # a forwarding proxy of a Store
    data_file = folder / "store" / "data.mdb"
    marks: list[dict[str, Any]] = []
    sizes: list[tuple[int, int, int]] = []  # per step: data.mdb bytes, bytes its trees hold, trained groups
    probe = Probe()
    final: dict[str, float] = {}
    policy = CheckpointPolicy(
        folder / "checkpoints", folder / "publish", interval=args.save_interval, keep_last=args.save_keep_last
    )

    def on_step(record: dict[str, Any]) -> None:
        marks.append(
            {
                "wall": time.perf_counter(),
                "cpu": time.process_time(),
                "tokens": record.get("batch/tokens", 0),
                "samples": args.batch * args.group,
                "written": written_bytes(),
                "busy": timed.busy,
                "threads": thread_cpu(),
                "engines": engine_cpu(engines),
                "actors": actor_cpu() if producers else {},
            }
        )
        st = store.statistics()
        size = data_file.stat().st_size if data_file.exists() else 0
        held = live_bytes(timed.store) if args.gc_keep_steps is not None and args.store != "memory" else 0
        sizes.append((size, held, st.counts.get(GroupState.TRAINED, 0)))

    dataset = workload(args.batch * (args.steps + 4) * (2 if args.mode == "async" else 1), args.prompt_len)

    r3 = shape is not None

    async def go(factory: Any = None) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(probe.run)
            # `--rollout-gc-keep-steps`: the launcher's own collector, after each step's commit;
            # leaving it waits for the last collection.
            async with (
                garbage_collector(store, args.gc_keep_steps, on_step) as step_done,
                EngineFleet(urls, router_url=router_url, concurrency=args.slots, routed_experts=r3) as fleet,
            ):
                # The instant engine holds no weights: resetting its label loses nothing (a real
                # engine is never relabelled: pipeline/run/run_engines.py).
                await fleet.update_weight_version("0")
                await run_pipeline(
                    plan,
                    engines=fleet,
                    store=store,
                    trainer=FolderTrainer(args.checkpoint_kb * 1024),
                    dataset=dataset,
                    reward_fn=reward,
                    filter_fn=None,
                    weights_dir=folder,
                    metrics=MetricsSink(None),
                    on_step=step_done,
                    producers=factory,
                    checkpoints=policy,
                )
            tg.cancel_scope.cancel()
        st = store.statistics()  # after the last collection
        final.update(
            data_mb=data_file.stat().st_size / 1e6 if data_file.exists() else 0.0,
            used_mb=st.bytes_used / 1e6,
            trained_held=st.counts.get(GroupState.TRAINED, 0),
            collected=st.collected,
            checkpoints=len(checkpoint_versions(policy.dir)),
        )

    try:
        if producers == 0:
            await go()
        else:
            from launch.ray_cluster import RaySettings, group_slots, open_ray_producers
            from launch.ray_producer import ProducerSpec

            def spec_for(i: int, count: int) -> ProducerSpec:
                return ProducerSpec(
                    name=f"producer-{i}",
                    engine_urls=tuple(urls),
                    router_url=router_url,
                    group_slots=group_slots(plan.slots, plan.n_samples, count)[i],
                    n_samples=plan.n_samples,
                    sampling_params=plan.sampling_params,
                    max_response_len=plan.max_response_len,
                    reward_path="benchmarks.controller_overhead:reward",
                    routed_experts_top_k=payloads.routed_experts_top_k,
                    sampler_top_k=payloads.sampler_top_k,
                    routed_experts_count=payloads.routed_experts_count,
                )

            settings = RaySettings(None, producers, lease_seconds=120.0, deadline_seconds=600.0)
            async with open_ray_producers(
                settings, spec_for, store=store, n_samples=plan.n_samples, store_batch=plan.store_batch
            ) as make:
                await go(make)
    finally:
        await store.aclose()
        shutil.rmtree(folder, ignore_errors=True)
    return {**summarize(producers, marks, sizes, probe, args), "final": final}


def summarize(
    producers: int, marks: list[dict[str, Any]], sizes: list[tuple[int, int, int]], probe: Probe, args: Any
) -> dict[str, Any]:
    first, last = marks[0], marks[-1]  # steady state: from the end of step 0 to the end of the last
    wall = last["wall"] - first["wall"]
    tokens = sum(m["tokens"] for m in marks[1:])
    samples = sum(m["samples"] for m in marks[1:])
    threads = {k: v - first["threads"].get(k, 0.0) for k, v in last["threads"].items()}
    engines = [b - a for a, b in zip(first["engines"], last["engines"], strict=True)]
    actors = {k: v - first["actors"].get(k, 0.0) for k, v in last["actors"].items()}
    busy = {
        "controller cpu": (last["cpu"] - first["cpu"]) / wall,
        "event loop": threads.get("MainThread", 0.0) / wall,
        "store writer": (last["busy"] - first["busy"]) / wall,
        "engine process (busiest)": max(engines, default=0.0) / wall,
    }
    if producers:
        busy["producer (mean)"] = actors.get("ProducerActor", 0.0) / producers / wall
        busy["mailbox"] = actors.get("Mailbox", 0.0) / wall
    saturated = next((k for k, v in busy.items() if v >= SATURATED), "engines (waiting on answers)")
    return {
        "producers": producers,
        "tokens/s": tokens / wall,
        "samples/s": samples / wall,
        "tokens/sample": tokens / max(samples, 1),
        "write MB/s": (last["written"] - first["written"]) / wall / 1e6,
        "store MB": sizes[-1][0] / 1e6 if sizes else 0.0,
        "sizes": sizes,
        "rss": probe.rss_peak,
        "lag p50 ms": percentile(probe.lags, 0.5) * 1e3,
        "lag p99 ms": percentile(probe.lags, 0.99) * 1e3,
        "lag max ms": max(probe.lags, default=0.0) * 1e3,
        "busy": busy,
        "saturated": saturated,
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.mode}, {args.store}, {args.engines} engines in {args.engine_processes} processes, shape {args.shape}"
        f"{f' + SC top-{args.sc_top_k}' if args.sc_top_k else ''}, lengths {args.lengths} of {args.length_limit} "
        f"(cap {args.max_tokens}), {args.batch} groups x {args.group} samples a step, {args.steps} steps, "
        f"{args.slots} slots; controller on CPU {args.cpu if args.cpu >= 0 else 'any'}; {os.cpu_count()} cores; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    head = f"{'W':>6} {'tokens/s':>11} {'x0.5M':>6} {'x1M':>6} {'samples/s':>10} {'tok/smp':>8} {'write MB/s':>11}"
    head += f" {'RSS anon/file MB':>17} {'lag p50/p99/max ms':>19}  saturated"
    print(head)
    for r in rows:
        rss = r["rss"]
        print(
            f"{r['producers'] or 'local':>6} {r['tokens/s']:>11,.0f} {r['tokens/s'] / DAPO_128_GPU_TOKENS_S:>6.2f} "
            f"{r['tokens/s'] / GOAL_TOKENS_S:>6.2f} {r['samples/s']:>10,.1f} {r['tokens/sample']:>8,.0f} "
            f"{r['write MB/s']:>11,.1f} {rss.get('RssAnon', 0) / 1024:>8,.0f}/{rss.get('RssFile', 0) / 1024:<8,.0f} "
            f"{r['lag p50 ms']:>6.1f}/{r['lag p99 ms']:.1f}/{r['lag max ms']:.0f}  {r['saturated']}"
        )
        print("       busy: " + ", ".join(f"{k} {v:.2f}" for k, v in r["busy"].items()))
    if args.gc_keep_steps is not None:
        for r in rows:
            sizes = r["sizes"]
            half = sizes[len(sizes) // 2 :]
            print(
                f"store size, W={r['producers'] or 'local'}, collection keeping {args.gc_keep_steps} steps: "
                f"data.mdb {sizes[0][0] / 1e6:,.1f} MB after step 0, {sizes[-1][0] / 1e6:,.1f} MB after step "
                f"{len(sizes) - 1}; over the last half min/max {min(s[0] for s in half) / 1e6:,.1f}/"
                f"{max(s[0] for s in half) / 1e6:,.1f} MB (its trees hold {min(s[1] for s in half) / 1e6:,.1f}/"
                f"{max(s[1] for s in half) / 1e6:,.1f} MB, trained groups held {min(s[2] for s in half)}/"
                f"{max(s[2] for s in half)}); at the end, {r['final']['trained_held']} trained groups held, "
                f"{r['final']['collected']} collected, {r['final']['checkpoints']} checkpoints kept"
            )
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))


@contextlib.contextmanager
def controller_core(cpu: int) -> Iterator[Callable[[], None]]:
    """Everything started inside stays off `cpu`; calling the yielded function moves this process
    (every thread) onto it."""
    if cpu < 0:
        yield lambda: None
        return
    everything = set(os.sched_getaffinity(0))
    os.sched_setaffinity(0, everything - {cpu})
    yield lambda: pin_process(cpu)


async def main(args: argparse.Namespace) -> None:
    if args.shape != "none":
        RouteShape.parse(args.shape)  # a typo fails here, not after the engines started
    await anyio.Path(args.work).mkdir(parents=True, exist_ok=True)
    rows = []
    with controller_core(args.cpu) as pin:
        if any(args.producers):
            import ray

            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(address="local", num_cpus=max(args.producers), include_dashboard=False, log_to_driver=False)
        try:
            async with engines_and_router(args) as (urls, router_url, engines):
                pin()
                if args.gc == "launcher":
                    settle_gc()
                for w in args.producers:
                    rows.append(await run_one(w, args, urls, router_url, engines))
                    print(f"  W={w or 'local'}: {rows[-1]['tokens/s']:,.0f} tokens/s", flush=True)
        finally:
            if any(args.producers):
                import ray

                ray.shutdown()
    report(rows, args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--engine-processes", type=int, default=4, help="processes the engines' ports are spread over")
    p.add_argument("--shape", default="48x8/128", help="R3 routes LAYERSxTOPK/EXPERTS (58x8/256: DeepSeek-V3), or none")
    p.add_argument("--sc-top-k", type=int, default=0, help="SC heads a token (0: none)")
    p.add_argument("--max-tokens", type=int, default=32768, help="the longest answer")
    p.add_argument("--length-limit", type=int, default=28672, help="the run's response limit (DAPO: 28k)")
    p.add_argument("--lengths", default="lognormal:-1.9,0.8", help="fractions of the limit (sim_model.LengthModel)")
    p.add_argument("--truncate-frac", type=float, default=0.10)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="groups a step")
    p.add_argument("--group", type=int, default=16, help="samples a group")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--slots", type=int, default=2048, help="requests in flight over all engines")
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--store", choices=["lmdb-sync", "lmdb-nosync", "memory"], default="lmdb-sync")
    p.add_argument("--producers", type=int, nargs="+", default=[0], help="0: the controller alone; W: Ray producers")
    p.add_argument("--cpu", type=int, default=0, help="pin the controller (every thread) here (-1: no pinning)")
    p.add_argument("--gc", choices=["launcher", "python"], default="launcher")
    p.add_argument("--gc-keep-steps", type=int, default=None, help="collect all but the last K steps, print sizes")
    p.add_argument("--save-interval", type=int, default=1, help="a checkpoint every N steps (collection stops there)")
    p.add_argument("--save-keep-last", type=int, default=2, help="checkpoints kept (0: all)")
    p.add_argument("--checkpoint-kb", type=int, default=64, help="bytes of each stand-in checkpoint's weights")
    p.add_argument("--work", default=tempfile.gettempdir() + "/bench-production", help="the store's disk")
    p.add_argument("--json", default=None, help="also write the rows here")
    return p


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    a = parser().parse_args()
    if a.engines < 1 or a.steps < 2 or any(w < 0 for w in a.producers):
        raise SystemExit("--engines >= 1, --steps >= 2 (the first is start-up) and --producers >= 0")
    anyio.run(main, a)
