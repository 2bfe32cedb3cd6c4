"""The store's layout record, the migration from layout 1 (no checksums), and the counter check.

Layout 1 stores (written before values were sealed) are migrated, not kept as they are: the first
writer to open one reseals every value in one transaction and stamps layout 2, so a writer only
ever writes one format. A read-only open (replay) reads a layout-1 store as it is, unchecked.
Migration reads and rewrites every value once: about as long as writing the store took, once.

The layout record is the one value whose form never changes, so that any later version can tell
which layout it is looking at: layout 1 wrote 8 bytes (an offset-binary i64, see `storage.keys`);
layout 2 and later write a big-endian i64 and the CRC-32 of key + that i64 (12 bytes).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeAlias

import lmdb

from core.errors import CorruptRecordError

from . import keys
from .protocol import GroupState
from .seal import LAYOUT_VERSION, seal

__all__ = ["SEALED_DATABASES", "Databases", "counter_problems", "layout_value", "migrate_to_sealed", "parse_layout"]

if TYPE_CHECKING:
    from lmdb import _Database

Databases: TypeAlias = "Mapping[bytes, _Database]"  # database name -> handle, as `LmdbStore` opens them
_LAYOUT = struct.Struct(">qI")
# Databases whose values are sealed; the others (indexes) hold b"" and are checked by their keys.
SEALED_DATABASES = (keys.META, keys.GROUPS, keys.STATE, keys.BATCHES, keys.LEASES, keys.TOMBSTONES)


def layout_value(version: int) -> bytes:
    body = struct.pack(">q", version)
    return body + struct.pack(">I", zlib.crc32(body, zlib.crc32(keys.META_LAYOUT)))


def parse_layout(raw: bytes, *, where: str) -> int:
    if len(raw) == 8:  # layout 1
        return keys.parse_i64(raw, key=where)
    if len(raw) != _LAYOUT.size:
        raise CorruptRecordError(where, f"a layout record of {len(raw)} bytes, expected 8 or {_LAYOUT.size}")
    version, stored = _LAYOUT.unpack(raw)
    computed = zlib.crc32(raw[:8], zlib.crc32(keys.META_LAYOUT))
    if stored != computed:
        raise CorruptRecordError(where, f"checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")
    return int(version)


def migrate_to_sealed(txn: lmdb.Transaction, dbs: Databases) -> None:
    """Reseal every value of a layout-1 store and stamp layout 2, in the caller's one transaction."""
    for name in SEALED_DATABASES:
        db = dbs[name]
        items = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db).iternext(keys=True, values=True)]
        for key, value in items:
            if name == keys.META and key == keys.META_LAYOUT:
                continue
            txn.put(key, seal(key, value), db=db)
    txn.put(keys.META_LAYOUT, layout_value(LAYOUT_VERSION), db=dbs[keys.META])


def counter_problems(counts: Mapping[GroupState, int], entries: Mapping[bytes, int]) -> list[str]:
    """Where the per-state counters disagree with the entry counts LMDB keeps per database."""
    total = sum(counts.values())
    expected = {
        keys.GROUPS: total,
        keys.STATE: total,
        keys.BY_STATE: total,
        keys.LEASES: counts.get(GroupState.RUNNING, 0),
        keys.PARTIAL_ORDER: counts.get(GroupState.PARTIAL, 0),
        keys.READY_ORDER: counts.get(GroupState.READY, 0),
    }
    return [
        f"the counters say {want} but database {name.decode()!r} holds {entries[name]} entries"
        for name, want in expected.items()
        if entries[name] != want
    ]
