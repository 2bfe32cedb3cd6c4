"""Per-token arrays stay aligned through every continuation; spans tile the response exactly."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.columns import SamplerHeads, TokenRoutes
from core.types import FinishReason, Group, PromptTask, Sample, SampleStatus, Segment, VersionSpan

segments = st.lists(
    st.tuples(
        st.integers(0, 6),  # tokens in this segment
        st.integers(0, 3),  # version
        st.sampled_from([FinishReason.ABORT, FinishReason.STOP, FinishReason.LENGTH]),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(segments)
def test_continuations_keep_arrays_aligned_and_spans_tiling(parts):
    sample = Sample(index=0, prompt_ids=(5, 6))
    expected_versions: list[int] = []
    version = 0
    for n, bump, reason in parts:
        version += bump  # versions never go backwards along a response
        seg = Segment(tuple(range(n)), tuple(-0.1 * i for i in range(n)), reason, version)
        sample = sample.resumed().extended(seg, max_response_len=1000)
        expected_versions += [version] * n
    assert len(sample.response_ids) == len(sample.logprobs) == len(sample.loss_mask)
    assert sample.token_versions() == expected_versions
    # adjacent spans never share a version: same-version segments merge
    assert all(a.version != b.version for a, b in itertools.pairwise(sample.spans))
    assert (
        sample.status
        is {
            FinishReason.ABORT: SampleStatus.PARTIAL,
            FinishReason.STOP: SampleStatus.COMPLETED,
            FinishReason.LENGTH: SampleStatus.TRUNCATED,
        }[parts[-1][2]]
    )


def test_resumed_records_each_prefix_length_once():
    s = Sample(index=0, prompt_ids=(1,))
    assert s.resumed() is s  # nothing to continue yet
    s = s.extended(Segment((3, 4), (-1.0, -2.0), FinishReason.ABORT, 0), max_response_len=10)
    s = s.resumed().resumed()
    assert s.resumed_at == (2,)
    s = s.extended(Segment((5,), (-0.5,), FinishReason.STOP, 1), max_response_len=10)
    assert s.spans == (VersionSpan(0, 2, 0), VersionSpan(2, 3, 1))
    assert s.versions == (0, 1) and s.oldest_version == 0


def test_reaching_the_length_limit_truncates_even_on_abort():
    s = Sample(index=0, prompt_ids=(1,))
    s = s.extended(Segment((3, 4), (-1.0, -2.0), FinishReason.ABORT, 0), max_response_len=2)
    assert s.status is SampleStatus.TRUNCATED


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(response_ids=(1, 2), logprobs=(0.0,), loss_mask=(1, 1), spans=(VersionSpan(0, 2, 0),)), "out of step"),
        (
            dict(response_ids=(1, 2), logprobs=(0.0, 0.0), loss_mask=(1, 1), spans=(VersionSpan(0, 1, 0),)),
            "cover 1 of 2",
        ),
        (
            dict(
                response_ids=(1, 2),
                logprobs=(0.0, 0.0),
                loss_mask=(1, 1),
                spans=(VersionSpan(0, 1, 0), VersionSpan(0, 2, 1)),
            ),
            "gap or overlap",
        ),
    ],
)
def test_misaligned_samples_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sample(index=0, prompt_ids=(1,), **kwargs)


def test_group_staleness_uses_the_oldest_token():
    task = PromptTask(index=3, prompt_ids=(1, 2))
    g = Group.fresh(task, epoch=0, n_samples=2, version=4, seq=7)
    assert g.group_id == "e0000-p000000003" and g.oldest_version == 4  # no tokens: admission version
    a = g.samples[0].extended(Segment((9,), (-1.0,), FinishReason.ABORT, 2), max_response_len=5)
    g = g.with_samples([a, g.samples[1]])
    assert g.oldest_version == 2 and g.staleness(5) == 3


def test_with_reward_is_replace_with_every_other_field_kept():
    # `with_reward` must keep every other field, including any added to Sample later: compare it
    # against `dataclasses.replace` with every field set.
    import dataclasses

    sample = Sample(
        index=3,
        prompt_ids=(1, 2),
        response_ids=(5, 6, 7),
        logprobs=(-0.5, -0.25, -1.0),
        loss_mask=(1, 0, 1),
        spans=(VersionSpan(0, 2, 1), VersionSpan(2, 3, 2)),
        status=SampleStatus.COMPLETED,
        finish_reason=FinishReason.STOP,
        error="kept",
        resumed_at=(2,),
        metadata={"turns": 2},
        routes=TokenRoutes(bytes(range(3 * 2 * 4)), layers=2, top_k=1),
        heads=SamplerHeads(bytes(3 * 4), bytes(3 * 8), k=1),
    )
    unset = [f.name for f in dataclasses.fields(Sample) if getattr(sample, f.name) == f.default]
    assert unset == ["reward"], "set every other field, so that a dropped one shows"
    assert sample.with_reward(0.75) == dataclasses.replace(sample, reward=0.75)


@pytest.mark.parametrize(
    "ids",
    [[5, 6, 7], range(5, 8), (5, 6, 7), "numpy"],
    ids=["list", "range", "tuple", "numpy"],
)
def test_a_prompt_task_keeps_any_sequence_of_token_ids_as_a_tuple_of_ints(ids):
    if ids == "numpy":  # what a tokenizer called with return_tensors="np" gives
        import numpy as np

        ids = np.array([5, 6, 7], dtype=np.int64)
    task = PromptTask(index=0, prompt_ids=ids)
    assert type(task.prompt_ids) is tuple and task.prompt_ids == (5, 6, 7)
    assert all(type(t) is int for t in task.prompt_ids)
    assert task == PromptTask(index=0, prompt_ids=(5, 6, 7))  # as the store gives it back


@pytest.mark.parametrize("ids", ["say a x3:", b"say", [1.5, 2]], ids=["text", "bytes", "floats"])
def test_a_prompt_task_refuses_text_and_non_integer_ids_naming_the_row(ids):
    with pytest.raises(ValueError, match="PromptTask 4: prompt_ids"):
        PromptTask(index=4, prompt_ids=ids)
