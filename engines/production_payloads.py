"""Production-sized `/generate` answers for the instant engine, encoded once and cut per request.

A load generator must not be the bottleneck of what it loads, and a production answer is large: a
30B-A3B model's routes are 48 layers x top-8 int32 a token, 2,048 bytes of base64, so a 28k-token
answer carries 57 MB of routes. Nothing here encodes per request. Every per-token field is one JSON
(or base64) text over the longest answer, encoded when the engine starts, plus where each token's
item ends; an answer of n tokens is the first n items of each, sent as slices of those texts.

- `output_token_logprobs` (`[logprob, token id, null]` a token) and `output_ids`: `JsonPrefix`.
- `output_top_logprobs` (SC, `top_logprobs_num` = k): k candidates a token, one `JsonPrefix` per k
  asked for, built on the first request that asks.
- `routed_experts` (R3, `return_routed_experts`): base64 of little-endian int32 rows
  `[positions, layers, top_k]`, distinct experts per layer as a router picks them, for positions
  `[routed_experts_start_len, input + output - 1)` (`reference/sglang-protocol.md` 1.3). base64
  turns every 3 bytes into 4 characters, so a cut after a whole number of 3-byte groups is valid
  base64 and pieces cut so join into valid base64: `RoutesBase64`.
- `meta_info.weight_versions`: one span over the answer, per request (a few bytes).
- lengths: the simulated engine's long tail (`sim_model.LengthModel`, a fraction of the length
  limit), one target per sample (its `sampling_seed`), cut by `max_new_tokens` and `--max-tokens`.
"""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from core.errors import ConfigError
from engines.sim_model import LengthModel

__all__ = ["JsonPrefix", "ProductionAnswers", "RouteShape", "RoutesBase64"]

EOS_ID = 2
_ROUTE_PATTERNS = 509  # distinct route rows (prime: rows do not repeat with a token period)


@dataclass(frozen=True, slots=True)
class RouteShape:
    """An MoE model's routes: `layers` MoE layers, `top_k` experts a token of `experts` each."""

    layers: int
    top_k: int
    experts: int

    @classmethod
    def parse(cls, spec: str) -> RouteShape:
        """`LAYERSxTOPK/EXPERTS`, e.g. `48x8/128` (Qwen3-30B-A3B) or `58x8/256` (DeepSeek-V3)."""
        try:
            head, experts = spec.split("/")
            layers, top_k = head.lower().split("x")
            shape = cls(int(layers), int(top_k), int(experts))
        except ValueError:
            raise ConfigError([f"route shape {spec!r} is not LAYERSxTOPK/EXPERTS, e.g. 48x8/128"]) from None
        if not (shape.layers >= 1 and 1 <= shape.top_k <= shape.experts):
            raise ConfigError([f"route shape {spec!r}: needs layers >= 1 and 1 <= top_k <= experts"])
        return shape

    @property
    def row_bytes(self) -> int:
        """One position's routes as SGLang sends them (int32)."""
        return self.layers * self.top_k * 4


class JsonPrefix:
    """A JSON array of items encoded once; its first n items are one slice (and `]`)."""

    def __init__(self, items: Sequence[bytes]) -> None:
        self.body = b"[" + b",".join(items) + b"]"
        ends = array("q", [1])  # ends[i]: where item i ends (before its comma); ends[0] for no item
        at = 1
        for i, item in enumerate(items):
            at += len(item) + (i > 0)
            ends.append(at)
        self._ends = ends
        self._view = memoryview(self.body)

    def __len__(self) -> int:
        return len(self._ends) - 1

    def first(self, n: int, last: bytes | None = None) -> list[memoryview | bytes]:
        """The pieces of a JSON array of the first n items, or of the first n - 1 and `last`."""
        if n > len(self):
            raise ValueError(f"{n} items asked of an array encoded with {len(self)}")
        if last is None or n == 0:
            return [self._view[: self._ends[n]], b"]"]
        return [self._view[: self._ends[n - 1]], b"," if n > 1 else b"", last, b"]"]


