"""R3 routes and SC sampler heads on SGLang's wire: what to ask for, and the answer cut to the new tokens.

R3 (`return_routed_experts`, `reference/sglang-protocol.md` 1.1 and 1.3): `meta_info.routed_experts`
is base64 of little-endian int32 `[rows, layers, top_k]`, one row per *forward position* in
`[start_len, prompt_len + completion_len - 1)`: position p's row is the routing of the forward
that read token p and sampled token p + 1, so the last output token (never read) has none. The
row of response token t is therefore the row of position `prompt_len - 1 + t`.

A continuation resends prompt + prefix as its prompt. Its answer's rows for the prefix come from
that request's re-prefill, under whatever weights serve now and another batch's numerics: not
the forward that sampled those tokens. Only the rows of the new tokens are taken, positions
`[input_len - 1, input_len - 1 + completion)`; the prefix keeps the rows it came with. The
request asks for just those (`routed_experts_start_len = input_len - 1`); a server that ignores
that field (some builds do) answers from 0 without saying so; the element count alone cannot
always tell which (`rows x layers` fits both ways), so until the pool knows the model's layer
count its requests ask for every row from 0, which reads the same either way.

SC (`top_logprobs_num`): `meta_info.output_top_logprobs`, one list per output token of
`[logprob, token_id, text|null]`, aligned with `output_token_logprobs`.

Not kept (yet): the rows of the prompt's own positions `[0, prompt_len - 1)`. A trainer replaying
routes over the whole sequence needs them, but a sample continued under newer weights had its
prompt re-prefilled by each request, so which forward's prompt rows belong to it is a choice the
trainer's side of R3 has to make (the first request's, most likely); the first requests of a pool
already receive them (`all_rows`), so keeping them is a change here, not on the wire.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.columns import SamplerHeads, TokenRoutes
from core.errors import EngineError

__all__ = ["TokenPayloads", "decode_routed_experts", "parse_top_logprobs", "routes_for_new_tokens"]


@dataclass(frozen=True, slots=True)
class TokenPayloads:
    """Which per-token payloads the requests ask for (both off: the plain request)."""

    # --use-rollout-routing-replay: ask for routed experts; the model's experts per token per
    # layer (--moe-router-topk) splits each row into layers.
    routed_experts_top_k: int | None = None
    # --use-score-centering --score-centering-top-k: the sampler's top-k per token.
    sampler_top_k: int | None = None
    # The model's experts per MoE layer, where the launcher knows it: the routes are stored in the
    # smallest type that holds that many ids (`core.columns.route_code`; 128 experts: one byte an
    # id). None: the smallest type that holds the largest id of each answer, widened as needed.
    routed_experts_count: int | None = None

    def __post_init__(self) -> None:
        for name in ("routed_experts_top_k", "routed_experts_count", "sampler_top_k"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"TokenPayloads {name}={value!r}: must be an integer >= 1 or None")

    @property
    def any(self) -> bool:
        return self.routed_experts_top_k is not None or self.sampler_top_k is not None

    def request_fields(self, input_len: int, *, all_rows: bool = False) -> dict[str, Any]:
        """The `/generate` fields that ask for them, for a request whose `input_ids` has `input_len`
        tokens: the routes of the new tokens only, or with `all_rows` every position's (whose row
        count does not depend on whether the server honours `routed_experts_start_len`, so the
        model's layer count can be read off it)."""
        fields: dict[str, Any] = {}
        if self.routed_experts_top_k is not None:
            fields["return_routed_experts"] = True
            fields["routed_experts_start_len"] = 0 if all_rows else max(0, input_len - 1)
        if self.sampler_top_k is not None:
            fields["top_logprobs_num"] = self.sampler_top_k
        return fields


