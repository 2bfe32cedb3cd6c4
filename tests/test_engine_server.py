"""The built-in engine against real HTTP on 127.0.0.1, a real tiny Qwen3, and (once) a real subprocess.

Requests are aborted mid-generation without sleeps: a long `ignore_eos` request is started and the
test waits until the engine reports it running (or until its first streamed chunk) before aborting.
"""

from __future__ import annotations

import functools
import itertools
import math
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from core.errors import EngineUnavailableError
from engines.builtin import EngineServer, open_server
from launch.builtin_engine import EngineProcess, free_port, start_engine
from pipeline.tasks.tiny_model import CHARS, EOS_ID, build_tokenizer, make_model_folder
from tests.conftest import get_ok_json, post_generate, post_raw, sse_chunks

pytestmark = pytest.mark.anyio

LONG = 400  # max_new_tokens of requests that must still be running when the test acts
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
TOK = build_tokenizer()


def char_id(ch: str) -> int:
    return 3 + CHARS.index(ch)


PROMPT = [char_id(c) for c in "what is 2+3?"]


# ---- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("engine") / "v0", hidden_size=32, num_layers=2, seed=0)


@pytest.fixture(scope="module")
def model_dir_v1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, other weights: what a trainer publishes."""
    return make_model_folder(tmp_path_factory.mktemp("engine") / "v1", hidden_size=32, num_layers=2, seed=1)


@pytest.fixture(scope="module")
def model_dir_wrong_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("engine") / "wide", hidden_size=64, num_layers=2)


@pytest.fixture
async def server(model_dir: Path) -> AsyncIterator[EngineServer]:
    async with open_server(model_dir, port=0, health_check_timeout=0.5) as s:
        yield s


# ---- helpers ----------------------------------------------------------------------------------------------


async def ok(http: aiohttp.ClientSession, url: str, **body: Any) -> dict[str, Any]:
    status, out = await post_generate(http, url, **body)
    assert status == 200, out
    return out


async def loads(http: aiohttp.ClientSession, url: str) -> tuple[int, int]:
    body = await get_ok_json(http, url + "/v1/loads?include=core")
    (load,) = body["loads"]
    assert load["dp_rank"] == 0
    return load["num_running_reqs"], load["num_waiting_reqs"]


async def wait_until(check: Callable[[], Any], timeout: float = 20.0) -> None:
    """Wait for a condition the engine reports; each look is a state read, not a guess at timing."""
    with anyio.fail_after(timeout):
        while not await check():  # noqa: ASYNC110 - the state lives in the engine process: no event reaches here
            await anyio.sleep(0.01)


async def wait_loads(http: aiohttp.ClientSession, url: str, running: int, waiting: int = 0) -> None:
    async def check() -> bool:
        return await loads(http, url) == (running, waiting)

    await wait_until(check)


def long_request(rid: str, **params: Any) -> dict[str, Any]:
    return {
        "rid": rid,
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, **params},
    }


def assert_logprobs_aligned(out: dict[str, Any]) -> None:
    lps = out["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in lps] == out["output_ids"]
    assert all(len(entry) == 3 and entry[2] is None for entry in lps)
    assert all(isinstance(entry[0], float) and entry[0] <= 0.0 for entry in lps)
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])


# ---- shapes -----------------------------------------------------------------------------------------------


async def test_length_finish_has_sglang_shape(server: EngineServer, http: aiohttp.ClientSession) -> None:
    out = await ok(
        http,
        server.url,
        input_ids=PROMPT,
        rid="r-length",
        return_logprob=True,
        sampling_params={"max_new_tokens": 7, "ignore_eos": True, "temperature": 0.7, "sampling_seed": 5},
    )
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["id"] == "r-length"
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == 7 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "0"
    assert meta["e2e_latency"] > 0
    assert len(out["output_ids"]) == 7
    assert out["text"] == TOK.decode(out["output_ids"], skip_special_tokens=True)
    assert_logprobs_aligned(out)


async def test_text_input_and_greedy_is_deterministic(server: EngineServer, http: aiohttp.ClientSession) -> None:
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    a = await ok(http, server.url, text="what is 2+3?", sampling_params=params, return_logprob=True)
    b = await ok(http, server.url, input_ids=PROMPT, sampling_params=params, return_logprob=True)
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["prompt_tokens"] == len(PROMPT)
    assert "rid" not in a and len(a["meta_info"]["id"]) == 32  # a uuid4 hex when no rid is given


async def test_stop_token_finish_includes_the_token_and_trims_text(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    ref = (await ok(http, server.url, input_ids=PROMPT, sampling_params=greedy))["output_ids"]
    stop = ref[3]
    k = ref.index(stop)
    out = await ok(
        http,
        server.url,
        input_ids=PROMPT,
        return_logprob=True,
        sampling_params={**greedy, "stop_token_ids": [stop], "skip_special_tokens": False},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ref[: k + 1]
    assert_logprobs_aligned(out)
    assert out["text"] == TOK.decode(ref[:k], skip_special_tokens=False)  # the stop token is cut from text
    kept = await ok(
        http,
        server.url,
        input_ids=PROMPT,
        sampling_params={**greedy, "stop_token_ids": [stop], "no_stop_trim": True, "skip_special_tokens": False},
    )
    assert kept["text"] == TOK.decode(ref[: k + 1], skip_special_tokens=False)


async def test_eos_stops_unless_ignored(server: EngineServer, http: aiohttp.ClientSession) -> None:
    force_eos = {"max_new_tokens": 5, "logit_bias": {str(EOS_ID): 100.0}}
    out = await ok(http, server.url, input_ids=PROMPT, sampling_params=force_eos)
    assert out["output_ids"] == [EOS_ID]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    out = await ok(http, server.url, input_ids=PROMPT, sampling_params={**force_eos, "ignore_eos": True})
    assert out["output_ids"] == [EOS_ID] * 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    # min_new_tokens masks EOS until it is reached
    out = await ok(http, server.url, input_ids=PROMPT, sampling_params={**force_eos, "min_new_tokens": 3})
    assert len(out["output_ids"]) == 4 and EOS_ID not in out["output_ids"][:3]


async def test_stop_string_finish(server: EngineServer, http: aiohttp.ClientSession) -> None:
    x = char_id("x")
    out = await ok(
        http,
        server.url,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 10, "logit_bias": {str(x): 100.0}, "stop": ["xxx"]},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "xxx"}
    assert out["output_ids"] == [x, x, x]
    assert out["text"] == ""


async def test_batch_and_n_return_lists(server: EngineServer, http: aiohttp.ClientSession) -> None:
    out = await ok(
        http,
        server.url,
        input_ids=[PROMPT, PROMPT[:3]],
        rid="b",
        sampling_params={"max_new_tokens": 3, "ignore_eos": True},
    )
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(PROMPT), 3]
    out = await ok(http, server.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "n": 3})
    assert isinstance(out, list) and len(out) == 3


async def test_logprobs_are_under_the_distribution_sampled_from(
    server: EngineServer, http: aiohttp.ClientSession, model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1].double()

    async def first(params: dict[str, Any]) -> tuple[int, float]:
        out = await ok(http, server.url, input_ids=PROMPT, return_logprob=True, sampling_params=params)
        lp, tid, _ = out["meta_info"]["output_token_logprobs"][0]
        return tid, lp

    tid, lp = await first({"max_new_tokens": 1, "temperature": 0})  # greedy reports temperature 1
    assert tid == int(logits.argmax()) and math.isclose(lp, float(torch.log_softmax(logits, -1)[tid]), abs_tol=1e-5)
    tid, lp = await first({"max_new_tokens": 1, "temperature": 0.5, "sampling_seed": 3})
    assert math.isclose(lp, float(torch.log_softmax(logits / 0.5, -1)[tid]), abs_tol=1e-5)
    tid, lp = await first({"max_new_tokens": 1, "temperature": 1.0, "top_k": 1, "sampling_seed": 3})
    assert tid == int(logits.argmax()) and lp == 0.0  # top_k=1 leaves a point mass


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": []}, "input_ids cannot be empty"),
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds"),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
        ({"input_ids": PROMPT, "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [1000]}, "outside the vocabulary"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10_000}}, "context length"),
        ({"input_ids": PROMPT, "logprob_start_len": 0}, "logprob_start_len"),
    ],
)
async def test_invalid_requests_are_400(
    server: EngineServer, http: aiohttp.ClientSession, body: dict[str, Any], needle: str
) -> None:
    status, out = await post_generate(http, server.url, **body)
    assert status == 400
    assert needle in out["error"]["message"]


async def test_invalid_streaming_request_reports_in_stream(server: EngineServer, http: aiohttp.ClientSession) -> None:
    async with http.post(server.url + "/generate", json={"input_ids": [], "stream": True}) as resp:
        assert resp.status == 200
        chunks = [c async for c in sse_chunks(resp)]
    assert chunks[-1] == "[DONE]"
    assert "input_ids cannot be empty" in chunks[0]["error"]["message"]


async def test_streaming_is_cumulative_and_matches_non_streaming(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 11},
    }
    whole = await ok(http, server.url, **body)
    async with http.post(server.url + "/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        chunks = [c async for c in sse_chunks(resp)]
    assert chunks[-1] == "[DONE]"
    outs = chunks[:-1]
    for prev, nxt in itertools.pairwise(outs):
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    final = outs[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert final["output_ids"] == whole["output_ids"]
    assert final["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    assert "e2e_latency" in final["meta_info"] and "e2e_latency" not in outs[0]["meta_info"]


# ---- abort --------------------------------------------------------------------------------------------


async def test_abort_in_flight_returns_partial_tokens(server: EngineServer, http: aiohttp.ClientSession) -> None:
    async with anyio.create_task_group() as tg:
        result: dict[str, Any] = {}

        async def run() -> None:
            result.update(await ok(http, server.url, **long_request("job-1")))

        tg.start_soon(run)
        await wait_loads(http, server.url, running=1)
        await server.core.wait_step()  # at least one token exists
        status, body = await post_raw(http, server.url + "/abort_request", {"rid": "job-1"})
        assert (status, body) == (200, b"")
    assert result["meta_info"]["finish_reason"] == ABORTED
    assert 1 <= len(result["output_ids"]) < LONG
    assert_logprobs_aligned(result)
    assert await loads(http, server.url) == (0, 0)


async def test_abort_matches_rid_prefix(server: EngineServer, http: aiohttp.ClientSession) -> None:
    results: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        for rid in ("grp-a-0", "grp-a-1", "grp-b-0"):

            async def run(rid: str = rid) -> None:
                results[rid] = await ok(http, server.url, **long_request(rid))

            tg.start_soon(run)
        await wait_loads(http, server.url, running=3)
        await post_raw(http, server.url + "/abort_request", {"rid": "grp-a"})
        await wait_loads(http, server.url, running=1)

        async def both_answered() -> bool:
            return len(results) == 2

        await wait_until(both_answered)
        assert {"grp-a-0", "grp-a-1"} == set(results)
        await post_raw(http, server.url + "/abort_request", {"rid": ""})  # an empty rid matches nothing
        assert await loads(http, server.url) == (1, 0)
        await post_raw(http, server.url + "/abort_request", {"rid": "grp-b-0"})
    assert all(r["meta_info"]["finish_reason"] == ABORTED for r in results.values())


async def test_abort_all_covers_running_and_waiting(model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with open_server(model_dir, port=0, max_running_requests=1) as server:
        results: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            for rid in ("first", "second"):

                async def run(rid: str = rid) -> None:
                    results[rid] = await ok(http, server.url, **long_request(rid))

                tg.start_soon(run)
            await wait_loads(http, server.url, running=1, waiting=1)
            await server.core.wait_step()
            status, body = await post_raw(http, server.url + "/abort_request", {"abort_all": True})
            assert (status, body) == (200, b"")
        running = next(r for r in results.values() if r["output_ids"])
        waiting = next(r for r in results.values() if not r["output_ids"])
        assert running["meta_info"]["finish_reason"] == ABORTED
        assert_logprobs_aligned(running)
        meta = waiting["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert "prompt_tokens" not in meta and "cached_tokens" not in meta
        assert meta["completion_tokens"] == 0 and meta["weight_version"] == "0"
        assert await loads(http, server.url) == (0, 0)


async def test_client_disconnect_frees_the_slot(server: EngineServer, http: aiohttp.ClientSession) -> None:
    async with http.post(server.url + "/generate", json={**long_request("gone"), "stream": True}) as resp:
        async for chunk in sse_chunks(resp):
            assert chunk["meta_info"]["finish_reason"] is None
            break
    # Leaving the block closes the connection mid-stream; the engine must notice and drop the request.
    await wait_loads(http, server.url, running=0)


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20}])
async def test_abort_then_continue_is_token_exact(
    server: EngineServer, http: aiohttp.ClientSession, sampling: dict[str, Any]
) -> None:
    n = 30
    params = {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": 1234, **sampling}
    reference = await ok(http, server.url, input_ids=PROMPT, return_logprob=True, sampling_params=params)

    # Interrupted run: stream, abort once some tokens arrived, while other requests share the batch.
    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(
                functools.partial(post_generate, http, server.url, **long_request(f"noise-{i}", sampling_seed=i))
            )
        await wait_loads(http, server.url, running=2)
        async with http.post(
            server.url + "/generate",
            json={"rid": "cut", "input_ids": PROMPT, "return_logprob": True, "sampling_params": params, "stream": True},
        ) as resp:
            last: dict[str, Any] = {}
            async for chunk in sse_chunks(resp):
                if chunk == "[DONE]":
                    break
                last = chunk
                if 3 <= len(chunk["output_ids"]) and last["meta_info"]["finish_reason"] is None:
                    await post_raw(http, server.url + "/abort_request", {"rid": "cut"})
        await post_raw(http, server.url + "/abort_request", {"rid": "noise"})
    assert last["meta_info"]["finish_reason"] == ABORTED
    partial = last["output_ids"]
    k = len(partial)
    assert 3 <= k < n
    assert partial == reference["output_ids"][:k]

    # Continuation: prompt + partial, the rest of the budget, same params, batched with others again.
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(post_generate, http, server.url, **long_request("noise2", sampling_seed=10)))
        await wait_loads(http, server.url, running=1)
        rest = await ok(
            http,
            server.url,
            input_ids=PROMPT + partial,
            return_logprob=True,
            sampling_params={**params, "max_new_tokens": n - k},
        )
        await post_raw(http, server.url + "/abort_request", {"rid": "noise2"})
    assert partial + rest["output_ids"] == reference["output_ids"]
    got = last["meta_info"]["output_token_logprobs"] + rest["meta_info"]["output_token_logprobs"]
    for (lp, tid, _), (ref_lp, ref_tid, _) in zip(got, reference["meta_info"]["output_token_logprobs"], strict=True):
        assert tid == ref_tid and math.isclose(lp, ref_lp, abs_tol=1e-4)


# ---- pause / continue, flush ---------------------------------------------------------------------------


async def test_pause_abort_aborts_and_holds_new_requests(server: EngineServer, http: aiohttp.ClientSession) -> None:
    results: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:

        async def run(name: str, body: dict[str, Any]) -> None:
            results[name] = await ok(http, server.url, **body)

        tg.start_soon(run, "inflight", long_request("inflight"))
        await wait_loads(http, server.url, running=1)
        await server.core.wait_step()
        status, body = await post_raw(http, server.url + "/pause_generation", {"mode": "abort"})
        assert status == 200 and orjson.loads(body) == {"message": "Generation paused successfully.", "status": "ok"}

        async def answered() -> bool:
            return "inflight" in results

        await wait_until(answered)
        assert results["inflight"]["meta_info"]["finish_reason"] == ABORTED

        tg.start_soon(run, "held", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})

        async def held() -> bool:
            return server.core.statistics().num_held == 1

        await wait_until(held)
        assert await loads(http, server.url) == (0, 0)
        async with http.get(server.url + "/health_generate") as resp:
            assert resp.status == 503  # no decode step can happen while paused
        assert "held" not in results
        status, body = await post_raw(http, server.url + "/continue_generation", {})
        assert orjson.loads(body) == {"message": "Generation continued successfully.", "status": "ok"}
    assert results["held"]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def paused_request(
    server: EngineServer, http: aiohttp.ClientSession, params: dict[str, Any], mode: str, while_paused: Any
) -> dict[str, Any]:
    """Run a request, pause the engine in `mode` once it decoded, `await while_paused()`, continue;
    return the request's answer."""
    result: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            result.update(await ok(http, server.url, input_ids=PROMPT, return_logprob=True, sampling_params=params))

        tg.start_soon(run)
        await wait_loads(http, server.url, running=1)
        await server.core.wait_step()
        status, _ = await post_raw(http, server.url + "/pause_generation", {"mode": mode})
        assert status == 200
        await while_paused()
        assert not result
        await post_raw(http, server.url + "/continue_generation", {})
    return result


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_keeps_requests_and_resumes_them_exactly(
    server: EngineServer, http: aiohttp.ClientSession, mode: str
) -> None:
    params = {"max_new_tokens": 30, "ignore_eos": True, "sampling_seed": 7}
    reference = await ok(http, server.url, input_ids=PROMPT, return_logprob=True, sampling_params=params)

    async def check_held() -> None:
        steps = server.core.statistics().steps
        async with http.get(server.url + "/health_generate") as resp:
            assert resp.status == 503  # waited its whole deadline without a decode step
        assert server.core.statistics().steps == steps
        if mode == "in_place":
            assert await loads(http, server.url) == (1, 0)
            async with http.post(server.url + "/flush_cache") as resp:
                assert resp.status == 400  # the running request keeps its cache
        else:
            assert await loads(http, server.url) == (0, 1)
            async with http.post(server.url + "/flush_cache") as resp:
                assert resp.status == 200  # retracted requests hold no cache

    result = await paused_request(server, http, params, mode, check_held)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    assert result["output_ids"] == reference["output_ids"]


