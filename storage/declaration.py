"""Where the LMDB store may live: detect the data directory's filesystem, check it against what the
deployment declares, and say how to open the store (`LmdbStore(sync=...)`).

LMDB keeps its reader table and write lock in a shared memory map (`lock.mdb`) and relies on POSIX
locks and a coherent page cache. A network filesystem (NFS, SMB, CephFS, Lustre, any FUSE
filesystem such as JuiceFS, 9p, virtiofs) gives none of that across hosts, and some not even
within one host, so an undeclared network filesystem is refused. A deployment that knows better
(one host writes the store, nothing else opens it while it runs) says so in a declaration:

    {"mount_path": "/shared/juicefs", "filesystem": "fuse.juicefs",
     "durability": {"synced_commits": true}}

passed as `--rollout-storage-declaration FILE`, or picks a preset with `--rollout-storage-profile`
(`PROFILES`: local, local-unsynced, nfs, juicefs, cephfs, lustre). The declaration records
properties of a mount that already exists; nothing here creates or changes mounts. It must agree
with what is detected: its `mount_path` must contain the data directory and its `filesystem` must
be the one the kernel reports (`/proc/self/mountinfo`, longest mount-point prefix of the resolved
path), else the error names both. `synced_commits: false` means the filesystem's fsync is not worth
waiting for (or not honoured): the store is opened with `sync=False`, so an OS or host crash may
lose the last commits (a process crash still loses nothing).

    plan = check_storage(data_dir, declaration=load_declaration(path) if path else None, profile=name)
    store = open_store("lmdb", data_dir, **plan.store_options())
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError, StoreError

__all__ = [
    "NETWORK_FILESYSTEMS",
    "PROFILES",
    "Mount",
    "StorageDeclaration",
    "StoragePlan",
    "StorageProfile",
    "check_storage",
    "find_mount",
    "is_network_filesystem",
    "load_declaration",
    "parse_declaration",
    "parse_mountinfo",
]

MOUNTINFO = "/proc/self/mountinfo"

# Filesystem types (as mountinfo spells them) on which LMDB's locking is not safe. Every `fuse.*`
# type counts too (JuiceFS is `fuse.juicefs`, s3fs `fuse.s3fs`, sshfs `fuse.sshfs`, ...).
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ncpfs",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "afs",
        "beegfs",
        "orangefs",
        "9p",
        "virtiofs",
        "fuse",
    }
)
_LOCAL_FILESYSTEMS = ("ext4", "ext3", "ext2", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay", "bcachefs")


def is_network_filesystem(filesystem: str) -> bool:
    return filesystem in NETWORK_FILESYSTEMS or filesystem.startswith("fuse.")


@dataclass(frozen=True, slots=True)
class Mount:
    mount_point: str
    filesystem: str  # "ext4", "nfs4", "fuse.juicefs"; "unknown" where the kernel could not be asked
    source: str  # the device or remote ("server:/export", "JuiceFS:myvol")


@dataclass(frozen=True, slots=True)
class StorageDeclaration:
    """What a deployment says about the mount its store lives on (see the module docstring)."""

    mount_path: str
    filesystem: str
    synced_commits: bool
    source: str = "<declaration>"  # the file it was read from, for messages


@dataclass(frozen=True, slots=True)
class StorageProfile:
    """A preset: which filesystems it covers, whether they are network ones, and their durability."""

    name: str
    filesystems: tuple[str, ...]
    network: bool
    synced_commits: bool
    note: str


PROFILES: Mapping[str, StorageProfile] = {
    p.name: p
    for p in (
        StorageProfile("local", _LOCAL_FILESYSTEMS, False, True, "a local disk; every commit is fsynced"),
        StorageProfile(
            "local-unsynced",
            _LOCAL_FILESYSTEMS,
            False,
            False,
            "a local scratch disk; commits are not fsynced (an OS crash may lose the last ones)",
        ),
        StorageProfile("nfs", ("nfs", "nfs4"), True, True, "NFS, written by this host only"),
        StorageProfile("juicefs", ("fuse.juicefs",), True, True, "JuiceFS, written by this host only"),
        StorageProfile(
            "cephfs", ("ceph", "fuse.ceph", "fuse.ceph-fuse"), True, True, "CephFS, written by this host only"
        ),
        StorageProfile("lustre", ("lustre",), True, True, "Lustre, written by this host only"),
    )
}


@dataclass(frozen=True, slots=True)
class StoragePlan:
    """The verdict: where the store is, on what, and how to open it."""

    data_dir: str  # resolved
    mount: Mount
    network: bool
    sync: bool
    declared_by: str | None  # "declaration FILE", "profile NAME", or None (a local disk, detected)

    def store_options(self) -> dict[str, Any]:
        """Keyword arguments for `open_store("lmdb", ...)` / `LmdbStore`."""
        return {"sync": self.sync}


# --- detection ----------------------------------------------------------------------------------


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in mount points as \\ooo octal escapes.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a `/proc/<pid>/mountinfo` text (see proc(5)); malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        mounts.append(Mount(_unescape(fields[4]), tail[0], _unescape(tail[1])))
    return mounts


def find_mount(path: str, mounts: Sequence[Mount]) -> Mount:
    """The mount `path` (absolute, resolved) is on: the longest mount point that is a whole-component
    prefix of it. Later mounts over the same point hide earlier ones, as in the kernel."""
    best: Mount | None = None
    for mount in mounts:
        if _contains(mount.mount_point, path) and (best is None or len(mount.mount_point) >= len(best.mount_point)):
            best = mount
    if best is None:
        return Mount("/", "unknown", "")
    return best


def _contains(directory: str, path: str) -> bool:
    directory = directory.rstrip("/") or "/"
    return directory == "/" or path == directory or path.startswith(directory + "/")


def _resolve(path: str | os.PathLike[str]) -> str:
    # The store directory may not exist yet: resolve what exists (symlinks included), keep the rest.
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _read_mountinfo() -> str | None:
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as fh:
            return fh.read()
    except OSError:
        return None  # not Linux: nothing to detect with


# --- declarations ----------------------------------------------------------------------------


def load_declaration(path: str | os.PathLike[str]) -> StorageDeclaration:
    """Reads a declaration file. ConfigError names the file and what is wrong with it."""
    where = f"--rollout-storage-declaration={os.fspath(path)!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{where}: file not found"]) from None
    except OSError as exc:
        raise ConfigError([f"{where}: cannot be read: {exc.strerror or exc}"]) from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError([f"{where}: not valid JSON: {exc}"]) from exc
    return parse_declaration(data, source=os.fspath(path))


def parse_declaration(data: Any, *, source: str = "<declaration>") -> StorageDeclaration:
    """A declaration from its JSON value; every problem is listed in one ConfigError."""
    where = f"--rollout-storage-declaration={source!r}"
    example = '{"mount_path": "/shared/fs", "filesystem": "fuse.juicefs", "durability": {"synced_commits": true}}'
    if not isinstance(data, dict):
        raise ConfigError([f"{where}: must be a JSON object like {example}"])
    problems = []
    unknown = sorted(set(data) - {"mount_path", "filesystem", "durability"})
    if unknown:
        problems.append(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (keys: mount_path, filesystem, durability)"
        )
    mount_path, filesystem, durability = data.get("mount_path"), data.get("filesystem"), data.get("durability")
    if not isinstance(mount_path, str) or not os.path.isabs(mount_path):
        problems.append(f"{where}: mount_path must be an absolute path, got {mount_path!r}")
    if not isinstance(filesystem, str) or not filesystem:
        problems.append(
            f"{where}: filesystem must name the filesystem type as the kernel reports it "
            f"(e.g. 'fuse.juicefs', 'nfs4'), got {filesystem!r}"
        )
    synced = durability.get("synced_commits") if isinstance(durability, dict) else None
    if not isinstance(synced, bool):
        problems.append(f'{where}: durability must be {{"synced_commits": true|false}}, got {durability!r}')
    elif isinstance(durability, dict) and set(durability) - {"synced_commits"}:
        extra = ", ".join(map(repr, sorted(set(durability) - {"synced_commits"})))
        problems.append(f"{where}: unknown durability key(s) {extra} (keys: synced_commits)")
    if problems or not (isinstance(mount_path, str) and isinstance(filesystem, str) and isinstance(synced, bool)):
        raise ConfigError(problems)
    return StorageDeclaration(os.path.normpath(mount_path), filesystem, synced, source)


# --- the check -------------------------------------------------------------------------------


def check_storage(
    data_dir: str | os.PathLike[str],
    *,
    declaration: StorageDeclaration | None = None,
    profile: str | None = None,
    mountinfo: str | None = None,
) -> StoragePlan:
    """Whether the LMDB store may live at `data_dir`, and with which options.

    `mountinfo` is the text of `/proc/self/mountinfo` (read when None; tests pass their own).
    Raises ConfigError when the declaration or profile disagrees with what is detected (naming
    both), and StoreError when the directory is on a network filesystem nobody declared.
    """
    path = _resolve(data_dir)
    text = _read_mountinfo() if mountinfo is None else mountinfo
    mount = find_mount(path, parse_mountinfo(text)) if text is not None else Mount("/", "unknown", "")
    detected = mount.filesystem
    network = is_network_filesystem(detected)
    on = f"{path} is on {detected} (mounted at {mount.mount_point}{f' from {mount.source}' if mount.source else ''})"

    chosen: StorageProfile | None = None
    if profile is not None:
        chosen = PROFILES.get(profile)
        if chosen is None:
            raise ConfigError([f"--rollout-storage-profile={profile!r}: must be one of {', '.join(PROFILES)}"])

    if declaration is not None:
        where = f"--rollout-storage-declaration={declaration.source!r}"
        problems = []
        if not _contains(_resolve(declaration.mount_path), path):
            problems.append(
                f"{where}: mount_path {declaration.mount_path!r} does not contain the rollout data directory {path!r}"
            )
        if detected != "unknown" and declaration.filesystem != detected:
            problems.append(f"{where}: declares filesystem {declaration.filesystem!r}, but {on}")
        if chosen is not None and declaration.filesystem not in chosen.filesystems:
            problems.append(
                f"{where}: declares filesystem {declaration.filesystem!r}, but "
                f"--rollout-storage-profile={chosen.name!r} covers {', '.join(chosen.filesystems)}"
            )
        if problems:
            raise ConfigError(problems)
        return StoragePlan(path, mount, network, declaration.synced_commits, f"declaration {declaration.source}")

    if chosen is not None:
        if detected != "unknown" and detected not in chosen.filesystems:
            raise ConfigError(
                [
                    f"--rollout-storage-profile={chosen.name!r} covers "
                    f"{', '.join(chosen.filesystems)}, but {on}{_suggest(detected)}"
                ]
            )
        return StoragePlan(path, mount, network, chosen.synced_commits, f"profile {chosen.name}")

    if network:
        by_profile = _suggest(detected, " with")
        raise StoreError(
            f"the rollout store directory {on}, a network filesystem: LMDB's locks and shared lock map "
            "are not safe there. Put --rollout-data-dir on a local disk, or, if this host alone writes the "
            f"store, declare it{by_profile}{' or' if by_profile else ''} with --rollout-storage-declaration FILE "
            f'holding {{"mount_path": "{mount.mount_point}", "filesystem": "{detected}", '
            '"durability": {"synced_commits": true}}'
        )
    return StoragePlan(path, mount, network, True, None)


def _suggest(filesystem: str, lead: str = "; use") -> str:
    """`lead` + the profile flag that covers `filesystem`, or "" when no profile does."""
    names = [p.name for p in PROFILES.values() if filesystem in p.filesystems]
    return f"{lead} --rollout-storage-profile {names[0]}" if names else ""
