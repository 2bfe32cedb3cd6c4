"""The tiny Qwen3-MoE in the built-in engine: R3 routes from its own routers, over real HTTP (issue 32).

What the engine answers for `return_routed_experts` is checked against a plain Hugging Face
forward of the same weights over the whole sequence (no KV cache, one batch of one): each
position's row must be the experts that forward's routers pick, under the weights that served
the forward which sampled the next token. The client side (the generator pool) must then keep
each token's row through an abort and a continuation, byte for byte with an uninterrupted run.
Ordering comes from the engine's own state (running requests, decode steps), never sleeps.
"""

from __future__ import annotations

import base64
from pathlib import Path

import aiohttp
import anyio
import numpy as np
import pytest
import torch

from core.clock import VersionClock
from core.columns import NO_ROUTE
from core.types import PromptTask, SampleStatus
from engines.builtin import EngineServer, open_server
from engines.moe_routes import RouteRecorder
from pipeline.tasks.tiny_model import CHARS, make_model_folder
from stages.publisher import publish_weights
from stages.sglang_client import EngineFleet
from stages.sglang_client.payloads import TokenPayloads
from tests.engine_rollout import engine_rollout

pytestmark = pytest.mark.anyio

LAYERS, TOP_K = 2, 2
PROMPT = [3 + CHARS.index(c) for c in "say b x3:"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("moe")
    return (
        make_model_folder(root / "v0", arch="moe", hidden_size=32, num_layers=LAYERS, moe_router_topk=TOP_K, seed=0),
        make_model_folder(root / "v1", arch="moe", hidden_size=32, num_layers=LAYERS, moe_router_topk=TOP_K, seed=1),
    )


def router_choices(model_dir: Path, ids: list[int]) -> np.ndarray:
    """[positions, layers, top_k]: the experts a plain full forward of `model_dir` routes `ids` to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    recorder = RouteRecorder.attach(model)
    assert recorder is not None
    with torch.no_grad(), recorder.recording():
        model(input_ids=torch.tensor([ids]))
    return recorder.take().numpy()


def rows_of(meta: dict, n_rows: int) -> np.ndarray:
    raw = base64.b64decode(meta["routed_experts"])
    return np.frombuffer(raw, dtype="<i4").reshape(n_rows, LAYERS, TOP_K)


async def generate(url: str, **body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url + "/generate", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize("kv_cache", ["slots", "none"])
async def test_the_engine_returns_the_experts_its_routers_chose_for_every_position(kv_cache, moe_dirs):
    v0, _ = moe_dirs
    params = {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 3}
    async with open_server(v0, port=0, kv_cache=kv_cache, health_check_timeout=0.5) as server:
        status, whole = await generate(server.url, input_ids=PROMPT, sampling_params=params, return_routed_experts=True)
        assert status == 200, whole
        start = len(PROMPT) - 1
        status, tail = await generate(
            server.url,
            input_ids=PROMPT,
            sampling_params=params,
            return_routed_experts=True,
            routed_experts_start_len=start,
        )
        assert status == 200, tail
    ids = PROMPT + whole["output_ids"]
    n_rows = len(ids) - 1  # every position a forward read: the last token never was
    got = rows_of(whole["meta_info"], n_rows)
    assert whole["meta_info"]["routed_experts_start_len"] == 0
    assert (got == router_choices(v0, ids[:-1])).all()
    assert len(np.unique(got)) > TOP_K  # the routers do pick among the experts
    # routed_experts_start_len: the rows from there on, the same ones.
    assert tail["output_ids"] == whole["output_ids"] and tail["meta_info"]["routed_experts_start_len"] == start
    assert (rows_of(tail["meta_info"], n_rows - start) == got[start:]).all()


async def test_a_dense_model_refuses_return_routed_experts_by_name(tmp_path):
    dense = make_model_folder(tmp_path / "dense", hidden_size=32, num_layers=2)
    async with open_server(dense, port=0, health_check_timeout=0.5) as server:
        status, out = await generate(server.url, input_ids=PROMPT, return_routed_experts=True)
        assert status == 400 and "return_routed_experts" in str(out) and "MoE" in str(out)
        status, out = await generate(server.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
        assert status == 200 and "routed_experts" not in out["meta_info"]


async def test_a_retract_publish_keeps_each_positions_row_from_the_forward_that_first_read_it(moe_dirs):
    """A retracted request is prefilled again under the new weights: only the row of the position
    that samples its next token is new; the earlier rows stay those of the old weights' forwards."""
    v0, v1 = moe_dirs
    long = 24
    async with (
        open_server(v0, port=0, weight_version="0", health_check_timeout=0.5) as server,
        EngineFleet([server.url], concurrency=4) as fleet,
        anyio.create_task_group() as tg,
    ):
        answer: dict = {}

        async def one() -> None:
            status, out = await generate(
                server.url,
                input_ids=PROMPT,
                sampling_params={"max_new_tokens": long, "ignore_eos": True, "sampling_seed": 5},
                return_routed_experts=True,
            )
            assert status == 200, out
            answer.update(out)

        tg.start_soon(one)
        with anyio.fail_after(60):
            while server.core.statistics().num_running < 1:
                await server.core.wait_step()
            await server.core.wait_step()  # at least one token under v0
            await fleet.pause("retract")
            await fleet.update_weights_from_disk(str(v1), weight_version="1", flush_cache=True)
            await fleet.continue_generation()
    meta = answer["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    boundary = spans[0]["end"]
    assert 0 < boundary < long
    ids = PROMPT + answer["output_ids"]
    got = rows_of(meta, len(ids) - 1)
    first_new = len(PROMPT) - 1 + boundary  # the position whose forward sampled the first v1 token
    old, new = router_choices(v0, ids[:-1]), router_choices(v1, ids[:-1])
    assert (got[:first_new] == old[:first_new]).all()
    assert (got[first_new:] == new[first_new:]).all()
    assert (old[:first_new] != new[:first_new]).any()  # the two weights do route differently


N_SAMPLES, MAX_LEN = 2, 32


async def _one_group(model: Path, *, abort_mid_request: bool) -> list:
    """One group of the generator pool (asking for R3) against the built-in engine; with
    `abort_mid_request`, a publish in abort mode (of the same weights) cuts both requests once
    they have decoded a few tokens, and the pool continues them as prompt + prefix."""

    async def cut(server: EngineServer, fleet: EngineFleet, clock: VersionClock) -> None:
        while server.core.statistics().generated_tokens < 3 * N_SAMPLES:
            await server.core.wait_step()
        await fleet.pause("abort")
        await publish_weights(clock, fleet, model, pause_mode="abort")

    [group] = await engine_rollout(
        model,
        [PromptTask(index=0, prompt_ids=tuple(PROMPT))],
        n_samples=N_SAMPLES,
        payloads=TokenPayloads(routed_experts_top_k=TOP_K),
        max_response_len=MAX_LEN,
        sampling_params={"ignore_eos": True},
        slots=8,
        during=cut if abort_mid_request else None,
    )
    return list(group.samples)


async def test_routes_survive_an_abort_and_a_continuation_byte_for_byte(moe_dirs):
    v0, _ = moe_dirs
    whole = await _one_group(v0, abort_mid_request=False)
    cut = await _one_group(v0, abort_mid_request=True)
    assert any(s.resumed_at for s in cut)  # the abort did cut requests mid-response
    for a, b in zip(whole, cut, strict=True):
        assert a.status is b.status is SampleStatus.TRUNCATED
        assert a.response_ids == b.response_ids
        assert a.routes is not None and b.routes is not None and (a.routes.layers, a.routes.top_k) == (LAYERS, TOP_K)
        assert a.routes.data == b.routes.data  # byte for byte
        # And they are the engine's routers' choices for each token's sampling position.
        ids = list(a.prompt_ids) + list(a.response_ids)
        expected = router_choices(v0, ids[:-1])[len(a.prompt_ids) - 1 :]
        assert (a.routes.as_ids().reshape(expected.shape) == expected).all()


async def test_a_request_aborted_while_retracted_keeps_its_tokens_unrouted_and_its_sample_goes_on(moe_dirs):
    """SGLang collects a request's routes when it finishes in a forward; a request aborted in its
    waiting queue, where a retract put it with its tokens, is answered by the tokenizer manager's
    `_handle_abort_req`, which sends no `routed_experts`. The built-in engine answers the same, and
    the pool keeps those tokens (NO_ROUTE rows: the trainer's router routes them) and continues
    the sample as partial rollout does; the tokens after the cut get their routes."""
    v0, _ = moe_dirs

    async def abort_retracted(server: EngineServer, fleet: EngineFleet, clock: VersionClock) -> None:
        while server.core.statistics().generated_tokens < 3 * N_SAMPLES:
            await server.core.wait_step()
        await fleet.pause("retract")  # back to the waiting queue, tokens and all
        await fleet.abort_all()  # where the abort finds them
        await fleet.continue_generation()

    [group] = await engine_rollout(
        v0,
        [PromptTask(index=0, prompt_ids=tuple(PROMPT))],
        n_samples=N_SAMPLES,
        payloads=TokenPayloads(routed_experts_top_k=TOP_K),
        max_response_len=MAX_LEN,
        sampling_params={"ignore_eos": True},
        slots=8,
        during=abort_retracted,
    )
    for s in group.samples:
        assert s.status is SampleStatus.TRUNCATED and len(s.response_ids) == MAX_LEN
        assert s.routes is not None and s.resumed_at
        cut = s.resumed_at[0]
        rows = s.routes.as_ids().reshape(MAX_LEN, LAYERS, TOP_K)
        assert (rows[:cut] == NO_ROUTE).all()  # the aborted answer's tokens came without routes
        ids = list(s.prompt_ids) + list(s.response_ids)
        expected = router_choices(v0, ids[:-1])[len(s.prompt_ids) - 1 :]
        assert (rows[cut:] == expected[cut:]).all()  # the continuation's did, from their forwards
