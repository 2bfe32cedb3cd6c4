"""SGLang's wire format: parsing `/generate` answers and the small shapes of the control calls.

Pure functions and frozen results, no I/O, so a parser can be tested on a dict. The format is
`reference/sglang-protocol.md` (section 1.3 for `/generate`, 7 for per-token version spans).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from core.columns import LogProbs, SamplerHeads, TokenIds, TokenRoutes
from core.errors import EngineError
from core.types import FinishReason, PauseMode, Segment, VersionSpan

from .payloads import decode_routed_experts, opt_index, parse_top_logprobs

__all__ = [
    "PAUSE_MODES",
    "EngineLoad",
    "EngineSpan",
    "GenerateResult",
    "error_text",
    "preview",
]

# What `/pause_generation` accepts (SGLang >= 0.5.6; older servers ignore the body and abort).
PAUSE_MODES = tuple(PauseMode)


@dataclass(frozen=True, slots=True)
class EngineSpan:
    """Output tokens `[start, end)` were decoded under the engine's weight version `version`.

    One entry of `meta_info.weight_versions`. The version is the engine's string; only the
    generator pool, which holds the clock, can say which published version it means.
    """

    version: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One finished `/generate` call, including an aborted one with its partial output.

    `token_ids` and `logprobs` come from `meta_info.output_token_logprobs` (as slime reads them),
    so they are aligned by construction. `prompt_tokens` and `cached_tokens` are None when the
    engine left them out (a request aborted while still in the waiting queue).
    """

    rid: str
    token_ids: TokenIds
    logprobs: LogProbs  # empty for a call sent without return_logprob
    finish_reason: FinishReason
    matched: int | str | None  # the stop token id or stop string, for `stop`
    finish_message: str | None  # the abort message, for `abort`
    # The engine's version when it assembled this output; None only for an abort without tokens
    # from a server that left it out (SGLang's "Abort before prefill" up to late 2025).
    weight_version: str | None
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None
    # `meta_info.weight_versions`, validated to tile the output; None from engines that send only
    # `weight_version` (then the version of tokens before a publish is unknown).
    weight_versions: tuple[EngineSpan, ...] | None = None
    # R3: `meta_info.routed_experts` decoded to its int32 bytes (rows of every forward position the
    # answer covers, from `routed_experts_start_len`); `stages.sglang_client.payloads` cuts the new tokens'.
    routed_experts: bytes | None = None
    routed_experts_start_len: int | None = None
    # SC: `meta_info.output_top_logprobs`, one row per output token.
    heads: SamplerHeads | None = None

    @classmethod
    def aborted_unanswered(cls, rid: str, message: str) -> GenerateResult:
        """A request that no engine answered, handed back as SGLang answers one aborted before
        prefill (no tokens, no version): the fault handling's answer for a request on an engine
        that died or was evicted, which the pool resumes from its prefix once an engine serves."""
        return cls(rid, TokenIds(), LogProbs(), FinishReason.ABORT, None, message, None, None, 0, None)

    @classmethod
    def from_response(cls, payload: object, *, url: str, rid: str) -> GenerateResult:
        """Parse a non-streaming `/generate` body. Anything malformed is an `EngineError` naming `url`."""
        if not isinstance(payload, Mapping):
            raise EngineError(url, f"expected one JSON object from /generate, got {type(payload).__name__}")
        meta = payload.get("meta_info")
        if not isinstance(meta, Mapping):
            raise EngineError(url, f"response has no meta_info object: {preview(payload)}")
        reason, matched, message = _parse_finish_reason(meta.get("finish_reason"), url)
        entries = meta.get("output_token_logprobs")
        if entries is not None:
            token_ids, logprobs = _parse_logprobs(entries, url)
        else:
            # No log-probs asked for, or an abort before prefill (whose answer may have no ids either).
            ids = payload.get("output_ids")
            token_ids, logprobs = TokenIds(() if ids is None else _int_tuple(ids, url, "output_ids")), LogProbs()
        completion = meta.get("completion_tokens")
        completion = len(token_ids) if completion is None else int(completion)
        spans = _parse_version_spans(meta.get("weight_versions"), completion, len(token_ids), url)
        version = meta.get("weight_version")
        if version is None and spans:
            version = spans[-1].version
        if version is None and (len(token_ids) or reason is not FinishReason.ABORT):
            # SGLang before ~0.5.1 does not stamp outputs; guessing a version would be worse. An
            # abort without tokens is the one exception: SGLang up to late 2025 answers a request
            # aborted before prefill with only id, finish_reason and counts, and no token needs one.
            raise EngineError(url, "response has no meta_info.weight_version (SGLang older than 0.5.1?)")
        if spans and str(version) != spans[-1].version:
            raise EngineError(
                url,
                f"meta_info.weight_version {version!r} is not the last span's version in "
                f"weight_versions {preview(meta.get('weight_versions'))}",
            )
        return cls(
            rid=str(meta.get("id", rid)),
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            matched=matched,
            finish_message=message,
            weight_version=None if version is None else str(version),
            prompt_tokens=_opt_int(meta.get("prompt_tokens")),
            completion_tokens=completion,
            cached_tokens=_opt_int(meta.get("cached_tokens")),
            weight_versions=spans,
            routed_experts=None
            if meta.get("routed_experts") is None
            else decode_routed_experts(meta["routed_experts"], url),
            routed_experts_start_len=opt_index(meta, "routed_experts_start_len", url),
            heads=parse_top_logprobs(meta.get("output_top_logprobs"), len(token_ids), url),
        )

    def to_segment(
        self, version: int, spans: tuple[VersionSpan, ...] = (), *, routes: TokenRoutes | None = None
    ) -> Segment:
        """These tokens as a `Segment` stamped with `version` (the clock's integer for the newest
        tokens) and, for a request that crossed a publish, `spans` over its tokens. The caller
        maps the engine's strings to the clock's integers."""
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"request {self.rid} was sent without return_logprob; a segment needs log-probs")
        return Segment(
            self.token_ids, self.logprobs, self.finish_reason, version, spans=spans, routes=routes, heads=self.heads
        )


