"""Sealed values: every value the LMDB store writes carries its layout version and a checksum.

LMDB checksums nothing, so a flipped bit in a data page is found only when something decodes the
record, and then as whatever exception the decoder happens to raise (or not at all: a damaged
float decodes fine). A sealed value is

    [1 byte: layout version][4 bytes: CRC-32 of key + payload, big-endian][payload]

The key is inside the checksum, so a value that ends up under another key (a damaged leaf page
that still parses) fails too. CRC-32 (zlib, in C) runs at several GB/s: sealing a 100 KB group
record costs a few microseconds against ~100 us to encode it, so every read checks it.

Empty values (the index databases, whose content is the key) are not sealed: there is nothing to
check, and `LmdbStore.verify` checks the indexes against the state entries instead.

Layout 1 (the stores written before checksums) has raw values; `unseal(..., sealed=False)` reads
them as they are, and a writer migrates such a store to layout 2 when it opens it.
"""

from __future__ import annotations

import struct
import zlib

from core.errors import CorruptRecordError

__all__ = ["LAYOUT_VERSION", "LEGACY_LAYOUT", "OVERHEAD", "seal", "sealed_payload", "unseal"]

LAYOUT_VERSION = 2  # the on-disk layout this code writes: sealed values
LEGACY_LAYOUT = 1  # raw values, no checksums: read as they are, migrated by a writer
_HEAD = struct.Struct(">BI")
OVERHEAD = _HEAD.size


def seal(key: bytes, payload: bytes) -> bytes:
    """`payload` as stored under `key`: layout version, checksum, payload."""
    return _HEAD.pack(LAYOUT_VERSION, zlib.crc32(payload, zlib.crc32(key))) + payload


def unseal(key: bytes | memoryview, value: bytes | memoryview, *, where: str, sealed: bool = True) -> bytes:
    """The payload of a sealed value. CorruptRecordError (naming `where`) if the value is damaged.

    `where` is the key as errors show it (`groups/e0000-p000000001`, see `keys.describe`).
    `sealed=False` reads a layout-1 value, which has nothing to check.
    """
    if not sealed:
        return bytes(value)
    return bytes(sealed_payload(key, value, where=where, sealed=sealed))


def sealed_payload(
    key: bytes | memoryview, value: bytes | memoryview, *, where: str, sealed: bool = True
) -> memoryview:
    """`unseal` without the copy: a view of the payload inside `value`, checked. For a reader of
    a transaction opened with `buffers=True`, whose values are views of the map: the checksum then
    reads the record where LMDB keeps it, once (`replay verify`, the resume's check of what can be
    served). The view is valid only while that transaction is open and the value unchanged."""
    view = memoryview(value)
    if not sealed:
        return view
    if len(view) < _HEAD.size:
        raise CorruptRecordError(
            where, f"a sealed value of {len(view)} bytes is shorter than its {_HEAD.size}-byte head"
        )
    version, stored = _HEAD.unpack_from(view)
    if version != LAYOUT_VERSION:
        raise CorruptRecordError(where, f"layout version byte {version}, expected {LAYOUT_VERSION}")
    payload = view[_HEAD.size :]
    computed = zlib.crc32(payload, zlib.crc32(key))
    if computed != stored:
        raise CorruptRecordError(where, f"checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")
    return payload
