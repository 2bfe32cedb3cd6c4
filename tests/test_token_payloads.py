"""R3 routes and SC sampler heads (issue 32, phase 1): from SGLang's wire to the store, token-aligned.

The rule under test: each response token keeps the route (and sampler top-k) of the forward that
sampled it, through aborts, continuations, publishes in every pause mode, and a round trip
through LMDB. The protocol fake computes both from (weight version, position, token), and a
re-prefill drifts the rows it recomputes (as a real engine's other batch shape does), so a client
that took a continuation's prefix rows would differ from the expected bytes here.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import anyio
import msgpack
import pytest

from core.clock import VersionClock
from core.columns import NO_ROUTE, SamplerHeads, TokenRoutes
from core.errors import ConfigError, CorruptRecordError, EngineError
from core.types import FinishReason, Group, PromptTask, Sample, SampleStatus, Segment
from pipeline.config import load_config
from stages.sglang_client import EngineFleet, GenerateResult
from stages.sglang_client.payloads import TokenPayloads, parse_top_logprobs, routes_for_new_tokens
from storage import AsyncStore, GroupState, LmdbStore, MemoryStore
from storage.codec import decode_group, encode_group
from tests.conftest import PoolRig
from tests.fakes import FakeSGLang
from tests.fakes.fake_moe import MoeShape, _route_row, sampler_head

pytestmark = pytest.mark.anyio

SHAPE = MoeShape(layers=3, top_k=2, experts=8)
K = 3  # sampler heads per token
MAX_LEN = 6
N_SAMPLES = 2
PAYLOADS = TokenPayloads(routed_experts_top_k=SHAPE.top_k, sampler_top_k=K)
URL = "http://engine:1"


def dataset(n: int = 8) -> list[PromptTask]:
    return [PromptTask(index=i, prompt_ids=(5, 100 + i, 7), label=i) for i in range(n)]


# -- what the forward that sampled each token routed (the fake's functions, recomputed) -----------


def expected_routes(sample: Sample, shape: MoeShape = SHAPE) -> bytes:
    """Token t's row: the forward that read position P - 1 + t, under the version that sampled t."""
    context = tuple(sample.prompt_ids) + tuple(sample.response_ids)
    p0 = len(sample.prompt_ids) - 1
    versions = sample.token_versions()
    return b"".join(_route_row(shape, str(versions[t]), p0 + t, context[p0 + t], 0) for t in range(sample.response_len))


def expected_heads(sample: Sample, seed: int, shape: MoeShape = SHAPE) -> SamplerHeads:
    context = tuple(sample.prompt_ids) + tuple(sample.response_ids)
    ids: list[int] = []
    lps: list[float] = []
    versions = sample.token_versions()
    for t in range(sample.response_len):
        for lp, tid, _ in sampler_head(shape, str(versions[t]), context[: len(sample.prompt_ids) + t], seed, K):
            ids.append(tid)
            lps.append(lp)
    return SamplerHeads(struct.pack(f"<{len(ids)}i", *ids), struct.pack(f"<{len(lps)}d", *lps), k=K)


def seeds_by_sample(fake: FakeSGLang) -> dict[tuple[str, int], int]:
    out = {}
    for r in fake.finished:
        if r.rid.startswith("r3-probe-"):  # the fleet's check on entry that the engine answers routes
            continue
        group_id, rest = r.rid.rsplit("-s", 1)
        out[(group_id, int(rest.split("-")[0]))] = r.seed
    return out


# -- the wire --------------------------------------------------------------------------------------


