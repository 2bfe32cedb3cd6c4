"""Everything a run needs before its first step: model folder, dataset, store, and where to resume.

A store remembers what it was written for (run id, dataset and tokenizer fingerprints, group size);
reopening it for anything else is refused with the difference named, before any state is touched.

Before an LMDB store is opened, `storage.check_storage` checks where it lives against the
deployment's declaration or profile (a network filesystem nobody declared stops the run) and says
whether commits are fsynced.

Resume rules. The weights (and optimizer state) of the last finished step are loaded, and the
rollout state continues from the store. Opening the store verifies it (LMDB's meta pages, the
layout, the counters against the records, the run record; see `storage.LmdbStore`). A store that
is damaged or of another layout is never deleted: it is moved aside to
`<data dir>.unreadable-<UTC time>`, a warning names both folders and what is damaged, and what is
still readable in it (`storage.salvage_store`: the dataset cursor, the last trained step, every
readable unfinished group) seeds a fresh store (`Store.seed`); the prompts of unfinished groups
whose records are damaged are generated again. An unreadable cursor means starting from the
beginning of the dataset (and carrying no group over); an unreadable trained step means resuming
from the newest complete weights folder, or the base model when there is none. A store that opens
but holds groups quarantined for a damaged record (`GroupState.QUARANTINED`) keeps them, and
their prompts are generated again under a new id. A store written for another run (a fingerprint
differs) is not damaged, and still stops the run with the difference named.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

import storage
from core.errors import ConfigError, CorruptRecordError, StoreError
from core.types import Group, PromptTask, StoreTransport, group_id_for
from pipeline.checkpoints import (
    CHECKPOINTS_DIR,
    PUBLISH_DIR,
    CheckpointPolicy,
    checkpoint_versions,
    prune_checkpoints,
    remove_publish_folders,
)
from pipeline.config import Config, config_to_dict
from pipeline.config.derived import derived
from pipeline.plan import Trainer
from pipeline.run.resume_settings import check_meta, run_meta
from pipeline.trainer_settings import build_trainer
from stages.reward import RewardFn
from storage import (
    Cursor,
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

_GROUP_ID = re.compile(r"^e(?P<epoch>\d+)-p(?P<index>\d+)(\.requeued)*$")


@dataclass(frozen=True)
class RunState:
    model_path: Path  # the base model every engine starts from
    dataset: list[PromptTask]
    reward_fn: RewardFn
    store: Store
    start_step: int
    version: int  # the version of the checkpoint loaded (engines and trainer), 0 for the base model
    weights: Path | None  # the checkpoint of `version` to load, None for the base model
    make_trainer: Callable[[], Trainer]
    agent: Callable[..., Any] | None = None  # the built-in task's agent (`--task tool`), if any
    checkpoints: CheckpointPolicy | None = None
    # When the checkpoint is older than the store's last trained step: the stored batches of steps
    # `version`..`start_step - 1` are trained again before new work (`pipeline.checkpoints`).
    replay_from: int | None = None


def open_run_state(config: Config) -> RunState:
    from transformers import AutoTokenizer

    from pipeline.tasks.tiny_model import built_shape_problem, make_model_folder

    out = Path(derived(config.output.dir, "output.dir"))
    if config.engine.hf_checkpoint:
        model_path = Path(config.engine.hf_checkpoint)
    else:
        model_path = out / "model"
        if not (model_path / "config.json").exists():
            if config.engine.num_experts is None:
                make_model_folder(model_path, seed=config.rollout.seed)
            else:  # the tiny Qwen3-MoE (R3 has routes to replay)
                make_model_folder(
                    model_path,
                    seed=config.rollout.seed,
                    arch="moe",
                    num_experts=config.engine.num_experts,
                    moe_router_topk=config.rollout.moe_router_topk or 2,
                )
        else:
            problem = built_shape_problem(
                model_path, num_experts=config.engine.num_experts, moe_router_topk=config.rollout.moe_router_topk
            )
            if problem is not None:
                raise ConfigError([problem])
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        # A Hub id with no network (or a typo of one) ends in a long traceback through
        # huggingface_hub and transformers; its first line says what happened.
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        why = (
            f"its tokenizer cannot be loaded ({said})"
            if model_path.exists()
            else f"no such local folder, and it cannot be loaded as a Hugging Face Hub id ({said}); "
            "download it first (huggingface-cli download) and pass its folder"
        )
        raise ConfigError([f"--hf-checkpoint={str(model_path)!r}: {why}"]) from exc
    dataset, reward_fn = _dataset(config, tokenizer)

    meta = run_meta(config, dataset, model_path)
    policy = CheckpointPolicy(
        out / CHECKPOINTS_DIR,
        out / PUBLISH_DIR,
        interval=config.output.save_interval,
        keep_last=config.output.save_keep_last,
    )
    _claim_weights(out / "weights", config)
    for folder in (policy.publish_dir, policy.dir):
        _remove_unfinished_saves(folder)
    if config.storage.transport is StoreTransport.LMDB:
        store = _open_lmdb(config, meta, policy, dataset)
    else:
        store = open_store(config.storage.transport, None)
        check_meta(store, meta)
        if checkpoint_versions(policy.dir, policy.publish_dir):
            log.warning(
                "the memory store keeps nothing to resume from: this run starts at step 0 from the base "
                "model, and its checkpoints replace those in the run folder",
                checkpoints=str(policy.dir),
            )
    trained = store.trained_step()
    try:
        version, weights = _resume_point(store, policy, trained)
    except BaseException:
        store.close()
        raise
    # What the engines loaded between checkpoints is never needed again: a resume reloads the
    # checkpoint. Checkpoints beyond the newest --save-keep-last go too (a kill may have come
    # between a commit and that deletion).
    remove_publish_folders(policy)
    prune_checkpoints(policy, trained + 1)
    start_from = weights or model_path
    settings = config_to_dict(config)
    t = config.trainer

    def make_trainer() -> Trainer:
        if t.backend == "megatron":
            from launch.megatron_ranks import start_megatron_trainer
            from pipeline.trainer_settings import megatron_settings

            # Rank 0 is this process; this node's ranks 1.. are started here and stopped by the
            # trainer's close(); other nodes' ranks are started there (`--node-rank K`) and wait for it.
            return start_megatron_trainer(start_from, log_dir=out / "logs", **megatron_settings(config))
        return build_trainer(start_from, settings, initial_model=model_path)

    agent = None
    if not config.data.prompt_data and config.data.task == "tool":
        from pipeline.tasks.tool_task import lookup_agent

        agent = lookup_agent
    replay_from = version if version <= trained else None
    return RunState(
        model_path,
        dataset,
        reward_fn,
        store,
        trained + 1,
        version,
        weights,
        make_trainer,
        agent,
        checkpoints=policy,
        replay_from=replay_from,
    )


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


def _claim_weights(weights_dir: Path, config: Config) -> None:
    """Refuse to write checkpoints over those an LMDB store of another run counts as trained.

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
    ours = (
        Path(derived(config.storage.data_dir, "storage.data_dir")).resolve()
        if config.storage.transport is StoreTransport.LMDB
        else None
    )
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
    if owner != ours or not record.exists():
        weights_dir.mkdir(parents=True, exist_ok=True)
        mine = None if ours is None else str(ours.relative_to(out) if ours.is_relative_to(out) else ours)
        tmp = record.with_name(f".{_OWNER_FILE}.tmp")
        tmp.write_bytes(orjson.dumps({"lmdb_store": mine}))
        os.replace(tmp, record)


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


