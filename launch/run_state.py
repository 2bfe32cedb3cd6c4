"""Everything a run needs before its first step: model folder, dataset, store, and where to resume.

A store remembers what it was written for (run id, dataset and tokenizer fingerprints, group size);
reopening it for anything else is refused with the difference named, before any state is touched.

Before an LMDB store is opened, `storage.check_storage` checks where it lives against the
deployment's declaration or profile (a network filesystem nobody declared stops the run) and says
whether commits are fsynced.

Resume rules. The weights (and optimizer state) of the last finished step are loaded, and the
rollout state continues from the store. A store that cannot be opened or whose records do not
decode (a damaged file, another layout) is never deleted: it is moved aside to
`<data dir>.unreadable-<UTC time>`, a warning names it and the reason, and what is still readable
in it (the dataset cursor, the last trained step) seeds a fresh store. An unreadable cursor means
starting from the beginning of the dataset; an unreadable trained step means resuming from the
newest complete weights folder, or the base model when there is none. A store written for another
run (a fingerprint differs) is not damaged, and still stops the run with the difference named.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import orjson
import structlog

from pipeline.config import Config, config_to_dict
from pipeline.trainer_settings import build_trainer, loss_settings
from pipeline.errors import CorruptRecordError, IncompatibleStoreError, StoreError, StoreLockedError
from pipeline.types import Group, PromptTask
from stages.reward import RewardFn
from storage import Cursor, RunMeta, Store, check_storage, load_declaration, open_store
from storage import codec, keys

__all__ = ["RunState", "Salvage", "open_run_state", "salvage_store"]

log = structlog.get_logger("launch")

# lmdb errors that mean the store's bytes are damaged or of another format. Any other lmdb error
# (disk full, permissions, locks, limits) is the machine's problem: the store stays where it is and
# the run stops, since moving a sound store aside would hide it.
_DAMAGED = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError,
            lmdb.PanicError, lmdb.IncompatibleError, lmdb.BadValsizeError, lmdb.BadChecksumError)


@dataclass(frozen=True)
class RunState:
    model_path: Path  # the base model every engine starts from
    dataset: list[PromptTask]
    reward_fn: RewardFn
    store: Store
    start_step: int
    version: int  # the policy version serving at the start
    weights: Path | None  # weights of `version` to load, None for the base model
    make_trainer: Callable[[], Any]


def open_run_state(config: Config) -> RunState:
    from transformers import AutoTokenizer

    from stages.tasks.tiny_model import make_model_folder

    out = Path(config.output.dir)
    if config.engine.hf_checkpoint:
        model_path = Path(config.engine.hf_checkpoint)
    else:
        model_path = out / "model"
        if not (model_path / "config.json").exists():
            make_model_folder(model_path, seed=config.rollout.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset, reward_fn = _dataset(config, tokenizer)

    meta = _run_meta(config, dataset, model_path)
    _remove_unfinished_saves(out / "weights")
    if config.storage.transport == "lmdb":
        store = _open_lmdb(config, meta, out / "weights")
    else:
        store = open_store(config.storage.transport, None)
        _check_meta(store, meta)
    trained = store.trained_step()
    version = trained + 1
    weights = out / "weights" / f"v{version}" if version > 0 else None
    if weights is not None and not (weights / "config.json").exists():
        store.close()
        raise StoreError(f"the store says step {trained} was trained, but its weights {weights} are missing")
    start_from = weights or model_path

    settings = config_to_dict(config)
    t = config.trainer

    def make_trainer() -> Any:
        if t.backend == "megatron":
            from launch.megatron_ranks import start_megatron_trainer

            # Rank 0 is this process; ranks 1.. are started here and stopped by the trainer's close().
            return start_megatron_trainer(
                start_from, world_size=t.num_ranks, tp=t.tensor_model_parallel_size,
                pp=t.pipeline_model_parallel_size, device=t.device, seed=config.rollout.seed, log_dir=out / "logs",
                loss=loss_settings(settings), lr=t.lr, temperature=config.rollout.temperature,
                max_grad_norm=t.max_grad_norm, micro_batch_size=t.micro_batch_size,
            )
        return build_trainer(start_from, settings)

    return RunState(model_path, dataset, reward_fn, store, trained + 1, version, weights, make_trainer)


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
        from stages.tasks.jsonl import load_jsonl_prompts

        tasks = load_jsonl_prompts(d.prompt_data, tokenizer, input_key=d.input_key, label_key=d.label_key)
        return tasks, d.reward_fn
    from stages.tasks.toy import toy_dataset, toy_reward

    return toy_dataset(d.num_prompts, seed=config.rollout.seed), d.reward_fn or toy_reward


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(orjson.dumps(obj)).hexdigest()[:16]


def _run_meta(config: Config, dataset: list[PromptTask], model_path: Path) -> RunMeta:
    tokenizer_file = model_path / "tokenizer.json"
    return RunMeta(
        run_id=config.storage.run_id,
        dataset_fingerprint=_fingerprint([[t.prompt_ids, t.label] for t in dataset]),
        tokenizer_fingerprint=hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()[:16]
        if tokenizer_file.exists() else "none",
        n_samples_per_prompt=config.rollout.n_samples_per_prompt,
        extra={"config": config_to_dict(config)},
    )


def _check_meta(store: Store, meta: RunMeta) -> None:
    stored = store.read_meta()
    if stored is None:
        store.write_meta(meta)
        return
    for name in ("run_id", "dataset_fingerprint", "tokenizer_fingerprint", "n_samples_per_prompt", "schema_version"):
        if getattr(stored, name) != getattr(meta, name):
            raise IncompatibleStoreError(name, getattr(stored, name), getattr(meta, name))


# --- the LMDB store: declaration, opening, and what happens when it is unreadable ---------------


@dataclass(frozen=True, slots=True)
class Salvage:
    """What could still be read from a store moved aside; None where that record is unreadable."""

    cursor: Cursor | None
    trained_step: int | None
    problems: tuple[str, ...]  # why each missing piece is missing


def _open_lmdb(config: Config, meta: RunMeta, weights_dir: Path) -> Store:
    s = config.storage
    data_dir = Path(s.data_dir)
    plan = check_storage(
        data_dir, declaration=load_declaration(s.declaration) if s.declaration is not None else None,
        profile=s.profile,
    )
    log.info(
        "rollout store", path=plan.data_dir, filesystem=plan.mount.filesystem, mount=plan.mount.mount_point,
        declared_by=plan.declared_by or "detected local disk", synced_commits=plan.sync,
    )
    options = plan.store_options()
    try:
        store = _open_checked(data_dir, options, meta)
    except StoreError as exc:
        reason = _unreadable_reason(exc)
        if reason is None:
            raise
    else:
        return store
    aside = _move_aside(data_dir)
    salvage = salvage_store(aside)
    trained = salvage.trained_step
    if trained is None:
        trained = _newest_weights_step(weights_dir)
    log.warning(
        "the rollout store is unreadable; it was moved aside, untouched, and a fresh store continues the run",
        moved_to=str(aside), reason=reason,
    )
    for problem in salvage.problems:
        log.warning("not recovered from the unreadable store", problem=problem)
    if salvage.cursor is None:
        log.warning("the dataset cursor is unreadable: rollout starts again from the beginning of the dataset")
    if salvage.trained_step is None:
        log.warning(
            "the last trained step is unreadable: resuming from the newest complete weights folder"
            if trained >= 0 else "the last trained step is unreadable and no weights were saved: starting from "
            "the base model", resume_at_step=trained + 1, weights=str(weights_dir / f"v{trained + 1}") if trained >= 0 else None,
        )
    store = open_store("lmdb", data_dir, **options)
    try:
        _check_meta(store, meta)
        _seed(store, salvage.cursor or Cursor(), trained)
    except BaseException:
        store.close()
        raise
    return store


def _open_checked(data_dir: Path, options: dict[str, object], meta: RunMeta) -> Store:
    """The store, checked against this run and recovered after an unclean stop."""
    store = open_store("lmdb", data_dir, **options)
    try:
        _check_meta(store, meta)
        store.recover()
    except BaseException:
        store.close()
        raise
    return store


def _unreadable_reason(exc: StoreError) -> str | None:
    """Why a store counts as unreadable (damaged bytes, another layout), or None: stop the run.

    Unreadable: a record that does not decode, another layout version, LMDB finding its file
    damaged, or the store's own consistency checks failing (a StoreError of its own, no cause). Not
    unreadable: another controller holds it, it belongs to another run (a fingerprint differs), or
    the machine failed it (disk full, permissions, lock limits).
    """
    if isinstance(exc, StoreLockedError):
        return None
    if isinstance(exc, IncompatibleStoreError):
        return str(exc) if exc.field == "schema_version" else None
    if isinstance(exc, CorruptRecordError):
        return str(exc)
    if exc.__cause__ is None:
        return str(exc)
    return str(exc) if isinstance(exc.__cause__, _DAMAGED) else None


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
        raise StoreError(f"the rollout store {data_dir} is unreadable and cannot be moved aside to {aside}: {exc}") from exc
    return aside


def salvage_store(path: str | os.PathLike[str]) -> Salvage:
    """The cursor and the last trained step of a damaged store, each read on its own.

    Opened read-only without LMDB's lock file (nothing else uses a store moved aside), so the
    folder's bytes stay exactly as they were. Each record decodes independently: a damaged cursor
    does not cost the trained step, and the other way round.
    """
    problems: list[str] = []
    try:
        env = lmdb.open(os.fspath(path), readonly=True, lock=False, subdir=True, create=False,
                        max_dbs=len(keys.DATABASES))
    except lmdb.Error as exc:
        return Salvage(None, None, (f"{path} does not open: {exc}",))
    try:
        try:
            meta_db = env.open_db(keys.META, create=False)
            with env.begin(db=meta_db) as txn:
                raw_cursor, raw_step = txn.get(keys.META_CURSOR), txn.get(keys.META_TRAINED_STEP)
                raw_cursor = None if raw_cursor is None else bytes(raw_cursor)
                raw_step = None if raw_step is None else bytes(raw_step)
        except lmdb.Error as exc:
            return Salvage(None, None, (f"the meta records of {path} do not read: {exc}",))
    finally:
        env.close()
    cursor: Cursor | None = Cursor()  # a store that never admitted anything has no cursor record
    if raw_cursor is not None:
        try:
            cursor = codec.decode_cursor(raw_cursor, key=keys.describe(keys.META, keys.META_CURSOR))
        except CorruptRecordError as exc:
            cursor = None
            problems.append(f"cursor: {exc}")
    trained: int | None = -1
    if raw_step is not None:
        try:
            trained = keys.parse_i64(raw_step, key=keys.describe(keys.META, keys.META_TRAINED_STEP))
        except CorruptRecordError as exc:
            trained = None
            problems.append(f"trained step: {exc}")
    return Salvage(cursor, trained, tuple(problems))


def _newest_weights_step(weights_dir: Path) -> int:
    """The step whose complete weights folder `vN` is newest (N - 1), -1 when there is none."""
    versions = [
        int(entry.name[1:]) for entry in weights_dir.glob("v*")
        if entry.name[1:].isdigit() and (entry / "config.json").exists()
    ] if weights_dir.is_dir() else []
    return max(versions, default=0) - 1


def _seed(store: Store, cursor: Cursor, trained: int) -> None:
    """Give a fresh store the salvaged cursor and trained step.

    The store protocol has no setter for the trained step: it moves only by finishing a batch. So
    one empty marker group is admitted (moving the cursor in the same transaction), batched for
    step `trained`, finished, and collected at once; what stays is the trained step, the cursor,
    and a tombstone of the marker (`collected` counts it). The marker's id cannot clash with a
    dataset group (`e0000-p000000012`).
    """
    if trained < 0:
        if cursor != Cursor():
            store.admit([], cursor)
        return
    marker = Group(f"resume-marker-step-{trained}", PromptTask(index=-1, prompt_ids=()), 0, (), trained, seq=-1)
    store.admit([marker], cursor)
    store.put_ready(marker)
    store.take_batch(trained, 1)
    store.finish_batch(trained)
    store.collect_garbage(trained)
