"""What the rollout store costs, measured in one run: commits per second and the time to resume.

    python -m benchmarks.store_costs [--commits 300] [--groups 100000] [--dir /path/on/the/disk/to/test]

1. Commits per second for group-sized records (8 samples x 1k response tokens, about 100 KB
   encoded): one `put_partial` per commit, encoding included, for LMDB with sync=True (an fsync per
   commit), LMDB with sync=False, and the memory store.
2. Reopen and resume a store holding `--groups` groups: open + recover + the first
   `claim_partial(1)` + the first `take_batch`. The fill uses small groups (8 samples x 16 tokens)
   so it runs in well under two minutes; the resume cost depends on the number of groups and the
   indexes, not on record size (records are read only when served). The fill's states are those of
   a long run stopped mid-step: 90% TRAINED (in batches of 1,000), one batch of 1,000 taken but not
   trained, 3% READY, 4% PARTIAL, the rest (2%) RUNNING at the "crash".
   Also reported: `collect_garbage` of the trained groups, and the store's size before and after.
3. What integrity costs: the checks every open runs (LMDB's meta pages; every branch and leaf
   page of every tree walked in Python, records not read; the counters against LMDB's entry
   counts), the launcher's `quarantine_damaged` (every servable group's record read and its
   checksum checked), and `verify` (every record read, checked and decoded: what
   `python -m pipeline.replay RUN_DIR verify` costs).

4. What R3 routes and SC sampler heads cost (`--only-payloads` runs just this): the same
   group-sized records with and without per-token payloads of a Qwen3-30B-A3B-like shape
   (`--r3-layers 48 --r3-top-k 8`, `--sc-top-k 20`): bytes per token, and the write (encode + an
   unsynced LMDB commit) and read (the record read, checked and decoded) times side by side.

`--dir` picks the disk to measure (default: a temporary folder). The page cache is warm for the
reopen (the fill just wrote it): that is the cost of a process restart, not of a host reboot.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from core.columns import SamplerHeads, TokenRoutes
from core.types import FinishReason, Group, PromptTask, Sample, Segment
from storage import Cursor, LmdbStore, MemoryStore, Store, codec
from storage.lmdb_pages import check_data_file, walk_pages


def _task(index: int) -> PromptTask:
    return PromptTask(index=index, prompt_ids=tuple(range(64)), label="x", metadata={"row": index})


def make_group(index: int, *, samples: int, tokens: int, finish: FinishReason = FinishReason.ABORT) -> Group:
    group = Group.fresh(_task(index), epoch=0, n_samples=samples, version=0, seq=index)
    out = []
    for s in group.samples:
        ids = tuple((index * 31 + s.index * 7 + i) % 50_000 for i in range(tokens))
        lps = tuple(-0.001 * (i % 97) for i in range(tokens))
        sample = s.resumed().extended(Segment(ids, lps, finish, 0), max_response_len=tokens * 2)
        out.append(sample if finish is FinishReason.ABORT else _rewarded(sample))
    return group.with_samples(out)


def with_payloads(group: Group, *, layers: int, top_k: int, sc_k: int, experts: int = 128) -> Group:
    """`group` with R3 routes and SC heads on every token (deterministic filler of the right size),
    the routes packed as the client stores them (one byte an id for <= 255 experts)."""
    out = []
    for s in group.samples:
        n = s.response_len
        expert_ids = ((np.arange(n * layers * top_k) * 7 + s.index) % experts).astype("<i4").tobytes()
        routes = TokenRoutes.packed(expert_ids, layers=layers, top_k=top_k, experts=experts)
        heads = SamplerHeads(bytes(n * sc_k * 4), bytes((i * 3) % 251 for i in range(n * sc_k * 8)), k=sc_k)
        out.append(dataclasses.replace(s, routes=routes, heads=heads))
    return group.with_samples(out)


def payload_costs(root: Path, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Bytes per token and write/read time of group records with vs without R3/SC payloads."""
    n, tokens = args.payload_commits, 1024  # a loaded record is ~14 MB: a few dozen are plenty
    plain = [make_group(i, samples=8, tokens=tokens) for i in range(n)]
    shape = dict(layers=args.r3_layers, top_k=args.r3_top_k, sc_k=args.sc_top_k, experts=args.r3_experts)
    loaded = [with_payloads(g, **shape) for g in plain]
    rows: list[tuple[str, str]] = []
    measured: dict[str, tuple[float, float, float]] = {}
    for name, groups in (("without", plain), ("with", loaded)):
        per_token = len(codec.encode_group(groups[0])) / (8 * tokens)
        with LmdbStore(root / f"payloads-{name}", map_size=1 << 36, sync=False) as store:
            write = 1 / commits_per_second(store, n, groups)
            start = time.perf_counter()
            for g in groups:
                found = store.get(g.group_id)
                assert found is not None and found[1].samples[0].routes == g.samples[0].routes
            read = (time.perf_counter() - start) / n
        measured[name] = (per_token, write, read)
    (b0, w0, r0), (b1, w1, r1) = measured["without"], measured["with"]
    what = f"R3 {args.r3_layers} layers x top-{args.r3_top_k} of {args.r3_experts} + SC top-{args.sc_top_k}"
    rows += [
        ("payloads: bytes/token without / with", f"{b0:.1f} / {b1:.1f}  (x{b1 / b0:.1f}; {what})"),
        ("payloads: write ms/group without / with", f"{w0 * 1e3:.2f} / {w1 * 1e3:.2f}  (x{w1 / w0:.0f}, unsynced)"),
        ("payloads: read ms/group without / with", f"{r0 * 1e3:.2f} / {r1 * 1e3:.2f}  (x{r1 / r0:.0f}, checked)"),
    ]
    return rows


