"""LMDB's own structure, checked before LMDB sees it: the two meta pages of `data.mdb`.

LMDB trusts its file. A damaged meta page makes `lmdb.open` fail with whatever the damaged field
leads to ("Cannot allocate memory" for a map size of exabytes, MDB_INVALID, MDB_CORRUPTED), or
worse, succeed on a meta page that points at garbage. Reading the two pages (8 KB) and checking
every field LMDB relies on costs microseconds, so every open does it, and a damaged file is named
as such, with the page and the field, instead of as an out-of-memory error.

The meta page layout (lmdb.h, 64-bit builds, format version 1), after the 16-byte page header
(pgno u64, pad u16, flags u16, lower/upper u16): magic u32, version u32, address u64, mapsize u64,
two MDB_db records of 48 bytes (free list, main; the free list's `md_pad` holds the page size),
last page number u64, transaction id u64.

`DAMAGE_ERRORS` are the lmdb exceptions that mean damaged bytes or another format. Any other lmdb
error (disk full, permissions, lock table, limits) is the machine's problem, not the store's.
"""

from __future__ import annotations

import os
import struct

import lmdb

__all__ = ["DAMAGE_ERRORS", "check_data_file", "is_damage", "meta_page_size"]

DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (
    lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError,
    lmdb.PanicError, lmdb.IncompatibleError, lmdb.BadValsizeError, lmdb.BadChecksumError,
)

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_P_META = 0x08
_P_INVALID = (1 << 64) - 1
_HEADER = struct.Struct("<QHHHH")
_META = struct.Struct("<IIQQ")
_DB = struct.Struct("<IHHQQQQQ")
_TAIL = struct.Struct("<QQ")
_DB_AT = _HEADER.size + _META.size
_TAIL_AT = _DB_AT + 2 * _DB.size
_MAX_DEPTH = 64  # a B-tree of 2^64 entries is far shallower


def is_damage(exc: BaseException) -> bool:
    """Whether an lmdb error means the file is damaged. ENOMEM on open counts: that is what a
    damaged map size or page number looks like from outside."""
    if isinstance(exc, DAMAGE_ERRORS):
        return True
    return isinstance(exc, lmdb.MemoryError) or "Cannot allocate memory" in str(exc)


def check_data_file(path: str) -> list[str]:
    """What is wrong with the meta pages of `path` (a `data.mdb`); empty if nothing.

    A file that does not exist is not checked (LMDB will create it)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(2 * 65536)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"it cannot be read: {exc}"]
    if size < 2 * 512:
        return [f"the file is {size} bytes, too short to hold LMDB's two meta pages"]
    psize = _page_size(head)
    if psize is None:
        return ["neither meta page holds a valid page size (both meta pages are damaged)"]
    if size < 2 * psize:
        return [f"the file is {size} bytes, too short for two meta pages of {psize} bytes"]
    problems = []
    for page in (0, 1):
        problems += _check_meta(head[page * psize : (page + 1) * psize], page, psize, size, path)
    return problems


def meta_page_size(path: str) -> int | None:
    """The page size one of the file's meta pages gives; None if neither does."""
    with open(path, "rb") as fh:
        return _page_size(fh.read(2 * 65536))


def _page_size(head: bytes) -> int | None:
    # Page 0 starts the file; page 1 starts at the page size, which page 0 (or a guess) gives.
    for offset in (0, 4096, 8192, 16384, 32768, 65536):
        if len(head) < offset + _TAIL_AT:
            break
        psize = _DB.unpack_from(head, offset + _DB_AT)[0]
        magic = _META.unpack_from(head, offset + _HEADER.size)[0]
        if magic == _MAGIC and 512 <= psize <= 65536 and psize & (psize - 1) == 0:
            if offset in (0, psize):
                return psize
    return None


def _check_meta(page: bytes, number: int, psize: int, size: int, path: str) -> list[str]:
    where = f"{os.path.basename(path)} meta page {number}"
    pgno, _, flags, _, _ = _HEADER.unpack_from(page)
    magic, version, _, mapsize = _META.unpack_from(page, _HEADER.size)
    free_db, main_db = _DB.unpack_from(page, _DB_AT), _DB.unpack_from(page, _DB_AT + _DB.size)
    last_pg, txnid = _TAIL.unpack_from(page, _TAIL_AT)
    checks = [
        (pgno == number, f"page number {pgno}"),
        (flags & _P_META, f"page flags {flags:#x} lack the meta flag"),
        (magic == _MAGIC, f"magic {magic:#x}, expected {_MAGIC:#x}"),
        (version == _DATA_VERSION, f"format version {version}, expected {_DATA_VERSION}"),
        (free_db[0] == psize, f"page size {free_db[0]}, the other meta page says {psize}"),
        (last_pg >= 1 and (last_pg + 1) * psize <= size,
         f"last page {last_pg} is past the end of the {size}-byte file (truncated, or a damaged field)"),
        (mapsize >= (last_pg + 1) * psize and mapsize <= 1 << 48, f"map size {mapsize} does not fit its last page {last_pg}"),
        (txnid < 1 << 62, f"transaction id {txnid}"),
    ]
    for name, db in (("free-list", free_db), ("main", main_db)):
        depth, root = db[2], db[7]
        checks.append((root == _P_INVALID or 2 <= root <= last_pg, f"{name} root page {root} is outside 2..{last_pg}"))
        checks.append((depth <= _MAX_DEPTH, f"{name} tree depth {depth}"))
    return [f"{where}: {why}" for ok, why in checks if not ok]
