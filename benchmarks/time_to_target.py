"""Wall-clock seconds to a reward target, every rollout mode, several seeds, on one device (issue 48).

    python -m benchmarks.time_to_target --preset h200 [--out build/ttt] [--budget-s 500]   # on a GPU host
    python -m benchmarks.time_to_target --quick                                             # CPU smoke test
    python -m benchmarks.time_to_target --summarize DIR                                     # the table again

(One module of about 650 lines, 140 of them this docstring, the plan's reasoning: the presets, a
run's flags and its record are one experiment's parts and change together while the set is still
being run on the GPU. The summary and its verdicts are `target_summary.py`'s; which versions a run
is evaluated at, the evaluations side by side and the run's clock at each are `target_eval.py`'s.)

AReaL's and verl's headline figures are wall time to a reward at equal accuracy; the project's own
were throughput on a model that learns nothing, and learning per step on a CPU. This joins them:
each mode is a real `python -m pipeline.launch` run (the built-in engine over real HTTP and the real
trainer on the same device, the real publish), and the measure is the run's own wall clock to a
reward target fixed before the runs, the reward of a held-out evaluation of its weights.

**The task** (`pipeline/tasks/long_answer.py`): "say b x517:" -> 517 b's then the end token,
the asked count drawn with P(N) ~ 1/N up to `max_count` (1,024 on the H200: median 24, mean 136, one prompt
in eleven above 512), the reward the fraction of the asked answer written (0 without the end
token). The model starts from a base model that writes answers of the asked length in the asked
letter half the time (`benchmarks/base_model.py`, built once per output folder), so response
lengths follow the prompts' long tail from the first step and generation dominates a step; RL
teaches the letter. `--preset cpu` is the same at a small shape and answers up to 48 tokens (the
learning per step the cluster twin takes as a stand-in); `--quick`, a smoke test of the mechanics.

**The modes**: sync; partial (`--partial-rollout`, over-sampling 2x); async; async-overlap (async
with `--overlap-weight-transfer`); and, on a GPU, the colocated ones (`--colocate`: the engine on
the trainer's GPU, weights by CUDA IPC; sync releases the engine's memory while training, async
keeps it; an overlapped publish is refused with --colocate). The others run the engine on the same
GPU beside the trainer, weights from disk. Each mode runs `--seeds` (0,1,2) at equal steps.

**The evaluation**: the trained batch's mean reward is no fair measure across modes: partial and
async runs train first on the samples that finish first, the short answers (on the H200, partial's
and async's first batches averaged about 20 tokens against sync's 206), so their batch reward rose
early on a biased sample. Each run saves a checkpoint every `eval_every` steps and at its last
(all kept); after it ends, `python -m pipeline.eval` (not timed with it: `eval_seconds`) evaluates
the base weights (version 0) and each checkpoint on `eval_prompts` held-out prompts
(`work/eval.jsonl`, drawn like the training prompts from another seed), one response each, the
same prompts and sampling seeds for every mode (as AReaL measures AIME accuracy at checkpoints). It
runs on built-in engines of its own with the sync flags of the same plan and seed, started once
for both of a run's rounds (the grid, the refinement). Version v's time
is the run's first v steps' `perf/step_time`, less what its checkpoints took beyond a weights-only
save (`perf/save_model_time`: the checkpoints are the measurement's, not the mode's; a colocated
run's every save, below).

**The crossing, to the step**: a grid of 4 steps is coarse where the target is crossed in about
ten (on the H200's first runs, any async time ratio from 0.16x to 0.81x of sync's fitted it). So a
run keeps the weights-only folders its engines loaded (`--save-keep-weights`: written every step
anyway, only not deleted) and, once the grid is evaluated, the kept versions between the grid's
last evaluation short of the target and its first to reach it are evaluated too
(`eval_refined`); the crossing is read off both (`target_summary.crossing_curve`), and the
picture draws both, the last quarter off the grid. A colocated run publishes by CUDA IPC, so with
the flag its folders are written for the evaluation alone (about 20 ms a step here) and its clock
leaves every save out, not only the checkpoints' extra (`saves_for_eval`). A folder of runs made
before the refinement takes no new ones.

**The target** is fixed before the runs it judges: `--target 0.8r` (the default) takes the start
plus 0.8 x the rise from the start to the plateau of one sync run, the run of
`--calibration-seed`: its start, the held-out reward of the base weights; its plateau, the mean
over the last quarter of its evaluations. By default seed 0's sync run, which goes first, fixes the
target before any other run starts and counts as seed 0's (one run less of device time); a seed
outside `--seeds` makes a calibration run of its own, left out of the table. `--target 0.8x`
takes 0.8 x the plateau (on the H200, with sync starting at 0.57 and plateauing at 0.87, it sat
at 0.695: reached in 3-5 steps, it said little), `--target 0.62` that reward. It is written in
`state.json` and every later call keeps it. A run reaches it at the first evaluated version
(grid or refinement) whose trailing mean over `smooth_eval` versions does
(`benchmarks/target_summary.py`; a record written before the evaluation is judged by its batch
reward, over `--smooth` steps); its time is that version's: from the controller's start (engine
start and model load left out, the trainer's first-step warm-up counted), as AReaL and verl count
training time.

**Per mode** (`summary.md`): time to target (mean over seeds, and how many reached it), its ratio
to sync's (a colocated mode's to colocated sync's), steps to target, the held-out reward over the
last quarter of the evaluations (the trained batch's over the last quarter of the steps beside
it), steps, groups/s, engine busy (`engine/busy_frac` over the run), publish stall (mean
`time/publish_gate_closed`), the verdicts against the issue's targets (async <= 0.6x sync's time,
partial <= 0.8x, final reward within 5%, both held-out), and `time_to_target.png`: the held-out
reward against wall-clock seconds, a marker at each evaluation, a line per run. Each run's record
also has the correlation between the asked count and the written length (`length_corr`): whether
lengths still follow the prompts.

**Calls of a few minutes**: runs go one at a time (they share the device), each appended to
`runs.jsonl` as it ends. `--budget-s` is this call's allowance: a run whose mode's past runs took
longer than what is left (with the last run's evaluation) is not started. `--eval-workers N` runs
N evaluations side by side after each run, an engine each: one version's evaluation decodes its
longest answer token after token, which leaves the GPU mostly idle (72-91 s a run on the H200 one
at a time, a third of the device time); what is measured does not change. On an H100 with the
refinement it gained little (97-128 s for 14 versions, 1 to 3 side by side): each record's
`eval_phases` say where the seconds go (per round, each version's decode and load, each
engine's start: `benchmarks/target_run.py`, which makes one run and its record), and each run's
line prints them: on the H100 each round's own engines took 11 s to start, so the rounds now
share engines started once a run, and each round's worker processes 11-17 s more, so the
workers on those engines run in this process (`target_eval.evaluate_on_engines`). Each record
keeps its `machine` (host and card UUID): two H100 machines ran the same modes 14-24% apart, and
the report names each machine's runs when a set spans several. The same command again
continues: it keeps the target, rebuilds the base model if it is missing (deterministic:
`state.json` keeps its fingerprint, and a rebuild that differs is named), and skips every finished
run. Non-colocated modes run first, seed by seed, then the colocated ones, so a cut set has whole
seeds of the first four.

**The shape, and why** (the `h200` preset: hidden 512, 8 layers, 8 heads, GQA 8/4, intermediate
1,024: about 19M parameters, the tiny tokenizer's 64 ids), from the H200 figures in BENCHMARKS.md:

- Decode. The built-in engine's CUDA-graph decode of the 0.6B shape (28 layers) replays in 4.4 ms
  at batch 1 and 8.1 ms at 64 rows of 1,024 context (section 7b): launch-bound, about 0.16-0.29
  ms a layer, plus about 1 ms of host work a step. Eight layers: about 2.5-3.5 ms a step. A sync
  round of 16 groups x 8 samples waits for its longest answer: four rounds in five ask for more
  than 512 (P(N > 512) = 0.09 a prompt, 16 prompts), so about 1,000 decode steps, 2.5-3.5 s.
- Prefill. One prompt a step (section 10b: 34-37 ms at 28 layers): about 10 ms at 8, 1.3 s for
  128 samples.
- Training. About 20k real tokens a step (128 samples, mean answer about 140); 19M parameters make
  that under 0.1 s of bf16 arithmetic, so the step is launch-bound: about 0.3 s (four micro-batches
  of like length under `--max-tokens-per-gpu 32768`, each with its forward, backward and the
  step-KL check's forward). Publish from disk: 38 MB, about 0.1 s.
- So a sync step is about 4-5 s, nearly all generation, as in a reasoning run.
- Steps to the target. On the CPU (`--preset cpu`: hidden 128 x 4 layers, counts up to 48, 8
  groups a step, lr 1e-3) the reward rose from about 0.55 to about 0.85 in 6-8 steps. On the H200
  at lr 3e-4 the sync run rose from 0.57 to 0.95 in five steps, then decayed from about 0.97 to
  about 0.85; at 1e-3 it collapsed. The preset trains at lr 1e-4, for a slower rise (not measured
  yet). 28 steps a run: on the H100 every run of the set's first 40-step attempt crossed the
  target by step 11 and held its plateau from about step 15 (BENCHMARKS.md 16), so the last
  quarter (steps 22-28) still reads the plateau, and a run costs about 30% less device time than
  at 40 (sync about 2 minutes with its start); then its evaluation, 8 versions of 128 prompts and
  the versions around the crossing.
- Device time. The base model took 4.4 minutes to build on the H200 (2026-12-05), padded, and
  115 s packed on an H100 (2026-12-06; it comes back from the call in bf16 and
  `benchmarks/gpu_check.sh` carries it to the next). Measured on the H200: a
  sync step 1.5-5.8 s while lengths follow the prompts. Before the runs had their evaluations, a
  570 s call held two or three runs, and the 21 runs of the set (4 modes x 3 seeds, then 3
  colocated x 3) were about 60-75 minutes of device time: more than one session's 30, so
  `runs.jsonl` and `state.json` carry it from call to call.
  Not a shortcut: `--steps 20 --lr 1e-3` (the CPU's rate) made sync rise for four steps on the
  H200 and then collapse into answers that ran to the cap (BENCHMARKS.md 16).
- A larger shape (the 0.6B's 28 layers: about 15 s a sync step, 2.5-5 minutes to the target)
  makes the trainer and the engine compete for the GPU much more (BENCHMARKS.md 10b: decode 1.64x
  slower beside a training step), but its base model takes about 10 minutes of supervised steps
  to count to 1,024, a whole device call, in every call that finds the machine cold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.target_run import (
    COLOCATED,
    DIAGNOSTIC,
    HELDOUT_SEED,
    MODES,
    REPO,
    SET_MODES,
    Inputs,
    Plan,
    eval_said,
    run_env,
    run_name,
    run_one,
)
from benchmarks.target_summary import (
    TargetSpec,
    calibration_points,
    figures,
    plot,
    read_runs,
    summarize,
    table,
    verdicts,
)

STATE, RUNS, SUMMARY, PICTURE = "state.json", "runs.jsonl", "summary.md", "time_to_target.png"


PRESETS: dict[str, Plan] = {
    # The design on one H200 (the module docstring says why this shape).
    "h200": Plan(
        device="cuda", hidden=512, layers=8, heads=8, max_count=1024, max_len=1280, batch=16, group=8,
        steps=28, lr=1e-4, base_steps=2000, base_batch=32, base_lr=1e-3, smooth=3, eval_prompts=128, eval_every=4,
    ),
    # The same at a small shape and answers up to 48 tokens, on a CPU: learning per step that the
    # cluster twin can take as a stand-in (benchmarks/cluster_twin.py), a minute or two a run.
    "cpu": Plan(
        device="cpu", hidden=128, layers=4, heads=4, max_count=48, max_len=64, batch=8, group=8,
        steps=24, lr=1e-3, base_steps=600, base_batch=32, base_lr=3e-3, smooth=3, eval_prompts=64, eval_every=4,
    ),
    # The smoke test (`--quick`): the mechanics end to end in a few minutes on a CPU, nothing learned.
    "quick": Plan(
        device="cpu", hidden=64, layers=2, heads=4, max_count=24, max_len=32, batch=4, group=4,
        steps=6, lr=1e-3, base_steps=60, base_batch=32, base_lr=3e-3, smooth=3, eval_prompts=8, eval_every=2,
    ),
}  # fmt: skip


# The preset's settings a flag may change (`--base-steps 3000`, `--steps 64`, ...).
OVERRIDES: dict[str, type] = {
    "device": str, "hidden": int, "layers": int, "heads": int, "max_count": int, "max_len": int, "batch": int,
    "group": int, "steps": int, "lr": float, "base_steps": int, "base_batch": int, "base_lr": float, "smooth": int,
    "eval_prompts": int, "eval_every": int, "smooth_eval": int,
}  # fmt: skip


def planned_runs(modes: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """The compared runs in the order they go: the non-colocated modes seed by seed, then the
    colocated ones, so a set cut short holds whole seeds of the first."""
    first = [m for m in modes if m not in COLOCATED]
    later = [m for m in modes if m in COLOCATED]
    return [(m, s) for group in (first, later) for s in seeds for m in group]


def estimate(mode: str, done: list[dict[str, Any]]) -> float | None:
    """Seconds a run of `mode` is expected to take: its mode's past runs' mean `wall` (start to
    end), else the longest past run's, plus the last run's `eval_seconds` (the evaluation is the
    same for every mode, and the last one was made the way this call makes them: `--eval-workers`
    may have changed since older ones); None when nothing has run."""
    if not done:
        return None
    own = [float(r["wall"]) for r in done if r["mode"] == mode]
    wall = statistics.fmean(own) if own else max(float(r["wall"]) for r in done)
    return wall + float(done[-1].get("eval_seconds", 0.0))


def fits(expected: float | None, left: float) -> bool:
    """Whether a run expected to take `expected` seconds fits in `left` (10% to spare); a run
    with no estimate is started (the first of a folder)."""
    return expected is None or expected * 1.1 <= left


def _prepare(plan: Plan, work: Path, state: dict[str, Any], *, runs: int = 0) -> Inputs:
    """The prompts files and the base model (built when missing). A base built again must be the
    one the folder's `runs` so far used (its fingerprint in `state`): SystemExit otherwise."""
    from pipeline.tasks.long_answer import long_answer_rows

    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    rows = long_answer_rows(4096, seed=7, max_count=plan.max_count)
    if not prompts.exists():
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = [int(r["label"]["count"]) for r in rows]  # type: ignore[index]
    # The held-out set, in the training prompts' format (so --input-key/--label-key's defaults read it).
    heldout = work / "eval.jsonl"
    held = "".join(
        json.dumps(r) + "\n" for r in long_answer_rows(plan.eval_prompts, seed=HELDOUT_SEED, max_count=plan.max_count)
    )
    if not heldout.exists() or heldout.read_text() != held:  # a --work shared with another plan's folder
        heldout.write_text(held)
    base = work / "base"
    if not (base / "base.json").exists():
        shutil.rmtree(base, ignore_errors=True)
        cmd = [
            sys.executable, "-m", "benchmarks.base_model", "--out", str(base), "--device", plan.device,
            "--hidden", str(plan.hidden), "--layers", str(plan.layers), "--heads", str(plan.heads),
            "--max-count", str(plan.max_count), "--max-positions", str(plan.max_len + 64),
            "--steps", str(plan.base_steps), "--batch", str(plan.base_batch), "--lr", str(plan.base_lr),
            # bf16 on a GPU: 38 MB for the h200 preset, small enough to come back from a device call
            # and be carried to the next (benchmarks/gpu_check.sh), which then skips the rebuild.
            "--save-dtype", "bfloat16" if plan.device.startswith("cuda") else "float32",
        ]  # fmt: skip
        print(f"building the base model ({plan.base_steps} supervised steps on {plan.device})", flush=True)
        done = subprocess.run(cmd, cwd=REPO, env=run_env(), check=False)
        if done.returncode != 0:
            raise SystemExit(f"the base model failed to build (exit {done.returncode})")
    built = json.loads((base / "base.json").read_text())
    known = state.get("base")
    if known and known["fingerprint"] != built["fingerprint"]:
        if runs:  # a set's runs must share one base: their target and start were read from it
            raise SystemExit(
                f"the base model was built again and differs from the one this folder's {runs} run(s) used "
                f"({built['fingerprint'][:12]} against {known['fingerprint'][:12]}): carry its parts "
                f"(base.tar.part-*) to this call, or give another --out for a new set"
            )
        print(
            f"note: the base model was built again and differs from the one state.json named "
            f"({built['fingerprint'][:12]} against {known['fingerprint'][:12]}); no run used that one, so "
            "this one counts",
            flush=True,
        )
        state["base"] = built
    state.setdefault("base", built)
    return Inputs(base, prompts, heldout, counts)