async def test_flush_cache_busy_vs_idle(server: EngineServer, http: aiohttp.ClientSession) -> None:
    for method in ("GET", "POST"):
        async with http.request(method, server.url + "/flush_cache") as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            assert (await resp.text()).startswith("Cache flushed.")
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(post_generate, http, server.url, **long_request("busy")))
        await wait_loads(http, server.url, running=1)
        async with http.get(server.url + "/flush_cache") as resp:
            assert resp.status == 400 and resp.content_type == "text/plain"
        await post_raw(http, server.url + "/abort_request", {"abort_all": True})
    async with http.get(server.url + "/flush_cache") as resp:
        assert resp.status == 200


# ---- weights ------------------------------------------------------------------------------------------


async def test_update_weights_from_disk(
    server: EngineServer,
    http: aiohttp.ClientSession,
    model_dir_v1: Path,
    model_dir_wrong_shape: Path,
    tmp_path: Path,
) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    before = await ok(http, server.url, **body)

    status, raw = await post_raw(
        http, server.url + "/update_weights_from_disk", {"model_path": str(model_dir_v1), "weight_version": "1"}
    )
    reply = orjson.loads(raw)
    assert status == 200 and reply["success"] is True, reply
    assert "Weight version updated to 1" in reply["message"] and reply["num_paused_requests"] == 0
    assert await get_ok_json(http, server.url + "/get_weight_version") == {"weight_version": "1"}
    info = await get_ok_json(http, server.url + "/model_info")
    assert info["weight_version"] == "1" and info["model_path"] == str(model_dir_v1)
    after = await ok(http, server.url, **body)
    assert after["meta_info"]["weight_version"] == "1"
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]

    for bad, needle in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path, "no model.safetensors"),
        (model_dir_wrong_shape, "shape"),
    ]:
        status, raw = await post_raw(
            http, server.url + "/update_weights_from_disk", {"model_path": str(bad), "weight_version": "2"}
        )
        reply = orjson.loads(raw)
        assert status == 400 and reply["success"] is False and needle in reply["message"], reply
    assert await get_ok_json(http, server.url + "/get_weight_version") == {"weight_version": "1"}
    still = await ok(http, server.url, **body)
    assert still["output_ids"] == after["output_ids"]
    assert still["meta_info"]["output_token_logprobs"] == after["meta_info"]["output_token_logprobs"]


