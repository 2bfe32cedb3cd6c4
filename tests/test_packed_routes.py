"""R3 routes stored packed (issue 49): the smallest integer type that holds the model's expert ids,
decoded from SGLang's int32 once at the client, stored so, read by the trainer as a view.

Bytes a token at the two shapes the issue names: Qwen3-30B-A3B (48 layers x top-8 of 128 experts)
packs to uint8, 384 bytes a token (SGLang sends 1,536 as int32, 2,048 as base64); DeepSeek-V3
(58 x top-8 of 256) to int16, 928 (256 ids and NO_ROUTE do not fit a byte).
"""

from __future__ import annotations

import base64
import struct

import msgpack
import numpy as np
import pytest
import torch

from core.columns import NO_ROUTE, TokenRoutes, route_code
from core.errors import EngineError
from core.types import FinishReason, Group, PromptTask, Sample, Segment
from pipeline.replay import main as replay_main
from stages.sglang_client.payloads import routes_for_new_tokens
from storage import GroupState, LmdbStore, codec
from trainers.routing_replay import replay_plan

QWEN3_30B_A3B = (48, 8, 128)  # layers, top-k, experts
DEEPSEEK_V3 = (58, 8, 256)


def _int32(values: np.ndarray) -> bytes:
    return values.astype("<i4").tobytes()


def _routes_like(shape: tuple[int, int, int], tokens: int, seed: int = 0) -> np.ndarray:
    """`tokens` rows of distinct top-k experts per layer, the highest expert id included."""
    layers, top_k, experts = shape
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :top_k]
    ids[0, 0, 0] = experts - 1
    return ids


def _group(routes: TokenRoutes, tokens: int) -> Group:
    task = PromptTask(index=0, prompt_ids=(5, 6, 7))
    group = Group.fresh(task, epoch=0, n_samples=1, version=0, seq=0)
    seg = Segment(tuple(range(100, 100 + tokens)), (-0.5,) * tokens, FinishReason.ABORT, 0, routes=routes)
    return group.with_samples([group.samples[0].extended(seg, max_response_len=tokens * 2)])


def test_the_type_is_the_smallest_that_holds_the_expert_ids_and_no_route():
    assert [route_code(n) for n in (1, 8, 128, 255, 256, 32767, 32768)] == ["B", "B", "B", "B", "h", "h", "i"]


@pytest.mark.parametrize(("shape", "code", "per_token"), [(QWEN3_30B_A3B, "B", 384), (DEEPSEEK_V3, "h", 928)])
def test_routes_are_packed_once_at_the_client_and_round_trip_through_the_store(tmp_path, shape, code, per_token):
    layers, top_k, experts = shape
    tokens = 5
    ids = _routes_like(shape, tokens)
    ids[2] = NO_ROUTE  # a token no sampling forward routed
    # An answer of 3 input tokens and `tokens` new ones, rows from routed_experts_start_len = 2.
    routes = routes_for_new_tokens(
        _int32(ids),
        echoed_start=2,
        sent_start=2,
        input_len=3,
        completion=tokens,
        top_k=top_k,
        layers=None,
        url="http://engine",
        experts=experts,
    )
    assert routes is not None and routes.code == code and len(routes.data) == tokens * per_token
    assert routes.layers == layers and (routes.as_ids() == ids).all()
    assert routes.row(2) == [[NO_ROUTE] * top_k] * layers and routes.unrouted_rows() == 1
    group = _group(routes, tokens)
    assert codec.decode_group(codec.encode_group(group)) == group
    with LmdbStore(tmp_path / "store") as store:
        store.admit([group], store.cursor())
        store.put_partial(group)
    with LmdbStore(tmp_path / "store", readonly=True) as store:
        [back] = store.groups(GroupState.PARTIAL)
    stored = back.samples[0].routes
    assert stored is not None and stored.code == code and stored == routes
    assert stored.tolist_flat() == ids.reshape(-1).tolist()  # NO_ROUTE came back as -1


def test_without_the_expert_count_the_largest_id_picks_the_type_and_a_wider_answer_widens_the_sample():
    small = TokenRoutes.packed(_int32(np.array([[[3, 254]]])), layers=1, top_k=2)
    wide = TokenRoutes.packed(_int32(np.array([[[255, NO_ROUTE]]])), layers=1, top_k=2)
    assert (small.code, wide.code) == ("B", "h")
    sample = Sample(0, (1,))
    for seg_routes, token in ((small, 8), (wide, 9)):
        seg = Segment((token,), (-1.0,), FinishReason.ABORT, 0, routes=seg_routes)
        sample = sample.extended(seg, max_response_len=8)
    assert sample.routes is not None and sample.routes.code == "h"
    assert sample.routes.tolist_flat() == [3, 254, 255, NO_ROUTE]
    # Unrouted rows (an agent's tool tokens) join in the sample's own type.
    sample = sample.with_environment((11,), version=0)
    assert sample.routes is not None and sample.routes.code == "h" and sample.routes.row(2) == [[NO_ROUTE] * 2]


def test_an_expert_id_the_model_does_not_have_fails_the_answer_naming_it():
    with pytest.raises(EngineError, match=r"expert id 130 is outside 0\.\.127 .* with 128 experts"):
        routes_for_new_tokens(
            _int32(np.array([1, 130])),
            echoed_start=0,
            sent_start=0,
            input_len=1,
            completion=1,
            top_k=2,
            layers=1,
            url="http://engine",
            experts=128,
        )
    with pytest.raises(ValueError, match="expert id -2"):
        TokenRoutes.packed(_int32(np.array([-2, 0])), layers=1, top_k=2)


