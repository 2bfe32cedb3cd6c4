"""`load_config`: parse, check, then the one step that touches the outside world, then freeze.

    read flags and TOML  ->  bounds and rules  ->  load step  ->  derived defaults  ->  Config
                               (pure)               (files, torch, plugins, URLs)

The load step (`load_step`) is the only part of loading that reads files (the JSONL prompt file,
the model folder, the storage declaration), imports heavy or user modules (torch, the
`module:function` plugins) or rewrites a value (engine URLs lose their trailing slash). Its
problems join those of the other steps, so the user still gets one `ConfigError` listing them all.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import orjson

from core.errors import ConfigError, PluginError
from core.types import StoreTransport
from pipeline.config.draft import Draft
from pipeline.config.experts import check_experts, experts_in_folder
from pipeline.config.parsing import read_argv, read_toml
from pipeline.config.prompt_file import check_dataset
from pipeline.config.rules import (
    check_bounds,
    check_rules,
    derive_defaults,
    url_problem,
    warn_odd_settings,
)
from pipeline.config.schema import Config, DataConfig
from stages.plugins import resolve_function
from storage.declaration import load_declaration

__all__ = ["load_config", "load_step"]


def load_config(argv: Sequence[str] | None = None, *, toml_path: str | Path | None = None) -> Config:
    """Read flags (and the TOML file they or `toml_path` name), check everything, return the tree.

    Precedence: defaults < TOML file < flags. `--config` in argv replaces `toml_path`, which is
    the file a caller (a launcher with a default file) proposes. argv=None reads sys.argv[1:].
    Raises ConfigError listing every problem; `Config.warnings` lists settings that are legal but
    probably unintended. `--help` prints the help and exits, as command lines do.
    """
    draft = Draft()
    config_file = read_argv(draft, sys.argv[1:] if argv is None else argv)
    if config_file is None and toml_path is not None:
        config_file = Path(toml_path)
    if config_file is not None:
        read_toml(draft, config_file)
    check_bounds(draft)
    check_rules(draft)
    load_step(draft)
    derive_defaults(draft)
    if draft.problems:
        raise ConfigError(draft.problems)
    warn_odd_settings(draft)
    return draft.build()


def load_step(draft: Draft) -> None:
    """Everything that reads files, imports modules or rewrites values, each problem recorded.

    Values that did not convert are skipped (already reported); each check runs even when others
    failed, so that one run of the command shows every problem.
    """
    _normalize_urls(draft)
    _check_model_folder(draft)
    device = draft.get("trainer", "device")
    if device is not None and device != "cpu":
        _check_device(draft, device)  # imports torch: only when it matters
    check_dataset(draft)  # every line of the prompt file; the batch size against the dataset
    _check_installed_backends(draft)
    declaration = draft.get("storage", "declaration")
    if declaration is not None:
        # The file's shape is checked now; whether it matches the mount is checked when the store
        # opens (`storage.check_storage`), since the data folder may not exist yet.
        try:
            load_declaration(declaration)
        except ConfigError as exc:
            draft.problems.extend(exc.problems)
    _resolve_plugins(draft)
    _fresh_run_folder(draft)


def _fresh_run_folder(draft: Draft) -> None:
    """One run, one folder: a memory run given neither --output-dir nor a run id gets a fresh
    folder, `runs/<run id>-<UTC time>`, since it can never be resumed (its state dies with it).

    An LMDB run keeps `runs/<run id>` (derived in `rules.derive_defaults`): running the same
    command again must find its store. A folder that already holds another run is refused when
    the run starts (`pipeline.run.folder`), naming the flag that fixes it.
    """
    if draft.given("output", "dir") or draft.given("storage", "run_id") or not draft.ok("storage", "run_id"):
        return
    if draft.get("storage", "transport") != StoreTransport.MEMORY:
        return
    if (draft.get("trainer", "num_nodes") or 1) > 1:
        return  # every node derives the folder itself: `runs/<run id>`, the same on each, not a time
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = Path("runs") / f"{draft.values['storage']['run_id']}-{stamp}"
    folder, n = base, 1
    while folder.exists():  # two runs started within one second
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    draft.values["output"]["dir"] = folder


def _check_installed_backends(draft: Draft) -> None:
    """megatron-core, the router, Ray and SGLang, when asked for, must be importable here (found, not imported)."""
    import importlib.util

    if draft.get("trainer", "backend") == "megatron" and (
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
    ):
        draft.problems.append(
            "--train-backend=megatron: megatron-core is not installed (pip install 'rollout-pipeline[megatron]')"
        )
    e = draft.values["engine"]
    several = (draft.ok("engine", "urls") and len(e["urls"]) > 1) or (
        not e["urls"] and not e["router_url"] and draft.ok("engine", "num_engines") and e["num_engines"] > 1
    )
    if several and importlib.util.find_spec("sglang_router") is None:
        # Found here, not 25 s into start-up when the engines are up and the router will not start.
        given = draft.show("engine", "urls") if e["urls"] else draft.show("engine", "num_engines")
        draft.problems.append(
            f"{given}: several engines need the sglang-router in front of them, and it is not installed "
            "for this Python (pip install 'rollout-pipeline[router]', or one engine)"
        )
    if draft.get("rollout", "producers") == "ray" and importlib.util.find_spec("ray") is None:
        # Found here, not after the engines came up, in a traceback asking for a bug report.
        draft.problems.append(
            f"{draft.show('rollout', 'producers')}: Ray is not installed for this Python ({sys.executable}); "
            "install it (pip install 'rollout-pipeline[ray]') or use --rollout-producers local"
        )
    if draft.get("engine", "launcher") == "sglang" and importlib.util.find_spec("sglang") is None:
        draft.problems.append(
            "--rollout-engine=sglang: SGLang is not installed for this Python "
            f"({sys.executable}: python -m sglang.launch_server cannot run); install it "
            "(pip install sglang) or use --rollout-engine builtin"
        )


def _normalize_urls(draft: Draft) -> None:
    e = draft.values["engine"]
    if draft.ok("engine", "urls"):
        e["urls"] = tuple(u.rstrip("/") for u in e["urls"])
    router = draft.get("engine", "router_url")
    if router and url_problem(router) is None:
        e["router_url"] = router.rstrip("/")


def _check_model_folder(draft: Draft) -> None:
    ckpt = draft.get("engine", "hf_checkpoint")
    if not ckpt:
        return
    shown = draft.show("engine", "hf_checkpoint")
    local = Path(ckpt).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            draft.problems.append(f"{shown}: not a model folder (no config.json)")
        elif (draft.get("trainer", "expert_model_parallel_size") or 1) > 1 and draft.get(
            "trainer", "backend"
        ) == "megatron":
            _check_folder_experts(draft, local / "config.json", shown)
    elif ckpt.startswith(("/", ".", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", ckpt):
        draft.problems.append(f"{shown}: folder not found")
    else:
        draft.warnings.append(f"{shown}: no such local folder; it will be treated as a Hugging Face Hub id")


def _check_folder_experts(draft: Draft, config_json: Path, shown: str) -> None:
    """--expert-model-parallel-size against the checkpoint's experts per layer (pipeline.config.experts)."""
    try:
        config = orjson.loads(config_json.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        draft.problems.append(f"{shown}: config.json is unreadable ({exc})")
        return
    check_experts(draft, experts_in_folder(config), shown)


def _check_device(draft: Draft, device: str) -> None:
    import torch

    shown = draft.show("trainer", "device")
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        draft.problems.append(f"{shown}: not a torch device ({exc})")
        return
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            draft.problems.append(f"{shown}: torch sees no GPU here (a CPU build of torch, or no driver)")
        elif parsed.index is not None and parsed.index >= count:
            draft.problems.append(f"{shown}: torch sees {count} GPU(s), numbered from 0")
    elif parsed.type != "cpu":
        draft.problems.append(f"{shown}: the built-in trainer runs on cpu or cuda (ROCm included)")


def _resolve_plugins(draft: Draft) -> None:
    """Import every `module:function` path now, so a typo fails before any engine starts."""
    for f in fields(DataConfig):
        path_field = f.metadata.get("plugin_of")
        if path_field is None:
            continue
        path = draft.values["data"][path_field]
        if not path or not draft.ok("data", path_field):
            continue
        try:
            draft.resolved["data", f.name] = resolve_function(path)
        except PluginError as exc:
            reason = str(exc).removeprefix(f"{exc.path!r}: ")
            draft.problems.append(f"{draft.show('data', path_field)}: {reason}")
