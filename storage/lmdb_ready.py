"""The ready groups an LMDB writer keeps decoded, so `take_batch` need not decode them again.

Decoding a group costs about twice encoding it (building 16k Python numbers for 8 x 1k tokens), so
the writer keeps the groups it put in READY and `take_batch` hands those out instead of decoding
them again: a group is encoded once on its way in and never decoded in a process that stays up.
Only what a commit made READY enters, and only once that commit is on disk.
"""

from __future__ import annotations

from collections.abc import Iterable

from core.types import Group

__all__ = ["READY_CACHE_MAX", "ReadyCache"]

# Ready groups kept decoded for `take_batch`; past this many the rest are read back from the map.
READY_CACHE_MAX = 4096
_SCALARS = (str, int, float, bool, bytes)


class ReadyCache(dict[str, Group]):
    """Group id -> the group as this writer put it in READY."""

    def remember(self, group: Group) -> None:
        if len(self) < READY_CACHE_MAX and decodes_equal(group):
            self[group.group_id] = group

    def forget(self, groups: Iterable[Group]) -> None:
        """These groups left READY (batched)."""
        for group in groups:
            self.pop(group.group_id, None)


def decodes_equal(group: Group) -> bool:
    """Whether decoding this group's record gives back an equal group of the same shapes.

    Free-form values are the exception: tuples inside a label or metadata come back as lists (and
    mappings as dicts), so a group that has any is read back from its record, never cached."""
    task = group.task
    if task.metadata or not (task.label is None or type(task.label) in _SCALARS):
        return False
    return not any(s.metadata for s in group.samples)