def _parse_version_spans(raw: object, completion: int, n_tokens: int, url: str) -> tuple[EngineSpan, ...] | None:
    """`meta_info.weight_versions` checked against the rule: a non-empty list of
    `{"version", "start", "end"}`, contiguous from 0, the last `end` equal to `completion_tokens`
    (and to the tokens received). Empty spans are legal (a request aborted before its first token,
    or two publishes with no token between) and kept; the caller skips them."""
    if raw is None:
        return None
    shown = preview(raw)
    if not isinstance(raw, list) or not raw:
        raise EngineError(url, f"meta_info.weight_versions must be a non-empty list of spans, got {shown}")
    spans: list[EngineSpan] = []
    covered = 0
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise EngineError(url, f"meta_info.weight_versions[{i}] is not an object: {item!r}")
        version, start, end = item.get("version"), item.get("start"), item.get("end")
        if version is None or not _is_index(start) or not _is_index(end):
            raise EngineError(url, f"meta_info.weight_versions[{i}] needs a version and int start/end: {item!r}")
        if start != covered or end < start:
            raise EngineError(
                url,
                f"meta_info.weight_versions must be contiguous from 0: span {i} is [{start}, {end}) "
                f"after {covered} tokens covered, in {shown}",
            )
        spans.append(EngineSpan(str(version), start, end))
        covered = end
    if covered != completion or covered != n_tokens:
        raise EngineError(
            url,
            f"meta_info.weight_versions end at {covered}, but the answer has completion_tokens "
            f"{completion} and {n_tokens} output tokens: {shown}",
        )
    return tuple(spans)


