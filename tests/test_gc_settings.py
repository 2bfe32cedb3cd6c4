"""The controller's collector settings (`launch.gc_settings`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from launch.gc_settings import GEN0_THRESHOLD, settle_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_gc_freezes_start_up_and_raises_only_the_young_threshold(restored_gc: None) -> None:
    gc.set_threshold(700, 11, 12)
    start_up = [object() for _ in range(3)], {"a": [1]}  # tracked containers that exist "at start-up"
    settle_gc()
    assert gc.get_threshold() == (GEN0_THRESHOLD, 11, 12)
    assert gc.get_freeze_count() > 0
    assert not any(o is start_up for o in gc.get_objects())  # frozen: out of every generation's scans
