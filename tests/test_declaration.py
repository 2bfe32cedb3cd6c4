"""The storage declaration: detect the filesystem from a mountinfo text, refuse undeclared network
filesystems, and hold a declaration or profile to what is detected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import ConfigError, StoreError
from storage import LmdbStore, open_store
from storage.declaration import (
    PROFILES,
    Mount,
    StorageDeclaration,
    check_storage,
    find_mount,
    is_network_filesystem,
    load_declaration,
    parse_declaration,
    parse_mountinfo,
)

# A real-looking mountinfo: root on ext4, an NFS export, JuiceFS over FUSE, a mount point with a
# space (written \040), a tmpfs mounted over a directory of the NFS export, and /data2 next to /data.
MOUNTINFO = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
40 22 0:50 / /data rw,relatime shared:20 - nfs4 fileserver:/export/data rw,vers=4.2,hard
41 22 8:2 / /data2 rw,relatime shared:21 - xfs /dev/sdb1 rw
42 22 0:51 / /shared/juicefs rw,relatime shared:22 - fuse.juicefs JuiceFS:ml rw,user_id=0,group_id=0
43 22 8:3 / /mnt/my\040disk rw,relatime - ext4 /dev/sdc1 rw
44 40 0:52 / /data/local-tmp rw,nosuid - tmpfs tmpfs rw,size=1024k
this line is not mountinfo
"""


def test_parse_mountinfo_reads_mount_point_type_and_source() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert mounts[0] == Mount("/", "ext4", "/dev/sda1")
    assert Mount("/mnt/my disk", "ext4", "/dev/sdc1") in mounts
    assert Mount("/shared/juicefs", "fuse.juicefs", "JuiceFS:ml") in mounts
    assert len(mounts) == 6


@pytest.mark.parametrize(
    ("path", "mount_point", "filesystem"),
    [
        ("/data/run-1/rollout_data", "/data", "nfs4"),
        ("/data", "/data", "nfs4"),
        ("/data2/run", "/data2", "xfs"),  # a prefix of characters is not a prefix of components
        ("/database", "/", "ext4"),
        ("/data/local-tmp/x", "/data/local-tmp", "tmpfs"),  # the longest mount point wins
        ("/mnt/my disk/store", "/mnt/my disk", "ext4"),
        ("/shared/juicefs/jobs/r/rollout_data", "/shared/juicefs", "fuse.juicefs"),
    ],
)
def test_find_mount_takes_the_longest_whole_component_prefix(path: str, mount_point: str, filesystem: str) -> None:
    found = find_mount(path, parse_mountinfo(MOUNTINFO))
    assert (found.mount_point, found.filesystem) == (mount_point, filesystem)


def test_which_filesystems_count_as_network() -> None:
    for fs in ("nfs", "nfs4", "cifs", "smb3", "ceph", "9p", "fuse.juicefs", "fuse.sshfs", "lustre", "fuse"):
        assert is_network_filesystem(fs), fs
    for fs in ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "fuseblk"):
        assert not is_network_filesystem(fs), fs


def test_a_local_disk_needs_no_declaration() -> None:
    plan = check_storage("/data2/run/rollout_data", mountinfo=MOUNTINFO)
    assert (plan.data_dir, plan.mount.filesystem, plan.network, plan.sync, plan.declared_by) == (
        "/data2/run/rollout_data",
        "xfs",
        False,
        True,
        None,
    )
    assert plan.store_options() == {"sync": True}


def test_an_undeclared_network_filesystem_is_refused_with_how_to_declare_it() -> None:
    with pytest.raises(StoreError) as info:
        check_storage("/shared/juicefs/jobs/r/rollout_data", mountinfo=MOUNTINFO)
    message = str(info.value)
    assert (
        "/shared/juicefs/jobs/r/rollout_data is on fuse.juicefs (mounted at /shared/juicefs from JuiceFS:ml)" in message
    )
    assert "declare it with --rollout-storage-profile juicefs or with --rollout-storage-declaration FILE" in message
    assert '"mount_path": "/shared/juicefs", "filesystem": "fuse.juicefs"' in message
    with pytest.raises(StoreError, match="is on nfs4 .*--rollout-storage-profile nfs"):
        check_storage("/data/run", mountinfo=MOUNTINFO)


def test_a_matching_declaration_allows_a_network_filesystem(tmp_path: Path) -> None:
    file = tmp_path / "deployment.json"
    file.write_text(
        json.dumps(
            {"mount_path": "/shared/juicefs", "filesystem": "fuse.juicefs", "durability": {"synced_commits": False}}
        )
    )
    declaration = load_declaration(file)
    assert declaration == StorageDeclaration("/shared/juicefs", "fuse.juicefs", False, str(file))
    plan = check_storage("/shared/juicefs/jobs/r/rollout_data", declaration=declaration, mountinfo=MOUNTINFO)
    assert (plan.network, plan.sync, plan.declared_by) == (True, False, f"declaration {file}")
    assert plan.store_options() == {"sync": False}
    # With a profile that covers it, too.
    plan = check_storage("/shared/juicefs/x", declaration=declaration, profile="juicefs", mountinfo=MOUNTINFO)
    assert plan.sync is False