def decode_routed_experts(raw: object, url: str) -> bytes:
    """`meta_info.routed_experts` (base64 of little-endian int32) as its bytes."""
    if not isinstance(raw, str):
        raise EngineError(url, f"meta_info.routed_experts is not a base64 string: {type(raw).__name__}")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineError(url, f"meta_info.routed_experts is not valid base64: {exc}") from exc
    if len(data) % 4:
        raise EngineError(url, f"meta_info.routed_experts holds {len(data)} bytes, not whole int32 values")
    return data


def routes_for_new_tokens(
    data: bytes,
    *,
    echoed_start: int | None,
    sent_start: int,
    input_len: int,
    completion: int,
    top_k: int,
    layers: int | None,
    url: str,
    experts: int | None = None,
) -> TokenRoutes | None:
    """The rows of the `completion` new tokens from an answer's routed experts, packed
    (`TokenRoutes.packed`: one byte an id for up to 255 `experts`; the int32 rows are never kept).

    The rows start at `echoed_start` (`meta_info.routed_experts_start_len`) when the engine says
    so, else at `sent_start` or, for a server that ignored it, 0: whichever the element count
    fits (checked against `layers` once a sample has rows). None for an answer without new tokens.
    """
    if completion == 0:
        return None
    values = len(data) // 4
    end = input_len - 1 + completion  # one past the last row: the final token was never read
    candidates = [echoed_start] if echoed_start is not None else list(dict.fromkeys((sent_start, 0)))
    for start in candidates:
        n_rows = end - start
        if start < 0 or start > input_len - 1 or n_rows <= 0 or values % (n_rows * top_k):
            continue
        found = values // (n_rows * top_k)
        if found < 1 or (layers is not None and found != layers):
            continue
        row = found * top_k * 4
        first = input_len - 1 - start
        rows = memoryview(data)[first * row : (first + completion) * row]  # no copy before the packing one
        try:
            return TokenRoutes.packed(rows, layers=found, top_k=top_k, experts=experts)
        except ValueError as exc:
            raise EngineError(url, f"meta_info.routed_experts: {exc}") from exc
    raise EngineError(
        url,
        f"meta_info.routed_experts holds {values} int32 values, which is no whole number of rows of "
        f"{'?' if layers is None else layers} layers x top-{top_k} for positions "
        f"[start, {end}) with start in {candidates} ({input_len} input + {completion} output tokens); "
        "is --moe-router-topk the model's experts per token?",
    )


def parse_top_logprobs(raw: object, n_tokens: int, url: str) -> SamplerHeads | None:
    """`meta_info.output_top_logprobs` as sampler heads: one row of k per output token."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != n_tokens:
        got = f"{len(raw)} entries" if isinstance(raw, list) else type(raw).__name__
        raise EngineError(
            url, f"meta_info.output_top_logprobs must hold one list per output token ({n_tokens}), got {got}"
        )
    if not raw:
        return None
    k = len(raw[0]) if isinstance(raw[0], list) else 0
    ids: list[int] = []
    logprobs: list[float] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, list) or len(entry) != k or k == 0:
            raise EngineError(url, f"meta_info.output_top_logprobs[{i}] is not a list of {k or 'k >= 1'} candidates")
        for item in entry:
            if not isinstance(item, (list, tuple)) or len(item) < 2:
                raise EngineError(url, f"meta_info.output_top_logprobs[{i}] has a malformed candidate: {item!r}")
            lp, tid = item[0], item[1]
            if type(tid) is not int or not isinstance(lp, (int, float)) or isinstance(lp, bool):
                raise EngineError(url, f"meta_info.output_top_logprobs[{i}] has no usable logprob/token id: {item!r}")
            ids.append(tid)
            logprobs.append(float(lp))
    try:
        return SamplerHeads(struct.pack(f"<{len(ids)}i", *ids), struct.pack(f"<{len(logprobs)}d", *logprobs), k=k)
    except struct.error as exc:
        raise EngineError(url, f"meta_info.output_top_logprobs has a token id outside int32: {exc}") from exc


def opt_index(meta: Mapping[str, Any], key: str, url: str) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise EngineError(url, f"meta_info.{key} must be a non-negative integer, got {value!r}")
    return value
