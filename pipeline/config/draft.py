"""One load in progress: the values by section and field, where each came from, and what is wrong.

Every step of `load_config` (parsing, rules, the load step) writes into one `Draft`, so that all
their problems end in one `ConfigError`. A value that did not convert is marked `BAD`: later rules
skip it, so one mistake is reported once.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.config.fields import options, typed
from pipeline.config.schema import SECTIONS, Config, opt_of

__all__ = ["BAD", "Draft", "close_match", "fmt"]


class _Bad:
    """Marks a value that did not convert; rules skip it so one mistake is reported once."""


BAD = _Bad()


class Draft:
    """The settings read so far, mutable until `build` freezes them into a `Config`."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {
            s: {f.name: f.default for f, _ in options(cls)} for s, cls in SECTIONS.items()
        }
        self.source: dict[tuple[str, str], str] = {}  # (section, field) -> "flag" | the TOML location
        self.resolved: dict[tuple[str, str], Callable[..., Any]] = {}
        self.problems: list[str] = []
        self.warnings: list[str] = []

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
        text = f"{opt_of(section, name).flag}={fmt(self.values[section][name])}"
        where = self.source.get((section, name), "flag")
        return text if where == "flag" else f"{text} ({where})"

    def build(self) -> Config:
        """The frozen tree. Only called once no problem is left, so no value is BAD."""
        parts = {}
        for section, cls in SECTIONS.items():
            kwargs = {f.name: typed(f, self.values[section][f.name]) for f, _ in options(cls)}
            kwargs.update({name: fn for (sec, name), fn in self.resolved.items() if sec == section})
            parts[section] = cls(**kwargs)
        return Config(**parts, warnings=tuple(self.warnings))


def fmt(value: Any) -> str:
    """A value as a problem shows it: strings and paths quoted, tuples as lists, enums by value."""
    if isinstance(value, Path):
        return repr(str(value))
    if isinstance(value, tuple):
        return repr(list(value))
    return repr(str(value)) if isinstance(value, str) else str(value)


def close_match(word: str, candidates: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""
