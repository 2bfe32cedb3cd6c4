"""The metrics file agrees with the store after any crash, and the dashboards get the same record.

`restore_metrics_file` is tested on files as a crash leaves them; the sinks write real TensorBoard
event files and a real offline W&B run (no network), read back here.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from pipeline.metric_sinks import SinkSettings, TensorBoardSink, WandbSink, open_step_sinks, scalars
from pipeline.metrics import MetricsSink, eval_record, is_eval_record, restore_metrics_file


def _record(step: int, **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "version": step,
        "reward/mean": 0.1 * step,
        "batch/tokens": 100 + step,
        "staleness/mean": math.nan,
        **extra,
    }


def _stored(step: int) -> dict[str, Any]:
    """A record as the store gives it back (JSON: NaN is null)."""
    return orjson.loads(orjson.dumps(_record(step)))


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def _line(step: int, **extra: Any) -> bytes:
    return orjson.dumps(_record(step, **extra))


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_record_lost_between_commit_and_append_is_written_back_from_the_store(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [_line(0, **{"time/publish_update": 0.5}), _line(1)])
    stored = {s: _stored(s) for s in range(3)}
    restored = restore_metrics_file(path, trained_step=2, stored=stored)
    assert restored.rebuilt == (2,) and restored.kept == 2 and not restored.dropped and not restored.missing
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["time/publish_update"] == 0.5  # a kept line keeps its after-commit fields
    assert records[2] == stored[2]
    assert not path.with_name("metrics.jsonl.dropped").exists()


def test_duplicates_phantoms_and_torn_lines_are_moved_aside_not_deleted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [_line(0), _line(0), _line(1, **{"reward/mean": 7.0}), _line(2), _line(3), b'{"step": 4, "rew']
    _write(path, lines)
    stored = {s: _stored(s) for s in range(3)}
    restored = restore_metrics_file(path, trained_step=2, stored=stored)
    assert _steps(path) == [0, 1, 2]
    # Step 1's line disagrees with the store: the store's record wins, the line is kept aside.
    assert json.loads(path.read_text().splitlines()[1]) == stored[1]
    assert restored.rebuilt == (1,)
    aside = path.with_name("metrics.jsonl.dropped").read_bytes().splitlines()
    assert aside == [lines[1], lines[2], lines[4], lines[5]]
    reasons = " | ".join(restored.dropped)
    for expected in (
        "line 2: a second record of step 0",
        "line 3: step 1 differs from the store's record in ['reward/mean']",
        "line 5: step 3 is not trained in the store (trained step 2)",
        "line 6: not JSON",
    ):
        assert expected in reasons, reasons


def test_a_file_that_agrees_with_the_store_is_left_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [_line(0), _line(1)])
    before = path.stat()
    restored = restore_metrics_file(path, trained_step=1, stored={s: _stored(s) for s in range(2)})
    assert not restored.changed
    after = path.stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_with_no_stored_records_trained_lines_stay_and_gaps_are_reported(tmp_path):
    """A store from before records (or steps finished without one): keep what the file has."""
    path = tmp_path / "metrics.jsonl"
    _write(path, [_line(0), _line(2)])
    restored = restore_metrics_file(path, trained_step=2, stored={})
    assert _steps(path) == [0, 2] and restored.missing == (1,)


def test_evaluations_own_lines_are_kept_in_place_and_never_judged_as_steps(tmp_path):
    """`python -m pipeline.eval` and the evaluation before training write lines of their own
    (`eval_record`); a resume keeps them, each before the step its weights went on to train,
    except one of weights the store has not trained (a step lost in a crash made them)."""
    path = tmp_path / "metrics.jsonl"
    start = orjson.dumps(eval_record(0, {"eval/toy": 0.1}))  # the starting weights: step 0
    after_1 = orjson.dumps(eval_record(2, {"eval/toy": 0.3}))  # the weights step 1 made
    untrained = orjson.dumps(eval_record(4, {"eval/toy": 0.9}))
    _write(path, [start, _line(0), _line(1), untrained, after_1])  # appended beside the run, late
    sink = MetricsSink(path)
    sink.write_eval(eval_record(1, {"eval/toy": 0.2}))
    sink.close()
    assert sink.records == []  # the steps' records only (the summary reads them)
    restored = restore_metrics_file(path, trained_step=2, stored={s: _stored(s) for s in range(3)})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["version"], is_eval_record(r)) for r in records] == [
        (0, 0, True),
        (0, 0, False),
        (0, 1, True),
        (1, 1, False),
        (1, 2, True),
        (2, 2, False),
    ]
    assert restored.rebuilt == (2,) and len(restored.dropped) == 1
    assert "an evaluation of version 4: weights not trained (trained step 2)" in restored.dropped[0]
    assert path.with_name("metrics.jsonl.dropped").read_bytes().splitlines() == [untrained]


def test_a_memory_store_restart_moves_the_earlier_life_aside(tmp_path):
    """Nothing survives with the memory store: the rerun starts at step 0, its file too."""
    path = tmp_path / "metrics.jsonl"
    _write(path, [_line(0), _line(1)])
    restored = restore_metrics_file(path, trained_step=-1, stored={})
    assert path.read_bytes() == b"" and len(restored.dropped) == 2
    assert len(path.with_name("metrics.jsonl.dropped").read_bytes().splitlines()) == 2


class _Exploding:
    name = "exploding"

    def __init__(self) -> None:
        self.calls = 0

    def write(self, record: Any) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        raise AssertionError("a sink switched off is not closed again")


class _Keeping:
    name = "keeping"

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.closed = False

    def write(self, record: Any) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        self.closed = True


def test_a_sink_that_fails_is_one_warning_and_the_others_go_on(tmp_path):
    warnings: list[str] = []
    bad, good = _Exploding(), _Keeping()
    sink = MetricsSink(tmp_path / "metrics.jsonl", [bad, good], warn=warnings.append)
    for step in range(3):
        sink.write(_record(step))
    sink.close()
    assert bad.calls == 1 and [r["step"] for r in good.records] == [0, 1, 2] and good.closed
    assert len(warnings) == 1
    assert "'exploding'" in warnings[0] and "No space left on device" in warnings[0]
    assert sink.failed == {"exploding": "OSError: [Errno 28] No space left on device"}
    assert _steps(tmp_path / "metrics.jsonl") == [0, 1, 2]


@pytest.mark.parametrize("blocked", [("wandb",), ("tensorboardX", "torch.utils.tensorboard")])
def test_a_missing_library_is_one_warning_naming_the_sink(tmp_path, monkeypatch, blocked):
    for module in blocked:
        monkeypatch.setitem(sys.modules, module, None)  # `import` now raises ImportError
    warnings: list[str] = []
    settings = SinkSettings(use_tensorboard=True, use_wandb=True, wandb_mode="offline")
    sinks = open_step_sinks(settings, output_dir=tmp_path, run_id="r", warn=warnings.append)
    name = "wandb" if blocked == ("wandb",) else "tensorboard"
    assert len(warnings) == 1 and f"metrics sink {name!r} is off" in warnings[0]
    assert f"rollout-pipeline[{name}]" in warnings[0]
    assert [s.name for s in sinks] == [n for n in ("tensorboard", "wandb") if n != name]
    for s in sinks:
        s.close()


def _tensorboard_scalars(logdir: Path) -> dict[tuple[str, int], float]:
    """Every scalar of the event files (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for f in logdir.iterdir():
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out[(v.tag, event.step)] = v.simple_value
    return out


def test_tensorboard_gets_every_number_of_the_record_by_name_and_step(tmp_path):
    pytest.importorskip("tensorboardX", reason="the tensorboard extra is not installed")
    sink = TensorBoardSink(tmp_path / "tb")
    records = [orjson.loads(orjson.dumps(_record(s, **{"train/loss": 1.0 / (s + 1)}))) for s in range(3)]
    for r in records:
        sink.write(r)
    sink.close()
    got = _tensorboard_scalars(tmp_path / "tb")
    expected = {(k, r["step"]): v for r in records for k, v in scalars(r).items()}
    assert got.keys() == expected.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in expected.items())
    assert ("staleness/mean", 0) not in got  # null in the file: no number to plot


