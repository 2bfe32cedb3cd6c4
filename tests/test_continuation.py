"""Continuations and sampling parameters (issue 8, defect 7): `min_new_tokens` shrinks by the
prefix, a stop string split across the prefix/continuation boundary ends the sample where SGLang
would have ended the uninterrupted request, and penalties are refused for modes that continue."""

from __future__ import annotations

import anyio
import pytest

from core.clock import VersionClock
from core.errors import ConfigError
from core.types import (
    FinishReason,
    Group,
    PromptTask,
    SampleStatus,
    Segment,
    VersionSpan,
)
from pipeline import RolloutPlan, run_pipeline
from pipeline.config import load_config
from stages.continuation import (
    N_RULE,
    PENALTY_RULE,
    continuation_params,
    cut_at,
    sampling_problems,
    stop_across_boundary,
)
from stages.sglang_client import EngineFleet
from storage import GroupState, MemoryStore
from tests.conftest import PoolRig
from tests.fakes import FakeSGLang
from tests.fakes.fake_sglang import detokenize

pytestmark = pytest.mark.anyio

# The fake spells token t as chr(ord("a") + t % 26).
H, E, L, O, B = 7, 4, 11, 14, 1  # noqa: E741 - token ids named by their letters: H E L L O
PROMPT = (2, 3)
MAX_LEN = 8


# -- the rules, on plain values -------------------------------------------------------------


def test_min_new_tokens_shrinks_by_the_prefix_and_never_passes_max_new_tokens():
    params = {"temperature": 1.0, "min_new_tokens": 5}
    assert continuation_params(params, 0, 8) == {"temperature": 1.0, "min_new_tokens": 5, "max_new_tokens": 8}
    assert continuation_params(params, 3, 5)["min_new_tokens"] == 2
    assert continuation_params(params, 7, 1)["min_new_tokens"] == 0
    assert continuation_params({"min_new_tokens": 5}, 1, 2)["min_new_tokens"] == 2  # SGLang's 400 otherwise
    assert "min_new_tokens" not in continuation_params({}, 3, 5)
    assert params["min_new_tokens"] == 5  # the pool's own params are untouched


def test_n_other_than_1_is_refused_in_every_mode():
    for continues in (False, True):
        assert sampling_problems({"n": 4}, continues=continues, can_detokenize=True) == [
            f"sampling_params['n']=4: {N_RULE}"
        ]
        assert sampling_problems({"n": 1}, continues=continues, can_detokenize=True) == []


def test_penalties_are_refused_only_when_samples_continue():
    params = {"frequency_penalty": 0.5, "presence_penalty": 0.0, "repetition_penalty": 1.1}
    problems = sampling_problems(params, continues=True, can_detokenize=True)
    assert problems == [
        f"sampling_params['frequency_penalty']=0.5: {PENALTY_RULE}",
        f"sampling_params['repetition_penalty']=1.1: {PENALTY_RULE}",
    ]
    assert sampling_problems(params, continues=False, can_detokenize=False) == []
    neutral = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
    assert sampling_problems(neutral, continues=True, can_detokenize=False) == []


def test_stop_strings_with_continuations_need_a_detokenizer():
    [problem] = sampling_problems({"stop": ["</answer>"]}, continues=True, can_detokenize=False)
    assert "['</answer>']" in problem and "detokenize" in problem
    assert sampling_problems({"stop": "</answer>"}, continues=True, can_detokenize=True) == []
    assert sampling_problems({"stop": ["</answer>"]}, continues=False, can_detokenize=False) == []


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--partial-rollout", "--rollout-frequency-penalty", "0.5"], "--rollout-frequency-penalty=0.5"),
        (["--rollout-mode", "async", "--rollout-presence-penalty", "-0.2"], "--rollout-presence-penalty=-0.2"),
        (["--rollout-mode", "async", "--rollout-repetition-penalty", "1.2"], "--rollout-repetition-penalty=1.2"),
    ],
)
def test_config_refuses_penalties_with_partial_or_async_naming_the_rule(argv, flag):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    [problem] = info.value.problems
    assert problem.startswith(flag) and PENALTY_RULE in problem


def test_config_allows_penalties_in_plain_sync_and_min_new_tokens_anywhere():
    config = load_config(["--rollout-frequency-penalty", "0.5", "--rollout-repetition-penalty", "1.2"])
    assert (config.rollout.frequency_penalty, config.rollout.repetition_penalty) == (0.5, 1.2)
    assert load_config(["--rollout-mode", "async", "--rollout-min-new-tokens", "4"]).rollout.min_new_tokens == 4


async def test_run_pipeline_refuses_penalties_before_starting_anything(tmp_path):
    plan = RolloutPlan(mode="async", batch_size=1, n_samples=2, num_steps=1, sampling_params={"presence_penalty": 0.3})
    with pytest.raises(ConfigError, match="presence_penalty"):
        await run_pipeline(
            plan,
            engines=None,
            store=None,
            trainer=None,
            dataset=[],
            reward_fn=None,  # type: ignore[arg-type]
            filter_fn=None,
            weights_dir=tmp_path,
            metrics=None,  # type: ignore[arg-type]
        )


