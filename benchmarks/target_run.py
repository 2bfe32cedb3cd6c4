"""One run of the time-to-target set (`benchmarks/time_to_target.py`): the launcher's flags for
a mode, the run, its record (read from its metrics and events), and the evaluation of its kept
weights on the held-out set after it: the grid, then the versions around its crossing, and where
the evaluation's seconds went.

The set's driver (`time_to_target.main`) decides which runs go, in what order, within what budget,
and reports them; everything here is about one run and stays the same whichever called it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.target_eval import (
    eval_engines,
    eval_lines,
    evaluate_on_engines,
    evaluate_versions,
    grid_versions,
    kept_versions,
    read_evaluation,
    refine_versions,
    version_seconds,
)

REPO = Path(__file__).resolve().parents[1]
REWARD = "pipeline.tasks.long_answer:long_answer_reward"
SET_MODES: dict[str, tuple[str, ...]] = {
    "sync": (),
    "partial": ("--partial-rollout", "--over-sampling-batch-size", "{double}"),
    "async": ("--rollout-mode", "async"),
    "async-overlap": ("--rollout-mode", "async", "--overlap-weight-transfer"),
    "sync-colocated": ("--colocate",),
    "partial-colocated": ("--colocate", "--partial-rollout", "--over-sampling-batch-size", "{double}"),
    "async-colocated": ("--colocate", "--rollout-mode", "async"),
}
COLOCATED = tuple(m for m in SET_MODES if m.endswith("-colocated"))
# Modes run only where `--modes` names them, not in the set: partial and async with OPSM off, and
# with OPSM read against the proximal policy. OPSM is on by default in both, and its mask reads the
# current policy, which the step's first optimizer step has already moved, so it drops negative
# samples of a fully on-policy batch too (9-25% of the tokens at a CPU run's first step); these
# read what that costs in steps to the target, and whether OPSM against the policy before the
# step (the rollout's staleness alone) keeps its protection without the cost.
DIAGNOSTIC: dict[str, tuple[str, ...]] = {
    "partial-no-opsm": (*SET_MODES["partial"], "--no-use-opsm"),
    "async-no-opsm": (*SET_MODES["async"], "--no-use-opsm"),
    "partial-opsm-proximal": (*SET_MODES["partial"], "--opsm-against", "proximal"),
    "async-opsm-proximal": (*SET_MODES["async"], "--opsm-against", "proximal"),
}
MODES = {**SET_MODES, **DIAGNOSTIC}  # every mode a run can have: its launcher flags
# The held-out set: drawn like the training prompts (seed 7) from another seed, the same for every run.
HELDOUT, HELDOUT_SEED = "heldout", 1009
EVAL_KEY = f"eval/{HELDOUT}"  # its mean reward in the run's eval.jsonl (pipeline/evaluation.py)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every run of an output folder shares; a later call must ask for the same
    (`time_to_target.PRESETS` names the shapes)."""

    device: str
    hidden: int
    layers: int
    heads: int
    max_count: int
    max_len: int  # --rollout-max-response-len
    batch: int  # groups per step
    group: int  # samples per group
    steps: int
    lr: float
    base_steps: int
    base_batch: int
    base_lr: float
    smooth: int  # trailing mean over steps, for a run judged by its trained batches' reward
    eval_prompts: int  # the held-out set's prompts, one response each
    eval_every: int  # a checkpoint (and so an evaluation) every N steps, and at the last
    smooth_eval: int = 1  # trailing mean over evaluated versions


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What every run of a folder reads: the base model, the training prompts (and the count each
    asks for), the held-out prompts."""

    base: Path
    prompts: Path
    heldout: Path
    counts: list[int]


def run_name(mode: str, seed: int, calibration: bool = False) -> str:
    return f"{mode}-calibration-s{seed}" if calibration else f"{mode}-s{seed}"


def launch_flags(plan: Plan, mode: str, seed: int, *, base: Path, prompts: Path, heldout: Path, out: Path) -> list[str]:
    """The `python -m pipeline.launch` flags of one run. Its checkpoints, every `eval_every` steps
    and at the last (the launcher's rule), all kept, are what `python -m pipeline.eval` evaluates
    after it (`evaluate_run`): the held-out set is named here, with no `--eval-interval`, so nothing
    is evaluated inside the timed run (and async mode, which refuses inline evaluation, takes it)."""
    flags = [
        "--output-dir", str(out), "--no-progress", "--log-level", "warning",
        "--hf-checkpoint", str(base),
        "--prompt-data", str(prompts), "--custom-rm-path", REWARD,
        "--num-rollout", str(plan.steps),
        "--rollout-batch-size", str(plan.batch), "--n-samples-per-prompt", str(plan.group),
        "--rollout-max-response-len", str(plan.max_len),
        "--rollout-seed", str(seed),
        "--lr", str(plan.lr),
        "--save-interval", str(plan.eval_every), "--save-keep-last", "0",
        "--eval-prompt-data", HELDOUT, str(heldout), "--n-samples-per-eval-prompt", "1",
    ]  # fmt: skip
    if plan.device.startswith("cuda"):
        flags += ["--trainer-device", plan.device, "--trainer-dtype", "bfloat16"]
        # Micro-batches of like length: less padding of a long-tailed batch (benchmarks/trainer_step.py).
        flags += ["--max-tokens-per-gpu", "32768"]
        if mode not in COLOCATED:  # a colocated engine follows --trainer-device
            flags += ["--rollout-device", plan.device]
    # Every step's weights kept, so the crossing is read between the grid's checkpoints. A colocated
    # publish goes by CUDA IPC, so its folders are written for the evaluation alone (about 20 ms a
    # step for the h200 preset), and its clock leaves those saves out (`saves_for_eval`).
    flags += ["--save-keep-weights"]
    flags += [f.format(double=2 * plan.batch) for f in MODES[mode]]
    return flags


def record(
    out: Path, mode: str, seed: int, plan: Plan, counts: list[int], *, wall: float, calibration: bool
) -> dict[str, Any]:
    """One run's line of runs.jsonl, read from its metrics.jsonl and events.jsonl."""
    from pipeline.metrics import is_eval_record

    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if not is_eval_record(r)]
    return {
        "mode": mode,
        "seed": seed,
        "calibration": calibration,
        "batch": plan.batch,
        "wall": wall,
        "reward": [r["rollout/raw_reward"] for r in steps],
        "step_seconds": [r["perf/step_time"] for r in steps],
        "busy": [r.get("engine/busy_frac", 0.0) for r in steps],
        "publish_stall": [r.get("time/publish_gate_closed", 0.0) for r in steps],
        "train_seconds": [r.get("perf/train_time", 0.0) for r in steps],
        # The step's save (`perf/save_model_time`, slime's name for time/save) and whether it was a
        # checkpoint: the evaluation's clock leaves the checkpoints' extra seconds out (`eval_clock`).
        "save_seconds": [r.get("perf/save_model_time", 0.0) for r in steps],
        "checkpoint": [r.get("checkpoint/step") == r["step"] for r in steps],
        "length": [r.get("rollout/response_len/mean", 0.0) for r in steps],
        "length_max": [r.get("rollout/response_len/max", 0) for r in steps],
        "truncated": [r.get("rollout/truncated_ratio", 0.0) for r in steps],
        "staleness_max": max((r.get("staleness/max", 0) for r in steps), default=0),
        # What the off-policy corrections did, step by step: the share of tokens OPSM took out (on
        # by default in partial and async modes; it drops a negative sample whose mean log mu - log
        # pi exceeds --opsm-delta, so a batch's earlier optimizer step, or the engine's and the
        # trainer's rounding, can drop an on-policy one), the engine's and the trainer's log-probs
        # apart (mean |diff|), and their k3 KL.
        "opsm_dropped": [r.get("train/opsm_clipfrac", 0.0) for r in steps],
        "logprob_diff": [r.get("train/train_rollout_logprob_abs_diff", 0.0) for r in steps],
        "kl_k3": [r.get("train/approx_kl_k3", 0.0) for r in steps],
        "length_corr": length_correlation(out / "events.jsonl", counts),
    }


