"""The simulated engine over real HTTP on 127.0.0.1, driven by raw requests and by the pipeline's client.

Time is scaled far down (a 20 ms decode step takes microseconds of wall time); what the tests check
about time is the engine-time accounting from `/sim/stats`, never the wall clock. Requests are
interrupted by reading a streamed chunk (the request is provably running) and then acting.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from core.errors import ConfigError
from core.types import FinishReason
from engines.sim import SimServer, _parse_args, open_sim_server, options_from_args
from engines.sim_model import EOS_ID, DecodeTimeModel, LengthModel, sim_token, strip_generated
from stages.sglang_client import EngineFleet
from tests.conftest import get_ok_json, post_generate, post_raw, sse_chunks

PROMPT = [11, 12, 13, 14, 15]
LIMIT = 400
# Every response ends at half its limit: 200 tokens, long enough to interrupt, short enough to run.
HALF = LengthModel("fixed", 0.5, 0.0, truncate_frac=0.0)
# Slow enough (1 ms of wall per 20 ms step) that an abort lands long before a 200-token target.
SCALE = 0.05


async def stats(http: aiohttp.ClientSession, server: SimServer) -> dict[str, Any]:
    return await get_ok_json(http, server.url + "/sim/stats")


def body(seed: int, prompt: list[int] = PROMPT, max_new_tokens: int = LIMIT, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "sampling_seed": seed, "temperature": 1.0},
        **extra,
    }


def ids_and_logprobs(out: dict[str, Any]) -> tuple[list[int], list[float]]:
    entries = out["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


async def interrupted(
    http: aiohttp.ClientSession, server: SimServer, rid: str, seed: int, act: Callable[[], Any]
) -> dict[str, Any]:
    """Stream a request; once a chunk proves it is running, `await act()`; return its last chunk."""
    last: Any = None
    async with http.post(server.url + "/generate", json={**body(seed), "rid": rid, "stream": True}) as resp:
        acted = False
        async for chunk in sse_chunks(resp):
            if chunk == "[DONE]":
                break
            last = chunk
            if not acted:
                acted = True
                await act()
    return last


# ---- shapes and lengths -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_outputs_have_sglang_shapes(http: aiohttp.ClientSession) -> None:
    async with open_sim_server(time_scale=1e-4, lengths=HALF, weight_version="3") as server:
        status, out = await post_generate(http, server.url, **body(seed=1, max_new_tokens=40), rid="r1")
        assert status == 200
        meta = out["meta_info"]
        assert meta["id"] == "r1" and meta["weight_version"] == "3"
        assert meta["finish_reason"] == {"type": "stop", "matched": EOS_ID}
        assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 20 == len(out["output_ids"])
        ids, lps = ids_and_logprobs(out)
        assert ids == out["output_ids"] and ids[-1] == EOS_ID and EOS_ID not in ids[:-1]
        assert all(-4.0 <= lp <= 0.0 for lp in lps)
        assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]
        assert len(out["text"]) == 19  # one character per token, the stop token trimmed

        # A batch and n > 1 answer with lists; ignore_eos runs to the limit.
        status, outs = await post_generate(
            http,
            server.url,
            input_ids=[PROMPT, PROMPT[:2]],
            sampling_params={"max_new_tokens": 8, "ignore_eos": True},
        )
        assert status == 200
        assert [o["meta_info"]["finish_reason"] for o in outs] == [{"type": "length", "length": 8}] * 2
        status, outs = await post_generate(
            http, server.url, input_ids=PROMPT, sampling_params={"n": 3, "max_new_tokens": 4}
        )
        assert status == 200 and len(outs) == 3
        status, err = await post_generate(http, server.url, input_ids=[], sampling_params={})
        assert status == 400 and "input_ids cannot be empty" in err["error"]["message"]

        info = await get_ok_json(http, server.url + "/model_info")
        assert info["weight_version"] == "3" and info["is_generation"] is True
        sinfo = await get_ok_json(http, server.url + "/server_info")
        assert sinfo["max_running_requests"] == 128 and sinfo["sim"]["length_model"]["mu"] == 0.5
        load = (await get_ok_json(http, server.url + "/v1/loads?include=core"))["loads"][0]
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0)
        for path in ("/health", "/health_generate", "/v1/models", "/get_weight_version"):
            async with http.get(server.url + path) as resp:
                assert resp.status == 200, path


def test_length_model_targets_follow_the_configured_distribution() -> None:
    model = LengthModel("lognormal", -1.9, 0.8, truncate_frac=0.10)
    targets = [model.target(seed, [7, 8, 9], 1000) for seed in range(2000)]
    cut = sum(t is None for t in targets) / len(targets)
    assert 0.09 <= cut <= 0.14  # 10% truncated on purpose, ~1% of the lognormal past the limit
    body_median = statistics.median(t for t in targets if t is not None)
    assert 130 <= body_median <= 170  # e^-1.9 = 0.15 of the limit
    assert model.target(5, [7, 8, 9], 1000) == model.target(5, [7, 8, 9], 1000)
    assert LengthModel("fixed", 0.25, 0.0, 0.0).target(1, [3], 100) == 25
    assert LengthModel("fixed", 0.25, 0.0, 1.0).target(1, [3], 100) is None


def test_a_prompt_spread_makes_each_prompt_long_or_short_in_every_epoch() -> None:
    """With `prompt_sigma` a prompt's length is its own (the same seeds of another pass draw alike):
    a length predicted from the prompt's past groups has something to predict."""
    model = LengthModel("lognormal", -2.5, 0.3, truncate_frac=0.0, prompt_sigma=1.0)
    prompts = [[7, 8, p] for p in range(40)]

    def mean_len(prompt: list[int], seeds: range) -> float:
        return statistics.fmean(model.target(s, prompt, 1000) or 1000 for s in seeds)

    first = [mean_len(p, range(0, 8)) for p in prompts]
    again = [mean_len(p, range(100, 108)) for p in prompts]  # other seeds: another epoch's samples
    rank = {p: r for r, p in enumerate(sorted(range(40), key=lambda i: first[i]))}
    again_rank = {p: r for r, p in enumerate(sorted(range(40), key=lambda i: again[i]))}
    assert sum(abs(rank[i] - again_rank[i]) for i in range(40)) / 40 < 4  # nearly the same order
    assert max(first) > 5 * min(first)  # and prompts differ a lot
    plain = LengthModel("lognormal", -2.5, 0.3, truncate_frac=0.0)  # 0: the draws of before, unchanged
    assert [plain.target(s, [7, 8, 1], 1000) for s in range(5)] == [68, 87, 52, 97, 44]
    with pytest.raises(ConfigError, match="prompt_sigma"):
        LengthModel(prompt_sigma=-1.0)


