"""The instant engine: answers every `/generate` at once, so a benchmark measures the controller alone.

    python -m engines.instant [--port 30000] [--tokens 1024] [--finish length] [--cpu 1]
        [--api-key KEY] [--max-body-mb 16]

It speaks the SGLang HTTP surface the pipeline uses (`reference/sglang-protocol.md`): `/generate`
(non-streaming, token in, token out, with `output_token_logprobs`), `/model_info`,
`/update_weight_version`, `/update_weights_from_disk`, `/pause_generation`, `/continue_generation`,
`/flush_cache`, `/abort_request`, `/v1/loads` and the health probes. There is no model and no scheduler: a
request gets `min(max_new_tokens, --tokens)` tokens the moment it arrives.

Why a hand-rolled HTTP/1.1 server on a bare asyncio protocol rather than aiohttp's: the point is to
be far cheaper per request than the controller it feeds, so the controller's core is the only
bottleneck. Each answer is built by splicing the rid and version into pre-encoded bytes; the
1k-entry log-prob array is encoded once per length. Only what aiohttp's client sends is parsed:
`Content-Length` bodies, keep-alive, one request at a time per connection. `--api-key` and the
body bound are every engine's (guards.py): 401 without the key, 413 for a body over the bound
(16 MiB unless `--max-body-mb`), answered before that body is buffered.

Pause: generation requests that arrive while paused wait (any mode: nothing is ever in flight
here) and are answered on `/continue_generation` with the version then serving; an
`/abort_request` answers them as aborted with no tokens, as SGLang answers aborted waiting requests.

Production payloads (`--max-tokens N`, the issue-49 load generator): answers as a production run's
are, encoded once and cut per request (`engines.production_payloads`): long-tailed lengths
(`--lengths lognormal:MU,SIGMA`, fractions of `--length-limit`, `--truncate-frac`) up to N tokens,
`output_ids`, per-token log-probs, `weight_versions` spans, R3 routes at `--routes 48x8/128` when
a request sets `return_routed_experts` (base64 int32, from `routed_experts_start_len`, echoed),
and SC heads when it sets `top_logprobs_num`. `--extra-ports P1,P2,...` serves more engines from
this one process, each with its own version and pause state (one process answers for many
ports, as a benchmark behind a router of 64 engines needs); `/instant/stats` reports per port.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from core.errors import ConfigError
from engines.guards import MIB, MIN_BODY, UNAUTHORIZED, add_guard_arguments, authorized, too_large_message
from engines.production_payloads import ProductionAnswers, RouteShape
from engines.sim_model import LengthModel

__all__ = ["InstantEngine", "main"]

EOS_ID = 2
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 413: b"Payload Too Large"}


@dataclass(slots=True)
class _Parked:
    transport: asyncio.Transport
    rid: str
    n_tokens: int
    prompt_tokens: int
    request: _Asked | None = None


@dataclass(frozen=True, slots=True)
class _Asked:
    """What a production-payload answer depends on, from its request."""

    stopped: bool
    routes_from: int | None  # routed_experts_start_len, when routes were asked for
    heads: int  # top_logprobs_num (0: none)


class InstantEngine:
    """The server state: version, pause flag, requests parked by a pause, and the answer cache."""

    def __init__(
        self,
        *,
        tokens: int,
        finish: str,
        weight_version: str,
        model_path: str,
        seed: int = 0,
        api_key: str | None = None,
        max_body: int = MIN_BODY,
        production: ProductionAnswers | None = None,
    ) -> None:
        self.tokens = tokens
        self.production = production  # shared by every port of the process
        self.answered_tokens = 0
        self.sent_bytes = 0
        self.api_key = api_key or None  # guards.py: SGLang's --api-key
        self.max_body = max_body
        self.finish = finish
        self.version = weight_version
        self.model_path = model_path
        self.paused = False
        self.parked: list[_Parked] = []
        self.requests = 0
        rng = random.Random(seed)
        # Realistic wire size: full-precision floats, as SGLang's float32 log-probs print through JSON.
        self._ids = [1000 + rng.randrange(50000) for _ in range(tokens)]
        self._lps = [-rng.random() * 3.0 for _ in range(tokens)]
        self._entries: dict[int, bytes] = {}

    def _logprob_bytes(self, n: int) -> bytes:
        cached = self._entries.get(n)
        if cached is None:
            ids = self._ids[:n]
            if self.finish == "stop" and n:
                ids[-1] = EOS_ID
            cached = self._entries[n] = orjson.dumps([[lp, t, None] for lp, t in zip(self._lps[:n], ids, strict=True)])
        return cached

    def answer(self, rid: str, n: int, prompt_tokens: int, *, aborted: bool = False) -> bytes:
        if aborted:
            n, finish = 0, b'{"type":"abort","message":"Abort in waiting queue"}'
        elif self.finish == "stop":
            finish = b'{"type":"stop","matched":%d}' % EOS_ID
        else:
            finish = b'{"type":"length","length":%d}' % n
        return b"".join((
            b'{"text":"","meta_info":{"id":', orjson.dumps(rid),
            b',"finish_reason":', finish,
            b',"prompt_tokens":%d,"completion_tokens":%d,"cached_tokens":0,"weight_version":' % (prompt_tokens, n),
            orjson.dumps(self.version),
            b',"output_token_logprobs":', self._logprob_bytes(n), b"}}",
        ))  # fmt: skip

    def production_answer(
        self, rid: str, n: int, prompt_tokens: int, asked: _Asked, *, aborted: bool = False
    ) -> list[bytes | memoryview]:
        """The pieces of a production answer's body (`engines.production_payloads`)."""
        answers = self.production
        assert answers is not None
        if aborted:
            n, finish = 0, b'{"type":"abort","message":"Abort in waiting queue"}'
        elif asked.stopped:
            finish = b'{"type":"stop","matched":%d}' % EOS_ID
        else:
            finish = b'{"type":"length","length":%d}' % n
        version = orjson.dumps(self.version)
        eos = answers.eos_logprob if asked.stopped and not aborted else None
        pieces: list[bytes | memoryview] = [b'{"text":"","output_ids":']
        pieces += answers.output_ids.first(n, b"%d" % EOS_ID if eos else None)
        pieces += [
            b',"meta_info":{"id":', orjson.dumps(rid),
            b',"finish_reason":', finish,
            b',"prompt_tokens":%d,"completion_tokens":%d,"cached_tokens":0,"weight_version":' % (prompt_tokens, n),
            version,
            b',"weight_versions":[{"version":', version, b',"start":0,"end":%d}]' % n,
            b',"output_token_logprobs":',
        ]  # fmt: skip
        pieces += answers.logprobs.first(n, eos)
        if asked.heads and n:
            pieces.append(b',"output_top_logprobs":')
            pieces += answers.heads(asked.heads).first(n)
        if asked.routes_from is not None and answers.routes is not None:
            rows = max(0, prompt_tokens + n - 1 - asked.routes_from)
            pieces.append(b',"routed_experts_start_len":%d,"routed_experts":"' % asked.routes_from)
            pieces += answers.routes.rows(rows)
            pieces.append(b'"')
        pieces.append(b"}}")
        self.answered_tokens += n
        return pieces

    def respond_generate(self, transport: asyncio.Transport, p: _Parked, *, aborted: bool = False) -> None:
        if p.request is None:
            body = self.answer(p.rid, p.n_tokens, p.prompt_tokens, aborted=aborted)
            self.sent_bytes += len(body)
            _respond(transport, 200, body)
            return
        pieces = self.production_answer(p.rid, p.n_tokens, p.prompt_tokens, p.request, aborted=aborted)
        length = sum(len(piece) for piece in pieces)
        self.sent_bytes += length
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
        transport.writelines([head, *pieces])

    def release_parked(self, *, aborted: bool) -> None:
        parked, self.parked = self.parked, []
        for p in parked:
            if not p.transport.is_closing():
                self.respond_generate(p.transport, p, aborted=aborted)


