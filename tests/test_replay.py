"""`python -m pipeline.replay`: summary, group and train over a real lmdb run, never changing it.

One real run (built-in engine, real trainer, real LMDB store) is made once for the module; a small
hand-built store checks the summary's numbers exactly (partial prefixes, staleness, open batches).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from core.errors import IncompatibleStoreError, PipelineError
from core.types import FinishReason, Group, PromptTask, Sample, SampleStatus, VersionSpan
from pipeline.replay import main, parse_steps
from pipeline.replay_report import summarize
from storage import Cursor, GroupState, LmdbStore
from tests.conftest import small_lmdb_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replay") / "run"
    # A checkpoint per step, every one kept: `train --weights` starts from any. Over-sampling
    # leaves partial groups to resume.
    flags = ("--partial-rollout", "--save-interval", "1", "--save-keep-last", "0", "--over-sampling-batch-size", "4")
    assert small_lmdb_run(out, *flags, steps=3) == 0
    return out


def _digest(store_dir: Path) -> str:
    return hashlib.sha256((store_dir / "data.mdb").read_bytes()).hexdigest()


@contextmanager
def unchanged(store_dir: Path):
    """Asserts that the store's data file has exactly the same bytes after the block."""
    before = _digest(store_dir)
    yield
    assert _digest(store_dir) == before, f"replay changed {store_dir / 'data.mdb'}"


def replay(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- the real run -------------------------------------------------------------------------------


def test_summary_reports_the_store_as_it_is(run_dir, capsys):
    store_dir = run_dir / "rollout_data"
    with LmdbStore(store_dir, readonly=True) as store:
        counts = {s: store.count(s) for s in GroupState}
        cursor, trained = store.cursor(), store.trained_step()
        expected = summarize(store, store_path=str(store_dir))
    with unchanged(store_dir):
        code, out, _ = replay(capsys, str(run_dir))  # summary is the default
        assert (code, out) == replay(capsys, str(run_dir), "summary")[:2]
    assert code == 0
    assert trained == 2 and f"trained step: {trained}" in out
    assert f"cursor: epoch={cursor.epoch} index={cursor.index} next_seq={cursor.next_seq}" in out
    assert f"groups: {sum(counts.values())} in all" in out
    for state, n in counts.items():
        assert f"  {state.value:<9} {n}\n" in out + "\n"
    assert "n_samples_per_prompt=4" in out and "partial_rollout=True" in out
    # 3 trained steps of 2 groups each; every token of every stored sample has a version
    assert sum(expected.staleness.values()) == 6
    assert sum(expected.admitted_versions.values()) == sum(counts.values())
    assert sum(expected.token_versions.values()) > 0
    assert f"partial groups: {expected.partial_groups}" in out


def test_group_shows_every_sample_with_decoded_text(run_dir, capsys):
    from transformers import AutoTokenizer

    store_dir = run_dir / "rollout_data"
    with LmdbStore(store_dir, readonly=True) as store:
        group = store.batch(1).groups[0]
        state, _ = store.get(group.group_id)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    with unchanged(store_dir):
        code, text, _ = replay(capsys, str(run_dir), "group", group.group_id)
        assert code == 0
        code, raw, _ = replay(capsys, str(run_dir), "group", group.group_id, "--json")
    assert code == 0
    assert text.startswith(f"group {group.group_id}: {state.value}")
    assert repr(tokenizer.decode(list(group.task.prompt_ids))) in text
    record = json.loads(raw)
    assert record["state"] == state.value == "trained"
    assert record["prompt_text"] == tokenizer.decode(list(group.task.prompt_ids))
    assert len(record["samples"]) == len(group.samples) == 4
    for shown, sample in zip(record["samples"], group.samples, strict=True):
        assert shown["status"] == sample.status.value
        assert shown["finish_reason"] == sample.finish_reason.value
        assert shown["reward"] == sample.reward
        assert shown["response_len"] == sample.response_len
        assert shown["spans"] == [[s.start, s.end, s.version] for s in sample.spans]
        assert shown["resumed_at"] == list(sample.resumed_at)
        assert shown["response_text"] == tokenizer.decode(list(sample.response_ids))
        assert f"sample {sample.index}: {sample.status.value}" in text


def test_an_unknown_group_is_named_in_the_error(run_dir, capsys):
    with unchanged(run_dir / "rollout_data"):
        code, out, err = replay(capsys, str(run_dir), "group", "e0000-p999999999")
    assert code == 1 and out == ""
    assert "'e0000-p999999999'" in err and str(run_dir / "rollout_data") in err


def test_train_replay_is_deterministic_and_reproduces_the_run(run_dir, capsys):
    with unchanged(run_dir / "rollout_data"):
        code, first, _ = replay(capsys, str(run_dir), "train")
        assert code == 0
        code, second, _ = replay(capsys, str(run_dir), "train")
    assert code == 0
    assert first == second
    replayed = [json.loads(line) for line in first.splitlines()]
    assert [r["step"] for r in replayed] == [0, 1, 2]
    assert all(r["groups"] == 2 for r in replayed)
    # Same base model, same batches, same seed and settings: the run's own trainer metrics, exactly.
    recorded = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r, m in zip(replayed, recorded, strict=True):
        assert r["step"] == m["step"]
        for key in ("loss", "grad_norm", "tokens", "train_rollout_logprob_abs_diff"):
            assert r[key] == pytest.approx(m[f"train/{key}"], rel=1e-6, abs=1e-9), key
        assert r["reward_mean"] == pytest.approx(m["rollout/raw_reward"])  # the trainer's own copy of it


def test_train_a_step_range_from_saved_weights(run_dir, capsys):
    with unchanged(run_dir / "rollout_data"):
        code, out, _ = replay(
            capsys, str(run_dir), "train", "--steps", "2:3", "--weights", str(run_dir / "checkpoints" / "v2")
        )
    assert code == 0
    [record] = [json.loads(line) for line in out.splitlines()]
    assert record["step"] == 2
    # The loss and gradient come before the optimizer step, so a fresh optimizer does not change them.
    recorded = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2]
    assert record["loss"] == pytest.approx(recorded["train/loss"], rel=1e-6)
    code, _, err = replay(capsys, str(run_dir), "train", "--steps", "2:9")
    assert code == 1 and "[3, 4, 5, 6, 7, 8]" in err and str(run_dir / "rollout_data") in err


