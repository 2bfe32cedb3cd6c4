"""The record codec: exact round trips, and loud failures on anything it did not write."""

from __future__ import annotations

import dataclasses
import math
import struct
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import CorruptRecordError, StoreError
from core.types import Batch, FinishReason, Group, PromptTask, Segment
from storage import Cursor, RunMeta
from storage.codec import (
    decode_batch,
    decode_batch_ref,
    decode_cursor,
    decode_group,
    decode_meta,
    encode_batch,
    encode_batch_ref,
    encode_cursor,
    encode_group,
    encode_meta,
    meta_difference,
)

# --- strategies -------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
json_scalars |= st.floats(allow_nan=False)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
metadata = st.dictionaries(st.text(max_size=6), json_values, max_size=3)
token_ids = st.integers(-(2**31), 2**31 - 1)
logprobs = st.floats(allow_nan=False, width=64)


@st.composite
def segments(draw: st.DrawFn) -> Segment:
    n = draw(st.integers(0, 6))
    return Segment(
        token_ids=tuple(draw(st.lists(token_ids, min_size=n, max_size=n))),
        logprobs=tuple(draw(st.lists(logprobs, min_size=n, max_size=n))),
        finish_reason=draw(st.sampled_from(FinishReason)),
        version=draw(st.integers(-3, 2**40)),
        error=draw(st.none() | st.text(max_size=10)),
    )


@st.composite
def groups(draw: st.DrawFn) -> Group:
    task = PromptTask(
        index=draw(st.integers(0, 10**9)),
        prompt_ids=tuple(draw(st.lists(token_ids, max_size=6))),
        label=draw(json_values),
        metadata=draw(metadata),
    )
    group = Group.fresh(
        task,
        epoch=draw(st.integers(0, 99)),
        n_samples=draw(st.integers(0, 4)),
        version=draw(st.integers(-5, 2**40)),
        seq=draw(st.integers(0, 2**62)),
    )
    samples = []
    for sample in group.samples:
        for _ in range(draw(st.integers(0, 3))):
            sample = sample.extended(draw(segments()), max_response_len=draw(st.integers(1, 20)))
            if draw(st.booleans()):
                sample = sample.resumed()
        mask = tuple(draw(st.lists(st.integers(0, 1), min_size=sample.response_len, max_size=sample.response_len)))
        changes = {
            "reward": draw(st.none() | st.floats(allow_nan=False)),
            "metadata": draw(metadata),
            "loss_mask": mask if draw(st.booleans()) else sample.loss_mask,
        }
        if draw(st.booleans()):  # a sample whose prompt differs from its task's (agent turns)
            changes["prompt_ids"] = tuple(draw(st.lists(token_ids, max_size=4)))
        samples.append(dataclasses.replace(sample, **changes))
    return dataclasses.replace(group.with_samples(samples), rejected_reason=draw(st.none() | st.text(max_size=12)))


def _lp_bits(group: Group) -> list[bytes]:
    return [struct.pack("<d", x) for s in group.samples for x in s.logprobs]


def _big_group(n_samples: int = 8, tokens: int = 1024) -> Group:
    task = PromptTask(index=7, prompt_ids=tuple(range(1000, 1200)), label="42", metadata={"source": "gsm8k"})
    group = Group.fresh(task, epoch=0, n_samples=n_samples, version=3, seq=11)
    half = tokens // 2
    samples = []
    for s in group.samples:
        first = Segment(tuple(range(5000, 5000 + half)), tuple(-0.001 * i for i in range(half)), FinishReason.ABORT, 3)
        rest = tokens - half
        second = Segment(tuple(range(rest)), tuple(-0.5 - 1e-6 * i for i in range(rest)), FinishReason.STOP, 4)
        s = s.extended(first, max_response_len=4 * tokens).resumed().extended(second, max_response_len=4 * tokens)
        samples.append(dataclasses.replace(s, reward=1.0, metadata={"turns": [1, 2]}))
    return group.with_samples(samples)


# --- round trips ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_group_round_trip_is_exact(group: Group) -> None:
    back = decode_group(encode_group(group))
    assert back == group
    assert _lp_bits(back) == _lp_bits(group)  # bit for bit, -0.0 included
    for a, b in zip(back.samples, group.samples, strict=True):
        assert (a.status, a.finish_reason, a.spans, a.resumed_at) == (b.status, b.finish_reason, b.spans, b.resumed_at)


