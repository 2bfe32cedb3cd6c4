"""Imports point one way, down the rooms of the house (ARCHITECTURE.md), with no exceptions:

    pipeline -> launch -> trainers -> stages -> storage -> engines -> core

Read from the source with `ast`, not by importing: every import statement counts, at the top of a
module or inside a function (a lazy import is still a dependency), under `TYPE_CHECKING` too.
The rule is by top-level package, so files can move inside a room without touching this test:

- a module may import its own room and the rooms below it;
- `core` (the vocabulary) imports nothing of the project but itself;
- `engines` (the built-in servers, reached only over HTTP) import only `core`, and only `launch`
  (which starts them) imports `engines`;
- `tests/`, `benchmarks/` and `examples/` may import anything; nothing imports them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Highest first: a room may import itself and anything after it.
LAYERS = ("pipeline", "launch", "trainers", "stages", "storage", "engines", "core")
# Rooms that may import only the ones named here (and themselves), whatever their place in LAYERS.
ONLY = {"engines": ("core",), "core": ()}
# Rooms that only the rooms named here (and themselves) may import: the rest reach them over HTTP.
REACHED_ONLY_BY = {"engines": ("launch",)}
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
    if other in REACHED_ONLY_BY and room not in REACHED_ONLY_BY[other]:
        return f"{other} is reached over HTTP; only {', '.join(REACHED_ONLY_BY[other])} imports it"
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
        ("engines.builtin", "stages.sglang_client.publish_distributed", False),
        ("engines.builtin", "core.types", True),
        ("launch.megatron_ranks", "trainers.megatron.trainer", True),
        ("launch.builtin_engine", "engines.memory_saver", True),
        ("trainers.routing_replay", "engines.moe_routes", False),
        ("stages.generator", "engines.seam", False),
        ("trainers.grpo", "pipeline.config", False),
        ("pipeline.launch", "pipeline.run.cli", True),
        ("launch.builtin_engine", "pipeline.config", False),
        ("core.types", "pipeline.events", False),
        ("core.clock", "storage", False),
        ("stages.reward", "tests.fakes", False),
        ("tests.test_x", "pipeline.run.cli", True),
    ],
)
def test_the_rule_itself(module: str, imported: str, allowed: bool) -> None:
    assert (_violation(module, imported) is None) == allowed


# ---- no cycles, no private names across modules --------------------------------------------------
#
# Between the library's files (not only its rooms): two modules that import each other, directly or
# round a longer loop, are one module in two files, and a private `_name` imported from another
# module is a seam that is not one. Counted like the rule above: every import, lazy or under
# `TYPE_CHECKING`. Packages' `__init__` count as the modules they are.

LIBRARY = ("core", "storage", "stages", "trainers", "engines", "launch", "pipeline")


def _library() -> dict[str, Path]:
    return {_module_name(p): p for top in LIBRARY for p in sorted((ROOT / top).rglob("*.py"))}


def _resolve(imported: str, modules: Mapping[str, Path]) -> tuple[str, list[str]] | None:
    """The library module `imported` names (its longest dotted prefix that is a file) and the rest
    of the name (attributes taken from that module); None for anything outside the library."""
    parts = imported.split(".")
    for n in range(len(parts), 0, -1):
        if (name := ".".join(parts[:n])) in modules:
            return name, parts[n:]
    return None


def _private(rest: Sequence[str]) -> str | None:
    """The first name of `rest` when it is private (`_name`, not a dunder)."""
    if rest and rest[0].startswith("_") and not rest[0].startswith("__"):
        return rest[0]
    return None


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for an attribute chain over a plain name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _attribute_uses(path: Path, modules: Mapping[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, dotted name) for every `module.attr` where `module` is a library module the file
    imported (`import a.b`, `import a.b as m`, `from a import b`): names used without an import."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bound: dict[str, str] = {}  # local name -> the module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    bound[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (dotted := _dotted(node)) is not None:
            head, _, tail = dotted.partition(".")
            if head in bound and tail:
                yield node.lineno, f"{bound[head]}.{tail}"


def _edges(modules: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, within the library."""
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for line, imported in _imports(path):
            found = _resolve(imported, modules)
            if found is None or found[0] == module:
                continue
            edges[module].setdefault(found[0], line)
    return edges


def _cycles(edges: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = _library()
    edges = _edges(modules)
    problems = []
    for component in _cycles(edges):
        arrows = [
            f"  {modules[a].relative_to(ROOT)}:{line}: {a} imports {b}"
            for a in component
            for b, line in edges[a].items()
            if b in component
        ]
        problems.append(f"{' <-> '.join(component)}:\n" + "\n".join(arrows))
    assert not problems, "import cycles between the library's files:\n" + "\n".join(problems)


def test_no_module_takes_a_private_name_from_another() -> None:
    modules = _library()
    problems = []
    for module, path in modules.items():
        uses = [*_imports(path), *_attribute_uses(path, modules)]
        for line, imported in uses:
            found = _resolve(imported, modules)
            if found is None or found[0] == module:
                continue
            if (name := _private(found[1])) is not None:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {module} uses {found[0]}.{name}")
    assert not problems, "private names used from another module:\n" + "\n".join(sorted(set(problems)))


def test_the_cycle_finder_itself() -> None:
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []
    modules = {"pkg": ROOT, "pkg.mod": ROOT}
    assert _resolve("pkg.mod._helper", modules) == ("pkg.mod", ["_helper"])
    assert _resolve("pkg.other", modules) == ("pkg", ["other"])
    assert _resolve("numpy.linalg", modules) is None
    assert _private(["_helper"]) == "_helper" and _private(["__version__"]) is None