def _wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The history rows of an offline run, read from its `.wandb` file (LevelDB log framing)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, chunk, rows = path.read_bytes(), 7, b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows[record.history.step.num] = items
    return rows


def test_wandb_offline_logs_every_number_of_the_record_by_name_and_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    sink = WandbSink(project="p", group="g", mode="offline", dir=tmp_path, run_id="run-1")
    records = [orjson.loads(orjson.dumps(_record(s, **{"train/loss": 1.0 / (s + 1)}))) for s in range(3)]
    for r in [*records, records[1]]:  # a replayed older step is skipped, not logged out of order
        sink.write(r)
    sink.close()
    rows = _wandb_history(tmp_path)
    assert sorted(rows) == [0, 1, 2]
    for r in records:
        row = {k: v for k, v in rows[r["step"]].items() if not k.startswith("_")}
        assert row == scalars(r)


def test_wandb_puts_evaluations_on_their_axis_without_losing_a_step(tmp_path, monkeypatch):
    """The starting weights' evaluation comes before step 0: logged as a row of its own, it took
    W&B's step 0 and W&B dropped step 0's record. `python -m pipeline.eval`'s come one after
    another: a row each."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    run, alone = tmp_path / "run", tmp_path / "alone"
    sink = WandbSink(project="p", group=None, mode="offline", dir=run, run_id="run-1")
    sink.write(eval_record(0, {"eval/toy": 0.1}))
    for step in range(3):
        sink.write(_record(step, **({"eval/toy": 0.5} if step == 1 else {})))
    sink.close()
    rows = {step: {k: v for k, v in row.items() if not k.startswith("_")} for step, row in _wandb_history(run).items()}
    assert sorted(rows) == [0, 1, 2] and all(rows[s]["batch/tokens"] == 100 + s for s in range(3))
    assert (rows[0]["eval/toy"], rows[0]["eval/step"]) == (0.1, 0)  # on eval/step 0, beside step 0
    assert (rows[1]["eval/toy"], rows[1]["eval/step"]) == (0.5, 1)  # an inline one: at its step
    sink = WandbSink(project="p", group=None, mode="offline", dir=alone, run_id="run-2")
    for version in (3, 5):
        sink.write(eval_record(version, {"eval/toy": version / 10}))
    sink.close()
    evaluated = [(row["eval/step"], row["eval/toy"]) for _, row in sorted(_wandb_history(alone).items())]
    assert evaluated == [(2, 0.3), (4, 0.5)]
