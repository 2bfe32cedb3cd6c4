"""Everything a run needs before its first step: model folder, dataset, store, and where to resume.

One module, over 600 lines: the start is one ordered sequence (check, open, take the folder,
resume) whose order is the promise that a refused start writes nothing; its natural split is by
those steps, not done yet.

A store remembers what it was written for (run id, dataset and tokenizer fingerprints, group size);
reopening it for anything else is refused with the difference named, before any state is touched.

Nothing is written into the run folder before the run owns it: the store open (an LMDB store's
writer lock taken) and every check passed. A refused start (a second controller on a live store,
a store of another run id, another run's checkpoints) leaves the folder as it found it, the live
run's `config.json` and the checkpoint it may be saving right now included. Only then are the
run's records written (`RunFolder.take`), the tiny model moved in (`pipeline.run.model_folder`),
the checkpoints' owner recorded, and what crashed saves left removed.

Before an LMDB store is opened, `storage.check_storage` checks where it lives against the
deployment's declaration or profile (a network filesystem nobody declared stops the run) and says
whether commits are fsynced.

Resume rules. The weights (and optimizer state) of the last finished step are loaded, and the
rollout state continues from the store. Opening the store verifies it (LMDB's meta pages, the
layout, the counters against the records, the run record; see `storage.LmdbStore`). A store that
is damaged or of another layout is never deleted: it is moved aside to
`<data dir>.unreadable-<UTC time>`, a warning names both folders and what is damaged, and what is
still readable in it (`storage.salvage_store`), reconciled with what the newest checkpoint records
it covers (`pipeline.run.reconcile`), seeds a fresh store (`Store.seed`): the batches of the steps
after the checkpoint are trained again from their readable groups, unfinished groups whose tokens
the resume can rebuild are carried over, and every other prompt admitted and not covered by the
checkpoint is generated again. An unreadable cursor means continuing from the checkpoint's
cursor, or, for a checkpoint that records none, from the beginning of the dataset (carrying no
group over). A store that opens but holds groups quarantined for a damaged record
(`GroupState.QUARANTINED`) keeps them, and their prompts are generated again under a new id; a
damaged group record in a batch the resume trains again is left out of it, and its prompt
generated again the same way (a damaged batch record there moves the store aside). Every prompt
generated again after damage is named: one warning line (how many, which) and one
`regenerated` event in events.jsonl. A store written for another run (a fingerprint differs) is
not damaged, and still stops the run with the difference named.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

import storage
from core.errors import ConfigError, CorruptRecordError, StoreError
from core.types import Group, PromptTask, StoreTransport
from pipeline.checkpoints import (
    CHECKPOINTS_DIR,
    PUBLISH_DIR,
    CheckpointPolicy,
    checkpoint_versions,
    prune_checkpoints,
    read_coverage,
    remove_publish_folders,
)
from pipeline.config import Config, config_to_dict
from pipeline.config.derived import derived
from pipeline.plan import BuiltInTrainer
from pipeline.run.folder import RunFolder
from pipeline.run.model_folder import StartingModel, starting_model
from pipeline.run.reconcile import Reconciled, prompt_of, reconcile, summary_ids
from pipeline.run.resume_settings import check_meta, run_meta
from pipeline.trainer_settings import build_trainer
from stages.reward import RewardFn
from storage import (
    Coverage,
    GroupState,
    RunMeta,
    Store,
    check_storage,
    load_declaration,
    open_store,
    unreadable_reason,
)

__all__ = ["RunState", "open_for_resume", "open_run_state"]

log = structlog.get_logger("launch")


@dataclass(frozen=True)
class RunState:
    model_path: Path  # the base model every engine starts from
    dataset: list[PromptTask]
    reward_fn: RewardFn
    store: Store
    start_step: int
    version: int  # the version of the checkpoint loaded (engines and trainer), 0 for the base model
    weights: Path | None  # the checkpoint of `version` to load, None for the base model
    make_trainer: Callable[[], BuiltInTrainer]
    agent: Callable[..., Any] | None = None  # the built-in task's agent (`--task tool`), if any
    checkpoints: CheckpointPolicy | None = None
    # When the checkpoint is older than the store's last trained step: the stored batches of steps
    # `version`..`start_step - 1` are trained again before new work (`pipeline.checkpoints`).
    replay_from: int | None = None
    # Prompts generated again after damage to the store: each an event for events.jsonl
    # (`{"kind": "regenerated", "count", "groups", "why"}`), written once the run's log is open.
    regenerated: tuple[dict[str, Any], ...] = ()


def open_run_state(config: Config, folder: RunFolder) -> RunState:
    """Open the run: its model, dataset and store; take its folder once the store is open and
    checked (nothing is written into the folder before: it may be a live run's); then tidy it.

    Raises ConfigError or StoreError (a refusal: the folder as it was found), or WriteError."""
    out = folder.path
    model = starting_model(config, out)
    try:
        return _open(config, folder, model)
    finally:
        model.discard()  # installed, or the start failed: the temporary build goes


def _open(config: Config, folder: RunFolder, model: StartingModel) -> RunState:
    """Check the start, open the store, then resume: the store closes if resuming refuses."""
    start = _check_start(config, folder.path, model)
    regenerated: list[dict[str, Any]] = []
    store = _open_run_store(config, start, regenerated)
    try:
        return _resume(config, folder, model, store, start, tuple(regenerated))
    except BaseException:
        store.close()
        raise


@dataclass(frozen=True)
class _Start:
    """What the checks before the store opens give the later steps (nothing is written yet)."""

    dataset: list[PromptTask]
    reward_fn: RewardFn
    meta: RunMeta  # what the store must have been written for
    policy: CheckpointPolicy
    owner: Path | None  # the LMDB store `weights/owner.json` names now (`_check_weights_owner`)


def _check_start(config: Config, out: Path, model: StartingModel) -> _Start:
    """The model's tokenizer, the dataset, what the store must be, and whether this run may write
    checkpoints into `out`: refused with a ConfigError or StoreError, nothing written."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model.source)
    except (OSError, ValueError) as exc:
        # A Hub id's failures are said before this (`pipeline.run.hub`); a folder that is not a
        # model ends in a long traceback through transformers, whose first line says what happened.
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError([f"--hf-checkpoint={str(model.path)!r}: its tokenizer cannot be loaded ({said})"]) from exc
    dataset, reward_fn = _dataset(config, tokenizer)

    # A Hub id's tokenizer is fingerprinted as the id names it (no local file: "none"), also when
    # an unreachable Hub has the run load its cached copy: a store begun online resumes offline.
    e = config.engine
    meta = run_meta(config, dataset, Path(e.hf_checkpoint) if e.hf_checkpoint else model.source)
    policy = CheckpointPolicy(
        out / CHECKPOINTS_DIR,
        out / PUBLISH_DIR,
        interval=config.output.save_interval,
        keep_last=config.output.save_keep_last,
        keep_published=config.output.save_keep_weights,
    )
    owner = _check_weights_owner(out / "weights", config)
    return _Start(dataset, reward_fn, meta, policy, owner)


def _open_run_store(config: Config, start: _Start, regenerated: list[dict[str, Any]]) -> Store:
    """The run's store: LMDB opened and checked (or seeded from its salvage, the prompts generated
    again added to `regenerated`), or a fresh memory store, which has nothing to resume from."""
    if config.storage.transport is StoreTransport.LMDB:
        return _open_lmdb(config, start.meta, start.policy, start.dataset, regenerated)
    store = open_store(config.storage.transport, None)
    check_meta(store, start.meta)
    if checkpoint_versions(start.policy.dir, start.policy.publish_dir):
        log.warning(
            "the memory store keeps nothing to resume from: this run starts at step 0 from the base "
            "model, and its checkpoints replace those in the run folder",
            checkpoints=str(start.policy.dir),
        )
    return store


def _resume(
    config: Config,
    folder: RunFolder,
    model: StartingModel,
    store: Store,
    start: _Start,
    regenerated: tuple[dict[str, Any], ...],
) -> RunState:
    """Where the run resumes (refused if stored batches would be lost); then take the folder and
    tidy it. Nothing is written into the folder before this step's `folder.take`."""
    out, policy = folder.path, start.policy
    trained = store.trained_step()
    version, weights = _resume_point(store, policy, trained)
    # The store is open (an LMDB store's writer lock is this process's) and every check passed:
    # the folder is this run's from here, and only from here is anything written into it.
    folder.take(config)
    model_path = model.install()
    _record_weights_owner(out / "weights", config, start.owner)
    for saves in (policy.publish_dir, policy.dir):
        _remove_unfinished_saves(saves)
    # What the engines loaded between checkpoints is never needed again by the run (a resume
    # reloads the checkpoint), unless --save-keep-weights keeps it for evaluation. Checkpoints
    # beyond the newest --save-keep-last go too (a kill may have come between a commit and that
    # deletion).
    if not policy.keep_published:
        remove_publish_folders(policy)
    prune_checkpoints(policy, trained + 1)
    return RunState(
        model_path,
        start.dataset,
        start.reward_fn,
        store,
        trained + 1,
        version,
        weights,
        _trainer_factory(config, weights or model_path, model_path, out),
        _agent(config),
        checkpoints=policy,
        replay_from=version if version <= trained else None,
        regenerated=regenerated,
    )


def _trainer_factory(config: Config, start_from: Path, model_path: Path, out: Path) -> Callable[[], BuiltInTrainer]:
    """What builds the trainer on `start_from` (the checkpoint resumed, or the base model) when the
    run asks for it."""
    settings = config_to_dict(config)
    t = config.trainer

    def make_trainer() -> BuiltInTrainer:
        if t.backend == "megatron":
            from launch.megatron_ranks import start_megatron_trainer
            from pipeline.trainer_settings import megatron_settings

            # Rank 0 is this process; this node's ranks 1.. are started here and stopped by the
            # trainer's close(); other nodes' ranks are started there (`--node-rank K`) and wait for it.
            return start_megatron_trainer(start_from, log_dir=out / "logs", **megatron_settings(config))
        return build_trainer(start_from, settings, initial_model=model_path)

    return make_trainer


def _agent(config: Config) -> Callable[..., Any] | None:
    """The built-in task's agent: `--task tool` without --prompt-data; None otherwise."""
    if not config.data.prompt_data and config.data.task == "tool":
        from pipeline.tasks.tool_task import lookup_agent

        return lookup_agent
    return None


def _resume_version(policy: CheckpointPolicy, trained: int) -> int:
    """The version of the newest full checkpoint the store counts (<= trained step + 1; a newer one
    was saved by a step that never committed); 0 for the base model."""
    versions = checkpoint_versions(policy.dir, policy.publish_dir)  # publish_dir: the older layout
    return max((v for v in versions if v <= trained + 1), default=0)


def _resume_point(store: Store, policy: CheckpointPolicy, trained: int) -> tuple[int, Path | None]:
    """The newest full checkpoint the store counts, and its folder; (0, None) for the base model.
    The stored batches of the steps after it must still be there, to be trained again."""
    versions = checkpoint_versions(policy.dir, policy.publish_dir)  # publish_dir: the older layout
    version = _resume_version(policy, trained)
    collected = store.statistics().collected_step
    if version <= trained and collected >= version:
        where = f"checkpoint v{version}" if version else "the base model (no checkpoint was saved)"
        raise StoreError(
            f"the store's last trained step is {trained}, the newest checkpoint is {where}, and the "
            f"batches of steps {version}..{collected} to train again were collected; a resume would lose "
            f"them. Restore a checkpoint of step {collected} or later into {policy.dir}"
        )
    return version, versions.get(version)


_OWNER_FILE = "owner.json"  # in the weights folder: which LMDB store counts these checkpoints


def _check_weights_owner(weights_dir: Path, config: Config) -> Path | None:
    """Refuse to write checkpoints over those an LMDB store of another run counts as trained; the
    owner recorded now (None: nobody). Looks only: `_record_weights_owner` writes, once the run
    owns its folder.

    A run saves `checkpoints/vN` and `weights/vN`. In a folder whose checkpoints belong to an LMDB store
    (a durable run that can still resume), a memory run or an LMDB run on another store would
    overwrite them, and resuming the durable run would then load weights it never trained. The
    owner is recorded in `weights/owner.json`, relative to the output dir when the store is inside
    it (so a run folder moved or copied whole still owns its checkpoints); a folder written before
    that record existed is owned by `<output dir>/rollout_data` when that store exists.
    Checkpoints of a memory run, or of a store that is gone, belong to nobody: any run may take
    the folder over.
    """
    out = weights_dir.parent.resolve()
    ours = _store_dir(config)
    record = weights_dir / _OWNER_FILE
    owner: Path | None
    if record.exists():
        try:
            stored = orjson.loads(record.read_bytes())["lmdb_store"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise StoreError(
                f"{record} is not the JSON object a run writes ({exc!r}); remove it if no run owns it"
            ) from exc
        owner = out / stored if stored is not None else None  # an absolute `stored` stays as it is
    else:
        default = out / "rollout_data"
        owner = default if any(weights_dir.glob("v*")) and default.is_dir() else None
    if owner is not None and owner != ours and owner.is_dir():
        this_run = (
            f"--rollout-data-transport=lmdb with --rollout-data-dir={ours}"
            if ours is not None
            else "--rollout-data-transport=memory"
        )
        raise StoreError(
            f"the output dir {out} holds the checkpoints of the LMDB run whose store is {owner}; "
            f"this run ({this_run}) would overwrite them, and that run would resume from weights it never "
            f"trained. Give this run another --output-dir, or resume that run with "
            f"--rollout-data-transport lmdb --rollout-data-dir {owner}"
        )
    return owner


def _record_weights_owner(weights_dir: Path, config: Config, owner: Path | None) -> None:
    """`weights/owner.json` names this run's store (None for a memory run), unless it already does."""
    out = weights_dir.parent.resolve()
    ours = _store_dir(config)
    record = weights_dir / _OWNER_FILE
    if record.exists() and owner == ours:
        return
    weights_dir.mkdir(parents=True, exist_ok=True)
    mine = None if ours is None else str(ours.relative_to(out) if ours.is_relative_to(out) else ours)
    tmp = record.with_name(f".{_OWNER_FILE}.tmp")
    tmp.write_bytes(orjson.dumps({"lmdb_store": mine}))
    os.replace(tmp, record)


def _store_dir(config: Config) -> Path | None:
    if config.storage.transport is not StoreTransport.LMDB:
        return None
    return Path(derived(config.storage.data_dir, "storage.data_dir")).resolve()


def _remove_unfinished_saves(weights_dir: Path) -> None:
    """Drop the temporary folders of a checkpoint save that a crash interrupted.

    `GRPOTrainer.save_weights` writes `.vN.tmp-*` and renames it into place (`.vN.old-*` holds a
    folder being replaced), so after a crash these are garbage: never a checkpoint the store counts.
    A finished `vN` newer than the resume point stays; the step that made it did not count, and
    saving it again replaces it whole. A counted checkpoint is never replaced (a finished step is
    never trained again), so an `.old-*` folder never holds the one this run resumes from.
    """
    if not weights_dir.is_dir():
        return
    for entry in weights_dir.iterdir():
        if entry.name.startswith(".v") and (".tmp-" in entry.name or ".old-" in entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _dataset(config: Config, tokenizer: Any) -> tuple[list[PromptTask], RewardFn]:
    d = config.data
    if d.prompt_data:
        from pipeline.tasks.jsonl import load_jsonl_prompts

        tasks = load_jsonl_prompts(d.prompt_data, tokenizer, input_key=d.input_key, label_key=d.label_key)
        # The rules ask for --custom-rm-path with --prompt-data, so a reward function is set here.
        return tasks, derived(d.reward_fn, "data.reward_fn")
    if d.task == "tool":
        from pipeline.tasks.tool_task import tool_dataset, tool_reward

        return tool_dataset(d.num_prompts, seed=config.rollout.seed), d.reward_fn or tool_reward
    from pipeline.tasks.toy import toy_dataset, toy_reward

    return toy_dataset(d.num_prompts, seed=config.rollout.seed), d.reward_fn or toy_reward


# --- the LMDB store: declaration, opening, and what happens when it is unreadable ---------------


def _open_lmdb(
    config: Config,
    meta: RunMeta,
    policy: CheckpointPolicy,
    dataset: list[PromptTask],
    regenerated: list[dict[str, Any]],
) -> Store:
    """The run's LMDB store, opened and checked, or a fresh one seeded from its salvage; the
    prompts it generates again after damage are added to `regenerated` (events to log)."""
    s = config.storage
    data_dir = Path(derived(s.data_dir, "storage.data_dir"))
    plan = check_storage(
        data_dir,
        declaration=load_declaration(s.declaration) if s.declaration is not None else None,
        profile=s.profile,
    )
    log.info(
        "rollout store",
        path=plan.data_dir,
        filesystem=plan.mount.filesystem,
        mount=plan.mount.mount_point,
        declared_by=plan.declared_by or "detected local disk",
        synced_commits=plan.sync,
    )
    options = plan.store_options()
    fresh = _fresh_group_for(dataset, config.rollout.n_samples_per_prompt)
    try:
        store = _open_checked(data_dir, options, meta)
    except StoreError as exc:
        reason = unreadable_reason(exc)
        if reason is None:
            raise
    else:
        reason = _resume_checks(store, policy, fresh, regenerated, requeue_failed=config.storage.requeue_failed_groups)
        if reason is None:
            return store
        store.close()
    batch_size = config.rollout.rollout_batch_size
    store, events = _continue_from_salvage(data_dir, options, meta, policy, reason, fresh, len(dataset), batch_size)
    regenerated += events
    return store


def open_for_resume(
    data_dir: Path,
    options: dict[str, Any],
    meta: RunMeta,
    policy: CheckpointPolicy,
    fresh: Callable[[str], Group | None],
    *,
    requeue_failed: bool = False,
) -> Store:
    """A run's LMDB store as a resume opens it: checked (pages, layout, counters, the run record),
    recovered after an unclean stop, damaged groups quarantined, the damaged records of what it
    trains again named, failed groups of earlier runs said. What it reads is bounded by the work in
    flight and the steps since the checkpoint, not by the store's size
    (`benchmarks.store_at_size` times it). A StoreError means the store does not open."""
    store = _open_checked(data_dir, options, meta)
    reason = _resume_checks(store, policy, fresh, [], requeue_failed=requeue_failed)
    if reason is not None:
        store.close()
        raise StoreError(f"{data_dir}: {reason}; the launcher moves such a store aside and salvages it")
    return store


def _resume_checks(
    store: Store,
    policy: CheckpointPolicy,
    fresh: Callable[[str], Group | None],
    regenerated: list[dict[str, Any]],
    *,
    requeue_failed: bool,
) -> str | None:
    """What a resume checks in a store that opened (closed again if a check fails): why it must be
    moved aside and salvaged instead, else None. It reads the batches it trains again, never the
    groups a checkpoint covers: those are history, and `replay verify` names their damaged records
    (before issue 49 the first resume read every trained group once: the store's whole size)."""
    try:
        first_replayed = _resume_version(policy, store.trained_step())
        unreplayable, reason = _unreplayable(store, first_replayed)
        if reason is None:
            _requeue_damaged(store, fresh)
            _requeue_unreplayable(store, unreplayable, fresh, regenerated)
            _failed_groups(store, fresh, requeue=requeue_failed)
        return reason
    except BaseException:
        store.close()
        raise


def _requeue_damaged(store: Store, fresh: Callable[[str], Group | None]) -> None:
    """Groups quarantined in a store that still opens (a record failed its checksum) are never
    trained; their prompts are generated again, once."""
    store.quarantine_damaged()
    quarantined = store.count(GroupState.QUARANTINED)
    if not quarantined:
        return
    requeued = store.requeue_quarantined(fresh)
    log.warning(
        "the rollout store holds groups whose records are damaged: they are quarantined (kept, never trained) "
        "and their prompts are generated again",
        quarantined=quarantined,
        requeued_now=requeued,
    )


def _unreplayable(store: Store, first: int) -> tuple[dict[str, int], str | None]:
    """The batches of steps `first`.. are trained again before new work: the groups of theirs
    whose records are damaged (id -> step), and why the store must be moved aside instead (a
    batch record itself is damaged: which prompts its step trained is then known only from a
    salvage), else None. Reads only."""
    damaged: dict[str, int] = {}
    for step in range(first, store.trained_step() + 1):
        try:  # checksums, no decoding: None for a collected step (`_resume_point` says so)
            errors = store.damaged_in_batch(step) or []
        except StoreError as exc:
            return {}, f"the batch record of step {step}, to be trained again, is damaged: {exc}"
        damaged |= dict.fromkeys((gid for gid, _ in errors), step)
    return damaged, None


def _requeue_unreplayable(
    store: Store, damaged: dict[str, int], fresh: Callable[[str], Group | None], regenerated: list[dict[str, Any]]
) -> None:
    """Groups of the batches trained again whose records are damaged (id -> step) cannot be
    trained again, and the checkpoint does not cover their prompts: the replay leaves them out
    (`pipeline.checkpoints`) and their prompts are generated again, once each, named."""
    if not damaged:
        return
    requeued = store.requeue_trained(list(damaged), fresh)
    if requeued:  # said once: a later resume finds them requeued already
        _say_regenerated({_REPLAY_DAMAGED: requeued}, regenerated, steps=sorted(set(damaged.values())))


_REPLAY_DAMAGED = "its group's record is damaged, in a batch trained after the newest checkpoint"


def _say_regenerated(why: dict[str, Sequence[str]], events: list[dict[str, Any]], **context: Any) -> None:
    """One warning line for the prompts generated again after damage (how many, which, why),
    and the same as an event for events.jsonl."""
    ids = [gid for group_ids in why.values() for gid in group_ids]
    log.warning(
        "prompts generated again after damage to the rollout store (not covered by the checkpoint, and their "
        "data cannot be trained again)",
        count=len(ids),
        ids=summary_ids(ids),
        why={reason: len(group_ids) for reason, group_ids in why.items()},
        **context,
    )
    events.append({"count": len(ids), "groups": ids, "why": {r: list(g) for r, g in why.items()}, **context})


def _failed_groups(store: Store, fresh: Callable[[str], Group | None], *, requeue: bool) -> None:
    """Failed groups of earlier runs (a reward that raised, say) are kept and never trained; their
    prompts come again only in the next epoch. Say so on resume, and with `--requeue-failed-groups`
    (the cause fixed) generate them again now, each once."""
    from storage.transitions import requeue_id

    waiting = [g.group_id for g in store.groups(GroupState.FAILED) if store.get(requeue_id(g.group_id)) is None]
    if not waiting:
        return
    if requeue:
        requeued = store.requeue_failed(fresh)
        log.warning("failed groups of earlier runs: their prompts are generated again", requeued=requeued)
        return
    log.warning(
        "the store holds failed groups of earlier runs (kept, never trained): their prompts come again "
        "only in the next epoch. Once the cause is fixed, add --requeue-failed-groups to generate them "
        "again now (`python -m pipeline.replay RUN_DIR summary` shows their errors)",
        failed_groups=len(waiting),
        first=waiting[:3],
    )


def _continue_from_salvage(
    data_dir: Path,
    options: dict[str, Any],
    meta: RunMeta,
    policy: CheckpointPolicy,
    reason: str,
    fresh: Callable[[str], Group | None],
    n_prompts: int,
    batch_size: int,
) -> tuple[Store, list[dict[str, Any]]]:
    """Move the unreadable store aside, read what can be read from it, reconcile that with the
    newest checkpoint (`pipeline.run.reconcile`), and seed a fresh store with the result. Returns
    the store and the events of the prompts generated again."""
    aside = _move_aside(data_dir)
    versions = checkpoint_versions(policy.dir, policy.publish_dir)
    version = max(versions, default=0)
    coverage = _coverage_of(versions.get(version))
    salvage = storage.salvage_store(aside, replay_after=version - 1)
    plan = reconcile(
        salvage,
        checkpoint_step=version - 1,
        coverage=coverage,
        n_prompts=n_prompts,
        batch_size=batch_size,
        fresh=fresh,
    )
    log.warning(
        "the rollout store is unreadable; it was moved aside, untouched, and a fresh store continues the run",
        moved_to=str(aside),
        fresh_store=str(data_dir),
        reason=reason,
    )
    for problem in salvage.problems:
        log.warning("not recovered from the unreadable store", problem=problem)
    events = _say_reconciled(salvage, plan, version, coverage)
    store = open_store(StoreTransport.LMDB, data_dir, **options)
    # Recorded so that replay says where the batches of the steps before the seed are.
    salvaged_from = {"store": str(aside), "trained_step": plan.trained_step - len(plan.replay)}
    meta = dataclasses.replace(meta, extra={**meta.extra, "salvaged_from": salvaged_from})
    try:
        check_meta(store, meta)
        store.seed(plan.cursor, plan.trained_step, partial=plan.partial, ready=plan.ready, replay=plan.replay)
    except BaseException:
        store.close()
        raise
    return store, events


def _coverage_of(checkpoint: Path | None) -> Coverage | None:
    """What the checkpoint folder records it covers; None for the base model, a checkpoint of an
    older version, or a record that does not decode (said)."""
    if checkpoint is None:
        return None
    try:
        return read_coverage(checkpoint)
    except CorruptRecordError as exc:
        log.warning("the checkpoint's record of what it covers is unreadable: reconciling without it", error=str(exc))
        return None


def _say_reconciled(
    salvage: storage.Salvage, plan: Reconciled, version: int, coverage: Coverage | None
) -> list[dict[str, Any]]:
    """The warnings of a salvage reconciled: steps trained again or lost, the cursor, what was
    carried over, and one line (and event) naming the prompts generated again."""
    checkpoint = f"checkpoint v{version}" if version else "the base model"
    replayed = [b.step for b, _ in plan.replay]
    if replayed:
        log.warning(
            "steps trained after the newest checkpoint are trained again from the batches the unreadable store "
            "still holds (a damaged group is left out of its batch)",
            steps=f"{replayed[0]}..{replayed[-1]}",
            groups=sum(len(b.groups) for b, _ in plan.replay),
            left_out=len(salvage.replay_damaged),
        )
    if salvage.trained_step is not None and salvage.trained_step > plan.trained_step:
        log.warning(
            "steps trained after the newest checkpoint cannot be trained again from the unreadable store: their "
            "prompts are generated again",
            lost_steps=f"{plan.trained_step + 1}..{salvage.trained_step}",
        )
    if salvage.trained_step is None or salvage.trained_step < version - 1:
        log.warning(
            f"the unreadable store's last trained step is {'unreadable' if salvage.trained_step is None else 'older'}"
            f": resuming from the newest checkpoint, {checkpoint}, "
            + ("and what it records it covers" if coverage is not None else "which records nothing of what it covers"),
            store_trained_step=salvage.trained_step,
            resume_at_step=plan.trained_step + 1,
        )
    if salvage.cursor is None and not plan.start_over:
        log.warning(
            f"the dataset cursor is unreadable: rollout continues from the cursor {checkpoint} records, or past the "
            "last prompt the unreadable store names; the prompts admitted after that, which nothing readable names, "
            "are admitted again from there as new work",
            cursor=f"epoch {plan.cursor.epoch}, index {plan.cursor.index}",
        )
    for note in plan.notes:
        log.warning("the unreadable store cannot be fully reconciled", note=note)
    if salvage.partial or salvage.ready or plan.covered_dropped:
        log.warning(
            "groups carried over from the unreadable store",
            partial=len(plan.partial) - len(plan.regenerated),
            ready=len(plan.ready),
            covered_by_the_checkpoint_dropped=plan.covered_dropped,
        )
    events: list[dict[str, Any]] = []
    if plan.regenerated:
        _say_regenerated(dict(plan.why), events, checkpoint=checkpoint)
    return events


def _fresh_group_for(dataset: list[PromptTask], n_samples: int) -> Callable[[str], Group | None]:
    """A new group for the prompt a group id names (`e0003-p000000012`, or a requeued id of it);
    None when the id names no dataset row (another dataset, a hand-made id)."""

    def fresh(group_id: str) -> Group | None:
        prompt = prompt_of(group_id)
        if isinstance(prompt, str) or prompt[1] >= len(dataset):
            return None
        epoch, index = prompt
        return Group.fresh(dataset[index], epoch=epoch, n_samples=n_samples, version=0, seq=0)

    return fresh


def _open_checked(data_dir: Path, options: dict[str, Any], meta: RunMeta) -> Store:
    """The store, checked against this run and recovered after an unclean stop."""
    store = open_store(StoreTransport.LMDB, data_dir, **options)
    try:
        check_meta(store, meta)
        store.recover()
    except BaseException:
        store.close()
        raise
    return store


def _move_aside(data_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = data_dir.with_name(f"{data_dir.name}.unreadable-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = data_dir.with_name(f"{data_dir.name}.unreadable-{stamp}-{n}")
    try:
        os.rename(data_dir, aside)
    except OSError as exc:
        raise StoreError(
            f"the rollout store {data_dir} is unreadable and cannot be moved aside to {aside}: {exc}"
        ) from exc
    return aside
