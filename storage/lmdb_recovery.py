"""An LMDB store's recovery and integrity: `recover` after an unclean stop, `seed` from a salvage,
`coverage` (what a checkpoint records), damaged groups quarantined and requeued, failed groups
and trained groups a resume cannot train again requeued, and `verify`.

Every value is sealed (`storage.seal`: layout version + CRC-32 over key and payload) and checked
on every read. A group whose record fails its checksum is never served: `claim_partial` and
`take_batch` move it to QUARANTINED and serve the next one (`Txn.serve`); `quarantine_damaged`
finds them all up front. Each method but `verify` is one transaction."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lmdb

from core.types import Batch, Group

from . import codec, keys
from . import transitions as tr
from .lmdb_checksums import damaged_groups
from .lmdb_pages import check_data_file, walk_pages
from .lmdb_transactions import LmdbTransactions, stored_counters
from .lmdb_txn import Txn
from .lmdb_verify import verify_records
from .protocol import Coverage, Cursor, GroupState, RecoveryReport, VerifyReport, encode_step_metrics

__all__ = ["Recovery"]

_RUNNING, _PARTIAL, _READY, _BATCHED = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.BATCHED
_TRAINED, _QUARANTINED = GroupState.TRAINED, GroupState.QUARANTINED


class Recovery:
    """Recovery and integrity of `tx`'s store."""

    def __init__(self, tx: LmdbTransactions) -> None:
        self._tx = tx

    def recover(self) -> RecoveryReport:
        def fn(w: Txn) -> RecoveryReport:
            running = w.ids_in_state(_RUNNING)
            for gid in running:  # leased or not: after a restart no producer holds anything
                old = w.expect(gid, _RUNNING)
                w.move(gid, old, _PARTIAL, old[1], old[2])
            # Batches after the trained step never reached a checkpoint: their groups go back to READY.
            open_batches = []
            cursor = w.txn.cursor(db=w.dbs[keys.BATCHES])
            if cursor.set_range(keys.step_key(w.trained_step + 1)):
                open_batches = [(bytes(k), bytes(v)) for k, v in cursor.iternext(keys=True, values=True)]
            requeued = 0
            for step_key, value in open_batches:
                raw = w.unseal(keys.BATCHES, step_key, value)
                _, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
                for gid in ids:
                    old = w.expect(gid, _BATCHED)
                    w.move(gid, old, _READY, old[1], old[2])
                    requeued += 1
                w.txn.delete(step_key, db=w.dbs[keys.BATCHES])
            return RecoveryReport(running_to_partial=len(running), batched_to_ready=requeued)

        return self._tx.write(fn)

    def seed(
        self,
        cursor: Cursor,
        trained_step: int,
        *,
        partial: Sequence[Group] = (),
        ready: Sequence[Group] = (),
        replay: Sequence[tuple[Batch, Mapping[str, Any] | None]] = (),
    ) -> None:
        records = [(g, _PARTIAL, codec.encode_group(g)) for g in partial]
        records += [(g, _READY, codec.encode_group(g)) for g in ready]
        records += [(g, _TRAINED, codec.encode_group(g)) for batch, _ in replay for g in batch.groups]
        batches = [
            (
                keys.step_key(batch.step),
                codec.encode_batch_ref(batch.step, [g.group_id for g in batch.groups]),
                None if metrics is None else encode_step_metrics(batch.step, metrics),
            )
            for batch, metrics in replay
        ]
        cursor_record = codec.encode_cursor(cursor)

        def fn(w: Txn) -> None:
            held = sum(w.counts.values()) + w.txn.stat(w.dbs[keys.TOMBSTONES])["entries"]
            tr.check_seed(trained_step, held, w.trained_step, [batch.step for batch, _ in replay])
            for group, state, data in records:
                gid = group.group_id
                if not w.put(keys.GROUPS, keys.group_key(gid), data, overwrite=False):
                    raise tr.duplicate_in_admit(gid)
                w.move(gid, None, state, group.oldest_version, group.seq)
            for (batch, _), (step_key, ref, metrics) in zip(replay, batches, strict=True):
                w.put(keys.BATCHES, step_key, ref)
                if metrics is not None:
                    w.put(keys.META, keys.step_metrics_key(batch.step), metrics)
            w.put(keys.META, keys.META_CURSOR, cursor_record)
            w.put(keys.META, keys.META_TRAINED_STEP, keys.i64_value(trained_step))
            # The steps before the seeded batches have no batches here: nothing to collect.
            w.collected = (0, trained_step - len(replay))
            w.put(keys.META, keys.META_COLLECTED, keys.collected_value(*w.collected))
            w.cursor, w.trained_step = cursor, trained_step

        self._tx.write(fn)

    def coverage(self, step: int) -> Coverage:
        def fn(txn: lmdb.Transaction) -> Coverage:
            w = self._tx.view(txn)
            unsettled = [gid for state in (_RUNNING, _PARTIAL, _READY) for gid in w.ids_in_state(state)]
            # A quarantined group's prompt is settled once requeued (the new group says the rest).
            unsettled += [gid for gid in w.ids_in_state(_QUARANTINED) if w.state_of(tr.requeue_id(gid)) is None]
            # The batches of later steps (trained, or taken): BATCHED groups of `step` are settled.
            later = w.txn.cursor(db=w.dbs[keys.BATCHES])
            if later.set_range(keys.step_key(step + 1)):
                for step_key, raw in later.iternext(keys=True, values=True):
                    payload = w.unseal(keys.BATCHES, bytes(step_key), bytes(raw))
                    unsettled += codec.decode_batch_ref(payload, key=keys.describe(keys.BATCHES, bytes(step_key)))[1]
            # The cursor of this same transaction (a writer's own copy may be a group commit ahead).
            return Coverage(step, stored_counters(w)[1], tuple(unsettled))

        return self._tx.read(fn)

    def quarantine_damaged(self) -> int:
        """Every group that can still be served (RUNNING, PARTIAL, READY, BATCHED) read and checked;
        those whose records are damaged move to QUARANTINED. Returns how many moved. A launcher
        runs it on open, so a damaged prompt is requeued before the run, not found mid-run."""
        # The checksum only (decoding every group would cost 10x more), read where LMDB keeps the
        # record (`buffers`: no copy first), in a read transaction: the work in flight is the
        # bulk of a resume's reading, gigabytes with long answers and R3 routes.
        damaged = self._tx.read_views(self._damaged_servable)
        if not damaged:
            return 0

        def fn(w: Txn) -> int:
            for gid, state in damaged:
                old = w.expect(gid, state)  # nothing else runs on open: as the read found it
                w.move(gid, old, GroupState.QUARANTINED, old[1], old[2])
            return len(damaged)

        return self._tx.write(fn)

    def _damaged_servable(self, txn: lmdb.Transaction) -> list[tuple[str, GroupState]]:
        w = self._tx.view(txn)
        state_of = {gid: state for state in (_RUNNING, _PARTIAL, _READY, _BATCHED) for gid in w.ids_in_state(state)}
        damaged = damaged_groups(txn, self._tx.dbs[keys.GROUPS], state_of, sealed=w.sealed)
        return [(gid, state_of[gid]) for gid, _ in damaged]

    def requeue_quarantined(self, fresh: Callable[[str], Group | None]) -> int:
        return len(self._requeue(lambda w: w.ids_in_state(_QUARANTINED), fresh))

    def requeue_failed(self, fresh: Callable[[str], Group | None]) -> int:
        return len(self._requeue(lambda w: w.ids_in_state(GroupState.FAILED), fresh))

    def requeue_trained(self, group_ids: Sequence[str], fresh: Callable[[str], Group | None]) -> list[str]:
        def trained(w: Txn) -> list[str]:
            for gid in group_ids:
                w.expect(gid, _TRAINED)
            return list(group_ids)

        return self._requeue(trained, fresh)

    def _requeue(self, ids: Callable[[Txn], Iterable[str]], fresh: Callable[[str], Group | None]) -> list[str]:
        def fn(w: Txn) -> list[str]:
            requeued = []
            for gid in ids(w):
                new_id = tr.requeue_id(gid)
                key = keys.group_key(new_id)
                if w.state_of(new_id) is not None or w.get(keys.TOMBSTONES, key) is not None:
                    continue
                if (group := fresh(gid)) is None:
                    continue
                group = dataclasses.replace(group, group_id=new_id)
                w.put(keys.GROUPS, key, codec.encode_group(group))
                w.move(new_id, None, _PARTIAL, group.oldest_version, group.seq)
                requeued.append(new_id)
            return requeued

        return self._tx.write(fn)

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Every record read and checked, every index checked (see `storage.lmdb_verify`);
        `progress(n)` is told the bytes of each value read."""
        data_file = os.path.join(self._tx.path, "data.mdb")
        pages = [f"{data_file}: {p}" for p in check_data_file(data_file)]
        if not pages:
            pages = [f"the {tree} tree is damaged: {why}" for tree, why in walk_pages(data_file).items()]
        if pages:  # LMDB must not walk a damaged tree (it reads past pages): report only these
            return VerifyReport(0, tuple(pages))
        tx = self._tx
        counts = tx.counters()[0]

        def records(env: lmdb.Environment) -> VerifyReport:
            return verify_records(env, tx.dbs, sealed=tx.sealed, counts=counts, progress=progress)

        # (a live writer may move on between the two reads: verify a stopped run)
        report = tx.under_lock(records)
        return VerifyReport(report.records, (*pages, *report.damaged))
