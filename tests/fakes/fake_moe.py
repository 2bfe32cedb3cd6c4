"""What the fake SGLang answers for R3 (`return_routed_experts`) and SC (`top_logprobs_num`).

Deterministic functions of (weight version, position, token, ...), so an uninterrupted request
and an aborted + continued one can be compared byte for byte, with one twist that real engines
have too: a *re-prefill* routes the positions it recomputes differently from the forward that
first read them (another batch shape, other numerics; the fake adds the prefill's length to the
hash). The row of the last input position is the one that samples the first new token, and is
the same in a prefill as in a decode step. A client that takes a continuation's prefix rows
instead of keeping its own therefore differs from the uninterrupted request, as it would on a
real MoE engine after a publish.

Rows follow SGLang's layout: int32 `[rows, layers, top_k]`, base64, one row per forward
position in `[routed_experts_start_len, prompt + completion - 1)`.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MoeShape", "RouteLog", "sampler_head"]


@dataclass(frozen=True, slots=True)
class MoeShape:
    layers: int = 3
    top_k: int = 2
    experts: int = 8
    vocab: int = 512


def _route_row(shape: MoeShape, version: str, position: int, token: int, drift: int) -> bytes:
    out: list[int] = []
    for layer in range(shape.layers):
        h = zlib.crc32(f"r3:{version}:{position}:{token}:{layer}:{drift}".encode())
        out.extend((h + j) % shape.experts for j in range(shape.top_k))  # top_k distinct experts
    return struct.pack(f"<{len(out)}i", *out)


@dataclass
class RouteLog:
    """The routes one request's forwards made: its prefill's rows, then one row per decode step."""

    shape: MoeShape
    prefill: list[bytes] = field(default_factory=list)
    decode: list[bytes] = field(default_factory=list)

    def prefilled(self, input_ids: Sequence[int], version: str) -> None:
        n = len(input_ids)
        # Positions before the last are recomputed context: their rows drift with the prefill's length.
        self.prefill = [_route_row(self.shape, version, p, input_ids[p], n) for p in range(n - 1)]

    def stepped(self, context: Sequence[int], version: str) -> None:
        """A forward that read the last token of `context` (and sampled the next one)."""
        p = len(context) - 1
        self.decode.append(_route_row(self.shape, version, p, context[p], 0))

    def answer(self, start_len: int, completion: int) -> str:
        """Base64 of the rows `[start_len, prefill + completion)`: as SGLang's `routed_experts`."""
        rows = (self.prefill + self.decode)[start_len : len(self.prefill) + completion]
        return base64.b64encode(b"".join(rows)).decode()


def sampler_head(shape: MoeShape, version: str, context: Sequence[int], seed: int, k: int) -> list[list[Any]]:
    """The sampler's top-k at the step that read `context`: `[logprob, token_id, None]`, best first."""
    out: list[list[Any]] = []
    for j in range(k):
        h = zlib.crc32(f"sc:{version}:{seed}:{len(context)}:{context[-1]}:{j}".encode())
        out.append([-(j + (h % 1000) / 1000.0), 1 + h % (shape.vocab - 1), None])
    return out
