"""The store at the sizes users run (issue 49): build one through the real store API, then time a
resume and `replay verify` on it.

    python -m benchmarks.store_at_size [--size-gb 100] [--shape 48x8/128] [--group 16]
        [--length-limit 28672] [--lengths lognormal:-1.9,0.8] [--batch 64] [--after-checkpoint 2]
        [--dir /the/disk/to/test] [--keep]

`--steady-steps N` runs N steps with collection keeping `--gc-keep-steps` (as
`--rollout-gc-keep-steps`) instead, and prints the store's size step by step: what it holds, the
file's high-water mark (LMDB reuses freed pages; it never shrinks the file), and their growth.

1. Build: steps of `--batch` groups of `--group` samples, long-tailed response lengths
   (`--lengths`: fractions of `--length-limit`, the simulated engine's length model), per-token
   log-probs, version spans and R3 routes at `--shape` packed as the client packs them (SC heads
   with `--sc-top-k`), through
   `LmdbStore` as the controller uses it: `admit`, `put_ready_groups`, `take_batch`,
   `finish_batch` with its metrics record, LMDB synced unless `--no-sync`. It stops at `--size-gb`
   of records, as a crash would leave it: the last `--after-checkpoint` steps trained after the
   newest checkpoint (a resume trains them again) and one batch taken but not trained, plus a
   batch's worth of ready groups and of running ones (the work in flight).
2. Resume: the page cache of data.mdb is dropped (`posix_fadvise`: the cost of a host reboot, not
   of a process restart; `--warm` keeps it), then the launcher's resume opens it
   (`pipeline.run.state.open_for_resume`: the page walk, layout and counter checks, recovery,
   quarantine of damaged servable groups, the damaged records of what is trained again named,
   failed groups said), and the batches since the checkpoint are read as the replay reads them.
   Goal: 10 s at 100 GB.
3. `python -m pipeline.replay DIR verify` in a process of its own, the cache dropped again: wall
   time, MB/s against the disk's own sequential read (`data.mdb` read once with large reads, the
   cache dropped before), and its peak RSS (anonymous memory: what it holds, not LMDB's map).

Figures print as they come; `--json FILE` writes them too. The store is deleted unless `--keep`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import orjson

from core.columns import ROUTE_CODES, LogProbs, LossMask, SamplerHeads, TokenIds, TokenRoutes, route_code
from core.types import FinishReason, Group, PromptTask, Sample, SampleStatus, VersionSpan
from engines.production_payloads import RouteShape
from engines.sim_model import LengthModel
from pipeline.checkpoints import CheckpointPolicy
from pipeline.run.state import open_for_resume
from storage import Cursor, LmdbStore, RunMeta

_POOL = 1 << 26  # random bytes every sample's columns are cut from (no generator in the hot loop)


class Samples:
    """Production-shaped samples without a generator in the loop: columns cut from random pools."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = np.random.default_rng(0)
        self.shape = None if args.shape == "none" else RouteShape.parse(args.shape)
        self.sc_k = args.sc_top_k
        self.lengths = LengthModel.parse(args.lengths, truncate_frac=args.truncate_frac)
        self.limit = args.length_limit
        self._ids = rng.integers(1000, 50_000, _POOL // 4, dtype="<i4").tobytes()
        self._lps = (-rng.random(_POOL // 8) * 3).astype("<f8").tobytes()
        self._routes = b""
        if self.shape is not None:
            # Packed as the client packs them (one byte an id for <= 255 experts).
            self._code = route_code(self.shape.experts)
            width = ROUTE_CODES[self._code]
            ids = rng.integers(0, self.shape.experts, _POOL // width, dtype=np.int32)
            self._routes = ids.astype({1: "<u1", 2: "<i2", 4: "<i4"}[width]).tobytes()
            self._row = self.shape.layers * self.shape.top_k * width
        self._at = 0

    def _cut(self, pool: bytes, n: int) -> bytes:
        self._at += 1
        start = (self._at * 7919) % max(1, len(pool) - n)
        return pool[start : start + n]

    def sample(self, index: int, prompt: tuple[int, ...], seed: int, version: int) -> Sample:
        n = self.lengths.target(seed, (), self.limit) or self.limit
        routes = heads = None
        if self.shape is not None:
            s = self.shape
            n = min(n, len(self._routes) // self._row)
            routes = TokenRoutes(
                self._cut(self._routes, n * self._row), layers=s.layers, top_k=s.top_k, code=self._code
            )
        if self.sc_k:
            k = self.sc_k
            heads = SamplerHeads(self._cut(self._ids, n * k * 4), self._cut(self._lps, n * k * 8), k=k)
        return Sample(
            index=index,
            prompt_ids=prompt,
            response_ids=TokenIds.from_bytes(self._cut(self._ids, 4 * n)),
            logprobs=LogProbs.from_bytes(self._cut(self._lps, 8 * n)),
            loss_mask=LossMask.ones(n),
            spans=(VersionSpan(0, n, version),),
            status=SampleStatus.COMPLETED if n < self.limit else SampleStatus.TRUNCATED,
            finish_reason=FinishReason.STOP if n < self.limit else FinishReason.LENGTH,
            reward=float(seed & 1),
            routes=routes,
            heads=heads,
        )


def build(path: Path, args: argparse.Namespace, meta: RunMeta) -> dict[str, Any]:
    """Fill a store through its API until `--size-gb` of records; leave it as a crash would."""
    samples = Samples(args)
    store = LmdbStore(path, sync=args.sync)
    target = args.size_gb * 1e9
    index = step = 0
    start = last_line = time.perf_counter()

    def admitted(count: int, version: int) -> list[Group]:
        # As the dispenser admits them: fresh groups, the cursor moved in the same transaction.
        nonlocal index
        fresh = []
        for _ in range(count):
            task = PromptTask(index=index, prompt_ids=tuple(range(index % 1000, index % 1000 + args.prompt_len)))
            fresh.append(Group.fresh(task, epoch=0, n_samples=args.group, version=version, seq=index))
            index += 1
        store.admit(fresh, Cursor(0, index, index))
        return fresh

    def generated(fresh: list[Group], version: int) -> list[Group]:
        return [
            g.with_samples(
                [samples.sample(s.index, g.task.prompt_ids, g.seq * 131 + s.index, version) for s in g.samples]
            )
            for g in fresh
        ]

    try:
        store.write_meta(meta)
        while True:
            ready = generated(admitted(args.batch, step), step)
            store.put_ready_groups(ready)  # as the collector stores what arrived together
            batch = store.take_batch(step, args.batch)
            assert batch is not None
            written = store.statistics().bytes_used
            done = written >= target
            if not done:
                tokens = sum(s.response_len for g in ready for s in g.samples)
                store.finish_batch(step, {"step": step, "batch/tokens": tokens})
                step += 1
            now = time.perf_counter()
            if now - last_line >= 10 or done:
                last_line = now
                rate = written / 1e6 / (now - start)
                print(f"  build: {written / 1e9:,.1f} GB, {step} steps trained, {rate:,.0f} MB/s", flush=True)
            if done:
                break
        # In flight at the "crash": the batch of `step` taken, not trained; a batch's worth ready;
        # a batch's worth running (admitted, nothing generated yet).
        store.put_ready_groups(generated(admitted(args.batch, step), step))
        admitted(args.batch, step)
        seconds = time.perf_counter() - start
        stats = store.statistics()
    finally:
        store.close()
    return {
        "build s": seconds,
        "build MB/s": stats.bytes_used / 1e6 / seconds,
        "store GB": stats.bytes_used / 1e9,
        "data.mdb GB": os.path.getsize(path / "data.mdb") / 1e9,
        "trained steps": step,
        "groups": index,
    }


def live_bytes(store: LmdbStore) -> int:
    """Bytes of the pages the store's trees hold now (branch, leaf and overflow pages of every
    database): what it holds, beside `bytes_used`, the file's high-water mark, which counts the
    pages LMDB freed and keeps for reuse. Reads the store's own environment (a benchmark's look
    inside, through its transactions object)."""
    tx = store._tx

    def count(env: lmdb.Environment) -> int:
        pages = 0
        with env.begin() as txn:
            for db in (*tx.dbs.values(), None):
                st = txn.stat(db) if db is not None else env.stat()
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return pages * int(env.stat()["psize"])

    return tx.under_lock(count)


def steady(path: Path, args: argparse.Namespace, meta: RunMeta) -> dict[str, Any]:
    """`--steady-steps N`: N steps through the store API with collection keeping the last
    `--gc-keep-steps` (as `--rollout-gc-keep-steps` runs it after each commit); the file's size,
    its high-water mark and the pages held, step by step."""
    samples = Samples(args)
    store = LmdbStore(path, sync=args.sync)
    keep = args.gc_keep_steps
    index = 0
    sizes: list[tuple[int, int, int]] = []  # data.mdb bytes, high-water bytes, live bytes
    start = time.perf_counter()
    try:
        store.write_meta(meta)
        for step in range(args.steady_steps):
            fresh = []
            for _ in range(args.batch):
                task = PromptTask(index=index, prompt_ids=tuple(range(index % 1000, index % 1000 + args.prompt_len)))
                fresh.append(Group.fresh(task, epoch=0, n_samples=args.group, version=step, seq=index))
                index += 1
            store.admit(fresh, Cursor(0, index, index))
            seeds = [[g.seq * 131 + s.index for s in g.samples] for g in fresh]
            store.put_ready_groups(
                [
                    g.with_samples(
                        [
                            samples.sample(s.index, g.task.prompt_ids, seed, step)
                            for s, seed in zip(g.samples, ss, strict=True)
                        ]
                    )
                    for g, ss in zip(fresh, seeds, strict=True)
                ]
            )
            store.take_batch(step, args.batch)
            store.finish_batch(step, {"step": step})
            if step - keep >= 0:
                store.collect_garbage(step - keep)
            sizes.append((os.path.getsize(path / "data.mdb"), store.statistics().bytes_used, live_bytes(store)))
            if (step + 1) % max(1, args.steady_steps // 10) == 0:
                f, h, live = sizes[-1]
                print(
                    f"  step {step}: data.mdb {f / 1e6:,.1f} MB, high-water {h / 1e6:,.1f} MB, "
                    f"held {live / 1e6:,.1f} MB",
                    flush=True,
                )
    finally:
        store.close()
    half = sizes[len(sizes) // 2 :]
    grew = (half[-1][1] - half[0][1]) / max(1, len(half) - 1) * 100
    return {
        "steady steps": len(sizes),
        "steady s": time.perf_counter() - start,
        "held MB (last half, max)": max(x[2] for x in half) / 1e6,
        "high-water MB (mid, end)": (half[0][1] / 1e6, half[-1][1] / 1e6),
        "data.mdb MB (end)": sizes[-1][0] / 1e6,
        "high-water growth MB per 100 steps (last half)": grew / 1e6,
        "sizes": sizes,
    }


def drop_cache(file: Path) -> None:
    """Evict `file`'s clean pages from the page cache (what a reboot leaves: nothing)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_mb_s(file: Path) -> float:
    """The disk's sequential read of `file`, cache dropped before: what `verify` is measured against."""
    drop_cache(file)
    start = time.perf_counter()
    read = 0
    with open(file, "rb", buffering=0) as fh:
        buf = bytearray(16 << 20)
        while n := fh.readinto(buf):
            read += n
    return read / 1e6 / (time.perf_counter() - start)


def rss_kb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0])
    return out


def resume(path: Path, args: argparse.Namespace, meta: RunMeta, trained: int) -> dict[str, Any]:
    """The launcher's resume of the store, then the batches since the checkpoint read as replay reads them."""
    if not args.warm:
        drop_cache(path / "data.mdb")
    folder = Path(tempfile.mkdtemp(prefix="store-at-size-ckpt-"))
    try:
        version = max(0, trained + 1 - args.after_checkpoint)
        if version:
            (folder / "checkpoints" / f"v{version}" / "optimizer").mkdir(parents=True)
            (folder / "checkpoints" / f"v{version}" / "config.json").write_bytes(b"{}")
        policy = CheckpointPolicy(folder / "checkpoints", folder / "publish")
        before = rss_kb()
        start = time.perf_counter()
        store = open_for_resume(path, {"sync": args.sync}, meta, policy, lambda gid: None)
        opened = time.perf_counter() - start
        after = rss_kb()  # the resume's own: the replay's batches below are the trainer's memory
        try:
            start = time.perf_counter()
            replayed = 0
            for step in range(version, store.trained_step() + 1):
                batch = store.batch(step)
                replayed += len(batch.groups) if batch is not None else 0
                del batch  # one batch at a time, as the replay trains them
            replay_read = time.perf_counter() - start
        finally:
            store.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "resume s": opened,
        "replay read s": replay_read,
        "replayed groups": replayed,
        "resume RSS anon MB": (after["RssAnon"] - before["RssAnon"]) / 1024,
    }


def verify(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`python -m pipeline.replay DIR verify` in a process of its own: wall time and peak RSS."""
    if not args.warm:
        drop_cache(path / "data.mdb")
    code_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [code_root, os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _VERIFY, str(path)], env=env, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"verify failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    peak = orjson.loads(done.stdout.strip().splitlines()[-1])
    lines = [line for line in done.stderr.splitlines() if line.startswith("verify:")]
    size = os.path.getsize(path / "data.mdb")
    return {
        "verify s": seconds,
        "verify MB/s": size / 1e6 / seconds,
        "verify peak RSS MB": peak["VmHWM"] / 1024,
        "verify RSS anon MB": peak["RssAnon"] / 1024,
        "verify progress lines": len(lines),
        "verify said": lines[-1] if lines else "",  # its own rate, the interpreter's start-up left out
    }


# The verify process: replay's own command, then its peak and anonymous RSS as one JSON line
# (RssAnon at the end: what it holds; VmHWM counts LMDB's file-backed map too).
_VERIFY = """
import sys, orjson
from pathlib import Path
from pipeline.replay import main
code = main([sys.argv[1], "verify"])
out = {}
for line in Path("/proc/self/status").read_text().splitlines():
    name, _, value = line.partition(":")
    if name in ("VmHWM", "RssAnon", "RssFile"):
        out[name] = int(value.split()[0])
print(orjson.dumps(out).decode())
sys.exit(code)
"""


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.dir is not None:  # the disk to test: its folder is made, as a run's would be
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="store-at-size-", dir=args.dir))
    path = root / "rollout_data"
    meta = RunMeta(
        run_id="store-at-size", dataset_fingerprint="d", tokenizer_fingerprint="t", n_samples_per_prompt=args.group
    )
    out: dict[str, Any] = {}
    if args.steady_steps:
        try:
            out.update(steady(path, args, meta))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"steady state over {out['steady steps']} steps ({args.batch} groups x {args.group} samples a step, "
            f"collection keeping {args.gc_keep_steps}): held at most {out['held MB (last half, max)']:,.1f} MB "
            f"over the last half; high-water {out['high-water MB (mid, end)'][0]:,.1f} MB at its start, "
            f"{out['high-water MB (mid, end)'][1]:,.1f} MB at the end "
            f"({out['high-water growth MB per 100 steps (last half)']:+,.2f} MB per 100 steps); data.mdb "
            f"{out['data.mdb MB (end)']:,.1f} MB; {out['steady s']:.0f} s",
            flush=True,
        )
        if args.json:
            Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
        return out
    try:
        print(
            f"building {args.size_gb:g} GB: {args.batch} groups x {args.group} samples a step, lengths {args.lengths} "
            f"of {args.length_limit}, routes {args.shape}{f', SC top-{args.sc_top_k}' if args.sc_top_k else ''}, "
            f"{'synced' if args.sync else 'unsynced'}, in {path}",
            flush=True,
        )
        out.update(build(path, args, meta))
        print(f"built: {out}", flush=True)
        out.update(resume(path, args, meta, out["trained steps"] - 1))
        goal = "within" if out["resume s"] <= 10 else "OVER"
        print(
            f"resume: {out['resume s']:.2f} s ({goal} the 10 s goal), then {out['replayed groups']} groups of the "
            f"{args.after_checkpoint} steps since the checkpoint read in {out['replay read s']:.2f} s; "
            f"anonymous RSS +{out['resume RSS anon MB']:,.0f} MB",
            flush=True,
        )
        disk = disk_read_mb_s(path / "data.mdb")
        out["disk read MB/s"] = disk
        out.update(verify(path, args))
        print(
            f"verify: {out['verify s']:.1f} s, {out['verify MB/s']:,.0f} MB/s = {out['verify MB/s'] / disk:.2f} of the "
            f"disk's sequential read ({disk:,.0f} MB/s); peak RSS {out['verify peak RSS MB']:,.0f} MB of which "
            f"anonymous {out['verify RSS anon MB']:,.0f} MB; {out['verify progress lines']} progress lines, the last: "
            f"{out['verify said']!r}",
            flush=True,
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept: {path}")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=100.0, help="records to build (pages in use)")
    p.add_argument("--shape", default="48x8/128", help="R3 routes LAYERSxTOPK/EXPERTS, or none")
    p.add_argument("--sc-top-k", type=int, default=0)
    p.add_argument("--group", type=int, default=16, help="samples a group")
    p.add_argument("--batch", type=int, default=64, help="groups a step")
    p.add_argument("--length-limit", type=int, default=28672)
    p.add_argument("--lengths", default="lognormal:-1.9,0.8", help="fractions of the limit (sim_model.LengthModel)")
    p.add_argument("--truncate-frac", type=float, default=0.10)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--after-checkpoint", type=int, default=2, help="steps trained after the newest checkpoint")
    p.add_argument("--no-sync", dest="sync", action="store_false", help="build without fsync")
    p.add_argument("--warm", action="store_true", help="keep the page cache (a process restart, not a reboot)")
    p.add_argument("--dir", default=None, help="where to build (the disk to measure)")
    p.add_argument("--keep", action="store_true")
    p.add_argument(
        "--steady-steps", type=int, default=0, help="instead: N steps with collection, the size step by step"
    )
    p.add_argument("--gc-keep-steps", type=int, default=2, help="with --steady-steps: steps collection keeps")
    p.add_argument("--json", default=None)
    return p


if __name__ == "__main__":
    main(parser().parse_args())
