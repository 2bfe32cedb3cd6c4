"""How an LMDB store runs its transactions: one store method, one transaction, and group commit.

`LmdbStore` owns one `LmdbTransactions` and hands it to each of its parts (`lmdb_groups`,
`lmdb_leases`, `lmdb_batches`, `lmdb_recovery`): it holds the environment, the lock and the
writer's in-memory counters, and runs `write` and `read` over them. A method hands `write` a
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
from .lmdb_txn import Txn
from .migrate import counter_problems
from .protocol import Cursor, GroupState, StoreStatistics

__all__ = ["LmdbTransactions", "Outcome", "stored_collected", "stored_counters"]

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

    def __init__(self, path: str, *, readonly: bool) -> None:
        self._path = path
        self._readonly = readonly
        self._dbs: dict[bytes, lmdb._Database] = {}
        self._page_size = 0
        self._sealed = True
        # Reentrant: `run_grouped` holds it across the calls it runs, which take it again.
        self._lock = threading.RLock()
        self._group: _Group | None = None
        self._env: lmdb.Environment | None = None
        self._transactions = 0
        self._bytes_used = 0
        self._map_size = 0
        self._counts: dict[GroupState, int] = dict.fromkeys(GroupState, 0)
        self._cursor, self._trained_step = Cursor(), -1
        self._collected = (0, -1)

    @property
    def path(self) -> str:
        return self._path

    @property
    def dbs(self) -> dict[bytes, lmdb._Database]:
        """The databases by name (`keys.DATABASES`, and the optional ones the store has)."""
        return self._dbs

    @property
    def sealed(self) -> bool:
        """Whether values carry a checksum (`storage.seal`): False only for a reader of a layout-1 store."""
        return self._sealed

    # --- opening and closing --------------------------------------------------------------------

    def open(self, env: lmdb.Environment) -> None:
        """Take `env` (closed by `close` from here on, even if opening its databases fails)."""
        self._env = env
        self._dbs = {name: env.open_db(name, create=not self._readonly) for name in keys.DATABASES}
        self._dbs.update(env_.open_optional(env, readonly=self._readonly))
        self._page_size = env.stat()["psize"]

    def load(self, *, sealed: bool) -> None:
        """The counters as the store holds them, checked against its records; transactions are
        counted from here (stamping or migrating the layout is not the caller's transaction)."""
        self._sealed = sealed
        self._counts, self._cursor, self._trained_step = self.read(lambda txn: stored_counters(self.view(txn)))
        self._collected = self.read(lambda txn: stored_collected(self.view(txn)))
        self.read(self._check_counters)
        self._note_size()
        self._transactions = 0

    def close(self, *, then: Callable[[], None]) -> None:
        """Close the environment, then run `then` (what the store holds beside it), both under the
        lock: no transaction is running, and none starts after."""
        with self._lock:
            env, self._env = self._env, None
            if env is not None:
                env.close()
            then()

    def under_lock(self, fn: Callable[[lmdb.Environment], T]) -> T:
        """`fn` of the environment, no transaction of this store running meanwhile."""
        with self._lock:
            return fn(self._open_env())

    # --- one method, one transaction ------------------------------------------------------------

    def write(self, fn: Callable[[Txn], T], committed: Callable[[T], None] | None = None) -> T:
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
                        w = self.view(txn)
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

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        return self._read(fn, buffers=False)

    def read_views(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """`read`, with the transaction's values views of the map, not copies (`buffers`): for a
        reader that checks records where LMDB keeps them. A reader's view stays valid until its
        transaction ends (nothing writes under it), so `fn` must return none. Inside a group
        commit, a separate read transaction would not see the group's writes: then the group's
        own (copies)."""
        return self._read(fn, buffers=True)

    def _read(self, fn: Callable[[lmdb.Transaction], T], *, buffers: bool) -> T:
        with self._lock:
            if self._group is not None:  # read the group's own transaction: it sees the calls before
                try:
                    return fn(self._group.w.txn)
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
            env = self._open_env()
            for _ in range(3):
                try:
                    with env.begin(buffers=True) if buffers else env.begin() as txn:
                        return fn(txn)
                except lmdb.MapResizedError:
                    env.set_mapsize(0)  # the writer (another process) grew the map: adopt its size
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
            raise StoreError(f"rollout store {self._path}: the map keeps being resized under a reader")

    def view(self, txn: lmdb.Transaction) -> Txn:
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
        self._group = group = _Group(self.view(txn))
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

    def _check_counters(self, txn: lmdb.Transaction) -> None:
        """The counters against the records, in O(1): LMDB keeps each database's entry count."""
        entries = {name: txn.stat(self._dbs[name])["entries"] for name in keys.DATABASES}
        counts = stored_counters(self.view(txn))[0]  # the same snapshot: a live writer may have moved on
        if problems := counter_problems(counts, entries):
            raise StoreCorruptionError(keys.describe(keys.META, keys.META_COUNTS), "; ".join(problems))

    def counters(self) -> tuple[dict[GroupState, int], Cursor, int]:
        """The group counts, the cursor and the trained step, as the next call will see them."""
        # The writer is the only one changing the store, so its copies are the truth. A read-only
        # store may be watching a live writer in another process: read fresh.
        if self._readonly:
            return self.read(lambda txn: stored_counters(self.view(txn)))
        self._open_env()
        if (group := self._group) is not None:
            return group.w.counts, group.w.cursor, group.w.trained_step
        return self._counts, self._cursor, self._trained_step

    def statistics(self) -> StoreStatistics:
        """Cheap for a writer: its counters live in memory, so no transaction (and no lock wait)."""
        if self._readonly:
            counts, cursor, trained = self.counters()
            collected = self.read(lambda txn: stored_collected(self.view(txn)))
            self._note_size()
        else:
            self._open_env()
            counts, cursor, trained, collected = self._counts, self._cursor, self._trained_step, self._collected
        return StoreStatistics(
            counts=dict(counts),
            cursor=cursor,
            trained_step=trained,
            transactions=self._transactions,
            bytes_used=self._bytes_used,
            collected=collected[0],
            collected_step=collected[1],
            map_size=self._map_size,
        )

    def _note_size(self) -> None:
        with self._lock:
            if self._env is not None:
                self._bytes_used = self._used_bytes(self._env)

    def _used_bytes(self, env: lmdb.Environment) -> int:
        info = env.info()
        self._map_size = info["map_size"]
        return (info["last_pgno"] + 1) * self._page_size


def stored_counters(r: Txn) -> tuple[dict[GroupState, int], Cursor, int]:
    """The group counts, the cursor and the trained step as `r`'s transaction reads them."""
    raw_counts = r.get(keys.META, keys.META_COUNTS)
    counts = dict.fromkeys(GroupState, 0) if raw_counts is None else keys.parse_counts(raw_counts)
    raw_cursor = r.get(keys.META, keys.META_CURSOR)
    cursor = (
        Cursor()
        if raw_cursor is None
        else codec.decode_cursor(raw_cursor, key=keys.describe(keys.META, keys.META_CURSOR))
    )
    raw_step = r.get(keys.META, keys.META_TRAINED_STEP)
    trained = -1 if raw_step is None else keys.parse_i64(raw_step, key=keys.describe(keys.META, keys.META_TRAINED_STEP))
    return counts, cursor, trained


def stored_collected(r: Txn) -> tuple[int, int]:
    """(groups collected, last step collected) as `r`'s transaction reads them."""
    raw = r.get(keys.META, keys.META_COLLECTED)
    return (0, -1) if raw is None else keys.parse_collected(raw)


def _outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return call(), None
    except Exception as exc:
        return None, exc
