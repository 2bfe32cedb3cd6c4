"""The run's configuration: one frozen tree, loaded once, every problem reported together.

    Config
    ├── rollout: RolloutConfig   when batches train, partial rollout, sampling, pacing, timeouts
    ├── data:    DataConfig      prompts, and the user functions (resolved here, at load)
    ├── engine:  EngineConfig    SGLang URLs, or how many built-in engines to start
    ├── storage: StorageConfig   where rollout state lives (memory | lmdb)
    ├── trainer: TrainerConfig   the built-in GRPO trainer's knobs
    └── output:  OutputConfig    run folder, metrics, logging

`load_config(argv)` reads an optional TOML file (`--config FILE.toml`; sections named like the
fields above, keys named like the dataclass fields), lets flags override it, fills the derived
defaults, checks every rule, imports every `module:function` path, and either returns a `Config`
or raises one `ConfigError` that lists every problem, each naming the flag, the value and the rule.
Flags reuse slime's names wherever slime has the concept, so launch scripts carry over.

Only the launcher sees this tree: components take plain parameters (torchtune's recipes vs
components), so nothing downstream re-reads flags or resolves plugins in the hot path.
Relative paths, in flags and in the TOML file alike, are relative to the working directory.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
import tomllib
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, PluginError
from pipeline.plugins import resolve_function
from storage.declaration import PROFILES, load_declaration

__all__ = [
    "Config",
    "DataConfig",
    "EngineConfig",
    "OutputConfig",
    "RolloutConfig",
    "StorageConfig",
    "TrainerConfig",
    "build_parser",
    "config_to_dict",
    "load_config",
]


@dataclass(frozen=True, slots=True)
class _Opt:
    """How one config field is spelled on the command line, parsed, and bounded."""

    flag: str
    kind: str  # int | float | str | path | choice | bool | urls
    help: str
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    default_help: str | None = None  # for derived defaults: what None becomes
    why: str = ""  # appended to a bound's message
    metavar: str | None = None


def _opt(default: Any, flag: str, kind: str, *, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"opt": _Opt(flag, kind, help, **kw)})


def _resolved(path_field: str) -> Any:
    """A callable filled in by load_config from the `module:function` path in `path_field`."""
    return field(default=None, metadata={"plugin_of": path_field})


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    mode: str = _opt(
        "sync", "--rollout-mode", "choice", choices=("sync", "async"),
        help="sync: train after each round; async: keep generating across training steps")
    rollout_batch_size: int = _opt(8, "--rollout-batch-size", "int", ge=1, help="groups per training step")
    n_samples_per_prompt: int = _opt(8, "--n-samples-per-prompt", "int", ge=1, help="samples per group (G)")
    over_sampling_batch_size: int | None = _opt(
        None, "--over-sampling-batch-size", "int", ge=1, default_help="--rollout-batch-size",
        help="groups admitted per refill; smaller than --rollout-batch-size is allowed")
    partial_rollout: bool = _opt(
        False, "--partial-rollout", "bool",
        help="sync mode: at the target, abort the rest and resume their prefixes first next round")
    partial_fill_idle_slots: bool = _opt(
        True, "--partial-fill-idle-slots", "bool",
        help="partial rollout: while a round waits for its stragglers, give idle slots one more group "
        "(more throughput, more off-policy tokens; --no-partial-fill-idle-slots keeps slime's refill rule)")
    mask_offpolicy_in_partial_rollout: bool = _opt(
        False, "--mask-offpolicy-in-partial-rollout", "bool",
        help="zero the loss mask of the prefix that existed before a continuation")
    max_response_len: int = _opt(
        64, "--rollout-max-response-len", "int", ge=1, help="response tokens per sample")
    temperature: float = _opt(
        1.0, "--rollout-temperature", "float", gt=0, help="sampling temperature",
        why=" (the trainer's log-prob correction divides the logits by it)")
    top_p: float = _opt(1.0, "--rollout-top-p", "float", help="nucleus sampling, in (0, 1]")
    top_k: int = _opt(-1, "--rollout-top-k", "int", help="top-k sampling; -1 = off")
    num_rollout: int = _opt(100, "--num-rollout", "int", ge=1, help="training steps")
    prefetch: int | None = _opt(
        None, "--rollout-prefetch", "int", ge=0, default_help="--rollout-batch-size",
        help="ready groups kept ahead of the trainer")
    max_staleness: int | None = _opt(
        None, "--max-staleness", "int", ge=0,
        help="admit no work that would exceed this staleness (versions); unset = no bound")
    pause_mode: str = _opt(
        "abort", "--pause-mode", "choice", choices=("abort", "retract", "in_place"),
        help="how engines pause for a weight publish")
    seed: int = _opt(42, "--rollout-seed", "int", ge=0, help="sampling and data-order seed")
    request_timeout: float = _opt(
        600.0, "--rollout-request-timeout", "float", gt=0, help="seconds per engine request")
    max_retries: int = _opt(3, "--rollout-max-retries", "int", ge=0, help="retries of a failed engine request")
    reward_timeout: float = _opt(30.0, "--reward-timeout", "float", gt=0, help="seconds per reward call")
    eval_interval: int | None = _opt(
        None, "--eval-interval", "int", ge=1, help="inline evaluation every N steps (sync mode only)")

    @property
    def resumes_partial_groups(self) -> bool:
        """Whether aborted groups are kept and resumed: always in async mode, by flag in sync mode."""
        return self.mode == "async" or self.partial_rollout


_FN = "MODULE:FUNCTION"


@dataclass(frozen=True, slots=True)
class DataConfig:
    prompt_data: Path | None = _opt(
        None, "--prompt-data", "path", default_help="the built-in toy task", help="JSONL prompt file")
    input_key: str = _opt("prompt", "--input-key", "str", metavar="KEY", help="JSONL key of the prompt text")
    label_key: str = _opt("label", "--label-key", "str", metavar="KEY", help="JSONL key of the label")
    num_prompts: int = _opt(512, "--num-prompts", "int", ge=1, help="size of the built-in toy dataset")
    custom_rm_path: str | None = _opt(
        None, "--custom-rm-path", "str", metavar=_FN, default_help="the toy task's reward",
        help="reward function")
    dynamic_sampling_filter_path: str | None = _opt(
        None, "--dynamic-sampling-filter-path", "str", metavar=_FN, help="group acceptance filter")
    rollout_all_samples_process_path: str | None = _opt(
        None, "--rollout-all-samples-process-path", "str", metavar=_FN,
        help="sees every group, filtered-out ones too (sync mode only)")
    buffer_filter_path: str | None = _opt(
        None, "--buffer-filter-path", "str", metavar=_FN,
        help="picks groups from the memory store's buffer (memory transport only)")
    # Filled by load_config from the paths above; None when the path is unset.
    reward_fn: Callable[..., Any] | None = _resolved("custom_rm_path")
    filter_fn: Callable[..., Any] | None = _resolved("dynamic_sampling_filter_path")
    all_samples_process_fn: Callable[..., Any] | None = _resolved("rollout_all_samples_process_path")
    buffer_filter_fn: Callable[..., Any] | None = _resolved("buffer_filter_path")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    urls: tuple[str, ...] = _opt(
        (), "--sglang-url", "urls", metavar="URL", default_help="start built-in engines",
        help="an SGLang engine URL (repeatable)")
    router_url: str | None = _opt(
        None, "--sglang-router-url", "str", metavar="URL", help="an SGLang router in front of engines")
    num_engines: int = _opt(
        1, "--rollout-num-engines", "int", ge=1,
        help="built-in engines to start (>1: behind sglang-router); "
        "with --sglang-router-url, the engines behind it")
    sglang_server_concurrency: int = _opt(
        64, "--sglang-server-concurrency", "int", ge=1, help="in-flight samples per engine")
    hf_checkpoint: str | None = _opt(
        None, "--hf-checkpoint", "str", metavar="PATH", default_help="build the tiny model in the run folder",
        help="model folder (or Hub id)")
    host: str = _opt(
        "127.0.0.1", "--engine-host", "str", metavar="HOST", help="address built-in engines bind to")
    # Real SGLang servers started by the pipeline (launch/sglang_server.py).
    launcher: str = _opt(
        "builtin", "--rollout-engine", "choice", choices=("builtin", "sglang"),
        help="engines the pipeline starts when no URL is given: the built-in engine, or real SGLang "
        "(python -m sglang.launch_server, which must be importable here)")
    sglang_devices: str | None = _opt(
        None, "--sglang-devices", "str", metavar="0,1,...", default_help="0 .. engines x GPUs per engine - 1",
        help="--rollout-engine sglang: GPU ids for the engines, in order; each engine takes "
        "--rollout-num-gpus-per-engine of them (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
    gpus_per_engine: int = _opt(
        1, "--rollout-num-gpus-per-engine", "int", ge=1, help="--rollout-engine sglang: GPUs per engine (its --tp-size)")
    sglang_mem_fraction_static: float | None = _opt(
        None, "--sglang-mem-fraction-static", "float", gt=0, default_help="SGLang's default",
        help="--rollout-engine sglang: GPU memory fraction for weights and KV cache")
    sglang_startup_timeout: float = _opt(
        900.0, "--sglang-startup-timeout", "float", gt=0, help="seconds for a started SGLang server to become healthy")
    api_key: str | None = _opt(
        None, "--api-key", "str", metavar="KEY",
        help="sent to engines and the router as 'Authorization: Bearer KEY', and given to the SGLang servers and "
        "router the pipeline starts")


@dataclass(frozen=True, slots=True)
class StorageConfig:
    transport: str = _opt(
        "memory", "--rollout-data-transport", "choice", choices=("memory", "lmdb"),
        help="where rollout state lives")
    data_dir: Path | None = _opt(
        None, "--rollout-data-dir", "path", default_help="<output dir>/rollout_data", help="LMDB folder")
    run_id: str = _opt(
        "default", "--rollout-queue-run-id", "str", metavar="ID", help="names the run and its store")
    declaration: Path | None = _opt(
        None, "--rollout-storage-declaration", "path", metavar="FILE.json",
        help='what the LMDB folder\'s mount is: {"mount_path", "filesystem", "durability": '
        '{"synced_commits"}}; needed on a network filesystem')
    profile: str | None = _opt(
        None, "--rollout-storage-profile", "choice", choices=tuple(PROFILES), default_help="detect; local only",
        help="a preset declaration for the LMDB folder's filesystem")
    gc_keep_steps: int | None = _opt(
        None, "--rollout-gc-keep-steps", "int", ge=0, default_help="keep everything (replay sees the whole run)",
        help="after each step, delete the trained groups and batches of all but the last N steps")


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    lr: float = _opt(5e-3, "--lr", "float", gt=0, help="learning rate")
    eps_clip: float = _opt(0.2, "--eps-clip", "float", gt=0, help="PPO ratio clip (low side)")
    eps_clip_high: float | None = _opt(
        None, "--eps-clip-high", "float", gt=0, default_help="--eps-clip", help="PPO ratio clip, high side")
    use_tis: bool = _opt(True, "--use-tis", "bool", help="truncated importance sampling")
    tis_clip: float = _opt(2.0, "--tis-clip", "float", gt=0, help="TIS ratio cap")
    max_grad_norm: float = _opt(1.0, "--clip-grad", "float", gt=0, help="gradient norm clip")
    global_batch_size: int | None = _opt(
        None, "--global-batch-size", "int", ge=1, default_help="the whole rollout batch (one optimizer step)",
        help="samples per optimizer step; a smaller value splits each rollout batch into several steps, "
        "with the PPO clip acting against the log-probs recomputed before the first")
    tis_mode: str = _opt(
        "truncate", "--tis-mode", "choice", choices=("truncate", "icepop", "seq-mask"),
        help="with --use-tis: truncate = clamp the weight to [--tis-clip-low, --tis-clip]; icepop = drop tokens "
        "whose weight leaves it; seq-mask = drop samples whose geometric-mean weight leaves it")
    tis_clip_low: float = _opt(0.0, "--tis-clip-low", "float", ge=0, help="importance weight lower bound")
    use_opsm: bool = _opt(
        False, "--use-opsm", "bool",
        help="off-policy sequence masking: drop negative-advantage samples whose mean log(mu/pi) > --opsm-delta")
    opsm_delta: float = _opt(1e-4, "--opsm-delta", "float", ge=0, help="OPSM threshold")
    loss_agg_mode: str = _opt(
        "token-mean", "--loss-agg-mode", "choice",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        help="token-mean (slime --calculate-per-token-loss), seq-mean-token-mean (slime's default), "
        "seq-mean-token-sum-norm (Dr.GRPO: divide by samples x --rollout-max-response-len)")
    disable_grpo_std_normalization: bool = _opt(
        False, "--disable-grpo-std-normalization", "bool", help="advantages are reward - group mean (Dr.GRPO)")
    overlong_buffer_len: int = _opt(
        0, "--overlong-buffer-len", "int", ge=0,
        help="DAPO overlong shaping: the last N tokens before --rollout-max-response-len cost reward; 0 = off")
    overlong_penalty_factor: float = _opt(
        1.0, "--overlong-penalty-factor", "float", ge=0, help="DAPO overlong penalty at the length cap")
    mask_truncated_samples: bool = _opt(
        False, "--mask-truncated-samples", "bool",
        help="truncated samples train no token (their reward still counts in the group's statistics)")
    mask_stale_tokens: int | None = _opt(
        None, "--mask-stale-tokens", "int", ge=0, metavar="K",
        help="tokens older than the trained version - K get loss 0; the group and its other tokens train "
        "(--max-staleness instead refuses to admit work)")
    device: str = _opt(
        "cpu", "--trainer-device", "str",
        help="torch device for the built-in trainer: cpu, cuda, cuda:N (ROCm builds of torch call AMD GPUs cuda too)")
    backend: str = _opt(
        "torch", "--train-backend", "choice", choices=("torch", "megatron"),
        help="torch: the single-process GRPO trainer; megatron: megatron-core ranks (pip install .[megatron])")
    num_ranks: int = _opt(
        1, "--actor-num-gpus-per-node", "int", ge=1,
        help="--train-backend megatron: trainer ranks on this host, one process per device (gloo processes on CPU)")
    tensor_model_parallel_size: int = _opt(
        1, "--tensor-model-parallel-size", "int", ge=1, help="--train-backend megatron: tensor parallel size")
    pipeline_model_parallel_size: int = _opt(
        1, "--pipeline-model-parallel-size", "int", ge=1,
        help="--train-backend megatron: pipeline parallel size (only 1 is supported yet)")
    micro_batch_size: int = _opt(
        8, "--micro-batch-size", "int", ge=1,
        help="--train-backend megatron: samples per micro-batch, packed into one sequence")


@dataclass(frozen=True, slots=True)
class OutputConfig:
    dir: Path | None = _opt(
        None, "--output-dir", "path", aliases=("--save",), default_help="runs/<run id>", help="run folder")
    metrics_file: Path | None = _opt(
        None, "--metrics-file", "path", default_help="<output dir>/metrics.jsonl", help="metrics JSONL")
    progress: bool = _opt(True, "--progress", "bool", help="progress bar")
    log_level: str = _opt(
        "info", "--log-level", "choice", choices=("debug", "info", "warning", "error"), help="log level")


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


_SECTIONS: dict[str, type] = {
    "rollout": RolloutConfig,
    "data": DataConfig,
    "engine": EngineConfig,
    "storage": StorageConfig,
    "trainer": TrainerConfig,
    "output": OutputConfig,
}

# Flags users bring from slime that have a different spelling here.
_SLIME_HINTS = {
    "--rollout-function-path": "async rollout is --rollout-mode async here",
    "--collect-aborted-samples": "that is --partial-rollout here",
}


def _options(cls: type) -> list[tuple[Field[Any], _Opt]]:
    return [(f, f.metadata["opt"]) for f in fields(cls) if "opt" in f.metadata]


def _all_flags() -> list[str]:
    flags = ["--config"]
    for cls in _SECTIONS.values():
        for _, opt in _options(cls):
            flags += [opt.flag, *opt.aliases]
            if opt.kind == "bool":
                flags.append("--no-" + opt.flag[2:])
    return flags


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting the process."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError([message])


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser, for `--help` and for `load_config`.

    Values come back as the strings typed (every default is suppressed, so only flags given
    appear): `load_config` converts and checks them all and reports every bad one together,
    where argparse would stop at the first. Abbreviated flags are refused: `--rollout` must not
    silently mean one of five flags.
    """
    parser = _Parser(
        prog="python -m pipeline.launch",
        description="Rollout pipeline for LLM RL. Flags override the --config TOML file.",
        allow_abbrev=False,
        exit_on_error=False,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file; sections: " + ", ".join(_SECTIONS))
    for section, cls in _SECTIONS.items():
        group = parser.add_argument_group(section)
        for f, opt in _options(cls):
            default = opt.default_help or ("none" if f.default in (None, ()) else f.default)
            kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "help": f"{opt.help} (default: {default})"}
            if opt.kind == "bool":
                kwargs["help"] = f"{opt.help} (default: {'on' if f.default else 'off'})"
                group.add_argument(opt.flag, *opt.aliases, action=argparse.BooleanOptionalAction, **kwargs)
                continue
            if opt.kind == "urls":
                kwargs["action"] = "append"
            metavar = opt.metavar or ("{" + ",".join(opt.choices) + "}" if opt.choices else opt.kind.upper())
            group.add_argument(opt.flag, *opt.aliases, metavar=metavar, **kwargs)
    return parser


