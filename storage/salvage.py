"""Reading what can still be read from a damaged LMDB store, record by record.

`salvage_store(path)` opens a store that `LmdbStore` refused (a damaged meta page, a record that
fails its checksum, counters that disagree) read-only and without LMDB's lock file, so the folder's
bytes stay exactly as they were, and reads each thing on its own: a damaged cursor does not cost
the trained step, a damaged group does not cost the others, a damaged groups tree does not cost
the batch records. The result seeds a fresh store (`Store.seed`); `problems` says what was lost
and why. What to make of it (which steps to train again, which prompts to generate again) is the
launcher's decision (`pipeline.run.reconcile`), which also knows what the checkpoint covers.

A damaged meta page is repaired in a temporary copy, never in place: LMDB keeps two meta pages and
writes them in turn, and the pages of the older commit stay intact until the commit after next, so
when one meta page is damaged the other still describes a whole, consistent tree (the last commit,
or the one before it). The copy costs one read and one write of the file.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lmdb

from core.errors import (
    IncompatibleStoreError,
    StoreCorruptionError,
    StoreError,
    StoreLockedError,
)
from core.types import Group

from . import codec, keys
from .lmdb_pages import check_data_file, meta_page_size, walk_pages
from .migrate import Databases, parse_layout
from .protocol import Cursor, GroupState, decode_step_metrics
from .seal import LAYOUT_VERSION, LEGACY_LAYOUT, unseal

__all__ = ["Salvage", "salvage_store", "unreadable_reason"]

_UNFINISHED_TO_PARTIAL = frozenset({GroupState.RUNNING, GroupState.PARTIAL})
_UNFINISHED_TO_READY = frozenset({GroupState.READY, GroupState.BATCHED})  # an open batch goes back to READY


@dataclass(frozen=True, slots=True)
class Salvage:
    """What could still be read from a store moved aside; None where that record is unreadable."""

    cursor: Cursor | None
    trained_step: int | None
    problems: tuple[str, ...]  # why each missing piece is missing
    partial: tuple[Group, ...] = ()  # readable unfinished groups (RUNNING and PARTIAL), prefixes kept
    ready: tuple[Group, ...] = ()  # readable finished, untrained groups (READY, and BATCHED of open steps)
    damaged: tuple[str, ...] = ()  # ids of unfinished groups whose records are damaged: their prompts go again
    # The state index could not be read: nothing above says which groups were unfinished, and
    # the fields below that come from the states are empty.
    groups_lost: bool = False
    settled: frozenset[str] = frozenset()  # REJECTED and FAILED groups: nothing to train or generate again
    quarantined: frozenset[str] = frozenset()  # QUARANTINED groups (their prompts were requeued, or are due)
    trained_ids: frozenset[str] | None = None  # TRAINED groups; None when the states are unreadable
    # The batch records, by step: the ids each step trained (or an open step took). None when the
    # batches tree is damaged; `unreadable_steps` are the records that fail their checksum.
    batches: Mapping[int, tuple[str, ...]] | None = None
    unreadable_steps: tuple[int, ...] = ()
    collected_step: int | None = -1  # batches of steps up to it were garbage collected; None: unreadable
    # For the steps after `salvage_store`'s `replay_after` (a checkpoint's step) up to the trained
    # step: each batch's readable groups, in order, and its metrics record, to train them again;
    # `replay_damaged` names the groups of those batches whose records cannot be read.
    replay: Mapping[int, tuple[Group, ...]] = field(default_factory=dict)
    replay_metrics: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    replay_damaged: tuple[str, ...] = ()


def salvage_store(path: str | os.PathLike[str], *, replay_after: int | None = None) -> Salvage:
    """Everything readable from the store at `path`, each record read on its own. With
    `replay_after` (the step of the checkpoint a resume loads), the groups and metrics records of
    the batches of the steps after it are read too (`Salvage.replay`)."""
    path = os.fspath(path)
    try:
        with _readable_copy(path) as (where, repaired):
            salvage = _read_env(where, replay_after)
    except (lmdb.Error, OSError, StoreError) as exc:
        return _nothing(f"{path} does not open: {exc}")
    if repaired:
        note = f"{repaired}; read from the other meta page (the last commit or the one before it)"
        return dataclasses.replace(salvage, problems=(note, *salvage.problems))
    return salvage


def _nothing(*problems: str) -> Salvage:
    """Nothing read: no cursor, no trained step, no group's state (`groups_lost`: an empty
    salvage must not read as a store whose states say nothing was in flight)."""
    return Salvage(None, None, problems, groups_lost=True)


def unreadable_reason(exc: StoreError) -> str | None:
    """Why a store that failed to open counts as unreadable (move it aside, salvage it), or None
    (stop the run, leave the store where it is).

    Unreadable: damaged bytes of any kind (`StoreCorruptionError`: a record, a meta page, LMDB's
    own errors, counters that disagree), another layout, or the store's own consistency checks
    failing (a StoreError of its own, with no cause). Not unreadable: another controller holds it,
    it belongs to another run (a fingerprint differs), or the machine failed it (disk full,
    permissions, lock limits): moving a sound store aside would hide it.
    """
    if isinstance(exc, StoreLockedError):
        return None
    if isinstance(exc, IncompatibleStoreError):
        return str(exc) if exc.field in ("schema_version", "layout_version") else None
    if isinstance(exc, StoreCorruptionError) or exc.__cause__ is None:
        return str(exc)
    return None


@contextmanager
def _readable_copy(path: str) -> Iterator[tuple[str, str]]:
    """`path` itself, or a temporary copy whose one damaged meta page is replaced by the other."""
    data = os.path.join(path, "data.mdb")
    if not os.path.exists(data):
        raise StoreError(f"there is no data.mdb in {path}")
    problems = check_data_file(data)
    pages = {p for p in (0, 1) for problem in problems if f"meta page {p}:" in problem}
    psize = meta_page_size(data)
    # Repairable: every problem is about one meta page, and the page size is known.
    if len(pages) != 1 or psize is None or not all(f"meta page {min(pages)}:" in p for p in problems):
        yield path, ""
        return
    bad = min(pages)
    with tempfile.TemporaryDirectory(prefix="rollout-salvage-") as tmp:
        copy = os.path.join(tmp, "data.mdb")
        shutil.copyfile(data, copy)
        with open(copy, "r+b") as fh:
            fh.seek((1 - bad) * psize)
            good = bytearray(fh.read(psize))
            good[0:8] = bad.to_bytes(8, "little")  # the page number is the only field that differs
            fh.seek(bad * psize)
            fh.write(good)
        yield tmp, f"meta page {bad} is damaged ({'; '.join(problems)})"


def _read_env(path: str, replay_after: int | None) -> Salvage:
    # LMDB must never walk a damaged tree (a damaged node sends it reading past its page): the
    # trees are walked in Python first, and a damaged one is not read at all.
    data = os.path.join(path, "data.mdb")
    problems = check_data_file(data)
    if any("past the end" not in p for p in problems):  # a truncated file is walked: the rest is not
        return _nothing(*(f"nothing can be read: {p}" for p in problems))
    damaged = walk_pages(data)
    if "main" in damaged or "meta" in damaged:
        tree = "main" if "main" in damaged else "meta"
        return _nothing(f"the {tree} tree is damaged, so nothing can be found: {damaged[tree]}")
    env = lmdb.open(path, readonly=True, lock=False, subdir=True, create=False, max_dbs=len(keys.DATABASES))
    try:
        with env.begin() as txn:
            dbs = {name: env.open_db(name, txn=txn, create=False) for name in keys.DATABASES}
            salvage = _read(txn, dbs, lost={name.encode() for name in damaged}, replay_after=replay_after)
    finally:
        env.close()
    lost = tuple(f"the {tree} tree is damaged and was not read: {why}" for tree, why in damaged.items())
    return dataclasses.replace(salvage, problems=(*lost, *salvage.problems))


def _read(txn: lmdb.Transaction, dbs: Databases, *, lost: set[bytes], replay_after: int | None) -> Salvage:
    meta = dbs[keys.META]
    raw_layout = txn.get(keys.META_LAYOUT, db=meta)
    layout = (
        LEGACY_LAYOUT
        if raw_layout is None
        else parse_layout(bytes(raw_layout), where=keys.describe(keys.META, keys.META_LAYOUT))
    )
    if layout > LAYOUT_VERSION:
        newer = (
            f"the store has layout {layout}, written by a newer rollout-pipeline; this version reads layouts "
            f"{LEGACY_LAYOUT} to {LAYOUT_VERSION} and reads nothing from it"
        )
        return _nothing(newer)
    sealed = layout == LAYOUT_VERSION
    problems: list[str] = []

    def read(db: bytes, key: bytes) -> bytes | None:
        raw = txn.get(key, db=dbs[db])
        return None if raw is None else unseal(key, raw, where=keys.describe(db, key), sealed=sealed)

    cursor: Cursor | None = Cursor()  # a store that never admitted anything has no cursor record
    try:
        if (raw := read(keys.META, keys.META_CURSOR)) is not None:
            cursor = codec.decode_cursor(raw, key=keys.describe(keys.META, keys.META_CURSOR))
    except (StoreError, lmdb.Error) as exc:
        cursor = None
        problems.append(f"cursor: {exc}")
    trained: int | None = -1
    try:
        if (raw := read(keys.META, keys.META_TRAINED_STEP)) is not None:
            trained = keys.parse_i64(raw, key=keys.describe(keys.META, keys.META_TRAINED_STEP))
    except (StoreError, lmdb.Error) as exc:
        trained = None
        problems.append(f"trained step: {exc}")
    collected: int | None = -1
    try:
        if (raw := read(keys.META, keys.META_COLLECTED)) is not None:
            collected = keys.parse_collected(raw)[1]
    except (StoreError, lmdb.Error) as exc:
        collected = None
        problems.append(f"garbage collection record: {exc}")
    batches, unreadable = _batches(txn, dbs, read, problems) if keys.BATCHES not in lost else (None, ())
    salvage = Salvage(cursor, trained, (), batches=batches, unreadable_steps=unreadable, collected_step=collected)
    if keys.STATE in lost:
        problems.append("no group's state is known: the state index cannot be read")
        salvage = dataclasses.replace(salvage, groups_lost=True)
    else:
        records_lost = keys.GROUPS in lost
        salvage = _groups(txn, dbs, read, problems, salvage, sealed=sealed, records_lost=records_lost)
    if replay_after is not None and trained is not None and batches is not None and keys.GROUPS not in lost:
        salvage = _replay(read, problems, salvage, range(replay_after + 1, trained + 1))
    return dataclasses.replace(salvage, problems=tuple(problems))


def _batches(
    txn: lmdb.Transaction, dbs: Databases, read: Callable[[bytes, bytes], bytes | None], problems: list[str]
) -> tuple[dict[int, tuple[str, ...]], tuple[int, ...]]:
    """Every readable batch record (ids only), and the steps whose records are damaged."""
    found: dict[int, tuple[str, ...]] = {}
    unreadable: list[int] = []
    try:
        for key in txn.cursor(db=dbs[keys.BATCHES]).iternext(keys=True, values=False):
            step = keys.parse_step_key(bytes(key))
            try:
                raw = read(keys.BATCHES, bytes(key))
                assert raw is not None  # the key was just listed
                found[step] = tuple(codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, bytes(key)))[1])
            except StoreError as exc:
                problems.append(f"the batch of step {step}: {exc}")
                unreadable.append(step)
    except (StoreError, lmdb.Error) as exc:  # a damaged page ends the walk: keep what came before it
        problems.append(f"the batch records are damaged after {len(found)} steps: {exc}")
    return found, tuple(unreadable)


def _replay(
    read: Callable[[bytes, bytes], bytes | None], problems: list[str], salvage: Salvage, steps: range
) -> Salvage:
    """The readable groups and the metrics record of each batch of `steps`, to train them again."""
    assert salvage.batches is not None
    replay: dict[int, tuple[Group, ...]] = {}
    records: dict[int, Mapping[str, Any]] = {}
    damaged: list[str] = []
    for step in steps:
        if step not in salvage.batches:
            continue
        groups = []
        for gid in salvage.batches[step]:
            key = keys.group_key(gid)
            try:
                raw = read(keys.GROUPS, key)
                if raw is None:
                    raise StoreError(f"group {gid!r} is in the batch of step {step} but has no record")
                groups.append(codec.decode_group(raw, key=keys.describe(keys.GROUPS, key)))
            except (StoreError, lmdb.Error) as exc:
                problems.append(f"group {gid} (trained at step {step}): {exc}")
                damaged.append(gid)
        replay[step] = tuple(groups)
        key = keys.step_metrics_key(step)
        try:
            if (raw := read(keys.META, key)) is not None:
                records[step] = decode_step_metrics(raw, key=keys.describe(keys.META, key))
        except (StoreError, lmdb.Error) as exc:  # trained again with today's split and its step's version
            problems.append(f"the metrics record of step {step}: {exc}")
    return dataclasses.replace(salvage, replay=replay, replay_metrics=records, replay_damaged=tuple(damaged))


def _groups(
    txn: lmdb.Transaction,
    dbs: Databases,
    read: Callable[[bytes, bytes], bytes | None],
    problems: list[str],
    salvage: Salvage,
    *,
    sealed: bool,
    records_lost: bool,
) -> Salvage:
    """Every group's state, and the unfinished groups, each read on its own; a damaged one (every
    one, when the groups tree is damaged: `records_lost`) is named in `damaged`."""
    entries: list[tuple[str, GroupState]] = []
    try:
        for key, value in txn.cursor(db=dbs[keys.STATE]).iternext(keys=True, values=True):
            where = keys.describe(keys.STATE, bytes(key))
            try:
                payload = unseal(bytes(key), value, where=where, sealed=sealed)
                state = keys.parse_state_entry(payload, key=where)[0]
            except StoreError as exc:
                problems.append(f"a group's state: {exc}")
                continue
            entries.append((bytes(key).decode(errors="replace"), state))
    except lmdb.Error as exc:  # a damaged page ends the walk: keep what came before it
        problems.append(f"the state index is damaged after {len(entries)} groups: {exc}")
    partial: list[Group] = []
    ready: list[Group] = []
    damaged: list[str] = []
    by_state: dict[GroupState, set[str]] = {state: set() for state in GroupState}
    for gid, state in entries:
        by_state[state].add(gid)
        if state not in _UNFINISHED_TO_PARTIAL | _UNFINISHED_TO_READY:
            continue  # trained, rejected, failed, quarantined: nothing to serve again
        key = keys.group_key(gid)
        if records_lost:
            damaged.append(gid)
            continue
        try:
            raw = read(keys.GROUPS, key)
            if raw is None:
                raise StoreError(f"group {gid!r} is indexed but has no record")
            group = codec.decode_group(raw, key=keys.describe(keys.GROUPS, key))
        except (StoreError, lmdb.Error) as exc:
            problems.append(f"group {gid} ({state.value}): {exc}")
            damaged.append(gid)
            continue
        (partial if state in _UNFINISHED_TO_PARTIAL else ready).append(group)
    return dataclasses.replace(
        salvage,
        partial=tuple(partial),
        ready=tuple(ready),
        damaged=tuple(damaged),
        settled=frozenset(by_state[GroupState.REJECTED] | by_state[GroupState.FAILED]),
        quarantined=frozenset(by_state[GroupState.QUARANTINED]),
        trained_ids=frozenset(by_state[GroupState.TRAINED]),
    )
