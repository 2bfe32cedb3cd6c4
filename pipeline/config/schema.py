"""The config tree: `Config`, its small sections (`data`, `storage`, `output`), the table of
sections, and the tree to and from plain data (`config_to_dict`, `section_from_dict`).

This module only describes, as do the larger sections beside it (`rollout_section`,
`engine_section`, `trainer_section`). The frozen dataclasses are the tree `load_config` returns;
each field's metadata (`opt(default, flag, kind, help=...)`, see `fields`) says its flag
(slime's name where slime has the concept), how a flag or TOML value converts, and its simple
bounds. Nothing here reads a file, imports a heavy module or resolves a plugin: `parsing` reads
flags and TOML against this schema, `rules` checks the values, and `load` runs the one step that
touches the outside world.

To add a setting, add one field line to its section; the flag, its help, TOML key, bounds and
`config_to_dict` follow from it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from core.types import StoreTransport
from pipeline.config.engine_section import EngineConfig
from pipeline.config.fields import FUNCTION_PATH, Opt, opt, options, resolved, typed
from pipeline.config.rollout_section import RolloutConfig
from pipeline.config.trainer_section import TrainerConfig
from storage.declaration import PROFILES

__all__ = [
    "SECTIONS",
    "Config",
    "DataConfig",
    "OutputConfig",
    "StorageConfig",
    "config_to_dict",
    "opt_of",
    "section_from_dict",
]


@dataclass(frozen=True, slots=True)
class DataConfig:
    prompt_data: Path | None = opt(
        None, "--prompt-data", "path", default_help="the built-in toy task", help="JSONL prompt file"
    )
    input_key: str = opt("prompt", "--input-key", "str", metavar="KEY", help="JSONL key of the prompt text")
    label_key: str = opt("label", "--label-key", "str", metavar="KEY", help="JSONL key of the label")
    num_prompts: int = opt(512, "--num-prompts", "int", ge=1, help="size of the built-in toy dataset")
    task: str = opt(
        "toy",
        "--task",
        "choice",
        choices=("toy", "tool"),
        help="built-in task without --prompt-data: toy (one turn) or tool (multi-turn: look up, then reply)",
    )
    custom_rm_path: str | None = opt(
        None,
        "--custom-rm-path",
        "str",
        metavar=FUNCTION_PATH,
        default_help="the toy task's reward",
        help="reward function",
    )
    dynamic_sampling_filter_path: str | None = opt(
        None, "--dynamic-sampling-filter-path", "str", metavar=FUNCTION_PATH, help="group acceptance filter"
    )
    rollout_all_samples_process_path: str | None = opt(
        None,
        "--rollout-all-samples-process-path",
        "str",
        metavar=FUNCTION_PATH,
        help="sees every group, filtered-out ones too (sync mode only)",
    )
    buffer_filter_path: str | None = opt(
        None,
        "--buffer-filter-path",
        "str",
        metavar=FUNCTION_PATH,
        help="picks groups from the memory store's buffer (memory transport only)",
    )
    custom_generate_function_path: str | None = opt(
        None,
        "--custom-generate-function-path",
        "str",
        metavar=FUNCTION_PATH,
        default_help="one request per sample",
        help="multi-turn agent `async def run(ctx, sample)` (see stages.agent)",
    )
    # Filled by load_config from the paths above; None when the path is unset.
    agent_fn: Callable[..., Any] | None = resolved("custom_generate_function_path")
    reward_fn: Callable[..., Any] | None = resolved("custom_rm_path")
    filter_fn: Callable[..., Any] | None = resolved("dynamic_sampling_filter_path")
    all_samples_process_fn: Callable[..., Any] | None = resolved("rollout_all_samples_process_path")
    buffer_filter_fn: Callable[..., Any] | None = resolved("buffer_filter_path")


@dataclass(frozen=True, slots=True)
class StorageConfig:
    transport: StoreTransport = opt(
        StoreTransport.MEMORY,
        "--rollout-data-transport",
        "choice",
        choices=tuple(StoreTransport),
        help="where rollout state lives",
    )
    data_dir: Path | None = opt(
        None, "--rollout-data-dir", "path", default_help="<output dir>/rollout_data", help="LMDB folder"
    )
    run_id: str = opt("default", "--rollout-queue-run-id", "str", metavar="ID", help="names the run and its store")
    declaration: Path | None = opt(
        None,
        "--rollout-storage-declaration",
        "path",
        metavar="FILE.json",
        help='what the LMDB folder\'s mount is: {"mount_path", "filesystem", "durability": '
        '{"synced_commits"}}; needed on a network filesystem',
    )
    profile: str | None = opt(
        None,
        "--rollout-storage-profile",
        "choice",
        choices=tuple(PROFILES),
        default_help="detect; local only",
        help="a preset declaration for the LMDB folder's filesystem",
    )
    requeue_failed_groups: bool = opt(
        False,
        "--requeue-failed-groups",
        "bool",
        help="on resume (LMDB), generate the prompts of groups that failed in earlier runs again now, each once "
        "(the failed groups stay, counted); without it they come again in the next epoch",
    )
    gc_keep_steps: int | None = opt(
        None,
        "--rollout-gc-keep-steps",
        "int",
        ge=0,
        default_help="keep everything (replay sees the whole run)",
        help="after each step, delete the trained groups and batches of all but the last N steps "
        "(never those after the newest checkpoint: a resume trains them again)",
    )


@dataclass(frozen=True, slots=True)
class OutputConfig:
    dir: Path | None = opt(
        None, "--output-dir", "path", aliases=("--save",), default_help="runs/<run id>", help="run folder"
    )
    metrics_file: Path | None = opt(
        None, "--metrics-file", "path", default_help="<output dir>/metrics.jsonl", help="metrics JSONL"
    )
    # Checkpoint cadence and retention (pipeline.checkpoints): the engines get weights-only folders
    # between checkpoints, and a resume trains the stored batches after the last checkpoint again.
    save_interval: int = opt(
        10,
        "--save-interval",
        "int",
        ge=1,
        help="a full checkpoint (weights, optimizer, RNG state, step) every N steps and at the last "
        "one; a resume trains the stored batches of the steps since again",
    )
    save_keep_last: int = opt(
        3, "--save-keep-last", "int", ge=0, help="checkpoints kept, the newest; 0 keeps every one"
    )
    save_keep_weights: bool = opt(
        False,
        "--save-keep-weights",
        "bool",
        help="keep every weights-only folder the engines loaded between checkpoints (weights/vN, one model a "
        "step), for python -m pipeline.eval of every version afterwards; by default each goes once a later "
        "one is served. Where the weights go by NCCL or CUDA IPC (--colocate), the folders are written for this",
    )
    progress: bool = opt(True, "--progress", "bool", help="progress bar")
    log_level: str = opt(
        "info", "--log-level", "choice", choices=("debug", "info", "warning", "error"), help="log level"
    )
    # Dashboards fed from the same per-step record as the metrics file (extras: see pipeline.metric_sinks).
    use_tensorboard: bool = opt(
        False, "--use-tensorboard", "bool", help="also write each step's metrics to TensorBoard"
    )
    tensorboard_dir: Path | None = opt(
        None, "--tensorboard-dir", "path", default_help="<output dir>/tensorboard", help="TensorBoard event folder"
    )
    use_wandb: bool = opt(False, "--use-wandb", "bool", help="also log each step's metrics to Weights & Biases")
    wandb_project: str = opt("rollout-pipeline", "--wandb-project", "str", metavar="NAME", help="W&B project")
    wandb_group: str | None = opt(None, "--wandb-group", "str", metavar="NAME", help="W&B run group")
    wandb_mode: str = opt(
        "offline",
        "--wandb-mode",
        "choice",
        choices=("offline", "online", "disabled"),
        help="offline writes under --wandb-dir with no network (upload later with `wandb sync`)",
    )
    wandb_dir: Path | None = opt(None, "--wandb-dir", "path", default_help="<output dir>", help="W&B files folder")
    wandb_run_id: str | None = opt(
        None,
        "--wandb-run-id",
        "str",
        metavar="ID",
        default_help="from the run id and output dir, stable across resumes",
        help="W&B run id; a resumed run continues the same W&B run",
    )


@dataclass(frozen=True, slots=True)
class Config:
    """The whole run. From `load_config`, every derived default is filled in and every path resolved."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # Legal but probably unintended settings, for the launcher to log. Not part of the settings.
    warnings: tuple[str, ...] = field(default=(), compare=False)


