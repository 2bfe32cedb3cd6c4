"""Checkpoint cadence and retention, the folders the engines load, and the replay of stored batches.

Two kinds of folder, two purposes:

- A checkpoint, `checkpoints/vN` (N = the policy version: the weights after step N - 1), is the
  trainer's whole state: weights, optimizer, random state, step count (`Trainer.save_weights`).
  One is written every `--save-interval` steps and at the run's last step; the newest
  `--save-keep-last` committed ones are kept.
- A publish folder, `weights/vN`, is what the engines load between checkpoints: weights only
  (`save_model`, when the trainer has it), written only where the transport needs a disk (none with
  `--update-weight-transport distributed`), and deleted once every live engine serves a later
  version (the next publish succeeded). At a checkpoint step the checkpoint itself is published.

Exactly once, relative to the checkpoint: the store keeps each trained batch (its groups, in order,
with their samples, behaviour log-probs and versions) and its metrics record (the version it was
trained against and its minibatch split) until a checkpoint covers its step. A resume loads the
newest checkpoint the store counts, then `replay_stored_batches` trains the stored batches of the
steps after it again, in order, before any new work: nothing is regenerated, and the trainer ends
where the killed run's committed steps had left it. On one CPU with a fixed seed that is bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from core.clock import VersionClock
from core.errors import ConfigError, StoreError
from pipeline.plan import RolloutPlan, Trainer
from stages.publisher import EngineMemory, WeightTarget, WeightTransfer, publish_weights
from storage import AsyncStore

__all__ = [
    "CheckpointPolicy",
    "StepSave",
    "StepSaver",
    "checkpoint_versions",
    "folder_bytes",
    "prune_checkpoints",
    "remove_folder",
    "replay_stored_batches",
    "replay_then_publish",
    "save_step",
]

log = structlog.get_logger("pipeline")

CHECKPOINTS_DIR = "checkpoints"
PUBLISH_DIR = "weights"
_OPTIMIZER_DIR = "optimizer"  # trainers.checkpoint.OPTIMIZER_DIR; both backends write it


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Where checkpoints and publish folders go, how often a checkpoint is written, how many stay."""

    dir: Path  # full checkpoints, `vN` each
    publish_dir: Path  # weights-only folders the engines load between checkpoints
    interval: int = 1  # a checkpoint every N steps (and at the run's last step)
    keep_last: int = 0  # checkpoints kept; 0 keeps every one

    def __post_init__(self) -> None:
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ConfigError([f"--save-interval={self.interval!r}: must be an integer >= 1"])
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ConfigError([f"--save-keep-last={self.keep_last!r}: must be an integer >= 0 (0 keeps every one)"])

    def due(self, step: int, num_steps: int) -> bool:
        """Whether step `step` ends with a checkpoint: every `interval` steps, and the last one."""
        return (step + 1) % self.interval == 0 or step == num_steps - 1


@dataclass(frozen=True, slots=True)
class StepSave:
    """What one step wrote: the folder the engines are given, and whether it is a checkpoint."""

    folder: Path
    checkpoint: bool
    bytes_written: int


def save_step(trainer: Trainer, policy: CheckpointPolicy, step: int, num_steps: int, *, distributed: bool) -> StepSave:
    """Save what step `step` must leave behind (blocking: run it off the event loop)."""
    version = step + 1
    if policy.due(step, num_steps):
        folder = trainer.save_weights(policy.dir / f"v{version}")
        return StepSave(folder, True, folder_bytes(folder))
    target = policy.publish_dir / f"v{version}"
    if distributed:  # the weights travel over torch.distributed: nothing to write
        return StepSave(target, False, 0)
    save_model: Callable[[Path], Path] = getattr(trainer, "save_model", None) or trainer.save_weights
    folder = save_model(target)
    return StepSave(folder, False, folder_bytes(folder))


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (what writing it cost)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def is_checkpoint(folder: Path) -> bool:
    """A complete full checkpoint: a model folder with its optimizer state (either backend's)."""
    return (folder / "config.json").is_file() and (folder / _OPTIMIZER_DIR).is_dir()


def checkpoint_versions(*dirs: Path) -> dict[int, Path]:
    """The full checkpoints `vN` in `dirs`, by version; a version in an earlier dir wins. The run
    folder's `weights/` holds the checkpoints of the older layout (one every step)."""
    found: dict[int, Path] = {}
    for d in reversed(dirs):
        if not d.is_dir():
            continue
        for entry in d.iterdir():
            if entry.name.startswith("v") and entry.name[1:].isdigit() and is_checkpoint(entry):
                found[int(entry.name[1:])] = entry
    return dict(sorted(found.items()))


def remove_folder(path: Path) -> None:
    """Delete `path` so that no reader ever sees half of it: renamed aside first (one atomic step,
    to a `.vN.old-*` name a restart cleans up), then removed."""
    if not path.exists():
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    os.replace(path, aside / "folder")
    shutil.rmtree(aside, ignore_errors=True)


def prune_checkpoints(policy: CheckpointPolicy, committed_version: int) -> list[int]:
    """Delete the checkpoints beyond the newest `keep_last` of those the store counts (version <=
    `committed_version`); a newer one (saved, its step not committed) is left for its step. Returns
    the versions deleted. Called after each commit and at start, so a kill in between loses nothing."""
    if policy.keep_last == 0:
        return []
    counted = [v for v in checkpoint_versions(policy.dir) if v <= committed_version]
    doomed = counted[: max(0, len(counted) - policy.keep_last)]
    for version in doomed:
        remove_folder(policy.dir / f"v{version}")
    return doomed


