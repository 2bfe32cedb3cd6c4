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

LMDB does not check its branch and leaf pages either: a damaged node size sends it reading past
its page (past the end of the file, a SIGBUS that kills the process). So `walk_pages` walks every
tree from the newest meta page in Python, before LMDB does, and checks every page and node it
reaches against the file: page numbers, flags, node offsets and sizes, child and overflow page
numbers. Values (the records) are not read; their checksums are the store's business.

`DAMAGE_ERRORS` are the lmdb exceptions that mean damaged bytes or another format. Any other lmdb
error (disk full, permissions, lock table, limits) is the machine's problem, not the store's.
"""

from __future__ import annotations

import mmap
import os
import struct

import lmdb

__all__ = ["DAMAGE_ERRORS", "check_data_file", "is_damage", "meta_page_size", "walk_pages"]

DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
    lmdb.IncompatibleError,
    lmdb.BadValsizeError,
    lmdb.BadChecksumError,
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
        if magic == _MAGIC and 512 <= psize <= 65536 and psize & (psize - 1) == 0 and offset in (0, psize):
            return int(psize)
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
        (
            last_pg >= 1 and (last_pg + 1) * psize <= size,
            f"last page {last_pg} is past the end of the {size}-byte file (truncated, or a damaged field)",
        ),
        (
            mapsize >= (last_pg + 1) * psize and mapsize <= 1 << 48,
            f"map size {mapsize} does not fit its last page {last_pg}",
        ),
        (txnid < 1 << 62, f"transaction id {txnid}"),
    ]
    for name, db in (("free-list", free_db), ("main", main_db)):
        depth, root = db[2], db[7]
        checks.append((root == _P_INVALID or 2 <= root <= last_pg, f"{name} root page {root} is outside 2..{last_pg}"))
        checks.append((depth <= _MAX_DEPTH, f"{name} tree depth {depth}"))
    return [f"{where}: {why}" for ok, why in checks if not ok]


_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_NODE = struct.Struct("<HHHH")
_PGNO = struct.Struct("<Q")


def walk_pages(path: str, *, main_keys: list[str] | None = None) -> dict[str, str]:
    """Every tree of `path` (a `data.mdb` whose meta pages passed `check_data_file`) walked from the
    newest meta page: {tree name: what is wrong} for each damaged tree, empty if none is.

    Tree names are "free-list", "main" and the named databases. A damaged main tree hides the
    named ones (their roots live in it). `main_keys`, when given, receives every key of the main
    tree (the named databases, and any plain key another program put there)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return {}
        # Mapped, not read: only the branch and leaf pages are touched, never the records'
        # overflow pages. Every offset is checked against the file's size first (no SIGBUS).
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            if hasattr(mmap, "MADV_RANDOM"):  # Linux: a fault reads its page, not megabytes around it
                # (the kernel's read-around, 8 MB on the development VM, pulled in the records
                # beside each tree page: 4 s of a 45 GB store's resume, before this)
                mapped.madvise(mmap.MADV_RANDOM)
            view = memoryview(mapped)
            try:
                return _walk(view, main_keys)
            finally:
                view.release()


def _walk(data: memoryview, main_keys: list[str] | None = None) -> dict[str, str]:
    psize = _page_size(bytes(data[: 2 * 65536]))
    assert psize is not None, "check_data_file first"
    metas = [bytes(data[p * psize : (p + 1) * psize]) for p in (0, 1)]
    newest = max(metas, key=lambda page: _TAIL.unpack_from(page, _TAIL_AT)[1])
    last_pg = _TAIL.unpack_from(newest, _TAIL_AT)[0]
    walker = _Walker(data, psize, last_pg)
    damaged: dict[str, str] = {}
    roots = (("free-list", _DB.unpack_from(newest, _DB_AT)), ("main", _DB.unpack_from(newest, _DB_AT + _DB.size)))
    for name, db in roots:
        subs: list[tuple[str, int]] = []
        if (problem := walker.tree(db[7], subs if name == "main" else None)) is not None:
            damaged[name] = problem
            continue
        for sub_name, root in subs:
            if (problem := walker.tree(root, None)) is not None:
                damaged[sub_name] = problem
    if main_keys is not None:
        main_keys.extend(walker.main_keys)
    return damaged