def test_length_and_time_models_reject_bad_values() -> None:
    assert LengthModel.parse("lognormal:-1,0.5", truncate_frac=0.2) == LengthModel("lognormal", -1.0, 0.5, 0.2)
    for spec in ("lognormal:1", "pareto:1,2", "fixed:x", "fixed:0"):
        with pytest.raises(ConfigError, match="length distribution|fraction"):
            LengthModel.parse(spec)
    with pytest.raises(ConfigError, match="step_base=-1"):
        DecodeTimeModel(step_base=-1)
    args = _parse_args(["--time-scale", "0", "--length-dist", "zipf:1", "--max-running-requests", "0"])
    with pytest.raises(ConfigError) as info:
        options_from_args(args)
    assert len(info.value.problems) == 3
    options = options_from_args(_parse_args(["--time-scale", "0.01", "--truncate-frac", "0.2", "--port", "0"]))
    assert options["time_scale"] == 0.01 and options["lengths"].truncate_frac == 0.2


@pytest.mark.anyio
async def test_response_lengths_over_200_requests(http: aiohttp.ClientSession) -> None:
    n, limit = 200, 64
    async with open_sim_server(time_scale=1e-4, max_running_requests=256) as server:
        request = {
            "input_ids": [[20 + i % 7, 30 + i] for i in range(n)],
            "sampling_params": [{"max_new_tokens": limit, "sampling_seed": 1000 + i} for i in range(n)],
            "return_logprob": True,
        }
        status, outs = await post_generate(http, server.url, **request)
        assert status == 200 and len(outs) == n
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
        lengths = [len(o["output_ids"]) for o in outs]
        truncated = reasons.count("length") / n
        assert 0.05 <= truncated <= 0.18, truncated  # ~11% expected; binomial sd is ~2%
        assert all(length == limit for r, length in zip(reasons, lengths, strict=True) if r == "length")
        assert 6 <= statistics.median(lengths) <= 16  # most responses are short
        assert set(reasons) == {"stop", "length"}
        # The same samples give the same answers.
        status, again = await post_generate(http, server.url, **request)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
        s = await stats(http, server)
        assert s["generated_tokens"] == 2 * sum(lengths) and s["max_batch_size"] == n