def test_missing_and_memory_runs_are_named(tmp_path, capsys):
    code, _, err = replay(capsys, str(tmp_path / "nowhere"))
    assert code == 1 and str(tmp_path / "nowhere") in err
    # What a memory-transport run leaves: outputs, but no store.
    memory_run = tmp_path / "memory-run"
    memory_run.mkdir()
    (memory_run / "metrics.jsonl").write_text("")
    for command in ([], ["group", "e0000-p000000000"], ["train"]):
        code, _, err = replay(capsys, str(memory_run), *command)
        assert code == 1
        assert str(memory_run / "rollout_data") in err and "memory" in err


def _foreign_lmdb(path: Path) -> Path:
    """An LMDB directory another program wrote: a plain key and a database of its own."""
    import lmdb

    path.mkdir(parents=True)
    env = lmdb.open(str(path), max_dbs=2)
    theirs = env.open_db(b"theirs")
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
        txn.put(b"k", b"v", db=theirs)
    env.close()
    (path / "lock.mdb").unlink()
    return path


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", [[], ["verify"], ["group", "e0000-p000000000"], ["train"], ["metrics"]])
def test_a_foreign_lmdb_directory_is_named_and_left_as_it_was(tmp_path, capsys, command):
    run = tmp_path / "run"
    _foreign_lmdb(run / "rollout_data")
    before = _listing(tmp_path)
    code, out, err = replay(capsys, str(run), *command)
    assert code == 1 and "not a rollout store" in err and "['hello', 'theirs']" in err, (out, err)
    assert _listing(tmp_path) == before  # not even LMDB's lock file


def test_a_writer_refuses_a_foreign_lmdb_directory_and_leaves_its_data(tmp_path):
    path = _foreign_lmdb(tmp_path / "theirs")
    data = (path / "data.mdb").read_bytes()
    with pytest.raises(IncompatibleStoreError, match="is not a rollout store: it holds \\['hello', 'theirs'\\]"):
        LmdbStore(path)
    assert (path / "data.mdb").read_bytes() == data


def test_parse_steps():
    assert parse_steps(None, 4) == range(0, 5)
    assert parse_steps("1:3", 4) == range(1, 3)
    assert parse_steps(":2", 4) == range(0, 2)
    assert parse_steps("3:", 4) == range(3, 5)
    for bad in ("3", "2:2", "-1:2", "a:b"):
        with pytest.raises(PipelineError, match=re.escape(repr(bad))):
            parse_steps(bad, 4)


# --- a hand-built store: exact numbers ----------------------------------------------------------


def _sample(i: int, spans: list[tuple[int, int, int]], status: SampleStatus, *, resumed=()) -> Sample:
    n = spans[-1][1] if spans else 0
    return Sample(
        index=i,
        prompt_ids=(1, 2),
        response_ids=(5,) * n,
        logprobs=(-0.5,) * n,
        loss_mask=(1,) * n,
        spans=tuple(VersionSpan(*s) for s in spans),
        status=status,
        resumed_at=resumed,
        finish_reason={SampleStatus.COMPLETED: FinishReason.STOP, SampleStatus.PARTIAL: FinishReason.ABORT}.get(status),
        reward=1.0 if status.finished else None,
    )