async def test_update_weights_between_decode_steps_stamps_the_new_version(
    server: EngineServer, http: aiohttp.ClientSession, model_dir_v1: Path
) -> None:
    result: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            result.update(await ok(http, server.url, **long_request("spanning")))

        tg.start_soon(run)
        await wait_loads(http, server.url, running=1)
        status, raw = await post_raw(
            http, server.url + "/update_weights_from_disk", {"model_path": str(model_dir_v1), "weight_version": "7"}
        )
        assert status == 200 and orjson.loads(raw)["success"] is True
        assert await loads(http, server.url) == (1, 0)  # the request kept decoding across the update
        await server.core.wait_step()
        await post_raw(http, server.url + "/abort_request", {"rid": "spanning"})
    assert result["meta_info"]["finish_reason"] == ABORTED
    assert result["meta_info"]["weight_version"] == "7"  # the version of its last tokens
    first, second = result["meta_info"]["weight_versions"]  # published without a pause: one swap
    assert first["version"] == "0" and first["start"] == 0 and 0 < first["end"]
    assert second == {"version": "7", "start": first["end"], "end": len(result["output_ids"])}


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_publish_during_a_pause_splits_the_version_spans(
    server: EngineServer, http: aiohttp.ClientSession, model_dir_v1: Path, mode: str
) -> None:
    params = {"max_new_tokens": 30, "ignore_eos": True, "sampling_seed": 3}
    held = 0

    async def publish() -> None:
        nonlocal held
        held = server.core.statistics().generated_tokens  # tokens decoded under version 0
        assert 0 < held < 30
        status, raw = await post_raw(
            http, server.url + "/update_weights_from_disk", {"model_path": str(model_dir_v1), "weight_version": "1"}
        )
        assert status == 200 and orjson.loads(raw)["success"] is True
        body = {"new_version": "1", "abort_all_requests": False}
        status, _ = await post_raw(http, server.url + "/update_weight_version", body)
        assert status == 200  # the same version again: no empty span

    result = await paused_request(server, http, params, mode, publish)
    meta = result["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "0", "start": 0, "end": held},
        {"version": "1", "start": held, "end": 30},
    ]
    assert meta["weight_version"] == "1" and meta["completion_tokens"] == 30


