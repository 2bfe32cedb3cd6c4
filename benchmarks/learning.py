"""Learning that holds, measured: every rollout mode on three built-in tasks, several seeds each.

    python -m benchmarks.learning [--steps 100] [--seeds 0,1,2] [--parallel 6] [--quick]
                                  [--tasks toy,long-tail,short-answer] [--modes sync,partial,async-s1,async]
                                  [--out DIR] [-- extra pipeline flags]
    python -m benchmarks.learning --design history [--steps 60] [--seeds 0,1,2] [--parallel 16]
    python -m benchmarks.learning --summarize DIR/runs.jsonl [...]   (the table of finished runs)

`--design history` (issue 50) measures what the prompts' stored histories buy: the tasks
`easy-hard` (`pipeline.tasks.easy_hard`: a share of prompts solved early, a share not solvable
yet, the rest learnable) and `long-tail`, each a finite set of `--prompts` rows (96) seen over
many epochs, evaluated every `--eval-every` steps (5) on the same rows; the settings `dapo`
(sync + the DAPO filter), `dapo-skip` (and `--skip-zero-std-prompts`), `dapo-skip-explore` (the
same with `--skip-explore-floor 0.3`), `sync` and `length` (`--length-aware-admission`; and
`partial-length` against `partial` when named), with `--sglang-server-concurrency 16` so a round's 64 samples do
not all start at once (otherwise the order they start in cannot matter). Its table (`history_table`)
gives per setting the generated tokens and the wall time (summed step times) to reach 90% of its
baseline's final reward (dapo for dapo-skip, sync for length), the final reward (the mean
evaluation over the last quarter of the steps), the step-time tail (p90 over p50 of the steps) and
the same of the rollout part alone (`perf/train_wait_time`: in sync mode the trainer waits exactly
for the round; the whole step also holds training, publishing and checkpoints, the same in every
setting).

Each run is `python -m pipeline.launch` in its own process (built-in engine over real HTTP, the
real trainer, default flags), so what is measured is what a user runs. Modes:

    sync        train after each round
    partial     sync + --partial-rollout (stragglers aborted at the target, resumed next round)
    async-s1    --rollout-mode async --max-staleness 1
    async       --rollout-mode async, no staleness bound
    async-s2    --rollout-mode async --max-staleness 2 (only when named in --modes)
    async-unpaced  --rollout-mode async --no-async-pacing (only when named in --modes)

Tasks: `toy` (the default task), `long-tail` (`pipeline.tasks.long_tail`, written as a JSONL file
and read back through --prompt-data with the toy reward) and `short-answer`
(`pipeline.tasks.short_answer`: "add 3+4:" -> "7<eos>", answers of one or two digits that earn
nothing without the end token). Per task and mode it prints the mean reward over the last quarter
of steps (mean over seeds, and its ratio to sync), the first step at which the seed-mean reward
reaches half of sync's last-quarter reward, the longest run of consecutive steps with the mean
response length at the cap (>= 95% of --rollout-max-response-len) in any seed, and the collapses:
how many seeds collapsed, of either kind (`collapses`):

    at the cap   5+ consecutive steps with the mean response length at the cap (the end token lost)
    short        5+ consecutive steps with mean response length <= 2 while the reward falls (the
                 window's mean reward more than 25% below the best 10-step mean reward before it)

It writes summary.json and learning.png (reward and response length per step) to --out, and each
run to runs.jsonl as it finishes (a call cut short keeps those). A run that fails is run again
once from scratch (with dozens at once two engines can take the same free port); the run records
`retried`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from pipeline.metrics import EVAL_STEP, is_eval_record

REPO = Path(__file__).resolve().parents[1]
_DAPO = ("--dynamic-sampling-filter-path", "stages.filter:reward_std_nonzero")
MODES: dict[str, tuple[str, ...]] = {
    "sync": (),
    "partial": ("--partial-rollout",),
    "async-s1": ("--rollout-mode", "async", "--max-staleness", "1"),
    "async": ("--rollout-mode", "async"),
    # Not in the default design, asked for by name (`--modes`): a bound between the two above, and
    # async with admission unpaced (always its whole window ahead: the default before pacing).
    "async-s2": ("--rollout-mode", "async", "--max-staleness", "2"),
    "async-unpaced": ("--rollout-mode", "async", "--no-async-pacing"),
    # The prompts' histories (issue 50), asked for by name or by `--design history`.
    "dapo": _DAPO,
    "dapo-skip": (*_DAPO, "--skip-zero-std-prompts"),
    # A higher exploration floor: prompts on a streak come back 3 times in 10 instead of 1.
    "dapo-skip-explore": (*_DAPO, "--skip-zero-std-prompts", "--skip-explore-floor", "0.3"),
    "length": ("--length-aware-admission",),
    "partial-length": ("--partial-rollout", "--length-aware-admission"),
}
DEFAULT_MODES = ("sync", "partial", "async-s1", "async")
TASKS = ("toy", "long-tail", "short-answer", "easy-hard")
# `--design history`: each treatment against its baseline, on a finite prompt set over many epochs.
HISTORY_PAIRS = {"dapo-skip": "dapo", "dapo-skip-explore": "dapo", "length": "sync", "partial-length": "partial"}
HISTORY_DESIGN = {
    "tasks": "easy-hard,long-tail",
    "modes": "sync,length,dapo,dapo-skip,dapo-skip-explore",
    "prompts": 96,
    "eval_every": 5,
    "steps": 60,
    "concurrency": 16,
}
REACH = 0.9  # "the same reward": this share of the baseline's final reward
AT_CAP = 0.95  # a step's mean response length this close to the cap counts as "at the cap"
COLLAPSE_STEPS = 5  # consecutive steps that make a collapse, of either kind
SHORT_LEN = 2.0  # a step's mean response length at or below this counts as "short"
# "The reward falls": the short window's mean reward is below FALLEN x the best BEST_STEPS-step mean
# reward before it. Calibrated on the runs of BENCHMARKS.md section 12: a plateau's noise (the
# short-answer task settles at one-digit answers, length 2) stays above 0.81 of its best, the two
# collapses seen fell to 0.57-0.71.
FALLEN = 0.75
BEST_STEPS = 10


def _task_flags(task: str, work: Path, prompts: int = 4096, eval_every: int | None = None) -> tuple[str, ...]:
    """The flags of `task` with `prompts` rows (JSONL tasks; the toy task's `--num-prompts`), and
    with `eval_every`, an inline evaluation of the same rows every that many steps."""
    if task == "toy":
        flags: tuple[str, ...] = ("--num-prompts", str(prompts)) if prompts != 4096 else ()
        return (*flags, "--eval-interval", str(eval_every)) if eval_every else flags
    if task == "short-answer":
        from pipeline.tasks.short_answer import short_answer_rows

        rows, reward = short_answer_rows(prompts, seed=7), "pipeline.tasks.short_answer:short_answer_reward"
    elif task == "easy-hard":
        from pipeline.tasks.easy_hard import easy_hard_rows

        rows, reward = easy_hard_rows(prompts, seed=7), "pipeline.tasks.easy_hard:easy_hard_reward"
    else:
        from pipeline.tasks.long_tail import long_tail_rows

        rows, reward = long_tail_rows(prompts, seed=7), "pipeline.tasks.toy:toy_reward"
    # The 4096-row files keep their old names (runs of the earlier designs point at them).
    path = work / (f"{task.replace('-', '_')}.jsonl" if prompts == 4096 else f"{task}-{prompts}.jsonl")
    if not path.exists():
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ("--prompt-data", str(path), "--custom-rm-path", reward)
    if eval_every:
        flags += ("--eval-interval", str(eval_every), "--eval-prompt-data", "train", str(path))
    return flags


def _run(
    task: str,
    mode: str,
    seed: int,
    steps: int,
    work: Path,
    extra: list[str],
    prompts: int = 4096,
    eval_every: int | None = None,
) -> dict[str, Any]:
    out = work / f"{task}-{mode}-s{seed}"
    cmd = [
        sys.executable,
        "-m",
        "pipeline.launch",
        "--output-dir",
        str(out),
        "--no-progress",
        "--log-level",
        "warning",
        "--num-rollout",
        str(steps),
        "--rollout-seed",
        str(seed),
        *MODES[mode],
        *_task_flags(task, work, prompts, eval_every),
        *extra,
    ]
    # The repo first, and whatever the caller's PYTHONPATH already names after it (a --target install).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    retried = done.returncode != 0
    if retried:
        # Once, from scratch: with dozens of runs at once two engines can take the same free port
        # (BENCHMARKS.md section 12 lost two runs so). A second failure is a real one.
        print(f"  {task}/{mode}/seed {seed} exited {done.returncode}, run again:\n{done.stderr[-1500:]}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{task}/{mode}/seed {seed} exited {done.returncode}:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if not is_eval_record(r)]  # an evaluation's own line is no step's
    # The mean reward of each evaluation, by steps trained: 0 for the starting weights' own line,
    # s + 1 for the one in step s's record (it evaluated that step's weights).
    names = (k for r in lines for k in r if k.startswith("eval/") and k.count("/") == 1 and "-" not in k)
    name = next((k for k in names if k != EVAL_STEP), None)
    evals = {(0 if is_eval_record(r) else int(r["step"]) + 1): float(r[name]) for r in lines if name and name in r}
    return {
        "task": task,
        "mode": mode,
        "seed": seed,
        "seconds": time.perf_counter() - started,
        "retried": retried,
        "reward": [r["rollout/raw_reward"] for r in records],
        "length": [r["rollout/response_len/mean"] for r in records],
        "staleness_max": max(r["staleness/max"] for r in records),
        "is_weight_max": max(r.get("train/is_weight_max", 0.0) for r in records),
        "entropy": [r.get("train/entropy", 0.0) for r in records],
        "zero_std_groups": [r.get("rollout/zero_std/count", 0.0) for r in records],
        "grad_norm": [r.get("train/grad_norm", 0.0) for r in records],
        "train_seconds": sum(r.get("perf/train_time", 0.0) for r in records),
        "ref_seconds": sum(r.get("perf/ref_log_probs_time", 0.0) for r in records),
        # What the histories change (issue 50): tokens generated so far and each step's time, the
        # evaluations ({step: reward}, 0 = the starting weights), the prompts skipped.
        "tokens": [r.get("tokens/generated_total", 0.0) for r in records],
        "step_time": [r.get("perf/step_time", 0.0) for r in records],
        # In sync mode the trainer waits exactly for the round: the rollout part of the step.
        "rollout_time": [r.get("perf/train_wait_time", 0.0) for r in records],
        "eval": dict(sorted(evals.items())),
        "skipped": records[-1].get("filter/rejected/skipped_zero_std", 0.0) if records else 0.0,
        "rejected": records[-1].get("filter/rejected/rejected", 0.0) if records else 0.0,
    }


def _longest_at_cap(lengths: list[float], cap: int) -> int:
    best = run = 0
    for length in lengths:
        run = run + 1 if length >= AT_CAP * cap else 0
        best = max(best, run)
    return best


def collapses(reward: list[float], length: list[float], cap: int) -> tuple[bool, bool]:
    """(collapsed at the cap, collapsed short) for one run, as the module docstring defines them."""
    at_cap = _longest_at_cap(length, cap) >= COLLAPSE_STEPS
    short = False
    for i in range(len(length) - COLLAPSE_STEPS + 1):
        if i < BEST_STEPS or any(x > SHORT_LEN for x in length[i : i + COLLAPSE_STEPS]):
            continue
        before = reward[:i]
        best = max(statistics.mean(before[j : j + BEST_STEPS]) for j in range(len(before) - BEST_STEPS + 1))
        if statistics.mean(reward[i : i + COLLAPSE_STEPS]) < FALLEN * best:
            short = True
    return at_cap, short


def _seed_mean(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [statistics.mean(values) for values in zip(*(r[key] for r in runs), strict=True)]


def summarize(runs: list[dict[str, Any]], cap: int) -> list[dict[str, Any]]:
    """One row per task and mode, as in the module docstring."""
    rows = []
    for task in dict.fromkeys(r["task"] for r in runs):
        by_mode = {m: [r for r in runs if r["task"] == task and r["mode"] == m] for m in MODES}
        by_mode = {m: rs for m, rs in by_mode.items() if rs}
        quarter = max(1, len(next(iter(by_mode.values()))[0]["reward"]) // 4)
        last = {m: [statistics.mean(r["reward"][-quarter:]) for r in rs] for m, rs in by_mode.items()}
        sync_last = statistics.mean(last["sync"]) if "sync" in last else None
        for mode, rs in by_mode.items():
            curve = _seed_mean(rs, "reward")
            half = None
            if sync_last is not None:
                half = next((i for i, v in enumerate(curve) if v >= 0.5 * sync_last), None)
            mean_last = statistics.mean(last[mode])
            rows.append(
                {
                    "task": task,
                    "mode": mode,
                    "seeds": len(rs),
                    "last_quarter_reward": mean_last,
                    "seed_std": statistics.stdev(last[mode]) if len(rs) > 1 else 0.0,
                    "vs_sync": mean_last / sync_last if sync_last else None,
                    "steps_to_half_sync": half,
                    "longest_at_cap": max(_longest_at_cap(r["length"], cap) for r in rs),
                    "collapsed_at_cap": sum(collapses(r["reward"], r["length"], cap)[0] for r in rs),
                    "collapsed_short": sum(collapses(r["reward"], r["length"], cap)[1] for r in rs),
                    "train_seconds": statistics.mean(r["train_seconds"] for r in rs),
                    "staleness_max": max(r["staleness_max"] for r in rs),
                    "is_weight_max": max(r["is_weight_max"] for r in rs),
                    "minutes": statistics.mean(r["seconds"] for r in rs) / 60,
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| task | mode | last-quarter reward (± seed std) | vs sync | steps to half sync | longest at cap "
        "| collapses (cap / short) | max staleness |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = f"{r['vs_sync']:.2f}" if r["vs_sync"] is not None else "-"
        half = "never" if r["steps_to_half_sync"] is None else str(r["steps_to_half_sync"])
        lines.append(
            f"| {r['task']} | {r['mode']} | {r['last_quarter_reward']:.3f} ± {r['seed_std']:.3f} | {vs} "
            f"| {half} | {r['longest_at_cap']} | {r['collapsed_at_cap']} / {r['collapsed_short']} "
            f"| {r['staleness_max']} |"
        )
    return "\n".join(lines)


def _quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values`, interpolated between the two nearest (numpy's default)."""
    xs = sorted(values)
    at = q * (len(xs) - 1)
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


def final_reward(run: dict[str, Any]) -> float:
    """The mean evaluation over the last quarter of the steps (the last quarter's training reward
    for a run without evaluations)."""
    steps = len(run["reward"])
    late = [float(v) for s, v in run.get("eval", {}).items() if int(s) >= steps - max(1, steps // 4)]
    if late:
        return statistics.mean(late)
    return statistics.mean(run["reward"][-max(1, steps // 4) :])


def history_rows(runs: list[dict[str, Any]], reach: float = REACH) -> list[dict[str, Any]]:
    """One row per task and setting of `--design history` (the module docstring's columns).

    "The same reward" is `reach` x the baseline's final reward (each setting against its baseline
    in `HISTORY_PAIRS`, a baseline against itself): the first evaluation at which the seed-mean
    reward reaches it, and the seed-mean tokens generated and step seconds spent until then."""
    rows = []
    for task in dict.fromkeys(r["task"] for r in runs):
        by_mode = {m: [r for r in runs if r["task"] == task and r["mode"] == m] for m in MODES}
        by_mode = {m: rs for m, rs in by_mode.items() if rs}
        finals = {m: [final_reward(r) for r in rs] for m, rs in by_mode.items()}
        reached: dict[str, dict[str, float | None]] = {}
        for mode, rs in by_mode.items():
            base = HISTORY_PAIRS.get(mode, mode) if HISTORY_PAIRS.get(mode) in by_mode else mode
            target = reach * statistics.mean(finals[base])
            evals = [{int(k): float(v) for k, v in r.get("eval", {}).items()} for r in rs]  # JSON keys are text
            points = sorted(set.intersection(*(set(e) for e in evals))) if evals else []
            step = next((p for p in points if statistics.mean(e[p] for e in evals) >= target), None)
            tokens = wall = None
            if step is not None:
                tokens = statistics.mean(r["tokens"][step - 1] if step else 0.0 for r in rs)
                wall = statistics.mean(sum(r["step_time"][:step]) for r in rs)
            reached[mode] = {"base": base, "target": target, "step": step, "tokens": tokens, "wall": wall}
        for mode, rs in by_mode.items():
            got, base = reached[mode], reached[str(reached[mode]["base"])]
            times = [t for r in rs for t in r["step_time"]]
            p50, p90 = _quantile(times, 0.5), _quantile(times, 0.9)
            base_times = [t for r in by_mode[str(got["base"])] for t in r["step_time"]]
            base_tail = _quantile(base_times, 0.9) / _quantile(base_times, 0.5)
            rounds = [t for r in rs for t in r.get("rollout_time", [])] or [0.0]
            base_rounds = [t for r in by_mode[str(got["base"])] for t in r.get("rollout_time", [])] or [0.0]
            r50, r90 = _quantile(rounds, 0.5), _quantile(rounds, 0.9)
            base_r50, base_r90 = _quantile(base_rounds, 0.5), _quantile(base_rounds, 0.9)

            def ratio(key: str, got: dict[str, Any] = got, base: dict[str, Any] = base) -> float | None:
                return got[key] / base[key] if got[key] is not None and base[key] else None

            rows.append(
                {
                    "task": task,
                    "mode": mode,
                    "baseline": got["base"],
                    "seeds": len(rs),
                    "final_reward": statistics.mean(finals[mode]),
                    "seed_std": statistics.stdev(finals[mode]) if len(rs) > 1 else 0.0,
                    "vs_baseline": statistics.mean(finals[mode]) / statistics.mean(finals[str(got["base"])]),
                    "target": got["target"],
                    "steps_to_target": got["step"],
                    "tokens_to_target": got["tokens"],
                    "tokens_vs_baseline": ratio("tokens"),
                    "wall_to_target": got["wall"],
                    "wall_vs_baseline": ratio("wall"),
                    "tokens_total": statistics.mean(r["tokens"][-1] for r in rs),
                    # A run whose policy leaves almost no group with a spread makes the filter
                    # generate without end: one such seed dominates the mean, so the median too.
                    "tokens_total_median": statistics.median(r["tokens"][-1] for r in rs),
                    "step_p50": p50,
                    "step_p90": p90,
                    "tail": p90 / p50 if p50 else None,
                    "tail_vs_baseline": (p90 / p50) / base_tail if p50 and base_tail else None,
                    "step_mean": statistics.mean(times),
                    "rollout_p50": r50,
                    "rollout_p90": r90,
                    "rollout_tail": r90 / r50 if r50 else None,
                    "rollout_tail_vs_baseline": (r90 / r50) / (base_r90 / base_r50) if r50 and base_r50 else None,
                    "rollout_p90_vs_baseline": r90 / base_r90 if base_r90 else None,
                    "skipped": statistics.mean(r.get("skipped", 0.0) for r in rs),
                    "rejected": statistics.mean(r.get("rejected", 0.0) for r in rs),
                    "minutes": statistics.mean(r["seconds"] for r in rs) / 60,
                }
            )
    return rows


def history_table(rows: list[dict[str, Any]]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        f"| task | setting (vs) | final reward (± seed std) | vs baseline | steps to {REACH:.0%} of baseline's "
        "| tokens to it (vs baseline) | wall s to it (vs baseline) | tokens in all (median) | step p50 / p90 s "
        "| tail p90/p50 (vs baseline) | rollout p50 / p90 s (p90 vs baseline) | rollout tail p90/p50 (vs baseline) "
        "| skipped / filtered |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['mode']} ({r['baseline']}) | {r['final_reward']:.3f} ± {r['seed_std']:.3f} "
            f"| {r['vs_baseline']:.2f} | {num(r['steps_to_target'], 'd')} "
            f"| {num(r['tokens_to_target'], '.0f')} ({num(r['tokens_vs_baseline'], '.2f')}) "
            f"| {num(r['wall_to_target'], '.0f')} ({num(r['wall_vs_baseline'], '.2f')}) "
            f"| {r['tokens_total']:.0f} ({r['tokens_total_median']:.0f}) "
            f"| {r['step_p50']:.2f} / {r['step_p90']:.2f} | {num(r['tail'], '.2f')} "
            f"({num(r['tail_vs_baseline'], '.2f')}) | {r['rollout_p50']:.2f} / {r['rollout_p90']:.2f} "
            f"({num(r['rollout_p90_vs_baseline'], '.2f')}) | {num(r['rollout_tail'], '.2f')} "
            f"({num(r['rollout_tail_vs_baseline'], '.2f')}) | {r['skipped']:.0f} / {r['rejected']:.0f} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path, cap: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in runs))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 7), squeeze=False)
    for col, task in enumerate(tasks):
        for mode in MODES:
            rs = [r for r in runs if r["task"] == task and r["mode"] == mode]
            if not rs:
                continue
            axes[0][col].plot(_seed_mean(rs, "reward"), label=mode)
            axes[1][col].plot(_seed_mean(rs, "length"), label=mode)
        axes[0][col].set_title(f"{task}: reward (mean of {len(rs)} seeds)")
        axes[1][col].set_title(f"{task}: mean response length")
        axes[1][col].axhline(cap, color="grey", linestyle=":", linewidth=1)
        axes[1][col].set_xlabel("step")
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.learning", description=__doc__.split("\n")[0])
    parser.add_argument("--design", choices=("modes", "history"), default="modes", help="the defaults below")
    parser.add_argument("--steps", type=int, default=None, help="100 (history: 60)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--tasks", default=None, help=f"of {', '.join(TASKS)} (default: the design's)")
    parser.add_argument("--modes", default=None, help=f"of {', '.join(MODES)} (default: the design's)")
    parser.add_argument("--prompts", type=int, default=None, help="rows of each task's prompt set (4096; history: 96)")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate the rows every N steps (history: 5)")
    parser.add_argument("--concurrency", type=int, default=None, help="--sglang-server-concurrency (64; history: 16)")
    parser.add_argument(
        "--parallel",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="runs at a time (each is an engine process plus a trainer process)",
    )
    parser.add_argument("--max-len", type=int, default=64, help="--rollout-max-response-len")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a fast check: 8 steps, one seed, toy task")
    parser.add_argument(
        "--summarize", type=Path, nargs="+", default=None, help="print the table of runs.jsonl files and run nothing"
    )
    args = parser.parse_args(argv)
    if args.summarize:
        done = [json.loads(line) for path in args.summarize for line in path.read_text().splitlines()]
        print(table(summarize(done, args.max_len)))
        if any(r["mode"] in HISTORY_PAIRS or r.get("eval") for r in done):
            print(history_table(history_rows(done)))
        return 0
    history = args.design == "history"
    design: dict[str, Any] = (
        HISTORY_DESIGN
        if history
        else {"tasks": ",".join(TASKS[:3]), "modes": ",".join(DEFAULT_MODES), "prompts": 4096, "steps": 100}
    )
    for name, value in design.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.quick:
        args.steps, args.seeds, args.tasks = 8, "0", "toy"
    seeds = [int(s) for s in args.seeds.split(",")]
    tasks, modes = args.tasks.split(","), args.modes.split(",")
    for name, chosen, known in (("task", tasks, TASKS), ("mode", modes, tuple(MODES))):
        if unknown := [c for c in chosen if c not in known]:
            parser.error(f"unknown {name}(s) {unknown}; known: {', '.join(known)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="learning-"))
    out.mkdir(parents=True, exist_ok=True)
    concurrency = ("--sglang-server-concurrency", str(args.concurrency)) if args.concurrency else ()
    extra = ["--rollout-max-response-len", str(args.max_len), *concurrency, *extra]

    jobs = [(t, m, s) for t in tasks for s in seeds for m in modes]
    print(f"{len(jobs)} runs of {args.steps} steps, {args.parallel} at a time, in {out}", flush=True)
    with ThreadPoolExecutor(args.parallel) as pool, (out / "runs.jsonl").open("w") as log:
        futures = [
            pool.submit(_run, t, m, s, args.steps, out, extra, args.prompts, args.eval_every) for t, m, s in jobs
        ]
        runs = []
        # As they finish, each on its own line of runs.jsonl: a call cut short keeps what finished.
        for f in as_completed(futures):
            runs.append(f.result())
            r = runs[-1]
            log.write(json.dumps(r) + "\n")
            log.flush()
            print(
                f"  {r['task']}/{r['mode']}/seed {r['seed']}: last reward {r['reward'][-1]:.3f} ({r['seconds']:.0f} s)",
                flush=True,
            )
    order = {job: i for i, job in enumerate(jobs)}
    runs.sort(key=lambda r: order[(r["task"], r["mode"], r["seed"])])
    rows = summarize(runs, args.max_len)
    more = {"history_rows": history_rows(runs)} if history else {}
    (out / "summary.json").write_text(
        json.dumps({"rows": rows, **more, "runs": runs, "steps": args.steps, "extra_flags": extra}, indent=1)
    )
    print(table(rows))
    if history:
        print(history_table(more["history_rows"]))
    try:
        plot(runs, out / "learning.png", args.max_len)
        print(f"picture: {out / 'learning.png'}")
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no picture")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