def _old_payloads_record(s: Sample) -> dict[str, object]:
    """The payload record as the code before packing wrote it: three fields, int32 ids."""
    assert s.routes is not None
    return {"r3": [s.routes.layers, s.routes.top_k, s.routes.widened("i").data]}


def test_a_store_written_before_packing_opens_replays_and_verifies(tmp_path, monkeypatch, capsys):
    ids = _routes_like((4, 2, 16), 3)
    ids[1] = NO_ROUTE
    group = _group(TokenRoutes(_int32(ids), layers=4, top_k=2), 3)
    with monkeypatch.context() as m:
        m.setattr(codec, "_payloads_record", _old_payloads_record)
        old_record = codec.encode_group(group)
        with LmdbStore(tmp_path / "rollout_data") as store:
            store.admit([group], store.cursor())
            store.put_partial(group)
    sample_record = msgpack.unpackb(old_record, raw=False)[-1][0]
    assert len(sample_record[12]["r3"]) == 3  # the old form, not the new one
    # The old int32 record reads as it was written, and equals the same ids packed.
    back = codec.decode_group(old_record).samples[0].routes
    assert back is not None and back.code == "i" and (back.as_ids() == ids).all()
    assert back == TokenRoutes.packed(_int32(ids), layers=4, top_k=2, experts=16)
    with LmdbStore(tmp_path / "rollout_data") as store:  # a writer opens it and serves the group
        [claimed] = store.claim_partial(1)
        assert claimed.samples[0].routes == back
        assert claimed.samples[0].routes.tolist_flat()[8:16] == [NO_ROUTE] * 8
    assert replay_main([str(tmp_path), "verify"]) == 0
    assert "nothing damaged" in capsys.readouterr().out


def test_the_trainer_reads_the_stored_bytes_as_a_view_and_widens_once():
    ids = _routes_like(QWEN3_30B_A3B, 4)
    ids[3] = NO_ROUTE
    routes = TokenRoutes.packed(_int32(ids), layers=48, top_k=8, experts=128)
    record = codec.decode_group(codec.encode_group(_group(routes, 4)))
    stored = record.samples[0].routes
    assert stored is not None
    view = stored.array()
    # A view of the record's bytes, not a copy: same memory, read-only, uint8.
    assert np.shares_memory(view, np.frombuffer(stored.data, dtype=np.uint8))
    assert view.dtype == np.uint8 and not view.flags.writeable and view.shape == (4, 48, 8)
    assert stored.view().obj is stored.data
    # The torch trainer's plan: the rows where the tokens were sampled, NO_ROUTE as -1, int64.
    sample = record.samples[0]
    plan = replay_plan([sample], width=3 + 4, layers=48, top_k=8).reshape(1, 7, 48, 8)
    assert plan.dtype == torch.long
    assert (plan[0, 2:6].numpy() == ids).all() and (plan[0, :2] == -1).all() and (plan[0, 5] == -1).all()
    # The megatron ranks get the packed bytes (a quarter of int32's) and the same plan.
    pytest.importorskip("megatron.core")
    from trainers.megatron.router_replay import plan as megatron_plan
    from trainers.megatron.rows import Row

    row = Row.of(sample, [True] * 4, 1.0, route_shape=(48, 8))
    assert row.routes is not None and row.routes[0] == "B"
    assert len(base64.b64decode(row.routes[1])) == 4 * 384
    packed_plan = megatron_plan([Row.from_json(row.to_json())], layers=48, top_k=8, device=torch.device("cpu"))
    assert packed_plan is not None and torch.equal(packed_plan, plan[0])


def test_no_route_survives_packing_joining_and_the_codec_in_every_type():
    for code, experts in (("B", 128), ("h", 256), ("i", 40000)):
        routed = TokenRoutes.packed(struct.pack("<2i", experts - 1, 0), layers=1, top_k=2, experts=experts)
        assert routed.code == code
        joined = routed.joined(TokenRoutes.unrouted(1, layers=1, top_k=2, code=code))
        group = _group(joined, 2)
        back = codec.decode_group(codec.encode_group(group)).samples[0].routes
        assert back is not None and back.tolist_flat() == [experts - 1, 0, NO_ROUTE, NO_ROUTE]
        assert back.unrouted_rows() == 1


def test_the_launcher_packs_by_the_models_expert_count_where_a_file_says_it(tmp_path):
    import orjson

    from pipeline.config import load_config
    from pipeline.run.cli import _plan

    r3 = ["--moe-router-topk", "2", "--use-rollout-routing-replay", "--output-dir", str(tmp_path / "run")]
    tiny = _plan(load_config(["--num-experts", "8", *r3]))
    assert tiny.payloads.routed_experts_count == 8
    folder = tmp_path / "deepseek"
    folder.mkdir()
    (folder / "config.json").write_bytes(orjson.dumps({"model_type": "deepseek_v3", "n_routed_experts": 256}))
    assert _plan(load_config(["--hf-checkpoint", str(folder), *r3])).payloads.routed_experts_count == 256
    dense_r3_off = load_config(["--num-experts", "8", "--output-dir", str(tmp_path)])
    assert _plan(dense_r3_off).payloads.routed_experts_count is None
