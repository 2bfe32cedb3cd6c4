"""Failed groups, said out loud: the first group each distinct error fails is logged as a warning.

A group with a failed sample (a reward that raised or returned no number, an agent that broke, an
engine that never answered) is stored as failed and counted in `groups/failed_total`, never
trained. The count reaches the metrics only when a step completes, so a reward that fails every
sample would show as a run whose first step never comes, with nothing said. One warning per
distinct error (up to `limit` of them) names it at once without flooding the log.
"""

from __future__ import annotations

import structlog

from pipeline.types import Group, SampleStatus

__all__ = ["FailureLog"]

log = structlog.get_logger("pipeline")

_LIMIT = 20  # distinct errors warned about; after that the count in the metrics says it


class FailureLog:
    def __init__(self, stage: str, *, limit: int = _LIMIT) -> None:
        self._stage = stage
        self._limit = limit
        self._seen: set[str] = set()

    def failed(self, group: Group) -> None:
        """Warn about `group` if its first error is one not seen before."""
        errors = [s.error or "no error recorded" for s in group.samples if s.status is SampleStatus.FAILED]
        if not errors or errors[0] in self._seen or len(self._seen) >= self._limit:
            return
        self._seen.add(errors[0])
        last = len(self._seen) == self._limit
        log.warning(
            "group failed: stored as failed, never trained"
            + (f" (the last of {self._limit} distinct errors logged)" if last else ""),
            stage=self._stage,
            group=group.group_id,
            failed_samples=f"{len(errors)}/{len(group.samples)}",
            error=errors[0],
        )
