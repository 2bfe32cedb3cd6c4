"""`python -m pipeline.replay RUN_DIR metrics` over a real LMDB run: the table, the CSV, and every
disagreement between the store and the metrics file named."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from pipeline.metric_sinks import scalars
from pipeline.metrics import AFTER_COMMIT
from pipeline.replay import main
from pipeline.replay_metrics import compare_metrics
from pipeline.run.cli import main as launch
from storage import LmdbStore


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replay-metrics") / "run"
    code = launch([
        "--rollout-data-transport", "lmdb", "--num-rollout", "3", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "32", "--output-dir", str(out),
        "--no-progress", "--log-level", "warning", "--use-tensorboard", "--use-wandb", "--wandb-mode", "offline",
    ])  # fmt: skip
    assert code == 0
    return out


def _replay(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*argv])
    out, err = capsys.readouterr()
    return code, out, err


def _lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_clean_run_agrees_and_the_csv_has_every_field_of_every_step(run_dir, capsys, tmp_path):
    data = run_dir / "rollout_data" / "data.mdb"
    before = hashlib.sha256(data.read_bytes()).hexdigest()
    code, out, _ = _replay(capsys, str(run_dir), "metrics", "--csv", str(tmp_path / "m.csv"))
    assert code == 0, out
    assert "the metrics file and the store agree: 3 steps, trained step 2" in out
    assert hashlib.sha256(data.read_bytes()).hexdigest() == before  # replay never writes
    records = _lines(run_dir)
    with (tmp_path / "m.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2] and {r["source"] for r in rows} == {"both"}
    for record, row in zip(records, rows, strict=True):
        assert set(record) <= set(row)
        for key, value in record.items():
            assert row[key] == ("" if value is None else str(value)), key
    # The printed table: one line per step, the reward as the file has it.
    table = out.splitlines()
    assert table[1].split()[:3] == ["step", "version", "rollout/raw_reward"]
    assert [line.split()[0] for line in table[2:5]] == ["0", "1", "2"]
    assert f"{records[1]['rollout/raw_reward']:.4g}" in table[3]


def test_the_dashboards_have_every_metric_of_the_file_by_name_and_step(run_dir):
    """The launcher's --use-tensorboard and --use-wandb (offline: no network) get the file's records."""
    from tests.test_metrics import _tensorboard_scalars, _wandb_history

    records = _lines(run_dir)
    expected = {(k, r["step"]): float(v) for r in records for k, v in scalars(r).items()}
    tensorboard = _tensorboard_scalars(run_dir / "tensorboard")
    assert tensorboard.keys() == expected.keys()
    assert all(tensorboard[k] == pytest.approx(v, rel=1e-6, abs=1e-12) for k, v in expected.items())
    history = _wandb_history(run_dir)
    wandb = {(k, step): v for step, row in history.items() for k, v in row.items() if not k.startswith("_")}
    assert wandb == expected


def test_every_disagreement_is_named(run_dir, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("model", "weights", "logs"))
    records = _lines(run)
    records[0]["rollout/raw_reward"] = 0.5  # a value the store does not have
    lines = [
        json.dumps(records[0]),
        json.dumps(records[2]),
        json.dumps(records[2]),  # step 1 gone, 2 twice
        json.dumps({**records[2], "step": 9}),
        '{"step": 3, "rew',
    ]  # a phantom step, a torn line
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, out, _ = _replay(capsys, str(run), "metrics", "--csv", str(tmp_path / "m.csv"))
    assert code == 0
    with LmdbStore(run / "rollout_data", readonly=True) as store:
        stored_reward = store.step_metrics()[0]["rollout/raw_reward"]
    for expected in (
        "disagree in 5 place(s)",
        "line 5 of the metrics file is not JSON",
        "step 2: a second record in the metrics file (line 3)",
        f"step 0: rollout/raw_reward is 0.5 in the metrics file, {stored_reward!r} in the store",
        "step 1: in the store, not in the metrics file",
        "step 9: in the metrics file, but the store has not trained it (trained step 2)",
    ):
        assert expected in out, out
    with (tmp_path / "m.csv").open() as f:
        sources = {int(r["step"]): r["source"] for r in csv.DictReader(f)}
    assert sources == {0: "both", 1: "store", 2: "both", 9: "file"}


def test_fields_measured_after_the_commit_are_not_a_disagreement():
    stored = {0: {"step": 0, "reward/mean": 0.25}}
    line = json.dumps({"step": 0, "reward/mean": 0.25, **dict.fromkeys(AFTER_COMMIT, 0.1)}).encode()
    assert compare_metrics([line], stored, trained_step=0).disagreements == ()
    other = json.dumps({"step": 0, "reward/mean": 0.25, "time/other": 1.0}).encode()
    assert compare_metrics([other], stored, trained_step=0).disagreements == (
        "step 0: time/other is 1.0 in the metrics file, '<absent>' in the store",
    )


def test_a_run_without_a_store_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    code, _, err = _replay(capsys, str(tmp_path), "metrics")
    assert code == 1 and "has no rollout store" in err and "--rollout-data-transport memory" in err


# Keys that are distinct concepts yet carry the same values in a short sync run like this one:
# a new pair equal on every step is an alias (one concept under two names, issue 45) unless it
# is added here with the reason it is not.
_EQUAL_HERE = {
    frozenset({"step", "version"}),  # sync: one publish per step
    frozenset({"step", "train/versions/newest"}),  # the trained tokens' newest version
    frozenset({"version", "train/versions/newest"}),
    frozenset({"train/versions/oldest", "train/versions/newest"}),  # sync: one version per batch
    frozenset({"step", "train/versions/oldest"}),
    frozenset({"version", "train/versions/oldest"}),
    frozenset({"batch/tokens", "train/tokens"}),  # every response token trained (no mask hit)
    frozenset({"perf/tokens_per_sec", "perf/effective_tokens_per_sec"}),  # the same, per second
    frozenset({"train/loss", "train/pg_loss"}),  # no KL or entropy term in the loss
    frozenset({"train/step_kl_max", "train/step_kl_proposed_max"}),  # no step was halved
    frozenset({"train/is_weight_mean", "train/tis"}),  # raw and applied IS weights: none clipped or masked
}


def test_no_two_keys_of_a_step_record_carry_the_same_values(run_dir):
    """One name per concept: no two keys of the record that change from step to step are equal on
    every step, except the pairs above. Counters that stay at 0-3 over three steps coincide by
    chance and are left out; a constant says nothing."""
    records = _lines(run_dir)
    series: dict[str, tuple[float, ...]] = {}
    for key in records[0]:
        values = tuple(r.get(key) for r in records)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            series[key] = tuple(float(v) for v in values)
    telling = {k: v for k, v in series.items() if len(set(v)) > 1 and any(x != int(x) or abs(x) > 3 for x in v)}
    names = sorted(telling)
    aliases = [
        (a, b)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if telling[a] == telling[b] and frozenset({a, b}) not in _EQUAL_HERE
    ]
    assert not aliases, f"the same values under two names (keep one; docs/metrics.md lists the renames): {aliases}"
