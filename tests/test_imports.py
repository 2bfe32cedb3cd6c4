"""Imports point one way: launch -> pipeline -> stages -> storage (the design's layering).

Read from the source with `ast`, not by importing: every import statement counts, at the top of a
module or inside a function (a lazy import is still a dependency), under `TYPE_CHECKING` too.
The rule is by top-level package, so files can move between rooms without touching this test:

- a module may import its own layer and the layers below it;
- everything may import the shared vocabulary `pipeline.types`, `pipeline.columns`, `pipeline.errors`,
  `pipeline.clock`,
  which in turn import nothing of the project but each other (else they would drag a layer in);
- `tests/`, `benchmarks/` and `examples/` may import anything.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Highest first: a layer may import itself and anything after it.
LAYERS = ("launch", "pipeline", "stages", "storage")
SHARED = ("pipeline.types", "pipeline.columns", "pipeline.errors", "pipeline.clock")
FREE = ("tests", "benchmarks", "examples")  # may import anything; nothing imports them

# (importing module, imported module): why the rule does not apply. Keep this short.
EXCEPTIONS = {
    ("pipeline.launch", "launch.cli"): "the entry point the README promises (`python -m pipeline.launch`); "
    "the import runs only under `if __name__ == '__main__'`, so importing pipeline never imports launch",
    ("pipeline.eval", "launch.eval_run"): "`python -m pipeline.eval`, the same kind of shim as pipeline.launch",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _imports(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line, imported module, under `if __name__ == "__main__"`) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    main_only = {id(n) for node in ast.walk(tree) if _is_main_guard(node) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, id(node) in main_only
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pipeline import types` imports the module pipeline.types, not just `pipeline`.
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name, id(node) in main_only


def _is_main_guard(node: ast.AST) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )


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
    if _in(module, SHARED):
        if _in(imported, SHARED) or imported in ("pipeline", *SHARED):
            return None
        return "the shared vocabulary (types, columns, errors, clock) imports only itself"
    if _in(imported, SHARED):
        return None
    layer, other = LAYERS.index(module.split(".")[0]), LAYERS.index(imported.split(".")[0])
    if other >= layer:
        return None
    return f"{LAYERS[layer]} is below {LAYERS[other]} (launch -> pipeline -> stages -> storage)"


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
        for line, imported, main_only in _imports(path):
            target = _target(imported)
            if target is None:
                continue
            # `from pipeline import types` names pipeline.types; `from pipeline.x import Name` names
            # pipeline.x.Name, whose module prefix decides the same way, so no resolution is needed.
            why = _violation(module, target)
            if why is None:
                continue
            if (module, _exception_key(target)) in EXCEPTIONS and main_only:
                continue
            problems.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}: {why}")
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def _exception_key(target: str) -> str:
    # `from launch.cli import main` is recorded as launch.cli.main; the exception names the module.
    return next((b for (_, b) in EXCEPTIONS if target == b or target.startswith(b + ".")), target)


def test_the_exception_is_still_needed_and_still_main_only() -> None:
    """An exception that no longer matches anything should be deleted, not kept as a loophole."""
    for (module, imported), _why in EXCEPTIONS.items():
        path = ROOT / (module.replace(".", "/") + ".py")
        found = [m for _, name, m in _imports(path) if name == imported or name.startswith(imported + ".")]
        assert found, f"{module} no longer imports {imported}: drop the exception"
        assert all(found), f"{module} imports {imported} outside `if __name__ == '__main__'`"


@pytest.mark.parametrize(
    ("module", "imported", "allowed"),
    [
        ("launch.cli", "pipeline.config", True),
        ("pipeline.controller", "stages.generator", True),
        ("stages.generator", "storage.protocol", True),
        ("storage.lmdb_store", "pipeline.errors", True),
        ("storage.lmdb_store", "pipeline.types.Group", True),
        ("stages.generator", "pipeline.events", False),
        ("storage.memory", "stages.admission", False),
        ("pipeline.config", "launch.cli", False),
        ("pipeline.types", "pipeline.events", False),
        ("pipeline.clock", "storage", False),
        ("stages.reward", "tests.fakes", False),
        ("tests.test_x", "launch.cli", True),
    ],
)
def test_the_rule_itself(module: str, imported: str, allowed: bool) -> None:
    assert (_violation(module, imported) is None) == allowed