def _rows(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def test_the_new_tokens_rows_are_cut_from_an_answer_that_starts_where_asked_or_at_zero():
    # 4 input tokens, 2 new: positions 0..4 have rows (the last new token was never read); the
    # new tokens' rows are positions 3 and 4. One layer, top-1: a row is one int, its position.
    common = dict(sent_start=3, input_len=4, completion=2, top_k=1, url=URL)
    honoured = routes_for_new_tokens(_rows([3, 4]), echoed_start=3, layers=None, **common)
    ignored = routes_for_new_tokens(_rows([0, 1, 2, 3, 4]), echoed_start=None, layers=1, **common)
    silent = routes_for_new_tokens(_rows([3, 4]), echoed_start=None, layers=None, **common)
    assert honoured is not None and ignored is not None and silent is not None
    assert honoured == ignored == silent == TokenRoutes(_rows([3, 4]), layers=1, top_k=1)
    assert honoured.data == bytes([3, 4])  # packed: ids 3 and 4 need one byte each
    # Two layers of top-2, echoed from 0: rows of 4 ints.
    wide = routes_for_new_tokens(_rows(list(range(20))), echoed_start=0, layers=None, **(common | {"top_k": 2}))
    assert wide is not None and (wide.layers, wide.top_k) == (2, 2) and wide.tolist_flat() == list(range(12, 20))
    assert routes_for_new_tokens(b"", echoed_start=None, layers=None, **(common | {"completion": 0})) is None
    with pytest.raises(EngineError, match="no whole number of rows of 2 layers x top-1"):
        routes_for_new_tokens(_rows([3, 4, 5]), echoed_start=3, layers=2, **common)


def test_an_answer_carries_routed_experts_and_top_logprobs_into_the_segment():
    meta = {
        "id": "r",
        "finish_reason": {"type": "length", "length": 2},
        "weight_version": "0",
        "completion_tokens": 2,
        "output_token_logprobs": [[-0.5, 9, None], [-0.25, 8, None]],
        "output_top_logprobs": [[[-0.5, 9, None], [-1.5, 3, None]], [[-0.25, 8, None], [-2.0, 4, None]]],
        "routed_experts": base64.b64encode(_rows([1, 2])).decode(),
        "routed_experts_start_len": 1,
    }
    result = GenerateResult.from_response({"output_ids": [9, 8], "meta_info": meta}, url=URL, rid="r")
    assert result.routed_experts == _rows([1, 2]) and result.routed_experts_start_len == 1
    assert result.heads is not None and result.heads.row(1) == [(8, -0.25), (4, -2.0)]
    routes = TokenRoutes(_rows([1, 2]), layers=1, top_k=1)
    segment = result.to_segment(0, routes=routes)
    assert segment.routes == routes and segment.heads == result.heads
    with pytest.raises(EngineError, match="not valid base64"):
        GenerateResult.from_response({"meta_info": meta | {"routed_experts": "!!"}}, url=URL, rid="r")
    with pytest.raises(EngineError, match=r"one list per output token \(2\), got 1 entries"):
        parse_top_logprobs([[[-0.5, 9, None]]], 2, URL)
    with pytest.raises(EngineError, match="not a list of 2 candidates"):
        parse_top_logprobs([[[-0.5, 9, None], [-1.0, 2, None]], [[-0.5, 9, None]]], 2, URL)


# -- the columns and the sample --------------------------------------------------------------------


def test_payload_columns_are_read_only_views_of_their_bytes():
    routes = TokenRoutes(_rows(list(range(12))), layers=2, top_k=3)
    view = routes.view()
    assert view.readonly and view.obj is routes.data  # the bytes themselves, not a copy
    assert view.shape == (2, 2, 3) and view.tolist()[1][0] == [6, 7, 8]
    with pytest.raises(TypeError):
        view[0, 0, 0] = 1  # type: ignore[index]
    with pytest.raises(ValueError, match="2 layers x top-3"):
        routes.joined(TokenRoutes(_rows([0, 1]), layers=1, top_k=2))
    with pytest.raises(ValueError, match="not a whole number of 24-byte rows"):
        TokenRoutes(_rows([1, 2]), layers=2, top_k=3)
    heads = SamplerHeads(_rows([1, 2]), struct.pack("<2d", -0.5, -1.5), k=2)
    assert heads.logprobs_view().obj is heads.logprobs_data and heads.row(0) == [(1, -0.5), (2, -1.5)]


def test_a_sample_keeps_its_payload_rows_aligned_with_its_tokens():
    r = TokenRoutes(_rows([10, 11]), layers=1, top_k=1)
    h = SamplerHeads(_rows([20, 21]), struct.pack("<2d", -1.0, -2.0), k=1)
    sample = Sample(0, (1, 2)).extended(
        Segment((5, 6), (-1.0, -1.0), FinishReason.ABORT, 0, routes=r, heads=h), max_response_len=8
    )
    # Environment tokens: no forward sampled them, so their rows say so.
    sample = sample.with_environment((7,), version=0)
    sample = sample.extended(
        Segment((8,), (-1.0,), FinishReason.LENGTH, 1, routes=r.rows(1, 2), heads=h.rows(1, 2)), max_response_len=8
    )
    assert sample.routes is not None and sample.heads is not None
    assert sample.routes.tolist_flat() == [10, 11, NO_ROUTE, 11]
    assert [row[0][0] for row in (sample.heads.row(t) for t in range(4))] == [20, 21, -1, 21]
    with pytest.raises(ValueError, match="1 rows of routed experts for 2 tokens"):
        Segment((5, 6), (-1.0, -1.0), FinishReason.ABORT, 0, routes=r.rows(0, 1))
    # Tokens from before payloads were asked for get placeholder rows, never a shifted column.
    late = Sample(0, (1,)).extended(Segment((5,), (-1.0,), FinishReason.ABORT, 0), max_response_len=8)
    late = late.extended(Segment((6,), (-1.0,), FinishReason.LENGTH, 0, routes=r.rows(0, 1)), max_response_len=8)
    assert late.routes is not None and late.routes.tolist_flat() == [NO_ROUTE, 10]


# -- the store -------------------------------------------------------------------------------------


def _group_with_payloads() -> Group:
    group = Group.fresh(dataset(1)[0], epoch=0, n_samples=2, version=0, seq=0)
    r = TokenRoutes(_rows(list(range(12))), layers=3, top_k=2)
    h = SamplerHeads(_rows([1, 2, 3, 4]), struct.pack("<4d", -0.1, -0.2, -0.3, -0.4), k=2)
    seg = Segment((9, 8), (-0.5, -0.25), FinishReason.ABORT, 0, routes=r, heads=h)
    return group.with_samples([group.samples[0].extended(seg, max_response_len=8), group.samples[1]])


def test_the_codec_keeps_payloads_and_reads_records_from_before_them():
    group = _group_with_payloads()
    back = decode_group(encode_group(group))
    assert back == group and back.samples[0].routes == group.samples[0].routes
    assert back.samples[0].heads == group.samples[0].heads and back.samples[1].routes is None
    # A sample without payloads is still the 12-field record that code from before them wrote and reads.
    record = msgpack.unpackb(encode_group(group), raw=False)
    assert [len(s) for s in record[-1]] == [13, 12]
    old = group.with_samples([group.samples[1]])
    assert decode_group(encode_group(old)) == old


def test_lmdb_keeps_payloads_sealed_and_byte_exact(tmp_path):
    group = _group_with_payloads()
    with LmdbStore(tmp_path / "store") as store:
        store.admit([group], store.cursor())
        store.put_partial(group)
    with LmdbStore(tmp_path / "store") as store:
        [back] = store.groups(GroupState.PARTIAL)
    assert back.samples[0].routes == group.samples[0].routes and back.samples[0].heads == group.samples[0].heads
    routes = back.samples[0].routes
    assert routes is not None and routes.view().obj is routes.data


# -- the pool over HTTP ----------------------------------------------------------------------------


class Rig(PoolRig):
    """`PoolRig` on this file's tasks, asking for R3 and SC: 8 slots."""

    def __init__(self, fleet, store, clock: VersionClock, *, max_len: int = MAX_LEN):
        super().__init__(
            fleet, store, clock, tasks=dataset(), n_samples=N_SAMPLES, max_len=max_len, slots=8, payloads=PAYLOADS
        )


def assert_payloads_from_the_sampling_forwards(group: Group, seeds: dict[tuple[str, int], int]) -> None:
    for s in group.samples:
        assert s.status.finished and s.routes is not None and s.heads is not None
        assert (s.routes.layers, s.routes.top_k) == (SHAPE.layers, SHAPE.top_k)
        assert s.routes.code == "B", "the fake's 8 experts fit one byte an id"
        int32 = s.routes.widened("i").data
        assert int32 == expected_routes(s), f"sample {s.index}: routes not from the sampling forwards"
        assert s.heads == expected_heads(s, seeds[(group.group_id, s.index)])


async def test_uninterrupted_requests_get_each_tokens_route_and_heads():
    store, clock = MemoryStore(), VersionClock()
    async with (
        FakeSGLang(weight_version="0", moe=SHAPE) as fake,
        EngineFleet([fake.url], concurrency=8) as fleet,
        anyio.create_task_group() as tg,
    ):
        rig = Rig(fleet, store, clock)
        await rig.start(tg)
        rig.admission.grant(2)
        with anyio.fail_after(10):
            await rig.admission.wait_settled()
        tg.cancel_scope.cancel()
    sent = fake.generate_payloads[0]
    assert sent["return_routed_experts"] is True and sent["top_logprobs_num"] == K
    # Until the pool knows the model's layers it asks for every row (which reads the same whether
    # or not a server honours routed_experts_start_len); the continuations below ask for the new ones.
    assert sent["routed_experts_start_len"] == 0
    for group in store.groups(GroupState.READY):
        assert_payloads_from_the_sampling_forwards(group, seeds_by_sample(fake))


@pytest.mark.parametrize(
    ("mode", "ignores_start"), [("abort", False), ("abort", True), ("retract", False), ("in_place", False)]
)
async def test_a_publish_mid_request_keeps_each_tokens_route_from_the_forward_that_sampled_it(
    mode, ignores_start, tmp_path
):
    store, clock = MemoryStore(), VersionClock()
    async with (
        FakeSGLang(weight_version="0", moe=SHAPE, ignore_routed_experts_start_len=ignores_start) as fake,
        EngineFleet([fake.url], concurrency=8) as fleet,
        anyio.create_task_group() as tg,
    ):
        rig = Rig(fleet, store, clock)
        await rig.start(tg)
        await rig.publish_with_one_group_held(fake, fleet, tmp_path / "v1", mode)
        tg.cancel_scope.cancel()
    [group] = store.groups(GroupState.READY)
    assert all(s.token_versions() == [0, 0, 1, 1, 1, 1] for s in group.samples)
    assert_payloads_from_the_sampling_forwards(group, seeds_by_sample(fake))
    if mode == "abort":
        # The continuation re-prefilled the 2-token prefix under v1: had the client taken those
        # rows, token 0's route would be this one, not the v0 one it keeps.
        s = group.samples[0]
        prompt_len = len(s.prompt_ids)
        re_prefilled = _route_row(SHAPE, "1", prompt_len - 1, s.prompt_ids[-1], prompt_len + 2)
        assert s.routes is not None and s.routes.rows(0, 1).widened("i").data != re_prefilled
        continuation = [p for p in fake.generate_payloads if len(p["input_ids"]) == prompt_len + 2]
        assert continuation and all(p["routed_experts_start_len"] == prompt_len + 1 for p in continuation)


async def _run_one_round(fake: FakeSGLang, store, *, stop_at: int | None) -> None:
    """Generate one group; with `stop_at`, stop the pool (partial rollout's "enough") once every
    request holds that many tokens, which stores the group as partial."""
    clock = VersionClock()
    async with EngineFleet([fake.url], concurrency=8) as fleet, anyio.create_task_group() as tg:
        rig = Rig(fleet, store, clock)
        await rig.start(tg)
        if stop_at is not None:
            fake.hold(stop_at)
        rig.admission.grant(1)
        with anyio.fail_after(10):
            if stop_at is None:
                await rig.admission.wait_settled()
            else:
                await fake.wait_until(lambda: fake.held == N_SAMPLES)
                await rig.pool.stop()
                fake.release()
        tg.cancel_scope.cancel()


async def test_routes_and_heads_survive_an_abort_and_a_resume_through_lmdb_byte_for_byte(tmp_path):
    async with FakeSGLang(weight_version="0", moe=SHAPE) as fake:
        reference = MemoryStore()
        await _run_one_round(fake, reference, stop_at=None)
    [whole] = reference.groups(GroupState.READY)

    async with FakeSGLang(weight_version="0", moe=SHAPE) as fake:
        with LmdbStore(tmp_path / "store") as store:
            await _run_one_round(fake, store, stop_at=3)
            [partial] = store.groups(GroupState.PARTIAL)
            assert all(s.status is SampleStatus.PARTIAL and s.response_len == 3 for s in partial.samples)
    # A new process: the partial group comes back from disk and is continued.
    async with FakeSGLang(weight_version="0", moe=SHAPE) as fake:
        with LmdbStore(tmp_path / "store") as store:
            await _run_one_round(fake, store, stop_at=None)
            [resumed] = store.groups(GroupState.READY)
    for a, b in zip(whole.samples, resumed.samples, strict=True):
        assert b.resumed_at == (3,) and a.response_ids == b.response_ids
        assert a.routes is not None and b.routes is not None and a.heads is not None
        assert a.routes.data == b.routes.data and a.heads == b.heads  # byte for byte


async def test_an_engine_without_routed_experts_fails_the_sample_by_name():
    store, clock = MemoryStore(), VersionClock()
    async with (
        FakeSGLang(weight_version="0", moe=SHAPE) as fake,
        EngineFleet([fake.url], concurrency=8) as fleet,
        anyio.create_task_group() as tg,
    ):
        rig = Rig(fleet, store, clock)
        rig.pool._payloads = TokenPayloads(routed_experts_top_k=5)  # the model routes top-2
        await rig.start(tg)
        rig.admission.grant(1)
        with anyio.fail_after(10):
            await rig.admission.wait_settled()
        tg.cancel_scope.cancel()
    [group] = store.groups(GroupState.FAILED)
    assert all("top-5" in (s.error or "") and "--moe-router-topk" in (s.error or "") for s in group.samples)


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--use-rollout-routing-replay"], "--use-rollout-routing-replay=True needs --moe-router-topk"),
        (["--use-score-centering"], "needs --score-centering-top-k"),
        (["--score-centering-top-k", "4"], "has no effect without --use-score-centering"),
        (["--use-score-centering", "--score-centering-top-k", "4", "--rollout-top-p", "0.9"], "--rollout-top-p=0.9"),
        (["--use-score-centering", "--score-centering-top-k", "4", "--rollout-top-k", "20"], "--rollout-top-k=20"),
    ],
)
def test_refused_payload_combinations_are_named_at_config_load(argv, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        load_config(argv)


def test_payload_flags_reach_the_plan():
    from pipeline.run.cli import _plan

    r3 = ["--use-rollout-routing-replay", "--moe-router-topk", "8"]
    config = load_config([*r3, "--use-score-centering", "--score-centering-top-k", "4"])
    assert _plan(config).payloads == TokenPayloads(routed_experts_top_k=8, sampler_top_k=4)
    assert _plan(load_config([])).payloads == TokenPayloads()


def test_routes_and_heads_survive_a_sigkill_of_the_lmdb_writer_byte_for_byte(tmp_path):
    """The writer is SIGKILLed while continuations of a stored partial group are in flight; the
    next process recovers the store (the leased group goes back to partial) and finishes it."""

    async def reference() -> Group:
        async with FakeSGLang(weight_version="0", moe=SHAPE) as fake:
            store = MemoryStore()
            await _run_one_round(fake, store, stop_at=None)
            [group] = store.groups(GroupState.READY)
            return group

    whole = anyio.run(reference)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.payload_kill_child", str(tmp_path / "store")],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the child holds its continuations (or exits)
        assert line.strip() == b"HELD", line + child.stdout.read()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    async def resume() -> Group:
        async with FakeSGLang(weight_version="0", moe=SHAPE) as fake:
            with LmdbStore(tmp_path / "store") as store:
                assert store.count(GroupState.RUNNING) == 1  # leased when the writer died
                store.recover()
                [partial] = store.groups(GroupState.PARTIAL)
                assert all(s.response_len == 3 and s.routes is not None for s in partial.samples)
                await _run_one_round(fake, store, stop_at=None)
                [group] = store.groups(GroupState.READY)
                return group

    resumed = anyio.run(resume)
    for a, b in zip(whole.samples, resumed.samples, strict=True):
        assert a.response_ids == b.response_ids and b.resumed_at and b.resumed_at[0] == 3
        assert a.routes is not None and b.routes is not None and a.heads is not None
        assert a.routes.data == b.routes.data and a.heads == b.heads  # byte for byte


# -- replay ----------------------------------------------------------------------------------------


def test_replay_shows_and_verifies_the_payloads(tmp_path, capsys):
    from pipeline.replay import main as replay

    group = _group_with_payloads()
    with LmdbStore(tmp_path / "rollout_data") as store:
        store.admit([group], store.cursor())
        store.put_partial(group)
    capsys.readouterr()
    assert replay([str(tmp_path), "group", group.group_id]) == 0
    text = capsys.readouterr().out
    assert "R3: 2 tokens x 3 layers x top-2, 0 unrouted; token 0: [[0, 1], [2, 3], [4, 5]]" in text
    assert "SC: 2 tokens x top-2; token 0: 1:-0.100 2:-0.200" in text
    assert replay([str(tmp_path), "group", group.group_id, "--json"]) == 0
    [with_rows, without] = json.loads(capsys.readouterr().out)["samples"]
    assert with_rows["routed_experts"]["experts"][1] == [[6, 7], [8, 9], [10, 11]]
    assert with_rows["sampler_heads"]["logprobs"] == [[-0.1, -0.2], [-0.3, -0.4]]
    assert "routed_experts" not in without and "sampler_heads" not in without
    assert replay([str(tmp_path), "verify"]) == 0


def test_a_payload_out_of_step_with_its_tokens_is_a_damaged_record_naming_the_key():
    record = msgpack.unpackb(encode_group(_group_with_payloads()), raw=False)
    layers, top_k, data, code = record[-1][0][12]["r3"]
    record[-1][0][12]["r3"] = [layers, top_k, data[: len(data) // 2], code]  # one row for two tokens
    with pytest.raises(CorruptRecordError, match=r"'groups/x' does not decode: .*1 rows of routed experts for 2"):
        decode_group(msgpack.packb(record, use_bin_type=True), key="groups/x")


def test_store_costs_reports_the_payloads_raw_size_per_token(tmp_path):
    import argparse

    from benchmarks.store_costs import payload_costs

    args = argparse.Namespace(payload_commits=2, r3_layers=2, r3_top_k=2, sc_top_k=2, r3_experts=128)
    rows = dict(payload_costs(tmp_path, args))
    without, with_ = (float(x) for x in rows["payloads: bytes/token without / with"].split("(")[0].split(" / "))
    # Raw rows: 2 x 2 uint8 routes (128 experts) + 2 x (int32 + float64) heads = 28 bytes a token, nothing more.
    assert with_ - without == pytest.approx(28, abs=0.1)
    assert "payloads: read ms/group without / with" in rows


async def _two_turn_agent(ctx, sample):
    """Model turn, tool tokens, model turn: the tool tokens have no sampling forward."""
    if not ctx.state.get("tool"):
        await ctx.generate(max_new_tokens=2)
        ctx.append([11, 12])
        ctx.state["tool"] = True
    await ctx.generate(max_new_tokens=2)


async def test_an_agents_model_turns_get_routes_and_its_tool_tokens_are_marked_unrouted():
    store, clock = MemoryStore(), VersionClock()
    async with (
        FakeSGLang(weight_version="0", moe=SHAPE) as fake,
        EngineFleet([fake.url], concurrency=8) as fleet,
        anyio.create_task_group() as tg,
    ):
        rig = Rig(fleet, store, clock)
        rig.pool._agent = _two_turn_agent
        await rig.start(tg)
        rig.admission.grant(1)
        with anyio.fail_after(10):
            await rig.admission.wait_settled()
        tg.cancel_scope.cancel()
    [group] = store.groups(GroupState.READY)
    seeds = seeds_by_sample(fake)
    for s in group.samples:
        assert s.response_len == MAX_LEN and list(s.loss_mask) == [1, 1, 0, 0, 1, 1]
        assert s.routes is not None and s.heads is not None
        want = expected_routes(s)
        row = SHAPE.layers * SHAPE.top_k * 4
        # Model tokens: the sampling forward's rows (the second turn's prefill re-read the first
        # turn, and its rows are not taken); tool tokens: NO_ROUTE and id -1 rows.
        int32 = s.routes.widened("i")
        assert int32.rows(0, 2).data == want[: 2 * row] and int32.rows(4, 6).data == want[4 * row :]
        assert s.routes.rows(2, 4).tolist_flat() == [NO_ROUTE] * (2 * SHAPE.layers * SHAPE.top_k)
        heads = expected_heads(s, seeds[(group.group_id, s.index)])
        assert s.heads.rows(0, 2) == heads.rows(0, 2) and s.heads.rows(4, 6) == heads.rows(4, 6)
        assert {t for t, _ in s.heads.row(2) + s.heads.row(3)} == {-1}


async def test_a_ray_producer_asks_for_the_payloads_and_returns_them_in_its_records():
    from launch.ray_producer import ProducerCore
    from tests.test_producer_core import spec

    async with FakeSGLang(weight_version="0", moe=SHAPE) as fake:
        producer = spec(fake.url, routed_experts_top_k=SHAPE.top_k, sampler_top_k=K, max_response_len=MAX_LEN)
        assert type(producer).from_json(producer.to_json()) == producer  # the spec travels as JSON
        core = ProducerCore(producer, node="here")
        async with anyio.create_task_group() as tg:
            await tg.start(core.run)
            fresh = Group.fresh(dataset(1)[0], epoch=0, n_samples=2, version=0, seq=0)
            await core.submit(encode_group(fresh))
            with anyio.fail_after(10):
                ((_, data),) = await core.take_results(8)
            tg.cancel_scope.cancel()
    assert_payloads_from_the_sampling_forwards(decode_group(data), seeds_by_sample(fake))


# -- the whole pipeline ----------------------------------------------------------------------------


class RecordingTrainer:
    """Keeps every batch it is handed; trains nothing."""

    def __init__(self) -> None:
        self.batches: list = []

    def train_step(self, batch):
        self.batches.append(batch)
        return {"loss": 0.0}

    def save_weights(self, path: Path) -> Path:
        return path


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_run_pipeline_hands_the_trainer_samples_whose_rows_came_from_the_sampling_forwards(mode, tmp_path):
    """Through the controller, with publishes between steps and LMDB: every trained token's route
    and heads are those of the forward (and version) that sampled it."""
    from pipeline import RolloutPlan, run_pipeline
    from pipeline.metrics import MetricsSink

    plan = RolloutPlan(
        mode=mode,
        batch_size=2,
        n_samples=N_SAMPLES,
        num_steps=3,
        partial=True,
        over_sampling=3,
        slots=8,
        max_response_len=MAX_LEN,
        payloads=PAYLOADS,
    )
    trainer = RecordingTrainer()
    async with FakeSGLang(weight_version="0", moe=SHAPE) as fake, EngineFleet([fake.url], concurrency=8) as fleet:
        with LmdbStore(tmp_path / "store") as store, anyio.fail_after(30):
            await run_pipeline(
                plan,
                engines=fleet,
                store=AsyncStore(store),
                trainer=trainer,
                dataset=dataset(),
                reward_fn=lambda task, sample: 1.0,
                filter_fn=None,
                weights_dir=tmp_path / "w",
                metrics=MetricsSink(None),
            )
        seeds = seeds_by_sample(fake)
    assert len(trainer.batches) == 3
    for batch in trainer.batches:
        for group in batch.groups:
            assert_payloads_from_the_sampling_forwards(group, seeds)
