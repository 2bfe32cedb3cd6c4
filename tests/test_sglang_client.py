"""The SGLang client against the fake SGLang server over real HTTP on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import aiohttp
import anyio
import pytest

from core.errors import EngineError, EngineUnavailableError
from core.types import FinishReason
from stages.sglang_client import EngineClient, EngineFleet, EngineLoad, GenerateResult
from stages.sglang_client.http1 import GeneratePool
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio

PROMPT = [11, 12, 13]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s
    for pool in _LEAN:  # the lean connections `client` opened, closed with the session
        await pool.aclose()
    _LEAN.clear()


@pytest.fixture
async def fake() -> AsyncIterator[FakeSGLang]:
    async with FakeSGLang(weight_version="3") as f:
        yield f


# Every test here runs twice: `/generate` over aiohttp, and over the fleet's lean connections
# (`stages.sglang_client.http1`); control calls take aiohttp either way.
_LEAN: list[GeneratePool] = []
_TRANSPORT = ["aiohttp"]


@pytest.fixture(params=["aiohttp", "lean"], autouse=True)
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    _TRANSPORT[0] = request.param
    yield request.param
    _TRANSPORT[0] = "aiohttp"


def client(url: str, session: aiohttp.ClientSession, **kw: float) -> EngineClient:
    opts = dict(request_timeout=10.0, control_timeout=5.0, max_retries=3, retry_backoff=0.001) | kw
    pool = None
    if _TRANSPORT[0] == "lean":
        pool = GeneratePool(url)
        _LEAN.append(pool)
    return EngineClient(url, session, generate_pool=pool, **opts)  # type: ignore[arg-type]


def scripted(tokens: list[int]):
    """A token function that answers `tokens` in order, whatever the prompt."""
    return lambda context, seed: tokens[len(context) - len(PROMPT)]


# -- finish reasons and parsing --------------------------------------------------------------


async def test_length_finish_carries_tokens_logprobs_and_counts(fake, session):
    result = await client(fake.url, session).generate(PROMPT, {"max_new_tokens": 5}, rid="r-len")

    served = fake.finished[-1]
    assert result.finish_reason is FinishReason.LENGTH
    assert result.token_ids == tuple(served.output_ids) and len(result.token_ids) == 5
    assert result.logprobs == tuple(served.logprobs)
    assert (result.rid, result.weight_version) == ("r-len", "3")
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (3, 5, 0)
    assert fake.generate_payloads[-1]["return_logprob"] is True
    segment = result.to_segment(3)
    assert (segment.token_ids, segment.logprobs, segment.version) == (result.token_ids, result.logprobs, 3)
    assert segment.finish_reason is FinishReason.LENGTH


async def test_stop_token_is_matched_and_kept():
    async with FakeSGLang(token_fn=scripted([5, 6, 99, 7])) as fake, aiohttp.ClientSession() as session:
        result = await client(fake.url, session).generate(
            PROMPT, {"max_new_tokens": 10, "stop_token_ids": [99]}, rid="r-stop"
        )
    assert result.finish_reason is FinishReason.STOP
    assert result.matched == 99
    assert result.token_ids == (5, 6, 99)  # the stop token stays in the tokens and log-probs
    assert len(result.logprobs) == 3


async def test_stop_string_is_matched():
    # The fake spells token t as chr(ord("a") + t % 26): 7,4,11,11,14 is "hello".
    async with FakeSGLang(token_fn=scripted([7, 4, 11, 11, 14])) as fake, aiohttp.ClientSession() as session:
        result = await client(fake.url, session).generate(PROMPT, {"max_new_tokens": 10, "stop": ["ll"]}, rid="r-s")
    assert result.finish_reason is FinishReason.STOP
    assert result.matched == "ll"
    assert result.token_ids == (7, 4, 11, 11)


def test_parser_reads_every_finish_shape_and_two_element_logprobs():
    def body(finish_reason: object, entries: list) -> dict:
        meta = {"id": "x", "finish_reason": finish_reason, "weight_version": "2", "output_token_logprobs": entries}
        return {"text": "", "output_ids": [e[1] for e in entries], "meta_info": meta}

    waiting = GenerateResult.from_response(
        body({"type": "abort", "message": "Abort in waiting queue"}, []), url="u", rid="x"
    )
    assert (waiting.finish_reason, waiting.finish_message) == (FinishReason.ABORT, "Abort in waiting queue")
    assert (waiting.prompt_tokens, waiting.cached_tokens, waiting.completion_tokens) == (None, None, 0)

    running = GenerateResult.from_response(
        body({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}, [[-0.5, 4]]),
        url="u",
        rid="x",
    )
    assert (running.finish_reason, running.token_ids, running.logprobs) == (FinishReason.ABORT, (4,), (-0.5,))

    mixed = [[-1, 1], [-2.5, 2, None]]  # 2-element entries (slime's fake) and 3-element ones (SGLang)
    length = GenerateResult.from_response(body({"type": "length", "length": 2}, mixed), url="u", rid="x")
    assert (length.finish_reason, length.token_ids, length.logprobs) == (FinishReason.LENGTH, (1, 2), (-1.0, -2.5))
    by_token = GenerateResult.from_response(body({"type": "stop", "matched": 2}, []), url="u", rid="x")
    by_string = GenerateResult.from_response(body({"type": "stop", "matched": "</a>"}, []), url="u", rid="x")
    assert (by_token.matched, by_string.matched) == (2, "</a>")


def _meta(finish_reason: object, entries: list, *, weight_version: str | None = "1") -> dict:
    meta = {"finish_reason": finish_reason, "output_token_logprobs": entries}
    if weight_version is not None:
        meta["weight_version"] = weight_version
    return meta


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        (_meta({"type": "stop", "matched": 1}, [[None, 1, None]]), "logprob"),  # orjson writes NaN as null
        (_meta({"type": "stop", "matched": 1}, [[-0.1, 1, None]], weight_version=None), "weight_version"),
        (_meta({"type": "exploded"}, []), "exploded"),
        (_meta(None, []), "finish_reason"),  # a streaming chunk, not a finished answer
    ],
)
def test_parser_rejects_what_it_cannot_trust(meta, problem):
    with pytest.raises(EngineError, match=problem) as info:
        GenerateResult.from_response({"meta_info": meta}, url="http://engine:1/generate", rid="x")
    assert info.value.url == "http://engine:1/generate"


# -- abort --------------------------------------------------------------------------------------


async def test_abort_in_flight_returns_the_partial_output(fake, session):
    fake.hold_at = 3
    engine = client(fake.url, session)
    results: list[GenerateResult] = []

    async def run() -> None:
        results.append(await engine.generate(PROMPT, {"max_new_tokens": 50}, rid="r-abort"))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await fake.wait_until(lambda: fake.held == 1)
            await engine.abort("r-abort")

    [result] = results
    assert result.finish_reason is FinishReason.ABORT
    assert result.finish_message == "Aborted"
    assert len(result.token_ids) == 3 and result.prompt_tokens == 3
    # Deterministic per context: the partial prefix is the start of the uninterrupted answer.
    fake.hold_at = None
    full = await engine.generate(PROMPT, {"max_new_tokens": 50}, rid="r-full")
    assert full.token_ids[:3] == result.token_ids
    assert result.to_segment(3).finish_reason is FinishReason.ABORT
    assert engine.statistics().aborts == 1


@asynccontextmanager
async def one_held_one_waiting(fake: FakeSGLang, engine: EngineClient) -> AsyncIterator[dict[str, GenerateResult]]:
    """Request "first" held after one token (the fake runs one request at a time) and "second" in the
    waiting queue behind it; the body acts on them; on exit both have answered, into the dict."""
    fake.hold_at = 1
    results: dict[str, GenerateResult] = {}

    async def run(rid: str) -> None:
        results[rid] = await engine.generate(PROMPT, {"max_new_tokens": 4}, rid=rid)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "first")
            await fake.wait_until(lambda: fake.held == 1)
            tg.start_soon(run, "second")
            await fake.wait_until(lambda: fake.waiting == 1)
            yield results


async def test_abort_in_waiting_queue_has_no_prompt_counts(session):
    async with FakeSGLang(max_running=1) as fake:
        engine = client(fake.url, session)
        async with one_held_one_waiting(fake, engine) as results:
            assert await engine.loads() == EngineLoad(running=1, waiting=1)
            await engine.abort("second")
            await fake.wait_until(lambda: [r.rid for r in fake.finished] == ["second"])
            fake.release()

    waiting = results["second"]
    assert waiting.finish_reason is FinishReason.ABORT
    assert waiting.finish_message == "Abort in waiting queue"
    assert waiting.token_ids == () and waiting.prompt_tokens is None and waiting.cached_tokens is None
    assert results["first"].finish_reason is FinishReason.LENGTH and len(results["first"].token_ids) == 4


async def test_abort_before_prefill_from_older_servers_is_an_empty_abort_not_an_error(session):
    # SGLang up to late 2025 answers a request aborted in the waiting queue with no weight_version,
    # no output_ids and no log-probs ("Abort before prefill"): nothing to stamp, nothing to lose.
    async with FakeSGLang(max_running=1, legacy_waiting_abort=True) as fake:
        engine = client(fake.url, session)
        async with one_held_one_waiting(fake, engine) as results:
            await engine.abort_all()
    waiting = results["second"]
    assert (waiting.finish_reason, waiting.finish_message) == (FinishReason.ABORT, "Abort before prefill")
    assert waiting.token_ids == () and waiting.weight_version is None and waiting.weight_versions is None
    assert waiting.to_segment(7).version == 7
    assert engine.statistics().errors == 0


def test_a_missing_weight_version_is_still_an_error_when_the_answer_has_tokens():
    meta = {"id": "x", "finish_reason": {"type": "abort", "message": "Aborted"}, "completion_tokens": 1}
    with pytest.raises(EngineError, match="weight_version"):
        GenerateResult.from_response({"output_ids": [5], "meta_info": meta}, url="u", rid="x")
    meta["output_token_logprobs"] = [[-0.1, 5, None]]
    with pytest.raises(EngineError, match="weight_version"):
        GenerateResult.from_response({"output_ids": [5], "meta_info": meta}, url="u", rid="x")


# -- retries and deadlines ------------------------------------------------------------------


async def test_generate_retries_5xx_then_succeeds(fake, session):
    fake.fail("/generate", status=503, times=2)
    engine = client(fake.url, session, max_retries=3)
    result = await engine.generate(PROMPT, {"max_new_tokens": 2}, rid="r-retry")
    assert result.finish_reason is FinishReason.LENGTH
    assert fake.calls["/generate"] == 3
    stats = engine.statistics()
    assert (stats.requests, stats.retries, stats.errors) == (3, 2, 0)


async def test_generate_gives_up_after_max_retries(fake, session):
    fake.fail("/generate", status=500, times=10, message="scheduler died")
    engine = client(fake.url, session, max_retries=2)
    with pytest.raises(EngineError, match="scheduler died") as info:
        await engine.generate(PROMPT, {"max_new_tokens": 2}, rid="r-dead")
    assert info.value.status == 500
    assert info.value.url == fake.url + "/generate"
    assert fake.calls["/generate"] == 3  # one try and two retries
    assert engine.statistics().errors == 1


async def test_generate_retries_a_dropped_connection(fake, session):
    fake.drop("/generate", times=1)
    result = await client(fake.url, session).generate(PROMPT, {"max_new_tokens": 2}, rid="r-drop")
    assert result.finish_reason is FinishReason.LENGTH
    assert fake.calls["/generate"] == 2


async def test_a_resend_after_a_dropped_connection_is_a_new_request_to_the_engine(fake, session):
    # SGLang keeps a request whose client hung up until it notices (seconds later); a resend with
    # the same rid would be refused as a duplicate, or would share the first one's state.
    fake.drop_admitted(times=2)
    result = await client(fake.url, session).generate(PROMPT, {"max_new_tokens": 2}, rid="r-orphan")
    assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 2
    rids = [p["rid"] for p in fake.generate_payloads]
    assert len(rids) == 3 and len(set(rids)) == 3
    assert all(r.startswith("r-orphan") for r in rids)  # an abort of the rid still reaches every attempt
    assert rids[0] == "r-orphan"


@pytest.mark.parametrize("status", [408, 429])
async def test_generate_retries_the_routers_overload_answers(fake, session, status):
    # sglang-router with --max-concurrent-requests answers 429 (its queue is full) and 408 (a
    # request waited in its queue past --queue-timeout-secs), both with an empty body.
    fake.fail("/generate", status=status, times=2)
    result = await client(fake.url, session, max_retries=3).generate(PROMPT, {"max_new_tokens": 2}, rid="r-busy")
    assert result.finish_reason is FinishReason.LENGTH
    assert fake.calls["/generate"] == 3


async def test_generate_400_is_not_retried(fake, session):
    with pytest.raises(EngineError, match="input_ids cannot be empty") as info:
        await client(fake.url, session).generate([], {"max_new_tokens": 2}, rid="r-bad")
    assert info.value.status == 400
    assert not isinstance(info.value, EngineUnavailableError)
    assert fake.calls["/generate"] == 1


async def test_generate_deadline_raises_unavailable_naming_the_url(fake, session):
    fake.hold_at = 0  # the engine never answers
    engine = client(fake.url, session, request_timeout=0.3)
    with anyio.fail_after(5):
        with pytest.raises(EngineUnavailableError, match="no answer within 0.3 s") as info:
            await engine.generate(PROMPT, {"max_new_tokens": 2}, rid="r-slow")
        assert fake.url in str(info.value)
        assert fake.calls["/generate"] == 1  # a timeout is not retried
        # Hanging up ends the request in the engine too, as SGLang aborts on disconnect.
        await fake.wait_until(lambda: not fake.requests)


async def test_unreachable_engine_is_retried_then_unavailable(session):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connection refused
        engine = client(url, session, max_retries=2)
        with pytest.raises(EngineUnavailableError) as info:
            await engine.generate(PROMPT, {}, rid="r-nowhere")
        assert info.value.url == url + "/generate"
        assert engine.statistics().retries == 2
        assert await engine.health() is False


# -- control calls -------------------------------------------------------------------------


async def test_flush_cache_retries_while_the_engine_is_busy(fake, session):
    fake.hold_at = 2
    engine = client(fake.url, session)
    order: list[str] = []

    async def generate() -> None:
        await engine.generate(PROMPT, {"max_new_tokens": 4}, rid="r-busy")
        order.append("generated")

    async def flush() -> None:
        await engine.flush_cache(5.0)
        order.append("flushed")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            await fake.wait_until(lambda: fake.held == 1)
            tg.start_soon(flush)
            await fake.wait_until(lambda: fake.calls["/flush_cache"] >= 2)  # refused at least twice
            assert order == []
            fake.release()
    assert order == ["generated", "flushed"]


async def test_flush_cache_gives_up_at_its_deadline(fake, session):
    fake.flush_busy_times = 10_000
    with anyio.fail_after(5), pytest.raises(EngineError, match="still busy after 0.6 s") as info:
        await client(fake.url, session).flush_cache(0.6)
    assert info.value.status == 400
    assert fake.calls["/flush_cache"] >= 2


async def test_weight_version_falls_back_to_get_model_info(session):
    async with FakeSGLang(weight_version="7", legacy_model_info=True) as fake:
        assert await client(fake.url, session).weight_version() == "7"
        assert (fake.calls["/model_info"], fake.calls["/get_model_info"]) == (1, 1)
    async with FakeSGLang(weight_version="8") as fake:
        assert await client(fake.url, session).weight_version() == "8"
        assert (fake.calls["/model_info"], fake.calls["/get_model_info"]) == (1, 0)


async def test_update_weights_from_disk_sets_the_version_or_reports_the_engine_message(fake, session, tmp_path):
    engine = client(fake.url, session)
    await engine.update_weights_from_disk(str(tmp_path), weight_version="4")
    assert fake.loaded_paths == [str(tmp_path)]
    assert await engine.weight_version() == "4"

    fake.weight_update_error = "Failed to get weights iterator: no safetensors in /nope"
    with pytest.raises(EngineError, match="no safetensors in /nope") as info:
        await engine.update_weights_from_disk("/nope", weight_version="5")
    assert info.value.status == 400
    assert fake.weight_version == "4"


async def test_update_weight_version_keeps_requests_running_and_stamps_at_assembly(fake, session):
    fake.hold_at = 1
    engine = client(fake.url, session)
    results: list[GenerateResult] = []

    async def run() -> None:
        results.append(await engine.generate(PROMPT, {"max_new_tokens": 3}, rid="r-ver"))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await fake.wait_until(lambda: fake.held == 1)
            await engine.update_weight_version("5")  # sends abort_all_requests=false
            assert fake.requests and not fake.requests[0].aborted
            fake.release()
    assert results[0].finish_reason is FinishReason.LENGTH
    assert results[0].weight_version == "5"


async def test_pause_abort_returns_partials_and_holds_new_requests_until_continue(fake, session):
    fake.hold_at = 2
    engine = client(fake.url, session)
    results: dict[str, GenerateResult] = {}

    async def run(rid: str) -> None:
        results[rid] = await engine.generate(PROMPT, {"max_new_tokens": 4}, rid=rid)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "before")
            await fake.wait_until(lambda: fake.held == 1)
            await engine.pause("abort")
            assert results["before"].finish_reason is FinishReason.ABORT
            assert len(results["before"].token_ids) == 2

            fake.release()
            tg.start_soon(run, "during")
            await fake.wait_until(lambda: fake.calls["/generate"] == 2)
            await anyio.wait_all_tasks_blocked()
            assert "during" not in results and fake.requests == []  # parked before the scheduler
            await engine.continue_generation()
    assert results["during"].finish_reason is FinishReason.LENGTH


async def test_pause_in_place_keeps_requests_and_flush_is_refused(fake, session):
    engine = client(fake.url, session)
    fake.hold_at = 1
    results: list[GenerateResult] = []

    async def run() -> None:
        results.append(await engine.generate(PROMPT, {"max_new_tokens": 3}, rid="r-inplace"))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await fake.wait_until(lambda: fake.held == 1)
            fake.hold_at = None  # from now on only the pause holds it
            await engine.pause("in_place")
            assert await engine.loads() == EngineLoad(running=1, waiting=0)
            with pytest.raises(EngineError, match="pending requests"):
                await engine.flush_cache(0.5)
            await engine.continue_generation()
    assert results[0].finish_reason is FinishReason.LENGTH and len(results[0].token_ids) == 3
    with pytest.raises(ValueError, match="sideways"):
        await engine.pause("sideways")  # type: ignore[arg-type]


async def test_wait_healthy_polls_until_the_engine_is_up(fake, session):
    fake.starting_polls = 3
    engine = client(fake.url, session)
    with anyio.fail_after(5):
        await engine.wait_healthy(5.0)
    assert fake.calls["/health_generate"] == 4
    assert await engine.health() is True

    fake.healthy = False
    with anyio.fail_after(5), pytest.raises(EngineUnavailableError, match="not healthy within 0.2 s") as info:
        await engine.wait_healthy(0.2)
    assert fake.url in str(info.value)


# -- the fleet -------------------------------------------------------------------------------


def fleet_for(*fakes: FakeSGLang, **kw) -> EngineFleet:
    # No router here: the first engine stands in for /generate; control calls reach every engine.
    urls = [f.url for f in fakes]
    return EngineFleet(urls, router_url=urls[0] if len(urls) > 1 else None, concurrency=4,
                       request_timeout=10, control_timeout=5, retry_backoff=0.001,
                       lean_generate=_TRANSPORT[0] == "lean", **kw)  # fmt: skip


async def test_fleet_with_one_engine_generates_and_counts(fake):
    async with fleet_for(fake) as fleet:
        assert fleet.generate_url == fake.url and fleet.worker_urls == (fake.url,)
        fake.fail("/generate", times=1)
        result = await fleet.generate(PROMPT, {"max_new_tokens": 2}, rid="f1")
        assert result.weight_version == "3"
        stats = fleet.statistics()
        assert (stats.requests, stats.retries, stats.errors) == (2, 1, 0)
    with pytest.raises(RuntimeError, match="async with"):
        _ = fleet.worker_urls


def test_fleet_needs_a_router_for_several_engines():
    with pytest.raises(ValueError, match="need a router"):
        EngineFleet(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    with pytest.raises(ValueError, match="worker URLs, a router URL"):
        EngineFleet()


async def test_fleet_fan_out_reaches_every_engine_and_names_the_one_that_failed():
    async with FakeSGLang() as a, FakeSGLang() as b, fleet_for(a, b) as fleet:
        b.weight_update_error = "out of disk"
        with pytest.raises(EngineError, match="out of disk") as info:
            await fleet.update_weights_from_disk("/ckpt/9", weight_version="9")
        assert info.value.url == b.url
        assert "1 of 2 engines" in str(info.value)
        assert a.weight_version == "9"  # the healthy engine still got the call
        assert await fleet.weight_versions() == {a.url: "9", b.url: "default"}

        await b.stop()
        with pytest.raises(EngineUnavailableError) as info:
            await fleet.abort_all()
        assert info.value.url == b.url
        assert a.calls["/abort_request"] == 1


async def test_fleet_control_calls_fan_out_to_all_engines():
    async with FakeSGLang() as a, FakeSGLang() as b, fleet_for(a, b) as fleet, aiohttp.ClientSession() as session:
        for f in (a, b):
            f.hold_at = 1
        results: dict[str, GenerateResult] = {}

        async def run(f: FakeSGLang) -> None:
            # Straight to each engine: there is no router in this test to spread the requests.
            results[f.url] = await client(f.url, session).generate(PROMPT, {"max_new_tokens": 5}, rid="same-rid")

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, a)
                tg.start_soon(run, b)
                await a.wait_until(lambda: a.held == 1)
                await b.wait_until(lambda: b.held == 1)
                assert await fleet.loads() == {a.url: EngineLoad(1, 0), b.url: EngineLoad(1, 0)}
                await fleet.abort_all()
        assert {r.finish_reason for r in results.values()} == {FinishReason.ABORT}

        await fleet.pause("retract")
        await fleet.continue_generation()
        await fleet.update_weight_version("2")
        await fleet.flush_cache(1.0)
        await fleet.wait_healthy(1.0)
        assert await fleet.weight_versions() == {a.url: "2", b.url: "2"}
        for f in (a, b):
            assert f.calls["/pause_generation"] == f.calls["/continue_generation"] == 1
            assert f.calls["/flush_cache"] == 1


async def test_a_heartbeat_that_hangs_during_a_pause_does_not_evict_the_engine():
    # SGLang ~0.5.x answers /health like /health_generate, which waits (20 s) for a decode step
    # that a pause withholds: a liveness probe then times out on a healthy engine.
    from stages.sglang_client.health import FaultPolicy

    policy = FaultPolicy(interval=0.05, timeout=0.1)
    async with FakeSGLang(health_waits_while_paused=True) as fake:
        async with EngineFleet([fake.url], control_timeout=5, fault_policy=policy) as fleet:
            with anyio.fail_after(10):
                probes = fake.calls["/health"]
                await fleet.pause("in_place")
                # A liveness probe hangs (the first may time out; the heartbeat then asks again,
                # outwaiting SGLang's health wait, and that one is answered at continue).
                await fake.wait_until(lambda: fake.calls["/health"] >= probes + 1)
                await fleet.continue_generation()
            assert fleet.worker_urls == (fake.url,)
            assert fleet.fault_statistics().evictions_total == 0  # type: ignore[union-attr]


async def test_an_engine_that_hangs_during_a_pause_is_evicted_once_it_outlasts_sglangs_health_wait():
    # A stopped (SIGSTOP) engine during a publish: before, every probe's timeout was put down to
    # SGLang's health wait, nothing evicted it, and the publish's weight update to it waited for its
    # request timeout (an hour by default), seen in a run. The second probe outwaits that wait; the
    # only engine gone, the fleet ends with the error naming why instead of waiting forever.
    from stages.sglang_client.health import FaultPolicy

    policy = FaultPolicy(interval=0.05, timeout=0.1, quiet_wait=0.5)
    with anyio.fail_after(10), pytest.raises(BaseException) as raised:
        async with FakeSGLang(health_waits_while_paused=True) as hung:
            async with EngineFleet([hung.url], control_timeout=5, fault_policy=policy) as fleet:
                await fleet.pause("in_place")
                await anyio.sleep_forever()
    leaves = raised.value.exceptions if isinstance(raised.value, BaseExceptionGroup) else (raised.value,)
    text = " ".join(str(e) for e in leaves)
    assert "no answer within 0.5 s while the engines were quiet" in text, text
    assert "fewer than --min-live-engines 1" in text, text


async def test_a_pause_that_begins_while_a_health_probe_waits_does_not_evict_the_engine():
    # A /health_generate sent before a publish's pause waits for a decode step; the pause aborts or
    # withholds it, and the probe answers 503. That 503 is the pause's: before, the heartbeat judged
    # it by the fleet's state when the probe went out, and evicted a healthy engine (seen in a run).
    from stages.sglang_client.health import FaultPolicy

    policy = FaultPolicy(interval=0.05, timeout=5.0)
    async with FakeSGLang() as fake:
        fake.health_generate_gate = anyio.Event()
        async with EngineFleet([fake.url], control_timeout=5, fault_policy=policy) as fleet:
            with anyio.fail_after(10):
                await fake.wait_until(lambda: fake.calls["/health_generate"] >= 1)  # a probe waits
                await fleet.pause("abort")
                answered = fake.calls["/health"]
                fake.health_generate_gate.set()  # it answers 503 now: the engine is paused
                await fake.wait_until(lambda: fake.calls["/health"] >= answered + 2)  # heartbeats went on
                await fleet.continue_generation()
            assert fleet.worker_urls == (fake.url,)
            assert fleet.fault_statistics().evictions_total == 0  # type: ignore[union-attr]


async def test_a_heartbeat_during_a_long_weight_load_does_not_evict_the_engine(tmp_path):
    # An overlapped publish does not pause; while SGLang loads a checkpoint it holds the model
    # update lock, no output arrives, and /health_generate answers 503 after 20 s.
    from stages.sglang_client.health import FaultPolicy

    policy = FaultPolicy(interval=0.05, timeout=1.0)
    async with FakeSGLang() as fake:
        async with EngineFleet([fake.url], control_timeout=5, fault_policy=policy) as fleet:
            fake.loading = True
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: fleet.update_weights_from_disk(str(tmp_path), weight_version="1"))
                    await fake.wait_until(lambda: fake.calls["/update_weights_from_disk"] == 1)
                    probes = sum(fake.calls[p] for p in ("/health", "/health_generate"))
                    await fake.wait_until(
                        lambda: sum(fake.calls[p] for p in ("/health", "/health_generate")) >= probes + 3
                    )
                    fake.loading = False
            assert fleet.worker_urls == (fake.url,) and fake.weight_version == "1"
            assert fleet.fault_statistics().evictions_total == 0  # type: ignore[union-attr]