def test_big_group_round_trip_and_shared_prompt_is_kept_once() -> None:
    group = _big_group()
    data = encode_group(group)
    back = decode_group(data)
    assert back == group
    assert back.multi_version and back.samples[0].resumed_at == (512,)
    # The prompt is stored once, and the decoded samples share the task's tuple again.
    assert all(s.prompt_ids is back.task.prompt_ids for s in back.samples)
    per_sample = 1024 * (4 + 8)
    assert len(data) < 8 * per_sample + 200 * 4 + 2000


def test_nan_and_signed_zero_log_probs_keep_their_bits() -> None:
    task = PromptTask(index=0, prompt_ids=(1,))
    lps = (math.nan, -0.0, -math.inf, 5e-324)
    sample = (
        Group.fresh(task, epoch=0, n_samples=1, version=0, seq=0)
        .samples[0]
        .extended(Segment((1, 2, 3, 4), lps, FinishReason.STOP, 0), max_response_len=10)
    )
    group = Group.fresh(task, epoch=0, n_samples=1, version=0, seq=0).with_samples([sample])
    back = decode_group(encode_group(group))
    assert _lp_bits(back) == _lp_bits(group)


def test_cursor_meta_and_batches_round_trip() -> None:
    cursor = Cursor(epoch=2, index=17, next_seq=99)
    assert decode_cursor(encode_cursor(cursor)) == cursor
    meta = RunMeta("run-1", "ds:abc", "tok:def", 8, extra={"config": {"lr": 1e-6, "modes": ["a", "b"]}})
    back = decode_meta(encode_meta(meta))
    assert back == meta and meta_difference(meta, back) is None
    assert meta_difference(meta, dataclasses.replace(meta, n_samples_per_prompt=4)) == ("n_samples_per_prompt", 8, 4)
    batch = Batch(step=5, groups=(_big_group(2, 8), dataclasses.replace(_big_group(1, 4), group_id="other")))
    assert decode_batch(encode_batch(batch)) == batch
    assert decode_batch_ref(encode_batch_ref(5, ["a", "b"])) == (5, ("a", "b"))


# --- failures ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_truncated_records_raise_corrupt_naming_the_key(data: st.DataObject) -> None:
    encoded = encode_group(_big_group(2, 16))
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(CorruptRecordError) as info:
        decode_group(encoded[:cut], key="groups/e0000-p000000007")
    assert info.value.key == "groups/e0000-p000000007"
    assert "groups/e0000-p000000007" in str(info.value)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_raises_corrupt(garbage: bytes) -> None:
    for decode in (decode_group, decode_batch, decode_cursor, decode_meta, decode_batch_ref):
        with pytest.raises(CorruptRecordError) as info:
            decode(garbage, key=b"some/key")
        assert info.value.key == b"some/key"


def test_wrong_schema_and_wrong_kind_are_refused() -> None:
    record = msgpack.unpackb(encode_group(_big_group(1, 4)), raw=False)
    record[0] = 99
    with pytest.raises(CorruptRecordError, match="schema version 99"):
        decode_group(msgpack.packb(record, use_bin_type=True), key="k")
    with pytest.raises(CorruptRecordError, match="'cursor' record where a 'group'"):
        decode_group(encode_cursor(Cursor()), key="k")
    # A sample array whose length is not a whole number of items.
    record[0] = 1
    record[11][0][2] = record[11][0][2][:-1]
    with pytest.raises(CorruptRecordError, match="whole number"):
        decode_group(msgpack.packb(record, use_bin_type=True), key="k")


def test_unstorable_values_raise_store_error_naming_the_group() -> None:
    group = _big_group(1, 4)
    # A token id outside int32 is refused where the sample is built, before anything could store it.
    with pytest.raises(ValueError, match=r"Sample.response_ids cannot be stored: TokenIds holds int32 token ids"):
        dataclasses.replace(group.samples[0], response_ids=(2**31, 1, 2, 3))
    not_json = dataclasses.replace(group.samples[0], metadata={"x": {1, 2}})
    with pytest.raises(StoreError, match="cannot be encoded"):
        encode_group(group.with_samples([not_json]))


def test_codec_is_fast_enough_for_the_hot_path() -> None:
    """8 samples x 1k tokens. The bounds are loose (a shared CI box); they catch a 5x regression."""
    group = _big_group()
    data = encode_group(group)

    def best(fn, runs: int = 15) -> float:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    assert best(lambda: encode_group(group)) < 500e-6
    assert best(lambda: decode_group(data)) < 1000e-6