class _Walker:
    def __init__(self, data: memoryview, psize: int, last_pg: int) -> None:
        self.data, self.psize, self.last_pg = data, psize, last_pg
        self.seen: set[int] = set()
        self.main_keys: list[str] = []  # every key of the main tree (a handful: it names the databases)

    def tree(self, root: int, subs: list[tuple[str, int]] | None) -> str | None:
        """None if every page under `root` is sound, else what is wrong (the first problem)."""
        if root == _P_INVALID:
            return None
        stack = [(root, 0)]
        while stack:
            pgno, depth = stack.pop()
            if depth > _MAX_DEPTH:
                return f"the tree is deeper than {_MAX_DEPTH} at page {pgno} (a loop of pages)"
            problem = self.page(pgno, depth, stack, subs)
            if problem is not None:
                return f"page {pgno}: {problem}"
        return None

    def page(
        self, pgno: int, depth: int, stack: list[tuple[int, int]], subs: list[tuple[str, int]] | None
    ) -> str | None:
        if not 2 <= pgno <= self.last_pg:
            return f"page number outside 2..{self.last_pg}"
        if (pgno + 1) * self.psize > len(self.data):
            return "the page is past the end of the file (truncated)"
        if pgno in self.seen:
            return "reached twice (pages shared between trees, or a loop)"
        self.seen.add(pgno)
        base, psize = pgno * self.psize, self.psize
        stored, _, flags, lower, upper = _HEADER.unpack_from(self.data, base)
        kind = flags & (_P_BRANCH | _P_LEAF)
        if stored != pgno or kind not in (_P_BRANCH, _P_LEAF) or flags & _P_OVERFLOW:
            return f"header says page {stored} with flags {flags:#x}"
        if not (_HEADER.size <= lower <= upper <= psize) or (lower - _HEADER.size) % 2:
            return f"node area {lower}..{upper} does not fit the page"
        n = (lower - _HEADER.size) // 2
        offsets = struct.unpack_from(f"<{n}H", self.data, base + _HEADER.size)
        if n and (min(offsets) < upper or max(offsets) > psize - _NODE.size):
            return f"a node offset ({min(offsets)}..{max(offsets)}) is outside the node area {upper}..{psize}"
        unpack, data, node_size = _NODE.unpack_from, self.data, _NODE.size
        for i, offset in enumerate(offsets):
            lo, hi, nflags, ksize = unpack(data, base + offset)
            end = offset + node_size + ksize
            if kind == _P_BRANCH:
                if end > psize:
                    return f"branch node {i} has a {ksize}-byte key past the page"
                stack.append((lo | hi << 16 | nflags << 32, depth + 1))
            elif nflags or end + (lo | hi << 16) > psize or subs is not None:  # else a value inline
                problem = self.leaf_node(i, base, offset, end, lo | hi << 16, nflags, ksize, subs)
                if problem is not None:
                    return problem
        return None

    def leaf_node(
        self,
        i: int,
        base: int,
        offset: int,
        end: int,
        dsize: int,
        nflags: int,
        ksize: int,
        subs: list[tuple[str, int]] | None,
    ) -> str | None:
        if subs is not None:  # the main tree
            self.main_keys.append(bytes(self.data[base + offset + _NODE.size : base + end]).decode(errors="replace"))
        if nflags & _F_BIGDATA:
            if end + 8 > self.psize:
                return f"leaf node {i} overruns the page"
            first = _PGNO.unpack_from(self.data, base + end)[0]
            pages = -(-(dsize + _HEADER.size) // self.psize)
            if not 2 <= first <= first + pages - 1 <= self.last_pg:
                return f"leaf node {i} points to overflow pages {first}..{first + pages - 1}, outside 2..{self.last_pg}"
            if (first + pages) * self.psize > len(self.data):
                return f"leaf node {i} points to overflow pages past the end of the file (truncated)"
            over = first * self.psize
            if _HEADER.unpack_from(self.data, over)[2] & _P_OVERFLOW == 0:
                return f"leaf node {i} points to page {first}, which is not an overflow page"
            return None
        if end + dsize > self.psize:
            return f"leaf node {i} has {ksize}+{dsize} bytes of key and value, past the page"
        if nflags & _F_SUBDATA and subs is not None:
            if dsize != _DB.size:
                return f"leaf node {i} names a database with a {dsize}-byte record"
            name = bytes(self.data[base + offset + _NODE.size : base + end]).decode(errors="replace")
            subs.append((name, _DB.unpack_from(self.data, base + end)[7]))
        return None
