"""What the simulated engine computes instead of a network: how long work takes, and which tokens come out.

Three pure pieces, no I/O and no clock:

- `DecodeTimeModel`: engine seconds for one decode step and one prefill batch. A decode step of a
  GPU engine is memory-bound: it reads every weight once whatever the batch size, plus each running
  request's KV cache. So a step costs a flat `step_base`, a little per running request, and a little
  per context token held by the batch. A prefill is compute-bound: it costs per prompt token.
- `LengthModel`: how long each response wants to be. Reasoning RL has long-tailed lengths: most
  responses end well before the limit, and a stubborn few (~5-15% in DAPO/GRPO reports) run into
  `max_new_tokens` and are truncated. The body is a lognormal *fraction of the sample's length
  limit* (so one setting fits any `max_response_len`), plus a point mass at the limit.
- tokens and log-probs: pure functions of `(sampling_seed, absolute position)`, like the built-in
  engine's sampler, so a request resent as `prompt + the k tokens it got` continues exactly.

A sample's identity is `(seed, original prompt)`. The original prompt of a resumed request is found
by stripping, from the end, every token that equals what this model would have generated at that
position for that seed (`strip_generated`). That makes the target length a function of the sample,
not of the request: a prefix resumed after an abort runs toward the SAME target, and produces the
remaining `target - k` tokens. (If an original prompt happens to end in such a token, the stripping
eats it for the first request and for every resumption alike, so the result stays consistent.)
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import ClassVar

from core.errors import ConfigError

__all__ = [
    "EOS_ID",
    "FIRST_TEXT_ID",
    "DecodeTimeModel",
    "LengthModel",
    "SimTokenizer",
    "sim_logprob",
    "sim_token",
    "strip_generated",
]

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
FIRST_TEXT_ID = 3  # generated tokens are drawn from [FIRST_TEXT_ID, vocab_size): never a special token

_NORMAL = NormalDist()


@dataclass(frozen=True, slots=True)
class DecodeTimeModel:
    """Engine-time costs in seconds. Defaults: roughly a 7-8B dense model in bf16 on one H100-class GPU.

    - `step_base` 20 ms: the weight read of one decode step (16 GB at ~3 TB/s is ~5 ms) plus the
      scheduler, sampling and kernel-launch overhead that real servers show at small batch.
    - `step_per_request` 0.1 ms: per-request work that does grow with batch (sampling, the
      attention kernels' per-sequence cost); 256 running requests add ~25 ms, about doubling a step.
    - `step_per_context_token` 40 ns: reading one token's KV cache (~128 KB for Llama-3-8B's GQA
      at ~3 TB/s); 256 requests x 4k context add ~40 ms.
    - `prefill_per_token` 30 us: ~16 GFLOP per token at ~500 TFLOP/s effective; `prefill_base` 5 ms
      for launching a prefill batch.
    - `weight_update` 2 s: moving a new 16 GB checkpoint into the engine (NCCL broadcast or disk).
    - `weight_swap` 0 s: with staged updates, making the staged copy live between two forwards
      (a pointer swap; the copy itself overlaps decoding).
    """

    step_base: float = 0.020
    step_per_request: float = 1e-4
    step_per_context_token: float = 4e-8
    prefill_base: float = 0.005
    prefill_per_token: float = 3e-5
    weight_update: float = 2.0
    weight_swap: float = 0.0

    def __post_init__(self) -> None:
        bad = [f"{k}={v!r}" for k, v in _fields(self).items() if not (isinstance(v, (int, float)) and v >= 0)]
        if bad:
            raise ConfigError([f"time model cost {b} must be a number >= 0" for b in bad])

    def decode_time(self, running: int, context_tokens: int) -> float:
        """One decode step over `running` requests that hold `context_tokens` tokens of KV in total."""
        return self.step_base + self.step_per_request * running + self.step_per_context_token * context_tokens

    def prefill_time(self, tokens: int) -> float:
        """One prefill batch computing `tokens` prompt tokens (prompts and resumed prefixes alike)."""
        return self.prefill_base + self.prefill_per_token * tokens


@dataclass(frozen=True, slots=True)
class LengthModel:
    """Target response length as a fraction X of the sample's length limit L (`max_new_tokens` of its
    first request): with probability `truncate_frac` X is infinite (the sample runs into the limit),
    otherwise X is `lognormal(mu, sigma)` (`kind="lognormal"`) or exactly `mu` (`kind="fixed"`).
    The target is `max(1, ceil(X * L))` tokens; a target >= L finishes with `length`.

    Defaults: median X = e^-1.9 ~ 15% of the limit, sigma 0.8 (the 90th percentile is ~42%), and 10%
    truncated; the lognormal itself adds ~1% more past the limit, so ~11% finish with `length` and the
    mean response is ~0.29 L: a round's slowest sample is ~3.5x the mean, which is the bubble.

    `prompt_sigma` (default 0: every prompt alike) gives each prompt a length of its own: X becomes
    `lognormal(mu + prompt_sigma * z_prompt, sigma)`, with `z_prompt` a standard normal drawn from
    the prompt's tokens alone (no seed), so the same prompt is long or short in every epoch, as
    hard prompts are in RL. That is what a length prediction from a prompt's history can use.
    """

    kind: str = "lognormal"
    mu: float = -1.9
    sigma: float = 0.8
    truncate_frac: float = 0.10
    prompt_sigma: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in ("lognormal", "fixed"):
            problems.append(f"kind must be lognormal or fixed, got {self.kind!r}")
        if self.kind == "fixed" and not self.mu > 0:
            problems.append(f"fixed length fraction must be > 0, got {self.mu}")
        if not self.sigma >= 0:
            problems.append(f"sigma must be >= 0, got {self.sigma}")
        if not 0.0 <= self.truncate_frac <= 1.0:
            problems.append(f"truncate_frac must be in [0, 1], got {self.truncate_frac}")
        if not self.prompt_sigma >= 0:
            problems.append(f"prompt_sigma must be >= 0, got {self.prompt_sigma}")
        if problems:
            raise ConfigError(problems)

    @classmethod
    def parse(cls, spec: str, *, truncate_frac: float = 0.10, prompt_sigma: float = 0.0) -> LengthModel:
        """`lognormal:MU,SIGMA` or `fixed:FRACTION` (fractions of the length limit)."""
        kind, _, args = spec.partition(":")
        try:
            values = [float(a) for a in args.split(",")] if args else []
        except ValueError as exc:
            raise ConfigError([f"length distribution {spec!r}: arguments must be numbers"]) from exc
        if kind == "lognormal" and len(values) == 2:
            return cls("lognormal", values[0], values[1], truncate_frac, prompt_sigma)
        if kind == "fixed" and len(values) == 1:
            return cls("fixed", values[0], 0.0, truncate_frac, prompt_sigma)
        raise ConfigError([f"length distribution {spec!r} is not lognormal:MU,SIGMA or fixed:FRACTION"])

    def target(self, seed: int, prompt: Sequence[int], limit: int) -> int | None:
        """Tokens this sample generates before EOS, or None if it runs to the limit."""
        digest = hashlib.blake2b(
            f"{seed}|".encode() + array("q", prompt).tobytes(), digest_size=16, person=b"sim-length"
        ).digest()
        u_trunc = _unit(int.from_bytes(digest[:8], "little"))
        u_len = _unit(int.from_bytes(digest[8:], "little"))
        if u_trunc < self.truncate_frac:
            return None
        if self.kind == "fixed":
            x = self.mu
        else:
            x = math.exp(self.mu + self.sigma * _NORMAL.inv_cdf(min(max(u_len, 1e-12), 1 - 1e-12)))
        if self.prompt_sigma:
            x *= math.exp(self.prompt_sigma * _prompt_z(prompt))
        if x * limit >= limit:
            return None
        return max(1, math.ceil(x * limit))


def _prompt_z(prompt: Sequence[int]) -> float:
    """A standard normal draw of the prompt alone (the same in every epoch and for every seed)."""
    digest = hashlib.blake2b(array("q", prompt).tobytes(), digest_size=8, person=b"sim-prompt").digest()
    return _NORMAL.inv_cdf(min(max(_unit(int.from_bytes(digest, "little")), 1e-12), 1 - 1e-12))


def _unit(bits: int) -> float:
    return (bits >> 11) / float(1 << 53)


def _mix(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{position}".encode(), digest_size=8, person=b"sim-token").digest()
    return int.from_bytes(digest, "little")


def sim_token(seed: int, position: int, vocab_size: int) -> int:
    """The non-EOS token the simulated model emits at absolute `position` for `seed`."""
    return FIRST_TEXT_ID + _mix(seed, position) % (vocab_size - FIRST_TEXT_ID)


def sim_logprob(seed: int, position: int) -> float:
    """The log-prob reported for the token at `position`: in (-4, 0], typical of sampled tokens."""
    return -4.0 * _unit(_mix(~seed, position)) ** 2


def strip_generated(tokens: Sequence[int], seed: int, vocab_size: int) -> int:
    """Length of `tokens` once the trailing tokens this model generated for `seed` are removed
    (at least 1: a prompt is never empty)."""
    end = len(tokens)
    while end > 1 and tokens[end - 1] == sim_token(seed, end - 1, vocab_size):
        end -= 1
    return end


class SimTokenizer:
    """A tokenizer for a vocabulary of any size: id i >= 3 is one CJK-range character, so `text` stays
    one character per token and decoding is cheap. Ids 0, 1, 2 are pad, EOS, BOS."""

    _BASE = 0x4E00
    _SPAN = 20000
    _SPECIALS: ClassVar[Mapping[int, str]] = {PAD_ID: "<pad>", EOS_ID: "<eos>", BOS_ID: "<bos>"}

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = EOS_ID

    def encode(self, text: str) -> list[int]:
        return [FIRST_TEXT_ID + (ord(c) - self._BASE) % (self.vocab_size - FIRST_TEXT_ID) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i in self._SPECIALS:
                if not skip_special_tokens:
                    out.append(self._SPECIALS[i])
            else:
                out.append(chr(self._BASE + (i - FIRST_TEXT_ID) % self._SPAN))
        return "".join(out)


def _fields(obj: object) -> dict[str, object]:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}  # type: ignore[attr-defined]
