"""Parse a command line with a module's own argparse parser, and run nothing.

`tests/test_docs_commands.py` runs this in a process of its own (modules configure logging and
structlog before they parse, which must not leak into the test process):

    python -m tests.docs_argv_check < [[module, [arg, ...]], ...]    (JSON on stdin)

For each pair the module runs as `__main__` with `sys.argv` set to the arguments, until its first
call to `ArgumentParser.parse_args` or `parse_known_args`: that call parses with the module's own
parser (a usage error is the module's own message), then stops the module before it does
anything. `None` as the arguments only collects the parser's flags. One JSON object per pair
comes back on stdout: `error` (None when the line parses), `extra` (what `parse_known_args` left
for the caller: pipeline.eval hands it to the launcher's config), `flags` (every option string of
the parser and its subcommands' parsers).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
from typing import Any

_parse_args = argparse.ArgumentParser.parse_args
_parse_known_args = argparse.ArgumentParser.parse_known_args


class Parsed(BaseException):  # not an Exception: a module's `except Exception` must not swallow it
    def __init__(self, parser: argparse.ArgumentParser, extra: list[str]) -> None:
        super().__init__()
        self.parser, self.extra = parser, extra


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
    return flags


def check(module: str, argv: list[str] | None) -> dict[str, Any]:
    state = {"depth": 0, "whole": False}

    def parse_known_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        if argv is None:
            raise Parsed(self, [])
        state["depth"] += 1
        try:  # a subcommand's parser is called from inside its parent's: only the outermost call stops
            result = _parse_known_args(self, args, namespace)
        finally:
            state["depth"] -= 1
        if state["depth"] == 0 and not state["whole"]:
            raise Parsed(self, list(result[1]))
        return result

    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        if argv is None:
            raise Parsed(self, [])
        state["whole"] = True  # parse_args calls parse_known_args, then refuses what is left over
        _parse_args(self, args, namespace)
        raise Parsed(self, [])

    err = io.StringIO()
    saved = sys.argv
    sys.argv = [module, *(argv or [])]
    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except Parsed as done:
        return {"error": None, "extra": done.extra, "flags": sorted(_flags(done.parser))}
    except SystemExit as exc:
        return {"error": f"exit {exc.code}: {err.getvalue().strip()[-1500:]}", "extra": [], "flags": []}
    except BaseException as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "extra": [], "flags": []}
    finally:
        argparse.ArgumentParser.parse_args = _parse_args  # type: ignore[method-assign]
        argparse.ArgumentParser.parse_known_args = _parse_known_args  # type: ignore[method-assign]
        sys.argv = saved
    return {"error": "the module ran to its end without parsing a command line", "extra": [], "flags": []}


if __name__ == "__main__":
    pairs = json.load(sys.stdin)
    print(json.dumps([check(module, argv) for module, argv in pairs]))
