"""Bring your own prompts: a JSONL file of rows, plus a reward function named `module:function`.

Each line of the file is one JSON object. The prompt is read from `input_key` (a string, or a list
of chat messages `{"role", "content"}`), the label from `label_key`, and every other key lands in
`PromptTask.metadata`, so a reward function can read extra fields without a new loader.

Tokenization happens once, here, and the pipeline never re-tokenizes. A plain-string prompt is
tokenized as is, without special tokens and without a chat template, unless `apply_chat_template`
asks for one: the model family decides what a prompt should look like, not this loader. A message
list always goes through the tokenizer's chat template (there is no other way to turn it into text).

The reward function takes `(task: PromptTask, sample: Sample)` and returns a number, sync or async;
`--custom-rm-path` names it and `stages.plugins` resolves it once, when the config loads, so a
typo fails at start-up rather than an hour into a run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from core.errors import ConfigError
from core.types import PromptTask

__all__ = ["load_jsonl_prompts"]

_MAX_PROBLEMS = 20  # a broken file lists this many problems, not ten thousand


def load_jsonl_prompts(
    path: str | os.PathLike[str],
    tokenizer: Any,
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    apply_chat_template: bool = False,
) -> list[PromptTask]:
    """Read one `PromptTask` per non-blank line of the JSONL file at `path`.

    `tokenizer` is a Hugging Face tokenizer. `label_key=None` reads no label (the reward needs
    none). Every problem in the file is collected into one `ConfigError` that names the file, the
    line number and the missing key or bad value, so one run finds them all.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"prompt file {str(path)!r} cannot be read: {exc}"]) from exc

    tasks: list[PromptTask] = []
    problems: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if len(problems) >= _MAX_PROBLEMS:
            problems.append(f"{path}: stopped reading at line {lineno} after {_MAX_PROBLEMS} problems")
            break
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"{where}: not valid JSON ({exc})")
            continue
        if not isinstance(row, dict):
            problems.append(f"{where}: expected a JSON object, got {type(row).__name__}")
            continue
        missing = [k for k in (input_key, label_key) if k is not None and k not in row]
        if missing:
            problems.append(f"{where}: missing key(s) {missing} (keys present: {sorted(row)})")
            continue
        try:
            prompt_ids = _tokenize(row[input_key], tokenizer, apply_chat_template)
        except ValueError as exc:
            problems.append(f"{where}: key {input_key!r}: {exc}")
            continue
        metadata = {k: v for k, v in row.items() if k not in (input_key, label_key)}
        label = row[label_key] if label_key is not None else None
        tasks.append(PromptTask(index=len(tasks), prompt_ids=prompt_ids, label=label, metadata=metadata))

    if problems:
        raise ConfigError(problems)
    if not tasks:
        raise ConfigError([f"prompt file {str(path)!r} holds no prompts"])
    return tasks


def _tokenize(prompt: Any, tokenizer: Any, apply_chat_template: bool) -> tuple[int, ...]:
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise ValueError("a message list needs objects with 'role' and 'content'")
        messages: list[Any] | None = prompt
    elif isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}] if apply_chat_template else None
    else:
        raise ValueError(f"expected a string or a list of messages, got {type(prompt).__name__}")

    if messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template, and this prompt needs one")
        # Render to text, then tokenize: the same ids whichever return type this transformers
        # version gives for tokenize=True. The template already holds any BOS it wants.
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{prompt!r} tokenizes to nothing")
    return tuple(int(i) for i in ids)