async def test_version_spans_of_whole_and_unstarted_requests(server: EngineServer, http: aiohttp.ClientSession) -> None:
    out = await ok(http, server.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 4}]
    await post_raw(http, server.url + "/update_weight_version", {"new_version": "5"})
    out = await ok(http, server.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 0})
    assert out["meta_info"]["weight_versions"] == [{"version": "5", "start": 0, "end": 0}]
    assert out["meta_info"]["weight_version"] == "5"


async def test_update_weight_version_and_unsupported_weight_paths(
    server: EngineServer, http: aiohttp.ClientSession
) -> None:
    status, raw = await post_raw(http, server.url + "/update_weight_version", {"new_version": "42"})
    assert status == 200 and orjson.loads(raw)["success"] is True
    assert (await get_ok_json(http, server.url + "/model_info"))["weight_version"] == "42"
    status, raw = await post_raw(http, server.url + "/update_weights_from_distributed", {"names": []})
    assert status == 400 and orjson.loads(raw)["success"] is False
    # A CPU engine cannot give memory back, nor take CUDA IPC handles: both say why (test_colocate.py).
    status, raw = await post_raw(http, server.url + "/release_memory_occupation", {})
    assert status == 400 and "runs on cpu" in orjson.loads(raw)["error"]["message"]


