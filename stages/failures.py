"""Failed groups, said out loud: the first group each distinct error fails is logged as a warning,
and the first traceback of each distinct exception a user's function raised is logged in full.

A group with a failed sample (a reward that raised or returned no number, an agent that broke, an
engine that never answered) is stored as failed and counted in `groups/failed_total`, never
trained. The count reaches the metrics only when a step completes, so a reward that fails every
sample would show as a run whose first step never comes, with nothing said. One warning per
distinct error (up to `limit` of them) names it at once without flooding the log.

An exception's repr says what, not where: `KeyError('answer')` from a reward of 200 lines. So the
first time a user's reward or agent raises an exception of a given type at a given line, its whole
traceback (into the user's function) is logged once (`first_traceback`).
"""

from __future__ import annotations

import traceback

import structlog

from core.types import Group, SampleStatus

__all__ = ["FailureLog", "first_traceback"]

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


_TRACED: set[tuple[str, str, int]] = set()  # (type, file, line) already logged, in this process


def first_traceback(stage: str, exc: BaseException, *, limit: int = _LIMIT) -> None:
    """Log `exc`'s traceback in full the first time its type is raised at its line (up to `limit`
    distinct ones per process); later ones are in the failed groups' warnings and the counts."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = frames[-1] if frames else None
    key = (type(exc).__qualname__, where.filename if where else "?", (where.lineno or 0) if where else 0)
    if key in _TRACED or len(_TRACED) >= limit:
        return
    _TRACED.add(key)
    log.warning(
        f"{stage} raised; its sample fails (this traceback is logged once per error and line):\n"
        + "".join(traceback.format_exception(exc)).rstrip(),
        stage=stage,
    )