def _group(index: int, version: int, samples: list[Sample]) -> Group:
    task = PromptTask(index=index, prompt_ids=(1, 2))
    return Group(f"e0000-p{index:09d}", task, 0, tuple(samples), admitted_version=version, seq=index)


def _build_store(path: Path) -> None:
    """Three ready groups (one with a resumed, two-version sample) and one partial group; steps 0
    and 1 trained, step 2 taken but not finished."""
    done = SampleStatus.COMPLETED
    ready = [
        _group(0, 0, [_sample(0, [(0, 3, 0)], done), _sample(1, [(0, 2, 0), (2, 4, 1)], done, resumed=(2,))]),
        _group(1, 0, [_sample(0, [(0, 1, 0)], done), _sample(1, [(0, 2, 0)], done)]),
        _group(2, 1, [_sample(0, [(0, 2, 2)], done), _sample(1, [(0, 2, 2)], done)]),
    ]
    partial = _group(3, 2, [_sample(0, [(0, 5, 2)], done), _sample(1, [], SampleStatus.PARTIAL)])
    with LmdbStore(path, sync=False) as store:
        store.admit([*ready, partial], Cursor(index=4, next_seq=4))
        for g in ready:
            store.put_ready(g)
        store.put_partial(partial)
        assert store.take_batch(0, 1).groups[0].group_id == ready[0].group_id
        store.finish_batch(0)
        store.take_batch(1, 1)
        store.finish_batch(1)
        store.take_batch(2, 1)  # taken, never finished


def test_summary_numbers_on_a_hand_built_store(tmp_path, capsys):
    _build_store(tmp_path / "rollout_data")
    with unchanged(tmp_path / "rollout_data"):
        with LmdbStore(tmp_path / "rollout_data", readonly=True) as store:
            s = summarize(store, store_path=store.path)
        # py-lmdb opens an environment once per process: replay opens its own after the one above closed
        code, out, err = replay(capsys, str(tmp_path))
    assert s.trained_step == 1 and s.open_batches == (2,)
    assert s.counts[GroupState.TRAINED] == 2 and s.counts[GroupState.BATCHED] == 1
    assert s.counts[GroupState.PARTIAL] == 1
    assert s.admitted_versions == {0: 2, 1: 1, 2: 1}
    assert s.token_versions == {0: 8, 1: 2, 2: 9}
    # step 0 trained group 0 (oldest v0) -> 0; step 1 trained group 1 (oldest v0) -> 1; step 2 is open
    assert s.staleness == {0: 1, 1: 1}
    assert (s.partial_groups, s.partial_samples, s.partial_finished_samples) == (1, 2, 1)
    assert s.partial_prefix_lens == {0: 1, 5: 1}
    assert s.resumed_samples == 1
    assert code == 0, err
    assert "batches taken, not trained: steps 2" in out
    assert "prefix lengths (tokens: samples) 0: 1  5: 1" in out
    assert "response tokens (version: tokens)  v0: 8  v1: 2  v2: 9" in out


def test_a_run_whose_store_is_elsewhere_is_found_through_its_run_record(tmp_path, capsys):
    """`--rollout-data-dir` outside the run folder: `run.json` records the store's absolute path, and
    replay follows it (issue 46: `verify` said the run was a memory run)."""
    from pipeline.config import load_config
    from pipeline.run.folder import check_run_folder

    run, elsewhere = tmp_path / "run", tmp_path / "disk" / "store"
    flags = ["--output-dir", str(run), "--rollout-data-transport", "lmdb", "--rollout-data-dir", str(elsewhere)]
    config = load_config(flags)
    check_run_folder(config).take(config)  # what the launcher writes once the run owns its folder
    _build_store(elsewhere)
    with unchanged(elsewhere):
        code, out, err = replay(capsys, str(run), "verify")
        assert code == 0, err
        assert f"store: {elsewhere}" in out and "nothing damaged" in out
        code, out, err = replay(capsys, str(run))
        assert code == 0 and "trained step: 1" in out, err
    # Moved since: the error names where run.json says the store is, and the way to give its folder.
    elsewhere.rename(tmp_path / "moved")
    code, _, err = replay(capsys, str(run), "verify")
    assert code == 1 and str(elsewhere) in err and "STORE_DIR" in err and "memory" not in err
    code, out, _ = replay(capsys, str(tmp_path / "moved"), "verify")
    assert code == 0 and "nothing damaged" in out


