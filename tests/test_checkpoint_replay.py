"""Checkpoint cadence, retention and the replay of stored batches (`pipeline.checkpoints`), in process:
a real LMDB store, the real torch trainer on the tiny model, on CPU.

The property: a trainer loaded from the last checkpoint that trains the stored batches of the steps
after it again ends with the same weights, bit for bit, as the trainer that trained them the first
time, whatever `--global-batch-size` says now (the split is the recorded one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import pytest
import torch

from core.errors import ConfigError, StoreError
from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
from pipeline.checkpoints import (
    CheckpointPolicy,
    StepSaver,
    checkpoint_versions,
    prune_checkpoints,
    remove_publish_folders,
    replay_stored_batches,
    save_step,
)
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import encode
from storage import AsyncStore, Cursor, LmdbStore
from trainers import GRPOTrainer

STEPS = 6
GROUPS = 2


pytestmark = pytest.mark.usefixtures("restore_torch_threads")


def _group(index: int, step: int) -> Group:
    task = PromptTask(index=index, prompt_ids=encode(f"say a x{index % 3 + 1}:"), label=None)
    samples = []
    for i in range(4):
        ids = encode("ab"[: (i + index) % 2 + 1] + "a" * (i + step % 3))
        logprobs = tuple(-1.0 - 0.1 * ((i + j + index) % 5) for j in range(len(ids)))
        seg = Segment(ids, logprobs, FinishReason.STOP, step)
        sample = Sample(index=i, prompt_ids=task.prompt_ids).extended(seg, max_response_len=64)
        samples.append(dataclasses.replace(sample, reward=float((i + index + step) % 3 == 0)))
    fresh = Group.fresh(task, epoch=0, n_samples=4, version=step, seq=index)
    return fresh.with_samples(samples)


def _train_run(path: Path, model: Path, policy: CheckpointPolicy, split: int) -> dict[str, torch.Tensor]:
    """The uninterrupted run: every step takes, trains, saves per the policy and commits its batch."""
    trainer = GRPOTrainer(model, global_batch_size=split)
    with LmdbStore(path) as store:
        for step in range(STEPS):
            groups = [_group(step * GROUPS + k, step) for k in range(GROUPS)]
            store.admit(
                [Group.fresh(g.task, epoch=0, n_samples=4, version=step, seq=g.seq) for g in groups],
                Cursor(index=(step + 1) * GROUPS, next_seq=(step + 1) * GROUPS),
            )
            for g in groups:
                store.put_ready(g)
            batch = store.take_batch(step, GROUPS)
            assert batch is not None
            metrics = trainer.train_step(dataclasses.replace(batch, train_version=step))
            save_step(trainer, policy, step, STEPS, distributed=False)
            store.finish_batch(step, {"step": step, "version": step, **{f"train/{k}": v for k, v in metrics.items()}})
    return _weights(trainer)


def _weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _policy(out: Path, interval: int, keep: int = 0) -> CheckpointPolicy:
    return CheckpointPolicy(out / "checkpoints", out / "weights", interval=interval, keep_last=keep)


def test_replaying_the_stored_batches_after_the_checkpoint_ends_bit_for_bit_where_the_run_did(tmp_path):
    model = make_model_folder(tmp_path / "model", seed=0)
    out = tmp_path / "run"
    policy = _policy(out, interval=4)
    straight = _train_run(out / "store", model, policy, split=4)
    # Steps 0..5 at interval 4: a checkpoint after step 3 (v4) and after the last (v6); weights
    # only (no optimizer) in between.
    assert sorted(checkpoint_versions(policy.dir)) == [4, 6]
    assert sorted(p.name for p in policy.publish_dir.iterdir()) == ["v1", "v2", "v3", "v5"]
    assert not (policy.publish_dir / "v5" / "optimizer").exists()

    # A kill after step 5 committed, before v6 was saved: resume from v4 and replay steps 4 and 5,
    # with a trainer whose --global-batch-size differs now (the recorded split wins).
    (policy.dir / "v6").rename(tmp_path / "v6-lost")
    resumed = GRPOTrainer(policy.dir / "v4", global_batch_size=3)
    assert resumed.steps == 4

    async def replay() -> None:
        async with AsyncStore(LmdbStore(out / "store")) as store:
            saved = await replay_stored_batches(
                resumed, store, policy, first=4, last=STEPS - 1, num_steps=STEPS, distributed=False
            )
            assert saved is not None and saved.checkpoint and saved.folder == policy.dir / "v6"

    anyio.run(replay)
    assert resumed.steps == STEPS
    got = _weights(resumed)
    assert all(torch.equal(straight[k], got[k]) for k in straight)
    # The replay saved the checkpoint the kill lost, whole.
    again = GRPOTrainer(policy.dir / "v6")
    assert again.steps == STEPS and all(torch.equal(straight[k], v) for k, v in _weights(again).items())


def test_a_replay_with_the_split_of_today_would_differ(tmp_path):
    """The recorded split matters: trained with --global-batch-size 3 instead of 4, the same
    batches land elsewhere (so the equality above is the recorded split's doing)."""
    model = make_model_folder(tmp_path / "model", seed=0)
    straight = _train_run(tmp_path / "a" / "store", model, _policy(tmp_path / "a", 100), split=4)
    other = _train_run(tmp_path / "b" / "store", model, _policy(tmp_path / "b", 100), split=3)
    assert not all(torch.equal(straight[k], other[k]) for k in straight)


def test_a_replay_refuses_a_step_whose_batch_was_collected(tmp_path):
    model = make_model_folder(tmp_path / "model", seed=0)
    out = tmp_path / "run"
    policy = _policy(out, interval=100)
    _train_run(out / "store", model, policy, split=4)
    with LmdbStore(out / "store") as store:
        store.collect_garbage(2)

    async def replay() -> None:
        async with AsyncStore(LmdbStore(out / "store")) as store:
            await replay_stored_batches(
                GRPOTrainer(model), store, policy, first=0, last=STEPS - 1, num_steps=STEPS, distributed=False
            )

    with pytest.raises(StoreError, match="step 0 was trained after the last checkpoint"):
        anyio.run(replay)


def test_retention_keeps_the_newest_counted_checkpoints_and_publish_folders_go(tmp_path):
    model = make_model_folder(tmp_path / "model", seed=0)
    out = tmp_path / "run"
    policy = _policy(out, interval=1, keep=2)
    _train_run(out / "store", model, policy, split=4)
    assert sorted(checkpoint_versions(policy.dir)) == list(range(1, STEPS + 1))
    # v6 is saved but its step not counted (committed version 5): it stays, and of the counted
    # ones the newest two do.
    assert prune_checkpoints(policy, committed_version=5) == [1, 2, 3]
    assert sorted(checkpoint_versions(policy.dir)) == [4, 5, 6]
    assert prune_checkpoints(policy, committed_version=6) == [4]
    # An older layout's checkpoint in the publish folder (it has an optimizer) is never a publish
    # folder to delete; a weights-only one is.
    GRPOTrainer(model).save_weights(policy.publish_dir / "v9")
    GRPOTrainer(model).save_model(policy.publish_dir / "v10")
    assert remove_publish_folders(policy) == 1
    assert sorted(p.name for p in policy.publish_dir.iterdir()) == ["v9"]
    assert sorted(checkpoint_versions(policy.dir, policy.publish_dir)) == [5, 6, 9]


@pytest.mark.parametrize("keep", [False, True])
def test_a_publish_folder_goes_once_served_past_unless_kept(tmp_path, keep):
    trainer = GRPOTrainer(make_model_folder(tmp_path / "model", seed=0))
    policy = dataclasses.replace(_policy(tmp_path, interval=3), keep_published=keep)
    saver = StepSaver.starting(policy, tmp_path / "weights", num_steps=6, first_step=0, transfer=None)
    for step in range(4):  # weights-only v1, v2; the checkpoint v3; weights-only v4
        saver.published(saver.save(trainer, step), step)
    left = sorted(p.name for p in policy.publish_dir.iterdir())
    # The engines serve v4; v1 and v2 were served past (v3, a checkpoint, is never a publish folder).
    assert left == (["v1", "v2", "v4"] if keep else ["v4"])
    assert sorted(checkpoint_versions(policy.dir, policy.publish_dir)) == [3]  # kept ones are not checkpoints


def test_save_step_writes_checkpoints_on_cadence_weights_only_between_and_none_for_distributed_unless_kept(tmp_path):
    trainer = GRPOTrainer(make_model_folder(tmp_path / "model", seed=0))
    trainer.train_step(Batch(0, (_group(0, 0), _group(1, 0))))  # AdamW's moments exist after a step
    policy = _policy(tmp_path, interval=3)
    between = save_step(trainer, policy, 0, 10, distributed=False)
    due = save_step(trainer, policy, 2, 10, distributed=False)
    last = save_step(trainer, policy, 9, 10, distributed=False)
    sent = save_step(trainer, policy, 3, 10, distributed=True)
    assert (between.checkpoint, due.checkpoint, last.checkpoint, sent.checkpoint) == (False, True, True, False)
    assert sent.bytes_written == 0 and not sent.folder.exists()
    # AdamW keeps two moments per weight: a checkpoint is about three times a publish folder.
    assert 2.5 < due.bytes_written / between.bytes_written < 3.5
    # Kept for evaluation (--save-keep-weights): written even where the weights go another way,
    # the same weights-only folder the engines would load from disk.
    kept = dataclasses.replace(policy, keep_published=True)
    written = save_step(trainer, kept, 4, 10, distributed=True)
    assert not written.checkpoint and written.folder == policy.publish_dir / "v5"
    assert written.bytes_written == between.bytes_written and (written.folder / "config.json").is_file()
    with pytest.raises(ConfigError, match="--save-interval=0"):
        _policy(tmp_path, interval=0)


def test_a_checkpoint_restores_the_random_state(tmp_path):
    trainer = GRPOTrainer(make_model_folder(tmp_path / "model", seed=0))
    torch.manual_seed(123)
    saved = trainer.save_weights(tmp_path / "v1")
    expected = torch.rand(4)
    torch.manual_seed(999)
    GRPOTrainer(saved)
    assert torch.equal(torch.rand(4), expected)


def test_a_checkpoint_keeps_its_optimizer_state_but_not_its_step_kernel(tmp_path):
    """AdamW's moments and step count come from the checkpoint; how the step is computed (the fused
    kernel under --trainer-compile on a GPU, foreach otherwise) stays the loading trainer's, so a
    run resumed with the flag or the device changed gets the kernel it asked for."""
    from trainers.checkpoint import load_optimizer, optimizer_param_names, save_optimizer

    net = torch.nn.Linear(3, 2)
    saved = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)
    net(torch.ones(1, 3)).sum().backward()
    saved.step()
    names = optimizer_param_names(net, saved)
    save_optimizer(saved, names, 7, tmp_path / "optimizer")
    fused = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    assert load_optimizer(fused, names, tmp_path / "optimizer", torch.device("cpu"), owner=tmp_path) == 7
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is None
    for p in net.parameters():
        torch.testing.assert_close(fused.state[p]["exp_avg"], saved.state[p]["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(fused.state[p]["exp_avg_sq"], saved.state[p]["exp_avg_sq"], rtol=0, atol=0)
    fused.step()  # the fused kernel takes the loaded state
    assert int(fused.state[net.weight]["step"]) == 2


def test_a_batch_from_the_store_is_the_batch_trained(tmp_path):
    """What a replay reads back is what was trained: the groups in order, every token, log-prob
    and version (the codec keeps them exactly)."""
    with LmdbStore(tmp_path / "store") as store:
        groups = [_group(k, 0) for k in range(GROUPS)]
        store.admit(
            [Group.fresh(g.task, epoch=0, n_samples=4, version=0, seq=g.seq) for g in groups],
            Cursor(index=GROUPS, next_seq=GROUPS),
        )
        for g in groups:
            store.put_ready(g)
        taken = store.take_batch(0, GROUPS)
        store.finish_batch(0, {"step": 0})
        again = store.batch(0)
    assert isinstance(taken, Batch) and again is not None
    assert [g.group_id for g in again.groups] == [g.group_id for g in taken.groups]
    assert again.samples == taken.samples


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_whole_and_no_temporary_folder(tmp_path, monkeypatch):
    """A full disk (or any error) while a checkpoint is written: the folder never appears, its
    temporary folder is gone, and the previous checkpoint still loads."""
    import errno

    import trainers.grpo as grpo

    trainer = GRPOTrainer(make_model_folder(tmp_path / "model", seed=0))
    trainer.train_step(Batch(0, (_group(0, 0), _group(1, 0))))
    policy = _policy(tmp_path / "run", interval=1)
    save_step(trainer, policy, 0, 10, distributed=False)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(grpo, "save_optimizer", disk_full)
    trainer.train_step(Batch(1, (_group(2, 1), _group(3, 1))))
    with pytest.raises(OSError, match="No space left"):
        save_step(trainer, policy, 1, 10, distributed=False)
    assert sorted(p.name for p in policy.dir.iterdir()) == ["v1"]
    assert GRPOTrainer(policy.dir / "v1").steps == 1


# --- settings changed on resume: a replayed step runs with the settings it first ran with ----------

# (setting, flags for steps 0..4, from step 5 (a first resume), from step 6 (the resume that replays
# steps 4 and 5)). Each binds on these batches: the trainer's log-probs are near -4 against behaviour
# log-probs near -1, so importance weights are 0.04..0.15 (a TIS cap of 0.1 cuts some), every
# negative sample is OPSM's, and of two minibatches a step the second is clipped (5: never).
CHANGES = [
    ("lr", ["--lr", "5e-3"], ["--lr", "2e-3"], ["--lr", "1e-3"]),
    ("eps-clip", ["--eps-clip", "0.2"], ["--eps-clip", "0.1"], ["--eps-clip", "5"]),
    ("tis-clip", ["--tis-clip", "2.0"], ["--tis-clip", "0.1"], ["--tis-clip", "0.08"]),
    ("opsm", ["--no-use-opsm"], ["--use-opsm"], ["--no-use-opsm"]),
]


def _config(flags: list[str]) -> dict:
    from pipeline.config import config_to_dict, load_config

    return config_to_dict(load_config(["--global-batch-size", "4", *flags]))


def _meta(config: dict):  # type: ignore[no-untyped-def]
    from storage import RunMeta

    return RunMeta("run", "data", "tokenizer", 4, extra={"config": config})


def _admit_and_take(store: LmdbStore, step: int) -> Batch:
    groups = [_group(step * GROUPS + k, step) for k in range(GROUPS)]
    store.admit(
        [Group.fresh(g.task, epoch=0, n_samples=4, version=step, seq=g.seq) for g in groups],
        Cursor(index=(step + 1) * GROUPS, next_seq=(step + 1) * GROUPS),
    )
    for g in groups:
        store.put_ready(g)
    batch = store.take_batch(step, GROUPS)
    assert batch is not None
    return dataclasses.replace(batch, train_version=step)


def _commit(store: LmdbStore, step: int, metrics: dict) -> None:
    store.finish_batch(step, {"step": step, "version": step, **{f"train/{k}": v for k, v in metrics.items()}})


@pytest.mark.parametrize(("setting", "first", "then", "now"), CHANGES, ids=[c[0] for c in CHANGES])
def test_a_replayed_step_runs_with_the_settings_it_first_ran_with(tmp_path, setting, first, then, now):
    """Steps 0..4 with one value, a resume changes it from step 5, a kill after step 5 (before the
    checkpoint after it), and a resume with a third value: steps 4 and 5, trained again from
    checkpoint v4, run with the first and second value (the store's record of settings says which),
    and end bit for bit where the killed run had; the resumed trainer then runs with the third."""
    from pipeline.run.resume_settings import check_meta
    from pipeline.trainer_settings import build_trainer, step_settings

    model = make_model_folder(tmp_path / "model", seed=0)
    out = tmp_path / "run"
    policy = _policy(out, interval=4)
    configs = [_config(flags) for flags in (first, then, now)]
    with LmdbStore(out / "store") as store:
        check_meta(store, _meta(configs[0]))
        trainer = build_trainer(model, configs[0], initial_model=model)
        for step in range(5):
            _commit(store, step, trainer.train_step(_admit_and_take(store, step)))
            save_step(trainer, policy, step, STEPS, distributed=False)
        # The first resume, after step 4 (no kill: it resumes from a save of its own), changes it.
        resumed_at_5 = build_trainer(trainer.save_weights(tmp_path / "after-4"), configs[1], initial_model=model)
        check_meta(store, _meta(configs[1]))
        _commit(store, 5, resumed_at_5.train_step(_admit_and_take(store, 5)))
        check_meta(store, _meta(configs[2]))  # the resume after the kill: from step 6
        changes = store.read_meta().extra["config_changes"]
    assert {c["step"] for c in changes} == {5, 6}
    killed = _weights(resumed_at_5)

    def replay(trainer: GRPOTrainer, meta_extra: dict | None = None) -> dict[str, torch.Tensor]:
        async def go() -> None:
            async with AsyncStore(LmdbStore(out / "store")) as store:
                if meta_extra is not None:  # the record of settings as a store without history has it
                    await store.write_meta(dataclasses.replace(await store.read_meta(), extra=meta_extra))
                await replay_stored_batches(trainer, store, policy, first=4, last=5, num_steps=STEPS, distributed=False)

        anyio.run(go)
        return _weights(trainer)

    resumed = build_trainer(policy.dir / "v4", configs[2], initial_model=model)
    got = replay(resumed)
    assert all(torch.equal(killed[k], got[k]) for k in killed), f"{setting}: the replay is not where the run was"
    assert resumed.step_settings == step_settings(configs[2])  # the new steps run with today's

    # The record of settings is what made it so: replayed with today's settings, the steps land elsewhere.
    today = replay(build_trainer(policy.dir / "v4", configs[2], initial_model=model), {"config": configs[2]})
    assert not all(torch.equal(killed[k], today[k]) for k in killed), f"{setting} does not bind on these batches"


@pytest.mark.parametrize(
    "flags",
    [
        ["--use-kl-loss", "--kl-loss-coef", "0.5"],  # a reference model the trainer was built without
        ["--rollout-temperature", "0.7"],
        ["--clip-grad", "0.01", "--max-step-kl", "0.01"],
        ["--micro-batch-size", "3", "--loss-agg-mode", "seq-mean-token-mean", "--entropy-coef", "0.1"],
    ],
    ids=["kl", "temperature", "clips", "micro-batches-and-loss"],
)
def test_use_settings_trains_as_a_trainer_built_with_them(tmp_path, flags):
    """`use_settings` between steps gives the step the trainer built with those settings would take,
    bit for bit; without it the trainer lands elsewhere (each setting binds)."""
    from pipeline.config import config_to_dict, load_config
    from pipeline.trainer_settings import build_trainer, step_settings

    model = make_model_folder(tmp_path / "model", seed=0)
    asked, other = (config_to_dict(load_config(["--global-batch-size", "4", *f])) for f in (flags, []))
    built = build_trainer(model, asked, initial_model=model)
    switched = build_trainer(model, other, initial_model=model)
    plain = build_trainer(model, other, initial_model=model)
    switched.use_settings(step_settings(asked))
    assert switched.step_settings == built.step_settings
    for step in range(2):
        batch = Batch(step, (_group(2 * step, step), _group(2 * step + 1, step)), train_version=step)
        metrics = [t.train_step(batch) for t in (built, switched, plain)]
        assert {k: v for k, v in metrics[0].items() if not k.endswith("_time")} == {
            k: v for k, v in metrics[1].items() if not k.endswith("_time")
        }
    a, b, c = (_weights(t) for t in (built, switched, plain))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


class _OwnTrainer:
    """A trainer of a user's own: `train_step` and `save_weights`, no `use_settings`."""

    def __init__(self, inner: GRPOTrainer) -> None:
        self.inner = inner

    def train_step(self, batch: Batch, *, minibatch_samples: int | None = None) -> dict[str, float]:
        return self.inner.train_step(batch, minibatch_samples=minibatch_samples)

    def save_weights(self, path: Path) -> Path:
        return self.inner.save_weights(path)


def test_what_a_replay_cannot_run_as_it_first_ran_is_said(tmp_path, capsys):
    """A setting fixed when the trainer is built (its dtype), and a trainer that cannot change its
    settings between steps: the replay goes on with today's, and says which settings, both values
    and from which step."""
    from pipeline.run.resume_settings import changed_settings

    model = make_model_folder(tmp_path / "model", seed=0)
    out = tmp_path / "run"
    policy = _policy(out, interval=4)
    _train_run(out / "store", model, policy, split=4)
    was, now = _config([]), _config(["--lr", "1e-3", "--trainer-dtype", "bfloat16"])
    with LmdbStore(out / "store") as store:
        store.write_meta(_meta(now))
        meta = store.read_meta()
        extra = {**meta.extra, "config_changes": changed_settings(was, now, step=5)}
        store.write_meta(dataclasses.replace(meta, extra=extra))

    async def replay() -> None:
        async with AsyncStore(LmdbStore(out / "store")) as store:
            trainer = _OwnTrainer(GRPOTrainer(policy.dir / "v4", global_batch_size=4))
            await replay_stored_batches(trainer, store, policy, first=4, last=5, num_steps=STEPS, distributed=False)

    capsys.readouterr()
    anyio.run(replay)
    said = capsys.readouterr().out
    assert "settings fixed when the trainer is built" in said
    assert "trainer.dtype: 'float32' through step 4, 'bfloat16' from step 5" in said
    assert "no use_settings()" in said and "trainer.lr: 0.005 through step 4, 0.001 from step 5" in said
