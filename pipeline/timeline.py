"""Draw a run's events as a timeline: one lane per engine slot, plus the trainer's lane on top.

    python -m pipeline.timeline RUN_DIR/events.jsonl -o timeline.html

Each request is a bar in its slot's lane, coloured by how it ended (stop, length limit, aborted,
error); a request that continued a prefix has a dark left edge. The top lanes show training steps,
weight publishes (the admission gate closed) and partial rollout's stops (abort and drain). White
space in the slot lanes is the bubble: slots with nothing to run.

The output is one self-contained HTML file with an inline SVG: no plotting library needed.
"""

from __future__ import annotations

import argparse
import html
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from core.errors import ReplayError
from pipeline.events import read_events

__all__ = ["EVENTS_FILE", "render_timeline", "slot_busy_fraction", "steady_window", "work_span", "write_html"]

EVENTS_FILE = "events.jsonl"  # the launcher's event log in the run dir

FINISH_COLOURS = {"stop": "#4c9a5a", "length": "#e0a030", "abort": "#d04a3a", "error": "#7a2a8a"}
TOP_LANES = (
    ("train", "#3a6fd0", "training step"),
    ("publish", "#8a4ad0", "publish (gate closed)"),
    ("stop", "#d04a3a", "stop: abort + drain"),
    ("restart", "#000000", "controller restarted"),
)
LANE_H, GAP, LEFT, WIDTH = 6, 1, 110, 1400


def work_span(events: Sequence[dict[str, Any]]) -> float:
    """Seconds from the first request, training or publish span's start to the last one's end
    (the run's work without its start-up), 0.0 if none."""
    spans = [e for e in events if "start" in e and "end" in e]
    return max(e["end"] for e in spans) - min(e["start"] for e in spans) if spans else 0.0


def slot_busy_fraction(
    events: Sequence[dict[str, Any]], *, start: float | None = None, end: float | None = None
) -> float:
    """Share of slot-time with a request in flight, over the span the requests cover, or over
    [`start`, `end`] where given (requests cut at its edges)."""
    reqs = [e for e in events if e["kind"] == "request"]
    if not reqs:
        return 0.0
    slots = {e["slot"] for e in reqs}
    t0 = min(e["start"] for e in reqs) if start is None else start
    t1 = max(e["end"] for e in reqs) if end is None else end
    busy = sum(max(0.0, min(e["end"], t1) - max(e["start"], t0)) for e in reqs)
    return busy / (len(slots) * (t1 - t0)) if t1 > t0 else 0.0


