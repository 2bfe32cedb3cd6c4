"""Per-token columns behave as the tuples they replace, stay read-only, and cross bytes exactly."""

from __future__ import annotations

import copy
import gc
import pickle
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.columns import LogProbs, LossMask, TokenIds
from core.types import FinishReason, Sample, Segment, VersionSpan
from trainers.columns import column_tensor

int32s = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40)
floats = st.lists(st.floats(allow_nan=False), max_size=40)


@given(int32s, int32s)
def test_token_ids_compare_hash_and_concatenate_as_tuples(a: list[int], b: list[int]) -> None:
    x, y = TokenIds(a), TokenIds(b)
    assert x == tuple(a) and tuple(a) == x and not (x != tuple(a))
    assert (x == tuple(b)) == (a == b) and (x != y) == (a != b)
    assert hash(x) == hash(tuple(a))
    for joined in (x + y, x + tuple(b), tuple(a) + y):
        assert type(joined) is TokenIds and joined == tuple(a + b)
    assert x[1:3] == tuple(a[1:3]) and type(x[1:3]) is TokenIds
    assert list(x) == a and x.tolist() == a and len(x) == len(a)
    if a:
        assert x[0] == a[0] and x[-1] == a[-1] and a[0] in x


@given(floats)
def test_log_probs_round_trip_bit_for_bit(values: list[float]) -> None:
    column = LogProbs(values)
    back = LogProbs.from_bytes(column.to_bytes())
    assert back == tuple(values)
    assert struct.pack(f"<{len(values)}d", *values) == column.to_bytes()
    assert pickle.loads(pickle.dumps(column)) == column


def test_a_column_is_read_only_and_plus_equals_rebinds() -> None:
    ids = TokenIds((1, 2, 3))
    for change in (
        lambda: ids.__setitem__(0, 9),
        lambda: ids.__delitem__(0),
        lambda: ids.append(4),
        lambda: ids.extend((4,)),
        lambda: ids.pop(),
        lambda: ids.frombytes(b"\0\0\0\0"),
        lambda: ids.reverse(),
    ):
        with pytest.raises(TypeError, match="TokenIds is read-only"):
            change()
    same = ids
    same += (4,)
    assert ids == (1, 2, 3) and same == (1, 2, 3, 4)  # as for a tuple: a new object, the old one unchanged
    assert copy.copy(ids) is ids and copy.deepcopy(ids) is ids


def test_bad_values_are_refused_with_the_rule() -> None:
    with pytest.raises(OverflowError, match="TokenIds holds int32 token ids"):
        TokenIds((2**31,))
    with pytest.raises(TypeError):
        TokenIds((1.5,))
    with pytest.raises(TypeError, match="from_bytes"):
        TokenIds(b"\0\0\0\0")
    with pytest.raises(ValueError, match="7 bytes is not a whole number of 4-byte items"):
        TokenIds.from_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match=r"Sample.response_ids cannot be stored"):
        Sample(index=0, prompt_ids=(1,), response_ids=(2**40,), logprobs=(0.0,), loss_mask=(1,))


def test_samples_store_any_sequence_as_columns_and_equal_their_tuple_twins() -> None:
    spans = (VersionSpan(0, 2, 3),)
    built = Sample(index=0, prompt_ids=(1,), response_ids=[5, 6], logprobs=(-0.5, -1.0), loss_mask=(1, 0), spans=spans)
    assert (type(built.response_ids), type(built.logprobs), type(built.loss_mask)) == (TokenIds, LogProbs, LossMask)
    twin = Sample(
        index=0,
        prompt_ids=(1,),
        response_ids=TokenIds((5, 6)),
        logprobs=LogProbs((-0.5, -1.0)),
        loss_mask=LossMask((1, 0)),
        spans=spans,
    )
    assert built == twin
    grown = built.extended(Segment((7,), (-2.0,), FinishReason.STOP, 4), max_response_len=10)
    assert grown.response_ids == (5, 6, 7) and grown.logprobs == (-0.5, -1.0, -2.0) and grown.loss_mask == (1, 0, 1)
    tool = grown.with_environment([8, 9], version=4)
    assert (
        tool.response_ids == (5, 6, 7, 8, 9) and tool.loss_mask == (1, 0, 1, 0, 0) and tool.logprobs[-2:] == (0.0, 0.0)
    )
    assert built.response_ids == (5, 6)  # the sample it grew from is unchanged


def test_a_column_is_not_tracked_by_the_collector() -> None:
    """What the columns are for: a 1k-token sample adds no object per token for gc to walk (a
    tuple's 1k ints and floats are each visited at every collection that sees the sample)."""
    assert len(gc.get_referents(tuple(range(1024)))) == 1024
    assert len(gc.get_referents(TokenIds(range(1024)))) <= 1  # at most its type
    assert len(gc.get_referents(LogProbs([0.5] * 1024))) <= 1


def test_column_tensor_copies_and_converts() -> None:
    ids = TokenIds((3, 1, 2))
    t = column_tensor(ids, torch.long)
    assert t.dtype == torch.long and t.tolist() == [3, 1, 2]
    t[0] = 99
    assert ids == (3, 1, 2)  # the tensor is a copy: the sample stays as it was
    assert column_tensor(LossMask((1, 0, 1)), torch.bool).tolist() == [True, False, True]
    assert column_tensor(LogProbs((-0.25,)), torch.float32).tolist() == [-0.25]
    assert column_tensor(TokenIds(), torch.long).shape == (0,)