def _fmt(value: Any) -> str:
    if isinstance(value, Path):
        return repr(str(value))
    if isinstance(value, tuple):
        return repr(list(value))
    return repr(value) if isinstance(value, str) else str(value)


def _close(word: str, candidates: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


class _Bad:
    """Marks a value that did not convert; rules skip it so one mistake is reported once."""


_BAD = _Bad()


class _Loader:
    """One load: values by section and field, where each came from, and what is wrong."""

    def __init__(self) -> None:
        self.values = {s: {f.name: f.default for f, _ in _options(cls)} for s, cls in _SECTIONS.items()}
        self.source: dict[tuple[str, str], str] = {}  # (section, field) -> "flag" | the TOML location
        self.resolved: dict[tuple[str, str], Callable[..., Any]] = {}
        self.problems: list[str] = []
        self.warnings: list[str] = []

    # --- reading -----------------------------------------------------------------------------

    def read_argv(self, argv: Sequence[str]) -> Path | None:
        try:
            namespace, extras = build_parser().parse_known_args(list(argv))
        except argparse.ArgumentError as exc:
            # A flag without its value stops argparse; nothing after it can be read reliably.
            raise ConfigError([str(exc)]) from exc
        self._unknown_args(extras)
        given = vars(namespace)
        config_file = given.pop("config", None)
        for dest, raw in given.items():
            section, name = dest.split(".")
            opt = _opt_of(section, name)
            self.source[section, name] = "flag"
            self.values[section][name] = self._convert_flag(opt, raw)
        return Path(config_file).expanduser() if config_file is not None else None

    def _unknown_args(self, extras: list[str]) -> None:
        known = _all_flags()
        i = 0
        while i < len(extras):
            token = extras[i]
            if token.startswith("-") and not _is_number(token):
                name = token.split("=", 1)[0]
                hint = f" ({_SLIME_HINTS[name]})" if name in _SLIME_HINTS else _close(name, known)
                self.problems.append(f"{name}: unknown flag{hint}")
                # An unknown flag's value would otherwise be reported a second time.
                if "=" not in token and i + 1 < len(extras) and not extras[i + 1].startswith("--"):
                    i += 1
            else:
                self.problems.append(f"{token!r}: unexpected argument (options are --flags)")
            i += 1

    def _convert_flag(self, opt: _Opt, raw: Any) -> Any:
        if opt.kind == "bool":
            return raw  # argparse already made it a bool
        if opt.kind == "urls":
            return tuple(raw)
        try:
            return _parse(opt, raw)
        except ValueError as exc:
            self.problems.append(f"{opt.flag}={raw!r}: {exc}")
            return _BAD

    def read_toml(self, path: Path) -> None:
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            self.problems.append(f"--config={str(path)!r}: file not found")
            return
        except OSError as exc:
            self.problems.append(f"--config={str(path)!r}: cannot be read: {exc.strerror or exc}")
            return
        except tomllib.TOMLDecodeError as exc:
            self.problems.append(f"--config={str(path)!r}: not valid TOML: {exc}")
            return
        for section, table in data.items():
            if section not in _SECTIONS:
                self.problems.append(f"{path}: unknown section [{section}] (sections: "
                                     f"{', '.join(_SECTIONS)}){_close(section, list(_SECTIONS))}")
                continue
            if not isinstance(table, dict):
                self.problems.append(f"{path}: {section} must be a table ([{section}]), got {_fmt(table)}")
                continue
            for key, value in table.items():
                self._toml_value(path, section, key, value)

    def _toml_value(self, path: Path, section: str, key: str, value: Any) -> None:
        names = [f.name for f, _ in _options(_SECTIONS[section])]
        if key not in names:
            underscored = key.replace("-", "_")
            elsewhere = [s for s, cls in _SECTIONS.items() if underscored in {f.name for f, _ in _options(cls)}]
            if underscored in names:
                hint = f" (did you mean {underscored}?)"
            elif elsewhere:
                hint = f" (it belongs in [{elsewhere[0]}])"
            else:
                hint = _close(underscored, names)
            self.problems.append(f"{path}: unknown key {key!r} in [{section}]{hint}")
            return
        where = f"[{section}] {key} in {path}"
        if (section, key) in self.source:
            return  # a flag overrides it; the flag's value is the one to check
        opt = _opt_of(section, key)
        self.source[section, key] = where
        try:
            self.values[section][key] = _from_toml(opt, value)
        except ValueError as exc:
            self.problems.append(f"{opt.flag}={_fmt(value)} ({where}): {exc}")
            self.values[section][key] = _BAD

    # --- checking ----------------------------------------------------------------------------

    def ok(self, section: str, name: str) -> bool:
        return not isinstance(self.values[section][name], _Bad)

    def get(self, section: str, name: str) -> Any:
        """The value, or None where it did not convert (so rules need not guard each use)."""
        value = self.values[section][name]
        return None if isinstance(value, _Bad) else value

    def given(self, section: str, name: str) -> bool:
        return (section, name) in self.source

    def show(self, section: str, name: str) -> str:
        """`--flag=value`, plus where a TOML value came from: the start of every problem."""
        text = f"{_opt_of(section, name).flag}={_fmt(self.values[section][name])}"
        where = self.source.get((section, name), "flag")
        return text if where == "flag" else f"{text} ({where})"

    def bounds(self) -> None:
        for section, cls in _SECTIONS.items():
            for f, opt in _options(cls):
                value = self.values[section][f.name]
                if value is None or not self.ok(section, f.name):
                    continue
                if opt.choices and value not in opt.choices:
                    allowed = ", ".join(opt.choices)
                    self.problems.append(f"{self.show(section, f.name)}: must be one of {allowed}")
                elif opt.ge is not None and value < opt.ge:
                    self.problems.append(f"{self.show(section, f.name)}: must be >= {opt.ge:g}")
                elif opt.gt is not None and not value > opt.gt:
                    self.problems.append(f"{self.show(section, f.name)}: must be > {opt.gt:g}{opt.why}")
                elif opt.kind in ("str", "path") and not str(value).strip():
                    self.problems.append(f"{self.show(section, f.name)}: must not be empty")

    def rules(self) -> None:
        r, s, get = self.values["rollout"], self.values["storage"], self.get
        problem = self.problems.append

        if self.ok("rollout", "top_p") and not 0 < r["top_p"] <= 1:
            problem(f"{self.show('rollout', 'top_p')}: must be in (0, 1]")
        if self.ok("rollout", "top_k") and r["top_k"] != -1 and r["top_k"] < 1:
            problem(f"{self.show('rollout', 'top_k')}: must be -1 (off) or >= 1")

        # The seed's forbidden combinations, each with its rule.
        if get("rollout", "mode") == "async" and get("rollout", "eval_interval") is not None:
            problem(f"{self.show('rollout', 'eval_interval')} with --rollout-mode=async: async rollout does "
                    "not run inline evaluation; evaluate separately")
        if get("rollout", "mode") == "async" and get("data", "rollout_all_samples_process_path"):
            problem(f"{self.show('data', 'rollout_all_samples_process_path')} with --rollout-mode=async: "
                    "async rollout does not support --rollout-all-samples-process-path (it has no "
                    "round boundary to call it at)")
        if get("storage", "transport") == "lmdb" and get("data", "buffer_filter_path"):
            problem(f"{self.show('data', 'buffer_filter_path')} with --rollout-data-transport=lmdb: the LMDB "
                    "store has its own durable ordering (complete, then partial, then new; oldest first)")

        self._trainer_rules()
        if self.ok("trainer", "device") and self.values["trainer"]["device"] != "cpu":
            self._device_rule(self.values["trainer"]["device"])  # imports torch: only when it matters
        self._data_rules()
        self._megatron_rules()
        self._sglang_rules()
        self._engine_rules()
        self._storage_rules()
        if self.ok("storage", "run_id") and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", s["run_id"]):
            problem(f"{self.show('storage', 'run_id')}: must be letters, digits, '.', '_' or '-', starting "
                    "with a letter or digit (it names folders and store keys)")

    def _trainer_rules(self) -> None:
        t, r, ok = self.values["trainer"], self.values["rollout"], self.ok
        if ok("trainer", "tis_clip_low") and ok("trainer", "tis_clip") and not t["tis_clip_low"] < t["tis_clip"]:
            self.problems.append(f"{self.show('trainer', 'tis_clip_low')}: must be below "
                                 f"{self.show('trainer', 'tis_clip')} (the weight's bounds)")
        if ok("trainer", "overlong_buffer_len") and ok("rollout", "max_response_len") and (
            t["overlong_buffer_len"] > r["max_response_len"]
        ):
            self.problems.append(f"{self.show('trainer', 'overlong_buffer_len')}: must be <= "
                                 f"{self.show('rollout', 'max_response_len')} (the buffer ends at the cap)")
        batch_ok = ok("rollout", "rollout_batch_size") and ok("rollout", "n_samples_per_prompt")
        if batch_ok and ok("trainer", "global_batch_size") and t["global_batch_size"] is not None:
            samples = r["rollout_batch_size"] * r["n_samples_per_prompt"]
            if t["global_batch_size"] > samples:
                self.problems.append(f"{self.show('trainer', 'global_batch_size')}: must be <= the samples of one "
                                     f"rollout batch ({samples} = --rollout-batch-size x --n-samples-per-prompt)")

    def _data_rules(self) -> None:
        d = self.values["data"]
        if d["prompt_data"] is None or not self.ok("data", "prompt_data"):
            return
        if not d["custom_rm_path"]:
            self.problems.append(f"{self.show('data', 'prompt_data')}: a JSONL prompt file needs "
                                 "--custom-rm-path (the built-in reward only scores the toy task)")
        path: Path = d["prompt_data"]
        if not path.is_file():
            self.problems.append(f"{self.show('data', 'prompt_data')}: "
                                 f"{'is not a file' if path.exists() else 'file not found'}")
            return
        # Read the first record only: enough to catch a wrong --input-key before any engine starts.
        try:
            with path.open("rb") as fh:
                line = next((ln for ln in fh if ln.strip()), None)
            record = json.loads(line) if line is not None else None
        except (OSError, ValueError) as exc:
            self.problems.append(f"{self.show('data', 'prompt_data')}: first record is not JSON: {exc}")
            return
        if record is None:
            self.problems.append(f"{self.show('data', 'prompt_data')}: the file has no records")
        elif not isinstance(record, dict):
            self.problems.append(f"{self.show('data', 'prompt_data')}: records must be JSON objects, "
                                 f"the first is a {type(record).__name__}")
        else:
            keys = ", ".join(map(repr, record)) or "none"
            if self.ok("data", "input_key") and d["input_key"] not in record:
                self.problems.append(f"{self.show('data', 'input_key')}: the first record of {str(path)!r} "
                                     f"has no such key (keys: {keys})")
            if self.ok("data", "label_key") and d["label_key"] not in record:
                self.warnings.append(f"{self.show('data', 'label_key')}: the first record of {str(path)!r} "
                                     f"has no such key (keys: {keys}); the reward gets no label")

    def _megatron_rules(self) -> None:
        get, show = self.get, self.show
        parallel = ("num_ranks", "tensor_model_parallel_size", "pipeline_model_parallel_size")
        if get("trainer", "backend") != "megatron":
            for name in parallel:
                if (get("trainer", name) or 1) > 1:
                    self.problems.append(f"{show('trainer', name)} with --train-backend=torch: the torch trainer is "
                                         "one process; add --train-backend megatron")
            return
        import importlib.util

        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            self.problems.append("--train-backend=megatron: megatron-core is not installed "
                                 "(pip install 'rollout-pipeline[megatron]')")
        if get("trainer", "global_batch_size") is not None:
            self.problems.append(f"{show('trainer', 'global_batch_size')} with --train-backend=megatron: the megatron "
                                 "backend takes one optimizer step per rollout batch (leave --global-batch-size out)")
        if (get("trainer", "pipeline_model_parallel_size") or 1) > 1:
            self.problems.append(f"{show('trainer', 'pipeline_model_parallel_size')}: pipeline parallelism is not "
                                 "supported by the megatron backend yet; use 1 (tensor and data parallel work)")
        ranks, tp = get("trainer", "num_ranks"), get("trainer", "tensor_model_parallel_size")
        if ranks and tp and ranks % tp:
            self.problems.append(f"{show('trainer', 'tensor_model_parallel_size')}: must divide "
                                 f"{show('trainer', 'num_ranks')} (data parallel = ranks / TP)")

    def _sglang_rules(self) -> None:
        e, get, show = self.values["engine"], self.get, self.show
        if get("engine", "launcher") != "sglang":
            for name in ("sglang_devices", "sglang_mem_fraction_static"):
                if self.given("engine", name):
                    self.warnings.append(f"{show('engine', name)} without --rollout-engine sglang: ignored")
            return
        if e["urls"] or get("engine", "router_url"):
            self.problems.append("--rollout-engine=sglang with --sglang-url/--sglang-router-url: the pipeline starts "
                                 "engines only when it is given none")
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            self.problems.append("--rollout-engine=sglang: SGLang is not installed for this Python "
                                 f"({sys.executable}: python -m sglang.launch_server cannot run); install it "
                                 "(pip install sglang) or use --rollout-engine builtin")
        fraction = get("engine", "sglang_mem_fraction_static")
        if fraction is not None and fraction >= 1:
            self.problems.append(f"{show('engine', 'sglang_mem_fraction_static')}: must be in (0, 1)")
        devices = get("engine", "sglang_devices")
        per = get("engine", "gpus_per_engine") or 1
        if devices is not None:
            ids = [d.strip() for d in devices.split(",")]
            if not all(d.isdigit() for d in ids) or len(set(ids)) != len(ids):
                self.problems.append(f"{show('engine', 'sglang_devices')}: must be distinct GPU ids separated by commas")
            elif len(ids) % per:
                self.problems.append(f"{show('engine', 'sglang_devices')}: {len(ids)} GPUs do not split into engines "
                                     f"of {show('engine', 'gpus_per_engine')}")
            elif self.given("engine", "num_engines") and get("engine", "num_engines") != len(ids) // per:
                self.problems.append(f"{show('engine', 'num_engines')}: --sglang-devices makes {len(ids) // per} "
                                     "engines; leave --rollout-num-engines out")
            else:
                e["num_engines"] = len(ids) // per

    def _storage_rules(self) -> None:
        # The file's shape is checked now; whether it matches the mount is checked when the store opens
        # (`storage.check_storage`), since the data folder may not exist yet.
        path = self.get("storage", "declaration")
        if path is not None:
            try:
                load_declaration(path)
            except ConfigError as exc:
                self.problems.extend(exc.problems)

    def _engine_rules(self) -> None:
        e = self.values["engine"]
        urls = e["urls"] if self.ok("engine", "urls") else ()
        normalized = []
        for url in urls:
            reason = _url_problem(url)
            if reason:
                self.problems.append(f"--sglang-url={url!r}: {reason}")
            normalized.append(url.rstrip("/"))
        for url in sorted({u for u in normalized if normalized.count(u) > 1}):
            self.problems.append(f"--sglang-url={url!r}: given more than once")
        self.values["engine"]["urls"] = tuple(normalized) if self.ok("engine", "urls") else _BAD
        router = self.get("engine", "router_url")
        if router:
            reason = _url_problem(router)
            if reason:
                self.problems.append(f"{self.show('engine', 'router_url')}: {reason}")
            else:
                e["router_url"] = router.rstrip("/")
        if urls and router:
            self.problems.append(f"{self.show('engine', 'router_url')} with --sglang-url: pass engine URLs or "
                                 "one router URL, not both")
        engines = self.get("engine", "num_engines")
        if urls and self.given("engine", "num_engines") and engines not in (None, len(urls)):
            self.problems.append(f"{self.show('engine', 'num_engines')}: {len(urls)} --sglang-url given; the "
                                 "engine count is the number of URLs (leave --rollout-num-engines out)")
        ckpt = e["hf_checkpoint"]
        if ckpt and self.ok("engine", "hf_checkpoint"):
            local = Path(ckpt).expanduser()
            if local.exists():
                if not (local / "config.json").is_file():
                    self.problems.append(f"{self.show('engine', 'hf_checkpoint')}: not a model folder "
                                         "(no config.json)")
            elif ckpt.startswith(("/", ".", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", ckpt):
                self.problems.append(f"{self.show('engine', 'hf_checkpoint')}: folder not found")
            else:
                self.warnings.append(f"{self.show('engine', 'hf_checkpoint')}: no such local folder; it will "
                                     "be treated as a Hugging Face Hub id")

    # --- derived defaults, warnings, plugins ---------------------------------------------------

    def derive(self) -> None:
        """Fill the defaults that depend on other settings. Skipped where their input is bad."""
        r, e, s, t, o = (self.values[k] for k in ("rollout", "engine", "storage", "trainer", "output"))
        if o["dir"] is None and self.ok("storage", "run_id"):
            o["dir"] = Path("runs") / s["run_id"]
        if o["metrics_file"] is None and isinstance(o["dir"], Path):
            o["metrics_file"] = o["dir"] / "metrics.jsonl"
        if s["data_dir"] is None and isinstance(o["dir"], Path):
            s["data_dir"] = o["dir"] / "rollout_data"
        if self.ok("rollout", "rollout_batch_size"):
            for name in ("over_sampling_batch_size", "prefetch"):
                if r[name] is None:
                    r[name] = r["rollout_batch_size"]
        if self.ok("engine", "urls") and e["urls"]:
            e["num_engines"] = len(e["urls"])
        if t["eps_clip_high"] is None and self.ok("trainer", "eps_clip"):
            t["eps_clip_high"] = t["eps_clip"]

    def _device_rule(self, device: str) -> None:
        import torch

        shown = self.show("trainer", "device")
        try:
            parsed = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            self.problems.append(f"{shown}: not a torch device ({exc})")
            return
        if parsed.type == "cuda":
            count = torch.cuda.device_count()
            if count == 0:
                self.problems.append(f"{shown}: torch sees no GPU here (a CPU build of torch, or no driver)")
            elif parsed.index is not None and parsed.index >= count:
                self.problems.append(f"{shown}: torch sees {count} GPU(s), numbered from 0")
        elif parsed.type != "cpu":
            self.problems.append(f"{shown}: the built-in trainer runs on cpu or cuda (ROCm included)")

    def warn(self) -> None:
        r, d, e, s = (self.values[k] for k in ("rollout", "data", "engine", "storage"))
        sync_without_partial = r["mode"] == "sync" and r["partial_rollout"] is False
        if sync_without_partial and self.given("rollout", "over_sampling_batch_size"):
            over = self.show("rollout", "over_sampling_batch_size")
            self.warnings.append(f"{over} without --partial-rollout: sync mode does not abort and resume the "
                                 "groups admitted past the target; add --partial-rollout to keep their "
                                 "prefixes for the next round")
        if sync_without_partial and r["mask_offpolicy_in_partial_rollout"] is True:
            self.warnings.append("--mask-offpolicy-in-partial-rollout without --partial-rollout in sync mode: "
                                 "no sample is ever continued, so nothing is masked")
        if r["n_samples_per_prompt"] == 1:
            self.warnings.append("--n-samples-per-prompt=1: group-normalized (GRPO) advantages of a group of "
                                 "one are 0, so nothing is learned")
        if s["transport"] == "memory" and self.given("storage", "data_dir"):
            self.warnings.append(f"{self.show('storage', 'data_dir')} with --rollout-data-transport=memory: "
                                 "nothing is stored on disk; add --rollout-data-transport lmdb to use it")
        for name in ("declaration", "profile"):
            if s["transport"] == "memory" and self.given("storage", name):
                self.warnings.append(f"{self.show('storage', name)} with --rollout-data-transport=memory: "
                                     "there is no store on disk to declare; it is ignored")
        if d["prompt_data"] is not None and self.given("data", "num_prompts"):
            self.warnings.append(f"{self.show('data', 'num_prompts')} with --prompt-data: it sizes only the "
                                 "built-in toy dataset and is ignored")
        external = bool(e["urls"]) or bool(e["router_url"])
        if external and e["hf_checkpoint"] is None:
            self.warnings.append("external engines without --hf-checkpoint: the trainer builds the tiny "
                                 "model, which must be the model those engines serve")
        # Accepted so slime scripts load and so the seed's forbidden combinations can be named,
        # but not run by this pipeline yet: say so instead of ignoring them in silence.
        if r["mode"] == "sync" and r["eval_interval"] is not None:
            self.warnings.append(f"{self.show('rollout', 'eval_interval')}: inline evaluation is not built yet; "
                                 "evaluate the saved weights (weights/vN) separately")
        for name in ("rollout_all_samples_process_path", "buffer_filter_path"):
            if d[name] and not (name == "rollout_all_samples_process_path" and r["mode"] == "async") and not (
                name == "buffer_filter_path" and s["transport"] == "lmdb"
            ):
                self.warnings.append(f"{self.show('data', name)}: resolved, but this pipeline does not call it "
                                     "(partial groups are served oldest version first by the store)")
        if not external and e["host"] not in ("127.0.0.1", "localhost", "::1"):
            self.warnings.append(f"{self.show('engine', 'host')}: built-in engines will accept connections "
                                 "from the network")

    def resolve_plugins(self) -> None:
        for f in fields(DataConfig):
            path_field = f.metadata.get("plugin_of")
            if path_field is None:
                continue
            path = self.values["data"][path_field]
            if not path or not self.ok("data", path_field):
                continue
            try:
                self.resolved["data", f.name] = resolve_function(path)
            except PluginError as exc:
                reason = str(exc).removeprefix(f"{exc.path!r}: ")
                self.problems.append(f"{self.show('data', path_field)}: {reason}")

    def build(self) -> Config:
        parts = {}
        for section, cls in _SECTIONS.items():
            kwargs = dict(self.values[section])
            kwargs.update({name: fn for (sec, name), fn in self.resolved.items() if sec == section})
            parts[section] = cls(**kwargs)
        return Config(**parts, warnings=tuple(self.warnings))


def _opt_of(section: str, name: str) -> _Opt:
    return next(opt for f, opt in _options(_SECTIONS[section]) if f.name == name)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _parse(opt: _Opt, raw: str) -> Any:
    """A flag's string as the field's type; ValueError says what was expected."""
    if opt.kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError("must be an integer") from None
    if opt.kind == "float":
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("must be a number") from None
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value
    if opt.kind == "path":
        if not raw.strip():
            raise ValueError("must not be empty")
        return Path(raw).expanduser()
    return raw  # str, choice: checked by the rules


def _from_toml(opt: _Opt, value: Any) -> Any:
    """A TOML value as the field's type. TOML is typed, so a string where a number goes is an error."""
    kind = opt.kind
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {type(value).__name__}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {type(value).__name__}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return float(value)
    if kind == "urls":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a list of URL strings")
        return tuple(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    return _parse(opt, value)


def _url_problem(url: str) -> str | None:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        return f"not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http(s)://host:port URL"
    return None


def load_config(argv: Sequence[str] | None = None, *, toml_path: str | Path | None = None) -> Config:
    """Read flags (and the TOML file they or `toml_path` name), check everything, return the tree.

    Precedence: defaults < TOML file < flags. `--config` in argv replaces `toml_path`, which is
    the file a caller (a launcher with a default file) proposes. argv=None reads sys.argv[1:].
    Raises ConfigError listing every problem; `Config.warnings` lists settings that are legal but
    probably unintended. `--help` prints the help and exits, as command lines do.
    """
    loader = _Loader()
    config_file = loader.read_argv(sys.argv[1:] if argv is None else argv)
    if config_file is None and toml_path is not None:
        config_file = Path(toml_path)
    if config_file is not None:
        loader.read_toml(config_file)
    loader.bounds()
    loader.rules()
    loader.resolve_plugins()
    loader.derive()
    if loader.problems:
        raise ConfigError(loader.problems)
    loader.warn()
    return loader.build()


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """The settings as JSON-able data (paths as strings, tuples as lists), for run metadata and logs.

    Resolved callables are left out: their `module:function` paths are in the dict already.
    """
    out: dict[str, dict[str, Any]] = {}
    for section in _SECTIONS:
        part = getattr(config, section)
        out[section] = {f.name: _jsonable(getattr(part, f.name)) for f, _ in _options(type(part))}
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value
