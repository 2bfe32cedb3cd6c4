"""A time-to-target run's evaluation (`benchmarks/time_to_target.py`): which versions it is
evaluated at (the grid of its checkpoints, and the weights it kept between the grid's evaluations
around its crossing of the target), the engines its rounds share, `python -m pipeline.eval` for them
side by side, and the run's clock at each version, less what the evaluation's own checkpoints cost it."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.from_thread

from benchmarks.target_summary import first_reach
from core.errors import EngineError

__all__ = [
    "checkpoint_overhead",
    "eval_clock",
    "eval_engines",
    "eval_lines",
    "evaluate_versions",
    "grid_versions",
    "kept_versions",
    "read_evaluation",
    "refine_versions",
    "version_seconds",
]


def checkpoint_overhead(save_seconds: list[float], checkpoint: list[bool], *, all_saves: bool = False) -> list[float]:
    """Per step, the seconds its save took for the evaluation: at a checkpoint step, its save less
    the median of the run's other steps' saves (the weights-only folder the engines load, which the
    step writes anyway when it publishes from disk), 0 at every other step. With no step but
    checkpoints, each checkpoint's whole save. `all_saves`: the mode publishes without a folder
    (CUDA IPC) and wrote every one for the evaluation alone (`--save-keep-weights`): every save,
    whole."""
    if all_saves:
        return list(save_seconds)
    plain = [s for s, c in zip(save_seconds, checkpoint, strict=True) if not c]
    usual = statistics.median(plain) if plain else 0.0
    return [max(0.0, s - usual) if c else 0.0 for s, c in zip(save_seconds, checkpoint, strict=True)]


def eval_clock(
    step_seconds: list[float],
    save_seconds: list[float],
    checkpoint: list[bool],
    versions: list[int],
    *,
    all_saves: bool = False,
) -> list[float]:
    """The run's wall seconds at which each version's weights were made: version v after step v-1,
    so its first v steps' seconds less what the evaluation's saves added to them (they are the
    measurement's, not the mode's: `checkpoint_overhead`). Version 0, the base weights, at 0."""
    extra = checkpoint_overhead(save_seconds, checkpoint, all_saves=all_saves)
    clock = [0.0, *itertools.accumulate(s - e for s, e in zip(step_seconds, extra, strict=True))]
    if bad := [v for v in versions if not 0 <= v < len(clock)]:
        raise ValueError(f"versions {bad}: a run of {len(step_seconds)} steps makes versions 0..{len(step_seconds)}")
    return [clock[v] for v in versions]


def _versions_in(out: Path, folder: str) -> list[int]:
    """The versions of the run's complete `vN` folders under `out/folder`, as `python -m
    pipeline.eval` finds them (`saved_weights`: a checkpoint wins over a weights-only copy)."""
    from pipeline.run.eval_run import saved_weights

    return [v for v, path in saved_weights(out).items() if path.parent.name == folder]


def grid_versions(out: Path) -> list[int]:
    """What every run is evaluated at: the base weights and each checkpoint (`checkpoints/vN`)."""
    from pipeline.checkpoints import CHECKPOINTS_DIR

    return [0, *_versions_in(out, CHECKPOINTS_DIR)]


def kept_versions(out: Path) -> list[int]:
    """The versions whose weights-only folders the run kept (`weights/vN`, `--save-keep-weights`)."""
    from pipeline.checkpoints import PUBLISH_DIR

    return _versions_in(out, PUBLISH_DIR)


def refine_versions(grid: dict[str, list[Any]], kept: list[int], target: float) -> list[int]:
    """The kept versions between the grid's last evaluation short of `target` and its first to
    reach it: evaluated too, they put the crossing at the step it happened, not at the next
    evaluation of the grid (`benchmarks/target_summary.figures` reads both). None when the grid
    never reaches it, or reaches it at its first version."""
    hit = first_reach(grid["reward"], target, 1)
    if not hit:
        return []
    low, high = grid["version"][hit - 1], grid["version"][hit]
    return [v for v in kept if low < v < high]


@contextlib.contextmanager
def eval_engines(flags: list[str], workers: int, log_dir: Path) -> Iterator[list[str]]:
    """Built-in engines for an evaluation's rounds, one a worker, started once and stopped on exit;
    their URLs. A round's `python -m pipeline.eval` that starts its own engines pays their start
    each time: 11 s for each of two rounds of an H100 run, most of what is not decode. Given one of
    these with `--sglang-url`, it loads each version's weights there (`update_weights_from_disk`),
    as it would into its own. `flags` are the evaluation's (the run's `launch_flags` and extra
    ones): the engines get their model, device, host and slots; flags that name the user's engines
    or another launcher start none (an empty list: each round then starts its own, as before).
    RuntimeError when an engine does not start."""
    from launch.builtin_engine import start_engines
    from pipeline.config import load_config
    from pipeline.run.run_engines import builtin_engine_args

    e = load_config(flags).engine
    if e.urls or e.router_url or e.launcher != "builtin" or not e.hf_checkpoint or workers < 1:
        yield []
        return
    start = functools.partial(
        start_engines,
        workers,
        e.hf_checkpoint,
        host=e.host,
        max_running_requests=e.sglang_server_concurrency,
        log_dir=log_dir,
        extra_args=builtin_engine_args(e),
        api_key=e.api_key or None,
    )
    with anyio.from_thread.start_blocking_portal() as portal:
        try:
            engines = portal.call(start)
        except EngineError as exc:
            raise RuntimeError(f"the evaluation's engines did not start: {exc}") from exc
        try:
            yield [engine.url for engine in engines]
        finally:
            for engine in engines:
                portal.call(engine.stop)


def _version_flags(versions: list[int]) -> list[str]:
    return [flag for v in versions for flag in ("--eval-version", str(v))]


def evaluate_versions(
    cmd: list[str], versions: list[int], out: Path, workers: int, *, cwd: Path, env: dict[str, str]
) -> float:
    """`cmd` (a `python -m pipeline.eval` of the run in `out`) for `versions`, split between
    `workers` side by side, each starting an engine of its own; its wall seconds. A version's
    evaluation is as long as its longest answer's decode, token after token, which leaves a GPU
    mostly idle: several side by side take about the time of one. Each gets the same prompts and
    sampling seeds either way, and each line of `eval.jsonl` is written whole. A worker that fails
    (a port taken between its pick and its bind) goes again alone; RuntimeError when that fails."""
    count = max(1, min(workers, len(versions)))
    groups = [(cmd, versions[i::workers]) for i in range(count)]
    started = time.perf_counter()
    for (command, group), _ in _eval_side_by_side(groups, out, cwd=cwd, env=env):  # alone this time
        done = subprocess.run(command + _version_flags(group), cwd=cwd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"python -m pipeline.eval exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def evaluate_on_engines(flags: list[str], versions: list[int], out: Path, urls: list[str]) -> float:
    """`pipeline.eval`'s own work (`evaluate_saved`, its flags `flags`) for `versions`, worker i on
    the engine at `urls[i]` (from `eval_engines`) with versions i, i + len(urls), ..., all side by
    side in this process; its wall seconds. No process starts: on an H100 host each round's
    `python -m pipeline.eval` workers spent 11-17 s starting (importing, loading the tokenizer),
    as long as the round's decode. The same flags, prompts and sampling seeds as a worker process
    gets; what the workers print goes to `out/eval-workers.log`. RuntimeError when one fails."""
    from pipeline.config import load_config
    from pipeline.run.eval_run import evaluate_saved

    if not urls:
        raise ValueError("evaluate_on_engines: no engine URLs (eval_engines started none: use evaluate_versions)")
    workers = len(urls)
    configs = [load_config([*flags, "--sglang-url", url]) for url in urls[: min(workers, len(versions))]]

    async def side_by_side() -> None:
        async with anyio.create_task_group() as tg:
            for i, config in enumerate(configs):
                tg.start_soon(evaluate_saved, config, versions[i::workers])

    started = time.perf_counter()
    with (out / "eval-workers.log").open("a") as log, contextlib.redirect_stdout(log):
        try:
            anyio.run(side_by_side)
        except Exception as exc:  # the task group's ExceptionGroup: every worker's error in it
            raise RuntimeError(
                f"the evaluation of {out} failed (its log: {out / 'eval-workers.log'}): {exc!r}"
            ) from exc
    return time.perf_counter() - started


def _eval_side_by_side(
    groups: list[tuple[list[str], list[int]]], out: Path, *, cwd: Path, env: dict[str, str]
) -> list[tuple[tuple[list[str], list[int]], str]]:
    """Run each (command, versions) at once; the ones that failed, with their stderr's tail."""
    logs = [out / f"eval-worker-{i}.log" for i in range(len(groups))]
    procs = []
    for (command, group), log_path in zip(groups, logs, strict=True):
        with log_path.open("w") as err:  # a file, not a pipe: no worker blocks on a full one
            procs.append(subprocess.Popen(command + _version_flags(group), cwd=cwd, env=env, stdout=err, stderr=err))
    failed = []
    for group, proc, log_path in zip(groups, procs, logs, strict=True):
        if proc.wait() != 0:
            failed.append((group, log_path.read_text()[-3000:]))
    return failed


def read_evaluation(out: Path, rec: dict[str, Any], versions: list[int], key: str) -> dict[str, list[Any]]:
    """The run record's `eval`: each version's held-out reward (`key`, `eval/<set>`, in the run's
    eval.jsonl) and the run's seconds when it was made (`eval_clock`; every save left out where the
    record says its mode wrote them for the evaluation alone, `saves_for_eval`). RuntimeError when
    a version has no reward (not evaluated, or every sample of it failed)."""
    from pipeline.evaluation import EvalLog
    from pipeline.run.eval_run import EVAL_FILE

    done = EvalLog(out / EVAL_FILE).evaluated()
    reward = [float(done.get(v, {}).get(key, math.nan)) for v in versions]
    if missing := [v for v, r in zip(versions, reward, strict=True) if not math.isfinite(r)]:
        raise RuntimeError(f"{out / EVAL_FILE}: no {key} for versions {missing} (evaluated: {sorted(done)})")
    seconds = eval_clock(
        rec["step_seconds"],
        rec["save_seconds"],
        rec["checkpoint"],
        versions,
        all_saves=rec.get("saves_for_eval", False),
    )
    return {"version": versions, "reward": reward, "seconds": seconds}


def eval_lines(out: Path) -> dict[int, dict[str, Any]]:
    """Each evaluated version's line of the run's metrics.jsonl (the last of a version evaluated
    twice); none where the file is missing."""
    from pipeline.metrics import is_eval_record

    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {int(r["version"]): r for r in map(json.loads, lines) if is_eval_record(r)}


def version_seconds(
    out: Path, versions: list[int], key: str = "time/eval", lines: dict[int, dict[str, Any]] | None = None
) -> list[float]:
    """Each version's `key` in its line of the run's metrics.jsonl (`eval_lines`, read here unless
    given), NaN where it has none: `time/eval` the held-out set's decode once its weights are
    loaded, `time/eval_load` their load, `time/eval_engine_start` the engines' start (on each
    `python -m pipeline.eval`'s first line only)."""
    found = eval_lines(out) if lines is None else lines
    return [float(found.get(v, {}).get(key, math.nan)) for v in versions]
