"""The prompt file and the dataset's size, checked when the config loads (part of `load`'s step).

Every line of `--prompt-data` is read here, so that a bad line is a config error (exit 2) before the
run folder, the model or the metrics file is written, not a failure after start-up. The loader
(`pipeline.tasks.jsonl`) still tokenizes and checks again; this step only reads JSON.

Also checked, since they waste a run without a word otherwise:
- `--rollout-batch-size` above the number of prompts: every batch holds a prompt twice (a warning);
- prompts with characters the built-in tiny model's tokenizer lacks (no `--hf-checkpoint`): they
  would be read as padding, silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.config.draft import Draft

__all__ = ["check_dataset"]

_SHOWN = 5  # bad lines named one by one; the rest are counted


def check_dataset(draft: Draft) -> None:
    """The prompt file line by line, then the batch size and characters against the dataset."""
    path: Path | None = draft.get("data", "prompt_data")
    if path is None:
        size = draft.get("data", "num_prompts")  # the built-in tasks make this many prompts
        _check_batch_size(draft, size, draft.show("data", "num_prompts"))
        return
    prompts = _read_prompt_file(draft, path)
    if prompts is None:
        return
    _check_batch_size(draft, len(prompts), f"{draft.show('data', 'prompt_data')} ({len(prompts)} prompts)")
    if draft.get("engine", "hf_checkpoint") is None:
        _check_tiny_characters(draft, prompts)


def _check_batch_size(draft: Draft, size: int | None, what: str) -> None:
    batch = draft.get("rollout", "rollout_batch_size")
    if size is None or batch is None or batch <= size:
        return
    # A warning, not a refusal: a few prompts and a bigger batch is a legal smoke test; what must
    # not happen is that it passes unnoticed.
    draft.warnings.append(
        f"{draft.show('rollout', 'rollout_batch_size')} with {what}: every batch holds some prompts more "
        f"than once (one group per prompt, the dataset taken again); lower it to {size} or add prompts"
    )


def _read_prompt_file(draft: Draft, path: Path) -> list[tuple[int, Any]] | None:
    """(line number, prompt) of every record; None when the file has problems (recorded)."""
    shown = draft.show("data", "prompt_data")
    if not path.is_file():
        draft.problems.append(f"{shown}: {'is not a file' if path.exists() else 'file not found'}")
        return None
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        draft.problems.append(f"{shown}: cannot be read: {exc}")
        return None
    records: list[tuple[int, Any]] = []
    bad: list[str] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except ValueError as exc:
            if not records and not bad:
                draft.problems.append(f"{shown}: first record is not JSON: {exc}")
                return None
            bad.append(f"line {lineno}: not JSON ({exc})")
    if not records:
        draft.problems.append(f"{shown}: the file has no records")
        return None
    if not _first_record_keys(draft, path, records[0][1]):
        return None
    input_key, label_key = draft.get("data", "input_key"), draft.get("data", "label_key")
    has_label = label_key in records[0][1]
    prompts: list[tuple[int, Any]] = []
    for lineno, record in records:
        if not isinstance(record, dict):
            bad.append(f"line {lineno}: a JSON {type(record).__name__}, not an object")
        elif input_key not in record:
            bad.append(f"line {lineno}: no {input_key!r} key (keys: {', '.join(map(repr, record)) or 'none'})")
        elif has_label and label_key not in record:
            bad.append(f"line {lineno}: no {label_key!r} key, which the first record has")
        elif not isinstance(record[input_key], (str, list)):
            bad.append(f"line {lineno}: {input_key!r} is a {type(record[input_key]).__name__}, not text or messages")
        else:
            prompts.append((lineno, record[input_key]))
    if bad:
        more = f"; and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        draft.problems.append(f"{shown}: {len(bad)} bad record(s): " + "; ".join(bad[:_SHOWN]) + more)
        return None
    return prompts


def _first_record_keys(draft: Draft, path: Path, record: Any) -> bool:
    shown = draft.show("data", "prompt_data")
    if not isinstance(record, dict):
        draft.problems.append(f"{shown}: records must be JSON objects, the first is a {type(record).__name__}")
        return False
    keys = ", ".join(map(repr, record)) or "none"
    first = f"the first record of {str(path)!r} has no such key (keys: {keys})"
    ok = True
    if draft.ok("data", "input_key") and draft.values["data"]["input_key"] not in record:
        draft.problems.append(f"{draft.show('data', 'input_key')}: {first}")
        ok = False
    if draft.ok("data", "label_key") and draft.values["data"]["label_key"] not in record:
        draft.warnings.append(f"{draft.show('data', 'label_key')}: {first}; the reward gets no label")
    return ok and draft.ok("data", "input_key")


def _check_tiny_characters(draft: Draft, prompts: list[tuple[int, Any]]) -> None:
    """The tiny model's tokenizer has one token per character of `CHARS`; any other character
    would be read as padding. Name the first prompts that have some, and the characters."""
    from pipeline.tasks.tiny_model import CHARS

    known = set(CHARS)
    bad: list[str] = []
    for lineno, prompt in prompts:
        text = (
            prompt
            if isinstance(prompt, str)
            else " ".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
        )
        if missing := sorted(set(text) - known):
            bad.append(f"line {lineno} {text[:40]!r} has {''.join(missing)!r}")
    if bad:
        more = f"; and {len(bad) - _SHOWN} more prompts" if len(bad) > _SHOWN else ""
        draft.problems.append(
            f"{draft.show('data', 'prompt_data')} without --hf-checkpoint: the built-in tiny model's tokenizer "
            f"knows only {CHARS!r} (lower case, digits, ' =+-*:?,.!'); "
            + "; ".join(bad[:_SHOWN])
            + more
            + ". Use --hf-checkpoint with your model, or prompts in those characters"
        )