def test_a_declaration_that_disagrees_with_the_mount_names_both() -> None:
    wrong_place = StorageDeclaration("/shared/juicefs", "nfs4", True, "d.json")
    with pytest.raises(ConfigError) as info:
        check_storage("/data/run", declaration=wrong_place, mountinfo=MOUNTINFO)
    (problem,) = info.value.problems
    assert problem == (
        "--rollout-storage-declaration='d.json': mount_path '/shared/juicefs' does not contain "
        "the rollout data directory '/data/run'"
    )
    wrong_fs = StorageDeclaration("/shared", "nfs4", True, "d.json")
    with pytest.raises(ConfigError) as info:
        check_storage("/shared/juicefs/run", declaration=wrong_fs, profile="nfs", mountinfo=MOUNTINFO)
    assert info.value.problems == [
        "--rollout-storage-declaration='d.json': declares filesystem 'nfs4', but /shared/juicefs/run is on "
        "fuse.juicefs (mounted at /shared/juicefs from JuiceFS:ml)",
    ]
    with pytest.raises(ConfigError) as info:
        check_storage(
            "/data/run",
            declaration=StorageDeclaration("/data", "nfs4", True, "d.json"),
            profile="local",
            mountinfo=MOUNTINFO,
        )
    assert info.value.problems == [
        "--rollout-storage-declaration='d.json': declares filesystem 'nfs4', but --rollout-storage-profile="
        f"'local' covers {', '.join(PROFILES['local'].filesystems)}",
    ]


def test_profiles_are_held_to_the_detected_filesystem() -> None:
    assert check_storage("/data/run", profile="nfs", mountinfo=MOUNTINFO).declared_by == "profile nfs"
    plan = check_storage("/data2/run", profile="local-unsynced", mountinfo=MOUNTINFO)
    assert (plan.sync, plan.network) == (False, False)
    with pytest.raises(
        ConfigError,
        match=r"profile='juicefs' covers fuse.juicefs, but /data/run is on nfs4 "
        r"\(mounted at /data from fileserver:/export/data\); use "
        r"--rollout-storage-profile nfs",
    ):
        check_storage("/data/run", profile="juicefs", mountinfo=MOUNTINFO)
    with pytest.raises(ConfigError, match="profile='local' covers .*but /data/run is on nfs4"):
        check_storage("/data/run", profile="local", mountinfo=MOUNTINFO)
    with pytest.raises(ConfigError, match="'gluster': must be one of local, local-unsynced, nfs, juicefs"):
        check_storage("/data/run", profile="gluster", mountinfo=MOUNTINFO)


def test_a_symlink_is_judged_by_where_it_points(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    info = f"1 0 8:1 / / rw - ext4 /dev/sda1 rw\n2 1 0:9 / {real} rw - nfs4 srv:/x rw\n"
    with pytest.raises(StoreError, match=f"{real}/store is on nfs4"):
        check_storage(tmp_path / "link" / "store", mountinfo=info)
    sshfs = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n2 1 0:9 / /remote rw - fuse.sshfs me@host:/ rw\n"
    with pytest.raises(StoreError, match="declare it with --rollout-storage-declaration FILE"):  # no profile fits
        check_storage("/remote/run", mountinfo=sshfs)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([], "must be a JSON object"),
        (
            {"mount_path": "rel/path", "filesystem": "nfs4", "durability": {"synced_commits": True}},
            "mount_path must be an absolute path, got 'rel/path'",
        ),
        ({"mount_path": "/x", "filesystem": "", "durability": {"synced_commits": True}}, "filesystem must name"),
        (
            {"mount_path": "/x", "filesystem": "nfs4", "durability": {"synced_commits": "yes"}},
            "durability must be {\"synced_commits\": true|false}, got {'synced_commits': 'yes'}",
        ),
        ({"mount_path": "/x", "filesystem": "nfs4"}, "durability must be"),
        (
            {"mount_path": "/x", "filesystem": "nfs4", "durability": {"synced_commits": True}, "mount": "/y"},
            "unknown key(s) 'mount'",
        ),
        (
            {"mount_path": "/x", "filesystem": "nfs4", "durability": {"synced_commits": True, "fsync": 1}},
            "unknown durability key(s) 'fsync'",
        ),
    ],
)
def test_malformed_declarations_are_config_errors(data: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_declaration(data, source="d.json")
    assert any(fragment in p and p.startswith("--rollout-storage-declaration='d.json'") for p in info.value.problems), (
        info.value.problems
    )


def test_unreadable_declaration_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_declaration(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_declaration(tmp_path / "bad.json")


def test_the_real_mountinfo_and_an_unsynced_plan_open_a_real_store(tmp_path: Path) -> None:
    plan = check_storage(tmp_path / "s", profile="local-unsynced") if not _on_network(tmp_path) else None
    if plan is None:
        pytest.skip(f"{tmp_path} is on a network filesystem here")
    with open_store("lmdb", tmp_path / "s", **plan.store_options()) as store:
        assert isinstance(store, LmdbStore)


def test_every_profile_names_filesystems() -> None:
    for profile in PROFILES.values():
        assert profile.filesystems and all(is_network_filesystem(f) == profile.network for f in profile.filesystems)


def _on_network(path: Path) -> bool:
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    return is_network_filesystem(find_mount(str(path.resolve()), parse_mountinfo(text)).filesystem)
