"""Evaluation on the engines: held-out prompt sets, sampled with their own parameters, scored, and
never mixed into training data (slime's `--eval-interval`, `--eval-prompt-data NAME PATH ...`).

`evaluate` sends each prompt of each set `n_samples` times to the engines (whatever weights they
serve), scores every response with the set's reward function, and returns the set's metrics:

    eval/<name>                    mean reward (slime's key)
    eval/<name>-truncated_ratio    share of responses cut at the length cap (slime's key)
    eval/<name>/reward_std, /reward_min, /reward_max, /response_len/mean,
    eval/<name>/samples, /failed   (a request the engine refused or a reward that raised: counted,
                                    left out of the means, never retried into another sample)

Nothing here touches the store, the collector or the trainer: an evaluation's samples exist only
in memory until its metrics are computed. `EvalLog` is the run's `eval.jsonl` (one line per
evaluated version of the weights, written whole and fsynced): what a resumed run and
`python -m pipeline.eval` read to never evaluate the same weights twice.

Who calls it: the launcher once before the first step when evaluation is on (the starting
weights, slime's evaluation before training; `--skip-eval-before-train` leaves it out), the
controller inline in sync mode, every `--eval-interval` steps after the step's publish (the
engines then serve the step's weights and nothing else is in flight); async mode refuses inline
evaluation (generation never pauses there, so an inline evaluation would mix policies) and
`python -m pipeline.eval` evaluates a run's saved weights instead.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson
import structlog

from core.errors import EngineError
from core.types import FinishReason, PromptTask, Sample, SampleStatus, Segment
from stages.generator import GenerateEngine
from stages.reward import RewardFn, call_reward
from stages.reward_threads import RewardThreads

__all__ = ["EvalLog", "EvalSet", "EvalSettings", "eval_due", "evaluate"]

log = structlog.get_logger("eval")


@dataclass(frozen=True, slots=True)
class EvalSet:
    """One named prompt set and the reward that scores it."""

    name: str
    tasks: tuple[PromptTask, ...]
    reward_fn: RewardFn


@dataclass(frozen=True, slots=True)
class EvalSettings:
    """How evaluation samples: slime's `--n-samples-per-eval-prompt`, `--eval-temperature` ..."""

    n_samples: int = 1
    sampling_params: Mapping[str, Any] | None = None  # temperature, top_p, top_k ... (SGLang's names)
    max_response_len: int = 1024
    concurrency: int = 64  # requests in flight at once
    reward_timeout: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_samples < 1 or self.max_response_len < 1 or self.concurrency < 1:
            raise ValueError(
                f"n_samples={self.n_samples}, max_response_len={self.max_response_len}, "
                f"concurrency={self.concurrency}: each must be >= 1"
            )


def eval_due(step: int, interval: int | None) -> bool:
    """Whether step `step` (0-based) ends an interval: steps interval-1, 2*interval-1, ... (slime
    evaluates after rollout ids that are multiples of the interval, counting from 1)."""
    return interval is not None and (step + 1) % interval == 0


async def evaluate(
    engine: GenerateEngine,
    sets: Sequence[EvalSet],
    settings: EvalSettings,
    *,
    step: int,
    on_sample: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Every set's metrics (module docstring) for the weights the engines serve now.

    `on_sample` is called after each response is scored (a progress bar's tick)."""
    limiter = anyio.CapacityLimiter(settings.concurrency)
    threads = RewardThreads()  # a plain def reward's calls, off the event loop (stages.reward_threads)
    out: dict[str, float] = {}
    try:
        for s in sets:
            results: list[Sample | None] = [None] * (len(s.tasks) * settings.n_samples)

            async def one(
                i: int, task: PromptTask, j: int, s: EvalSet = s, results: list[Sample | None] = results
            ) -> None:
                async with limiter:
                    results[i * settings.n_samples + j] = await _sample(engine, s, task, j, settings, step, threads)
                if on_sample is not None:
                    on_sample()

            async with anyio.create_task_group() as tg:
                for i, task in enumerate(s.tasks):
                    for j in range(settings.n_samples):
                        tg.start_soon(one, i, task, j)
            out.update(_set_metrics(s.name, results))
    finally:
        threads.close()
    return out


async def _sample(
    engine: GenerateEngine,
    s: EvalSet,
    task: PromptTask,
    j: int,
    settings: EvalSettings,
    step: int,
    threads: RewardThreads,
) -> Sample | None:
    """One scored response, or None when the engine refused it or the reward failed."""
    params = dict(settings.sampling_params or {}, max_new_tokens=settings.max_response_len)
    params["sampling_seed"] = zlib.crc32(f"{settings.seed}:{s.name}:{task.index}:{j}".encode())
    rid = f"eval-{step}-{s.name}-{task.index}-{j}"
    try:
        result = await engine.generate(task.prompt_ids, params, rid=rid)
    except EngineError as exc:
        log.warning("evaluation request failed", rid=rid, error=str(exc))
        return None
    if result.finish_reason is FinishReason.ABORT:
        return None
    segment = Segment(result.token_ids, result.logprobs, result.finish_reason, 0)
    sample = Sample(index=j, prompt_ids=task.prompt_ids).extended(segment, max_response_len=settings.max_response_len)
    [(ok, value)] = await call_reward(s.reward_fn, task, [sample], timeout=settings.reward_timeout, threads=threads)
    try:
        if not ok:
            raise value
        reward = float(value)
    except Exception as exc:  # a user reward's failure is counted, never the end of the run
        log.warning("evaluation reward failed", rid=rid, error=repr(exc))
        return None
    if not math.isfinite(reward):
        return None
    return sample.with_reward(reward)


def _set_metrics(name: str, results: Sequence[Sample | None]) -> dict[str, float]:
    done = [r for r in results if r is not None]
    rewards = [float(r.reward) for r in done if r.reward is not None]
    truncated = sum(r.status is SampleStatus.TRUNCATED for r in done)
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)) if rewards else math.nan
    ratio = truncated / len(done) if done else math.nan
    return {
        f"eval/{name}": mean,
        f"eval/{name}-truncated_ratio": ratio,
        f"eval/{name}/reward_std": std,
        f"eval/{name}/reward_min": min(rewards, default=math.nan),
        f"eval/{name}/reward_max": max(rewards, default=math.nan),
        f"eval/{name}/response_len/mean": (sum(r.response_len for r in done) / len(done)) if done else math.nan,
        f"eval/{name}/samples": float(len(done)),
        f"eval/{name}/failed": float(len(results) - len(done)),
    }


class EvalLog:
    """The run's `eval.jsonl`: one JSON line per evaluation (`{"step", "version", "eval/...": ...}`;
    `version` names the weights: 0 the starting ones, N those step N-1 made).

    Each line is written whole and fsynced before the evaluation counts as done; a torn last line
    (a crash mid-write) is ignored on reading, so those weights are evaluated again, once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def evaluated(self) -> dict[int, dict[str, Any]]:
        """Version -> its record, for every complete line (a line without a version, step S's: S + 1)."""
        out: dict[int, dict[str, Any]] = {}
        if not self.path.exists():
            return out
        for line in self.path.read_bytes().splitlines():
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                version = record.get("version")
                out[version if isinstance(version, int) else record["step"] + 1] = record
        return out

    def append(self, record: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = orjson.dumps(dict(record), option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        with self.path.open("ab") as fh:
            if fh.tell() and not self._ends_with_newline():
                fh.write(b"\n")  # after a torn line, start clean
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"