def _is_index(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_finish_reason(raw: object, url: str) -> tuple[FinishReason, int | str | None, str | None]:
    # The four shapes (schedule_batch.FINISH_*.to_json and _handle_abort_req):
    #   {"type":"stop","matched":<token id>}      {"type":"stop","matched":"<stop string>"}
    #   {"type":"length","length":N}              {"type":"abort","message":...[,"status_code",...]}
    if not isinstance(raw, Mapping):
        raise EngineError(url, f"response has no finish_reason (got {raw!r}); was it a streaming chunk?")
    kind = raw.get("type")
    if kind == "stop":
        matched = raw.get("matched")
        return FinishReason.STOP, matched if isinstance(matched, (int, str)) else None, None
    if kind == "length":
        return FinishReason.LENGTH, None, None
    if kind == "abort":
        message = raw.get("message")
        return FinishReason.ABORT, None, None if message is None else str(message)
    raise EngineError(url, f"unknown finish_reason {dict(raw)!r}")


_INT_ONLY = frozenset({int})
_NUMBERS = frozenset({int, float})
_INT32 = (-(2**31), 2**31 - 1)  # a token id is stored as int32 (core.columns.TokenIds)


def _parse_logprobs(entries: object, url: str) -> tuple[TokenIds, LogProbs]:
    # Real SGLang sends [logprob, token_id, text|null]; some fakes send [logprob, token_id].
    if not isinstance(entries, list):
        raise EngineError(url, f"output_token_logprobs is not a list: {preview(entries)}")
    fast = _transpose_logprobs(entries)
    if fast is not None:
        try:
            # From here on a token is 4 + 8 bytes, not two Python objects (core.columns).
            return TokenIds(fast[0]), LogProbs(fast[1])
        except OverflowError:
            pass  # a token id outside int32: the loop below names it
    token_ids: list[int] = []
    logprobs: list[float] = []
    for i, item in enumerate(entries):
        if not isinstance(item, (list, tuple)) or len(item) < 2:
            raise EngineError(url, f"output_token_logprobs[{i}] is not [logprob, token_id, ...]: {item!r}")
        lp, tid = item[0], item[1]
        if not _is_number(lp) or isinstance(tid, bool) or not isinstance(tid, int) or not _INT32[0] <= tid <= _INT32[1]:
            # orjson writes NaN as null, so a null here is a NaN or a missing value: either way unusable.
            raise EngineError(url, f"output_token_logprobs[{i}] has no usable logprob/token id: {item!r}")
        token_ids.append(tid)
        logprobs.append(float(lp))
    return TokenIds(token_ids), LogProbs(logprobs)


def _transpose_logprobs(entries: list[Any]) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """The hot path of the whole controller (1k entries per sample): split the entries into
    columns in C (one `zip`), then check each column's set of exact types, about a fifth of the
    cost of a Python loop.

    None when anything is off (a short or non-list entry, a null log-prob, a bool token id): the
    loop then finds the entry and says what is wrong with it. `zip` stops at the shortest entry,
    so fewer than two columns means some entry is short. Exact `type` checks refuse bools, which
    `isinstance(x, int)` would let through. A JSON body holds no iterable entries besides lists,
    strings and objects; a string yields strings here, an object its string keys.
    """
    try:
        columns = tuple(zip(*entries, strict=False))
    except TypeError:  # a number or a null entry
        return None
    if len(columns) < 2:
        return None
    logprobs, token_ids = columns[0], columns[1]
    if not set(map(type, token_ids)) <= _INT_ONLY:
        return None
    kinds = set(map(type, logprobs))
    if kinds <= _NUMBERS:  # ints among them are packed as float64 by LogProbs like the floats
        return token_ids, logprobs
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_tuple(raw: object, url: str, name: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and _INT32[0] <= x <= _INT32[1] for x in raw
    ):
        raise EngineError(url, f"{name} is not a list of int32 token ids: {preview(raw)}")
    return tuple(raw)


def _opt_int(raw: object) -> int | None:
    return None if raw is None else int(raw)  # type: ignore[call-overload]


def preview(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def error_text(body: bytes) -> str:
    """The engine's own words from an error body: JSON `error.message`/`message`/`detail`, or the text."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, Mapping):
        err = doc.get("error")
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if doc.get(key):
                return str(doc[key])
    text = body.decode("utf-8", "replace").strip()
    if _HTML.match(text):
        # Something other than SGLang answered (a web server, a notebook, a proxy's login page):
        # its page says nothing useful spread over a terminal; its title says what it is.
        title = _TITLE.search(text)
        what = f"an HTML page titled {title[1].strip()[:80]!r}" if title else "an HTML page"
        return f"answered with {what}, not SGLang's JSON: is this the URL of an SGLang server?"
    return (text[:500] + "...") if len(text) > 500 else (text or "(empty body)")


_HTML = re.compile(r"\s*(<!doctype html|<html|<head|<body)", re.I)
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.I | re.S)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Requests an engine holds, summed over its data-parallel ranks (`GET /v1/loads`)."""

    running: int
    waiting: int

    @property
    def total(self) -> int:
        return self.running + self.waiting
