"""Every LMDB database name, key and index entry the store uses, built in this one module.

One environment holds these named databases:

    meta           b"run" -> RunMeta record, b"cursor" -> Cursor record, b"trained_step" -> i64,
                   b"counts" -> groups per state, b"layout" -> the layout version of this file
    groups         group id -> Group record (codec)
    state          group id -> state entry: state code, oldest version, seq (what the indexes are keyed by)
    by_state       state code + group id -> b""    (every group of one state, for recover and `groups()`)
    partial_order  (oldest_version, seq) + group id -> b""    PARTIAL groups in serving order
    ready_order    (oldest_version, seq) + group id -> b""    READY groups in serving order
    batches        step -> batch record (the step and its group ids, in batch order)
    leases         group id -> lease: expiry (f64, seconds since the epoch) + owner (UTF-8); RUNNING only
    tombstones     group id -> i64 step: a TRAINED group `collect_garbage` deleted; `admit` refuses it
                   (the cursor alone would not do: `admit` takes any id, from a producer, a replay or
                   an epoch wrap, and the rule "an id exists once" is the store's to keep; a tombstone
                   is about 40 bytes with its B-tree share, against ~100 KB for the group it replaces)

`meta` also holds b"collected" -> two i64 (groups collected, last step collected).

One more database is optional (`OPTIONAL_DATABASES`): a writer creates it, a reader opens it where
it exists, and a store written before it simply has none.

    history        the dataset row in 12 digits -> that prompt's history (`storage.history`): one
                   key per prompt, so reading the histories of k prompts is k lookups. A database
                   of its own, not keys under `meta`: it grows with the prompt set, and `meta`
                   holds what a salvage needs (cursor, trained step), which must stay a small tree.

Leases are not indexed by expiry: only RUNNING groups have one (the in-flight work, thousands at
most), so `reclaim_expired` and `renew_leases` scan them all, which costs less than keeping a
second index up to date on every claim and put.

Integers in keys are big-endian with the sign bit flipped, so LMDB's bytewise key order is numeric
order (negative values included). Order keys end in the group id, so two groups with the same
(version, seq) still get distinct keys; UTF-8 byte order equals code-point order, so the memory
store sorts the same way by comparing `(version, seq, group_id)` tuples.
"""

from __future__ import annotations

import struct

from core.errors import CorruptRecordError, StoreError

from .protocol import GroupState

__all__ = [
    "BATCHES",
    "BY_STATE",
    "DATABASES",
    "GROUPS",
    "HISTORY",
    "LEASES",
    "META",
    "META_COLLECTED",
    "META_COUNTS",
    "META_CURSOR",
    "META_LAYOUT",
    "META_RUN",
    "META_STEP_METRICS",
    "META_TRAINED_STEP",
    "OPTIONAL_DATABASES",
    "PARTIAL_ORDER",
    "READY_ORDER",
    "STATE",
    "STATE_ORDER",
    "TOMBSTONES",
    "by_state_key",
    "by_state_prefix",
    "collected_value",
    "counts_value",
    "describe",
    "group_id_of_by_state_key",
    "group_id_of_order_key",
    "group_key",
    "history_key",
    "i64_value",
    "lease_value",
    "order_key",
    "parse_collected",
    "parse_counts",
    "parse_i64",
    "parse_lease",
    "parse_state_entry",
    "parse_step_key",
    "state_entry",
    "step_key",
    "step_metrics_key",
]

# Database names.
META = b"meta"
GROUPS = b"groups"
STATE = b"state"
BY_STATE = b"by_state"
PARTIAL_ORDER = b"partial_order"
READY_ORDER = b"ready_order"
BATCHES = b"batches"
LEASES = b"leases"
TOMBSTONES = b"tombstones"
DATABASES = (META, GROUPS, STATE, BY_STATE, PARTIAL_ORDER, READY_ORDER, BATCHES, LEASES, TOMBSTONES)
HISTORY = b"history"
OPTIONAL_DATABASES = (HISTORY,)  # a writer creates them; a reader of an older store finds none

# Keys in `meta`.
META_RUN = b"run"
META_CURSOR = b"cursor"
META_TRAINED_STEP = b"trained_step"
META_COUNTS = b"counts"
META_LAYOUT = b"layout"
META_COLLECTED = b"collected"
# `meta` also holds b"metrics/" + step key -> the step's metrics record (JSON), written by
# `finish_batch`; under `meta` rather than in a database of their own, so a store written before
# these records existed still opens read-only (a new named database would be missing there).
META_STEP_METRICS = b"metrics/"

# One byte per state, fixed forever: stored on disk, so never derived from enum order.
_STATE_CODE = {
    GroupState.RUNNING: b"r",
    GroupState.PARTIAL: b"p",
    GroupState.READY: b"y",
    GroupState.BATCHED: b"b",
    GroupState.TRAINED: b"t",
    GroupState.REJECTED: b"x",
    GroupState.FAILED: b"f",
    GroupState.QUARANTINED: b"q",
}
_CODE_STATE = {code[0]: state for state, code in _STATE_CODE.items()}
# The order of the per-state counters in the `counts` record.
STATE_ORDER = tuple(_STATE_CODE)

