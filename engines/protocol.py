"""SGLang's /generate protocol for the built-in engine: parse a request body, render an output.

Shapes follow reference/sglang-protocol.md section 1 (GenerateReqInput, SamplingParams and its
`verify()`, the output and its meta_info). Anything SGLang accepts that the built-in engine cannot
honour is refused with InvalidRequestError (HTTP 400), never silently ignored.
"""

from __future__ import annotations

import base64
import reprlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engines.request import FinishKind, InvalidRequestError, Request
from engines.seam import SamplingParams

__all__ = ["GenerateCall", "parse_generate", "parse_sampling_params", "render_output"]

_SAMPLING_DEFAULTS = SamplingParams()
# The culprit as the error shows it: a prompt can be megabytes, the message stays a line.
_SHORT = reprlib.Repr()
_SHORT.maxlist, _SHORT.maxstring, _SHORT.maxlevel = 8, 80, 2
# Keys SGLang accepts that do not change what this engine computes.
_SAMPLING_IGNORED = {"spaces_between_special_tokens", "stream_interval", "custom_params"}
# Keys SGLang accepts whose non-default values this engine cannot honour.
_SAMPLING_UNSUPPORTED = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
}
# Top-level /generate fields that must be absent (or falsy) here.
_GENERATE_UNSUPPORTED = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "custom_logit_processor",
    "return_hidden_states",
    "token_ids_logprob",
)


def parse_sampling_params(raw: object, *, vocab_size: int) -> SamplingParams:
    """SGLang's `SamplingParams(**raw)` plus its `verify()`: null means default; every problem is listed."""
    if raw is None:
        return _SAMPLING_DEFAULTS
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"sampling_params must be an object, got {raw!r}", raw)
    problems: list[str] = []
    values: dict[str, Any] = {}

    def number(key: str, *, integer: bool = False) -> Any:
        v = raw.get(key)
        if v is None:
            return getattr(_SAMPLING_DEFAULTS, key)
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok:
            problems.append(f"{key} must be {'an integer' if integer else 'a number'}, got {v!r}")
            return getattr(_SAMPLING_DEFAULTS, key)
        return v

    values["max_new_tokens"] = number("max_new_tokens", integer=True)
    values["min_new_tokens"] = number("min_new_tokens", integer=True)
    values["temperature"] = float(number("temperature"))
    values["top_p"] = float(number("top_p"))
    values["top_k"] = number("top_k", integer=True)
    values["min_p"] = float(number("min_p"))
    values["n"] = number("n", integer=True)
    seed = raw.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        problems.append(f"sampling_seed must be an integer, got {seed!r}")
        seed = None
    values["sampling_seed"] = seed
    for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        v = raw.get(key)
        if v is None:
            continue
        if not isinstance(v, bool):
            problems.append(f"{key} must be a boolean, got {v!r}")
        else:
            values[key] = v

    stop = raw.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        problems.append(f"stop must be a string or a list of strings, got {stop!r}")
        stop = None
    values["stop"] = tuple(s for s in stop or () if s)

    stop_ids = raw.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)
    ):
        problems.append(f"stop_token_ids must be a list of integers, got {stop_ids!r}")
        stop_ids = None
    values["stop_token_ids"] = frozenset(stop_ids or ())

    bias = raw.get("logit_bias")
    pairs: list[tuple[int, float]] = []
    if bias is not None:
        if not isinstance(bias, dict):
            problems.append(f"logit_bias must be an object of token id -> bias, got {bias!r}")
        else:
            for k, v in bias.items():
                try:
                    tid = int(k)
                except ValueError:
                    tid = -1
                if not 0 <= tid < vocab_size or isinstance(v, bool) or not isinstance(v, (int, float)):
                    problems.append(f"logit_bias entry {k!r}: {v!r} is not a token id in the vocabulary -> number")
                else:
                    pairs.append((tid, float(v)))
    values["logit_bias"] = tuple(pairs)

    for key, default in _SAMPLING_UNSUPPORTED.items():
        if raw.get(key) is not None and raw.get(key) != default:
            problems.append(f"{key}={raw[key]!r} is not supported by the built-in engine")
    known = {f for f in SamplingParams.__dataclass_fields__} | _SAMPLING_IGNORED | set(_SAMPLING_UNSUPPORTED)
    for key in raw:
        if key not in known:
            problems.append(f"unexpected sampling parameter {key!r}")

    # SGLang's SamplingParams.verify()
    t, p = values["temperature"], values["top_p"]
    if not (t >= 0.0 and t != float("inf")):
        problems.append(f"temperature must be finite and >= 0, got {t}")
    if not 0.0 < p <= 1.0:
        problems.append(f"top_p must be in (0, 1], got {p}")
    if not 0.0 <= values["min_p"] <= 1.0:
        problems.append(f"min_p must be in [0, 1], got {values['min_p']}")
    if values["top_k"] < 1 and values["top_k"] != -1:
        problems.append(f"top_k must be -1 (disable), or at least 1, got {values['top_k']}")
    if values["max_new_tokens"] < 0:
        problems.append(f"max_new_tokens must be at least 0, got {values['max_new_tokens']}")
    if not 0 <= values["min_new_tokens"] <= max(values["max_new_tokens"], 0):
        problems.append(
            f"min_new_tokens must be in [0, max_new_tokens({values['max_new_tokens']})], got {values['min_new_tokens']}"
        )
    if values["n"] < 1:
        problems.append(f"n must be at least 1, got {values['n']}")
    bad_ids = sorted(t for t in values["stop_token_ids"] if not 0 <= t < vocab_size)
    if bad_ids:
        problems.append(f"stop_token_ids {bad_ids} are outside the vocabulary [0, {vocab_size})")
    if problems:
        raise InvalidRequestError("; ".join(problems), raw)
    return SamplingParams(**values)


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """A parsed /generate body: the requests it makes and how to answer."""

    requests: tuple[Request, ...]
    batch: bool  # answer with a list
    stream: bool
    text_in_logprobs: bool


