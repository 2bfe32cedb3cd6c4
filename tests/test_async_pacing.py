"""Async pacing (`pipeline.rollout_modes.Pace`): the window follows what the trainer finds when it
asks for a batch. The pipeline-level checks (a trainer-bound run settles at one batch ahead) are in
tests/test_async_mode.py."""

from __future__ import annotations

import pytest

from pipeline import RolloutPlan
from pipeline.rollout_modes import Pace, async_pace


def test_the_window_starts_at_the_unpaced_ceiling():
    plan = RolloutPlan(mode="async", batch_size=8, n_samples=8, num_steps=1, slots=64, prefetch=4)
    pace = async_pace(plan)
    # the collector's bound (batch + prefetch) plus twice the groups 64 slots run at once
    assert pace.ceiling == 8 + 4 + 2 * 8 and pace.window == pace.ceiling


def test_an_engine_bound_run_keeps_the_ceiling():
    pace = Pace(batch_size=8, ceiling=32)
    for ready in (0, 3, 7, 5):
        pace.asked(ready=ready, in_flight=24)
        assert pace.window == 32


def test_a_surplus_drops_the_window_to_what_was_in_use_less_half_the_surplus():
    pace = Pace(batch_size=8, ceiling=32)
    pace.asked(ready=16, in_flight=4)  # in use 20, surplus 8
    assert pace.window == 16
    pace.asked(ready=11, in_flight=5)  # in use 16, surplus 3: half rounds up
    assert pace.window == 14
    pace.asked(ready=8, in_flight=2)  # no surplus: down to what was in use
    assert pace.window == 10
    pace.asked(ready=9, in_flight=0)  # a surplus of one still counts
    assert pace.window == 8
    pace.asked(ready=30, in_flight=0)  # never below one batch
    assert pace.window == 8


def test_a_starved_trainer_widens_the_window_by_what_was_missing_up_to_the_ceiling():
    pace = Pace(batch_size=8, ceiling=20)
    pace.asked(ready=12, in_flight=0)
    assert pace.window == 10
    pace.asked(ready=5, in_flight=5)  # 3 groups were missing
    assert pace.window == 13
    pace.asked(ready=0, in_flight=13)
    assert pace.window == 20  # 21, held at the ceiling


@pytest.mark.parametrize(("batch_size", "ceiling"), [(0, 4), (5, 4)])
def test_a_window_that_cannot_hold_a_batch_is_refused(batch_size, ceiling):
    with pytest.raises(ValueError, match=rf"batch_size={batch_size}, ceiling={ceiling}"):
        Pace(batch_size=batch_size, ceiling=ceiling)
