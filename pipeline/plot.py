"""`python -m pipeline.plot RUN_DIR`: a run's learning curves as one PNG, `RUN_DIR/curves.png`.

Reads `RUN_DIR/metrics.jsonl`, which memory and LMDB runs both write (one record per trained
step), and draws one panel per quantity the records hold: reward, response length, staleness, KL
between the engine's and the trainer's policy, loss, throughput. A panel whose keys no record has
is left out, and `--key NAME` adds any other metric, so a run with more (or fewer) metrics draws
what it has. Needs matplotlib: `pip install 'rollout-pipeline[plot]'`.

    python -m pipeline.plot runs/latest                  # -> runs/latest/curves.png
    python -m pipeline.plot RUN_DIR -o curves.png --key train/entropy
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.metrics import is_eval_record

__all__ = ["PANELS", "draw", "main", "read_records"]

# (title, keys drawn in it): a key may be missing from a run, a panel with none is left out.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("rollout/raw_reward",)),
    ("response length (tokens)", ("rollout/response_len/mean", "rollout/response_len/max")),
    ("staleness (versions)", ("staleness/mean", "staleness/max")),
    ("KL", ("train/approx_kl_k3", "train/kl", "train/kl_mean", "train/ref_kl")),
    ("loss", ("train/loss",)),
    ("throughput", ("groups/per_second",)),
)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file in step order, the steps' and the evaluations' own lines
    (`pipeline.metrics.eval_record`: what `--key eval/NAME` draws beside the inline ones); a torn
    or non-JSON line is skipped."""
    records: dict[int, dict[str, Any]] = {}
    evaluations: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            if is_eval_record(record):
                evaluations.append(record)
            else:
                records[record["step"]] = record  # a step written twice: the last one counts
    return sorted([*records.values(), *evaluations], key=lambda r: int(r["step"]))


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(r["step"])
            values.append(float(value))
    return steps, values


def draw(records: list[dict[str, Any]], out: Path, *, title: str, extra: Sequence[str] = ()) -> list[str]:
    """Draw the panels the records have into `out` (PNG); the keys drawn."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels = [(name, [k for k in keys if _series(records, k)[0]]) for name, keys in PANELS]
    panels += [(key, [key]) for key in extra if _series(records, key)[0]]
    panels = [(name, keys) for name, keys in panels if keys]
    if not panels:
        raise ValueError("no metric to draw: the records hold none of " + ", ".join(k for _, ks in PANELS for k in ks))
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            ax.plot(*_series(records, key), label=key, linewidth=1.2)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [k for _, keys in panels for k in keys]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder (or its metrics.jsonl)")
    parser.add_argument("-o", "--output", type=Path, help="PNG to write (default: RUN_DIR/curves.png)")
    parser.add_argument("--key", action="append", default=[], help="another metric to draw (repeatable)")
    args = parser.parse_args(argv)
    metrics = args.run_dir if args.run_dir.is_file() else args.run_dir / "metrics.jsonl"
    if not metrics.is_file():
        print(f"error: {metrics}: no metrics file (is {args.run_dir} a run folder?)", file=sys.stderr)
        return 2
    records = read_records(metrics)
    if not records:
        print(f"error: {metrics}: no step record yet", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: drawing needs matplotlib: pip install 'rollout-pipeline[plot]'", file=sys.stderr)
        return 2
    out = args.output or metrics.parent / "curves.png"
    try:
        drawn = draw(records, out, title=f"{metrics.parent} ({len(records)} steps)", extra=args.key)
    except ValueError as exc:
        print(f"error: {metrics}: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {len(records)} steps; {', '.join(drawn)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
