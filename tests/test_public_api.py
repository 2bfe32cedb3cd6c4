"""One public API (issue 9): every name in `pipeline.__all__` imports from `pipeline`, is documented,
and the engine seam is typed (no `Any` where the engine's answer comes back)."""

from __future__ import annotations

import inspect
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
