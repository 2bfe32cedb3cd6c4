"""Per-step metrics: computed from a batch and the stages' statistics, written as JSON lines."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import IO, Any

import orjson

from pipeline.types import Batch, SampleStatus

__all__ = ["GroupTimes", "MetricsSink", "batch_metrics"]


def batch_metrics(batch: Batch, *, version: int, max_staleness: int | None = None) -> dict[str, float]:
    """What the batch says about rollout: reward, lengths, staleness and off-policy share.

    `version` is the policy version the batch is trained at. A group's staleness is that version
    minus the version of its oldest token (read from the per-token spans).

    `--max-staleness` bounds staleness by admission, assuming groups finish in admission order; a
    straggler overtaken by later groups can still train staler. `staleness/overtaken_groups` counts
    those groups in this batch (0 when no bound is set), so the bound's leaks are visible.
    """
    samples = batch.samples
    rewards = [s.reward for s in samples if s.reward is not None]
    staleness = [g.staleness(version) for g in batch.groups]
    tokens = sum(s.response_len for s in samples)
    off_policy = sum(
        span.end - span.start for s in samples for span in s.spans if span.version < version
    )
    return {
        "reward/mean": _mean(rewards),
        "response_len/mean": _mean([s.response_len for s in samples]),
        "response_len/max": max((s.response_len for s in samples), default=0),
        "truncated_ratio": _mean([s.status is SampleStatus.TRUNCATED for s in samples]),
        "staleness/mean": _mean(staleness),
        "staleness/max": max(staleness, default=0),
        "staleness/multi_version_frac": _mean([len(s.versions) > 1 for s in samples]),
        "staleness/overtaken_groups": (
            0 if max_staleness is None else sum(1 for st in staleness if st > max_staleness)
        ),
        "off_policy_token_frac": off_policy / tokens if tokens else 0.0,
        "resumed_sample_frac": _mean([bool(s.resumed_at) for s in samples]),
        "batch/tokens": tokens,
    }


def _mean(values: list[Any]) -> float:
    return float(sum(values)) / len(values) if values else math.nan


class MetricsSink:
    """Appends one JSON object per training step to a file (and keeps them for the summary)."""

    def __init__(self, path: Path | None) -> None:
        self._file: IO[bytes] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab")
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class GroupTimes:
    """When each group was admitted and when it became ready, to split its age at training into
    time in flight (generating, rewarding, filtering) and time queued (ready, waiting for a batch).

    Only what this process saw: a group admitted before a restart counts from its first sighting.
    """

    def __init__(self) -> None:
        self._admitted: dict[str, float] = {}
        self._ready: dict[str, float] = {}

    def admitted(self, group_id: str) -> None:
        self._admitted.setdefault(group_id, time.perf_counter())

    def ready(self, group_id: str) -> None:
        self._ready[group_id] = time.perf_counter()

    def taken(self, group_ids: list[str]) -> dict[str, float]:
        now = time.perf_counter()
        in_flight, queued = [], []
        for gid in group_ids:
            ready = self._ready.pop(gid, now)
            in_flight.append(ready - self._admitted.pop(gid, ready))
            queued.append(now - ready)
        return {"time/group_in_flight_mean": _mean(in_flight), "time/group_queued_mean": _mean(queued)}
