"""One public API (issue 9): every name in `pipeline.__all__` imports from `pipeline`, is documented,
and the engine seam is typed (no `Any` where the engine's answer comes back)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
import typing

import pytest

import pipeline


@pytest.mark.parametrize("name", pipeline.__all__)
def test_every_public_name_imports_and_is_documented(name: str) -> None:
    obj = getattr(pipeline, name)
    doc = inspect.getdoc(obj) or ""
    # A dataclass without a docstring gets its signature as __doc__: that is not documentation.
    assert doc and not doc.startswith(f"{name}("), f"pipeline.{name} has no docstring"
    assert name in dir(pipeline)


# The public surface, written out: a name added to or dropped from `pipeline` changes this list
# on purpose, in the same change (and the CHANGELOG says so).
PUBLIC = {
    "Agent",
    "AgentContext",
    "AgentError",
    "AgentInterrupted",
    "AgentStateError",
    "AsyncStore",
    "Batch",
    "Config",
    "ConfigError",
    "EngineError",
    "EngineFleet",
    "EngineUnavailableError",
    "Engines",
    "FinishReason",
    "GenerateEngine",
    "GenerateResult",
    "Group",
    "GroupsFailingError",
    "LmdbStore",
    "MemoryStore",
    "PauseMode",
    "PipelineError",
    "PluginError",
    "PromptTask",
    "PublishError",
    "PublishReport",
    "Rollout",
    "RolloutMode",
    "RolloutPlan",
    "RunSummary",
    "Sample",
    "SampleStatus",
    "Segment",
    "StoreError",
    "StoreTransport",
    "Trainer",
    "Turn",
    "VersionClock",
    "VersionMismatchError",
    "VersionSpan",
    "WeightTarget",
    "load_config",
    "run_pipeline",
}


def test_the_exported_members_are_exactly_the_public_list() -> None:
    assert set(pipeline.__all__) == PUBLIC
    assert len(pipeline.__all__) == len(PUBLIC), "a name listed twice in __all__"
    # Nothing public rides along unlisted: every non-module, non-underscore name is exported.
    loose = {
        n
        for n, v in vars(pipeline).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"
    }
    assert loose <= PUBLIC, f"public but not in __all__: {sorted(loose - PUBLIC)}"


@pytest.mark.parametrize("room", ["core", "storage", "stages", "trainers", "engines", "launch", "pipeline"])
def test_each_room_imports_first_in_a_fresh_interpreter(room: str) -> None:
    """No import cycle hides behind import order: every room can be the first one a program imports."""
    modules = {"core": "core.types", "storage": "storage", "stages": "stages.generator"}
    done = subprocess.run(
        [sys.executable, "-c", f"import {modules.get(room, room)}, pipeline"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_an_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pipeline.Nope  # noqa: B018


def test_the_engine_seam_is_typed() -> None:
    hints = typing.get_type_hints(pipeline.GenerateEngine.generate)
    assert hints["return"] is pipeline.GenerateResult
    for proto in (pipeline.GenerateEngine, pipeline.WeightTarget, pipeline.Agent):
        for member, fn in vars(proto).items():
            if (callable(fn) and not member.startswith("_")) or member == "__call__":
                assert typing.Any not in typing.get_type_hints(fn).values(), f"{proto.__name__}.{member}"