def _rewarded(sample: Sample) -> Sample:
    return dataclasses.replace(sample, reward=1.0)


def commits_per_second(store: Store, n: int, groups: list[Group]) -> float:
    store.admit(
        [Group.fresh(g.task, epoch=0, n_samples=len(g.samples), version=0, seq=g.seq) for g in groups],
        Cursor(index=n, next_seq=n),
    )
    start = time.perf_counter()
    for g in groups:
        store.put_partial(g)
    return n / (time.perf_counter() - start)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def fill(path: Path, n: int, batch: int) -> float:
    """`n` small groups in a long run's states; returns seconds taken."""
    start = time.perf_counter()
    trained, ready, partial = int(n * 0.90) // batch * batch, int(n * 0.04), int(n * 0.04)
    with LmdbStore(path, sync=False) as store:
        next_index = 0
        for chunk_start in range(0, n, 1000):
            chunk = range(chunk_start, min(n, chunk_start + 1000))
            fresh = [Group.fresh(_task(i), epoch=0, n_samples=8, version=0, seq=i) for i in chunk]
            store.admit(fresh, Cursor(index=chunk.stop, next_seq=chunk.stop))
            next_index = chunk.stop
        for i in range(trained + ready):
            store.put_ready(make_group(i, samples=8, tokens=16, finish=FinishReason.STOP))
        for step in range(trained // batch):
            store.take_batch(step, batch)
            store.finish_batch(step)
        store.take_batch(trained // batch, batch)  # the step the crash interrupted
        for i in range(trained + ready, trained + ready + partial):
            store.put_partial(make_group(i, samples=8, tokens=16))
        assert next_index == n
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="store-costs-", dir=args.dir))
    rows: list[tuple[str, str]] = []
    try:
        if args.only_payloads:
            rows += payload_costs(root, args)
            return _print(rows)
        big = [make_group(i, samples=8, tokens=1024) for i in range(args.commits)]
        size = len(codec.encode_group(big[0]))
        for name, make in (
            ("lmdb sync=True", lambda: LmdbStore(root / "sync", map_size=1 << 32)),
            ("lmdb sync=False", lambda: LmdbStore(root / "nosync", map_size=1 << 32, sync=False)),
            ("memory", MemoryStore),
        ):
            with make() as store:
                rate = commits_per_second(store, args.commits, big)
            rows.append((f"commits/s, {name}", f"{rate:,.0f}  ({args.commits} x put_partial of {size / 1e3:.0f} KB)"))

        path = root / "resume"
        fill_s = fill(path, args.groups, 1000)
        rows.append((f"fill {args.groups:,} small groups (8 x 16 tokens)", f"{fill_s:.1f} s (not part of resume)"))
        data_file = str(path / "data.mdb")
        meta_s, _ = timed(lambda: check_data_file(data_file))
        walk_s, damaged = timed(lambda: walk_pages(data_file))
        assert not damaged
        open_s, store = timed(lambda: LmdbStore(path))
        try:
            stats = store.statistics()
            recover_s, report = timed(store.recover)
            claim_s, claimed = timed(lambda: store.claim_partial(1))
            take_s, taken = timed(lambda: store.take_batch(stats.trained_step + 1, 8))
            assert claimed and taken is not None
            quarantine_s, _ = timed(store.quarantine_damaged)
            total = open_s + recover_s + claim_s + take_s
            rows += [
                ("resume: open", f"{open_s * 1e3:.1f} ms (all of the integrity checks below included)"),
                ("  open check: meta pages", f"{meta_s * 1e3:.2f} ms"),
                (
                    "  open check: every tree's pages walked",
                    f"{walk_s * 1e3:.1f} ms  ({(path / 'data.mdb').stat().st_size / 1e6:.0f} MB file)",
                ),
                (
                    "resume: recover",
                    f"{recover_s * 1e3:.1f} ms  ({report.running_to_partial} running -> partial, "
                    f"{report.batched_to_ready} batched -> ready)",
                ),
                ("resume: first claim_partial(1)", f"{claim_s * 1e3:.2f} ms"),
                ("resume: first take_batch(8)", f"{take_s * 1e3:.2f} ms"),
                ("resume: total", f"{total * 1e3:.1f} ms for {sum(stats.counts.values()):,} groups"),
                (
                    "launcher: quarantine_damaged",
                    f"{quarantine_s * 1e3:.0f} ms  (every servable group's record read and checked)",
                ),
            ]
            verify_s, verified = timed(store.verify)
            assert verified.ok, verified.damaged[:3]
            rows.append(("verify (every record)", f"{verify_s:.1f} s for {verified.records:,} records"))
            before = store.statistics().bytes_used
            gc_s, deleted = timed(lambda: store.collect_garbage(stats.trained_step))
            store.close()
            reopen_s, store = timed(lambda: LmdbStore(path))
            after = store.statistics().bytes_used
            rows += [
                ("collect_garbage (trained groups)", f"{gc_s * 1e3:.0f} ms for {deleted:,} groups"),
                (
                    "store size before / after GC",
                    f"{before / 1e6:.1f} MB / {after / 1e6:.1f} MB (freed pages are reused, the file does not shrink)",
                ),
                ("reopen after GC", f"{reopen_s * 1e3:.1f} ms"),
            ]
        finally:
            store.close()
        rows += payload_costs(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(rows)


def _print(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 40}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", type=int, default=300, help="group-sized commits per store")
    parser.add_argument("--groups", type=int, default=100_000, help="groups in the store that is reopened")
    parser.add_argument("--only-payloads", action="store_true", help="measure only the R3/SC payload costs")
    parser.add_argument("--r3-layers", type=int, default=48, help="MoE layers of the routes (Qwen3-30B-A3B: 48)")
    parser.add_argument("--r3-experts", type=int, default=128, help="experts per layer (packs the routes)")
    parser.add_argument("--r3-top-k", type=int, default=8, help="experts per token per layer (Qwen3-30B-A3B: 8)")
    parser.add_argument("--sc-top-k", type=int, default=20, help="sampler heads per token")
    parser.add_argument("--payload-commits", type=int, default=20, help="group-sized commits with and without payloads")
    parser.add_argument("--dir", default=None, help="where to put the stores (default: a temporary folder)")
    main(parser.parse_args())
