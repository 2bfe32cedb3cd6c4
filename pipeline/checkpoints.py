"""Checkpoint cadence and retention, the folders the engines load, and the replay of stored batches.

Two kinds of folder, two purposes:

- A checkpoint, `checkpoints/vN` (N = the policy version: the weights after step N - 1), is the
  trainer's whole state: weights, optimizer, random state, step count (`Trainer.save_weights`).
  One is written every `--save-interval` steps and at the run's last step; the newest
  `--save-keep-last` committed ones are kept.
- A publish folder, `weights/vN`, is what the engines load between checkpoints: weights only
  (`save_model`, when the trainer has it), written only where the transport needs a disk (none with
  `--update-weight-transport distributed`), and deleted once every live engine serves a later
  version (the next publish succeeded), unless `--save-keep-weights` keeps every one (to evaluate
  each version afterwards: `python -m pipeline.eval`). At a checkpoint step the checkpoint itself
  is published.

A checkpoint also records what it covers (`covers.json`: its step, the dataset cursor, and the
groups below the cursor its steps did not settle; `Store.coverage`), so that a resume whose store
is lost or damaged knows which prompts the weights already learned from, and which to generate
again (`pipeline.run.reconcile`). A checkpoint written before that record existed (or by a save
killed between the weights and the record) has none; the resume then reconciles from what the
store still holds.

Exactly once, relative to the checkpoint: the store keeps each trained batch (its groups, in order,
with their samples, behaviour log-probs and versions) and its metrics record (the version it was
trained against and its minibatch split) until a checkpoint covers its step. A resume loads the
newest checkpoint the store counts, then `replay_stored_batches` trains the stored batches of the
steps after it again, in order, before any new work: nothing is regenerated, and the trainer ends
where the killed run's committed steps had left it. On one CPU with a fixed seed that is bit for bit.
A setting the resume changed takes effect from the first new step (the store records it): each
replayed step runs with the trainer settings it first ran with (learning rate, loss, temperature,
clips, micro-batches: `trainers.step_settings`, through `use_settings`), and the new steps with
today's. What is fixed when the trainer is built (device, dtype, ranks, `--ref-load`, R3) cannot
change between steps: a replayed step that first ran with another value is said in a warning.
A group of such a batch whose record is damaged is left out of the batch (its prompt is generated
again, named, by the launcher before the replay: `pipeline.run.state`); a batch left with no
readable group trains nothing, and the steps after it are trained again all the same.
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
from typing import TYPE_CHECKING, Any

import anyio
import orjson
import structlog

from core.clock import VersionClock
from core.errors import ConfigError, CorruptRecordError, StoreError
from pipeline.plan import ReplaysSettings, RolloutPlan, SavesModel, Trainer
from pipeline.settings_history import changes_after, settings_at
from pipeline.trainer_settings import FIXED_WHEN_BUILT, replayed_settings, step_settings
from stages.publisher import EngineMemory, WeightTarget, WeightTransfer, publish_weights
from storage import AsyncStore, Coverage, Cursor

if TYPE_CHECKING:
    from trainers.step_settings import StepSettings

__all__ = [
    "CheckpointPolicy",
    "StepSave",
    "StepSaver",
    "checkpoint_versions",
    "folder_bytes",
    "prune_checkpoints",
    "read_coverage",
    "remove_folder",
    "replay_stored_batches",
    "replay_then_publish",
    "save_step",
    "write_coverage",
]

log = structlog.get_logger("pipeline")

CHECKPOINTS_DIR = "checkpoints"
PUBLISH_DIR = "weights"
_OPTIMIZER_DIR = "optimizer"  # trainers.checkpoint.OPTIMIZER_DIR; both backends write it
COVERAGE_FILE = "covers.json"  # in a checkpoint folder: what its steps settled (`Store.coverage`)
_COVERAGE_FORMAT = 1


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Where checkpoints and publish folders go, how often a checkpoint is written, how many stay."""

    dir: Path  # full checkpoints, `vN` each
    publish_dir: Path  # weights-only folders the engines load between checkpoints
    interval: int = 1  # a checkpoint every N steps (and at the run's last step)
    keep_last: int = 0  # checkpoints kept; 0 keeps every one
    # Weights-only folders stay once served past: every version evaluable (written for it where the
    # publish sends the weights another way).
    keep_published: bool = False

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


