"""The simulated twin's time model (`benchmarks/modes_builtin.py`), fitted from the sums the
built-in engine reports in `/server_info` (`engines/kv_forward.py`'s `SlotStatistics`)."""

from __future__ import annotations

import pytest

from benchmarks.modes_builtin import _decode_fit, _prefill_fit, _share_in_training, twin_fit
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


def test_the_share_in_training_counts_busy_slot_time_inside_training_steps():
    events = [
        {"kind": "train", "step": 0, "start": 10.0, "end": 20.0},
        _request(0.0, 2.0, 100),  # outside: 2 s
        _request(11.0, 15.0, 100),  # inside: 4 s
        _request(9.0, 12.0, 500),  # 1 s outside, 2 s inside
    ]
    assert _share_in_training(events) == pytest.approx(6 / 9)
    assert _share_in_training([e for e in events if e["kind"] == "request"]) == 0.0


def test_the_sharing_slowdown_is_what_async_decode_took_beyond_the_sync_fitted_model():
    """The decode model comes from the modes whose engine idles while the trainer trains; an
    async engine that decoded 40% of its steps beside training at 1.5x its own cost took
    (0.6 + 0.4 x 1.5) x the model's seconds, and the fit gives 1.5 back. Fitted over every mode
    instead, the async steps would raise the model and hide part of the sharing."""
    import argparse

    def step(r: int, c: int) -> float:
        return 0.006 + 4e-5 * r + 2e-8 * c

    alone = [(r, c, step(r, c)) for r, c in ((4, 900), (64, 9000), (64, 60000), (32, 40000), (8, 200))]
    shared = [(64, 40000, step(64, 40000) * (1.5 if i % 5 < 2 else 1.0)) for i in range(50)]
    prefill = [(16, 0, 0, 0.03 + 1.5e-5 * 16), (128, 0, 0, 0.03 + 1.5e-5 * 128)]

    def mode(decode, share):
        return {"forward": _context_sums(decode, prefill), "share in training": share, "publish s": 0.2}

    results = {"sync": mode(alone, 0.0), "async": mode(shared, 0.4)}
    fit = twin_fit(argparse.Namespace(device="cpu"), results)
    assert (fit["decode_base"], fit["decode_per_row"], fit["decode_per_context"]) == pytest.approx(
        (0.006, 4e-5, 2e-8), rel=1e-6
    )
    assert fit["slowdown"] == pytest.approx(1.5, rel=1e-6)
    assert twin_fit(argparse.Namespace(device="cpu"), {"sync": mode(alone, 0.0)})["slowdown"] == 1.0


def test_the_simulated_trainer_takes_each_step_its_own_time(tmp_path, monkeypatch):
    """Per-step training times (the twin's: the real run's `perf/train_time`), the last for any step beyond them."""
    from types import SimpleNamespace

    slept: list[float] = []
    monkeypatch.setattr("benchmarks.modes_sim.time.sleep", slept.append)
    trainer = SimulatedTrainer([0.5, 0.1, 0.3], tmp_path)
    for step in range(5):
        trainer.train_step(SimpleNamespace(step=step))
    assert slept == [0.5, 0.1, 0.3, 0.3, 0.3]
    with pytest.raises(ValueError, match="empty"):
        SimulatedTrainer([], tmp_path)


def test_the_twin_reruns_from_saved_inputs_and_keeps_its_events(tmp_path, capsys):
    """`--twin-from`: a real run's saved workload, fit and figures run the twin again without the
    real engine, and each twin mode's events land beside the pages, one training span a step as long
    as that mode's own training time at the time scale."""
    import argparse
    import json

    from benchmarks.modes_builtin import TWIN_RESULTS, rerun_twin, save_twin_inputs

    args = argparse.Namespace(
        steps=2, batch=2, group=2, max_len=16, length_tail="lognormal:-1.9,0.8", device="cpu",
        rollout_seed=3, num_prompts=32,
    )  # fmt: skip
    fit = {
        "decode_base": 2e-3, "decode_per_row": 1e-5, "decode_per_context": 1e-8, "decode_steps": 10,
        "prefill_base": 1e-3, "prefill_per_token": 1e-5, "publish": 0.01, "slowdown": 1.0,
    }  # fmt: skip
    results = {
        name: {"span": 1.0, "busy": 0.5, "steady busy": 0.5, "train steps": [0.8, 0.2],
               "share in training": 0.0, "publish s": 0.01, "forward": {"not": "saved"}}
        for name in ("sync", "sync+partial", "async", "async+overlap")
    }  # fmt: skip
    path = tmp_path / "twin-inputs.json"
    save_twin_inputs(path, args, results, fit)
    saved = json.loads(path.read_text())
    assert set(saved["modes"]["sync"]) == set(TWIN_RESULTS)  # the raw forward sums are fitted, not kept
    rerun_twin(path, time_scale=0.5, timeline_dir=str(tmp_path / "pages"))
    assert "async+overlap" in capsys.readouterr().out
    for name in ("sync", "sync-partial", "async", "async-overlap"):
        events = [
            json.loads(line) for line in (tmp_path / "pages" / f"events-twin-{name}.jsonl").read_text().splitlines()
        ]
        trains = sorted((e for e in events if e["kind"] == "train"), key=lambda e: e["step"])
        first, second = (e["end"] - e["start"] for e in trains)
        assert first >= 0.4 and 0.1 <= second < 0.4, (name, first, second)  # 0.8 s and 0.2 s at scale 0.5
    # The real run's prompts and seed: each twin sample ends where the length tail ended it there.
    from engines.sim_model import LengthModel
    from pipeline.tasks.toy import toy_dataset
    from stages.continuation import sampling_seed

    prompts = toy_dataset(32, seed=3)
    lengths = LengthModel.parse("lognormal:-1.9,0.8")
    events = [json.loads(line) for line in (tmp_path / "pages" / "events-twin-sync.jsonl").read_text().splitlines()]
    requests = [e for e in events if e["kind"] == "request"]
    assert len(requests) == 2 * 2 * 2
    for r in requests:
        prompt = prompts[int(r["group"].split("-p")[1])].prompt_ids
        drawn = lengths.target(sampling_seed(3, r["group"], r["sample"]), prompt, 16)
        assert r["tokens"] == (16 if drawn is None else drawn), r
    path.write_text(json.dumps({"modes": {}}))
    with pytest.raises(SystemExit, match="not a twin-inputs file"):
        rerun_twin(path, time_scale=0.5, timeline_dir=None)
