"""Learning that holds, measured: every rollout mode on three built-in tasks, several seeds each.

    python -m benchmarks.learning [--steps 100] [--seeds 0,1,2] [--parallel 6] [--quick]
                                  [--tasks toy,long-tail,short-answer] [--modes sync,partial,async-s1,async]
                                  [--out DIR] [-- extra pipeline flags]
    python -m benchmarks.learning --summarize DIR/runs.jsonl [...]   (the table of finished runs)

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

REPO = Path(__file__).resolve().parents[1]
MODES: dict[str, tuple[str, ...]] = {
    "sync": (),
    "partial": ("--partial-rollout",),
    "async-s1": ("--rollout-mode", "async", "--max-staleness", "1"),
    "async": ("--rollout-mode", "async"),
    # Not in the default design, asked for by name (`--modes`): a bound between the two above, and
    # async with admission unpaced (always its whole window ahead: the default before pacing).
    "async-s2": ("--rollout-mode", "async", "--max-staleness", "2"),
    "async-unpaced": ("--rollout-mode", "async", "--no-async-pacing"),
}
DEFAULT_MODES = ("sync", "partial", "async-s1", "async")
TASKS = ("toy", "long-tail", "short-answer")
AT_CAP = 0.95  # a step's mean response length this close to the cap counts as "at the cap"
COLLAPSE_STEPS = 5  # consecutive steps that make a collapse, of either kind
SHORT_LEN = 2.0  # a step's mean response length at or below this counts as "short"
# "The reward falls": the short window's mean reward is below FALLEN x the best BEST_STEPS-step mean
# reward before it. Calibrated on the runs of BENCHMARKS.md section 12: a plateau's noise (the
# short-answer task settles at one-digit answers, length 2) stays above 0.81 of its best, the two
# collapses seen fell to 0.57-0.71.
FALLEN = 0.75
BEST_STEPS = 10


def _task_flags(task: str, work: Path) -> tuple[str, ...]:
    if task == "toy":
        return ()
    if task == "short-answer":
        from pipeline.tasks.short_answer import short_answer_rows

        path = work / "short_answer.jsonl"
        if not path.exists():
            path.write_text("".join(json.dumps(row) + "\n" for row in short_answer_rows(4096, seed=7)))
        return ("--prompt-data", str(path), "--custom-rm-path", "pipeline.tasks.short_answer:short_answer_reward")
    from pipeline.tasks.long_tail import long_tail_rows

    path = work / "long_tail.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps(row) + "\n" for row in long_tail_rows(4096, seed=7)))
    return ("--prompt-data", str(path), "--custom-rm-path", "pipeline.tasks.toy:toy_reward")


def _run(task: str, mode: str, seed: int, steps: int, work: Path, extra: list[str]) -> dict[str, Any]:
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
        *_task_flags(task, work),
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
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
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
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {', '.join(MODES)}")
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
        return 0
    if args.quick:
        args.steps, args.seeds, args.tasks = 8, "0", "toy"
    seeds = [int(s) for s in args.seeds.split(",")]
    tasks, modes = args.tasks.split(","), args.modes.split(",")
    for name, chosen, known in (("task", tasks, TASKS), ("mode", modes, tuple(MODES))):
        if unknown := [c for c in chosen if c not in known]:
            parser.error(f"unknown {name}(s) {unknown}; known: {', '.join(known)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="learning-"))
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--rollout-max-response-len", str(args.max_len), *extra]

    jobs = [(t, m, s) for t in tasks for s in seeds for m in modes]
    print(f"{len(jobs)} runs of {args.steps} steps, {args.parallel} at a time, in {out}", flush=True)
    with ThreadPoolExecutor(args.parallel) as pool, (out / "runs.jsonl").open("w") as log:
        futures = [pool.submit(_run, t, m, s, args.steps, out, extra) for t, m, s in jobs]
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
    (out / "summary.json").write_text(
        json.dumps({"rows": rows, "runs": runs, "steps": args.steps, "extra_flags": extra}, indent=1)
    )
    print(table(rows))
    try:
        plot(runs, out / "learning.png", args.max_len)
        print(f"picture: {out / 'learning.png'}")
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no picture")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
