"""A trainer checkpoint on disk: the model folder plus the optimizer state in its `optimizer/` subfolder.

Tensors go to safetensors, step counts and hyperparameters to JSON; never pickle. A subfolder,
because engines load every `*.safetensors` at a folder's top level. The folder is written under a
temporary name beside its final path and renamed into place, so an engine loading it, or a restart
after a crash, never sees half a folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
import torch

from core.errors import PipelineError

__all__ = [
    "OPTIMIZER_DIR",
    "has_optimizer",
    "load_optimizer",
    "load_rng_state",
    "model_folder_files",
    "optimizer_param_names",
    "save_optimizer",
    "save_rng_state",
    "write_folder_atomically",
]

# Files of a model folder that hold weights or the model config: written fresh by `save_pretrained`,
# so they are never copied from the original folder (a stale shard would shadow the new weights).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_REWRITTEN = frozenset({"config.json", "generation_config.json"})
# The optimizer's part of a checkpoint, inside the model folder.
OPTIMIZER_DIR = "optimizer"
_OPTIMIZER_TENSORS = "state.safetensors"
_OPTIMIZER_META = "state.json"
_OPTIMIZER_FORMAT = 1
# The trainer's random state (torch's CPU generator), beside the optimizer's: a resumed run draws
# what the uninterrupted one would have drawn (dropout, if a model config enables it).
_RNG_TENSORS = "rng.safetensors"


def model_folder_files(original: Path) -> dict[str, bytes]:
    """The non-weight files of a model folder (tokenizer, chat template...), read now: a trainer
    keeps them, since the folder it was loaded from (an old checkpoint) may be deleted by
    retention before its next save."""
    return {
        src.name: src.read_bytes()
        for src in original.iterdir()
        if src.is_file() and src.name not in _REWRITTEN and not src.name.endswith(_WEIGHT_SUFFIXES)
    }


def write_folder_atomically(path: Path, original: Path | Mapping[str, bytes], fill: Callable[[Path], None]) -> Path:
    """Write a model folder at `path` (replacing one that is there): `fill(tmp)` writes the weights.

    Tokenizer and other non-weight files come from `original` (a folder, or its files as
    `model_folder_files` read them), so the result loads with `from_pretrained` exactly like it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    files = model_folder_files(original) if isinstance(original, Path) else original
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        fill(tmp)
        if path.exists():
            # Two renames: a reader sees the old folder or (briefly) none, never a mix.
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / "folder")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# An optimizer group's settings that choose a kernel rather than hold the state.
_STEP_KERNEL = ("fused", "foreach", "capturable", "differentiable")


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters, in its order (tied weights appear once)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


def save_optimizer(optimizer: torch.optim.Optimizer, param_names: list[str], steps: int, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().to("cpu").contiguous()
            else:  # a plain number (e.g. `step` on some torch versions)
                scalars.setdefault(str(index), {})[name] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state["param_groups"]]
    save_file(tensors, str(folder / _OPTIMIZER_TENSORS))
    meta = {
        "format": _OPTIMIZER_FORMAT,
        "optimizer": type(optimizer).__name__,
        "trainer_steps": steps,
        "param_names": param_names,
        "param_groups": groups,
        "scalars": scalars,
    }
    (folder / _OPTIMIZER_META).write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))


def has_optimizer(model_folder: Path) -> bool:
    return (model_folder / OPTIMIZER_DIR / _OPTIMIZER_META).exists()


def load_optimizer(
    optimizer: torch.optim.Optimizer, param_names: list[str], folder: Path, device: torch.device, *, owner: Path
) -> int:
    """Restore the state saved by `save_optimizer` into `optimizer`; return the trainer's step count.

    The state (moments, step counts) comes from the checkpoint; the learning rate and weight
    decay stay the constructor's, so a restart may deliberately change them.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = orjson.loads((folder / _OPTIMIZER_META).read_bytes())
        tensors = load_file(str(folder / _OPTIMIZER_TENSORS), device=str(device))
    except (OSError, orjson.JSONDecodeError, SafetensorError) as exc:
        raise PipelineError(f"optimizer checkpoint {folder} is unreadable: {exc}") from exc
    if meta.get("format") != _OPTIMIZER_FORMAT or meta.get("optimizer") != type(optimizer).__name__:
        raise PipelineError(
            f"optimizer checkpoint {folder} is format {meta.get('format')!r} of {meta.get('optimizer')!r}; "
            f"expected format {_OPTIMIZER_FORMAT} of {type(optimizer).__name__!r}"
        )
    if meta["param_names"] != param_names:
        raise PipelineError(f"optimizer checkpoint {folder} was saved for other parameters than {owner}'s")
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = tensor
    for index, entries in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entries)
    current = optimizer.state_dict()["param_groups"]
    if len(current) != len(meta["param_groups"]):
        raise PipelineError(
            f"optimizer checkpoint {folder} has {len(meta['param_groups'])} param groups, expected {len(current)}"
        )
    groups = []
    for saved, now in zip(meta["param_groups"], current, strict=True):
        merged = {k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in saved.items()}
        merged.update(lr=now["lr"], weight_decay=now["weight_decay"], params=now["params"])
        # How the step is computed (AdamW's fused kernel under --trainer-compile on a GPU, foreach
        # otherwise) is this trainer's choice, not the checkpoint's: a run resumed on another
        # device or with the flag changed keeps the kernel it asked for.
        merged.update({k: now[k] for k in _STEP_KERNEL if k in now})
        groups.append(merged)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise PipelineError(f"optimizer checkpoint {folder} does not fit the model: {exc}") from exc
    return int(meta["trainer_steps"])


def save_rng_state(folder: Path) -> None:
    """torch's CPU random state into `folder` (the optimizer subfolder of a checkpoint), as safetensors."""
    from safetensors.torch import save_file

    save_file({"torch_cpu": torch.get_rng_state()}, str(folder / _RNG_TENSORS))


def load_rng_state(folder: Path) -> bool:
    """Restore the random state `save_rng_state` wrote; False (nothing changed) for a checkpoint
    written before it was saved."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / _RNG_TENSORS
    if not path.exists():
        return False
    try:
        torch.set_rng_state(load_file(str(path))["torch_cpu"])
    except (OSError, KeyError, RuntimeError, SafetensorError) as exc:
        raise PipelineError(f"random state {path} is unreadable: {exc}") from exc
    return True