def steady_window(events: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """From the end of the first publish to the start of the last training step: the steps
    between a run's two ends (the first step holds the trainer's warm-up, the last one the
    final full checkpoint, and the engine waits through both); None with fewer than 3 steps."""
    trains = sorted(e["start"] for e in events if e["kind"] == "train")
    publishes = sorted(e["end"] for e in events if e["kind"] == "publish")
    if len(trains) < 3 or not publishes or publishes[0] >= trains[-1]:
        return None
    return publishes[0], trains[-1]


def _on_one_clock(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shift each resumed run's times by how long after the first run it started."""
    out: list[dict[str, Any]] = []
    first: float | None = None
    offset = 0.0
    for e in events:
        if e["kind"] == "run":
            first = e["started_at"] if first is None else first
            offset = e["started_at"] - first
            if out:
                out.append({"kind": "restart", "start": offset, "end": offset})
            continue
        if offset and "start" in e:
            e = dict(e, start=e["start"] + offset, end=e["end"] + offset)
        out.append(e)
    return out


def render_timeline(events: Iterable[dict[str, Any]], *, title: str = "rollout timeline") -> str:
    events = _on_one_clock(events)
    reqs = [e for e in events if e["kind"] == "request"]
    spans = [e for e in events if "start" in e and "end" in e]
    if not spans:
        return _page(title, "<p>no events recorded</p>")
    t0 = min(e["start"] for e in spans)
    t1 = max(e["end"] for e in spans)
    scale = (WIDTH - LEFT - 10) / max(t1 - t0, 1e-9)
    n_slots = max((e["slot"] for e in reqs), default=-1) + 1
    top = len(TOP_LANES) * (LANE_H * 2 + GAP) + 20
    height = top + n_slots * (LANE_H + GAP) + 40

    def x(t: float) -> float:
        return float(LEFT + (t - t0) * scale)

    parts: list[str] = []
    for i, (kind, colour, label) in enumerate(TOP_LANES):
        y = 10 + i * (LANE_H * 2 + GAP)
        parts.append(f'<text x="4" y="{y + LANE_H * 2 - 2}" class="lbl">{label}</text>')
        for e in (e for e in events if e["kind"] == kind):
            tip = html.escape(", ".join(f"{k}={v}" for k, v in e.items()))
            parts.append(_rect(x(e["start"]), y, (e["end"] - e["start"]) * scale, LANE_H * 2, colour, tip))
    parts.append(f'<text x="4" y="{top + 8}" class="lbl">engine slots</text>')
    for e in reqs:
        y = top + e["slot"] * (LANE_H + GAP)
        w = (e["end"] - e["start"]) * scale
        tip = html.escape(
            f"{e['group']} #{e['sample']} +{e['tokens']} tokens after {e['prefix']}, {e['finish']}, v{e['version']}"
        )
        parts.append(_rect(x(e["start"]), y, w, LANE_H, FINISH_COLOURS.get(e["finish"], "#888"), tip))
        if e.get("prefix"):
            parts.append(_rect(x(e["start"]), y, min(2.0, w), LANE_H, "#222", tip))
    axis_y = height - 20
    for k in range(11):
        t = t0 + (t1 - t0) * k / 10
        parts.append(f'<text x="{x(t):.1f}" y="{axis_y + 14}" class="lbl" text-anchor="middle">{t - t0:.2f}s</text>')
    legend = " ".join(
        f'<span style="background:{c};color:#fff;padding:1px 6px">{k}</span>' for k, c in FINISH_COLOURS.items()
    )
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}">'
        f"<style>.lbl{{font:10px sans-serif;fill:#333}}</style>{''.join(parts)}</svg>"
    )
    stats = f"{len(reqs)} requests on {n_slots} slots; slot busy fraction {slot_busy_fraction(events):.2f}"
    return _page(title, f"<p>{stats}. Requests ended by: {legend}; dark left edge = continued a prefix.</p>{svg}")


def _rect(x: float, y: float, w: float, h: float, colour: str, tip: str) -> str:
    return (
        f'<rect x="{x:.2f}" y="{y}" width="{max(w, 0.5):.2f}" height="{h}" fill="{colour}"><title>{tip}</title></rect>'
    )


def _page(title: str, body: str) -> str:
    t = html.escape(title)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{t}</title></head>"
        f"<body><h3>{t}</h3>{body}</body></html>"
    )


def write_html(events: Path, output: Path | None = None) -> Path:
    """Draw the event log `events` (or a run dir's `events.jsonl`) to `output` (default: beside
    it, `timeline.html`); returns the path. ReplayError names a file that cannot be used."""
    if events.is_dir():
        events = events / EVENTS_FILE
    if not events.is_file():
        raise ReplayError(f"there is no event log at {events}: give a run's {EVENTS_FILE}, or its --output-dir")
    out = output if output is not None else events.with_name("timeline.html")
    try:
        page = render_timeline(read_events(events), title=str(events))
    except (ValueError, KeyError, TypeError) as exc:  # a line that is not an event this code writes
        raise ReplayError(f"{events} is not a readable event log: {exc!r}") from exc
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ReplayError(f"cannot write the timeline to {out}: {exc}") from exc
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("events", type=Path, help="events.jsonl of a run (or the run dir)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="HTML file (default: beside the events)")
    args = parser.parse_args(argv)
    try:
        out = write_html(args.events, args.output)
    except ReplayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
