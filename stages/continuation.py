"""What a continued request needs that the engine cannot know (issue 8, defect 7).

A continuation resends `prompt + response_so_far` as `input_ids`, so to the engine the prefix is
prompt. Three sampling parameters then mean something else than for the uninterrupted request:

- `min_new_tokens` counts new tokens only: resent verbatim it would hold off stops for that many
  tokens again. It is reduced by the tokens already generated (`continuation_params`).
- Stop strings are looked for in the output alone (SGLang decodes only `output_ids`), so one that
  starts in the prefix and ends in the continuation is missed. The generator pool checks the
  boundary with a detokenizer (`stop_across_boundary`) and ends the sample where SGLang would have
  for the uninterrupted request. The pool, not the engine client, owns the check: it is the one
  place that holds both the prefix and the continuation, and the detokenizer is passed to it.
- Frequency, presence and repetition penalties count tokens in the output alone, so a
  continuation would penalise as if the prefix had never been generated. There is no faithful
  correction over HTTP; with partial rollout or async (the modes that continue) they are refused
  (`sampling_problems`).

`sampling_problems` also refuses `n` other than 1 for every run: it is not a continuation rule,
but the same check at the same place (before anything starts) is where a user looks for it.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core.types import FinishReason, Segment, VersionSpan

__all__ = [
    "N_RULE",
    "PENALTY_RULE",
    "Detokenize",
    "continuation_params",
    "cut_at",
    "penalties_in",
    "sampling_problems",
    "sampling_seed",
    "stop_across_boundary",
    "stop_strings",
]

# token ids -> text, as the engine's tokenizer decodes them (e.g. a Hugging Face tokenizer's decode)
Detokenize = Callable[[Sequence[int]], str]

# Each penalty and its neutral value (sampling_params.py in SGLang).
_NEUTRAL_PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}

PENALTY_RULE = (
    "penalties cannot be combined with partial rollout or async rollout: a continued request "
    "resends the prefix as prompt, and the engine counts penalised tokens in the output alone, so "
    "the continuation would not see the prefix's counts"
)

N_RULE = (
    "must be 1: each sample is a request of its own (the group's size is the plan's n_samples), and "
    "SGLang answers n > 1 with a list of n answers, which the pipeline does not take"
)

# Tokens of slack past a stop string's length in characters, for tokens that decode to nothing
# on their own (a partial UTF-8 sequence, a special token skipped by the decoder).
_WINDOW_SLACK = 8


def penalties_in(params: Mapping[str, Any]) -> dict[str, Any]:
    """The penalties `params` sets to something other than their neutral value."""
    return {
        name: params[name]
        for name, neutral in _NEUTRAL_PENALTIES.items()
        if params.get(name) is not None and params[name] != neutral
    }


def stop_strings(params: Mapping[str, Any]) -> tuple[str, ...]:
    """The `stop` parameter as a tuple of non-empty strings (SGLang takes a str or a list)."""
    raw = params.get("stop")
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else list(raw)
    return tuple(s for s in stops if s)


def sampling_problems(params: Mapping[str, Any], *, continues: bool, can_detokenize: bool) -> list[str]:
    """What is wrong with `params`: for any run, `n` other than 1; for a run whose samples are
    continued (`continues`: partial rollout or async), what a continuation would apply wrongly.
    Each problem names the value and the rule."""
    problems = []
    if (n := params.get("n", 1)) != 1:
        problems.append(f"sampling_params['n']={n!r}: {N_RULE}")
    if not continues:
        return problems
    problems += [f"sampling_params[{name!r}]={value!r}: {PENALTY_RULE}" for name, value in penalties_in(params).items()]
    stops = stop_strings(params)
    if stops and not can_detokenize:
        problems.append(
            f"sampling_params['stop']={list(stops)!r} with partial or async rollout needs a detokenizer "
            "(run_pipeline(detokenize=...)): a stop string split across a continued prefix and its "
            "continuation is invisible to the engine, and only the pool can check the boundary"
        )
    return problems


def sampling_seed(run_seed: int, group_id: str, sample_index: int) -> int:
    """The `sampling_seed` of every request for one sample: stable across its continuations (and
    across restarts of the run), so an engine whose draws are a function of (seed, position), as
    the built-in one's are, continues a prefix exactly as the uninterrupted request would have."""
    return zlib.crc32(f"{run_seed}:{group_id}:{sample_index}".encode())


def continuation_params(params: Mapping[str, Any], generated: int, max_new_tokens: int) -> dict[str, Any]:
    """`params` for a request that continues a response already `generated` tokens long and may
    add `max_new_tokens` more. `min_new_tokens` shrinks by what was generated, and never exceeds
    `max_new_tokens` (SGLang answers 400 to that)."""
    out = dict(params, max_new_tokens=max_new_tokens)
    min_new = out.get("min_new_tokens")
    if min_new:
        out["min_new_tokens"] = min(max(0, int(min_new) - generated), max_new_tokens)
    return out


def stop_across_boundary(
    prefix: Sequence[int],
    new: Sequence[int],
    stops: Sequence[str],
    detokenize: Detokenize,
    *,
    min_new_tokens: int = 0,
) -> tuple[int, str] | None:
    """Where the uninterrupted request would have stopped inside `new`: `(k, stop)` when a stop
    string first appears in the decoded response after `k` new tokens and reaches back into the
    prefix, or None.

    Only matches that straddle the boundary count: one wholly inside `new` the engine saw itself,
    and one wholly inside the prefix would have ended the prefix. `min_new_tokens` is the original
    request's: SGLang looks for no stop before that many response tokens.
    """
    if not prefix or not new or not stops:
        return None
    window = max(len(s) for s in stops) + _WINDOW_SLACK
    tail = list(prefix[-window:])
    head_len = len(detokenize(tail))
    for k in range(1, min(len(new), window) + 1):
        if len(prefix) + k < min_new_tokens:
            continue
        text = detokenize(tail + list(new[:k]))
        for stop in stops:
            # The first occurrence that ends past the prefix; it must also start inside it.
            at = text.find(stop, max(0, head_len - len(stop) + 1))
            if 0 <= at < head_len:
                return k, stop
    return None


def cut_at(segment: Segment, k: int) -> Segment:
    """The segment's first `k` tokens, ended by a stop string (what SGLang would have returned)."""
    spans = tuple(VersionSpan(s.start, min(s.end, k), s.version) for s in segment.spans if s.start < k)
    version = spans[-1].version if spans else segment.version
    return dataclasses.replace(
        segment,
        token_ids=segment.token_ids[:k],
        logprobs=segment.logprobs[:k],
        routes=None if segment.routes is None else segment.routes.rows(0, k),
        heads=None if segment.heads is None else segment.heads.rows(0, k),
        finish_reason=FinishReason.STOP,
        version=version,
        spans=spans,
    )