# ---- abort and resume ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_abort_then_resume_reaches_the_same_target_and_tokens(http: aiohttp.ClientSession) -> None:
    async with open_sim_server(time_scale=SCALE, lengths=HALF) as server:
        status, full = await post_generate(http, server.url, **body(seed=42))
        assert status == 200 and full["meta_info"]["finish_reason"]["type"] == "stop"
        full_ids, full_lps = ids_and_logprobs(full)
        assert len(full_ids) == LIMIT // 2

        last = await interrupted(
            http, server, "cut", 42, lambda: post_raw(http, server.url + "/abort_request", {"rid": "cut"})
        )
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        part_ids, part_lps = ids_and_logprobs(last)
        k = len(part_ids)
        assert 1 <= k < len(full_ids)
        assert part_ids == full_ids[:k] and part_lps == full_lps[:k]
        assert strip_generated(PROMPT + part_ids, 42, 151936) == len(PROMPT)

        # No publish in between: the aborted sequence is still cached, only its last token is computed.
        before = await stats(http, server)
        resume = body(seed=42, prompt=PROMPT + part_ids, max_new_tokens=LIMIT - k)
        status, rest = await post_generate(http, server.url, **resume)
        after = await stats(http, server)
        assert status == 200 and rest["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
        assert ids_and_logprobs(rest) == (full_ids[k:], full_lps[k:])
        assert after["prefill_tokens"] - before["prefill_tokens"] == 1
        assert after["cached_prefill_tokens"] - before["cached_prefill_tokens"] == len(PROMPT) + k - 1

        # After a flush (what a weight publish does) the same resumption pays the whole prefix.
        status, _ = await post_raw(http, server.url + "/flush_cache")
        assert status == 200
        before = await stats(http, server)
        status, again = await post_generate(http, server.url, **resume)
        after = await stats(http, server)
        assert ids_and_logprobs(again) == (full_ids[k:], full_lps[k:])
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(PROMPT) + k
        assert after["prefill_time"] - before["prefill_time"] == pytest.approx(
            server.core.model.timing.prefill_time(len(PROMPT) + k)
        )


@pytest.mark.anyio
async def test_resumed_truncated_sample_still_ends_at_its_limit(http: aiohttp.ClientSession) -> None:
    always = LengthModel("lognormal", -1.9, 0.8, truncate_frac=1.0)
    async with open_sim_server(time_scale=1e-4, lengths=always) as server:
        _status, first = await post_generate(http, server.url, **body(seed=9, max_new_tokens=30))
        ids = first["output_ids"]
        assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 30} and len(ids) == 30
        assert ids == [sim_token(9, len(PROMPT) + i, 151936) for i in range(30)]
        _status, rest = await post_generate(
            http, server.url, **body(seed=9, prompt=PROMPT + ids[:12], max_new_tokens=18)
        )
        assert rest["output_ids"] == ids[12:] and rest["meta_info"]["finish_reason"]["type"] == "length"