def length_correlation(events: Path, counts: list[int]) -> float:
    """Pearson r between the count a sample's prompt asked for and the length it wrote (its last
    request's prefix plus tokens), over the run's finished samples; nan when it cannot be told."""
    last: dict[tuple[str, int], dict[str, Any]] = {}
    if not events.exists():
        return math.nan
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("kind") != "request" or e.get("finish") in (None, "abort"):
            continue
        key = (e["group"], e["sample"])
        if key not in last or e["end"] > last[key]["end"]:
            last[key] = e
    asked, written = [], []
    for (group, _), e in last.items():
        index = int(group.rsplit("-p", 1)[1])
        if index < len(counts):
            asked.append(counts[index])
            written.append(e.get("prefix", 0) + e.get("tokens", 0))
    try:
        return float(statistics.correlation(asked, written))
    except statistics.StatisticsError:
        return math.nan


def evaluate_run(
    plan: Plan,
    seed: int,
    inputs: Inputs,
    out: Path,
    extra: list[str],
    workers: int = 1,
    versions: list[int] | None = None,
    urls: list[str] | None = None,
) -> tuple[list[int], float]:
    """Evaluate a finished run's base weights (version 0) and every checkpoint on the held-out set
    with `python -m pipeline.eval`; (the versions, its wall seconds). It starts a built-in engine of
    its own on the plan's device, so it gets the sync flags of the same plan and seed: a mode's flags
    (`--colocate`, `--rollout-mode async`, `--overlap-weight-transfer`) are about sharing a trainer's
    GPU and publishing while generating, and the evaluation has neither. The flags after `--` go to
    it as they went to the run (they name what both load: engines, dtypes). RuntimeError when it fails.

    `workers` > 1 splits the versions between that many `python -m pipeline.eval` at once, each with
    an engine of its own (`--eval-workers`): a version's evaluation is as long as its longest
    answer's decode, token after token, which leaves a GPU mostly idle, so several side by side
    take about the time of one. Each version gets the same prompts and sampling seeds either way,
    and each line of `eval.jsonl` is written whole; a worker that fails (a port taken between its
    pick and its bind) goes again alone before the evaluation counts as failed
    (`target_eval.evaluate_versions`).

    `versions` names others than the grid (the refinement's: `refine_versions`); `urls`, engines
    the workers use instead of starting their own (`eval_flags`, `target_eval.eval_engines`): then
    the workers are `pipeline.eval`'s code in this process, one per engine, and no process starts
    (`target_eval.evaluate_on_engines`)."""
    if versions is None:
        versions = grid_versions(out)
        if versions[-1] != plan.steps:
            raise RuntimeError(
                f"{out}: checkpoints of versions {versions[1:]}, not the last step's (v{plan.steps}): "
                f"--save-interval {plan.eval_every} saves every {plan.eval_every} steps and the last"
            )
    if not versions:
        return [], 0.0
    flags = eval_flags(plan, seed, inputs, out, extra)
    if urls:  # engines started once for the run's rounds: the workers run in this process
        return versions, evaluate_on_engines(flags, versions, out, urls)
    cmd = [sys.executable, "-m", "pipeline.eval", *flags]
    return versions, evaluate_versions(cmd, versions, out, workers, cwd=REPO, env=run_env())


