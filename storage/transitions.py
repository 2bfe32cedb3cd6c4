"""The group state machine, written once: which moves exist, and what a refused move says.

Both stores (`MemoryStore`, `LmdbStore`) check every move against `TRANSITIONS` and raise the
errors built here, so the rules and their messages cannot drift apart (they once did: the two
stores checked a lost lease differently). The shared store suite holds both to it.

    move             from                       to
    admit            (new id)                   RUNNING      leased
    admit(skipped=)  (new id)                   REJECTED     a prompt skipped before generation, with
                                                             the cursor that passed it
    seed             (new id)                   PARTIAL / READY / TRAINED   a fresh store continuing a
                                                             damaged one (TRAINED: a batch to train again)
    requeue_quarantined (new id)                PARTIAL      a quarantined group's prompt, again
    requeue_trained  (new id)                   PARTIAL      a trained group's prompt, again: its record is
                                                             damaged and a resume must train its step again
    requeue_failed   (new id)                   PARTIAL      a failed group's prompt, again (asked for)
    claim_partial    PARTIAL                    RUNNING      leased
    put_partial      RUNNING                    PARTIAL
    put_ready        RUNNING                    READY
    put_rejected     RUNNING                    REJECTED
    put_failed       RUNNING                    FAILED
    put_*_groups     RUNNING                    READY / REJECTED   many groups, one transaction
    reclaim_expired  RUNNING                    PARTIAL
    hand_over        RUNNING                    RUNNING      the lease moves to another owner
    hand_over_groups RUNNING                    RUNNING      many leases, one transaction
    accept_results   RUNNING                    any put target, or RUNNING handed back: each fenced alone
    take_batch       READY                      BATCHED
    finish_batch     BATCHED                    TRAINED
    recover          RUNNING / BATCHED          PARTIAL / READY
    quarantine       any but TRAINED            QUARANTINED  its record failed its checksum
    collect_garbage  TRAINED                    (deleted, id kept as a tombstone)

QUARANTINED is where a group whose stored record is damaged goes instead of being trained or
served: the damaged bytes are kept for inspection, the state is counted, and its prompt is
generated again under a new id (`requeue_id`), so every prompt whose data is readable is still
trained exactly once.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

from core.errors import StoreError
from core.types import Group

from .protocol import GroupState

__all__ = [
    "TRANSITIONS",
    "Move",
    "already_collected",
    "already_exists",
    "already_trained",
    "check_batch_size",
    "check_collect",
    "check_distinct",
    "check_distinct_ids",
    "check_hand_over",
    "check_lease",
    "check_move",
    "check_put",
    "check_result_state",
    "check_skipped",
    "duplicate_in_admit",
    "no_batch",
    "out_of_order",
    "requeue_id",
]

_R, _P, _Y, _B, _T = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.BATCHED, GroupState.TRAINED
_Q = GroupState.QUARANTINED


class Move(enum.Enum):
    ADMIT = "admit"
    CLAIM = "claim_partial"
    PUT = "put"
    RECLAIM = "reclaim_expired"
    TAKE = "take_batch"
    FINISH = "finish_batch"
    RECOVER = "recover"
    QUARANTINE = "quarantine"
    SEED = "seed"
    SKIP = "skip"


# (from, to) -> the move that makes it. `None` as `from` is a group the store does not hold yet.
TRANSITIONS: Mapping[tuple[GroupState | None, GroupState], Move] = {
    (None, _R): Move.ADMIT,
    (None, GroupState.REJECTED): Move.SKIP,
    (None, _P): Move.SEED,
    (None, _Y): Move.SEED,
    (None, _T): Move.SEED,
    (_P, _R): Move.CLAIM,
    (_R, _P): Move.PUT,  # also reclaim_expired and recover: the same edge
    (_R, _Y): Move.PUT,
    (_R, GroupState.REJECTED): Move.PUT,
    (_R, GroupState.FAILED): Move.PUT,
    (_Y, _B): Move.TAKE,
    (_B, _T): Move.FINISH,
    (_B, _Y): Move.RECOVER,
    **{(s, _Q): Move.QUARANTINE for s in GroupState if s not in (_T, _Q)},
}
_PUT_TARGETS = frozenset(to for (old, to), move in TRANSITIONS.items() if move is Move.PUT and old is _R)


def check_move(gid: str, old: GroupState | None, new: GroupState) -> None:
    """Refuse a move the state machine does not have (an index that disagrees with a state)."""
    if (old, new) not in TRANSITIONS:
        shown = "absent" if old is None else old.value
        raise StoreError(f"group {gid!r} cannot move from {shown} to {new.value}: no such transition")


def check_lease(owner: str, lease_seconds: float) -> None:
    """Both stores refuse the same bad lease arguments."""
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"a lease owner is a non-empty string, got {owner!r}")
    if not lease_seconds > 0:  # NaN too
        raise ValueError(f"lease_seconds must be > 0, got {lease_seconds!r}")


def check_put(gid: str, state: GroupState | None, to: GroupState, owner: str | None, holder: str | None) -> None:
    """A `put_*` of group `gid` (now `state`, lease held by `holder`) to `to`, on behalf of `owner`.

    With `owner`, the lease must be theirs: a RUNNING group with no lease recorded counts as lost,
    in both stores."""
    assert to in _PUT_TARGETS, to
    if state is None:
        raise StoreError(f"group {gid!r} is not in the store; only an admitted group can become {to.value}")
    if state is not _R:
        raise StoreError(f"group {gid!r} is {state.value}, not running; it cannot become {to.value}")
    if owner is not None and holder != owner:
        held = "nobody" if holder is None else repr(holder)
        raise StoreError(
            f"group {gid!r} is leased to {held}, not {owner!r}; it cannot become {to.value} "
            "(its lease expired, or was never theirs)"
        )


def check_hand_over(gid: str, state: GroupState | None, owner: str, holder: str | None, to: str) -> None:
    """`hand_over` of group `gid` (now `state`, lease held by `holder`) from `owner` to `to`: only
    the holder of a RUNNING group's lease can hand it on (the same fence as `check_put`)."""
    if state is None:
        raise StoreError(f"group {gid!r} is not in the store; its lease cannot go to {to!r}")
    if state is not _R:
        raise StoreError(f"group {gid!r} is {state.value}, not running; its lease cannot go to {to!r}")
    if holder != owner:
        held = "nobody" if holder is None else repr(holder)
        raise StoreError(
            f"group {gid!r} is leased to {held}, not {owner!r}; it cannot be handed to {to!r} "
            "(its lease expired, or was never theirs)"
        )


