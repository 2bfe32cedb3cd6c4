"""`python -m pipeline.replay RUN_DIR metrics`: the per-step table a user would plot, from the store
and the metrics file, and every place where the two disagree.

The store holds the record each step was committed with (`Store.step_metrics`); the file holds what
the run appended after each commit (see `pipeline.metrics` for why the two can differ after a
crash, and how a resume repairs the file). A row comes from the file where it has the step, else
from the store. The fields measured after the commit (`AFTER_COMMIT`) are only in the file, and
their absence from the store is not a disagreement.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from core.errors import ReplayError
from pipeline.metrics import AFTER_COMMIT, AFTER_COMMIT_PREFIXES, is_eval_record

__all__ = ["DEFAULT_COLUMNS", "MetricsTable", "compare_metrics", "format_metrics", "write_csv"]

# What the printed table shows unless --columns says otherwise (the CSV has every field).
DEFAULT_COLUMNS = (
    "step",
    "version",
    "rollout/raw_reward",
    "rollout/response_len/mean",
    "staleness/max",
    "train/loss",
    "perf/step_time",
)


@dataclass(frozen=True, slots=True)
class MetricsTable:
    rows: tuple[dict[str, Any], ...]  # one per step, in step order, with a "source" field
    columns: tuple[str, ...]  # every field of any row ("source" aside), "step" first, in first-seen order
    disagreements: tuple[str, ...]
    trained_step: int


def compare_metrics(
    file_lines: Sequence[bytes], stored: Mapping[int, Mapping[str, Any]], trained_step: int
) -> MetricsTable:
    """The table and the disagreements between the file's lines and the store's records."""
    problems: list[str] = []
    in_file: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(file_lines, 1):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            problems.append(f"line {number} of the metrics file is not JSON (a write cut short?)")
            continue
        if isinstance(record, dict) and is_eval_record(record):
            continue  # an evaluation's own line, no step's record (`pipeline.metrics.eval_record`)
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            problems.append(f"line {number} of the metrics file has no integer step ({step!r})")
        elif step in in_file:
            problems.append(f"step {step}: a second record in the metrics file (line {number})")
        else:
            in_file[step] = record
    for step in sorted(set(in_file) | set(stored)):
        problems += _step_problems(step, in_file.get(step), stored.get(step), trained_step)
    rows, columns = [], {"step": None}
    for step in sorted(set(in_file) | set(stored)):
        source = "both" if step in in_file and step in stored else "file" if step in in_file else "store"
        row = {**(in_file.get(step) or stored[step]), "source": source}
        rows.append(row)
        columns.update(dict.fromkeys(k for k in row if k != "source"))
    return MetricsTable(tuple(rows), tuple(columns), tuple(problems), trained_step)


def _step_problems(
    step: int, line: Mapping[str, Any] | None, ours: Mapping[str, Any] | None, trained_step: int
) -> list[str]:
    if line is None:
        return [f"step {step}: in the store, not in the metrics file"]
    if ours is None:
        if step > trained_step:
            return [f"step {step}: in the metrics file, but the store has not trained it (trained step {trained_step})"]
        return [f"step {step}: in the metrics file, not in the store (no record was stored with its commit)"]
    out = []
    for key in sorted(set(line) | set(ours)):
        if (key in AFTER_COMMIT or key.startswith(AFTER_COMMIT_PREFIXES)) and key not in ours:
            continue
        a, b = line.get(key, "<absent>"), ours.get(key, "<absent>")
        if a != b:
            out.append(f"step {step}: {key} is {a!r} in the metrics file, {b!r} in the store")
    return out


def format_metrics(table: MetricsTable, columns: Sequence[str] = DEFAULT_COLUMNS) -> str:
    shown = [c for c in columns if c in table.columns] + ["source"]
    cells = [[_cell(row.get(c)) for c in shown] for row in table.rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(shown)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(shown, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    if table.disagreements:
        lines.append(f"\nthe metrics file and the store disagree in {len(table.disagreements)} place(s):")
        lines += [f"  {p}" for p in table.disagreements]
    else:
        lines.append(
            f"\nthe metrics file and the store agree: {len(table.rows)} steps, trained step {table.trained_step}"
        )
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def write_csv(table: MetricsTable, out: Path | IO[str]) -> None:
    """Every field of every step; an empty cell where a row lacks the field (or it is null)."""
    columns = [*table.columns, "source"]
    try:
        handle = out.open("w", newline="", encoding="utf-8") if isinstance(out, Path) else out
    except OSError as exc:
        raise ReplayError(f"cannot write the metrics table to {out}: {exc}") from exc
    try:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="", extrasaction="ignore")
        writer.writeheader()
        for row in table.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    finally:
        if isinstance(out, Path):
            handle.close()