# ---- batching, info -----------------------------------------------------------------------------------


async def test_concurrent_requests_share_forward_passes(model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with open_server(model_dir, port=0, max_running_requests=4) as server:
        outs: list[Any] = []
        async with anyio.create_task_group() as tg:
            for i in range(10):

                async def run(i: int = i) -> None:
                    params = {"max_new_tokens": 8, "ignore_eos": True}
                    outs.append(await ok(http, server.url, input_ids=PROMPT[: 2 + i], sampling_params=params))

                tg.start_soon(run)
        assert len(outs) == 10 and all(len(o["output_ids"]) == 8 for o in outs)
        stats = server.core.statistics()
        assert stats.max_batch_size == 4  # batched, and never beyond --max-running-requests
        assert stats.steps < 10 * 8
        info = await get_ok_json(http, server.url + "/get_server_info")
        assert info["internal_states"][0]["max_batch_size"] == 4
        assert info["max_running_requests"] == 4


async def test_info_endpoints(server: EngineServer, http: aiohttp.ClientSession, model_dir: Path) -> None:
    for path in ("/health", "/health_generate"):
        async with http.get(server.url + path) as resp:
            assert resp.status == 200 and await resp.read() == b""
    for path in ("/model_info", "/get_model_info"):
        info = await get_ok_json(http, server.url + path)
        assert info["model_path"] == str(model_dir) and info["is_generation"] is True
        assert info["weight_version"] == "0" and "preferred_sampling_params" in info
    for path in ("/server_info", "/get_server_info"):
        info = await get_ok_json(http, server.url + path)
        assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1)
        assert info["disaggregation_mode"] == "null" and info["max_running_requests"] == 64
    models = await get_ok_json(http, server.url + "/v1/models")
    assert models["object"] == "list" and models["data"][0]["id"] == str(model_dir)
    assert await loads(http, server.url) == (0, 0)


