"""How an LMDB store runs its transactions: one store method, one transaction, and group commit.

`LmdbTransactions` is the base every concern of `LmdbStore` builds on (`lmdb_groups`,
`lmdb_leases`, `lmdb_batches`, `lmdb_recovery`): it holds the environment, the lock and the
writer's in-memory counters, and gives them `_write` and `_read`. A method hands `_write` a
function of one `Txn`; the function's writes commit together or not at all.

Where the cost hides: with `sync=True` every transaction ends in an fsync (about a millisecond on a
local SSD). The map is a virtual reservation: it starts at `map_size` and doubles whenever a
transaction finds it full (the transaction is aborted, the map grown, and the transaction run
again from the start, so a full map never loses a write).

Group commit (`run_grouped`): several calls share one write transaction and so one fsync, which
is what a synced store spends most of its time on. Each call stays all-or-nothing: a call that
raises after writing aborts the shared transaction, which is then run again without it (the
others are deterministic in the store's state, so their second run writes what the first did);
every other call gets its own result, and nothing is acknowledged before the commit is on disk.
Reads and counters inside a group see the writes of the calls before them, as they would one
transaction after another.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import lmdb

from core.errors import StoreCorruptionError, StoreError

from . import codec, keys
from . import lmdb_env as env_
from .lmdb_pages import DAMAGE_ERRORS
from .lmdb_ready import ReadyCache
from .lmdb_txn import Txn
from .protocol import Cursor, GroupState

__all__ = ["LmdbTransactions", "Outcome"]

T = TypeVar("T")
# One call's outcome in a group: (its result, None) or (None, what it raised).
Outcome = tuple[Any, Exception | None]


class _Group:
    """The write transaction that several calls share (`LmdbTransactions.run_grouped`)."""

    __slots__ = ("committed", "w", "wrote")

    def __init__(self, w: Txn) -> None:
        self.w = w
        self.wrote = False  # whether the call running now entered a write (else its failure aborts nothing)
        self.committed: list[tuple[Callable[[Any], None], Any]] = []


class LmdbTransactions:
    """The environment, the lock, the writer's counters, and the transactions over them.
    Thread-safe: every transaction holds one lock."""

    _dbs: dict[bytes, lmdb._Database]
    _page_size: int

    def __init__(self, path: str, *, readonly: bool, clock: Callable[[], float]) -> None:
        self._path = path
        self._readonly = readonly
        self._clock = clock
        self._collected = (0, -1)
        self._ready_cache = ReadyCache()
        # Reentrant: `run_grouped` holds it across the calls it runs, which take it again.
        self._lock = threading.RLock()
        self._group: _Group | None = None
        self._lock_fd: int | None = None
        self._transactions = 0
        self._bytes_used = 0
        self._map_size = 0
        self._env: lmdb.Environment | None = None
        self._sealed = True
        self._counts: dict[GroupState, int] = dict.fromkeys(GroupState, 0)
        self._cursor, self._trained_step = Cursor(), -1

    # --- one method, one transaction ------------------------------------------------------------

    def _write(self, fn: Callable[[Txn], T], committed: Callable[[T], None] | None = None) -> T:
        """Run `fn` in one write transaction; on a full map, double it and run `fn` again.

        `committed` runs once the transaction is on disk, still under the store's lock."""
        if self._readonly:
            raise StoreError(f"the rollout store {self._path} is open read-only")
        with self._lock:
            if (group := self._group) is not None:
                group.wrote = True
                try:
                    result = fn(group.w)
                except lmdb.MapFullError:
                    raise  # `run_grouped` grows the map and runs the group again
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
                if committed is not None:
                    group.committed.append((committed, result))
                return result
            env = self._open_env()
            while True:
                try:
                    with env.begin(write=True) as txn:
                        w = self._txn(txn)
                        result = fn(w)
                        if w.counts != self._counts:
                            w.put(keys.META, keys.META_COUNTS, keys.counts_value(w.counts))
                    break
                except lmdb.MapFullError:
                    self._grow(env)  # the transaction was aborted; nothing of it is stored
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
            self._adopt(w, env)
            if committed is not None:
                committed(result)
            return result

    def _read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        with self._lock:
            if self._group is not None:  # read the group's own transaction: it sees the calls before
                try:
                    return fn(self._group.w.txn)
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
            env = self._open_env()
            for _ in range(3):
                try:
                    with env.begin() as txn:
                        return fn(txn)
                except lmdb.MapResizedError:
                    env.set_mapsize(0)  # the writer (another process) grew the map: adopt its size
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
            raise StoreError(f"rollout store {self._path}: the map keeps being resized under a reader")

    def _txn(self, txn: lmdb.Transaction) -> Txn:
        """`txn` seen through `Txn`, with the counters as they are now. Its read helpers work on
        any transaction; a reader never writes through it."""
        return Txn(
            txn,
            self._dbs,
            sealed=self._sealed,
            counts=self._counts,
            cursor=self._cursor,
            trained_step=self._trained_step,
            collected=self._collected,
        )

    def _adopt(self, w: Txn, env: lmdb.Environment) -> None:
        """`w` committed: its counters are the store's now."""
        self._counts, self._cursor, self._trained_step = w.counts, w.cursor, w.trained_step
        self._collected = w.collected
        self._transactions += 1
        self._bytes_used = self._used_bytes(env)

    # --- group commit ---------------------------------------------------------------------------

    def run_grouped(self, calls: Sequence[Callable[[], Any]]) -> list[Outcome]:
        """Run `calls` (this store's methods, bound to their arguments) in order in one write
        transaction, committed (and synced) once. Returns each call's (result, None) or (None,
        error); see "Group commit" in the module docstring for what a failing call does."""
        if self._readonly or len(calls) < 2:
            return [_outcome(call) for call in calls]
        failed: dict[int, Exception] = {}
        with self._lock:
            while True:
                outcomes = self._try_group(self._open_env(), calls, failed)
                if outcomes is not None:
                    return outcomes

    def _try_group(
        self, env: lmdb.Environment, calls: Sequence[Callable[[], Any]], failed: dict[int, Exception]
    ) -> list[Outcome] | None:
        """One attempt at the group. None: it was aborted (a call failed after writing, or the
        map was full and has grown) and must run again; `failed` then holds the calls left out."""
        outcomes: list[Outcome] = []
        txn = env.begin(write=True)
        self._group = group = _Group(self._txn(txn))
        try:
            for i, call in enumerate(calls):
                if i in failed:
                    outcomes.append((None, failed[i]))
                    continue
                group.wrote = False
                try:
                    outcomes.append((call(), None))
                except lmdb.MapFullError:
                    raise
                except Exception as exc:
                    outcomes.append((None, exc))
                    if group.wrote:  # it may have written part of itself: run the rest without it
                        failed[i] = exc
                        txn.abort()
                        return None
            if group.w.counts != self._counts:
                group.w.put(keys.META, keys.META_COUNTS, keys.counts_value(group.w.counts))
            txn.commit()
        except lmdb.MapFullError:
            txn.abort()
            self._grow(env)
            return None
        except lmdb.Error as exc:  # the commit itself failed: no call in the group happened
            txn.abort()
            error = self._translate(exc)
            return [(None, error if e is None else e) for _, e in outcomes]
        except BaseException:
            txn.abort()
            raise
        finally:
            self._group = None
        self._adopt(group.w, env)
        for committed, result in group.committed:
            committed(result)
        return outcomes

    def _grow(self, env: lmdb.Environment) -> None:
        size = env.info()["map_size"]
        if size * 2 > env_.MAX_MAP_SIZE:
            raise StoreError(f"rollout store {self._path}: the map is full at {size} bytes and may not grow further")
        try:
            env.set_mapsize(size * 2)
        except lmdb.Error as exc:
            raise StoreError(f"rollout store {self._path}: cannot grow the map past {size} bytes: {exc}") from exc

    # --- the environment and the counters -------------------------------------------------------

    def _open_env(self) -> lmdb.Environment:
        if self._env is None:
            raise StoreError(f"the rollout store {self._path} is closed")
        return self._env

    def _translate(self, exc: lmdb.Error) -> StoreError:
        """An lmdb error as this library's: damaged bytes are a StoreCorruptionError, whatever the code."""
        if isinstance(exc, DAMAGE_ERRORS):
            return StoreCorruptionError(os.path.join(self._path, "data.mdb"), f"LMDB: {exc}")
        return StoreError(f"rollout store {self._path}: {exc}")

    def _load_counters(self, txn: lmdb.Transaction) -> tuple[dict[GroupState, int], Cursor, int]:
        r = self._txn(txn)
        raw_counts = r.get(keys.META, keys.META_COUNTS)
        counts = dict.fromkeys(GroupState, 0) if raw_counts is None else keys.parse_counts(raw_counts)
        raw_cursor = r.get(keys.META, keys.META_CURSOR)
        cursor = (
            Cursor()
            if raw_cursor is None
            else codec.decode_cursor(raw_cursor, key=keys.describe(keys.META, keys.META_CURSOR))
        )
        raw_step = r.get(keys.META, keys.META_TRAINED_STEP)
        trained = (
            -1 if raw_step is None else keys.parse_i64(raw_step, key=keys.describe(keys.META, keys.META_TRAINED_STEP))
        )
        return counts, cursor, trained

    def _load_collected(self, txn: lmdb.Transaction) -> tuple[int, int]:
        raw = self._txn(txn).get(keys.META, keys.META_COLLECTED)
        return (0, -1) if raw is None else keys.parse_collected(raw)

    def _counters(self) -> tuple[dict[GroupState, int], Cursor, int]:
        # The writer is the only one changing the store, so its copies are the truth. A read-only
        # store may be watching a live writer in another process: read fresh.
        if self._readonly:
            return self._read(self._load_counters)
        self._open_env()
        if (group := self._group) is not None:
            return group.w.counts, group.w.cursor, group.w.trained_step
        return self._counts, self._cursor, self._trained_step

    def _note_size(self) -> None:
        with self._lock:
            if self._env is not None:
                self._bytes_used = self._used_bytes(self._env)

    def _used_bytes(self, env: lmdb.Environment) -> int:
        info = env.info()
        self._map_size = info["map_size"]
        return (info["last_pgno"] + 1) * self._page_size


def _outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return call(), None
    except Exception as exc:
        return None, exc
