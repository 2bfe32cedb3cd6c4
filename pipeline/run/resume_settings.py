"""What a store was written for (`run_meta`, checked on every open by `check_meta`), and what a
resume does with settings that differ from those the store recorded.

Every setting is recorded in the store (`RunMeta.extra["config"]`, the settings in force). On a
resume each one that changed is either refused, naming both values, or accepted; an accepted
change is recorded (`RunMeta.extra["config_changes"]`: the setting, both values and the first step
trained with the new one), `config` is updated to the new values, and `replay summary` shows both.

Refused, because the stored state or the checkpoints would mean something else:

- `--n-samples-per-prompt`: stored groups hold G samples each; advantages are normalised over G.
- `--rollout-queue-run-id`: the store belongs to one run.
- `--train-backend`: `weights/vN` holds that backend's optimizer state.
- The dataset (`--prompt-data`, `--input-key`, `--label-key`, `--num-prompts`, `--task`, and
  `--rollout-seed` for the built-in tasks), refused by content (the dataset fingerprint), so a
  prompt file that only moved is accepted: group ids are dataset positions, the cursor counts rows.
- The tokenizer (`--hf-checkpoint`'s `tokenizer.json`), refused by content (its fingerprint):
  stored token ids would decode to other text.

Accepted and recorded: every other setting. Rollout shape (`--rollout-batch-size`,
`--over-sampling-batch-size`, `--rollout-mode`, `--partial-rollout`, `--max-staleness`,
`--rollout-max-response-len`: a stored partial sample longer than a lowered limit is truncated,
never regenerated), sampling, the trainer's loss and optimizer settings (the optimizer state is
loaded, then the new learning rate applies), `--num-rollout` (extending a run is the usual reason
to resume), engines, timeouts, producers, storage paths and output settings. A change applies from
the step recorded with it: the stored batches of the steps after the last checkpoint, trained
again on resume, run with the settings they first ran with (`pipeline.checkpoints`; the settings
of any step: `pipeline.settings_history`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import structlog

from core.errors import IncompatibleStoreError
from core.types import PromptTask
from pipeline.config import Config, config_to_dict
from pipeline.config.schema import opt_of
from storage import RunMeta, Store

log = structlog.get_logger("launch")

__all__ = [
    "REFUSED",
    "SettingChange",
    "changed_settings",
    "check_meta",
    "refused_change",
    "run_meta",
    "without_secrets",
]

# Settings whose change a resume refuses by name (the dataset and tokenizer by their fingerprints).
REFUSED: Mapping[str, str] = {
    "rollout.n_samples_per_prompt": "stored groups hold that many samples each",
    "storage.run_id": "the store belongs to one run",
    "trainer.backend": "the checkpoints (weights/vN) hold that backend's optimizer state",
}
# The RunMeta fields that are settings, checked before the recorded settings are.
_META_SETTINGS = {"run_id": "storage.run_id", "n_samples_per_prompt": "rollout.n_samples_per_prompt"}
# Values never written to disk (the store's settings, their history, the run folder's config.json):
# a secret is recorded only as "<set>" or None, so a copied run folder does not carry the key.
_SECRET = frozenset({"engine.api_key"})

SettingChange = dict[str, Any]  # {"step": int, "setting": "section.name", "from": old, "to": new}


def changed_settings(stored: Mapping[str, Any], now: Mapping[str, Any], *, step: int) -> list[SettingChange]:
    """Each setting whose value differs between two `config_to_dict` trees, as a change record
    taking effect at `step`. A setting only one side has (a newer or older version of this
    library) is a change from or to None."""
    changes: list[SettingChange] = []
    for section in sorted(set(stored) | set(now)):
        old_part, new_part = stored.get(section) or {}, now.get(section) or {}
        for name in sorted(set(old_part) | set(new_part)):
            old, new = old_part.get(name), new_part.get(name)
            if old == new:
                continue
            setting = f"{section}.{name}"
            if setting in _SECRET:
                old, new = _shown_secret(old), _shown_secret(new)
            changes.append({"step": step, "setting": setting, "from": old, "to": new})
    return changes


def refused_change(changes: list[SettingChange]) -> tuple[SettingChange, str] | None:
    """The first change a resume refuses, with the reason; None when all are accepted."""
    for change in changes:
        if (why := REFUSED.get(change["setting"])) is not None:
            return change, why
    return None


def flag_of(setting: str) -> str:
    """`rollout.rollout_batch_size` -> `rollout_batch_size`, the name the store's errors use."""
    return setting.split(".", 1)[1]


