"""Time to a reward target at cluster scale, predicted: each mode's measured learning per step, times
its seconds per step on the simulated twin of a 64-engine run with 16k-token tails (issue 48).

    python -m benchmarks.cluster_twin --learning build/ttt/runs.jsonl [--state build/ttt/state.json]
    python -m benchmarks.cluster_twin --learning DIR/runs.jsonl --target 0.8x     # a learning.py file

Two measured inputs, one simulated:

- **Learning per step** (`--learning`): the runs of `benchmarks/time_to_target.py` (their
  `runs.jsonl`, the target from its `state.json`) or of `benchmarks/learning.py` (`--task`, and
  `--target` as a reward, or a share of sync's last-quarter reward or of its rise). Per mode, the
  steps to the target as time_to_target's table reports them: each seed's first step at which the
  trailing mean (`--smooth` steps) of its reward reaches it; for runs with a held-out evaluation
  (time_to_target's, since it has one), its first evaluated version whose reward (a trailing mean
  over `--smooth-eval` versions) does, its steps being its version, read between the evaluation
  grid's points where the run kept its weights (`eval_refined`); then the mean over the seeds that
  reach it (how many do is printed). learning.py has no overlapped-publish mode: async's steps
  stand in for it.
- **Seconds per step at cluster scale**: the mode on the simulated engine (`engines/sim.py`,
  through the real pipeline, `benchmarks/modes_sim.py`) as ONE engine's share of the cluster:
  `--groups` groups of `--group` samples on `--slots` slots, responses up to `--max-len` (16,384)
  with the simulated engine's long tail (`--length-tail`, a share `--truncate-frac` at the limit),
  the decode-time model of a 1.5B model on one H100-class GPU (the flags below), a trainer that
  takes `--train-seconds` a step, a publish of `--publish-seconds`. The step's seconds are the
  first step's, then the mean of the rest for every later step.
- The prediction: time to target = first step + (steps to target - 1) x steady step, per mode, and
  its ratio over sync's ("speed-up"); "long run" leaves the first step's fill out (steps to target x
  steady step), what a run of hundreds of steps sees; both beside AReaL's (sync 41.0 h / async
  14.8 h = 2.77x, 1.5B to AIME24 42.2) and verl's (41 h / 17 h for 400 steps at equal accuracy, published as 2.35x).

What it assumes, said again with the table:

1. Learning per step does not change with scale: a step at 64 x the groups and 16x the tokens
   improves the reward as a measured step did. Unchecked; the staleness an async step trains at
   is printed beside it (the twin's, from its own pacing).
2. One engine stands for 64: the groups spread evenly over the engines and each engine waits for
   its own longest sample. With `--truncate-frac` 0.1 at the limit, one of 128 samples reaches it
   with probability 1 - 0.9^128, so every engine's round, and the cluster's, ends at the limit.
3. The trainer runs on GPUs of its own (as in AReaL's and verl's asynchronous setups), so decoding
   is not slowed while it trains, and it takes the same seconds per step in every mode.
4. The engine's time model: a decode step costs `--step-base` + `--step-per-request` x rows +
   `--step-per-context-token` x context tokens (defaults: 8 ms, 50 us, 10 ns: a 1.5B model's
   3 GB of weights and 28 KB of KV a token, read at about 3 TB/s, plus SGLang's step overhead),
   a prefill `--prefill-per-token` (10 us).
5. Tokens in blocks of `--coarsen` (8): the simulated engine makes one token for 8 real ones at
   8 decode steps' cost, so samples end on multiples of 8 tokens; the event loop keeps up with
   2k forwards a round where it could not with 16k.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import structlog

from benchmarks.target_summary import TargetSpec, calibration_points, figures, read_runs

# The published ratios the prediction stands beside: (sync hours, async hours, what was reached).
PUBLISHED = {
    "AReaL": (41.0, 14.8, "a 1.5B model to AIME24 42.2"),
    "verl fully-async": (41.0, 17.0, "400 steps at equal accuracy; published as 2.35x"),
}
# The twin's plan for each mode (benchmarks/modes_sim.plans), and the learning each takes: a mode
# without learning runs of its own learns as the one named (learning.py's async for the overlap).
SIM_PLANS = {"sync": "sync", "partial": "sync+partial", "async": "async", "async-overlap": "async, overlap"}
LEARNS_AS = {"async-overlap": "async"}


def steps_to_target(
    runs: list[dict[str, Any]], target: float, smooth: int, smooth_eval: int = 1
) -> dict[str, tuple[float | None, int, int]]:
    """Per mode (calibration runs left out), what time_to_target's table reports as its steps to
    target: the mean over the seeds that reach `target` of each seed's first step (1-based; an
    evaluated version's steps, read between the grid's points where the run kept its weights) at
    which the trailing mean of its reward (the held-out evaluation's where it has one) reaches it,
    or None when none does; then how many seeds reach it, and how many there are."""
    seeds: dict[str, list[int | None]] = {}
    for run in runs:
        if not run.get("calibration"):
            seeds.setdefault(run["mode"], []).append(figures(run, target, smooth, smooth_eval).steps_to_target)
    out: dict[str, tuple[float | None, int, int]] = {}
    for mode, hits in seeds.items():
        reached = [k for k in hits if k is not None]
        out[mode] = (statistics.fmean(reached) if reached else None, len(reached), len(hits))
    return out


def predict(first: float, steady: float, steps: float) -> float:
    """Seconds to the end of step `steps`: the first step, then the steady one (none for 0 steps:
    the base weights already reach the target)."""
    return 0.0 if steps <= 0 else first + (steps - 1) * steady


def _learning_runs(path: Path, task: str | None) -> list[dict[str, Any]]:
    runs = read_runs(path)
    if runs and "task" in runs[0]:  # learning.py's runs.jsonl: one task's
        tasks = sorted({r["task"] for r in runs})
        chosen = task or tasks[0]
        if chosen not in tasks:
            raise SystemExit(f"--task {chosen!r}: {path} has {', '.join(tasks)}")
        runs = [r for r in runs if r["task"] == chosen]
    return runs


def _target(args: argparse.Namespace, runs: list[dict[str, Any]]) -> tuple[float, str]:
    if args.state is not None:
        state = json.loads(args.state.read_text())
        return float(state["target"]["value"]), f"{state['target']['spec']} (from {args.state})"
    spec = TargetSpec.parse(args.target)
    plateau = start = None
    if spec.relative:
        sync = [r for r in runs if r["mode"] == "sync" and not r.get("calibration")]
        if not sync:
            raise SystemExit(f"--target {spec}: a share of sync's plateau or rise needs sync runs in --learning")
        points = [calibration_points(r, args.smooth, args.smooth_eval) for r in sync]
        start, plateau = statistics.fmean(p[0] for p in points), statistics.fmean(p[1] for p in points)
    return spec.resolve(plateau, start), str(spec)


def _simulate(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    import anyio

    from benchmarks import modes_sim as sim

    # One simulated token stands for `coarsen` real ones, so a 16k-token round is 2k forwards the
    # event loop keeps up with (at 16k it ran late on every forward, and the lateness, not the time
    # model, set the steps' seconds). A forward then costs `coarsen` real decode steps, each over
    # `coarsen` times the context: base and per-request costs x k, per-context-token x k^2, prefill
    # per token x k. The lengths are fractions of the limit (`--length-tail`), so they scale alike.
    k = args.coarsen
    twin = argparse.Namespace(
        batch=args.groups, group=args.group, steps=args.sim_steps, slots=args.slots, max_len=args.max_len // k,
        time_scale=args.time_scale, train_time=args.train_seconds, prompt_len=max(1, args.prompt_len // k),
        timeline_dir=None,
        sim_flags=[
            "--step-base", str(args.step_base * k), "--step-per-request", str(args.step_per_request * k),
            "--step-per-context-token", str(args.step_per_context_token * k * k),
            "--prefill-per-token", str(args.prefill_per_token * k),
            "--weight-update-time", str(args.publish_seconds),
            "--length-dist", args.length_tail, "--truncate-frac", str(args.truncate_frac),
        ],
    )  # fmt: skip
    plans = sim.plans(twin)
    work = Path(tempfile.mkdtemp(prefix="cluster-twin-"))
    out = {}
    for mode, name in SIM_PLANS.items():
        out[mode] = anyio.run(sim.run_mode, f"cluster-{mode}", plans[name], twin, 0, work)
        r = out[mode]
        print(
            f"twin {mode}: {r['groups/s'] * args.engines:.3f} groups/s over {args.engines} engines, "
            f"first step {r['first step s']:.0f} s, staleness mean {r['stale mean']:.2f}, "
            f"slot busy {r['slot busy']:.3f}" + (f", ran late on {r['late']} forwards" if r["late"] else ""),
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster_twin", description=__doc__.split("\n")[0])
    p.add_argument("--learning", type=Path, required=True, help="runs.jsonl of time_to_target or learning.py")
    p.add_argument("--state", type=Path, default=None, help="time_to_target's state.json: its target")
    p.add_argument("--task", default=None, help="learning.py's runs: the task (default: the first)")
    p.add_argument(
        "--target", default="0.8x", help="without --state: a reward, or a share of sync's plateau (0.8x) or rise (0.8r)"
    )
    p.add_argument("--smooth", type=int, default=3, help="trailing mean over steps (the trained batch's reward)")
    p.add_argument("--smooth-eval", type=int, default=1, help="trailing mean over evaluations (held-out reward)")
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--groups", type=int, default=16, help="groups per step per engine")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--slots", type=int, default=128, help="running requests per engine")
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--length-tail", default="lognormal:-1.9,0.8")
    p.add_argument("--truncate-frac", type=float, default=0.1)
    p.add_argument("--step-base", type=float, default=0.008)
    p.add_argument("--step-per-request", type=float, default=5e-5)
    p.add_argument("--step-per-context-token", type=float, default=1e-8)
    p.add_argument("--prefill-per-token", type=float, default=1e-5)
    p.add_argument("--train-seconds", type=float, default=70.0)
    p.add_argument("--publish-seconds", type=float, default=2.0)
    p.add_argument("--sim-steps", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=0.05, help="wall seconds per engine second")
    p.add_argument("--coarsen", type=int, default=8, help="real tokens one simulated token stands for")
    args = p.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))  # no per-step lines
    if args.sim_steps < 2:
        p.error("--sim-steps must be >= 2: the first step and at least one steady one")

    runs = _learning_runs(args.learning, args.task)
    if not runs:
        raise SystemExit(f"--learning {args.learning}: no runs")
    target, spec = _target(args, runs)
    learned = steps_to_target(runs, target, args.smooth, args.smooth_eval)
    measure = "held-out evaluation" if all(r.get("eval") for r in runs) else "trained-batch reward"
    window = args.smooth_eval if measure == "held-out evaluation" else args.smooth
    print(f"learning per step from {args.learning} (target {target:.3f}, {spec}; {measure}, trailing mean {window}):")
    for mode, (k, reached, seeds) in learned.items():
        at = "never" if k is None else f"step {k:.1f}"
        print(f"  {mode}: {at} ({reached} of {seeds} seeds reach it; their mean)")

    twin = _simulate(args)
    rows = []
    for mode, r in twin.items():
        k, *_ = learned.get(mode) or learned.get(LEARNS_AS.get(mode, mode)) or (None, 0, 0)
        total = args.groups * args.sim_steps / r["groups/s"]  # engine seconds of the simulated steps
        first = r["first step s"]
        steady = (total - first) / (args.sim_steps - 1)
        rows.append((mode, k, first, steady, None if k is None else predict(first, steady, k)))
    sync = next((t for m, _, _, _, t in rows if m == "sync"), None)
    # Over many steps the first step's fill weighs nothing: steps to target x the steady step.
    sync_long = next((k * st for m, k, _, st, _ in rows if m == "sync" and k is not None), None)
    print(
        f"\npredicted time to target at cluster scale: {args.engines} engines x {args.groups} groups x {args.group} "
        f"samples a step, up to {args.max_len} tokens ({args.length_tail}, {args.truncate_frac:.0%} at the limit), "
        f"training {args.train_seconds:g} s a step, publish {args.publish_seconds:g} s"
    )
    cols = ("steps to target", 16), ("first step s", 14), ("steady step s", 15), ("time to target h", 18)
    print(f"{'mode':16}" + "".join(f"{c:>{w}}" for c, w in cols) + f"{'speed-up':>10}{'long run':>10}")
    for mode, k, first, steady, t in rows:
        speed = "-" if t is None or sync is None else f"{sync / t:.2f}x"
        long = "-" if k is None or sync_long is None else f"{sync_long / (k * steady):.2f}x"
        hours = "never" if t is None else f"{t / 3600:.2f}"
        print(
            f"{mode:16}{'never' if k is None else f'{k:.1f}':>16}{first:>14.0f}{steady:>15.0f}{hours:>18}"
            f"{speed:>10}{long:>10}"
        )
    for name, (sync_h, async_h, what) in PUBLISHED.items():
        print(f"published, {name}: sync {sync_h} h, async {async_h} h: {sync_h / async_h:.2f}x ({what})")
    print(
        "assumes: learning per step as measured, at any scale; one engine's share stands for 64 (each round "
        "ends at the length limit); the trainer on GPUs of its own, the same seconds in every mode; the "
        "decode-time model of the flags (module docstring)"
    )
    if any(math.isnan(t) for *_, t in rows if t is not None):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
