"""Group records checked by their checksums alone, where LMDB keeps them: what a resume reads
before it serves or trains anything again (the work in flight, the batches since the checkpoint),
gigabytes with long answers and R3 routes, so it reads them once, at the disk's pace.

The transaction must be a reader opened with `buffers=True` (`LmdbTransactions.read_views`): its
values are views of the map, valid until it ends. The checksums run on worker threads (zlib lets
go of the GIL) while the calling thread goes on asking LMDB for the next record.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import lmdb

from core.errors import CorruptRecordError

from . import keys
from .seal import sealed_payload

__all__ = ["CHECK_THREADS", "damaged_groups"]

# Threads that checksum (and, in `verify`, decode) records while the caller reads on.
CHECK_THREADS = min(8, os.cpu_count() or 1)


def damaged_groups(
    txn: lmdb.Transaction, db: lmdb._Database, ids: Iterable[str], *, sealed: bool
) -> list[tuple[str, CorruptRecordError]]:
    """(group id, error) for each group record among `ids` that is missing or fails its checksum,
    in the order of `ids`."""

    def check(gid: str, value: bytes | memoryview | None) -> CorruptRecordError | None:
        key = keys.group_key(gid)
        where = keys.describe(keys.GROUPS, key)
        try:
            if value is None:
                raise CorruptRecordError(where, "missing")
            sealed_payload(key, value, where=where, sealed=sealed)
        except CorruptRecordError as exc:
            return exc
        return None

    with ThreadPoolExecutor(max_workers=CHECK_THREADS) as pool:
        checks = [(gid, pool.submit(check, gid, txn.get(keys.group_key(gid), db=db))) for gid in ids]
        return [(gid, error) for gid, c in checks if (error := c.result()) is not None]