def check_distinct(groups: Sequence[Group], to: GroupState) -> None:
    """A put of many groups names each group once: the same group twice in one transaction would
    move RUNNING -> `to` and then find it no longer RUNNING, so it is refused up front, whole."""
    check_distinct_ids([group.group_id for group in groups], f"put of {to.value} groups")


def check_distinct_ids(group_ids: Sequence[str], what: str) -> None:
    """A batch of `what` names each group once (as `check_distinct` for puts)."""
    seen: set[str] = set()
    for gid in group_ids:
        if gid in seen:
            raise StoreError(f"group {gid!r} appears twice in one {what}; nothing was stored")
        seen.add(gid)


def check_result_state(gid: str, to: GroupState) -> None:
    """`accept_results` takes RUNNING (the lease handed back) or a put target, nothing else."""
    if to is not _R and to not in _PUT_TARGETS:
        allowed = sorted(s.value for s in (_R, *_PUT_TARGETS))
        raise ValueError(f"result for group {gid!r}: state {to.value!r} is not one of {allowed}")


def check_skipped(groups: Sequence[Group]) -> None:
    """A skipped group names why it was skipped and carries no generated token: it is stored as
    the prompt's REJECTED group, and replay shows the reason."""
    for group in groups:
        if not group.rejected_reason:
            raise ValueError(f"skipped group {group.group_id!r} has no rejected_reason; a skip says why")
        if any(s.response_len for s in group.samples):
            raise ValueError(
                f"skipped group {group.group_id!r} has generated tokens; only a prompt not generated yet is skipped"
            )


def duplicate_in_admit(gid: str) -> StoreError:
    return StoreError(f"group {gid!r} appears twice in one admit; nothing was stored")


def already_exists(gid: str, state: GroupState | None) -> StoreError:
    shown = state.value if state is not None else "unindexed"
    return StoreError(f"group {gid!r} already exists ({shown}); nothing was stored")


def already_collected(gid: str, step: int) -> StoreError:
    return StoreError(f"group {gid!r} already exists (trained at step {step}, then collected); nothing was stored")


def check_collect(up_to_step: int, trained_step: int) -> None:
    if up_to_step > trained_step:
        raise StoreError(f"cannot collect up to step {up_to_step}: only steps up to {trained_step} are trained")


def check_batch_size(size: int) -> None:
    if size < 1:
        raise ValueError(f"a batch needs at least one group, got size={size}")


def already_trained(step: int, trained_step: int) -> StoreError:
    return StoreError(f"step {step} is already trained (trained step {trained_step}) and has no batch")


def no_batch(step: int) -> StoreError:
    return StoreError(f"no batch was taken for step {step}")


def out_of_order(step: int, earliest: int) -> StoreError:
    return StoreError(f"step {step} cannot finish before step {earliest}: steps finish in order")


def check_seed(trained_step: int, held: int, current_step: int, replay_steps: Sequence[int] = ()) -> None:
    """`seed` starts a store: only an empty one, with a step >= -1, and batches to train again
    only for the last trained steps, in order."""
    if held or current_step != -1:
        raise StoreError(
            f"only an empty store can be seeded; this one holds {held} groups and trained step {current_step}"
        )
    if trained_step < -1 or not math.isfinite(trained_step):
        raise ValueError(f"a seeded trained step is -1 or more, got {trained_step}")
    expected = list(range(trained_step - len(replay_steps) + 1, trained_step + 1))
    if list(replay_steps) != expected or (expected and expected[0] < 0):
        raise ValueError(f"seeded batches are of the last trained steps {expected}, in order; got {list(replay_steps)}")


def requeue_id(gid: str) -> str:
    """The id a quarantined group's prompt is generated again under: never one the store held."""
    return f"{gid}.requeued"


class PutMoves:
    """The `put_*` moves of a store, written once: each is RUNNING -> a state, for one group or
    many, and a store supplies `_put`, which moves every group or none in one transaction."""

    def _put(self, groups: Sequence[Group], to: GroupState, owner: str | None) -> None:
        raise NotImplementedError

    def put_partial(self, group: Group, *, owner: str | None = None) -> None:
        self._put((group,), GroupState.PARTIAL, owner)

    def put_ready(self, group: Group, *, owner: str | None = None) -> None:
        self._put((group,), GroupState.READY, owner)

    def put_rejected(self, group: Group, *, owner: str | None = None) -> None:
        self._put((group,), GroupState.REJECTED, owner)

    def put_failed(self, group: Group, *, owner: str | None = None) -> None:
        self._put((group,), GroupState.FAILED, owner)

    def put_ready_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None:
        self._put(groups, GroupState.READY, owner)

    def put_rejected_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None:
        self._put(groups, GroupState.REJECTED, owner)