def target_said(target: dict[str, Any]) -> str:
    """How the target was fixed, for the summary's head: its reward, its form, and the calibration
    run's start and plateau it came from."""
    spec = TargetSpec.parse(target["spec"])
    plateau, start, source = target.get("plateau"), target.get("start"), target.get("from") or "sync"
    said = f"{target['value']:.3f} ({spec}"
    if spec.form == "rise" and plateau is not None and start is not None:
        said += f": {start:.3f} + {spec.value:g} x ({plateau:.3f} - {start:.3f}), the start and plateau of {source}"
    elif spec.form == "plateau" and plateau is not None:
        said += f" of the plateau {plateau:.3f} of {source}"
    return said + ")"


def judged_said(runs: list[dict[str, Any]], plan: dict[str, Any]) -> str:
    """What the runs are judged by, for the summary's head (an old record has no evaluation)."""
    smooth, smooth_eval = plan["smooth"], plan.get("smooth_eval", 1)
    held = (
        f"held-out reward ({plan.get('eval_prompts')} prompts, one response each, at the base weights, every "
        f"{plan.get('eval_every')} steps and the last)"
        + (f", trailing mean over {smooth_eval} evaluations" if smooth_eval > 1 else "")
    )
    batch = "trained-batch reward" + (f", trailing mean over {smooth} steps" if smooth > 1 else "")
    evaluated = sum(1 for r in runs if r.get("eval"))
    if evaluated and evaluated == len(runs):
        return f"judged by the {held}"
    return f"judged by the {held} where a run has one, else the {batch}" if evaluated else f"judged by the {batch}"