def save_step(
    trainer: Trainer,
    policy: CheckpointPolicy,
    step: int,
    num_steps: int,
    *,
    distributed: bool,
    coverage: Coverage | None = None,
) -> StepSave:
    """Save what step `step` must leave behind (blocking: run it off the event loop). A checkpoint
    gets `coverage` (what steps 0..`step` settled) beside its weights."""
    version = step + 1
    if policy.due(step, num_steps):
        folder = trainer.save_weights(policy.dir / f"v{version}")
        if coverage is not None:
            write_coverage(folder, coverage)
        return StepSave(folder, True, folder_bytes(folder))
    target = policy.publish_dir / f"v{version}"
    # The weights travel over torch.distributed or CUDA IPC: nothing to write, unless every version
    # is to be kept for evaluation (`keep_published`), which then writes the folder the engines skip.
    if distributed and not policy.keep_published:
        return StepSave(target, False, 0)
    # Weights alone where the trainer can save them so; a full checkpoint otherwise.
    folder = trainer.save_model(target) if isinstance(trainer, SavesModel) else trainer.save_weights(target)
    return StepSave(folder, False, folder_bytes(folder))


def write_coverage(folder: Path, coverage: Coverage) -> None:
    """`covers.json` in the checkpoint `folder`, written whole or not at all (a kill in between
    leaves a checkpoint without it, which a resume treats as one of an older version). A trainer
    of the user's whose save leaves no folder here has nothing to record it in."""
    if not folder.is_dir():
        return
    c = coverage.cursor
    record = {
        "format": _COVERAGE_FORMAT,
        "step": coverage.step,
        "cursor": {"epoch": c.epoch, "index": c.index, "next_seq": c.next_seq},
        "unsettled": list(coverage.unsettled),
    }
    tmp = folder / f".{COVERAGE_FILE}.tmp"
    tmp.write_bytes(orjson.dumps(record))
    os.replace(tmp, folder / COVERAGE_FILE)


