"""Response lengths with a long tail on a real model: the engine ends each request where the
simulated engine's length model says, as if the model had sampled EOS there.

A random-init model's samples nearly all run to the length cap, so on real compute the modes'
comparison lacks the tail that partial rollout exists for. With a `LengthTail` the engine draws
each sample's target length from `sim_model.LengthModel`, the simulated engine's distribution, and
at that position it emits the model's first EOS id instead of the drawn token (the reported
log-prob is EOS's under the row's sampling distribution). Everything else is real: the forward,
the K/V, the sampled tokens up to there, the trainer and the publishes.

The target is a function of the sample, not of the request: `(sampling_seed, original prompt,
response limit)`, the simulated engine's own key (`LengthModel.target`). A resumed request arrives
as `prompt + k generated tokens` with `max_new_tokens = limit - k`; given the run's response limit
(`limit`, the pipeline's `--rollout-max-response-len`), the original prompt is the first
`len(input) + max_new_tokens - limit` tokens, so a resumed prefix heads for the same end. Without
`limit` every request counts as a first one (its `max_new_tokens` is the limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.errors import ConfigError
from engines.seam import SamplingParams
from engines.sim_model import LengthModel

__all__ = ["LengthTail"]


@dataclass(frozen=True, slots=True)
class LengthTail:
    lengths: LengthModel
    limit: int | None = None  # the run's response limit: lets a resumed request find its original prompt

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError([f"length tail limit must be >= 1, got {self.limit}"])

    def end_at(self, seed: int, input_ids: Sequence[int], params: SamplingParams) -> int | None:
        """The absolute position at which this request draws EOS, or None (it runs to its limit)."""
        if params.ignore_eos:
            return None
        n = len(input_ids)
        limit = self.limit or params.max_new_tokens
        start = n + params.max_new_tokens - limit  # where the sample's response began
        if not 1 <= start <= n:  # not a request of this run's shape: take it as a first request
            start, limit = n, params.max_new_tokens
        target = self.lengths.target(seed, tuple(input_ids[:start]), limit)
        if target is None:
            return None
        return max(start + target - 1, n + params.min_new_tokens - 1)
