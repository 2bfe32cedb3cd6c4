"""Reading what can still be read from a damaged LMDB store, record by record.

`salvage_store(path)` opens a store that `LmdbStore` refused (a damaged meta page, a record that
fails its checksum, counters that disagree) read-only and without LMDB's lock file, so the folder's
bytes stay exactly as they were, and reads each thing on its own: a damaged cursor does not cost
the trained step, a damaged group does not cost the others. The result seeds a fresh store
(`Store.seed`); `problems` says what was lost and why.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
from .protocol import Cursor, GroupState
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
    # The groups or their states could not be read, so which prompts below the cursor were
    # unfinished is unknown. `trained_ids` then holds the groups the batch records of steps
    # 0..trained_step name (the prompts trained for sure), or None where those records are gone
    # too (`trained_unknown` says why): the launcher decides what to do with the rest.
    groups_lost: bool = False
    trained_ids: frozenset[str] | None = None
    trained_unknown: str = ""


def salvage_store(path: str | os.PathLike[str]) -> Salvage:
    """Everything readable from the store at `path`, each record read on its own."""
    path = os.fspath(path)
    try:
        with _readable_copy(path) as (where, repaired):
            salvage = _read_env(where)
    except (lmdb.Error, OSError, StoreError) as exc:
        return Salvage(None, None, (f"{path} does not open: {exc}",))
    if repaired:
        note = f"{repaired}; read from the other meta page (the last commit or the one before it)"
        return dataclasses.replace(salvage, problems=(note, *salvage.problems))
    return salvage


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


def _read_env(path: str) -> Salvage:
    # LMDB must never walk a damaged tree (a damaged node sends it reading past its page): the
    # trees are walked in Python first, and a damaged one is not read at all.
    data = os.path.join(path, "data.mdb")
    problems = check_data_file(data)
    if any("past the end" not in p for p in problems):  # a truncated file is walked: the rest is not
        return Salvage(None, None, tuple(f"nothing can be read: {p}" for p in problems))
    damaged = walk_pages(data)
    if "main" in damaged or "meta" in damaged:
        tree = "main" if "main" in damaged else "meta"
        return Salvage(None, None, (f"the {tree} tree is damaged, so nothing can be found: {damaged[tree]}",))
    env = lmdb.open(path, readonly=True, lock=False, subdir=True, create=False, max_dbs=len(keys.DATABASES))
    try:
        with env.begin() as txn:
            dbs = {name: env.open_db(name, txn=txn, create=False) for name in keys.DATABASES}
            salvage = _read(txn, dbs, lost={name.encode() for name in damaged})
    finally:
        env.close()
    lost = tuple(f"the {tree} tree is damaged and was not read: {why}" for tree, why in damaged.items())
    return dataclasses.replace(salvage, problems=(*lost, *salvage.problems))


def _read(txn: lmdb.Transaction, dbs: Databases, *, lost: set[bytes]) -> Salvage:
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
        return Salvage(None, None, (newer,))
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
    if cursor is None:
        problems.append("no group is carried over: with the cursor unknown, the dataset starts again")
        return Salvage(cursor, trained, tuple(problems))
    if lost & {keys.STATE, keys.GROUPS}:
        problems.append("no group is carried over: the groups or their states cannot be read")
        trained_ids, unknown = _trained_ids(txn, dbs, read, trained, lost)
        return Salvage(
            cursor, trained, tuple(problems), groups_lost=True, trained_ids=trained_ids, trained_unknown=unknown
        )
    partial, ready, damaged = _groups(txn, dbs, read, problems, sealed=sealed)
    return Salvage(cursor, trained, tuple(problems), tuple(partial), tuple(ready), tuple(damaged))


def _trained_ids(
    txn: lmdb.Transaction,
    dbs: Databases,
    read: Callable[[bytes, bytes], bytes | None],
    trained: int | None,
    lost: set[bytes],
) -> tuple[frozenset[str] | None, str]:
    """The groups the batch records of steps 0..`trained` name, or (None, why not)."""
    if trained is None:
        return None, "the last trained step is unreadable"
    if keys.BATCHES in lost:
        return None, "the batches tree is damaged too"
    try:
        raw = read(keys.META, keys.META_COLLECTED)
        collected = -1 if raw is None else keys.parse_collected(raw)[1]  # batches 0..collected are gone
    except (StoreError, lmdb.Error) as exc:
        return None, f"the garbage collection record is unreadable ({exc})"
    if collected >= 0:
        return None, (
            f"the batch records of steps 0..{collected} are not in this store (garbage collected, or in a store "
            "moved aside before)"
        )
    ids: set[str] = set()
    for step in range(trained + 1):
        key = keys.step_key(step)
        try:
            raw = read(keys.BATCHES, key)
            if raw is None:
                return None, f"the batch record of step {step} is missing"
            ids.update(codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, key))[1])
        except (StoreError, lmdb.Error) as exc:
            return None, f"the batch record of step {step} is unreadable ({exc})"
    return frozenset(ids), ""


def _groups(
    txn: lmdb.Transaction,
    dbs: Databases,
    read: Callable[[bytes, bytes], bytes | None],
    problems: list[str],
    *,
    sealed: bool,
) -> tuple[list[Group], list[Group], list[str]]:
    """The unfinished groups, each read on its own; a damaged one is named in `damaged`."""
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
    for gid, state in entries:
        if state not in _UNFINISHED_TO_PARTIAL | _UNFINISHED_TO_READY:
            continue  # trained, rejected, failed, quarantined: nothing to serve again
        key = keys.group_key(gid)
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
    return partial, ready, damaged