SECTIONS: dict[str, type] = {
    "rollout": RolloutConfig,
    "data": DataConfig,
    "engine": EngineConfig,
    "storage": StorageConfig,
    "trainer": TrainerConfig,
    "output": OutputConfig,
}


def opt_of(section: str, name: str) -> Opt:
    return next(spec for f, spec in options(SECTIONS[section]) if f.name == name)


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """The settings as JSON-able data (paths as strings, tuples as lists), for run metadata and logs.

    Resolved callables are left out: their `module:function` paths are in the dict already.
    """
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        part = getattr(config, section)
        out[section] = {f.name: _jsonable(getattr(part, f.name)) for f, _ in options(type(part))}
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


_Section = TypeVar("_Section")


def section_from_dict(cls: type[_Section], data: Mapping[str, Any]) -> _Section:
    """A section rebuilt from `config_to_dict`'s output (run metadata): unknown keys are ignored and
    missing ones take the schema's default, so a run recorded by an older version still reads.

    No rule is checked: the values were checked when that run loaded its config.
    """
    kwargs: dict[str, Any] = {}
    for f, spec in options(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if spec.kind == "path" and value is not None:
            value = Path(value)
        elif spec.kind in ("urls", "strs"):
            value = tuple(value)
        kwargs[f.name] = typed(f, value)
    return cls(**kwargs)
