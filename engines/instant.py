"""The instant engine: answers every `/generate` at once, so a benchmark measures the controller alone.

    python -m engines.instant [--port 30000] [--tokens 1024] [--finish length] [--cpu 1]
        [--api-key KEY] [--max-body-mb 16]

It speaks the SGLang HTTP surface the pipeline uses (`reference/sglang-protocol.md`): `/generate`
(non-streaming, token in, token out, with `output_token_logprobs`), `/model_info`,
`/update_weight_version`, `/update_weights_from_disk`, `/pause_generation`, `/continue_generation`,
`/flush_cache`, `/abort_request` and the health probes. There is no model and no scheduler: a
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
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from engines.guards import MIB, MIN_BODY, UNAUTHORIZED, add_guard_arguments, authorized, too_large_message

__all__ = ["InstantEngine", "main"]

EOS_ID = 2
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 413: b"Payload Too Large"}


@dataclass(slots=True)
class _Parked:
    transport: asyncio.Transport
    rid: str
    n_tokens: int
    prompt_tokens: int


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
    ) -> None:
        self.tokens = tokens
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

    def release_parked(self, *, aborted: bool) -> None:
        parked, self.parked = self.parked, []
        for p in parked:
            if not p.transport.is_closing():
                _respond(p.transport, 200, self.answer(p.rid, p.n_tokens, p.prompt_tokens, aborted=aborted))


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
            n = min(int(params.get("max_new_tokens", engine.tokens)), engine.tokens)
            rid, prompt = str(doc.get("rid", "")), len(doc.get("input_ids") or ())
            if engine.paused:
                engine.parked.append(_Parked(transport, rid, n, prompt))
            else:
                _respond(transport, 200, engine.answer(rid, n, prompt))
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
        elif path == "/instant/stats":
            _respond(transport, 200, orjson.dumps({"requests": engine.requests}))
        else:
            _respond(transport, 404, orjson.dumps({"error": {"message": f"no route {method} {path}"}}))


async def serve(args: argparse.Namespace) -> None:
    engine = InstantEngine(
        tokens=args.tokens,
        finish=args.finish,
        weight_version=args.weight_version,
        model_path=args.model_path,
        api_key=args.api_key,
        max_body=MIN_BODY if args.max_body_mb is None else int(args.max_body_mb * MIB),
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(engine), args.host, args.port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"instant engine on http://{args.host}:{args.port}, {args.tokens} tokens per answer", flush=True)
    async with server:
        await stop.wait()


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
    add_guard_arguments(ap)
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.max_body_mb is not None and not args.max_body_mb > 0:
        ap.error(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
