"""A large store resumes and verifies at its size (issue 49): a resume reads what it trains again,
not the store; `replay verify` streams with its progress said; the benchmark that builds one
through the real store API, at a tiny size."""

from __future__ import annotations

import argparse
import io

import pytest
from structlog.testing import capture_logs

from benchmarks import store_at_size as bench
from core.types import Group, PromptTask
from pipeline.checkpoints import CheckpointPolicy
from pipeline.replay import main as replay
from pipeline.replay import verify_progress
from pipeline.run.state import open_for_resume
from storage import GroupState, LmdbStore, RunMeta, codec, lmdb_checksums
from tests.conftest import flip_a_stored_group_bit

BATCH = 3


def _args(tmp_path, **changes) -> argparse.Namespace:
    argv = ["--size-gb", "0.004", "--batch", str(BATCH), "--group", "2", "--length-limit", "256"]
    argv += ["--shape", "6x4/128", "--prompt-len", "8", "--no-sync", "--dir", str(tmp_path)]
    args = bench.parser().parse_args(argv)
    vars(args).update(changes)
    return args


def _meta(args: argparse.Namespace) -> RunMeta:
    return RunMeta(run_id="r", dataset_fingerprint="d", tokenizer_fingerprint="t", n_samples_per_prompt=args.group)


@pytest.fixture
def built(tmp_path):
    """A store as a crash leaves it: steps trained, one batch taken, groups ready and running."""
    args = _args(tmp_path)
    path = tmp_path / "run" / "rollout_data"
    done = bench.build(path, args, _meta(args))
    assert done["trained steps"] >= 5
    return path, args, done["trained steps"] - 1


def _checkpoint(tmp_path, version: int) -> CheckpointPolicy:
    folder = tmp_path / "checkpoints" / f"v{version}"
    (folder / "optimizer").mkdir(parents=True)
    (folder / "config.json").write_bytes(b"{}")
    return CheckpointPolicy(tmp_path / "checkpoints", tmp_path / "publish")


def _fresh(group_id: str) -> Group:
    """A group as the launcher's dataset would make it again for `group_id` (e0000-pNNN...)."""
    index = int(group_id.split("-p")[1].split(".")[0])
    return Group.fresh(PromptTask(index=index, prompt_ids=(1, 2, 3)), epoch=0, n_samples=2, version=0, seq=index)


def test_a_resume_checks_the_groups_it_trains_again_not_the_store(built, tmp_path, monkeypatch):
    path, args, trained = built
    with LmdbStore(path, readonly=True) as store:
        old = store.batch(1).groups[0].group_id  # trained before the checkpoint
        again = [g.group_id for g in store.batch(trained).groups]  # trained after it: trained again
        servable = {
            g.group_id for s in (GroupState.RUNNING, GroupState.READY, GroupState.BATCHED) for g in store.groups(s)
        }
    recent = again[0]
    flip_a_stored_group_bit(path, old)
    flip_a_stored_group_bit(path, recent)
    decoded: list[int] = []
    checked: list[str] = []
    real_decode, real_check = codec.decode_group, lmdb_checksums.sealed_payload

    def counting(data, **kw):
        decoded.append(1)
        return real_decode(data, **kw)

    def checking(key, value, **kw):
        checked.append(bytes(key).decode())
        return real_check(key, value, **kw)

    monkeypatch.setattr(codec, "decode_group", counting)
    monkeypatch.setattr(lmdb_checksums, "sealed_payload", checking)
    policy = _checkpoint(tmp_path, trained)  # v{trained}: step `trained` is trained again
    regenerated = "prompts generated again after damage"
    with capture_logs() as logs:
        store = open_for_resume(path, {"sync": False}, _meta(args), policy, _fresh)
    try:
        # The groups of the one step since the checkpoint and the work in flight, by their
        # checksums, none decoded; nothing of the steps before: a resume's reads do not grow
        # with the store.
        assert not decoded and set(again) <= set(checked) and set(checked) <= set(again) | servable
        assert old not in checked
        said = [e for e in logs if regenerated in e["event"]]
        named = " ".join(said[0]["ids"]) if len(said) == 1 else ""
        assert recent in named and old not in named, said  # named as the id it is generated again under
        assert store.count(GroupState.READY) == 2 * BATCH  # the open batch back, and the ready ones
        assert store.count(GroupState.PARTIAL) == BATCH + 1  # the running ones, and the one generated again
    finally:
        store.close()
    checked.clear()
    with capture_logs() as logs:  # said once; the next resume reads the same step again, nothing older
        open_for_resume(path, {"sync": False}, _meta(args), policy, _fresh).close()
    assert set(again) <= set(checked) and old not in checked and not decoded
    assert not [e for e in logs if regenerated in e["event"]]


def test_replay_verify_streams_with_its_progress_said_and_names_every_damaged_record(built, capsys):
    path = built[0]
    with LmdbStore(path, readonly=True) as store:
        victim = store.batch(1).groups[0].group_id
    assert replay([str(path.parent), "verify"]) == 0
    out, err = capsys.readouterr()
    assert "nothing damaged" in out
    [line] = [x for x in err.splitlines() if x.startswith("verify:")]  # not a terminal: one plain line at the end
    assert "MB read (done) in" in line and "MB/s" in line, line
    flip_a_stored_group_bit(path, victim)
    assert replay([str(path.parent), "verify"]) == 1
    assert victim in capsys.readouterr().out


def test_the_progress_is_plain_lines_off_a_terminal_with_the_rate():
    stream = io.StringIO()
    with verify_progress(2_000_000_000, stream, every=0.0) as progress:
        progress(500_000_000)
        progress(500_000_000)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("verify: 500 MB read of about 2,000 MB (25%)")
    assert len(lines) == 3 and lines[-1].startswith("verify: 1,000 MB read (done) in")
    assert all("MB/s" in line for line in lines) and "\r" not in stream.getvalue()


def test_the_benchmark_builds_resumes_and_verifies_a_store_and_prints_its_figures(tmp_path, capsys):
    out = bench.main(_args(tmp_path))
    assert out["store GB"] >= 0.004 and out["resume s"] > 0 and out["replayed groups"] == 2 * BATCH
    assert out["verify MB/s"] > 0 and out["verify progress lines"] >= 1 and out["verify RSS anon MB"] > 0
    printed = capsys.readouterr().out
    assert "the 10 s goal" in printed and "of the disk's sequential read" in printed
    assert not any(p.name.startswith("store-at-size-") for p in tmp_path.iterdir())  # deleted without --keep


def test_under_collection_what_the_store_holds_stays_flat_and_the_sizes_print(tmp_path, capsys):
    out = bench.main(_args(tmp_path, steady_steps=40, gc_keep_steps=2))
    held = [live for _, _, live in out["sizes"]]
    assert len(held) == 40 and min(held) > 0
    # Collection keeps 2 steps: what the trees hold late is what they held early on, not 4x it.
    assert max(held[20:]) <= 2 * max(held[4:12])
    assert "steady state over 40 steps" in capsys.readouterr().out
