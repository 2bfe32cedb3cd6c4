"""`/release_memory_occupation` and `/resume_memory_occupation` (SGLang 3.4): which of the engine's
GPU memory is given back now, and whether it may generate.

    release(tags)   idle engine only; requests refused from now on; the tags' memory unmapped
    resume(tags)    the tags' memory mapped again (fresh contents: the KV cache is zeroed; the weights
                    are undefined until an update rewrites every one of them, unless backed up)

SGLang's semantics, with its tags (`memory_saver.py`): no tags means all of them; a tag already in
the state asked for is left alone (the library under it exits the process on a second pause or a
resume of active memory, so the engine keeps the state itself instead of trusting the caller).
While any tag is released, or the weights are undefined, `/generate` answers 503 with the reason
(SGLang would decode on unmapped memory); publishes to released weights are refused by their
handlers with the call that fixes it. Each pause and resume runs in the core's compute lane, so no
forward reads memory while it moves.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engines.memory_saver import ALL_TAGS, KV_CACHE, WEIGHTS, MemorySaver
from engines.scheduler import EngineCore

if TYPE_CHECKING:
    import torch

__all__ = ["MemoryOccupation", "OccupationError", "OccupationStatistics", "parse_tags"]

log = logging.getLogger(__name__)


class OccupationError(Exception):
    """A release or resume refused; its message is the HTTP answer's."""


@dataclass(frozen=True, slots=True)
class OccupationStatistics:
    released: tuple[str, ...]  # the tags whose memory is given back now
    weights_undefined: int  # weights resumed without a backup and not rewritten since
    releases: int
    resumes: int


def parse_tags(body: dict[str, Any]) -> tuple[str, ...]:
    """SGLang's `{"tags": null | [...]}`: null or empty means every tag."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return ALL_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise OccupationError(f"tags must be null or a list of strings, got {tags!r}")
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown:
        raise OccupationError(f"unknown memory tags {unknown}; SGLang's are {list(ALL_TAGS)}")
    return tuple(dict.fromkeys(tags))


class MemoryOccupation:
    """The engine's released tags and undefined weights, and the calls that move them."""

    def __init__(
        self,
        saver: MemorySaver,
        core: EngineCore,
        *,
        weight_groups: Callable[[], Sequence[Sequence[str]]],
        after_kv_resume: Callable[[], None] = lambda: None,
        device: torch.device | None = None,
    ) -> None:
        """`weight_groups`: the live weights' tied groups (a complete update has one name of each);
        `after_kv_resume` runs on the compute thread once the KV cache's memory is back."""
        self._saver = saver
        self._core = core
        self._weight_groups = weight_groups
        self._after_kv_resume = after_kv_resume
        self._device = device
        self.released: set[str] = set()
        self._undefined: list[Sequence[str]] = []  # weight groups with no value since a resume
        self._releases = self._resumes = 0

    @property
    def enabled(self) -> bool:
        return self._saver.enabled

    async def release(self, tags: Iterable[str]) -> str:
        if not self._saver.enabled:
            raise OccupationError(f"release_memory_occupation refused: {self._saver.why_not}")
        core = self._core
        if not core.is_idle() or core.num_waiting:
            raise OccupationError(
                f"release_memory_occupation needs an idle engine: {core.num_running} running and "
                f"{core.num_waiting} waiting request(s); pause generation in abort mode (or let them finish) first"
            )
        moving = [t for t in tags if t not in self.released]
        self.released.update(moving)
        core.hold_generation(self._why_held())
        if moving:
            await core.run_in_lane(lambda: self._pause(moving))
            self._releases += 1
        log.info("released GPU memory %s (released now: %s)", moving, sorted(self.released))
        return f"Released {moving or 'nothing new'}; released now: {sorted(self.released)}."

    async def resume(self, tags: Iterable[str]) -> str:
        if not self._saver.enabled:
            raise OccupationError(f"resume_memory_occupation refused: {self._saver.why_not}")
        moving = [t for t in tags if t in self.released]
        if moving:
            await self._core.run_in_lane(lambda: self._resume(moving))
            self._resumes += 1
            self.released.difference_update(moving)
            if WEIGHTS in moving and not self._saver.weights_backed_up:
                self._undefined = [list(g) for g in self._weight_groups()]
        self._core.hold_generation(self._why_held())
        log.info("resumed GPU memory %s (released now: %s)", moving, sorted(self.released))
        return f"Resumed {moving or 'nothing new'}; released now: {sorted(self.released)}."

    def written(self, names: Iterable[str] | None) -> None:
        """Weights got values (`names`, or all of them for None): an update after a resume."""
        if not self._undefined:
            return
        if names is None:
            self._undefined = []
        else:
            got = set(names)
            self._undefined = [g for g in self._undefined if not any(n in got for n in g)]
        self._core.hold_generation(self._why_held())

    def refuse_weights_update(self, path: str) -> None:
        """Raise OccupationError if the weights' memory is released: an update would write to unmapped memory."""
        if WEIGHTS in self.released:
            raise OccupationError(
                f"{path} refused: the weights' memory is released (release_memory_occupation); call "
                '/resume_memory_occupation with {"tags": ["weights"]} first, then publish'
            )

    def statistics(self) -> OccupationStatistics:
        return OccupationStatistics(
            released=tuple(t for t in ALL_TAGS if t in self.released),
            weights_undefined=len(self._undefined),
            releases=self._releases,
            resumes=self._resumes,
        )

    def _why_held(self) -> str | None:
        if self.released:
            return (
                f"the engine's GPU memory is released ({', '.join(sorted(self.released))}): it generates again "
                'after /resume_memory_occupation (for the weights, then a publish); released by the "colocated" '
                "weight sync, which resumes it itself"
            )
        if self._undefined:
            return (
                f"the weights were resumed without a CPU backup and {len(self._undefined)} of them have no value "
                "yet: publish the weights (update_weights_from_tensor, _from_disk or _from_distributed) first"
            )
        return None

    def _pause(self, tags: Sequence[str]) -> None:
        with self._on_device():
            if self._device is not None:
                import torch

                torch.cuda.synchronize(self._device)
                # Cached blocks of the default pool (activations, graph warm-ups) go back too:
                # measured from outside the process, a released engine should hold little beyond
                # its context.
                torch.cuda.empty_cache()
            for tag in tags:
                self._saver.pause(tag)

    def _resume(self, tags: Sequence[str]) -> None:
        with self._on_device():
            for tag in tags:
                self._saver.resume(tag)
            if KV_CACHE in tags:
                self._after_kv_resume()

    def _on_device(self) -> AbstractContextManager[object]:
        """The lane runs on a worker thread: the engine's device (and its context) current there,
        for the driver calls under the library."""
        if self._device is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.device(self._device)