def _open_lmdb(config: Config, meta: RunMeta, policy: CheckpointPolicy, dataset: list[PromptTask]) -> Store:
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
        _resume_checks(store, policy, fresh, requeue_failed=config.storage.requeue_failed_groups)
        return store
    return _continue_from_salvage(data_dir, options, meta, policy, reason, fresh, len(dataset))


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
    _resume_checks(store, policy, fresh, requeue_failed=requeue_failed)
    return store


def _resume_checks(
    store: Store, policy: CheckpointPolicy, fresh: Callable[[str], Group | None], *, requeue_failed: bool
) -> None:
    """What a resume checks in a store that opened (closed again if a check fails)."""
    try:
        _requeue_damaged(store, fresh)
        _name_damaged_trained(store, from_step=_resume_version(policy, store.trained_step()))
        _failed_groups(store, fresh, requeue=requeue_failed)
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


def _name_damaged_trained(store: Store, *, from_step: int) -> None:
    """Name, once, the damaged records of the trained groups a resume trains again: the batches of
    steps `from_step` (the checkpoint's version) on, not yet checked
    (`RunMeta.extra["trained_checked_to"]`). What a resume reads stays what it trains again,
    never the whole store: the groups trained before the checkpoint are history (nothing to
    generate or train again), and `replay verify` reads and names every damaged one of them.
    (Before issue 49 this read every trained group once, at a store's first resume: its whole
    size.)"""
    meta = store.read_meta()
    if meta is None:
        return
    checked, trained = int(meta.extra.get("trained_checked_to", -1)), store.trained_step()
    if trained <= checked:
        return
    damaged: list[str] = []
    for step in range(max(checked + 1, from_step), trained + 1):
        errors: list[CorruptRecordError] = []
        try:
            store.batch(step, damaged=errors)  # None for a collected or seeded step: nothing to read
        except StoreError as exc:  # the batch record itself
            damaged.append(str(exc))
        damaged += [str(e.key if isinstance(e.key, str) else e.key.decode(errors="replace")) for e in errors]
    if damaged:
        log.warning(
            "the rollout store holds damaged records of groups already trained, in the batches since the checkpoint: "
            "their data is lost (said once; `python -m pipeline.replay OUTPUT_DIR verify` lists every damaged record)",
            records=damaged,
        )
    store.write_meta(dataclasses.replace(meta, extra={**meta.extra, "trained_checked_to": trained}))


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
) -> Store:
    """Move the unreadable store aside, read what can be read from it, and seed a fresh one."""
    aside = _move_aside(data_dir)
    salvage = storage.salvage_store(aside)
    # A fresh store holds no trained batch to train again: the run continues from the newest
    # checkpoint, and steps trained after it (their batches unreadable now) are lost.
    checkpointed = max(checkpoint_versions(policy.dir, policy.publish_dir), default=0) - 1
    trained = salvage.trained_step
    if trained is None:
        trained = checkpointed
    elif trained > checkpointed:
        log.warning(
            "steps trained after the newest checkpoint cannot be trained again from the unreadable store",
            lost_steps=f"{checkpointed + 1}..{trained}",
        )
        trained = checkpointed
    log.warning(
        "the rollout store is unreadable; it was moved aside, untouched, and a fresh store continues the run",
        moved_to=str(aside),
        fresh_store=str(data_dir),
        reason=reason,
    )
    for problem in salvage.problems:
        log.warning("not recovered from the unreadable store", problem=problem)
    if salvage.cursor is None:
        log.warning("the dataset cursor is unreadable: rollout starts again from the beginning of the dataset")
    if salvage.trained_step is None:
        log.warning(
            "the last trained step is unreadable: resuming from the newest complete weights folder"
            if trained >= 0
            else "the last trained step is unreadable and no weights were saved: starting from the base model",
            resume_at_step=trained + 1,
            weights=str(policy.dir / f"v{trained + 1}") if trained >= 0 else None,
        )
    again = [g for g in (fresh(gid) for gid in salvage.damaged) if g is not None]
    if salvage.groups_lost and salvage.cursor is not None:
        again += _unaccounted_prompts(salvage, salvage.cursor, n_prompts, fresh)
    if salvage.partial or salvage.ready or again:
        log.warning(
            "groups carried over from the unreadable store",
            partial=len(salvage.partial),
            ready=len(salvage.ready),
            damaged_generated_again=len(again),
        )
    store = open_store(StoreTransport.LMDB, data_dir, **options)
    # Recorded so that replay says where the batches of the steps before the seed are.
    salvaged_from = {"store": str(aside), "trained_step": trained}
    meta = dataclasses.replace(meta, extra={**meta.extra, "salvaged_from": salvaged_from})
    try:
        check_meta(store, meta)
        store.seed(salvage.cursor or Cursor(), trained, partial=(*salvage.partial, *again), ready=salvage.ready)
    except BaseException:
        store.close()
        raise
    return store