def _shown_secret(value: object) -> str | None:
    return None if value is None else "<set>"


def without_secrets(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A `config_to_dict` tree fit to persist: each secret replaced by "<set>" (or None)."""
    out = {section: dict(part) if isinstance(part, Mapping) else part for section, part in tree.items()}
    for setting in _SECRET:
        section, name = setting.split(".", 1)
        part = out.get(section)
        if isinstance(part, dict) and name in part:
            part[name] = _shown_secret(part[name])
    return out


# --- what a store was written for: checked on every open, settings changes recorded -------------


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(orjson.dumps(obj)).hexdigest()[:16]


def run_meta(config: Config, dataset: list[PromptTask], model_path: Path) -> RunMeta:
    tokenizer_file = model_path / "tokenizer.json"
    return RunMeta(
        run_id=config.storage.run_id,
        dataset_fingerprint=_fingerprint([[t.prompt_ids, t.label] for t in dataset]),
        tokenizer_fingerprint=hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()[:16]
        if tokenizer_file.exists()
        else "none",
        n_samples_per_prompt=config.rollout.n_samples_per_prompt,
        extra={"config": without_secrets(config_to_dict(config))},
    )


def check_meta(store: Store, meta: RunMeta) -> None:
    stored = store.read_meta()
    if stored is None:
        store.write_meta(meta)
        return
    for name in ("run_id", "dataset_fingerprint", "tokenizer_fingerprint", "n_samples_per_prompt", "schema_version"):
        old, new = getattr(stored, name), getattr(meta, name)
        if old == new:
            continue
        if (setting := _META_SETTINGS.get(name)) is not None:  # a flag: say how to resume anyway
            raise _refused(setting, old, new)
        raise IncompatibleStoreError(name, old, new)
    _record_setting_changes(store, stored, meta)


def _refused(setting: str, old: object, new: object) -> IncompatibleStoreError:
    """A refused change of `setting` ("section.name"), with the flag that resumes the run and the alternative."""
    name, why = flag_of(setting), REFUSED[setting]
    flag = opt_of(*setting.split(".", 1)).flag
    return IncompatibleStoreError(
        name,
        old,
        new,
        reason=f"the store was written with {name}={old!r}, this run has {name}={new!r}: "
        f"a resume cannot change it ({why}); run it with {flag} {old} again, or start a new run "
        "in another --output-dir",
    )


def _record_setting_changes(store: Store, stored: RunMeta, meta: RunMeta) -> None:
    """Refuse a changed setting that would change what the stored state means, naming both
    values; record every other change, with the first step it applies to (`pipeline.run.resume_settings`)."""
    before, now = stored.extra.get("config"), meta.extra.get("config")
    if not isinstance(before, dict) or not isinstance(now, dict):
        return  # a store written before settings were recorded: nothing to compare
    changes = changed_settings(before, now, step=store.trained_step() + 1)
    if (refused := refused_change(changes)) is not None:
        change, _ = refused
        raise _refused(change["setting"], change["from"], change["to"])
    if not changes:
        return
    history = list(stored.extra.get("config_changes", ()))
    extra = {**stored.extra, "config": now, "config_changes": history + changes}
    store.write_meta(dataclasses.replace(stored, extra=extra))
    log.warning(
        "settings changed since the store was written: accepted and recorded in the store (replay summary shows them)",
        changes=[f"{c['setting']}: {c['from']!r} -> {c['to']!r}" for c in changes],
        from_step=changes[0]["step"],
    )