def test_replay_reads_a_store_while_its_writer_holds_it(tmp_path, capsys):
    """Read-only means no writer lock: replay works beside a live controller (here, another process
    holding the store open as its writer), and cannot be mistaken for a second writer."""
    _build_store(tmp_path / "rollout_data")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from storage import LmdbStore; s = LmdbStore(sys.argv[1]); "
            "print('open', flush=True); sys.stdin.read(); s.close()",
            str(tmp_path / "rollout_data"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        code, out, err = replay(capsys, str(tmp_path))
        assert code == 0, err
        assert "trained step: 1" in out
        code, out, err = replay(capsys, str(tmp_path), "group", "e0000-p000000003", "--json")
        assert code == 0, err
        assert json.loads(out)["state"] == "partial"
    finally:
        holder.communicate(timeout=30)
    assert holder.returncode == 0


# --- timeline -----------------------------------------------------------------------------------


def test_timeline_draws_the_runs_event_log(run_dir, tmp_path, capsys):
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["kind"] for e in events} >= {"request", "train", "publish"}
    with unchanged(run_dir / "rollout_data"):
        code, out, err = replay(capsys, str(run_dir), "timeline")
    assert code == 0, err
    written = run_dir / "timeline.html"
    assert out.strip() == f"timeline written to {written}"
    page = written.read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page
    requests = sum(e["kind"] == "request" for e in events)
    assert f"{requests} requests on " in page
    code, out, _ = replay(capsys, str(run_dir / "rollout_data"), "timeline", "-o", str(tmp_path / "t.html"))
    assert code == 0 and str(tmp_path / "t.html") in out
    assert (tmp_path / "t.html").read_text() == page


def test_timeline_without_an_event_log_is_named(tmp_path, capsys):
    code, out, err = replay(capsys, str(tmp_path), "timeline")
    assert code == 1 and out == ""
    assert str(tmp_path / "events.jsonl") in err
    assert not (tmp_path / "timeline.html").exists()


# --- garbage collection -------------------------------------------------------------------------


def test_gc_keeps_the_last_steps_and_replay_still_reads_the_rest(tmp_path, capsys):
    out = tmp_path / "run"
    gc = ("--save-interval", "1", "--save-keep-last", "0", "--rollout-gc-keep-steps", "2")
    assert small_lmdb_run(out, *gc, steps=6) == 0
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        stats = store.statistics()
        assert stats.trained_step == 5
        assert stats.counts[GroupState.TRAINED] == 2 * 2  # the groups of steps 4 and 5 only
        assert (stats.collected, stats.collected_step) == (4 * 2, 3)
        assert [s for s in range(6) if store.batch(s) is not None] == [4, 5]
        kept = {g.group_id for s in (4, 5) for g in store.batch(s).groups}
        assert {g.group_id for g in store.groups(GroupState.TRAINED)} == kept
        expected = summarize(store, store_path=store.path)
    assert sum(expected.staleness.values()) == 4  # the kept batches
    code, text, err = replay(capsys, str(out))
    assert code == 0, err
    assert "trained step: 5" in text and "garbage collected: 8 trained groups and the batches of steps 0..3" in text
    code, text, err = replay(capsys, str(out), "train", "--weights", str(out / "checkpoints" / "v4"))
    assert code == 0, err
    assert [json.loads(line)["step"] for line in text.splitlines()] == [4, 5]


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    # `python -m pipeline.replay RUN summary | head -3`: head exits before replay writes its output.
    _build_store(tmp_path / "rollout_data")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.replay", str(tmp_path), "summary"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err, err  # 141: as if killed by SIGPIPE


def test_train_replays_each_step_at_the_version_it_was_trained_at(tmp_path):
    # Async mode with --mask-stale-tokens 0: step 1 was trained at version 1 and every token of its
    # batch is from version 0, so the run trained none of them. The replay must agree; it used to
    # take the batch's newest token (0) as the trained version and train them all.
    from pipeline.replay import replay_training
    from pipeline.tasks.tiny_model import make_model_folder
    from storage import RunMeta

    model = make_model_folder(tmp_path / "model", hidden_size=32, num_layers=2, seed=0)
    done = SampleStatus.COMPLETED
    groups = [_group(i, 0, [_sample(0, [(0, 3, 0)], done), _sample(1, [(0, 2, 0)], done)]) for i in (0, 1)]
    config = {"trainer": {"mask_stale_tokens": 0}}
    with LmdbStore(tmp_path / "rollout_data", sync=False) as store:
        store.write_meta(RunMeta("r", "d", "t", 2, extra={"config": config}))
        store.admit(groups, Cursor(index=2, next_seq=2))
        for step, group in enumerate(groups):
            store.put_ready(group)
            store.take_batch(step, 1)
            store.finish_batch(step, {"step": step, "version": step})
    with LmdbStore(tmp_path / "rollout_data", readonly=True) as store:
        first, second = replay_training(store, model, range(0, 2), seed=0)
    assert first["mask_ratio"] == 1.0  # trained at version 0: its tokens are fresh
    assert second["mask_ratio"] == 0.0