def test_a_stop_string_across_the_boundary_is_found_where_it_completes():
    # "hel" + "lo": "ll" straddles the boundary and completes with the first new token.
    assert stop_across_boundary((H, E, L), (L, O, B), ["ll"], detokenize) == (1, "ll")
    # Wholly inside the continuation: the engine's to find, not the boundary's.
    assert stop_across_boundary((H, E, L), (O, L, L), ["ll"], detokenize) is None
    # Wholly inside the prefix (held off by min_new_tokens then): not a boundary match either.
    assert stop_across_boundary((L, L, E), (O, B), ["ll"], detokenize) is None
    # A longer stop string reaching back two tokens, completing two tokens in.
    assert stop_across_boundary((B, H, E), (L, L, O), ["hell"], detokenize) == (2, "hell")
    # min_new_tokens counts the whole response: no stop before 5 tokens, then the first check
    # finds "ll" in the tail (SGLang looks for a stop string in the last tokens, not at the end).
    assert stop_across_boundary((H, E, L), (L, O, B), ["ll"], detokenize, min_new_tokens=4) == (1, "ll")
    assert stop_across_boundary((H, E, L), (L, O, B), ["ll"], detokenize, min_new_tokens=5) == (2, "ll")


def test_cut_at_keeps_the_first_tokens_spans_and_ends_with_stop():
    segment = Segment(
        (1, 2, 3, 4), (-1.0,) * 4, FinishReason.LENGTH, 2, spans=(VersionSpan(0, 1, 1), VersionSpan(1, 4, 2))
    )
    cut = cut_at(segment, 1)
    assert (cut.token_ids, cut.logprobs, cut.finish_reason) == ((1,), (-1.0,), FinishReason.STOP)
    assert cut.spans == (VersionSpan(0, 1, 1),) and cut.version == 1
    assert cut_at(segment, 3).spans == (VersionSpan(0, 1, 1), VersionSpan(1, 3, 2))


# -- the pool, over HTTP -------------------------------------------------------------------------


def _scripted(script):
    return lambda context, seed: script[len(context) - len(PROMPT)]


async def _continue_one_prefix(fake: FakeSGLang, prefix: tuple[int, ...], params: dict, detok=None) -> Group:
    """Store one partial group whose samples hold `prefix`, and let the pool continue it."""
    store, clock = MemoryStore(), VersionClock()
    task = PromptTask(index=0, prompt_ids=PROMPT)
    group = Group.fresh(task, epoch=0, n_samples=1, version=0, seq=0)
    seg = Segment(prefix, (-1.0,) * len(prefix), FinishReason.ABORT, 0)
    group = group.with_samples([s.extended(seg, max_response_len=MAX_LEN) for s in group.samples])
    store.admit([group], store.cursor())
    store.put_partial(group)
    async with EngineFleet([fake.url], concurrency=4) as fleet, anyio.create_task_group() as tg:
        rig = PoolRig(
            fleet,
            store,
            clock,
            tasks=[task],
            n_samples=1,
            max_len=MAX_LEN,
            slots=4,
            sampling_params=params,
            detokenize=detok,
        )
        await rig.start(tg)
        with anyio.fail_after(10):
            rig.admission.grant(1)
            await rig.admission.wait_settled()
        tg.cancel_scope.cancel()
    [ready] = store.groups(GroupState.READY)
    return ready


async def test_a_stop_string_split_across_the_boundary_ends_the_sample():
    script = [H, E, L, L, O, B, B, B]
    async with FakeSGLang(weight_version="0", token_fn=_scripted(script)) as fake:
        group = await _continue_one_prefix(fake, (H, E, L), {"stop": ["ll"]}, detok=detokenize)
        served = fake.finished[-1]
    [sample] = group.samples
    # The engine, seeing "lobbb" alone, ran on to the length limit; the pool ends where "hell" matched.
    assert served.output_ids == [L, O, B, B, B]
    assert sample.response_ids == (H, E, L, L)
    assert sample.status is SampleStatus.COMPLETED and sample.finish_reason is FinishReason.STOP
    assert len(sample.logprobs) == 4 and sample.spans == (VersionSpan(0, 4, 0),)


async def test_a_continuation_sends_min_new_tokens_less_the_prefix():
    async with FakeSGLang(weight_version="0", token_fn=_scripted([H, E, L, L, O, B, B, B]), eos_token_id=B) as fake:
        group = await _continue_one_prefix(fake, (H, E, L), {"min_new_tokens": 5})
        sent = fake.generate_payloads[-1]["sampling_params"]
    assert (sent["min_new_tokens"], sent["max_new_tokens"]) == (2, 5)
    # The EOS at response token 6 ends it (5 tokens were due, 6 were generated): as uninterrupted.
    [sample] = group.samples
    assert sample.response_ids == (H, E, L, L, O, B) and sample.status is SampleStatus.COMPLETED
