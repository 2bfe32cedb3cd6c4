"""The KV-cache forward against the recompute forward it replaces, on a real tiny Qwen3 at fp32.

Continuous batching is exercised for real: more requests than slots, joining and leaving at
different steps, with mixed sampling parameters; every token must match the recompute path.
(Abort/resume exactness over HTTP is `test_engine_server.py::test_abort_then_continue_is_token_exact`,
which runs on the default engine, this one.)
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from core.errors import ConfigError
from engines.builtin import EngineServer, open_server
from engines.decode_graphs import batch_buckets, bucket_for, kv_buckets
from engines.kv_forward import DecodeMode, KVCacheForward
from engines.seam import Row, SamplingParams
from engines.torch_model import ModelRunner
from pipeline.tasks.tiny_model import make_model_folder

SAMPLINGS = [
    SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0),
    SamplingParams(max_new_tokens=17, ignore_eos=True, temperature=0.0),
    SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, top_p=0.9),
    SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=1.2, top_k=5),
    SamplingParams(max_new_tokens=21, temperature=1.0, min_p=0.05, min_new_tokens=4, stop_token_ids=frozenset({7})),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("kv") / "m", hidden_size=32, num_layers=2, seed=0)


def _run_batched(forward: Any, prompts: list[tuple[int, ...]], slots: int) -> list[list[tuple[int, float]]]:
    """A minimal continuous-batching loop: admit into free slots, step, retire finished requests."""
    outs: list[list[tuple[int, float]]] = [[] for _ in prompts]
    waiting, running = list(range(len(prompts))), []
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        rows = [
            Row(
                prompt_ids=prompts[i],
                output_ids=tuple(t for t, _ in outs[i]),
                params=SAMPLINGS[i % len(SAMPLINGS)],
                seed=1000 + i,
                banned=(7,) if len(outs[i]) < SAMPLINGS[i % len(SAMPLINGS)].min_new_tokens else (),
                rid=f"r{i}",
                key=i + 1,
            )
            for i in running
        ]
        for i, row, draw in zip(list(running), rows, forward.step(rows), strict=True):
            outs[i].append((draw.token_id, draw.logprob))
            p = row.params
            if len(outs[i]) >= p.max_new_tokens or draw.token_id in p.stop_token_ids:
                running.remove(i)
                if hasattr(forward, "release"):
                    forward.release(row)
    return outs


def test_cached_decode_equals_recompute_token_for_token(model_dir: Path) -> None:
    runner = ModelRunner(model_dir)
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(3, 60) for _ in range(rng.randrange(1, 40))) for _ in range(13)]
    reference = _run_batched(runner, prompts, slots=len(prompts))  # recompute, everything at once
    kv = KVCacheForward(runner, max_running_requests=4)
    cached = _run_batched(kv, prompts, slots=4)  # four slots, refilled as requests finish
    for ref, got in zip(reference, cached, strict=True):
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert all(math.isclose(a, b, abs_tol=1e-5) for (_, a), (_, b) in zip(got, ref, strict=True))
    stats = kv.statistics()
    assert stats.max_slots_in_use == 4 and stats.prefills >= 4 and stats.decode_steps > 0
    # Requests finished out of slot order: the later ones moved down into the holes, K/V and all.
    assert stats.moves > 0


def test_the_step_sums_for_the_twins_time_fit_count_rows_and_context(model_dir: Path) -> None:
    """The sums `/server_info` reports for the simulated twin's fit (`benchmarks/modes_builtin.py`):
    decode-only steps against their rows and context (the rows' positions summed), and the rows a
    prefilling step decodes beside its prompts, with their context."""
    kv = KVCacheForward(ModelRunner(model_dir), max_running_requests=3)
    seen: set[int] = set()
    want: Counter[str] = Counter()

    class Recording:
        def step(self, rows: list[Row]) -> Any:
            fresh = [r for r in rows if r.key not in seen]
            seen.update(r.key for r in rows)
            held = [r for r in rows if r not in fresh]
            context = sum(r.position for r in held)
            if fresh:
                want["prefill_step_held_rows"] += len(held)
                want["prefill_step_held_context"] += context
            else:
                want["decode_timed_steps"] += 1
                want["decode_context"] += context
                want["decode_context_squared"] += context * context
                want["decode_rows_context"] += len(rows) * context
            return kv.step(rows)

        def release(self, row: Row) -> None:
            kv.release(row)

    rng = random.Random(1)
    _run_batched(Recording(), [tuple(rng.randrange(3, 60) for _ in range(rng.randrange(1, 30))) for _ in range(7)], 3)
    stats = kv.statistics()
    assert want["decode_timed_steps"] > 0 and want["prefill_step_held_rows"] > 0  # both kinds of step ran
    assert {k: getattr(stats, k) for k in want} == dict(want)
    assert stats.decode_context_seconds > 0


def test_cache_memory_is_slots_times_context(model_dir: Path) -> None:
    runner = ModelRunner(model_dir, context_length=48)
    kv = KVCacheForward(runner, max_running_requests=3)
    text = runner.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_layer = 2 * (3 + 1) * text.num_key_value_heads * 48 * head_dim * 4  # K and V, fp32, and the spare slot
    assert kv.context_length == 48
    assert kv.statistics().cache_bytes == text.num_hidden_layers * per_layer


async def _generate(http: aiohttp.ClientSession, server: EngineServer, **body: Any) -> tuple[int, Any]:
    async with http.post(server.url + "/generate", json=body) as resp:
        return resp.status, orjson.loads(await resp.read())


@pytest.mark.anyio
async def test_engines_with_and_without_cache_answer_alike_under_load(
    model_dir: Path, http: aiohttp.ClientSession
) -> None:
    bodies = [
        {
            "input_ids": [3 + (i * 7 + j) % 50 for j in range(3 + i)],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12 + i, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True},
        }
        for i in range(10)
    ]
    answers: dict[str, list[Any]] = {}
    for kind in ("slots", "none"):
        results: list[Any] = [None] * len(bodies)
        async with open_server(model_dir, kv_cache=kind, max_running_requests=3) as server:
            async with anyio.create_task_group() as tg:
                for i, body in enumerate(bodies):

                    async def one(i: int = i, body: dict[str, Any] = body, results: list[Any] = results) -> None:
                        status, out = await _generate(http, server, **body)
                        assert status == 200, out
                        results[i] = out

                    tg.start_soon(one)
            assert server.core.statistics().max_batch_size == 3
        answers[kind] = results
    for kv, ref in zip(answers["slots"], answers["none"], strict=True):
        assert kv["output_ids"] == ref["output_ids"]


@pytest.mark.anyio
async def test_a_request_that_cannot_fit_gets_400(model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with open_server(model_dir, context_length=32, max_running_requests=2) as server:
        status, out = await _generate(http, server, input_ids=[5] * 20, sampling_params={"max_new_tokens": 13})
        assert status == 400
        assert "maximum context length of 32 tokens" in out["error"]["message"]
        assert "a total of 33 tokens" in out["error"]["message"]
        status, out = await _generate(
            http, server, input_ids=[5] * 20, sampling_params={"max_new_tokens": 12, "ignore_eos": True}
        )
        assert status == 200 and out["meta_info"]["completion_tokens"] == 12  # the last position fits
        info = await (await http.get(server.url + "/server_info")).json()
        assert info["context_length"] == 32 and info["kv_cache"] == "static-slots"


def test_a_request_released_after_its_batch_was_built_takes_no_slot(model_dir: Path) -> None:
    """The scheduler builds rows, then an abort releases one before the compute thread runs them:
    that row must not take a slot, or the slot leaks and a later request finds none."""
    kv = KVCacheForward(ModelRunner(model_dir), max_running_requests=1)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    aborted = Row(prompt_ids=(5, 6, 7), output_ids=(), params=params, seed=1, rid="same", key=1)
    kv.release(aborted)  # lands between building the batch and running it
    assert kv.step([aborted]) == [None]
    again = Row(prompt_ids=(5, 6, 7), output_ids=(), params=params, seed=1, rid="same", key=2)  # rid reused
    (draw,) = kv.step([again])
    assert draw is not None and kv.statistics().slots_in_use == 1


def test_padded_graph_step_equals_eager_decode_token_for_token(model_dir: Path) -> None:
    """The CUDA-graph decode's padded fixed-shape step, run eagerly on the CPU: batches padded to
    buckets 1, 2, 4 and 5 with dummy rows in the spare slot, KV lengths rounded up to 64 and then to
    the context; every token and log-prob as the plain eager decode gives them."""
    runner = ModelRunner(model_dir, context_length=96)
    rng = random.Random(1)
    # Prompts up to 60 tokens plus up to 30 new ones: the KV length crosses the 64 bucket.
    prompts = [tuple(rng.randrange(3, 60) for _ in range(rng.randrange(1, 60))) for _ in range(11)]
    eager = _run_batched(KVCacheForward(runner, max_running_requests=5), prompts, slots=5)
    padded_kv = KVCacheForward(runner, max_running_requests=5, decode=DecodeMode.PADDED)
    padded = _run_batched(padded_kv, prompts, slots=5)
    for ref, got in zip(eager, padded, strict=True):
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert all(math.isclose(a, b, abs_tol=1e-5) for (_, a), (_, b) in zip(got, ref, strict=True))
    graphs = padded_kv.statistics().graphs
    assert graphs is not None and graphs.replays == padded_kv.statistics().decode_steps > 0
    assert padded_kv.graphs is not None and padded_kv.graphs.batch_buckets == (1, 2, 4, 5)
    assert padded_kv.graphs.kv_buckets == (64, 96)


def test_a_batch_over_the_largest_graph_decodes_eagerly(model_dir: Path) -> None:
    """Four rows with a graph for at most two: eager steps until requests finish (after 9 and 17
    tokens), graph steps once two are left; the tokens are the eager decode's throughout."""
    runner = ModelRunner(model_dir, context_length=64)
    prompts: list[tuple[int, ...]] = [(5 + i, 6, 7) for i in range(4)]
    eager = _run_batched(KVCacheForward(runner, max_running_requests=4), prompts, slots=4)
    kv = KVCacheForward(runner, max_running_requests=4, decode=DecodeMode.PADDED, graph_max_batch=2)
    for ref, got in zip(eager, _run_batched(kv, prompts, slots=4), strict=True):
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert all(math.isclose(a, b, abs_tol=1e-5) for (_, a), (_, b) in zip(got, ref, strict=True))
    stats = kv.statistics()
    assert stats.graphs is not None and 0 < stats.graphs.replays < stats.decode_steps


def test_graph_buckets() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert kv_buckets(40) == (40,)
    assert kv_buckets(64) == (64,)
    assert kv_buckets(300) == (64, 128, 256, 300)
    assert bucket_for(3, (1, 2, 4)) == 4 and bucket_for(4, (1, 2, 4)) == 4
    with pytest.raises(ValueError, match="5 exceeds the largest bucket 4"):
        bucket_for(5, (1, 2, 4))
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        batch_buckets(0)


def test_cuda_graphs_on_a_cpu_are_refused_with_the_device_named(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA graphs need a cuda device; this engine runs on cpu"):
        KVCacheForward(ModelRunner(model_dir), max_running_requests=2, decode=DecodeMode.GRAPHS)
