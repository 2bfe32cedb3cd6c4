"""What the prompts' stored histories buy, on the simulated engine (issue 50): the sync step-time
tail with length-aware admission, and the generation saved by skipping zero-variance prompts.

    python -m benchmarks.history_sim [--steps 40] [--seeds 3] [--prompts 64] [--batch 16] [--group 8]
        [--slots 32] [--max-len 512] [--prompt-sigma 1.0] [--sigma 0.3] [--truncate-frac 0]
        [--zero-std-share 0.5] [--time-scale 0.05] [--only sync,length,...]

Each setting is the real pipeline over real HTTP to a fresh simulated engine (`engines.sim`), the
same finite prompt set over many epochs, a trainer that takes no time (so a step is its rollout
round: what the order of admission can change). The length model gives each prompt a length of
its own (`--length-prompt-sigma`: the same prompt is long or short in every epoch, with
`--sigma` of noise per sample), which is what a prediction from past groups can use. Settings:

    sync            plain sync rounds (each a batch of groups, `--slots` of its samples at a time)
    length          sync + --length-aware-admission
    partial         sync + --partial-rollout (over-sampling 2 x batch)
    partial-length  partial + --length-aware-admission
    dapo            sync + the DAPO filter (reward_std_nonzero), `--zero-std-share` of the prompts
                    scoring every sample alike
    dapo-skip       dapo + --skip-zero-std-prompts

Reported per setting (medians over seeds; times in engine seconds): step time p50, p90, their
ratio (the tail) and mean; the round tail (median over rounds of the time from the last request's
start to the round's end: what starting the long ones first shrinks) and the share of slot-time
idle in a round; the first epoch's steps left out (no history yet: every prompt counts as
longest, the order is the cursor's); generated tokens per trained group; prompts skipped.
Nothing learns here (the rewards are fixed), so "to the same reward" is the learning benchmark's
(`python -m benchmarks.learning --design history`); here a skip saves exactly what the filter
would have thrown away.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import anyio
import structlog

from benchmarks.modes_sim import SimulatedTrainer, sim_stats, workload
from core.types import PromptTask, Sample
from launch.builtin_engine import start_engine
from pipeline import RolloutPlan, run_pipeline
from pipeline.events import EventLog
from pipeline.metrics import MetricsSink
from pipeline.timeline import slot_busy_fraction
from stages.filter import reward_std_nonzero
from stages.sglang_client import EngineFleet
from storage import AsyncStore, MemoryStore

SETTINGS = ("sync", "length", "partial", "partial-length", "dapo", "dapo-skip")
PAIRS = {"length": "sync", "partial-length": "partial", "dapo-skip": "dapo"}


def make_reward(share: float) -> Any:
    """A reward fixed per prompt and sample: `share` of the prompts score every sample 1 (no
    spread: the DAPO filter rejects them), the others score by sample (a spread)."""

    def reward(task: PromptTask, sample: Sample) -> float:
        if zlib.crc32(f"zero:{task.index}".encode()) % 1000 < share * 1000:
            return 1.0
        return float(sample.index % 2)

    return reward


def plan_for(setting: str, args: argparse.Namespace, seed: int) -> tuple[RolloutPlan, bool]:
    """The plan of `setting`, and whether it runs the DAPO filter."""
    common: dict[str, Any] = dict(
        mode="sync",
        batch_size=args.batch,
        n_samples=args.group,
        num_steps=args.steps,
        slots=args.slots,
        max_response_len=args.max_len,
        sampling_params={"temperature": 1.0},
        seed=seed,
    )
    partial = setting.startswith("partial")
    return (
        RolloutPlan(
            **common,
            partial=partial,
            over_sampling=2 * args.batch if partial else None,
            length_aware_admission=setting.endswith("length"),
            skip_zero_std=setting == "dapo-skip",
        ),
        setting.startswith("dapo"),
    )


async def run_setting(setting: str, args: argparse.Namespace, seed: int, work: Path) -> dict[str, float]:
    plan, dapo = plan_for(setting, args, seed)
    scale = args.time_scale
    flags = [
        "--time-scale", str(scale), "--random-seed", str(seed), "--length-dist", f"lognormal:{args.mu},{args.sigma}",
        "--truncate-frac", str(args.truncate_frac), "--length-prompt-sigma", str(args.prompt_sigma),
    ]  # fmt: skip
    engine = await start_engine("simulated", module="engines.sim", max_running_requests=args.slots, extra_args=flags)
    async with engine, EngineFleet([engine.url], concurrency=args.slots) as fleet:
        store = MemoryStore()
        sink = MetricsSink(None)
        events = EventLog(None)
        before = await sim_stats(engine.url)
        started = time.perf_counter()
        await run_pipeline(
            plan,
            engines=fleet,
            store=AsyncStore(store),
            trainer=SimulatedTrainer(0.0, work),
            dataset=workload(args.prompts, args.prompt_len, seed),
            reward_fn=make_reward(args.zero_std_share if dapo else 0.0),
            filter_fn=reward_std_nonzero if dapo else None,
            weights_dir=work,
            metrics=sink,
            events=events,
        )
        wall = time.perf_counter() - started
        after = await sim_stats(engine.url)
    # Steps of the first epoch have no history to order by: left out of the step-time figures.
    first_epoch = -(-args.prompts // args.batch)
    steps = [r["perf/step_time"] / scale for r in sink.records[first_epoch:]] or [0.0]
    last = sink.records[-1]
    tails, idle = round_tails(events.events, skip=first_epoch)
    return {
        "p50": statistics.median(steps),
        "p90": statistics.quantiles(steps, n=10)[-1] if len(steps) > 1 else steps[0],
        "tail": (statistics.quantiles(steps, n=10)[-1] / statistics.median(steps)) if len(steps) > 1 else 1.0,
        "mean": statistics.fmean(steps),
        "tokens/group": last["tokens/generated_total"] / (args.batch * args.steps),
        "skipped": float(last.get("filter/rejected/skipped_zero_std", 0.0)),
        "rejected": float(last.get("filter/rejected/rejected", 0.0)),
        "round tail": statistics.median(tails) / scale if tails else 0.0,
        "idle": statistics.median(idle) if idle else 0.0,
        "engine s": wall / scale,
        "late": float(after.get("late_forwards", 0) - before.get("late_forwards", 0)),
    }


def round_tails(events: list[dict[str, Any]], *, skip: int) -> tuple[list[float], list[float]]:
    """Per sync round after the first `skip`: the tail (wall seconds from the last request's start
    to the round's last end: no slot takes new work, the round waits on its slowest samples) and
    the share of slot-time idle from the round's first start to its end."""
    trains = sorted((e["start"], e["end"]) for e in events if e["kind"] == "train")
    requests = [e for e in events if e["kind"] == "request"]
    tails, idle = [], []
    opened = 0.0
    for step, (train_start, train_end) in enumerate(trains):
        mine = [e for e in requests if opened <= e["start"] < train_start]
        opened = train_end
        if step < skip or not mine:
            continue
        first, last_start, end = (
            min(e["start"] for e in mine),
            max(e["start"] for e in mine),
            max(e["end"] for e in mine),
        )
        tails.append(end - last_start)
        idle.append(1.0 - slot_busy_fraction(mine, start=first, end=end))
    return tails, idle


async def main(args: argparse.Namespace) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="history-sim-"))
    chosen = [s for s in SETTINGS if not args.only or s in args.only.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    for seed in range(args.seeds):
        for setting in chosen:
            results.setdefault(setting, []).append(await run_setting(setting, args, seed, work))
            r = results[setting][-1]
            print(f"seed {seed} {setting}: p50 {r['p50']:.2f} p90 {r['p90']:.2f} s, {r['tokens/group']:.0f} tok/group")
    print(
        f"\nmedians over {args.seeds} seeds; {args.steps} steps of {args.batch} groups x {args.group} samples, "
        f"{args.prompts} prompts ({args.steps * args.batch / args.prompts:.1f} epochs of trained groups), "
        f"{args.slots} slots, max {args.max_len} tokens, lengths lognormal({args.mu}, {args.sigma}) x prompt "
        f"factor e^({args.prompt_sigma} z), truncate {args.truncate_frac}; engine seconds, first epoch left out"
    )
    cols = ["p50", "p90", "tail", "mean", "round tail", "idle", "tokens/group", "skipped", "rejected", "late"]
    print(f"{'setting':16}" + "".join(f"{c:>13}" for c in cols) + f"{'tail vs':>10}{'r.tail vs':>10}{'tokens vs':>11}")
    med = {s: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for s, runs in results.items()}
    for setting, m in med.items():
        base = med.get(PAIRS.get(setting, setting), m)
        cells = "".join(f"{m[c]:>13.2f}" for c in cols)
        vs = [m["tail"] / base["tail"], m["round tail"] / (base["round tail"] or 1.0)]
        print(f"{setting:16}{cells}{vs[0]:>10.2f}{vs[1]:>10.2f}{m['tokens/group'] / base['tokens/group']:>11.2f}")
    if any(m["late"] for m in med.values()):
        print("note: the simulated engine ran late on some forwards; raise --time-scale for exact timing")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.history_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64, help="the finite prompt set, seen over several epochs")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--slots", type=int, default=32, help="concurrent samples (fewer than a round's)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--mu", type=float, default=-2.5, help="log of the median length fraction")
    ap.add_argument("--sigma", type=float, default=0.3, help="per-sample length noise (log scale)")
    ap.add_argument("--prompt-sigma", type=float, default=1.0, help="per-prompt length spread (log scale)")
    ap.add_argument("--truncate-frac", type=float, default=0.0)
    ap.add_argument("--zero-std-share", type=float, default=0.5, help="dapo settings: prompts with no reward spread")
    ap.add_argument("--time-scale", type=float, default=0.05, help="wall seconds per engine second")
    ap.add_argument("--only", default=None, help=f"comma-separated of {', '.join(SETTINGS)}")
    ap.add_argument("--work", default=None)
    return ap.parse_args(argv)


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(main, parse_args())