def parse_generate(
    body: object, *, tokenizer: Any, vocab_size: int, routes: bool = False, top_logprobs: bool = False
) -> GenerateCall:
    """Turn a /generate body (SGLang's GenerateReqInput) into requests; raise InvalidRequestError.
    `routes`: the served model has MoE layers whose routes a request may ask for (R3);
    `top_logprobs`: the engine samples from a real distribution whose top-k it can report (SC)."""
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the body must be a JSON object, got {type(body).__name__}", body)
    routed, routed_start = _routed_experts(body, routes)
    for key in _GENERATE_UNSUPPORTED:
        if body.get(key):
            raise InvalidRequestError(f"{key} is not supported by the built-in engine", body[key])
    if body.get("logprob_start_len") not in (None, -1):
        raise InvalidRequestError(
            "logprob_start_len >= 0 (prompt log-probs) is not supported by the built-in engine",
            body["logprob_start_len"],
        )
    top = body.get("top_logprobs_num")
    if top is not None and (type(top) is not int or top < 0):
        raise InvalidRequestError(f"top_logprobs_num must be an integer >= 0, got {top!r}", top)
    if top and not top_logprobs:
        raise InvalidRequestError("top_logprobs_num > 0 is not supported by this engine (no model distribution)", top)

    text, input_ids = body.get("text"), body.get("input_ids")
    prompts: list[tuple[int, ...]]
    if text is not None:  # SGLang: text wins over input_ids
        if isinstance(text, str):
            batch, texts = False, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            batch, texts = True, text
        else:
            raise InvalidRequestError(f"text must be a string or a list of strings, got {_SHORT.repr(text)}", text)
        prompts = [tuple(tokenizer.encode(t)) for t in texts]
    elif input_ids is not None:
        if _is_ids(input_ids):
            batch, prompts = False, [tuple(input_ids)]
        elif isinstance(input_ids, list) and input_ids and all(_is_ids(x) for x in input_ids):
            batch, prompts = True, [tuple(x) for x in input_ids]
        else:
            raise InvalidRequestError(
                f"input_ids must be a list of integers or a list of such lists, got {_SHORT.repr(input_ids)}",
                input_ids,
            )
    else:
        raise InvalidRequestError("Either text, input_ids or input_embeds should be provided.")
    if any(len(p) == 0 for p in prompts):
        raise InvalidRequestError("input_ids cannot be empty.", input_ids)

    params = _per_request(body.get("sampling_params"), len(prompts), "sampling_params", batch)
    parsed = [parse_sampling_params(p, vocab_size=vocab_size) for p in params]
    n = parsed[0].n
    if any(p.n != n for p in parsed):
        raise InvalidRequestError("every request in a batch must use the same n", [p.n for p in parsed])
    if n > 1:
        if batch:
            raise InvalidRequestError("n > 1 with a batch of prompts is not supported by the built-in engine", n)
        batch, prompts, parsed = True, prompts * n, parsed * n
    logprob = _per_request(body.get("return_logprob"), len(prompts), "return_logprob", batch)
    if not all(isinstance(x, bool) or x is None for x in logprob):
        raise InvalidRequestError(f"return_logprob must be a boolean, got {body['return_logprob']!r}")
    rids = _rids(body.get("rid"), len(prompts), batch)
    stream = bool(body.get("stream", False))
    if stream and batch:
        raise InvalidRequestError("streaming a batch is not supported by the built-in engine")
    requests = tuple(
        Request(
            rid=rid,
            prompt_ids=prompt,
            params=p,
            return_logprob=bool(lp),
            return_routed_experts=routed,
            routed_start_len=routed_start,
            top_logprobs_num=(top or 0) if lp else 0,  # SGLang: with return_logprob only
        )
        for rid, prompt, p, lp in zip(rids, prompts, parsed, logprob, strict=True)
    )
    return GenerateCall(
        requests=requests,
        batch=batch,
        stream=stream,
        text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
    )


