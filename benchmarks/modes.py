"""Sync vs sync + partial vs async rollout on the simulated engine: one run, same workload.

    python -m benchmarks.modes [--seeds 3] [--steps 10] [--time-scale 0.02] [--timeline-dir DIR] [--only NAME]
    python -m benchmarks.modes --engine builtin [--device cuda] [--model-size 0.6b] [--quick]  (modes_builtin.py)
    python -m benchmarks.modes --twin-from DIR/twin-inputs.json [--twin-time-scale 1] [--timeline-dir DIR]

The simulated runs are `modes_sim.py`; this module is the command line of both.

Every mode runs the real pipeline over real HTTP against a fresh simulated engine subprocess with
the same GPU-like decode-time model, the same long-tailed response lengths, the same prompts and
the same simulated trainer (a fixed training time per step, then a real weight publish). Times
below are *engine* seconds (wall seconds divided by the time scale), so the figures read as they
would on the modelled GPU. Each mode runs once per seed; the table shows medians.

Columns:
- groups/s, tokens/s: accepted groups and trained response tokens per engine second, end to end
  (rollout, training and publishing all included: that is what a user waits for);
- ratio: groups/s over sync's;
- busy: the share of engine time spent in forward passes (1.0 is the physical limit);
- off-pol: share of trained tokens produced by an older policy version than the one trained;
- stale mean/max: staleness of trained groups in versions;
- wasted: generated tokens neither trained nor kept in the store for later (lost work).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import anyio
import structlog

from benchmarks import modes_builtin, modes_sim

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="groups per step")
    parser.add_argument("--group", type=int, default=8, help="samples per group")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=128, help="concurrent requests (C x E)")
    parser.add_argument("--train-time", type=float, default=10.0, help="engine seconds per training step")
    parser.add_argument("--time-scale", type=float, default=0.02, help="wall seconds per engine second")
    parser.add_argument("--work", default="/tmp/bench-modes")
    parser.add_argument("--only", action="append", default=[], help="run only this mode (repeatable)")
    parser.add_argument("--timeline-dir", default=None, help="write one timeline HTML per mode (seed 0)")
    parser.add_argument(
        "--engine",
        default="sim",
        choices=["sim", "builtin"],
        help="builtin: real engine, trainer and publishes (benchmarks/modes_builtin.py)",
    )
    parser.add_argument("--device", default="cpu", help="builtin: cpu, cuda or cuda:N")
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "0.6b"], help="builtin: the model")
    parser.add_argument("--quick", action="store_true", help="builtin: the tiny model, 3 short steps")
    parser.add_argument(
        "--length-tail",
        default=None,
        metavar="DIST",
        help="builtin: end samples at lengths from the simulated engine's distribution (e.g. lognormal:-1.9,0.8)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="builtin: the trainer's compute dtype (--trainer-dtype), and the engine's with --length-tail",
    )
    parser.add_argument(
        "--twin-from",
        default=None,
        metavar="FILE",
        help="builtin: run only the simulated twin, from a real run's twin-inputs.json (in its --timeline-dir)",
    )
    parser.add_argument(
        "--twin-time-scale", type=float, default=0.25, help="with --twin-from: wall seconds per engine second"
    )
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    parsed = parser.parse_args()
    if parsed.twin_from:
        modes_builtin.rerun_twin(
            Path(parsed.twin_from), time_scale=parsed.twin_time_scale, timeline_dir=parsed.timeline_dir
        )
    elif parsed.engine == "builtin":
        modes_builtin.main(parsed)
    else:
        anyio.run(modes_sim.main, parsed)