def _report(runs: list[dict[str, Any]], out: Path, state: dict[str, Any], left: int) -> None:
    target = state["target"]["value"]
    plan = state["plan"]
    smooth, smooth_eval = plan["smooth"], plan.get("smooth_eval", 1)
    rows = summarize(runs, target, smooth, smooth_eval)
    card = state.get("card", plan["device"])  # a folder of before the card was kept: its device
    head = (
        f"time to target on {card}: long-answer task (counts up to {plan['max_count']}, cap "
        f"{plan['max_len']}), base model hidden {plan['hidden']} x {plan['layers']} layers, {plan['steps']} steps "
        f"of {plan['batch']} groups x {plan['group']} at lr {plan['lr']:g}; target {target_said(state['target'])}; "
        + judged_said(runs, plan)
    )
    lines = [head, "", table(rows, target), "", *verdicts(rows)]
    corr = [r["length_corr"] for r in runs if not math.isnan(r.get("length_corr", math.nan))]
    if corr:
        lines.append(f"asked count against written length: r = {min(corr):.3f} .. {max(corr):.3f} over the runs")
    if said := machines_said(runs):
        lines.append(said)
    spent = [r["eval_seconds"] for r in runs if "eval_seconds" in r]
    if spent:
        lines.append(f"evaluation, after each run and not timed with it: {statistics.fmean(spent):.0f} s a run")
    if left:
        lines.append(f"{left} run(s) left: the same command again continues")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    (out / SUMMARY).write_text(text + "\n")
    try:
        title = f"reward against wall-clock seconds ({card})"
        plot(runs, out / PICTURE, target, title=title, smooth=smooth, smooth_eval=smooth_eval)
        print(f"picture: {out / PICTURE}")
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no picture")