def _unaccounted_prompts(
    salvage: storage.Salvage, cursor: Cursor, n_prompts: int, fresh: Callable[[str], Group | None]
) -> list[Group]:
    """With the groups and their states unreadable, the prompts below the cursor that the batch
    records of the trained steps do not name were partial, ready, rejected or failed: which, the
    lost trees would have said. They are generated again (fresh groups), said in one line; when
    the batch records are gone too, which prompts were trained is unknown, and generating them
    again could train a prompt twice, so they are not, and the line says so."""
    admitted = [(epoch, index) for epoch in range(cursor.epoch + 1) for index in range(n_prompts)]
    admitted = [(e, i) for e, i in admitted if e < cursor.epoch or i < cursor.index]
    if salvage.trained_ids is None:
        log.warning(
            "the groups of the unreadable store cannot be read and which prompts were trained is unknown: "
            "prompts below the cursor that were unfinished are not generated again",
            why=salvage.trained_unknown,
            prompts_below_cursor=len(admitted),
        )
        return []
    trained = set()
    for gid in salvage.trained_ids:
        if (match := _GROUP_ID.match(gid)) is not None:
            trained.add((int(match["epoch"]), int(match["index"])))
    missing = [group_id_for(e, i) for e, i in admitted if (e, i) not in trained]
    groups = [g for g in (fresh(gid) for gid in missing) if g is not None]
    if missing:
        log.warning(
            "the groups of the unreadable store cannot be read: prompts below the cursor that no trained batch "
            "names (they were partial, ready, rejected or failed) are generated again",
            prompts=len(missing),
            ids=missing if len(missing) <= 20 else [*missing[:20], f"... {len(missing) - 20} more"],
        )
    return groups


def _fresh_group_for(dataset: list[PromptTask], n_samples: int) -> Callable[[str], Group | None]:
    """A new group for the prompt a group id names (`e0003-p000000012`, or a requeued id of it);
    None when the id names no dataset row (another dataset, a hand-made id)."""

    def fresh(group_id: str) -> Group | None:
        match = _GROUP_ID.match(group_id)
        if match is None or int(match["index"]) >= len(dataset):
            return None
        task = dataset[int(match["index"])]
        return Group.fresh(task, epoch=int(match["epoch"]), n_samples=n_samples, version=0, seq=0)

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