def _routed_experts(body: dict[str, Any], routes: bool) -> tuple[bool, int]:
    """`return_routed_experts` and `routed_experts_start_len` (sglang-protocol.md 1.1)."""
    asked, start = body.get("return_routed_experts"), body.get("routed_experts_start_len")
    if asked is not None and not isinstance(asked, bool):
        raise InvalidRequestError(f"return_routed_experts must be a boolean, got {asked!r}", asked)
    if start is not None and (type(start) is not int or start < 0):
        raise InvalidRequestError(f"routed_experts_start_len must be an integer >= 0, got {start!r}", start)
    if asked and not routes:
        raise InvalidRequestError("return_routed_experts needs an MoE model; the served model has no MoE layers", asked)
    return bool(asked), start or 0


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _per_request(value: object, n: int, name: str, batch: bool) -> list[Any]:
    if isinstance(value, list):
        if not batch or len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompt(s)", value)
        return value
    return [value] * n


def _rids(rid: object, n: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(n)] if batch else [rid]
    if isinstance(rid, list) and batch and len(rid) == n and all(isinstance(r, str) for r in rid):
        return rid
    raise InvalidRequestError(f"rid must be a string, or a list of {n} strings for this batch, got {rid!r}", rid)


def render_output(
    req: Request,
    *,
    tokenizer: Any,
    final: bool,
    stream: bool = False,
    text_in_logprobs: bool = False,
) -> dict[str, Any]:
    """One SGLang /generate output (sglang-protocol.md 1.3), assembled now: cumulative tokens,
    logprobs aligned with output_ids, and the weight version of its tokens: `weight_version` is the
    last span's, and the final answer carries every span in `weight_versions` (section 7, late-2026)."""
    p, finish = req.params, req.finish
    ids = list(req.output_ids)
    text_ids = ids
    if finish is not None and finish.kind is FinishKind.STOP_TOKEN and not p.no_stop_trim:
        text_ids = ids[:-1]  # SGLang trims the matched stop token from `text` only
    text = tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
    if finish is not None and finish.kind is FinishKind.STOP_STR and not p.no_stop_trim:
        cut = text.find(str(finish.matched))
        text = text[:cut] if cut != -1 else text
    spans = req.version_spans()
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": finish.to_json() if finish is not None else None,
        "prompt_tokens": len(req.prompt_ids),
        "weight_version": spans[-1][0],
        "completion_tokens": len(ids),
        "cached_tokens": 0,
    }
    if finish is not None and finish.kind is FinishKind.ABORT_WAITING:
        # SGLang's _handle_abort_req: no prompt/cached token counts, and a streaming client
        # gets only the last id in this final chunk.
        del meta["prompt_tokens"], meta["cached_tokens"]
        if stream:
            ids = ids[-1:]
    if final:  # streams carry the spans on the final chunk only
        meta["weight_versions"] = [{"version": v, "start": s, "end": e} for v, s, e in spans]
        meta["e2e_latency"] = (req.finished_at or time.perf_counter()) - req.created
    if req.return_logprob:
        pairs = zip(req.output_logprobs, req.output_ids, strict=True)
        if text_in_logprobs:
            meta["output_token_logprobs"] = [[lp, t, tokenizer.decode([t])] for lp, t in pairs]
        else:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in pairs]
        # logprob_start_len=-1: SGLang starts at the last prompt token, whose logprob is null.
        meta["input_token_logprobs"] = [[None, req.prompt_ids[-1], None]]
        if req.top_logprobs_num:  # one list per output token, most likely first (SC reads them)
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in req.output_top_logprobs]
            meta["input_top_logprobs"] = [None]
    waiting_abort = finish is not None and finish.kind is FinishKind.ABORT_WAITING
    if req.return_routed_experts and final and not waiting_abort:
        # SGLang collects the routes of a request that finishes in a forward (running, or aborted
        # while running); one aborted in its waiting queue, a retracted one with tokens included,
        # is answered by the tokenizer manager's _handle_abort_req, which sends none.
        meta["routed_experts"] = _routed_rows(req)
        meta["routed_experts_start_len"] = req.routed_start_len
    return {"text": text, "output_ids": ids, "meta_info": meta}


def _routed_rows(req: Request) -> str:
    """Base64 of the request's routes of positions [routed_start_len, prompt + completion - 1):
    every position read by a forward (the last token never is)."""
    if not req.routed_positions:
        return ""
    row = len(req.routes) // req.routed_positions
    return base64.b64encode(bytes(req.routes[req.routed_start_len * row :])).decode("ascii")
