"""How a config field describes its setting: `opt(default, flag, kind, help=...)` puts an `Opt`
in the field's metadata (its flag, how a flag or TOML value converts, its simple bounds), and
`resolved(path_field)` marks a callable `load_config` fills in from a `module:function` path.
Every section of the tree (`schema`, `rollout_section`, `engine_section`, `trainer_section`) is
made of these; `parsing`, `rules` and `show` read them back with `options`.
"""

from __future__ import annotations

import enum
from dataclasses import Field, dataclass, field, fields
from typing import Any

__all__ = ["FUNCTION_PATH", "Opt", "opt", "options", "resolved", "typed"]

FUNCTION_PATH = "MODULE:FUNCTION"  # the metavar of a flag that names a user function


@dataclass(frozen=True, slots=True)
class Opt:
    """How one config field is spelled on the command line, parsed, and bounded."""

    flag: str
    kind: str  # int | float | str | path | choice | bool | urls | strs (choice: an enum's values, or plain strings)
    help: str
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    default_help: str | None = None  # for derived defaults: what None becomes
    why: str = ""  # appended to a bound's message
    metavar: str | None = None


def opt(default: Any, flag: str, kind: str, *, help: str, **kw: Any) -> Any:
    """A setting: a dataclass field with `default`, spelled `flag`, converted as `kind`."""
    return field(default=default, metadata={"opt": Opt(flag, kind, help, **kw)})


def resolved(path_field: str) -> Any:
    """A callable filled in by load_config from the `module:function` path in `path_field`."""
    return field(default=None, metadata={"plugin_of": path_field})


def options(cls: type) -> list[tuple[Field[Any], Opt]]:
    """The fields of a section that are settings (resolved callables are not), with their metadata."""
    return [(f, f.metadata["opt"]) for f in fields(cls) if "opt" in f.metadata]


def typed(f: Field[Any], value: Any) -> Any:
    """A checked choice as its enum, for fields whose default is one (`"async"` -> RolloutMode.ASYNC)."""
    if isinstance(f.default, enum.Enum) and value is not None and not isinstance(value, type(f.default)):
        return type(f.default)(value)
    return value
