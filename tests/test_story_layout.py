"""The rollout story reads top to bottom (issue 29): its modules import one another in one direction
only, never a private name of another module, and each stays small enough to read.

    controller (run_pipeline, one step) ─► session (Rollout) ─► graph (the stages wired)
        │                                      │                    ─► rollout_modes (who admits what)
        └─► checkpoints, step_record           └──────────────────────► plan (definitions only)

Read from the source with `ast`, like `tests/test_imports.py`: every import counts, lazy or under
`TYPE_CHECKING` too, since a newcomer following one must open the other file either way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STORY = ("controller", "session", "graph", "rollout_modes", "plan", "step_record", "checkpoints")
PROJECT = ("core", "storage", "stages", "trainers", "engines", "launch", "pipeline")


def _path(module: str) -> Path:
    return ROOT / "pipeline" / f"{module}.py"


def _imports(module: str) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every project import in `pipeline.<module>`."""
    tree = ast.parse(_path(module).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] in PROJECT]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT:
            found += [(node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("module", STORY)
def test_no_private_name_crosses_a_module(module: str) -> None:
    private = [f"{source}.{name}" for source, name in _imports(module) if name.startswith("_")]
    assert not private, f"pipeline.{module} imports private names of other modules: {private}"


def test_the_story_modules_import_one_another_in_one_direction() -> None:
    edges = {
        module: {
            source.removeprefix("pipeline.")
            for source, _ in _imports(module)
            if source.removeprefix("pipeline.") in STORY and source != f"pipeline.{module}"
        }
        for module in STORY
    }

    def cycle_from(start: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in sorted(edges[path[-1]]):
            if nxt == start:
                return (*path, nxt)
            if nxt not in path and (found := cycle_from(start, (*path, nxt))):
                return found
        return None

    cycles = [" -> ".join(c) for m in STORY if (c := cycle_from(m, (m,)))]
    assert not cycles, f"the story's modules import in a circle: {cycles}"


def test_the_definitions_run_nothing_and_import_nothing_of_the_story() -> None:
    """`pipeline.plan` sits under every other module of the story, so it may import none of them."""
    above = {source for source, _ in _imports("plan") if source.removeprefix("pipeline.") in STORY}
    assert not above, f"pipeline.plan imports {above}"


@pytest.mark.parametrize("module", STORY)
def test_each_module_of_the_story_stays_under_600_lines(module: str) -> None:
    lines = len(_path(module).read_text(encoding="utf-8").splitlines())
    assert lines < 600, f"pipeline/{module}.py has {lines} lines"
