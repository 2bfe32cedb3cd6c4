"""Kills around checkpoints, replays and collection, on a real `python -m pipeline.launch` run (LMDB,
the built-in engine, the torch trainer on CPU), each followed by a resume that reaches the same end.

The end state checked: every step trained exactly once in the store, the kept checkpoints exactly
`--save-keep-last`, no publish folder left behind, and the final checkpoint's weights bit for bit
those of a fresh trainer that trains the recorded batch sequence (each stored batch, with its
recorded version and minibatch split) in one go: the kills and replays changed nothing.

Why the reference is the recorded sequence and not a second uninterrupted run: the built-in engine
batches concurrent requests, and the last bits of its log-probs depend on which requests share a
forward (float sums in another order), which depends on timing. Two uninterrupted runs already
train on behaviour log-probs that differ around 1e-8 and end with different weights. What a resume
controls, the trainer's side, is exact.

Kill points are polled from outside, as in tests/test_fault_injection.py (whose Launcher and Watch
this reuses): the launcher is another process with no hook for tests.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import config_to_dict, load_config
from pipeline.trainer_settings import build_trainer
from storage import GroupState, LmdbStore
from tests.test_fault_injection import FLAGS, Launcher, Watch

STEPS = 8
KEEP = 2
CKPT = ("--num-rollout", str(STEPS), "--save-interval", "2", "--save-keep-last", str(KEEP))


pytestmark = pytest.mark.usefixtures("restore_torch_threads")


def _trained_at_least(w: Watch, step: int):
    return lambda: w.store is not None and w.store.trained_step() >= step


def _log_says(launcher: Launcher, text: str):
    return lambda: text in launcher.log.read_text(errors="replace")


def _entries(folder: Path, marker: str) -> bool:
    return folder.is_dir() and any(marker in p.name for p in folder.iterdir())


def _checkpoint_saving_or_saved(out: Path, w: Watch):
    """A checkpoint being written (its `.vN.tmp-*` folder) or, if the poll misses that window, a
    new one just saved (maybe not committed yet)."""
    before = set((out / "checkpoints").glob("v*"))
    return lambda: _entries(out / "checkpoints", ".tmp-") or bool(set((out / "checkpoints").glob("v*")) - before)


def _publish_folder_going(out: Path, w: Watch):
    """A publish folder being removed (renamed aside), or the next step committed if that is missed."""
    trained = w.store.trained_step() if w.store is not None else -1
    return lambda: _entries(out / "weights", ".old-") or (w.store is not None and w.store.trained_step() > trained + 1)


def _run_lives(out: Path, points, extra: tuple[str, ...]) -> list[str]:
    watch = Watch(out)
    seen = []
    launcher = None
    try:
        for life, (name, arm) in enumerate(points):
            watch.close()
            launcher = Launcher(out, life, *CKPT, *extra)
            launcher.wait_until("the engine", lambda launcher=launcher: launcher.serving() and watch.store is not None)
            launcher.wait_until(name, arm(watch, launcher))
            launcher.kill()
            seen.append(f"{name}: trained {watch.store.trained_step()}")
        watch.close()
        # What kills inside a save or a removal leave (windows too narrow to hit by polling every time).
        (out / "checkpoints" / f".v{STEPS}.tmp-killed").mkdir(parents=True, exist_ok=True)
        (out / "weights" / ".v3.old-killed" / "folder").mkdir(parents=True, exist_ok=True)
        launcher = Launcher(out, len(points), *CKPT, *extra)
        assert launcher.finish(300) == 0, launcher.log_tail()
        log = "".join((out.parent / f"life-{i}.log").read_text(errors="replace") for i in range(len(points) + 1))
        assert "replaying stored batches" in log  # some life resumed behind the store's trained step
    finally:
        watch.close()
        if launcher is not None and launcher.proc.poll() is None:
            launcher.kill()
    return seen


def _check_end_state(out: Path, extra: tuple[str, ...] = (), *, collected: bool = False) -> None:
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        assert store.trained_step() == STEPS - 1
        assert store.count(GroupState.RUNNING) == 0 and store.count(GroupState.BATCHED) == 0
        cursor = store.cursor()
        ids = [g.group_id for s in GroupState for g in store.groups(s)]
        stats = store.statistics()
        # Every prompt handed out is held once (or was collected after a checkpoint covered it).
        assert len(ids) == len(set(ids)) and len(ids) + stats.collected == cursor.index
        records = store.step_metrics()
        assert sorted(records) == list(range(STEPS))
        if collected:
            assert stats.collected_step == STEPS - 1  # the last checkpoint covers every step
            return
        batches = [store.batch(step) for step in range(STEPS)]
        trained = [g.group_id for b in batches for g in b.groups]  # type: ignore[union-attr]
        assert len(trained) == len(set(trained)) == store.count(GroupState.TRAINED)
        # The reference: a fresh trainer, the recorded batch sequence, in one go.
        # The run's own settings: the loss reads some rollout ones (the response length bound).
        trainer = build_trainer(out / "model", config_to_dict(load_config([*FLAGS, *CKPT, *extra])))
        for step, batch in enumerate(batches):
            assert batch is not None
            record = records[step]
            trainer.train_step(
                dataclasses.replace(batch, train_version=record["version"]),
                minibatch_samples=int(record["train/minibatch_samples"]),
            )
    checkpoints = sorted(int(p.name[1:]) for p in (out / "checkpoints").iterdir())
    assert checkpoints == [STEPS - 2, STEPS], checkpoints  # --save-keep-last 2 of v2, v4, v6, v8
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["owner.json"]  # publish folders gone
    meta = json.loads((out / "checkpoints" / f"v{STEPS}" / "optimizer" / "state.json").read_text())
    assert meta["trainer_steps"] == STEPS  # no batch trained twice into the surviving weights
    saved = load_file(str(out / "checkpoints" / f"v{STEPS}" / "model.safetensors"))
    expected = trainer.model.state_dict()
    different = [k for k in saved if not torch.equal(saved[k], expected[k])]
    assert not different, f"the resumed run's weights differ from the recorded sequence's in {different}"


@pytest.mark.slow
def test_kills_around_checkpoints_and_replays_resume_to_the_recorded_sequences_weights(tmp_path):
    out = tmp_path / "run"
    points = (
        # Step 0 committed, no checkpoint yet: the resume starts from the base model and replays step 0.
        ("before the first checkpoint", lambda w, _: _trained_at_least(w, 0)),
        # The next life replays step 0 (and maybe 1): killed in the middle of that.
        ("during a replayed step", lambda w, launcher: _log_says(launcher, "replaying stored batches")),
        ("during or right after a checkpoint save", lambda w, _: _checkpoint_saving_or_saved(out, w)),
        ("while an old publish folder is removed", lambda w, _: _publish_folder_going(out, w)),
    )
    seen = _run_lives(out, points, ())
    print(*seen, sep="\n  ")
    _check_end_state(out)


@pytest.mark.slow
def test_async_kills_resume_to_the_recorded_sequences_weights(tmp_path):
    """Async mode: generation runs across steps, so the trained sequence is not a replay of any
    other run; it equals the recorded one, and the resumed run's weights are that sequence's."""
    out = tmp_path / "run"
    points = (
        ("async: step 2 committed", lambda w, _: _trained_at_least(w, 2)),
        ("async: during a replayed step", lambda w, launcher: _log_says(launcher, "replaying stored batches")),
    )
    _run_lives(out, points, ("--rollout-mode", "async"))
    _check_end_state(out, ("--rollout-mode", "async"))


@pytest.mark.slow
def test_a_kill_after_collecting_old_batches_resumes(tmp_path):
    """With --rollout-gc-keep-steps 0 a step's batch is collected once a checkpoint covers it, never
    before: a kill right after a collection resumes from that checkpoint with every batch it needs."""
    out = tmp_path / "run"

    def collected_once(w: Watch, _: Launcher):
        return lambda: w.store is not None and w.store.statistics().collected_step >= 1

    def trained_past_checkpoint(w: Watch, _: Launcher):
        return lambda: w.store is not None and w.store.trained_step() >= 4  # checkpoint v4: steps 0..3

    started = time.monotonic()
    _run_lives(
        out,
        (("right after a collection", collected_once), ("a step past a checkpoint", trained_past_checkpoint)),
        ("--rollout-gc-keep-steps", "0"),
    )
    print(f"{time.monotonic() - started:.0f}s")
    _check_end_state(out, collected=True)
