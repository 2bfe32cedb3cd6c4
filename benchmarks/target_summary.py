"""What the time-to-target runs say (`benchmarks/time_to_target.py`): the figures of one run, the
table per mode, the ratios to sync, the verdicts against issue 48's targets, and the picture.

A run is one line of `runs.jsonl`: its mode and seed, and per training step (from the run's own
`metrics.jsonl`) the reward (`rollout/raw_reward`), the step's wall seconds (`perf/step_time`,
commit to commit, so the steps add up to the run's time from the controller's start), the engine's
busy share (`engine/busy_frac`: slot-seconds in flight over slots x seconds) and the publish's
stall (`time/publish_gate_closed`: seconds the admission gate stayed closed for the publish).

Time to target: the wall seconds, summed over the steps, to the end of the first step at which the
trailing mean reward over `smooth` steps (fewer at the start) reaches the target. One step's reward
is the mean over one batch, noisy; the trailing mean is what "reached" means for every mode alike.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RunFigures",
    "TargetSpec",
    "figures",
    "ratios",
    "read_runs",
    "summarize",
    "table",
    "time_to_target",
    "verdicts",
]

# The targets: wall time to the target over sync's, and final reward against sync's.
ASYNC_TIME_RATIO = 0.6
PARTIAL_TIME_RATIO = 0.8
FINAL_REWARD_TOLERANCE = 0.05
# The modes the others are held against (`ratios`); the issue sets them no target of their own.
BASELINE = ("sync", "sync-colocated")
TIME_TARGETS = {
    "partial": PARTIAL_TIME_RATIO,
    "async": ASYNC_TIME_RATIO,
    "async-overlap": ASYNC_TIME_RATIO,
    "partial-colocated": PARTIAL_TIME_RATIO,
    "async-colocated": ASYNC_TIME_RATIO,
}


@dataclass(frozen=True)
class TargetSpec:
    """The reward target: an absolute reward (`0.55`), or a share of a calibration run's plateau
    (`0.8x`: 0.8 x sync's mean reward over the last quarter of its steps)."""

    value: float
    relative: bool

    @classmethod
    def parse(cls, text: str) -> TargetSpec:
        raw = text.strip()
        relative = raw.endswith("x")
        try:
            value = float(raw[:-1] if relative else raw)
        except ValueError:
            raise ValueError(f"--target {text!r}: not a reward (0.55) nor a share of sync's plateau (0.8x)") from None
        if not (0 < value <= 1) or not math.isfinite(value):
            raise ValueError(f"--target {text!r}: must be in (0, 1] (a reward, or a share of sync's plateau)")
        return cls(value, relative)

    def resolve(self, plateau: float | None) -> float:
        """The reward the runs must reach; `plateau` is the calibration run's last-quarter reward."""
        if not self.relative:
            return self.value
        if plateau is None:
            raise ValueError("a relative target needs the calibration run's plateau")
        return self.value * plateau

    def __str__(self) -> str:
        return f"{self.value:g}x" if self.relative else f"{self.value:g}"


def read_runs(path: Path) -> list[dict[str, Any]]:
    """The runs of a `runs.jsonl` file, in the order they finished; none when it is absent."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value with the `window - 1` before it (fewer at the start)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def time_to_target(reward: Sequence[float], seconds: Sequence[float], target: float, smooth: int) -> float | None:
    """Wall seconds to the end of the first step whose trailing mean reward reaches `target`; None
    when no step does."""
    if len(reward) != len(seconds):
        raise ValueError(f"{len(reward)} rewards against {len(seconds)} step times: one of each per step")
    clock = list(itertools.accumulate(seconds))
    for i, value in enumerate(trailing_mean(reward, max(1, smooth))):
        if value >= target:
            return clock[i]
    return None


def last_quarter(values: Sequence[float]) -> float:
    quarter = max(1, len(values) // 4)
    return statistics.fmean(values[-quarter:])


@dataclass(frozen=True)
class RunFigures:
    """One run's figures, as the table reports them per mode."""

    mode: str
    seed: int
    steps: int
    seconds: float  # the steps' wall seconds, summed
    time_to_target: float | None
    steps_to_target: int | None
    final_reward: float  # mean over the last quarter of the steps
    groups_per_second: float
    busy: float  # engine slot-seconds in flight over slots x seconds, over the whole run
    publish_stall: float  # mean seconds a step's publish kept the admission gate closed


def figures(run: dict[str, Any], target: float, smooth: int) -> RunFigures:
    reward, seconds = run["reward"], run["step_seconds"]
    total = sum(seconds)
    reached = time_to_target(reward, seconds, target, smooth)
    steps_to = None
    if reached is not None:
        steps_to = next(i + 1 for i, t in enumerate(itertools.accumulate(seconds)) if t >= reached)
    busy = run.get("busy") or [0.0] * len(seconds)
    stall = run.get("publish_stall") or [0.0]
    return RunFigures(
        mode=run["mode"],
        seed=int(run["seed"]),
        steps=len(reward),
        seconds=total,
        time_to_target=reached,
        steps_to_target=steps_to,
        final_reward=last_quarter(reward),
        groups_per_second=len(reward) * int(run["batch"]) / total if total > 0 else 0.0,
        busy=sum(b * s for b, s in zip(busy, seconds, strict=True)) / total if total > 0 else 0.0,
        publish_stall=statistics.fmean(stall),
    )


def _mean(values: Iterable[float]) -> float:
    kept = list(values)
    return statistics.fmean(kept) if kept else math.nan


def _std(values: Iterable[float]) -> float:
    kept = list(values)
    return statistics.stdev(kept) if len(kept) > 1 else 0.0


def summarize(runs: Sequence[dict[str, Any]], target: float, smooth: int) -> list[dict[str, Any]]:
    """One row per mode (calibration runs left out), in the order the modes first appear. Time to
    target is the mean over the seeds that reached it; `reached` says how many did."""
    per_mode: dict[str, list[RunFigures]] = {}
    for run in runs:
        if run.get("calibration"):
            continue
        per_mode.setdefault(run["mode"], []).append(figures(run, target, smooth))
    rows = []
    for mode, figs in per_mode.items():
        times = [f.time_to_target for f in figs if f.time_to_target is not None]
        rows.append(
            {
                "mode": mode,
                "seeds": len(figs),
                "reached": len(times),
                "time_to_target": _mean(times),
                "time_to_target_std": _std(times),
                "steps_to_target": _mean(f.steps_to_target for f in figs if f.steps_to_target is not None),
                "final_reward": _mean(f.final_reward for f in figs),
                "final_reward_std": _std(f.final_reward for f in figs),
                "steps": _mean(f.steps for f in figs),
                "seconds": _mean(f.seconds for f in figs),
                "groups_per_second": _mean(f.groups_per_second for f in figs),
                "busy": _mean(f.busy for f in figs),
                "publish_stall": _mean(f.publish_stall for f in figs),
            }
        )
    return ratios(rows)


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's time to target and final reward over its baseline's: a colocated mode's is
    colocated sync where it ran, every other mode's (colocated sync's too) sync's; None where
    there is no baseline, or a seed of either never reached the target."""
    by_mode = {r["mode"]: r for r in rows}
    for row in rows:
        colocated = row["mode"].endswith("-colocated") and row["mode"] != "sync-colocated"
        base = (by_mode.get("sync-colocated") if colocated else None) or by_mode.get("sync")
        row["baseline"] = base["mode"] if base else None
        usable = base is not None and base["reached"] == base["seeds"] and row["reached"] == row["seeds"]
        row["time_ratio"] = row["time_to_target"] / base["time_to_target"] if usable and base else None
        row["reward_ratio"] = row["final_reward"] / base["final_reward"] if base and base["final_reward"] else None
    return rows


def verdicts(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line per target of the issue: met, missed, or not measured (and why)."""
    lines = []
    for row in rows:
        mode = row["mode"]
        if mode in BASELINE:
            continue
        goal = TIME_TARGETS.get(mode)
        if goal is not None:
            if row["time_ratio"] is None:
                why = "a seed of it or of its baseline never reached the target" if row["baseline"] else "no sync ran"
                lines.append(f"target {mode} time <= {goal}x {row['baseline'] or 'sync'}: not measured ({why})")
            else:
                met = "MET" if row["time_ratio"] <= goal else "MISSED"
                lines.append(
                    f"target {mode} time <= {goal}x {row['baseline']}: {row['time_ratio']:.2f}x "
                    f"({row['time_to_target']:.1f} s against {row['time_to_target'] / row['time_ratio']:.1f} s): {met}"
                )
        if row["reward_ratio"] is not None:
            met = "MET" if row["reward_ratio"] >= 1 - FINAL_REWARD_TOLERANCE else "MISSED"
            lines.append(
                f"target {mode} final reward within {FINAL_REWARD_TOLERANCE:.0%} of {row['baseline']}: "
                f"{row['reward_ratio']:.3f}: {met}"
            )
    return lines