def card_name(device: str) -> str:
    """The card a run's seconds were measured on (`torch.cuda.get_device_name`, ROCm's too), or the
    device's own name off a GPU: a set's times compare only on one kind of card."""
    if not device.startswith("cuda"):
        return device
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def machine_name(device: str) -> str:
    """Which machine a run's seconds were measured on: the host and, on a GPU, the card's UUID.
    Two machines with the same card differ (an H100 set's fresh machine ran every mode's steps
    14-24% slower than the last session's): runs of one seed on one machine compare best."""
    host = socket.gethostname()
    if not device.startswith("cuda"):
        return host
    import torch

    return f"{host} {torch.cuda.get_device_properties(torch.device(device)).uuid}"


def machines_said(runs: list[dict[str, Any]]) -> str | None:
    """A line saying which runs share a machine, when a set's runs were timed on several. Records
    from before runs kept `machine` are named apart as not recorded: they may span machines (the
    H100 set's first 13 runs did, two of them)."""
    by: dict[str, list[str]] = {}
    unrecorded: list[str] = []
    for r in runs:
        if not r.get("calibration"):
            name = run_name(r["mode"], r["seed"])
            if "machine" in r:
                by.setdefault(r["machine"], []).append(name)
            else:
                unrecorded.append(name)
    if len(by) + bool(unrecorded) < 2:
        return None
    groups = [f"[{', '.join(names)}]" for names in by.values()]
    if unrecorded:
        groups.append(f"not recorded, one machine or more: [{', '.join(unrecorded)}]")
    machines = f"{len(by)} machines" if len(by) != 1 else "1 machine"
    return (
        f"timed on {machines} of the card{' and before machines were recorded' if unrecorded else ''}"
        " (a machine's runs in brackets): "
        + "; ".join(groups)
        + ": ratios between machines carry their difference, seed-by-seed pairs on one machine do not"
    )


