"""The production-payload load generator (issue 49): the instant engine answering as a production
run's engines do (long-tailed lengths, log-probs, version spans, R3 routes as SGLang sends them,
SC heads), several engines in one process behind the real sglang-router, read by the real client
and kept by the real LMDB store; and the benchmark built on it, at a tiny size."""

from __future__ import annotations

import argparse
import base64
import json

import aiohttp
import numpy as np
import orjson
import pytest

from benchmarks import production_payloads as bench
from benchmarks.controller_overhead import NullTrainer, reward, workload
from core.types import FinishReason
from engines.production_payloads import JsonPrefix, RoutesBase64, RouteShape
from pipeline import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from stages.sglang_client import EngineFleet
from stages.sglang_client.payloads import TokenPayloads
from storage import AsyncStore, GroupState, LmdbStore

pytestmark = pytest.mark.anyio

SHAPE = "6x4/128"  # small layers x top-k; 128 experts, so the routes pack to a byte an id
MAX_TOKENS = 96


def test_an_encoded_array_gives_its_first_items_as_valid_json():
    items = [orjson.dumps([-0.25 * i, 1000 + i, None]) for i in range(7)]
    whole = JsonPrefix(items)
    for n in range(8):
        assert json.loads(b"".join(whole.first(n))) == [json.loads(x) for x in items[:n]]
    eos = orjson.dumps([-0.01, 2, None])
    assert json.loads(b"".join(whole.first(3, eos))) == [json.loads(x) for x in items[:2]] + [[-0.01, 2, None]]
    with pytest.raises(ValueError, match="8 items asked"):
        whole.first(8)


@pytest.mark.parametrize("shape", ["48x8/128", "58x8/256"])  # 1,536 and 1,856 bytes a row: both cuts of base64
def test_route_rows_of_any_count_are_one_valid_base64_of_distinct_experts(shape):
    routes = RoutesBase64(RouteShape.parse(shape), max_rows=7)
    s = routes.shape
    for n in (0, 1, 2, 3, 5, 9, 10, 19, 20):  # within a block, whole blocks, past them
        raw = base64.b64decode(b"".join(routes.rows(n)), validate=True)
        ids = np.frombuffer(raw, dtype="<i4").reshape(n, s.layers, s.top_k)
        assert all(len(set(layer)) == s.top_k for row in ids.tolist() for layer in row)  # a router's top-k
        assert n == 0 or (ids.min() >= 0 and ids.max() < s.experts)
    assert int(np.frombuffer(base64.b64decode(b"".join(routes.rows(1))), dtype="<i4").max()) == s.experts - 1


def test_a_route_shape_that_is_not_one_is_refused_naming_the_form():
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match="is not LAYERSxTOPK/EXPERTS"):
        RouteShape.parse("48x8")
    with pytest.raises(ConfigError, match="1 <= top_k <= experts"):
        RouteShape.parse("4x9/8")


def _args(**changes: object) -> argparse.Namespace:
    argv = ["--engines", "3", "--engine-processes", "1", "--shape", SHAPE, "--sc-top-k", "3"]
    argv += ["--max-tokens", str(MAX_TOKENS), "--length-limit", str(MAX_TOKENS), "--prompt-len", "16"]
    argv += ["--batch", "3", "--group", "4", "--steps", "3", "--slots", "24", "--cpu", "-1"]
    args = bench.parser().parse_args(argv)
    vars(args).update(changes)
    return args


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def engines():
    """Three production-payload engines served by one process, behind the real router."""
    async with bench.engines_and_router(_args()) as (urls, router_url, processes):
        yield urls, router_url, processes


async def test_the_client_decodes_production_answers_and_the_store_keeps_them(engines, tmp_path):
    urls, router_url, processes = engines
    assert len(processes) == 1 and len(urls) == 3 and router_url is not None
    shape = RouteShape.parse(SHAPE)
    payloads = TokenPayloads(routed_experts_top_k=shape.top_k, sampler_top_k=3, routed_experts_count=shape.experts)
    plan = RolloutPlan(
        mode="sync",
        batch_size=3,
        n_samples=4,
        num_steps=2,
        slots=24,
        max_response_len=MAX_TOKENS,
        sampling_params={"temperature": 1.0},
        payloads=payloads,
    )
    before = await _answered_tokens(urls)
    store = AsyncStore(LmdbStore(tmp_path / "store"))
    try:
        async with EngineFleet(urls, router_url=router_url, concurrency=24, routed_experts=True) as fleet:
            await fleet.update_weight_version("0")
            await run_pipeline(
                plan,
                engines=fleet,
                store=store,
                trainer=NullTrainer(tmp_path),
                dataset=workload(12, 16),
                reward_fn=reward,
                filter_fn=None,
                weights_dir=tmp_path,
                metrics=MetricsSink(None),
            )
    finally:
        await store.aclose()
    answered = await _answered_tokens(urls) - before
    with LmdbStore(tmp_path / "store", readonly=True) as lmdb:
        groups = list(lmdb.groups(GroupState.TRAINED))
    samples = [s for g in groups for s in g.samples]
    # Every token answered is kept, but the fleet's one-token R3 probes (through the router, then direct).
    assert len(groups) == 6 and 0 <= answered - sum(s.response_len for s in samples) <= 2
    lengths = {s.response_len for s in samples}
    assert len(lengths) > 3 and max(lengths) <= MAX_TOKENS  # a long tail, capped
    assert {s.finish_reason for s in samples} <= {FinishReason.STOP, FinishReason.LENGTH}
    for g in groups:
        # One span a sample, from the engine's weight_versions: the version the group was generated at.
        assert all([(x.start, x.end, x.version) for x in s.spans] == [(0, s.response_len, g.admitted_version)]
                   for s in g.samples)  # fmt: skip
    for s in samples:
        assert s.routes is not None and s.heads is not None
        assert (s.routes.layers, s.routes.top_k, s.routes.code) == (shape.layers, shape.top_k, "B")
        assert len(s.routes) == len(s.heads) == s.response_len == len(s.logprobs)
        ids = s.routes.as_ids()
        assert ids.min() >= 0 and ids.max() < shape.experts  # every token routed, to the model's experts
        assert s.heads.k == 3


async def _answered_tokens(urls: list[str]) -> int:
    async with aiohttp.ClientSession() as session:
        total = 0
        for url in urls:
            async with session.get(url + "/instant/stats") as resp:
                total += (await resp.json())["tokens"]
        return total


async def test_the_benchmark_reports_rates_lag_busy_parts_and_the_store_size_under_collection(engines, capsys):
    urls, router_url, processes = engines
    args = _args(gc_keep_steps=1, work=None)
    row = await bench.run_one(0, args, urls, router_url, processes)
    assert row["tokens/s"] > 0 and row["samples/s"] > 0 and row["write MB/s"] > 0
    assert set(row["busy"]) == {"controller cpu", "event loop", "store writer", "engine process (busiest)"}
    assert row["saturated"] in {*row["busy"], "engines (waiting on answers)"}
    assert row["rss"]["VmRSS"] > 0 and row["lag max ms"] >= row["lag p50 ms"] >= 0
    # Collection keeps the last step's groups: the 2 steps before it were collected by the end.
    assert row["final"]["trained_held"] == 3 and row["final"]["collected"] == 6 and len(row["sizes"]) == 3
    assert row["final"]["checkpoints"] == 2  # --save-keep-last 2 of the 3 saved
    bench.report([row], args)
    assert "saturated" in capsys.readouterr().out