def read_coverage(folder: Path) -> Coverage | None:
    """What the checkpoint `folder` covers, or None when it has no record (written before the
    record existed). A record that does not decode is a CorruptRecordError naming the file."""
    path = folder / COVERAGE_FILE
    if not path.exists():
        return None
    try:
        record = orjson.loads(path.read_bytes())
        if record.get("format") != _COVERAGE_FORMAT:
            raise ValueError(f"format {record.get('format')!r}, expected {_COVERAGE_FORMAT}")
        c = record["cursor"]
        cursor = Cursor(int(c["epoch"]), int(c["index"]), int(c["next_seq"]))
        unsettled = tuple(str(gid) for gid in record["unsettled"])
        return Coverage(int(record["step"]), cursor, unsettled)
    except (OSError, orjson.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptRecordError(str(path), f"the checkpoint's coverage record does not decode: {exc}") from exc


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
    meta = await store.read_meta()
    settings = _ReplaySettings.of(trainer, meta.extra if meta is not None else {}, first, last)
    saved: StepSave | None = None
    log.warning(
        "replaying stored batches trained after the last checkpoint",
        steps=f"{first}..{last}",
        **({"with_the_settings_they_first_ran_with": settings.said} if settings is not None else {}),
    )
    for step in range(first, last + 1):
        if settings is not None:
            await settings.use(step)
        damaged: list[CorruptRecordError] = []
        batch = await store.batch(step, damaged=damaged)
        if batch is None:
            raise StoreError(
                f"step {step} was trained after the last checkpoint (v{first}), but the store no longer "
                f"holds its batch to train it again; resume from a store that kept it, or remove "
                f"checkpoints newer than the batches kept"
            )
        if damaged:  # their prompts were requeued before the run (`pipeline.run.state`)
            log.warning(
                "a batch to train again holds damaged group records: trained without them",
                step=step,
                left_out=[str(e.key) for e in damaged],
                trained=len(batch.groups),
            )
        record: Mapping[str, Any] = records.get(step, {})
        version = record.get("version")
        batch = dataclasses.replace(batch, train_version=version if isinstance(version, int) else step)
        split = record.get("train/minibatch_samples")
        kwargs: dict[str, int] = {}
        if takes_split and isinstance(split, int | float):
            kwargs["minibatch_samples"] = int(split)
        if batch.groups:  # a batch with no readable group trains nothing; the next ones still do
            await anyio.to_thread.run_sync(functools.partial(trainer.train_step, batch, **kwargs))
        if policy.due(step, num_steps) or step == last:
            coverage = await store.coverage(step) if policy.due(step, num_steps) else None
            saved = await anyio.to_thread.run_sync(
                functools.partial(
                    save_step, trainer, policy, step, num_steps, distributed=distributed, coverage=coverage
                )
            )
            if saved.checkpoint:
                prune_checkpoints(policy, step + 1)
    if settings is not None:
        await settings.restore()  # the new steps run with today's settings
    return saved


@dataclass(slots=True)
class _ReplaySettings:
    """The settings each replayed step first ran with, when some differ from today's: a setting a
    resume changed takes effect from the step the store records (`pipeline.settings_history`), so
    the steps before it, trained again, run as they first ran (`ReplaysSettings.use_settings`)."""

    use_settings: Callable[[StepSettings], None]
    by_step: dict[int, StepSettings]
    own: StepSettings  # the trainer's before the replay, given back after it
    said: list[str]  # the changes undone, for the log
    applied: StepSettings | None = None

    @classmethod
    def of(cls, trainer: Trainer, extra: Mapping[str, Any], first: int, last: int) -> _ReplaySettings | None:
        now = extra.get("config")
        if not isinstance(now, Mapping):
            return None  # a store that records no settings
        changes = changes_after(extra, first)  # a replayed step ran with each one's "from"
        fixed = [_said(c) for c in changes if c["setting"] in FIXED_WHEN_BUILT]
        if fixed:
            log.warning(
                "settings fixed when the trainer is built changed since some replayed steps first ran: "
                "those steps run with today's values, and may end elsewhere than the first time",
                steps=f"{first}..{last}",
                changes=fixed,
            )
        then = {step: settings_at(extra, step) or {} for step in range(first, last + 1)}
        if all(step_settings(t) == step_settings(now) for t in then.values()):
            return None  # nothing that changed touches a training step (rollout, engines, output...)
        said = [_said(c) for c in changes if _touches_a_step(settings_at(extra, c["step"]) or {}, c)]
        if not isinstance(trainer, ReplaysSettings):
            log.warning(
                "settings changed since some replayed steps first ran, and this trainer has no "
                "use_settings() to run them with those: they run with today's",
                steps=f"{first}..{last}",
                changes=said,
            )
            return None
        own = trainer.step_settings
        by_step = {step: replayed_settings(own, t, now) for step, t in then.items()}
        return cls(trainer.use_settings, by_step, own, said)

    async def use(self, step: int) -> None:
        await self._apply(self.by_step[step])

    async def restore(self) -> None:
        await self._apply(self.own)

    async def _apply(self, settings: StepSettings) -> None:
        if settings != self.applied:
            # Blocking: megatron's ranks all take them; a first reference model is loaded.
            await anyio.to_thread.run_sync(self.use_settings, settings)
            self.applied = settings


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


def _said(change: Mapping[str, Any]) -> str:
    step = change["step"]
    return f"{change['setting']}: {change['from']!r} through step {step - 1}, {change['to']!r} from step {step}"


def _touches_a_step(after: Mapping[str, Any], change: Mapping[str, Any]) -> bool:
    """Whether the trainer's step settings differ with this change undone from the settings
    `after` it took effect (a rollout, engine or output setting does not touch them)."""
    section, name = str(change["setting"]).split(".", 1)
    before = {k: dict(v) for k, v in after.items() if isinstance(v, Mapping)}
    before.setdefault(section, {})[name] = change["from"]
    try:
        return step_settings(before) != step_settings(after)
    except (TypeError, ValueError):  # only with another change undone too: it does touch the step
        return True


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

    def due(self, step: int) -> bool:
        """Whether step `step` saves a full checkpoint (which records what it covers)."""
        return self.policy is None or self.policy.due(step, self.num_steps)

    def save(self, trainer: Trainer, step: int, coverage: Coverage | None = None) -> StepSave:
        """Blocking: run it off the event loop. `coverage`: what a checkpoint records it covers."""
        if self.policy is None:
            folder = trainer.save_weights(self.weights_dir / f"v{step + 1}")
            if coverage is not None:
                write_coverage(folder, coverage)
            # Every step's save is a full checkpoint here: the collector may go up to this step.
            self.checkpoint_step = step
            return StepSave(folder, True, folder_bytes(folder))
        saved = save_step(trainer, self.policy, step, self.num_steps, distributed=self.distributed, coverage=coverage)
        if saved.checkpoint:
            self.checkpoint_step = step
        return saved

    def published(self, saved: StepSave, step: int) -> None:
        """After the commit and a publish that every live engine took: the previous publish folder
        goes, and the checkpoints beyond the newest `keep_last` (this step's counts now)."""
        if self.policy is None:
            return
        previous, self.served = self.served, saved
        kept = self.policy.keep_published
        if previous is not None and not previous.checkpoint and previous.folder != saved.folder and not kept:
            remove_folder(previous.folder)
        if saved.checkpoint:
            prune_checkpoints(self.policy, step + 1)