def _respond(transport: asyncio.Transport, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
        status, _REASONS.get(status, b"Error"), content_type, len(body),
    )  # fmt: skip
    transport.write(head + body)


class _Connection(asyncio.Protocol):
    def __init__(self, engine: InstantEngine) -> None:
        self._engine = engine
        self._buf = bytearray()
        self._discard = 0  # bytes of a refused body still to come
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._discard:
            dropped = min(self._discard, len(data))
            self._discard -= dropped
            data = data[dropped:]
        self._buf += data
        engine, transport = self._engine, self._transport
        assert transport is not None
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buf[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", 0))
            method, path, _ = head[0].split(" ", 2)
            path = path.split("?", 1)[0]
            if length > engine.max_body:  # answered now; the body is dropped as it comes, never held
                message = too_large_message(length, engine.max_body)
                _respond(transport, 413, orjson.dumps({"error": {"message": message}}))
                del self._buf[: end + 4]
                self._discard = length - min(length, len(self._buf))
                del self._buf[:length]
                continue
            if len(self._buf) < end + 4 + length:
                return
            body = bytes(self._buf[end + 4 : end + 4 + length])
            del self._buf[: end + 4 + length]
            key = engine.api_key
            if key is not None and not authorized(method, path, headers.get("authorization"), key):
                _respond(transport, 401, UNAUTHORIZED)
                continue
            self._handle(method, path, body)

    def _handle(self, method: str, path: str, body: bytes) -> None:
        engine, transport = self._engine, self._transport
        assert transport is not None
        try:
            doc = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            _respond(transport, 400, b'{"error":{"message":"body is not JSON"}}')
            return
        if path == "/generate":
            engine.requests += 1
            params = doc.get("sampling_params") or {}
            rid, prompt = str(doc.get("rid", "")), len(doc.get("input_ids") or ())
            asked = None
            if engine.production is None:
                n = min(int(params.get("max_new_tokens", engine.tokens)), engine.tokens)
            else:
                limit = int(params.get("max_new_tokens", engine.production.max_tokens))
                n, stopped = engine.production.tokens_for(limit, int(params.get("sampling_seed") or 0))
                routes_from = None
                if doc.get("return_routed_experts"):
                    routes_from = int(doc.get("routed_experts_start_len") or 0)
                asked = _Asked(stopped, routes_from, int(doc.get("top_logprobs_num") or 0))
            parked = _Parked(transport, rid, n, prompt, asked)
            if engine.paused:
                engine.parked.append(parked)
            else:
                engine.respond_generate(transport, parked)
        elif path in ("/model_info", "/get_model_info"):
            _respond(transport, 200, orjson.dumps({"model_path": engine.model_path, "weight_version": engine.version}))
        elif path == "/update_weight_version":
            engine.version = str(doc.get("new_version"))
            _respond(transport, 200, b'{"success":true,"message":"ok"}')
        elif path == "/update_weights_from_disk":
            if doc.get("weight_version") is not None:
                engine.version = str(doc["weight_version"])
            _respond(transport, 200, b'{"success":true,"message":"Succeeded to update model weights."}')
        elif path == "/pause_generation":
            engine.paused = True
            _respond(transport, 200, b"")
        elif path == "/continue_generation":
            engine.paused = False
            engine.release_parked(aborted=False)
            _respond(transport, 200, b"")
        elif path == "/abort_request":
            if doc.get("abort_all") or doc.get("rid"):
                engine.release_parked(aborted=True)
            _respond(transport, 200, b"")
        elif path == "/flush_cache":
            _respond(transport, 200, b"Cache flushed.\n", b"text/plain")
        elif path in ("/health", "/health_generate"):
            _respond(transport, 200, b"")
        elif path == "/v1/loads":  # nothing ever runs here; what a pause parked waits
            loads = {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": len(engine.parked)}]}
            _respond(transport, 200, orjson.dumps(loads))
        elif path == "/instant/stats":
            stats = {"requests": engine.requests, "tokens": engine.answered_tokens, "bytes": engine.sent_bytes}
            _respond(transport, 200, orjson.dumps(stats))
        else:
            _respond(transport, 404, orjson.dumps({"error": {"message": f"no route {method} {path}"}}))


def production_answers(args: argparse.Namespace) -> ProductionAnswers | None:
    """The answers the production-payload flags describe (None without `--max-tokens`)."""
    if args.max_tokens is None:
        return None
    lengths = None if args.lengths is None else LengthModel.parse(args.lengths, truncate_frac=args.truncate_frac)
    return ProductionAnswers(
        max_tokens=args.max_tokens,
        lengths=lengths,
        length_limit=args.length_limit,
        routes=None if args.routes is None else RouteShape.parse(args.routes),
        max_prompt=args.max_prompt,
    )


def _connections(engine: InstantEngine) -> Callable[[], _Connection]:
    return lambda: _Connection(engine)


async def serve(args: argparse.Namespace, production: ProductionAnswers | None = None) -> None:
    ports = [args.port, *args.extra_ports]
    engines = [
        InstantEngine(
            tokens=args.tokens,
            finish=args.finish,
            weight_version=args.weight_version,
            model_path=args.model_path,
            api_key=args.api_key,
            max_body=MIN_BODY if args.max_body_mb is None else int(args.max_body_mb * MIB),
            production=production,
        )
        for _ in ports
    ]
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(_connections(engine), args.host, port, backlog=1024)
        for engine, port in zip(engines, ports, strict=True)
    ]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    what = f"{args.tokens} tokens per answer" if production is None else f"production payloads up to {args.max_tokens}"
    print(f"instant engine on http://{args.host}:{ports[0]} (+{len(ports) - 1} ports), {what}", flush=True)
    try:
        await stop.wait()
    finally:
        for server in servers:
            server.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model-path", "--model", default="instant", help="only reported")
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--max-running-requests", type=int, default=0, help="accepted for start_engine; unused")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per answer (capped by max_new_tokens)")
    ap.add_argument("--finish", choices=["length", "stop"], default="length")
    ap.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    ap.add_argument(
        "--extra-ports", type=_ports, default=[], help="comma-separated: more engines served by this process"
    )
    prod = ap.add_argument_group("production payloads (issue 49's load generator)")
    prod.add_argument("--max-tokens", type=int, default=None, help="turns them on: the longest answer, e.g. 32768")
    prod.add_argument("--lengths", default=None, help="lognormal:MU,SIGMA or fixed:FRACTION of --length-limit")
    prod.add_argument("--truncate-frac", type=float, default=0.10, help="of samples that run to the limit")
    prod.add_argument("--length-limit", type=int, default=None, help="the run's response limit (default --max-tokens)")
    prod.add_argument("--routes", default=None, help="R3 rows answered when asked: LAYERSxTOPK/EXPERTS, e.g. 48x8/128")
    prod.add_argument("--max-prompt", type=int, default=4096, help="prompt tokens the route rows are encoded for")
    add_guard_arguments(ap)
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.max_tokens is not None and args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.max_tokens is None and (args.lengths or args.routes):
        ap.error("--lengths and --routes shape production payloads: add --max-tokens N (the longest answer)")
    if args.max_body_mb is not None and not args.max_body_mb > 0:
        ap.error(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    try:
        production = production_answers(args)  # encoded before the port opens: ready means ready
    except ConfigError as exc:
        ap.error(str(exc))
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    asyncio.run(serve(args, production))
    return 0


def _ports(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ports") from None


if __name__ == "__main__":
    sys.exit(main())
