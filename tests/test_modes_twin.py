"""The simulated twin's time model (`benchmarks/modes_builtin.py`), fitted from the sums the
built-in engine reports in `/server_info` (`engines/kv_forward.py`'s `SlotStatistics`)."""

from __future__ import annotations

import pytest

from benchmarks.modes_builtin import _decode_fit, _prefill_fit, _slowdown_in_training
from benchmarks.modes_sim import SimulatedTrainer


def _sums(decode: list[tuple[int, float]], prefill: list[tuple[int, int, float]]) -> dict[str, float]:
    """What the engine accumulates: decode-only steps (rows, seconds); prefilling steps (prefill
    tokens t, rows decoded beside them h, seconds). No context sums: an engine from before them."""
    return {
        "decode_timed_steps": len(decode),
        "decode_rows": sum(r for r, _ in decode),
        "decode_seconds": sum(s for _, s in decode),
        "decode_rows_squared": sum(r * r for r, _ in decode),
        "decode_rows_seconds": sum(r * s for r, s in decode),
        "prefills": len(prefill),
        "prefill_tokens": sum(t for t, _, _ in prefill),
        "prefill_seconds": sum(s for _, _, s in prefill),
        "prefill_steps_decoding": sum(h > 0 for _, h, _ in prefill),
        "prefill_step_tokens_squared": sum(t * t for t, _, _ in prefill),
        "prefill_step_tokens_seconds": sum(t * s for t, _, s in prefill),
        "prefill_step_held_rows": sum(h for _, h, _ in prefill),
        "prefill_step_tokens_held": sum(t * h for t, h, _ in prefill),
        "prefill_step_tokens_decoding": sum(t for t, h, _ in prefill if h),
    }


def test_the_prefill_fit_takes_out_the_decode_that_shares_its_step():
    """Decode 10 ms + 50 us a row; prefill 2 ms + 30 us a token, in steps that also decode the
    held rows. The fit gives the prefill's own cost back: charging the whole step to the prefill
    tokens (the old fit) made a 16-token prompt cost 0.7 ms a token, 23x too much."""
    decode = [(r, 0.010 + 5e-5 * r) for r in (4, 16, 32, 64, 64, 48)]
    steps = [(16, 63, 0), (32, 0, 0), (48, 40, 0), (16, 10, 0), (160, 60, 0)]
    prefill = [(t, h, 0.002 + 3e-5 * t + (0.010 + 5e-5 * h if h else 0.0)) for t, h, _ in steps]
    # Two modes' engines report separately; the fit sums them.
    fs = [_sums(decode[:3], prefill[:2]), _sums(decode[3:], prefill[2:])]
    a, b, c, n = _decode_fit(fs)
    assert n == 6 and abs(a - 0.010) < 1e-9 and abs(b - 5e-5) < 1e-12 and c == 0.0
    base, per_token = _prefill_fit(fs, a, b)
    assert abs(base - 0.002) < 1e-9 and abs(per_token - 3e-5) < 1e-12
    whole_step = sum(s for _, _, s in prefill) / sum(t for t, _, _ in prefill)
    assert whole_step > 5 * per_token


def test_an_engine_that_reported_no_prefill_sums_fits_to_zero_not_an_error():
    fs = [{k: 0 for k in _sums([], [])}]
    assert _decode_fit(fs) == (0.0, 0.0, 0.0, 0)
    assert _prefill_fit(fs, 0.0, 0.0) == (0.0, 0.0)


def _context_sums(decode: list[tuple[int, int, float]], prefill: list[tuple[int, int, int, float]]) -> dict[str, float]:
    """The sums with context: decode steps (rows, context, seconds); prefilling steps (t, h, c_h, seconds)."""
    sums = _sums([(r, s) for r, _, s in decode], [(t, h, s) for t, h, _, s in prefill])
    sums.update(
        decode_context=sum(c for _, c, _ in decode),
        decode_context_squared=sum(c * c for _, c, _ in decode),
        decode_rows_context=sum(r * c for r, c, _ in decode),
        decode_context_seconds=sum(c * s for _, c, s in decode),
        prefill_step_held_context=sum(c for _, _, c, _ in prefill),
        prefill_step_tokens_held_context=sum(t * c for t, _, c, _ in prefill),
    )
    return sums


def test_the_decode_fit_separates_rows_from_the_context_they_attend_over():
    """Decode 6 ms + 40 us a row + 20 ns a context token, with rows and context varying apart (a
    long-response engine's); prefill 30 ms + 15 us a token beside held rows. All five come back;
    the two-term fit would put the context's cost into the rows'."""

    def step(r: int, c: int) -> float:
        return 0.006 + 4e-5 * r + 2e-8 * c

    shapes = ((4, 900), (64, 9000), (64, 60000), (32, 40000), (8, 200))
    decode = [(r, c, step(r, c)) for r, c in shapes]
    prefill = [
        (t, h, c, 0.03 + 1.5e-5 * t + (step(h, c) if h else 0.0))
        for t, h, c in ((16, 63, 30000), (128, 0, 0), (64, 10, 2000))
    ]
    a, b, c, n = _decode_fit([_context_sums(decode, prefill)])
    assert n == 5
    assert (a, b, c) == pytest.approx((0.006, 4e-5, 2e-8), rel=1e-6)
    base, per_token = _prefill_fit([_context_sums(decode, prefill)], a, b, c)
    assert (base, per_token) == pytest.approx((0.03, 1.5e-5), rel=1e-6)
    two_term = _decode_fit([_sums([(r, s) for r, _, s in decode], [])])
    assert two_term[1] > 1.2 * b  # without the context term the rows absorb its cost


def _request(start: float, end: float, tokens: int) -> dict[str, object]:
    return {"kind": "request", "slot": 0, "start": start, "end": end, "tokens": tokens}


def test_the_slowdown_in_training_compares_requests_wholly_inside_and_wholly_outside():
    """Tokens per second outside training steps over inside; requests that straddle a step's
    edge, or are too short to say, count on neither side."""
    events = [
        {"kind": "train", "step": 0, "start": 10.0, "end": 20.0},
        _request(0.0, 2.0, 100),  # outside: 50 tokens/s
        _request(3.0, 5.0, 100),  # outside
        _request(11.0, 15.0, 100),  # inside: 25 tokens/s
        _request(9.0, 12.0, 500),  # straddles the start: neither
        _request(16.0, 16.1, 5),  # too short: neither
    ]
    assert _slowdown_in_training(events) == 2.0
    assert _slowdown_in_training([e for e in events if e["start"] < 9.0 or e["kind"] == "train"]) is None


def test_the_simulated_trainer_takes_each_step_its_own_time(tmp_path, monkeypatch):
    """Per-step training times (the twin's: the real run's `time/train`), the last for any step beyond them."""
    from types import SimpleNamespace

    slept: list[float] = []
    monkeypatch.setattr("benchmarks.modes_sim.time.sleep", slept.append)
    trainer = SimulatedTrainer([0.5, 0.1, 0.3], tmp_path)
    for step in range(5):
        trainer.train_step(SimpleNamespace(step=step))
    assert slept == [0.5, 0.1, 0.3, 0.3, 0.3]
    with pytest.raises(ValueError, match="empty"):
        SimulatedTrainer([], tmp_path)
