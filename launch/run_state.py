"""Everything a run needs before its first step: model folder, dataset, store, and where to resume.

A store remembers what it was written for (run id, dataset and tokenizer fingerprints, group size);
reopening it for anything else is refused with the difference named, before any state is touched.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from pipeline.config import Config, config_to_dict
from pipeline.errors import IncompatibleStoreError, StoreError
from pipeline.types import PromptTask
from stages.reward import RewardFn
from storage import RunMeta, Store, open_store

__all__ = ["RunState", "open_run_state"]


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

    from stages.grpo_trainer import GRPOTrainer
    from stages.tiny_model import make_model_folder

    out = Path(config.output.dir)
    if config.engine.hf_checkpoint:
        model_path = Path(config.engine.hf_checkpoint)
    else:
        model_path = out / "model"
        if not (model_path / "config.json").exists():
            make_model_folder(model_path, seed=config.rollout.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset, reward_fn = _dataset(config, tokenizer)

    data_dir = config.storage.data_dir
    store = open_store(config.storage.transport, data_dir)
    try:
        _check_meta(store, config, dataset, model_path)
        store.recover()
    except BaseException:
        store.close()
        raise
    trained = store.trained_step()
    version = trained + 1
    _remove_unfinished_saves(out / "weights")
    weights = out / "weights" / f"v{version}" if version > 0 else None
    if weights is not None and not (weights / "config.json").exists():
        store.close()
        raise StoreError(f"the store says step {trained} was trained, but its weights {weights} are missing")
    t = config.trainer
    start_from = weights or model_path

    def make_trainer() -> GRPOTrainer:
        return GRPOTrainer(
            start_from, lr=t.lr, eps_clip=t.eps_clip, eps_clip_high=t.eps_clip_high,
            tis_cap=t.tis_clip if t.use_tis else None,
            mask_offpolicy_in_partial_rollout=config.rollout.mask_offpolicy_in_partial_rollout,
            temperature=config.rollout.temperature, max_grad_norm=t.max_grad_norm, seed=config.rollout.seed,
        )

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
        from stages.jsonl_task import load_jsonl_prompts

        tasks = load_jsonl_prompts(d.prompt_data, tokenizer, input_key=d.input_key, label_key=d.label_key)
        return tasks, d.reward_fn
    from stages.toy_task import toy_dataset, toy_reward

    return toy_dataset(d.num_prompts, seed=config.rollout.seed), d.reward_fn or toy_reward


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(orjson.dumps(obj)).hexdigest()[:16]


def _check_meta(store: Store, config: Config, dataset: list[PromptTask], model_path: Path) -> None:
    tokenizer_file = model_path / "tokenizer.json"
    meta = RunMeta(
        run_id=config.storage.run_id,
        dataset_fingerprint=_fingerprint([[t.prompt_ids, t.label] for t in dataset]),
        tokenizer_fingerprint=hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()[:16]
        if tokenizer_file.exists() else "none",
        n_samples_per_prompt=config.rollout.n_samples_per_prompt,
        extra={"config": config_to_dict(config)},
    )
    stored = store.read_meta()
    if stored is None:
        store.write_meta(meta)
        return
    for name in ("run_id", "dataset_fingerprint", "tokenizer_fingerprint", "n_samples_per_prompt", "schema_version"):
        if getattr(stored, name) != getattr(meta, name):
            raise IncompatibleStoreError(name, getattr(stored, name), getattr(meta, name))
