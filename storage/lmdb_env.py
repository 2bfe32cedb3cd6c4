"""Opening an LMDB store's environment: its settings, the writer's lock, and the checks made
before LMDB reads a byte of it.

One writer. LMDB allows one write transaction at a time per environment, but nothing stops two
processes from each believing they own the run, so a writer holds an exclusive `flock` on
`writer.lock` in the store directory (which records who holds it) for as long as it is open. A
read-only store takes no lock and never writes; it is for replay and inspection.

Before LMDB opens the file, its meta pages and every tree's pages are walked in Python
(`storage.lmdb_pages`), and a file another program wrote is refused (`not_a_rollout_store`):
LMDB itself would read past a damaged page, or add its databases to someone else's file.
"""

from __future__ import annotations

import fcntl
import os
import socket
from typing import Any

import lmdb

from core.errors import IncompatibleStoreError, StoreCorruptionError, StoreError, StoreLockedError

from . import keys
from .lmdb_pages import check_data_file, walk_pages

__all__ = [
    "LOCK_FILE",
    "MAX_MAP_SIZE",
    "check_before_open",
    "data_file",
    "open_env",
    "open_optional",
    "release_writer_lock",
    "take_writer_lock",
    "writer_alive",
]

LOCK_FILE = "writer.lock"
MAX_MAP_SIZE = 1 << 40  # 1 TiB: past this, a full map is a bug or a disk problem, not growth


def data_file(path: str) -> str:
    return os.path.join(path, "data.mdb")


def check_before_open(path: str, *, readonly: bool) -> None:
    """Refuse a damaged file (StoreCorruptionError) or another program's (IncompatibleStoreError)
    before LMDB opens it.

    The page checks read the file outside LMDB's reader table, so they run only when no writer
    is changing it: a writer (this one holds the lock), or a reader of a store nobody writes."""
    file = data_file(path)
    problems = [] if readonly and writer_alive(path) else check_data_file(file)
    main_keys: list[str] | None = None
    if not problems and os.path.exists(file) and not (readonly and writer_alive(path)):
        main_keys = []
        walked = walk_pages(file, main_keys=main_keys)
        problems = [f"the {tree} tree is damaged: {why}" for tree, why in walked.items()]
    if problems:
        raise StoreCorruptionError(file, "; ".join(problems))
    if main_keys is not None and (foreign := not_a_rollout_store(path, main_keys, readonly=readonly)):
        raise foreign


def open_env(path: str, *, map_size: int, sync: bool, readonly: bool) -> lmdb.Environment:
    """The environment with every rollout database's slot. `sync=False` trades durability of the
    last transactions on an OS crash for speed (a process crash still loses nothing committed)."""
    options: dict[str, Any] = dict(
        map_size=map_size,
        max_dbs=len(keys.DATABASES) + len(keys.OPTIONAL_DATABASES),
        subdir=True,
        readonly=readonly,
        sync=sync,
    )
    try:
        return lmdb.open(path, create=not readonly, metasync=sync, lock=True, **options)
    except lmdb.Error:
        if not readonly:
            raise
    # A reader registers itself in lock.mdb, which needs a writable directory. An archived store on
    # read-only media has no writer to guard against: read it without LMDB's reader table.
    return lmdb.open(path, create=False, lock=False, **options)


def open_optional(env: lmdb.Environment, *, readonly: bool) -> dict[bytes, Any]:
    """The optional databases (`keys.OPTIONAL_DATABASES`): a writer creates them; a reader opens
    those the store has (a store from before one existed has none, and reads as empty there)."""
    found = {}
    for name in keys.OPTIONAL_DATABASES:
        try:
            found[name] = env.open_db(name, create=not readonly)
        except lmdb.NotFoundError:
            continue
    return found


def not_a_rollout_store(path: str, main_keys: list[str], *, readonly: bool) -> IncompatibleStoreError | None:
    """The error for an LMDB file another program wrote (its main tree holds keys no rollout store
    writes), or one a reader cannot use (it lacks the rollout databases); None for a rollout store,
    or an empty file a writer is about to fill. Checked before LMDB opens it: a writer would add
    its databases to the other program's file, a reader would fail on LMDB's MDB_NOTFOUND."""
    ours = {name.decode() for name in keys.DATABASES}
    optional = {name.decode() for name in keys.OPTIONAL_DATABASES}
    others = sorted(set(main_keys) - ours - optional)
    missing = sorted(ours - set(main_keys)) if readonly else []
    if not others and not missing:
        return None
    if others:
        reason = (
            f"{path} is not a rollout store: it holds {others}, which no rollout store writes; "
            "point the store at another directory (its data was left as it was)"
        )
    else:  # a store of the first layouts (fewer databases), or an empty LMDB file
        reason = f"{path} lacks the databases {missing} that a reader of this version opens"
        reason += " (a store from an early version that no writer has opened since, or not a rollout store)"
    return IncompatibleStoreError("databases", sorted(main_keys), sorted(ours), reason=reason)


def writer_alive(path: str) -> bool:
    """Whether a writer holds `<path>/writer.lock` now (a shared flock would wait for it)."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing the descriptor releases a shared lock it got
    return False


def take_writer_lock(path: str) -> int:
    """An exclusive, non-blocking flock on `<path>/writer.lock`, which then names its holder."""
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"cannot create the writer lock {lock_path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
        holder = holder or "another process (it has not named itself yet)"
        os.close(fd)
        raise StoreLockedError(path, holder) from None
    except OSError as exc:
        os.close(fd)
        raise StoreError(f"cannot lock {lock_path}: {exc}") from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return fd


def release_writer_lock(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)  # no stale holder shown after a clean close
    finally:
        os.close(fd)  # closing the descriptor releases the flock