# ---- the time model --------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_decode_time_grows_with_batch_size_as_configured(http: aiohttp.ClientSession) -> None:
    timing = DecodeTimeModel(
        step_base=0.02, step_per_request=0.01, step_per_context_token=0.0, prefill_base=0.0, prefill_per_token=0.001
    )
    async with open_sim_server(time_scale=1e-4, timing=timing, lengths=HALF, prefix_cache_entries=0) as server:
        for batch in (1, 8):
            before = await stats(http, server)
            status, outs = await post_generate(
                http,
                server.url,
                input_ids=[PROMPT] * batch,
                sampling_params=[{"max_new_tokens": 20, "sampling_seed": i} for i in range(batch)],
            )
            after = await stats(http, server)
            assert status == 200 and all(len(o["output_ids"]) == 10 for o in outs)
            # One prefill gives every request its first token, then 9 decode steps of the whole batch.
            assert after["prefill_batches"] - before["prefill_batches"] == 1
            assert after["prefill_tokens"] - before["prefill_tokens"] == len(PROMPT) * batch  # no prefix cache
            assert after["prefill_time"] - before["prefill_time"] == pytest.approx(0.001 * len(PROMPT) * batch)
            steps = after["decode_steps"] - before["decode_steps"]
            decode = after["decode_time"] - before["decode_time"]
            assert steps == 9
            assert decode / steps == pytest.approx(0.02 + 0.01 * batch)
            busy = after["busy_time"] - before["busy_time"]
            assert after["running_request_seconds"] - before["running_request_seconds"] == pytest.approx(busy * batch)


@pytest.mark.anyio
async def test_a_slowdown_stretches_every_forward_until_set_back(http: aiohttp.ClientSession) -> None:
    """`/sim/slowdown` models a trainer on the engine's GPU: forwards cost `factor` times their
    time while it is set; bad factors are refused by value and leave it as it was."""
    timing = DecodeTimeModel(
        step_base=0.02, step_per_request=0.0, step_per_context_token=0.0, prefill_base=0.01, prefill_per_token=0.0
    )
    async with open_sim_server(time_scale=1e-4, timing=timing, lengths=HALF, prefix_cache_entries=0) as server:
        per_run = []
        for factor in (1.0, 3.0, 1.0):
            status, raw = await post_raw(http, server.url + "/sim/slowdown", {"factor": factor})
            assert status == 200 and orjson.loads(raw)["factor"] == factor
            before = await stats(http, server)
            status, out = await post_generate(http, server.url, **body(1, max_new_tokens=20))
            after = await stats(http, server)
            assert status == 200 and len(out["output_ids"]) == 10
            per_run.append(
                (after["decode_time"] - before["decode_time"], after["prefill_time"] - before["prefill_time"])
            )
        assert per_run[0] == pytest.approx((9 * 0.02, 0.01))
        assert per_run[1] == pytest.approx((3 * 9 * 0.02, 3 * 0.01))
        assert per_run[2] == pytest.approx(per_run[0])
        for bad in (0, -1.5, "2", True, None):
            status, raw = await post_raw(http, server.url + "/sim/slowdown", {"factor": bad})
            assert status == 400 and repr(bad).encode() in raw
        assert server.core.model.slowdown == 1.0


@pytest.mark.anyio
async def test_decode_time_grows_with_context(http: aiohttp.ClientSession) -> None:
    timing = DecodeTimeModel(
        step_base=0.02, step_per_request=0.0, step_per_context_token=0.001, prefill_base=0.005, prefill_per_token=0.0
    )
    async with open_sim_server(time_scale=1e-4, timing=timing, lengths=HALF) as server:
        _status, out = await post_generate(http, server.url, **body(seed=3, max_new_tokens=20))
        assert len(out["output_ids"]) == 10
        s = await stats(http, server)
        contexts = [len(PROMPT) + j for j in range(1, 10)]  # the KV each decode step reads
        assert s["decode_time"] == pytest.approx(9 * 0.02 + 0.001 * sum(contexts))
        assert s["prefill_time"] == pytest.approx(0.005)
        assert s["busy_time"] == pytest.approx(s["decode_time"] + s["prefill_time"])
        assert 0.0 < s["busy_fraction"] <= 1.0 and s["engine_time"] > 0


