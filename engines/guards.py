"""What an engine lets in: SGLang's `--api-key`, and a bound on the size of a request body.

The API key (SGLang's `--api-key`, `python/sglang/srt/utils/auth.py` upstream): with a key set,
every request needs `Authorization: Bearer KEY`, except the health probes (paths starting with
`/health`, so `/health_generate` too, as SGLang: load balancers and the launcher probe without
secrets) and CORS preflights (OPTIONS). Anything else gets SGLang's 401 `{"error": "Unauthorized"}`
before its handler runs or its body is read. Keys are compared in constant time.

The body bound: a server reads a whole body into memory before a handler can look at it, so an
unbounded one let a 300 MB body hold the engine for 21 s and four of 400 MB take 7.7 GB. The
largest body a legitimate client sends is a `/generate` batch that fills every running slot with a
full-context prompt, at most 8 bytes of JSON a token id (`151935, `); the default bound is that,
and never below 16 MiB. A larger body gets 413 naming the bound and the flag that raises it
(`--max-body-mb`): before it is read when it declares its length, else once the read passes it.
"""

from __future__ import annotations

import argparse
import hmac
import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

__all__ = [
    "MIB",
    "MIN_BODY",
    "UNAUTHORIZED",
    "add_guard_arguments",
    "authorized",
    "default_max_body",
    "guard_middlewares",
    "guard_options",
    "too_large_message",
]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
UNAUTHORIZED = b'{"error":"Unauthorized"}'  # SGLang's body for a missing or wrong key
MIN_BODY = 16 * MIB
_BYTES_PER_TOKEN_ID = 8  # "151935, ": the widest id of a 152k vocabulary with json.dumps' separator


def authorized(method: str, path: str, authorization: str | None, key: str) -> bool:
    """Whether a request may pass an engine started with `--api-key key`."""
    if method == "OPTIONS" or path.startswith("/health"):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode())


def default_max_body(context_length: int, max_running_requests: int) -> int:
    """The largest legitimate body: one `/generate` batch of a full-context prompt per running slot."""
    return max(MIN_BODY, _BYTES_PER_TOKEN_ID * context_length * max_running_requests)


def add_guard_arguments(ap: argparse.ArgumentParser) -> None:
    """Every aiohttp engine's `--api-key` and `--max-body-mb`."""
    ap.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="SGLang's: every request but the health probes needs 'Authorization: Bearer KEY' (401 without)",
    )
    ap.add_argument(
        "--max-body-mb",
        type=float,
        default=None,
        metavar="MIB",
        help="largest request body accepted, in MiB (413 above it); default: a /generate batch of a "
        "full-context prompt per running request, at least 16",
    )


def guard_options(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """(`api_key` and `max_body_bytes` for `open_engine`, problems with the flags)."""
    mb = args.max_body_mb
    if mb is not None and not mb > 0:
        return {}, [f"--max-body-mb must be > 0, got {mb}"]
    return {"api_key": args.api_key or None, "max_body_bytes": None if mb is None else int(mb * MIB)}, []


def too_large_message(size: int | None, limit: int) -> str:
    got = f"{size} bytes" if size is not None else "more bytes than that"
    return (
        f"the request body is {got}; this engine accepts at most {limit} bytes ({limit / MIB:g} MiB: by default "
        "a /generate batch of a full-context prompt per running request). Send smaller batches, or start the "
        "engine with a larger --max-body-mb"
    )


def guard_middlewares(api_key: str | None, max_body: int) -> list[Middleware]:
    """aiohttp middlewares: the key first (a refused request's body is never read), then the bound.

    The app must also be built with `client_max_size=max_body`, so that a body sent without a
    length (chunked) is cut off at the bound while it is read."""

    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        assert api_key is not None
        if not authorized(request.method, request.path, request.headers.get("Authorization"), api_key):
            log.info("refused %s %s from %s: no valid API key", request.method, request.path, request.remote)
            return web.Response(status=401, body=UNAUTHORIZED, content_type="application/json")
        return await handler(request)

    @web.middleware
    async def bound_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        size = request.content_length
        if size is not None and size > max_body:
            return _too_large(size, max_body)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:  # a chunked body passed the bound while it was read
            return _too_large(None, max_body)

    return [require_key, bound_body] if api_key else [bound_body]


def _too_large(size: int | None, limit: int) -> web.Response:
    log.warning("refused a request body of %s bytes (bound %d)", "unknown" if size is None else size, limit)
    return web.json_response({"error": {"message": too_large_message(size, limit)}}, status=413)
