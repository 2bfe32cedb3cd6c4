"""Flags and the TOML file, read against the schema into a `Draft`; nothing is checked here but types.

Flags keep slime's names; the TOML file has one table per section (`[rollout]`, `[engine]`, ...)
with keys named like the flags without their dashes (`rollout-batch-size`) or like the dataclass
fields (`rollout_batch_size`). Precedence: defaults < TOML file < flags. Every value
that does not convert is recorded as a problem and the reading goes on, so that one error can list
them all (argparse alone would stop at the first).
"""

from __future__ import annotations

import argparse
import math
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from pipeline.config.draft import BAD, Draft, close_match, fmt
from pipeline.config.fields import Opt, options
from pipeline.config.schema import SECTIONS, opt_of

__all__ = ["build_parser", "read_argv", "read_toml"]

# Flags users bring from slime that have a different spelling here.
_SLIME_HINTS = {
    "--rollout-function-path": "async rollout is --rollout-mode async here",
    "--collect-aborted-samples": "that is --partial-rollout here",
}


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
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file; sections: " + ", ".join(SECTIONS))
    parser.add_argument("--version", action="version", version=f"rollout-pipeline {_version()}")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print every setting, derived defaults filled in, as a --config TOML file, and exit",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f, opt in options(cls):
            default = opt.default_help or ("none" if f.default in (None, ()) else f.default)
            kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "help": f"{opt.help} (default: {default})"}
            if opt.kind == "bool":
                kwargs["help"] = f"{opt.help} (default: {'on' if f.default else 'off'})"
                group.add_argument(opt.flag, *opt.aliases, action=argparse.BooleanOptionalAction, **kwargs)
                continue
            if opt.kind == "urls":
                kwargs["action"] = "append"
            if opt.kind == "strs":  # slime's nargs="+" lists: --eval-prompt-data NAME PATH [NAME PATH ...]
                kwargs["action"], kwargs["nargs"] = "extend", "+"
            metavar = opt.metavar or ("{" + ",".join(opt.choices) + "}" if opt.choices else opt.kind.upper())
            group.add_argument(opt.flag, *opt.aliases, metavar=metavar, **kwargs)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollout-pipeline")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def read_argv(draft: Draft, argv: Sequence[str]) -> Path | None:
    """Record every flag given; return the `--config` file, if one is named."""
    try:
        namespace, extras = build_parser().parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        # A flag without its value stops argparse; nothing after it can be read reliably.
        raise ConfigError([str(exc)]) from exc
    _unknown_args(draft, extras)
    given = vars(namespace)
    config_file = given.pop("config", None)
    given.pop("print_config", None)  # the launcher's, not a setting
    for dest, raw in given.items():
        section, name = dest.split(".")
        opt = opt_of(section, name)
        draft.source[section, name] = "flag"
        draft.values[section][name] = _convert_flag(draft, opt, raw)
    return Path(config_file).expanduser() if config_file is not None else None


def _all_flags() -> list[str]:
    flags = ["--config"]
    for cls in SECTIONS.values():
        for _, opt in options(cls):
            flags += [opt.flag, *opt.aliases]
            if opt.kind == "bool":
                flags.append("--no-" + opt.flag[2:])
    return flags


def _unknown_args(draft: Draft, extras: list[str]) -> None:
    known = _all_flags()
    i = 0
    while i < len(extras):
        token = extras[i]
        if token.startswith("-") and not _is_number(token):
            name = token.split("=", 1)[0]
            hint = f" ({_SLIME_HINTS[name]})" if name in _SLIME_HINTS else close_match(name, known)
            draft.problems.append(f"{name}: unknown flag{hint}")
            # An unknown flag's value would otherwise be reported a second time.
            if "=" not in token and i + 1 < len(extras) and not extras[i + 1].startswith("--"):
                i += 1
        else:
            draft.problems.append(f"{token!r}: unexpected argument (options are --flags)")
        i += 1


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _convert_flag(draft: Draft, opt: Opt, raw: Any) -> Any:
    if opt.kind == "bool":
        return raw  # argparse already made it a bool
    if opt.kind in ("urls", "strs"):
        return tuple(raw)
    try:
        return _parse(opt, raw)
    except ValueError as exc:
        draft.problems.append(f"{opt.flag}={raw!r}: {exc}")
        return BAD


def read_toml(draft: Draft, path: Path) -> None:
    """Record every key of the TOML file that no flag overrides."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        draft.problems.append(f"--config={str(path)!r}: file not found")
        return
    except OSError as exc:
        draft.problems.append(f"--config={str(path)!r}: cannot be read: {exc.strerror or exc}")
        return
    except tomllib.TOMLDecodeError as exc:
        draft.problems.append(f"--config={str(path)!r}: not valid TOML: {exc}")
        return
    for section, table in data.items():
        if section not in SECTIONS:
            draft.problems.append(
                f"{path}: unknown section [{section}] (sections: "
                f"{', '.join(SECTIONS)}){close_match(section, list(SECTIONS))}"
            )
            continue
        if not isinstance(table, dict):
            draft.problems.append(f"{path}: {section} must be a table ([{section}]), got {fmt(table)}")
            continue
        for key, value in table.items():
            _toml_value(draft, path, section, key, value)


def _toml_value(draft: Draft, path: Path, section: str, key: str, value: Any) -> None:
    names = [f.name for f, _ in options(SECTIONS[section])]
    # A key may be the flag's name too (`rollout-batch-size = 16` for --rollout-batch-size), so
    # a command line moves into a file as it is; the field's name (`rollout_batch_size`) works too.
    by_flag = {flag[2:]: f.name for f, opt in options(SECTIONS[section]) for flag in (opt.flag, *opt.aliases)}
    if key not in names and key in by_flag:
        key = by_flag[key]
    if key not in names:
        underscored = key.replace("-", "_")
        elsewhere = [s for s, cls in SECTIONS.items() if underscored in {f.name for f, _ in options(cls)}]
        if underscored in names:
            hint = f" (did you mean {underscored}?)"
        elif elsewhere:
            hint = f" (it belongs in [{elsewhere[0]}])"
        else:
            hint = close_match(underscored, names)
        draft.problems.append(f"{path}: unknown key {key!r} in [{section}]{hint}")
        return
    where = f"[{section}] {key} in {path}"
    if (section, key) in draft.source:
        return  # a flag overrides it; the flag's value is the one to check
    opt = opt_of(section, key)
    draft.source[section, key] = where
    try:
        draft.values[section][key] = _from_toml(opt, value)
    except ValueError as exc:
        draft.problems.append(f"{opt.flag}={fmt(value)} ({where}): {exc}")
        draft.values[section][key] = BAD


def _parse(opt: Opt, raw: str) -> Any:
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


def _from_toml(opt: Opt, value: Any) -> Any:
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
    if kind == "strs":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a list of strings")
        return tuple(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    return _parse(opt, value)
