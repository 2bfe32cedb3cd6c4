"""An LMDB store's batches and the trainer's progress: `take_batch` (READY -> BATCHED, recorded
under its step), `finish_batch` (the step's commit: BATCHED -> TRAINED with its metrics record),
the records read back, and `collect_garbage` of trained steps. Each method is one transaction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lmdb

from core.errors import CorruptRecordError
from core.types import Batch

from . import codec, keys
from . import transitions as tr
from .lmdb_checksums import damaged_groups
from .lmdb_ready import ReadyCache
from .lmdb_transactions import LmdbTransactions
from .lmdb_txn import Txn
from .protocol import GroupState, decode_step_metrics, encode_step_metrics
from .seal import unseal

__all__ = ["BatchMoves"]

_READY, _BATCHED = GroupState.READY, GroupState.BATCHED


class BatchMoves:
    """`tx`'s batches and the trainer's commits; a batch is served from `ready` where it can be."""

    def __init__(self, tx: LmdbTransactions, ready: ReadyCache) -> None:
        self._tx, self._ready = tx, ready

    def take_batch(self, step: int, size: int) -> Batch | None:
        tr.check_batch_size(size)
        step_key = keys.step_key(step)

        def fn(w: Txn) -> Batch | None:
            existing = w.get(keys.BATCHES, step_key)
            if existing is not None:
                return w.batch_from_ref(step_key, existing)
            if step <= w.trained_step:
                raise tr.already_trained(step, w.trained_step)
            if w.counts[_READY] < size:
                return None
            served = w.serve(_READY, size, self._ready)
            if len(served) < size:  # damaged records were quarantined: too few are left
                return None
            ids, groups = [gid for gid, _, _ in served], [group for _, _, group in served]
            for gid, old, _ in served:
                w.move(gid, old, _BATCHED, old[1], old[2])
            w.put(keys.BATCHES, step_key, codec.encode_batch_ref(step, ids))
            return Batch(step=step, groups=tuple(groups))

        def committed(batch: Batch | None) -> None:  # these groups are BATCHED now, no longer READY
            self._ready.forget(batch.groups if batch is not None else ())

        return self._tx.write(fn, committed)

    def finish_batch(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        step_key = keys.step_key(step)
        record = None if metrics is None else encode_step_metrics(step, metrics)

        def fn(w: Txn) -> None:
            raw = w.get(keys.BATCHES, step_key)
            if raw is None and 0 <= step <= w.collected[1]:  # finished, then collected: a late retry
                return
            if raw is None:
                raise tr.no_batch(step)
            if step <= w.trained_step:  # finished already: a retry after a crash
                return
            earliest = w.first_open_step()
            if earliest is not None and earliest < step:
                raise tr.out_of_order(step, earliest)
            _, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
            for gid in ids:
                old = w.expect(gid, _BATCHED)
                w.move(gid, old, GroupState.TRAINED, old[1], old[2])
            w.put(keys.META, keys.META_TRAINED_STEP, keys.i64_value(step))
            if record is not None:  # with the commit: a step is trained exactly when its record is stored
                w.put(keys.META, keys.step_metrics_key(step), record)
            w.trained_step = step

        self._tx.write(fn)

    def step_metrics(self, first: int = 0) -> dict[int, dict[str, Any]]:
        def fn(txn: lmdb.Transaction) -> dict[int, dict[str, Any]]:
            out: dict[int, dict[str, Any]] = {}
            cursor = txn.cursor(db=self._tx.dbs[keys.META])
            if cursor.set_range(keys.step_metrics_key(first)):
                for key, raw in cursor.iternext(keys=True, values=True):
                    if not bytes(key).startswith(keys.META_STEP_METRICS):
                        break
                    step = keys.parse_step_key(bytes(key)[len(keys.META_STEP_METRICS) :])
                    where = keys.describe(keys.META, bytes(key))
                    payload = unseal(bytes(key), bytes(raw), where=where, sealed=self._tx.sealed)
                    out[step] = decode_step_metrics(payload, key=where)
            return out

        return self._tx.read(fn)

    def batch(self, step: int, *, damaged: list[CorruptRecordError] | None = None) -> Batch | None:
        """With `damaged`, as in `groups`: damaged groups are listed there and left out of the batch."""
        step_key = keys.step_key(step)

        def fn(txn: lmdb.Transaction) -> Batch | None:
            w = self._tx.view(txn)
            raw = w.get(keys.BATCHES, step_key)
            if raw is None:
                return None
            step_read, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
            return Batch(step=step_read, groups=tuple(w.readable(ids, damaged)))

        return self._tx.read(fn)

    def damaged_in_batch(self, step: int) -> list[tuple[str, CorruptRecordError]] | None:
        step_key = keys.step_key(step)

        def fn(txn: lmdb.Transaction) -> list[tuple[str, CorruptRecordError]] | None:
            w = self._tx.view(txn)
            raw = w.get(keys.BATCHES, step_key)
            if raw is None:
                return None
            _, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
            return damaged_groups(txn, w.dbs[keys.GROUPS], ids, sealed=w.sealed)

        return self._tx.read_views(fn)

    def collect_garbage(self, up_to_step: int) -> int:
        def fn(w: Txn) -> int:
            tr.check_collect(up_to_step, w.trained_step)
            done, last = w.collected
            if up_to_step <= last:
                return 0
            batches = w.dbs[keys.BATCHES]
            cursor = w.txn.cursor(db=batches)
            steps = []
            if cursor.set_range(keys.step_key(last + 1)):
                for step_key, raw in cursor.iternext(keys=True, values=True):
                    if keys.parse_step_key(bytes(step_key)) > up_to_step:
                        break
                    steps.append((bytes(step_key), w.unseal(keys.BATCHES, bytes(step_key), bytes(raw))))
            deleted = 0
            for step_key, raw in steps:
                step, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
                for gid in ids:
                    old = w.expect(gid, GroupState.TRAINED)
                    key = keys.group_key(gid)
                    w.txn.delete(key, db=w.dbs[keys.GROUPS])
                    w.txn.delete(key, db=w.dbs[keys.STATE])
                    w.txn.delete(keys.by_state_key(old[0], gid), db=w.dbs[keys.BY_STATE])
                    w.put(keys.TOMBSTONES, key, keys.i64_value(step))
                    w.counts[GroupState.TRAINED] -= 1
                    deleted += 1
                w.txn.delete(step_key, db=batches)
            w.collected = (done + deleted, up_to_step)
            w.put(keys.META, keys.META_COLLECTED, keys.collected_value(*w.collected))
            return deleted

        return self._tx.write(fn)
