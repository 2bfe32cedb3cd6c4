"""Resolve the user functions a config names by path, once, when the config loads.

A typo in `--custom-rm-path` should fail before any engine starts, not an hour into the run when
the first group reaches the reward stage. So the config's load step (`pipeline.config.load`) calls
`resolve_function` for every path and stores the callable on the config tree; no stage imports
anything later.

Two spellings are accepted:

- `package.module:function` (or `package.module:Class.method`): the colon splits module from attribute;
- `package.module.function`: slime's dotted spelling, split at the last dot, so scripts written
  for slime carry over unchanged.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any, cast

from core.errors import PluginError

__all__ = ["resolve_function", "split_path"]


def split_path(path: str) -> tuple[str, str]:
    """Split a plugin path into (module name, attribute path); PluginError if it is malformed."""
    if not isinstance(path, str) or not path.strip():
        raise PluginError(str(path), "expected 'module:function'")
    if path.count(":") > 1:
        raise PluginError(path, "expected 'module:function' with one ':'")
    if ":" in path:
        module_name, attr_path = path.split(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise PluginError(path, "expected 'module:function' (or slime's dotted 'module.function')")
    for part in (*module_name.split("."), *attr_path.split(".")):
        if not part.isidentifier():
            raise PluginError(path, f"{part!r} is not a Python identifier; expected 'module:function'")
    return module_name, attr_path


def resolve_function(path: str) -> Callable[..., Any]:
    """Import the module `path` names and return the callable it names.

    Raises PluginError naming `path` when the module is not found, importing it raises, an attribute
    is missing, or the object found is not callable. The import runs the module's top level, which
    is why this happens once at load and never in the hot path.
    """
    module_name, attr_path = split_path(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Tell "your module does not exist" apart from "your module imports something missing".
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise PluginError(path, f"module {module_name!r} not found (is it on PYTHONPATH?)") from exc
        raise PluginError(path, f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # the user's module top level can raise anything
        raise PluginError(path, f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from exc

    owner = module_name
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginError(path, f"{owner!r} has no attribute {part!r}{hint}") from exc
        owner = f"{owner}.{part}" if owner != module_name else f"{module_name}:{part}"
    if not callable(obj):
        raise PluginError(path, f"{attr_path!r} is a {type(obj).__name__}, not a callable")
    return cast(Callable[..., Any], obj)  # checked just above; mypy cannot narrow Any by callable()