def remove_publish_folders(policy: CheckpointPolicy, *, keep: Path | None = None) -> int:
    """Delete every weights-only publish folder but `keep` (the one the engines serve now). A
    checkpoint of the older layout in the same folder (it has an optimizer) is never touched."""
    if not policy.publish_dir.is_dir():
        return 0
    removed = 0
    for entry in policy.publish_dir.iterdir():
        if not (entry.name.startswith("v") and entry.name[1:].isdigit() and entry.is_dir()):
            continue
        if keep is not None and entry.resolve() == keep.resolve():
            continue
        if (entry / _OPTIMIZER_DIR).is_dir():
            continue
        remove_folder(entry)
        removed += 1
    return removed


async def replay_stored_batches(
    trainer: Trainer,
    store: AsyncStore,
    policy: CheckpointPolicy,
    *,
    first: int,
    last: int,
    num_steps: int,
    distributed: bool,
) -> StepSave | None:
    """Train the stored batches of steps `first`..`last` again, in order, as they were trained.

    Each batch comes back from the store as it was taken (the same groups in the same order, their
    samples with the behaviour log-probs and versions they were trained on); its metrics record
    gives the version it was trained against and its minibatch split. A step due for a checkpoint
    saves it (the kill came before that save counted). Returns what the last replayed step saved
    for the engines (None when nothing was replayed).
    """
    if last < first:
        return None
    records = await store.step_metrics(first)
    takes_split = "minibatch_samples" in inspect.signature(trainer.train_step).parameters
    saved: StepSave | None = None
    log.warning("replaying stored batches trained after the last checkpoint", steps=f"{first}..{last}")
    for step in range(first, last + 1):
        batch = await store.batch(step)
        if batch is None:
            raise StoreError(
                f"step {step} was trained after the last checkpoint (v{first}), but the store no longer "
                f"holds its batch to train it again; resume from a store that kept it, or remove "
                f"checkpoints newer than the batches kept"
            )
        record: Mapping[str, Any] = records.get(step, {})
        version = record.get("version")
        batch = dataclasses.replace(batch, train_version=version if isinstance(version, int) else step)
        split = record.get("train/minibatch_samples")
        kwargs: dict[str, int] = {}
        if takes_split and isinstance(split, int | float):
            kwargs["minibatch_samples"] = int(split)
        await anyio.to_thread.run_sync(functools.partial(trainer.train_step, batch, **kwargs))
        if policy.due(step, num_steps) or step == last:
            saved = await anyio.to_thread.run_sync(
                functools.partial(save_step, trainer, policy, step, num_steps, distributed=distributed)
            )
            if saved.checkpoint:
                prune_checkpoints(policy, step + 1)
    return saved


async def replay_then_publish(
    plan: RolloutPlan,
    trainer: Trainer,
    store: AsyncStore,
    engines: WeightTarget,
    clock: VersionClock,
    policy: CheckpointPolicy,
    *,
    resume_from: int,
    transfer: WeightTransfer | None,
    memory: EngineMemory | None = None,
) -> StepSave | None:
    """Train the stored batches after the loaded checkpoint (version `resume_from`) again, then
    publish the result: the engines then serve the version the store's last trained step made, as
    they did before the kill. Runs before the stage graph starts: nothing generates meanwhile.
    Colocated (`memory`), the engines release their GPU memory for the replay, as after a round.
    Returns what was published (None: nothing to replay)."""
    trained = await store.trained_step()
    if memory is not None and trained >= resume_from:
        await memory.release()
    saved = await replay_stored_batches(
        trainer,
        store,
        policy,
        first=resume_from,
        last=trained,
        num_steps=plan.num_steps,
        distributed=transfer is not None,
    )
    if saved is None:
        return None
    clock.start_at(trained)
    await publish_weights(clock, engines, saved.folder, pause_mode=plan.pause_mode, transfer=transfer)
    return saved


@dataclass(slots=True)
class StepSaver:
    """What each step saves, and the publish folder to delete once the engines serve a later one.
    Without a policy: a full checkpoint every step in `weights_dir` (the older layout)."""

    policy: CheckpointPolicy | None
    weights_dir: Path
    num_steps: int
    checkpoint_step: int  # the step of the newest checkpoint, -1 for none
    distributed: bool
    served: StepSave | None = None  # the folder the engines were last given, if this session wrote it

    @classmethod
    def starting(
        cls,
        policy: CheckpointPolicy | None,
        weights_dir: Path,
        num_steps: int,
        first_step: int,
        transfer: WeightTransfer | None,
        served: StepSave | None = None,
    ) -> StepSaver:
        """`served`: what a replay published (deleted, if a publish folder, once a later one is served)."""
        if policy is None:
            return cls(None, weights_dir, num_steps, first_step - 1, transfer is not None)
        newest = [v for v in checkpoint_versions(policy.dir, policy.publish_dir) if v <= first_step]
        return cls(policy, weights_dir, num_steps, max(newest, default=0) - 1, transfer is not None, served)

    def save(self, trainer: Trainer, step: int) -> StepSave:
        """Blocking: run it off the event loop."""
        if self.policy is None:
            folder = trainer.save_weights(self.weights_dir / f"v{step + 1}")
            return StepSave(folder, True, folder_bytes(folder))
        saved = save_step(trainer, self.policy, step, self.num_steps, distributed=self.distributed)
        if saved.checkpoint:
            self.checkpoint_step = step
        return saved

    def published(self, saved: StepSave, step: int) -> None:
        """After the commit and a publish that every live engine took: the previous publish folder
        goes, and the checkpoints beyond the newest `keep_last` (this step's counts now)."""
        if self.policy is None:
            return
        previous, self.served = self.served, saved
        if previous is not None and not previous.checkpoint and previous.folder != saved.folder:
            remove_folder(previous.folder)
        if saved.checkpoint:
            prune_checkpoints(self.policy, step + 1)
