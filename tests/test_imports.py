"""Imports point one way, down the rooms of the house (ARCHITECTURE.md), with no exceptions:

    pipeline -> launch -> trainers -> stages -> storage -> engines -> core

Read from the source with `ast`, not by importing: every import statement counts, at the top of a
module or inside a function (a lazy import is still a dependency), under `TYPE_CHECKING` too.
The rule is by top-level package, so files can move inside a room without touching this test:

- a module may import its own room and the rooms below it;
- `core` (the vocabulary) imports nothing of the project but itself;
- `engines` (the built-in servers, reached only over HTTP) import only `core`;
- `tests/`, `benchmarks/` and `examples/` may import anything; nothing imports them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Highest first: a room may import itself and anything after it.
LAYERS = ("pipeline", "launch", "trainers", "stages", "storage", "engines", "core")
# Rooms that may import only the ones named here (and themselves), whatever their place in LAYERS.
ONLY = {"engines": ("core",), "core": ()}
FREE = ("tests", "benchmarks", "examples")  # may import anything; nothing imports them


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from core import types` imports the module core.types, not just `core`.
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name


def _target(imported: str) -> str | None:
    """The project module an import names, as precisely as the rule needs; None for third-party."""
    top = imported.split(".")[0]
    return imported if top in LAYERS or top in FREE else None


def _violation(module: str, imported: str) -> str | None:
    """Why `module` may not import `imported`, or None if it may."""
    if _in(module, FREE):
        return None
    if _in(imported, FREE):
        return f"{imported.split('.')[0]}/ is not part of the library"
    room, other = module.split(".")[0], imported.split(".")[0]
    if room == other:
        return None
    if room in ONLY:
        if other in ONLY[room]:
            return None
        allowed = ", ".join(ONLY[room]) or "nothing of the project"
        return f"{room} imports only {allowed}"
    if LAYERS.index(other) > LAYERS.index(room):
        return None
    return f"{room} is below {other} ({' -> '.join(LAYERS)})"


def _source_files() -> list[Path]:
    files = []
    for top in (*LAYERS, *FREE):
        if (ROOT / top).is_dir():
            files += sorted((ROOT / top).rglob("*.py"))
    return files


def test_imports_point_one_way() -> None:
    problems = []
    for path in _source_files():
        module = _module_name(path)
        for line, imported in _imports(path):
            target = _target(imported)
            if target is None:
                continue
            why = _violation(module, target)
            if why is not None:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}: {why}")
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "imported", "allowed"),
    [
        ("pipeline.run.cli", "pipeline.config", True),
        ("pipeline.controller", "stages.generator", True),
        ("stages.generator", "storage.protocol", True),
        ("storage.lmdb_store", "core.errors", True),
        ("storage.lmdb_store", "core.types.Group", True),
        ("stages.generator", "pipeline.events", False),
        ("storage.memory", "stages.admission", False),
        ("engines.builtin", "stages.sglang.publish_distributed", False),
        ("engines.builtin", "core.types", True),
        ("launch.megatron_ranks", "trainers.megatron.trainer", True),
        ("trainers.grpo", "pipeline.config", False),
        ("pipeline.launch", "pipeline.run.cli", True),
        ("launch.engine_process", "pipeline.config", False),
        ("core.types", "pipeline.events", False),
        ("core.clock", "storage", False),
        ("stages.reward", "tests.fakes", False),
        ("tests.test_x", "pipeline.run.cli", True),
    ],
)
def test_the_rule_itself(module: str, imported: str, allowed: bool) -> None:
    assert (_violation(module, imported) is None) == allowed