# LMDB refuses keys over 511 bytes; order keys add 16 bytes in front of the id.
_MAX_ID_BYTES = 400
_U64 = struct.Struct(">Q")
_ORDER = struct.Struct(">QQ")
_STATE_ENTRY = struct.Struct(">cQQ")
_COUNTS = struct.Struct(f">{len(STATE_ORDER)}Q")
_LEGACY_COUNTS = struct.Struct(f">{len(STATE_ORDER) - 1}Q")  # before QUARANTINED existed
_SIGN = 1 << 63
_EXPIRY = struct.Struct(">d")
_COLLECTED = struct.Struct(">QQ")


def _flip(value: int) -> int:
    """Signed 64-bit -> unsigned with the same order (offset binary)."""
    if not -_SIGN <= value < _SIGN:
        raise StoreError(f"integer {value} does not fit a 64-bit store key")
    return value + _SIGN


def group_key(group_id: str) -> bytes:
    key = group_id.encode()
    if not key or len(key) > _MAX_ID_BYTES:
        raise StoreError(f"group id {group_id!r} must be 1..{_MAX_ID_BYTES} UTF-8 bytes to be a store key")
    return key


def order_key(oldest_version: int, seq: int, group_id: str) -> bytes:
    """Key in `partial_order` / `ready_order`: serving order is oldest version, then FIFO seq."""
    return _ORDER.pack(_flip(oldest_version), _flip(seq)) + group_key(group_id)


def group_id_of_order_key(key: bytes) -> str:
    return bytes(key[_ORDER.size :]).decode()


def by_state_prefix(state: GroupState) -> bytes:
    return _STATE_CODE[state]


def by_state_key(state: GroupState, group_id: str) -> bytes:
    return _STATE_CODE[state] + group_key(group_id)


def group_id_of_by_state_key(key: bytes) -> str:
    return bytes(key[1:]).decode()


def step_key(step: int) -> bytes:
    return _U64.pack(_flip(step))


def parse_step_key(key: bytes) -> int:
    value: int = _U64.unpack(key)[0]
    return value - _SIGN


def step_metrics_key(step: int) -> bytes:
    return META_STEP_METRICS + step_key(step)


def history_key(index: int) -> bytes:
    """Key in `history` of dataset row `index`: the row in 12 decimal digits, so histories sort by
    row and an error names the record as `history/000000000017`."""
    if not 0 <= index < 10**12:
        raise StoreError(f"a dataset row for a history key is 0..{10**12 - 1}, got {index}")
    return f"{index:012d}".encode()


def i64_value(value: int) -> bytes:
    return _U64.pack(_flip(value))


def parse_i64(value: bytes, *, key: str) -> int:
    if len(value) != _U64.size:
        raise CorruptRecordError(key, f"expected {_U64.size} bytes, found {len(value)}")
    number: int = _U64.unpack(value)[0]
    return number - _SIGN


def state_entry(state: GroupState, oldest_version: int, seq: int) -> bytes:
    """Value in `state`: enough to find a group's index entries without decoding the group."""
    return _STATE_ENTRY.pack(_STATE_CODE[state], _flip(oldest_version), _flip(seq))


def parse_state_entry(value: bytes, *, key: str) -> tuple[GroupState, int, int]:
    if len(value) != _STATE_ENTRY.size:
        raise CorruptRecordError(key, f"state entry of {len(value)} bytes, expected {_STATE_ENTRY.size}")
    code, version, seq = _STATE_ENTRY.unpack(value)
    state = _CODE_STATE.get(code[0])
    if state is None:
        raise CorruptRecordError(key, f"unknown state code {code!r}")
    return state, version - _SIGN, seq - _SIGN


def counts_value(counts: dict[GroupState, int]) -> bytes:
    return _COUNTS.pack(*(counts[s] for s in STATE_ORDER))


def parse_counts(value: bytes) -> dict[GroupState, int]:
    if len(value) == _LEGACY_COUNTS.size:
        return dict(zip(STATE_ORDER, (*_LEGACY_COUNTS.unpack(value), 0), strict=True))
    if len(value) != _COUNTS.size:
        raise CorruptRecordError(describe(META, META_COUNTS), f"{len(value)} bytes, expected {_COUNTS.size}")
    return dict(zip(STATE_ORDER, _COUNTS.unpack(value), strict=True))


def lease_value(owner: str, expires_at: float) -> bytes:
    return _EXPIRY.pack(expires_at) + owner.encode()


def parse_lease(value: bytes, *, key: str) -> tuple[str, float]:
    if len(value) < _EXPIRY.size:
        raise CorruptRecordError(key, f"lease of {len(value)} bytes, expected at least {_EXPIRY.size}")
    try:
        owner = bytes(value[_EXPIRY.size :]).decode()
    except UnicodeDecodeError as exc:
        raise CorruptRecordError(key, f"lease owner is not UTF-8: {exc}") from exc
    return owner, _EXPIRY.unpack_from(value)[0]


def collected_value(groups: int, step: int) -> bytes:
    return _COLLECTED.pack(_flip(groups), _flip(step))


def parse_collected(value: bytes) -> tuple[int, int]:
    if len(value) != _COLLECTED.size:
        raise CorruptRecordError(describe(META, META_COLLECTED), f"{len(value)} bytes, expected {_COLLECTED.size}")
    groups, step = _COLLECTED.unpack(value)
    return groups - _SIGN, step - _SIGN


def describe(db: bytes, key: bytes) -> str:
    """A key as errors name it: `groups/e0000-p000000007`, `batches/<hex>`."""
    try:
        shown = bytes(key).decode()
        if not shown.isprintable():
            raise ValueError
    except ValueError:
        shown = bytes(key).hex()
    return f"{db.decode()}/{shown}"