class RoutesBase64:
    """base64 of int32 route rows, any number of rows, cut from one encoding of `block` rows."""

    def __init__(self, shape: RouteShape, max_rows: int, seed: int = 0) -> None:
        self.shape = shape
        # Rows in a multiple of 3: then the block's bytes are whole 3-byte groups, so a whole
        # block, or any multiple of 3 rows of it, is base64 that joins with what follows.
        self.block = 3 * math.ceil(max(max_rows, 3) / 3)
        rng = np.random.default_rng(seed)
        # Distinct experts per layer (a router's top-k), highest first; the highest expert id
        # among them so that a packer sees the model's whole range.
        scores = rng.random((_ROUTE_PATTERNS, shape.layers, shape.experts))
        patterns = np.argsort(-scores, axis=-1)[..., : shape.top_k].astype("<i4")
        if shape.experts - 1 not in patterns[0, 0]:
            patterns[0, 0, 0] = shape.experts - 1
        rows = patterns[np.arange(self.block) % _ROUTE_PATTERNS]
        self._raw = rows.tobytes()
        self._b64 = memoryview(base64.b64encode(self._raw))

    def rows(self, n: int) -> list[memoryview | bytes]:
        """Pieces of the base64 of `n` rows (blocks, then whole 3-row groups of a block, then the
        last one or two rows encoded now: a few KB)."""
        pieces: list[memoryview | bytes] = []
        row = self.shape.row_bytes
        while n >= self.block:
            pieces.append(self._b64)
            n -= self.block
        whole = n - n % 3
        if whole:
            pieces.append(self._b64[: whole * row // 3 * 4])
        if n % 3:
            pieces.append(base64.b64encode(self._raw[whole * row : n * row]))
        return pieces


class ProductionAnswers:
    """Everything of a production answer that is encoded once, for answers up to `max_tokens`."""

    def __init__(
        self,
        *,
        max_tokens: int,
        lengths: LengthModel | None,
        length_limit: int | None,
        routes: RouteShape | None,
        max_prompt: int,
        seed: int = 0,
    ) -> None:
        self.max_tokens = max_tokens
        self.lengths = lengths
        self.length_limit = length_limit or max_tokens
        rng = np.random.default_rng(seed)
        ids = (1000 + rng.integers(0, 50_000, max_tokens)).tolist()
        # Full-precision floats, as SGLang's float32 log-probs print through JSON.
        lps = (-rng.random(max_tokens) * 3.0).tolist()
        self._ids, self._lps = ids, lps
        self.logprobs = JsonPrefix([orjson.dumps([lp, t, None]) for lp, t in zip(lps, ids, strict=True)])
        self.output_ids = JsonPrefix([b"%d" % t for t in ids])
        self.eos_logprob = orjson.dumps([-0.01, EOS_ID, None])
        self.routes = None if routes is None else RoutesBase64(routes, max_rows=max_tokens + max_prompt, seed=seed)
        self._heads: dict[int, JsonPrefix] = {}

    def tokens_for(self, max_new_tokens: int, sampling_seed: int) -> tuple[int, bool]:
        """(tokens, stopped): the sample's long-tailed target length (its `sampling_seed` names it),
        cut by `max_new_tokens` and `--max-tokens`; stopped when it ends before `max_new_tokens`."""
        cap = min(max_new_tokens, self.max_tokens)
        if self.lengths is None:
            return cap, False
        target = self.lengths.target(sampling_seed, (), self.length_limit)
        if target is None or target >= cap:
            return cap, cap < max_new_tokens  # cut by --max-tokens: an EOS there, as a real model's would be
        return target, True

    def heads(self, k: int) -> JsonPrefix:
        """`output_top_logprobs` items of k candidates a token (the sampled token first)."""
        found = self._heads.get(k)
        if found is None:
            rng = np.random.default_rng(k)
            others = (1000 + rng.integers(0, 50_000, (self.max_tokens, k))).tolist()
            items = []
            for t in range(self.max_tokens):
                cands = [[self._lps[t], self._ids[t], None]]
                cands += [[self._lps[t] - 0.5 * j, others[t][j], None] for j in range(1, k)]
                items.append(orjson.dumps(cands))
            found = self._heads[k] = JsonPrefix(items)
        return found