async def test_sglang_router_accepts_the_engine(server: EngineServer, http: aiohttp.ClientSession) -> None:
    pytest.importorskip("sglang_router")
    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--worker-urls", server.url, "--host", "127.0.0.1", "--port", str(port),
        "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    router = await anyio.open_process(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"

        async def listed() -> bool:
            try:
                async with http.get(url + "/workers") as resp:
                    workers = (await resp.json())["workers"] if resp.status == 200 else []
            except aiohttp.ClientError:
                return False
            return [w["url"] for w in workers] == [server.url] and workers[0]["is_healthy"]

        await wait_until(listed, timeout=30)
        out = await ok(http, url, input_ids=PROMPT, return_logprob=True, sampling_params={"max_new_tokens": 4})
        assert_logprobs_aligned(out)
    finally:
        with anyio.move_on_after(10, shield=True):
            router.terminate()
            await router.wait()
        await router.aclose()


# ---- subprocess ---------------------------------------------------------------------------------------


async def test_engine_process_serves_and_stops_on_sigterm(model_dir: Path, http: aiohttp.ClientSession) -> None:
    engine: EngineProcess
    async with await start_engine(model_dir, startup_timeout=120, weight_version="3") as engine:
        out = await ok(http, engine.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert out["meta_info"]["weight_version"] == "3"
    assert engine.returncode == 0  # SIGTERM is a clean shutdown


async def test_engine_process_reports_startup_failure(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailableError, match="does not exist"):
        await start_engine(tmp_path / "no-model", startup_timeout=120, log_path=tmp_path / "engine.log")