@pytest.mark.anyio
async def test_concurrency_limit_queues_the_rest(http: aiohttp.ClientSession) -> None:
    async with open_sim_server(time_scale=1e-4, lengths=HALF, max_running_requests=3) as server:
        status, outs = await post_generate(
            http,
            server.url,
            input_ids=[[40 + i] for i in range(7)],
            sampling_params={"max_new_tokens": 20, "sampling_seed": 5},
        )
        assert status == 200 and all(len(o["output_ids"]) == 10 for o in outs)
        s = await stats(http, server)
        assert s["max_batch_size"] == 3 and s["prefill_batches"] == 3  # 3 + 3 + 1


# ---- pause, continue, flush, weights ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_pause_in_place_keeps_kv_and_continue_finishes(http: aiohttp.ClientSession) -> None:
    async with open_sim_server(time_scale=SCALE, lengths=HALF) as server:
        _status, full = await post_generate(http, server.url, **body(seed=7))
        frozen: dict[str, Any] = {}

        async def pause_and_check() -> None:
            status, _ = await post_raw(http, server.url + "/pause_generation", {"mode": "in_place"})
            assert status == 200
            frozen["stats"] = await stats(http, server)
            status, _ = await post_raw(http, server.url + "/flush_cache")
            assert status == 400  # in_place keeps the request running: it holds cache
            assert (await stats(http, server))["decode_steps"] == frozen["stats"]["decode_steps"]
            status, _ = await post_raw(http, server.url + "/continue_generation")
            assert status == 200

        before = await stats(http, server)
        last = await interrupted(http, server, "p", 7, pause_and_check)
        after = await stats(http, server)
        assert frozen["stats"]["paused"] == "in_place" and frozen["stats"]["num_running"] == 1
        assert last["output_ids"] == full["output_ids"]
        assert after["prefill_tokens"] - before["prefill_tokens"] == 1  # prompt cached; no second prefill


@pytest.mark.anyio
async def test_pause_retract_then_flush_charges_a_new_prefill(http: aiohttp.ClientSession) -> None:
    async with open_sim_server(time_scale=SCALE, lengths=HALF) as server:
        seen: dict[str, Any] = {}

        async def retract_flush_continue() -> None:
            status, _ = await post_raw(http, server.url + "/pause_generation", {"mode": "retract"})
            assert status == 200
            seen["stats"] = await stats(http, server)
            status, _ = await post_raw(http, server.url + "/flush_cache")
            assert status == 200  # retracted requests hold no cache
            await post_raw(http, server.url + "/continue_generation")

        last = await interrupted(http, server, "r", 11, retract_flush_continue)
        k = seen["stats"]["generated_tokens"]
        assert seen["stats"]["num_running"] == 0 and seen["stats"]["num_waiting"] == 1 and k >= 1
        assert last["meta_info"]["finish_reason"]["type"] == "stop" and len(last["output_ids"]) == LIMIT // 2
        s = await stats(http, server)
        assert s["prefill_batches"] == 2 and s["prefill_tokens"] == len(PROMPT) + (len(PROMPT) + k)


@pytest.mark.anyio
async def test_pause_abort_returns_partial_output(http: aiohttp.ClientSession) -> None:
    async with open_sim_server(time_scale=SCALE, lengths=HALF) as server:
        last = await interrupted(
            http, server, "a", 5, lambda: post_raw(http, server.url + "/pause_generation", {"mode": "abort"})
        )
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 1 <= len(last["output_ids"]) < LIMIT // 2
        status, _ = await post_raw(http, server.url + "/flush_cache")
        assert status == 200
        s = await stats(http, server)
        assert s["paused"] == "abort" and s["aborted_requests"] == 1