def mixed_cards(card: str, state: dict[str, Any], runs: list[dict[str, Any]]) -> str | None:
    """Why this call may not add runs to the folder's set, or None: its runs were timed on another
    card (the folder's state.json names it, and so does each run's record)."""
    seen = {state["card"]} if "card" in state else set()
    seen |= {r["card"] for r in runs if "card" in r}
    if seen - {card}:
        return (
            f"its runs were timed on {', '.join(sorted(seen))} and this call runs on {card}: times on two "
            "cards do not compare; continue on that card, or give another --out"
        )
    return None


def _plan(args: argparse.Namespace) -> Plan:
    plan = PRESETS["quick" if args.quick else args.preset]
    changes = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    return dataclasses.replace(plan, **changes)


def default_modes(gpu: bool) -> list[str]:
    """The set's modes: every one the device allows (the colocated ones need a GPU), none of the
    diagnostic ones (`target_run.DIAGNOSTIC`), which run only where `--modes` names them."""
    return [m for m in SET_MODES if gpu or m not in COLOCATED]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_target", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    p.add_argument("--quick", action="store_true", help="the CPU smoke test: --preset quick, one seed")
    p.add_argument("--out", type=Path, default=REPO / "build" / "ttt")
    p.add_argument("--work", type=Path, default=None, help="base model and run folders (default: OUT/work)")
    p.add_argument(
        "--modes",
        default=None,
        help=f"of {', '.join(MODES)} (default: the set's, all the device allows; "
        f"{', '.join(DIAGNOSTIC)} only when named)",
    )
    p.add_argument("--seeds", default=None, help="compared seeds (default 0,1,2; --quick: 0)")
    p.add_argument(
        "--target",
        default="0.8r",
        help="a reward (0.62), a share of sync's plateau (0.8x), or a share of its rise from its start (0.8r)",
    )
    p.add_argument(
        "--calibration-seed",
        type=int,
        default=0,
        help="the sync run whose start and plateau fix a relative target: a compared seed's (default 0), or a run "
        "of its own",
    )
    p.add_argument("--budget-s", type=float, default=math.inf, help="this call's seconds; the rest waits")
    p.add_argument(
        "--eval-workers",
        type=int,
        default=1,
        help="evaluations side by side after each run, an engine each (default 1); what is measured is the same",
    )
    p.add_argument("--summarize", type=Path, default=None, metavar="DIR", help="report DIR's runs, run nothing")
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="build the prompts and the base model (its fingerprint into state.json), run nothing: a "
        "device call of its own, so that no run is cut short by the build's minutes",
    )
    for name, kind in OVERRIDES.items():  # the preset's settings, one by one
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help="the preset's, unless given")
    args = p.parse_args(argv)
    started = time.perf_counter()

    if args.summarize:
        _report(read_runs(args.summarize / RUNS), args.summarize, json.loads((args.summarize / STATE).read_text()), 0)
        return 0
    try:
        spec = TargetSpec.parse(args.target)
    except ValueError as exc:
        p.error(str(exc))
    if args.eval_workers < 1:
        p.error(f"--eval-workers {args.eval_workers}: must be at least 1 (one evaluation at a time)")
    plan = _plan(args)
    gpu = plan.device.startswith("cuda")
    modes = args.modes.split(",") if args.modes else default_modes(gpu)
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    if not gpu and (cpu_colocated := [m for m in modes if m in COLOCATED]):
        p.error(f"--modes {cpu_colocated}: --colocate shares a GPU; on {plan.device} leave them out")
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}
    asked = dataclasses.asdict(plan)
    if "plan" in state and state["plan"] != asked:
        differ = {k: (state["plan"].get(k), v) for k, v in asked.items() if state["plan"].get(k) != v}
        raise SystemExit(
            f"{out}: its runs were made with other settings ({differ}, as (then, now)); run with the "
            "same flags to continue, or give another --out"
        )
    state["plan"] = asked
    if "target" in state and state["target"]["spec"] != str(spec):
        raise SystemExit(
            f"--target {spec}: {out} fixed its target before its runs as {state['target']['spec']} "
            f"({state['target']['value']:.3f}); keep it, or give another --out"
        )
    runs_path = out / RUNS
    runs = read_runs(runs_path)
    # A runs.jsonl carried without its state.json passes the plan check above; runs made before the
    # evaluation (another plan: lr 3e-4 on the H200) would count as done and one could fix the target.
    if old := [run_name(r["mode"], r["seed"], bool(r.get("calibration"))) for r in runs if not r.get("eval")]:
        raise SystemExit(
            f"{runs_path}: runs {old} have no held-out evaluation: made before it, with another plan; "
            "give another --out (--summarize still reports them)"
        )
    # Runs made before the refinement crossed the target on the grid alone: a mode whose seeds mix
    # the two would mix two measures.
    coarse = [run_name(r["mode"], r["seed"], bool(r.get("calibration"))) for r in runs if "eval_refined" not in r]
    if coarse and plan.smooth_eval == 1:
        raise SystemExit(
            f"{runs_path}: runs {coarse} read their crossing off the evaluation grid alone (made before runs "
            "kept their weights to refine it); give another --out (--summarize still reports them)"
        )
    card = card_name(plan.device)
    if why := mixed_cards(card, state, runs):
        raise SystemExit(f"{out}: {why}")
    state["card"] = card
    machine = machine_name(plan.device)
    work = args.work or out / "work"
    inputs = _prepare(plan, work, state, runs=len(runs))
    state_path.write_text(json.dumps(state, indent=1))
    if args.prepare_only:
        print(f"prepared: the base model {state['base']['fingerprint'][:12]} in {inputs.base}", flush=True)
        return 0

    budget: float = args.budget_s

    def budget_left() -> float:
        return budget - (time.perf_counter() - started)

    def keep(rec: dict[str, Any]) -> None:
        runs.append(rec)
        with runs_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        reached = "-"
        if "target" in state:
            fig = figures(rec, state["target"]["value"], plan.smooth, plan.smooth_eval)
            reached = "never" if fig.time_to_target is None else f"{fig.time_to_target:.1f} s"
        ev = rec["eval"]
        rounds = f": {said}" if (said := eval_said(rec.get("eval_phases", []), rec.get("eval_engines_up"))) else ""
        print(
            f"run {run_name(rec['mode'], rec['seed'], rec['calibration'])}: {len(rec['reward'])} steps in "
            f"{sum(rec['step_seconds']):.1f} s ({rec['wall']:.0f} s with its start), batch reward "
            f"{rec['reward'][0]:.3f} -> {rec['reward'][-1]:.3f}, held-out reward {ev['reward'][0]:.3f} (v0) -> "
            f"{ev['reward'][-1]:.3f} (v{ev['version'][-1]}; evaluated in {rec['eval_seconds']:.0f} s{rounds}), "
            f"to target {reached}, length r {rec['length_corr']:.2f}",
            flush=True,
        )

    if "target" not in state:
        plateau, start, source = None, None, None
        if spec.relative:
            # A compared seed's sync run fixes the target before any other run starts, and counts
            # as that seed's sync run; another seed makes a run of its own, left out of the table.
            compared = args.calibration_seed in seeds
            source = f"sync, seed {args.calibration_seed}" + ("" if compared else " (a calibration run)")
            found = [
                r
                for r in runs
                if r["mode"] == "sync" and r["seed"] == args.calibration_seed and r.get("calibration") != compared
            ]
            if not found:
                print(f"{source} fixes the target", flush=True)

                def own_target(rec: dict[str, Any]) -> float:
                    start, plateau = calibration_points(rec, plan.smooth, plan.smooth_eval)
                    return spec.resolve(plateau, start)

                rec = run_one(
                    plan, "sync", args.calibration_seed, work, inputs, extra, card=card, machine=machine,
                    calibration=not compared, target_of=own_target, eval_workers=args.eval_workers,
                )  # fmt: skip
                if rec is None:
                    raise SystemExit("the run that fixes the target failed: no target, no other runs")
                keep(rec)
                found = [rec]
            # Its start: the held-out reward of the base weights (or, in an old record without an
            # evaluation, its first steps' batch reward); its plateau: its last quarter's.
            start, plateau = calibration_points(found[0], plan.smooth, plan.smooth_eval)
            if start >= spec.resolve(plateau, start):
                at = (
                    "its held-out reward at version 0"
                    if found[0].get("eval")
                    else f"over its first {plan.smooth} steps"
                )
                print(
                    f"note: the target ({spec.resolve(plateau, start):.3f}) is at or below where {source} started "
                    f"({start:.3f}, {at}): every run reaches it at once; a higher --target (in another --out) "
                    "measures the rise",
                    flush=True,
                )
        state["target"] = {
            "spec": str(spec),
            "value": spec.resolve(plateau, start),
            "plateau": plateau,
            "start": start,
            "from": source,
        }
        state_path.write_text(json.dumps(state, indent=1))
        print(f"target fixed: {state['target']['value']:.3f} ({spec})", flush=True)
        for rec in runs:  # the run that fixed it, now that there is a target to reach
            reached = figures(rec, state["target"]["value"], plan.smooth, plan.smooth_eval).time_to_target
            print(f"run {run_name(rec['mode'], rec['seed'], rec['calibration'])}: to target "
                  + ("never" if reached is None else f"{reached:.1f} s"), flush=True)  # fmt: skip

    target = state["target"]["value"]
    finished = {(r["mode"], r["seed"]) for r in runs if not r.get("calibration")}
    todo = [(m, s) for m, s in planned_runs(modes, seeds) if (m, s) not in finished]
    failed: list[str] = []
    skipped: defaultdict[str, int] = defaultdict(int)
    for mode, seed in todo:
        expected = estimate(mode, runs)
        if not fits(expected, budget_left()):
            skipped[mode] += 1
            continue
        rec = run_one(
            plan,
            mode,
            seed,
            work,
            inputs,
            extra,
            card=card,
            machine=machine,
            target_of=lambda _: target,
            eval_workers=args.eval_workers,
        )
        if rec is None:
            failed.append(run_name(mode, seed))
            continue
        keep(rec)
    left = sum(skipped.values()) + len(failed)
    if skipped:
        print("left for the next call (budget): " + ", ".join(f"{m} x{n}" for m, n in skipped.items()))
    _report(runs, out, state, left)
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