def eval_flags(plan: Plan, seed: int, inputs: Inputs, out: Path, extra: list[str]) -> list[str]:
    """The flags of a run's evaluation: the sync flags of its plan and seed, then the extra ones."""
    flags = launch_flags(plan, "sync", seed, base=inputs.base, prompts=inputs.prompts, heldout=inputs.heldout, out=out)
    return [*flags, *extra]


def run_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def run_one(
    plan: Plan,
    mode: str,
    seed: int,
    work: Path,
    inputs: Inputs,
    extra: list[str],
    *,
    card: str,
    machine: str,
    target_of: Callable[[dict[str, Any]], float],
    calibration: bool = False,
    eval_workers: int = 1,
) -> dict[str, Any] | None:
    """One launcher run, then the evaluation of its weights; its record, or None (said why) when
    either failed (the next call runs it again). `target_of` gives the set's target from the run's
    record with its grid evaluation (the run that fixes it computes it from its own): where the
    grid crosses it, the kept versions between are evaluated too (`eval_refined`)."""
    name = run_name(mode, seed, calibration)
    out = work / "runs" / name
    shutil.rmtree(out, ignore_errors=True)  # a run cut short by an earlier call starts over
    flags = launch_flags(plan, mode, seed, base=inputs.base, prompts=inputs.prompts, heldout=inputs.heldout, out=out)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", *flags, *extra],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    try:
        if done.returncode != 0:
            print(f"run {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            return None
        rec = record(out, mode, seed, plan, inputs.counts, wall=wall, calibration=calibration)
        rec["base"] = json.loads((inputs.base / "base.json").read_text())["fingerprint"][:12]
        rec["card"] = card
        rec["machine"] = machine  # the host and the card's UUID: which runs shared a machine
        rec["saves_for_eval"] = mode in COLOCATED  # before read_evaluation: its clock leaves them out
        try:
            # Both rounds on the same engines, started once (`eval_engines`); the evaluation's
            # seconds are all of it, the engines' start and stop included.
            evaluating = time.perf_counter()
            flags = eval_flags(plan, seed, inputs, out, extra)
            with eval_engines(flags, eval_workers, out / "logs" / "eval-engines") as urls:
                if urls:
                    rec["eval_engines_up"] = time.perf_counter() - evaluating
                versions, seconds = evaluate_run(plan, seed, inputs, out, extra, eval_workers, urls=urls)
                rec["eval"] = read_evaluation(out, rec, versions, EVAL_KEY)
                # Where an evaluation's seconds go: each version's decode and load, each engine's start.
                rec["eval_phases"] = [eval_phase(out, versions, seconds, eval_workers)]
                if plan.smooth_eval == 1:  # a trailing mean over evaluations would change with denser ones
                    finer = refine_versions(rec["eval"], kept_versions(out), target_of(rec))
                    finer, seconds = evaluate_run(plan, seed, inputs, out, extra, eval_workers, finer, urls=urls)
                    rec["eval_refined"] = read_evaluation(out, rec, finer, EVAL_KEY)
                    if finer:
                        rec["eval_phases"].append(eval_phase(out, finer, seconds, eval_workers))
            rec["eval_seconds"] = time.perf_counter() - evaluating
        except RuntimeError as exc:
            print(f"run {name}: its evaluation failed: {exc}")
            return None
        return rec
    finally:
        for heavy in ("weights", "checkpoints", "model"):  # what a run leaves beyond its figures
            shutil.rmtree(out / heavy, ignore_errors=True)


def eval_phase(out: Path, versions: list[int], seconds: float, workers: int) -> dict[str, Any]:
    """One `python -m pipeline.eval` round of a run (the grid, or the refinement): how many
    versions, its wall seconds, side by side in how many, its versions' decode and load seconds
    (None where a version's line has none: runs.jsonl stays strict JSON), each worker's engine
    start (the lines that carry one), and the rest of its seconds (`round_rest`)."""

    lines = eval_lines(out)  # the run's metrics.jsonl, read once for the three figures

    def per_version(key: str) -> list[float | None]:
        return [d if math.isfinite(d) else None for d in version_seconds(out, versions, key, lines)]

    decode, load = per_version("time/eval"), per_version("time/eval_load")
    starts = per_version("time/eval_engine_start")
    return {
        "versions": len(versions),
        "seconds": seconds,
        "workers": min(workers, len(versions)),
        "decode": decode,
        "load": load,
        "starts": [d for d in starts if d is not None],
        "rest": round_rest(seconds, min(workers, len(versions)), decode, load, starts),
    }


def round_rest(
    seconds: float, workers: int, decode: list[float | None], load: list[float | None], starts: list[float | None]
) -> float | None:
    """A round's seconds that none of its figures hold: each worker (`evaluate_versions` gives
    worker i the versions i, i + workers, ...) starts its engine, then loads and decodes its
    versions; the round lasts as its slowest worker, and the rest is the workers' own start (a
    process's Python, imports and tokenizer) and the engines' stop (with engines the rounds share,
    `eval_engines`, the workers run in the benchmark's process, a worker's start is reading its
    flags and tokenizer and opening its engine, and no round stops one). None where a figure is
    missing."""
    spent = [None if d is None or w is None else d + w for d, w in zip(decode, load, strict=True)]
    firsts = starts[:workers]
    if workers < 1 or None in spent or None in firsts:
        return None
    busy = [start + sum(spent[i::workers]) for i, start in enumerate(firsts)]  # type: ignore[arg-type,operator]
    return max(0.0, seconds - max(busy))


def eval_said(phases: list[dict[str, Any]], engines_up: float | None = None) -> str:
    """`eval_phase`s in words: `11 versions in 62 s, 3 side by side, decoding 4.1 s each, loading
    0.1 s each, engines up in 12-14 s, 9 s besides (the workers' start, engines' stop)` (a record
    from before a figure was kept leaves it out); `engines_up`, the seconds of engines the rounds
    shared (`eval_engines_up`), goes first, and then a round's own engines start in no time."""
    said = []
    for p in phases:
        text = f"{p['versions']} versions in {p['seconds']:.0f} s, {p['workers']} side by side"
        for word, key in (("decoding", "decode"), ("loading", "load")):
            known = [d for d in p.get(key, []) if d is not None]  # eval_phase keeps a missing one as None
            text += f", {word} {statistics.fmean(known):.1f} s each" if known else ""
        if (starts := p.get("starts")) and engines_up is None:
            low, high = min(starts), max(starts)
            text += (
                f", engines up in {low:.0f} s"
                if round(low) == round(high)
                else f", engines up in {low:.0f}-{high:.0f} s"
            )
        if p.get("rest") is not None:  # with shared engines, a round stops none
            besides = "the workers' start" if engines_up is not None else "the workers' start, engines' stop"
            text += f", {p['rest']:.0f} s besides ({besides})"
        said.append(text)
    shared = [f"engines up once in {engines_up:.0f} s"] if engines_up is not None else []
    return "; ".join(shared + said)