def table(rows: Sequence[dict[str, Any]], target: float) -> str:
    """The table the README and BENCHMARKS carry, as markdown."""
    lines = [
        f"| mode | seeds reaching {target:.3f} | time to target s (± std) | vs sync | steps to target "
        "| last-quarter reward (± std) | vs sync | steps | groups/s | engine busy | publish stall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = "never" if not r["reached"] else f"{r['time_to_target']:.1f} ± {r['time_to_target_std']:.1f}"
        vs_t = "-" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}"
        vs_r = "-" if r["reward_ratio"] is None else f"{r['reward_ratio']:.3f}"
        steps_to = "-" if math.isnan(r["steps_to_target"]) else f"{r['steps_to_target']:.1f}"
        lines.append(
            f"| {r['mode']} | {r['reached']}/{r['seeds']} | {t} | {vs_t} | {steps_to} "
            f"| {r['final_reward']:.3f} ± {r['final_reward_std']:.3f} | {vs_r} | {r['steps']:.0f} "
            f"| {r['groups_per_second']:.3f} | {r['busy']:.3f} | {r['publish_stall']:.3f} |"
        )
    return "\n".join(lines)


def plot(runs: Sequence[dict[str, Any]], path: Path, target: float, *, title: str, smooth: int = 1) -> None:
    """Reward against wall-clock seconds, one line per mode and seed (a colour per mode; colocated
    modes dashed), the reward as its trailing mean over `smooth` steps (what reaching the target
    reads), the target dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    modes = list(dict.fromkeys(r["mode"] for r in runs if not r.get("calibration")))
    colours = plt.get_cmap("tab10")
    for i, mode in enumerate(modes):
        first = True
        for run in runs:
            if run["mode"] != mode or run.get("calibration"):
                continue
            clock = list(itertools.accumulate(run["step_seconds"]))
            style = "--" if mode.endswith("-colocated") else "-"
            reward = trailing_mean(run["reward"], smooth)
            ax.plot(clock, reward, style, color=colours(i % 10), alpha=0.75, linewidth=1.2,
                    label=mode if first else None)  # fmt: skip
            first = False
    ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:.3f}")
    ax.set_xlabel("wall-clock seconds (the run's steps, from its controller's start)")
    ax.set_ylabel("reward (rollout/raw_reward)" + (f", trailing mean over {smooth} steps" if smooth > 1 else ""))
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