@pytest.mark.anyio
async def test_update_weights_sets_version_and_takes_its_time(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    timing = DecodeTimeModel(weight_update=3.0)
    async with open_sim_server(time_scale=1e-4, timing=timing, lengths=HALF) as server:
        status, raw = await post_raw(
            http, server.url + "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "7"}
        )
        doc = orjson.loads(raw)
        assert status == 200 and doc["success"] is True and "Weight version updated to 7" in doc["message"]
        assert (await get_ok_json(http, server.url + "/model_info"))["weight_version"] == "7"
        status, out = await post_generate(http, server.url, **body(seed=1, max_new_tokens=4))
        assert out["meta_info"]["weight_version"] == "7"
        s = await stats(http, server)
        assert s["weight_updates"] == 1 and s["weight_update_time"] == 3.0

        status, raw = await post_raw(
            http,
            server.url + "/update_weights_from_disk",
            {"model_path": str(tmp_path / "nope"), "weight_version": "8"},
        )
        assert status == 400 and orjson.loads(raw)["success"] is False
        assert (await get_ok_json(http, server.url + "/model_info"))["weight_version"] == "7"


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_version_spans_mark_a_publish_during_a_pause(
    http: aiohttp.ClientSession, tmp_path: Path, mode: str
) -> None:
    async with open_sim_server(time_scale=SCALE, lengths=HALF) as server:
        seen: dict[str, Any] = {}

        async def publish_while_held() -> None:
            status, _ = await post_raw(http, server.url + "/pause_generation", {"mode": mode})
            assert status == 200
            seen["k"] = (await stats(http, server))["generated_tokens"]
            status, _ = await post_raw(
                http, server.url + "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "2"}
            )
            assert status == 200
            await post_raw(http, server.url + "/continue_generation")

        last = await interrupted(http, server, "v", 5, publish_while_held)
        k, n = seen["k"], LIMIT // 2
        assert 0 < k < n and last["meta_info"]["completion_tokens"] == n
        assert last["meta_info"]["weight_versions"] == [
            {"version": "0", "start": 0, "end": k},
            {"version": "2", "start": k, "end": n},
        ]
        assert last["meta_info"]["weight_version"] == "2"


@pytest.mark.anyio
async def test_staged_weight_update_keeps_decoding_and_marks_the_swap(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    timing = DecodeTimeModel(weight_update=2.0)  # 100 decode steps' worth of transfer
    async with open_sim_server(time_scale=SCALE, timing=timing, lengths=HALF, staged_weight_updates=True) as server:
        seen: dict[str, Any] = {}

        async def publish_while_running() -> None:
            before = await stats(http, server)
            status, _ = await post_raw(
                http, server.url + "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "3"}
            )
            assert status == 200
            after = await stats(http, server)
            seen["k"] = after["generated_tokens"]
            seen["steps"] = after["decode_steps"] - before["decode_steps"]
            seen["stopped"] = after["weight_update_time"]

        last = await interrupted(http, server, "s", 9, publish_while_running)
        n, k = LIMIT // 2, seen["k"]
        assert seen["steps"] > 10  # the engine kept decoding through the 2 s transfer
        assert seen["stopped"] == 0.0  # and stopped for nothing but a zero-cost swap
        spans = last["meta_info"]["weight_versions"]
        assert spans[0]["version"] == "0" and spans[-1] == {"version": "3", "start": spans[0]["end"], "end": n}
        assert 0 < spans[0]["end"] <= k + 1


# ---- the pipeline's client -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_pipeline_client_drives_a_publish(tmp_path: Path) -> None:
    async with open_sim_server(time_scale=SCALE, lengths=HALF) as server:
        async with EngineFleet([server.url], concurrency=8, request_timeout=30, control_timeout=10) as fleet:
            await fleet.wait_healthy(10)
            full = await fleet.generate(PROMPT, {"max_new_tokens": LIMIT, "sampling_seed": 21}, rid="full")
            assert full.finish_reason is FinishReason.STOP and len(full.token_ids) == LIMIT // 2

            results = []

            async def run_one() -> None:
                results.append(await fleet.generate(PROMPT, {"max_new_tokens": LIMIT, "sampling_seed": 21}, rid="x"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run_one)
                with anyio.fail_after(10):
                    while (await fleet.loads())[server.url].running == 0:  # noqa: ASYNC110 - engine-side state
                        await anyio.sleep(0.005)  # polling an engine-reported state, not ordering
                # A publish, as the clock does it.
                await fleet.pause("abort")
                await fleet.flush_cache(5)
                await fleet.update_weights_from_disk(str(tmp_path), weight_version="1")
                await fleet.continue_generation()
            (part,) = results
            assert part.finish_reason is FinishReason.ABORT and part.weight_version == "0"
            k = len(part.token_ids)
            assert 1 <= k < LIMIT // 2 and part.token_ids == full.token_ids[:k]
            assert await fleet.weight_versions() == {server.url: "1"}

            rest = await fleet.generate(
                PROMPT + list(part.token_ids), {"max_new_tokens": LIMIT - k, "sampling_seed": 21}, rid="resume"
            )
            assert rest.weight_version == "1" and rest.finish_reason is FinishReason.STOP
            assert part.token_ids + rest.token_ids == full.token_ids
            assert part.logprobs + rest.logprobs == full.logprobs
            assert math.isclose(sum(full.logprobs), sum(part.logprobs) + sum(rest.logprobs))


@pytest.mark.anyio
async def test_siblings_share_the_cached_prompt(http: aiohttp.ClientSession) -> None:
    async with open_sim_server(time_scale=1e-4, lengths=HALF) as server:
        status, outs = await post_generate(
            http, server.url, input_ids=PROMPT, sampling_params={"n": 4, "max_new_tokens": 8}, return_logprob=True
        )
        assert status == 200 and len(outs) == 4
        s = await stats(http, server)
        # The first sample computes the prompt; the other three find it cached (SGLang's radix cache).
        assert s["prefill_tokens"] == len(PROMPT) + 3 and s["cached_prefill_tokens"] == 3 * (len(PROMPT) - 1)


@pytest.mark.anyio
async def test_command_line_engine_behind_the_real_router(tmp_path: Path) -> None:
    from launch.builtin_engine import free_port
    from launch.router_process import start_router

    port = free_port()
    command = [
        sys.executable, "-m", "engines.sim", "--port", str(port), "--time-scale", "0.001",
        "--length-dist", "fixed:0.5", "--truncate-frac", "0", "--log-level", "warning",
    ]  # fmt: skip
    log_path = tmp_path / "sim.log"
    with open(log_path, "wb") as log:  # noqa: ASYNC230 - a local log file for the child, opened at once
        process = await anyio.open_process(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            with anyio.fail_after(30):
                while True:  # waiting for another process to start listening
                    assert process.returncode is None, log_path.read_text()
                    try:
                        async with http.get(url + "/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    await anyio.sleep(0.05)
        async with open_sim_server(time_scale=0.001, lengths=HALF) as other:
            with anyio.fail_after(30):
                router = await start_router([url, other.url])
            async with router, EngineFleet(router_url=router.url, concurrency=4, request_timeout=20) as fleet:
                assert set(fleet.worker_urls) == {url, other.url}
                results = [
                    await fleet.generate(PROMPT, {"max_new_tokens": 16, "sampling_seed": i}, rid=f"via-router-{i}")
                    for i in range(4)
                ]
                assert all(r.finish_reason is FinishReason.STOP and len(r.token_ids) == 8 for r in results)
                assert (await stats_of(other.url))["finished_requests"] == 2  # round robin over both
                await fleet.pause("retract")
                await fleet.continue_generation()
    finally:
        process.terminate()
        with anyio.move_on_after(10, shield=True):
            await process.wait()
    assert process.returncode == 0, log_path.read_text()


async def stats_of(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        return await get_ok_json(http, url + "/sim/stats")
