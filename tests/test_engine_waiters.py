"""Who the engine core wakes at each decode step (engines/request.py): a whole answer's handler
waits for its request's finish alone, a stream's writer for every change. One event for both woke
every non-streaming handler at every token, for it to find no finish yet: the scheduler's cost a
request a step went from 9 us to 4 on a development CPU without it (`benchmarks/engine_host.py`),
where the built-in engine's host work per request bounds the async modes' throughput at a small
model (BENCHMARKS 16, the tenth session). The benchmark's own smoke test is here too."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from benchmarks.engine_host import InstantForward
from engines import request as request_module
from engines.request import FinishKind, Request
from engines.scheduler import EngineCore
from engines.seam import SamplingParams

pytestmark = pytest.mark.anyio


def _counted_events(monkeypatch: pytest.MonkeyPatch) -> list[anyio.Event]:
    """The events the requests make for their waiters, counted as they are made."""
    made: list[anyio.Event] = []

    def event() -> anyio.Event:
        made.append(anyio.Event())
        return made[-1]

    monkeypatch.setattr(request_module, "anyio", SimpleNamespace(Event=event))
    return made


async def _decode(core: EngineCore, *waits) -> None:
    """Run `core` until every wait returns (a deadline, not a sleep, bounds it)."""
    async with anyio.create_task_group() as tg:
        await tg.start(core.run)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as waiters:
                for wait in waits:
                    waiters.start_soon(wait)
        tg.cancel_scope.cancel()


async def test_a_whole_answer_is_woken_by_its_finish_alone(monkeypatch):
    """40 tokens decoded, one event made for its handler (before: one at every token, each
    waking the handler to find no finish)."""
    made = _counted_events(monkeypatch)
    core = EngineCore(InstantForward(), max_running_requests=2)
    whole = Request(rid="whole", prompt_ids=(3, 4), params=SamplingParams(max_new_tokens=40, ignore_eos=True))
    await core.submit(whole)
    await _decode(core, whole.wait_finished)
    assert whole.finish is not None and whole.finish.kind is FinishKind.LENGTH and len(whole.output_ids) == 40
    assert len(made) == 1


async def test_a_stream_is_woken_by_every_change(monkeypatch):
    made = _counted_events(monkeypatch)
    core = EngineCore(InstantForward(), max_running_requests=2)
    streamed = Request(rid="streamed", prompt_ids=(3, 4), params=SamplingParams(max_new_tokens=40, ignore_eos=True))
    seen: list[int] = []

    async def stream() -> None:
        async for req in streamed.changes():
            seen.append(len(req.output_ids))

    await core.submit(streamed)
    await _decode(core, stream)
    assert seen[-1] == 40 and seen == sorted(set(seen)) and len(seen) > 1  # the tokens as they came
    assert len(seen) - 1 <= len(made) <= len(seen)  # an event a wait: one before each change it saw


async def test_a_request_finished_before_anyone_waits_returns_at_once():
    core = EngineCore(InstantForward(), max_running_requests=1)
    req = Request(rid="r", prompt_ids=(3,), params=SamplingParams(max_new_tokens=3, ignore_eos=True))
    await core.submit(req)
    await _decode(core, req.wait_finished)
    with anyio.fail_after(1):
        await req.wait_finished()  # finished: nothing to wait for
        assert [r.output_ids for r in [x async for x in req.changes()]] == [[5, 5, 5]]


def test_the_host_cost_benchmark_prints_each_case(capsys):
    """`benchmarks/engine_host.py` at a toy size: a line per request count, whole answers and
    streams side by side, and the scheduler alone; then the turnover case, groups of two whole in
    flight (3 requests hold one group); a bad count refused by name."""
    from benchmarks.engine_host import main

    flags = ["--requests", "2,3", "--tokens", "4", "--repeats", "1", "--tail", "6", "--group", "2", "--groups", "5"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    decode, turnover = out.split("turnover:")
    rows = [line.split() for line in decode.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["2", "3"] and all(r[-1].endswith("x") for r in rows)
    assert "the scheduler alone (an instant forward), 3 requests:" in decode
    rows = [line.split() for line in turnover.splitlines() if line.strip()[:1].isdigit()]
    assert [r[:2] for r in rows] == [["2", "2"], ["3", "2"]]
    assert all(float(r[2]) > 0 and 0 <= float(r[-1]) <= 1 for r in rows)  # tokens/s; the prefills' share
    with pytest.raises(SystemExit):
        main(["--requests", "0"])
    assert "--requests '0' and --tokens 300: at least 1 request and 2 tokens" in capsys.readouterr().err


def test_the_turnover_lengths_follow_the_task_tail():
    """The turnover case's asked lengths: within 1..longest, the same for a seed, and P(n) ~ 1/n
    (mean longest / H(longest), 136.5 at 1,024), so most answers are short."""
    from benchmarks.engine_host import tail_lengths

    lengths = tail_lengths(4000, 1024, seed=3)
    assert lengths == tail_lengths(4000, 1024, seed=3) and 1 <= min(lengths) and max(lengths) <= 1024
    harmonic = sum(1 / n for n in range(1, 1025))
    assert abs(sum(lengths) / len(lengths) - 1024 / harmonic) < 0.1 * 1024 / harmonic
    assert sum(n <= 32 for n in lengths) > len(lengths) / 2  # H(32) / H(1024) = 0.54
