"""Per-step metrics: computed from a batch and the stages' statistics, written as JSON lines.

The guarantee (with a store that survives the process, i.e. LMDB): `metrics.jsonl` holds exactly
one record per trained step, steps 0..trained_step, in order. The controller stores each step's
record in the transaction that commits the step (`Store.finish_batch(step, metrics)`), then
appends it to the file; `restore_metrics_file` runs before a resumed run appends anything and
makes the file agree with the store: a record the file lacks (a kill between the commit and the
append) is written back from the store, a torn line, a duplicate, or a record of a step the store
does not count as trained is moved to `<file>.dropped` (nothing is deleted). The fields known only
after the commit (`AFTER_COMMIT`: the publish timings) are absent from a record rebuilt this way.

With the memory store nothing survives a crash: a restart is a new run from step 0, so every
record of the earlier life is moved to `<file>.dropped`, and the file holds this life's steps only.

Evaluation records: an evaluation that is no step's (the starting weights', before the first step;
`python -m pipeline.eval`'s of saved weights; one a resumed run catches up on) is a line of its own,
`eval_record`: `step` (the step whose weights it evaluated, 0 for the starting weights, as slime
logs them), `eval/step` (the same: what marks the line as an evaluation, and W&B's axis for it),
`version` (the weights: 0 the starting ones) and the `eval/...` keys an inline evaluation adds to
its step's record. They are not step records: the restore keeps them (placed before the record of
the step the evaluated weights went on to train) unless their weights are not the run's any more
(a version past the trained step's), and readers of the step records skip them (`is_eval_record`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, Protocol

import orjson
import structlog

from core.types import Batch, SampleStatus

__all__ = [
    "AFTER_COMMIT",
    "AFTER_COMMIT_PREFIXES",
    "EVAL_STEP",
    "GroupTimes",
    "MetricsSink",
    "RestoredMetrics",
    "StepSink",
    "batch_metrics",
    "eval_record",
    "is_eval_record",
    "restore_metrics_file",
]

log = structlog.get_logger("metrics")

# Fields of a step's record measured after its commit (the publish follows the commit), so the
# record stored with the commit lacks them.
AFTER_COMMIT = ("time/publish_gate_closed", "time/publish_update", "time/eval")
# Whole families measured after the commit: an inline evaluation runs after the step's publish.
AFTER_COMMIT_PREFIXES = ("eval/",)
# The key that marks an evaluation's own line in the metrics file (module docstring).
EVAL_STEP = "eval/step"


def eval_record(version: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    """The metrics line of an evaluation of the weights of `version` that is no step's (module
    docstring): at the step that made them (version - 1), the starting weights at step 0."""
    step = max(version - 1, 0)
    return {"step": step, EVAL_STEP: step, "version": version, **metrics}


def is_eval_record(record: Mapping[str, Any]) -> bool:
    """Whether a line of the metrics file is an evaluation's own, not a step's record."""
    return EVAL_STEP in record


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
    off_policy = sum(span.end - span.start for s in samples for span in s.spans if span.version < version)
    zero_std = 0
    for g in batch.groups:
        scored = [float(s.reward) for s in g.samples if s.reward is not None]
        zero_std += bool(scored) and max(scored) - min(scored) <= 1e-6
    # slime's names where slime has the concept (pipeline/metric_names.py, docs/metrics.md).
    return {
        "rollout/raw_reward": _mean(rewards),
        "reward/std": _pstd([float(r) for r in rewards]),
        "reward/min": min(rewards, default=math.nan),
        "reward/max": max(rewards, default=math.nan),
        # Groups whose rewards are all equal: GRPO gives them advantage 0, so they teach nothing.
        "rollout/zero_std/count": zero_std,
        "rollout/response_len/mean": _mean([s.response_len for s in samples]),
        "rollout/response_len/min": min((s.response_len for s in samples), default=0),
        "rollout/response_len/max": max((s.response_len for s in samples), default=0),
        "rollout/truncated_ratio": _mean([s.status is SampleStatus.TRUNCATED for s in samples]),
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


def _pstd(values: list[float]) -> float:
    """The population std (slime's and verl's reward std); nan for no values."""
    if not values:
        return math.nan
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


class StepSink(Protocol):
    """Somewhere else a step's record goes (TensorBoard, W&B): `pipeline.metric_sinks`."""

    name: str

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsSink:
    """Appends one JSON object per training step to a file (and keeps them for the summary), and
    hands the same record to each extra sink.

    An extra sink that raises (disk full, a library that went missing) is reported once, as a
    warning naming the sink and the reason, and is not called again: a dashboard never ends a run.
    `with MetricsSink(path) as metrics:` closes the file (and the extra sinks) on leaving.
    """

    def __init__(
        self,
        path: Path | None,
        extras: Sequence[StepSink] = (),
        *,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._file: IO[bytes] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab")
        self.records: list[dict[str, Any]] = []
        self._extras = list(extras)
        self._warn = warn or log.warning
        self.failed: dict[str, str] = {}  # sink name -> why it stopped

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            self._file.flush()
        self.write_extras(record)

    def write_eval(self, record: Mapping[str, Any]) -> None:
        """An evaluation's own line (`eval_record`): to the file and the extra sinks, not to
        `records` (the steps')."""
        if self._file is not None:
            self._file.write(orjson.dumps(dict(record), option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            self._file.flush()
        self.write_extras(record)

    def write_extras(self, record: Mapping[str, Any]) -> None:
        """The extra sinks only: for records the file already has (rebuilt on resume)."""
        for sink in list(self._extras):
            self._guard(sink, "write", partial(sink.write, record))

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in list(self._extras):
            self._guard(sink, "close", sink.close)

    def _guard(self, sink: StepSink, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # any failure of a dashboard: warn once, keep training
            self._extras.remove(sink)
            reason = f"{type(exc).__name__}: {exc}"
            self.failed[sink.name] = reason
            self._warn(f"metrics sink {sink.name!r} failed on {what} and is off for the rest of the run ({reason})")
            if what != "close":
                with suppress(Exception):  # the same failure again, most likely: said once above
                    sink.close()


@dataclass(frozen=True, slots=True)
class RestoredMetrics:
    """What `restore_metrics_file` did: steps written back from the store, lines moved aside."""

    kept: int
    rebuilt: tuple[int, ...]
    dropped: tuple[str, ...]  # one reason per line moved to `<file>.dropped`
    missing: tuple[int, ...]  # trained steps with no record anywhere (a store from before records)

    @property
    def changed(self) -> bool:
        return bool(self.rebuilt or self.dropped)


def restore_metrics_file(path: Path, *, trained_step: int, stored: Mapping[int, Mapping[str, Any]]) -> RestoredMetrics:
    """Make the metrics file hold exactly one record per trained step, 0..`trained_step`.

    `stored` is the store's records (`Store.step_metrics()`). A line of the file is kept if it is
    the first record of a trained step and agrees with the store's record of that step on every
    field the store has; a trained step left without a line gets the store's record. Every other
    line is appended to `<file>.dropped` with nothing lost. The file is replaced atomically (a
    crash during the restore leaves the old file or the new one, never half of one).
    """
    lines = path.read_bytes().splitlines() if path.exists() else []
    kept: dict[int, bytes] = {}
    evals: list[tuple[int, bytes]] = []  # (version, line): evaluations' own lines
    dropped: list[tuple[bytes, str]] = []
    for number, line in enumerate(lines, 1):
        version = _evaluated_version(line)
        if version is not None:
            if version <= trained_step + 1:
                evals.append((version, line))
            else:
                untrained = f"an evaluation of version {version}: weights not trained (trained step {trained_step})"
                dropped.append((line, f"line {number}: {untrained}"))
            continue
        step, why = _judge(line, trained_step, stored, kept)
        if why is None:
            kept[step] = line
        elif line.strip():
            dropped.append((line, f"line {number}: {why}"))
    rebuilt = []
    for step in sorted(stored):
        if step <= trained_step and step not in kept:
            kept[step] = orjson.dumps(dict(stored[step]))
            rebuilt.append(step)
    missing = tuple(s for s in range(trained_step + 1) if s not in kept)
    # Step S's record, and before it the evaluations of version S (the weights it started from).
    ordered = sorted([((s, 1), kept[s]) for s in kept] + [((v, 0), line) for v, line in evals], key=lambda x: x[0])
    order = [line for _, line in ordered]
    result = RestoredMetrics(len(kept) - len(rebuilt), tuple(rebuilt), tuple(w for _, w in dropped), missing)
    placed = set(order)
    in_file = [line for line in lines if line in placed]
    if result.changed or order != in_file:  # in the file: its own order, the rebuilt ones missing
        if dropped:
            with path.with_name(path.name + ".dropped").open("ab") as aside:
                aside.write(b"".join(line + b"\n" for line, _ in dropped))
                aside.flush()
                os.fsync(aside.fileno())
        _replace(path, b"".join(line + b"\n" for line in order))
    return result


def _evaluated_version(line: bytes) -> int | None:
    """The version an evaluation's own line evaluated (`eval_record`), None for any other line."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not is_eval_record(record):
        return None
    version = record.get("version")
    if isinstance(version, int) and not isinstance(version, bool):
        return version
    step = record.get("step")
    return step + 1 if isinstance(step, int) and not isinstance(step, bool) else 0


def _judge(
    line: bytes, trained_step: int, stored: Mapping[int, Mapping[str, Any]], kept: Mapping[int, bytes]
) -> tuple[int, str | None]:
    """(step, None) for a line to keep, else (step or -1, why it goes)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return -1, "not JSON (a write cut short)"
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return -1, f"no integer 'step' field, got {step!r}"
    if step < 0 or step > trained_step:
        return step, f"step {step} is not trained in the store (trained step {trained_step})"
    if step in kept:
        return step, f"a second record of step {step}"
    ours = stored.get(step)
    if ours is not None:
        differing = sorted(k for k, v in ours.items() if record.get(k, _ABSENT) != v)
        if differing:
            return step, f"step {step} differs from the store's record in {differing[:5]}"
    return step, None


_ABSENT = object()


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
