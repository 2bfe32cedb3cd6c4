"""The examples in `examples/` run, as a user runs them (`python -m examples.<name>` from the root)."""

from __future__ import annotations

import json
from pathlib import Path

from examples.custom_agent import FEEDBACK
from storage import LmdbStore
from tests.conftest import run_python_module

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str) -> str:
    done = run_python_module(f"examples.{name}", *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_custom_trainer_loop_trains_and_publishes() -> None:
    out = run_example("custom_trainer_loop", "--steps", "2")
    assert "step 0:" in out and "now serving v2" in out and "'groups/ready_total': 8" in out


def test_custom_agent_runs_under_the_launcher(tmp_path: Path) -> None:
    run_example(
        "custom_agent",
        "--num-rollout",
        "2",
        "--output-dir",
        str(tmp_path),
        "--no-progress",
        "--log-level",
        "warning",
        "--rollout-batch-size",
        "4",
        "--rollout-data-transport",
        "lmdb",
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    with LmdbStore(tmp_path / "rollout_data", readonly=True) as store:
        samples = [s for step in (0, 1) for g in store.batch(step).groups for s in g.samples]
    retried = [s for s in samples if 0 in s.loss_mask]
    assert retried, "no sample got the environment's feedback"
    for s in retried:
        at = s.loss_mask.index(0)
        assert s.response_ids[at : at + len(FEEDBACK)] == FEEDBACK
        assert s.loss_mask[at : at + len(FEEDBACK)] == (0,) * len(FEEDBACK)
        assert s.metadata["agent"]["state"] == {"step": "done", "tries": 2}
