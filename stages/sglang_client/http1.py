"""`GeneratePool`: keep-alive HTTP/1.1 connections for `POST /generate`, and nothing else.

Why not aiohttp for this one call: at thousands of answers a second on one core, aiohttp's
request and response machinery (about 90 us an exchange here) costs as much as everything else
the controller does for a sample except parsing the answer. `/generate` needs little of it: one
POST with a JSON body, one response per connection at a time, and a body delimited by
`Content-Length` (SGLang, the router), `Transfer-Encoding: chunked` (a streaming proxy) or the
connection closing. Control calls stay on aiohttp, where their rarity makes its cost irrelevant.

It is still real HTTP to the same engine: the same request line, `Host`, `Content-Type`,
`Content-Length` and any `Authorization` header the fleet sends, and every response is parsed
according to RFC 9112 (status line, headers, interim 1xx answers skipped, `Connection: close`
honoured, gzip/deflate bodies inflated). A connection is reused only after a complete response;
a request that is cancelled or times out closes its connection (a half-read answer would be
read by the next request), which is also how the engine learns to abort it.

asyncio only (a `Protocol`), so the fleet uses it only when anyio runs on asyncio.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel

__all__ = ["GeneratePool", "HttpProtocolError"]

_MAX_HEAD = 64 * 1024  # a response head longer than this is not an engine talking


class HttpProtocolError(ConnectionError):
    """The server's bytes are not an HTTP/1.1 response this client can read."""


class _Response:
    __slots__ = ("body", "encoding", "keep_alive", "status")

    def __init__(self, status: int, body: bytes, keep_alive: bool, encoding: bytes) -> None:
        self.status, self.body, self.keep_alive, self.encoding = status, body, keep_alive, encoding


class _Connection(asyncio.Protocol):
    """One TCP connection: reads exactly one response per `expect`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._buf = bytearray()
        self._waiter: asyncio.Future[_Response] | None = None
        # The head of the response being read: status, content length (None: chunked or to close),
        # chunked, keep-alive, content-encoding.
        self._head: tuple[int, int | None, bool, bool, bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def expect(self, waiter: asyncio.Future[_Response]) -> None:
        self._waiter, self._head = waiter, None
        self._buf.clear()

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self.close()  # bytes nobody asked for: the connection is out of step, never reuse it
            return
        if self._head is None and not self._buf and self._whole(data):
            return
        self._buf += data
        try:
            self._parse()
        except HttpProtocolError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost settles the waiter

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        head = self._head
        if head is not None and head[1] is None and not head[2]:  # a body delimited by the close
            self._finish(bytes(self._buf), keep_alive=False)
            return
        self._fail(exc or ConnectionResetError("the engine closed the connection before its answer was complete"))

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.close()

    def _finish(self, body: bytes, *, keep_alive: bool) -> None:
        assert self._head is not None
        status, _, _, head_keep, encoding = self._head
        waiter, self._waiter, self._head = self._waiter, None, None
        if waiter is not None and not waiter.done():
            waiter.set_result(_Response(status, body, keep_alive and head_keep, encoding))

    def _whole(self, data: bytes) -> bool:
        """The common case, a complete Content-Length response in one read, without copying it
        into the buffer first. False (nothing consumed) for anything else."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return False
        try:
            head = _parse_head(data[:end])
        except HttpProtocolError:
            return False  # the general path raises it
        length = head[1]
        if head[0] < 200 or head[2] or length is None or len(data) != end + 4 + length:
            return False
        self._head = head
        self._finish(data[end + 4 :], keep_alive=True)
        return True

    def _parse(self) -> None:
        buf = self._buf
        while self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise HttpProtocolError(f"a response head longer than {_MAX_HEAD} bytes")
                return
            head = _parse_head(bytes(buf[:end]))
            del buf[: end + 4]
            if not 100 <= head[0] < 200:  # an interim answer (100 Continue): the real one follows
                self._head = head
        length, chunked = self._head[1], self._head[2]
        if chunked:
            done = _dechunk(buf)
            if done is not None:
                body, used = done
                self._finish(body, keep_alive=used == len(buf))
        elif length is not None and len(buf) >= length:
            self._finish(bytes(buf[:length]), keep_alive=len(buf) == length)


def _parse_head(raw: bytes) -> tuple[int, int | None, bool, bool, bytes]:
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
    status = int(parts[1])
    keep_alive = parts[0] == b"HTTP/1.1"
    length: int | None = None
    chunked = False
    encoding = b""
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise HttpProtocolError(f"a header line without a colon: {line[:100]!r}")
        name, value = name.strip().lower(), value.strip()
        if name == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise HttpProtocolError(f"bad Content-Length {value[:40]!r}")
            length = int(value)
        elif name == b"transfer-encoding":
            codings = [c.strip() for c in value.lower().split(b",")]
            if codings[-1] != b"chunked" or any(c not in (b"chunked", b"identity") for c in codings):
                raise HttpProtocolError(f"unsupported Transfer-Encoding {value[:40]!r}")
            chunked = True
        elif name == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            keep_alive = b"close" not in tokens and (keep_alive or b"keep-alive" in tokens)
        elif name == b"content-encoding":
            encoding = value.lower()
    if chunked:  # RFC 9112 6.3: chunked wins over a Content-Length, and the connection is not reused
        length, keep_alive = None, keep_alive and length is None
    if status in (204, 304):
        length = 0
    if length is None and not chunked:
        keep_alive = False  # the body ends when the connection does
    return status, length, chunked, keep_alive, encoding


def _dechunk(buf: bytearray) -> tuple[bytes, int] | None:
    """A complete chunked body at the start of `buf` and the bytes it used; None if incomplete."""
    parts: list[bytes] = []
    pos = 0
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size_text = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpProtocolError(f"bad chunk size {size_text[:40]!r}") from None
        pos = eol + 2
        if size == 0:  # the last chunk, then trailer fields up to an empty line
            end = buf.find(b"\r\n", pos)
            while end > pos:
                pos = end + 2
                end = buf.find(b"\r\n", pos)
            return (b"".join(parts), end + 2) if end >= 0 else None
        if len(buf) < pos + size + 2:
            return None
        if buf[pos + size : pos + size + 2] != b"\r\n":
            raise HttpProtocolError("a chunk does not end with CRLF")
        parts.append(bytes(buf[pos : pos + size]))
        pos += size + 2


class GeneratePool:
    """Keep-alive connections to one engine (or router) for `POST <url>/generate`.

    `post` sends one request and returns (status, body); it raises TimeoutError past `timeout`,
    OSError (ConnectionError and friends, `HttpProtocolError` included) when the connection fails.
    """

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None, max_idle: int = 256) -> None:
        parts = urlsplit(url.rstrip("/"))
        if not self.supports(url) or parts.hostname is None:
            raise ValueError(f"GeneratePool speaks plain http://host:port only, got {url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        host = f"[{self._host}]" if ":" in self._host else self._host
        lines = [f"POST {parts.path}/generate HTTP/1.1", f"Host: {host}:{self._port}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")
        self._idle: list[_Connection] = []
        self._max_idle = max_idle
        self._open: set[_Connection] = set()
        self._closed = False

    @staticmethod
    def supports(url: str) -> bool:
        return urlsplit(url).scheme == "http" and _on_asyncio()

    async def post(self, body: bytes, timeout: float) -> tuple[int, bytes]:
        if self._closed:
            raise ConnectionError("the /generate connection pool is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = self._reuse()
        if conn is None:
            with anyio.fail_at(anyio.current_time() + timeout):
                _, conn = await loop.create_connection(_Connection, self._host, self._port)
            self._open.add(conn)
        waiter: asyncio.Future[_Response] = loop.create_future()
        conn.expect(waiter)
        assert conn.transport is not None
        conn.transport.write(b"%b%d\r\n\r\n%b" % (self._head, len(body), body))
        # A timer that fails the waiter, rather than a cancel scope per request: this runs
        # thousands of times a second, and a scope costs as much as the HTTP exchange.
        timer = loop.call_at(deadline, _expire, waiter, timeout)
        try:
            response = await waiter
        except BaseException:
            self._discard(conn)
            raise
        finally:
            timer.cancel()
        if response.keep_alive and not conn.lost and len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            self._discard(conn)
        return response.status, _inflate(response.body, response.encoding)

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        self._open.clear()
        await anyio.lowlevel.checkpoint()  # let the transports run their close callbacks

    def _reuse(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
            self._discard(conn)
        return None

    def _discard(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)


def _expire(waiter: asyncio.Future[_Response], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError(f"no answer within {timeout:g} s"))


def _inflate(body: bytes, encoding: bytes) -> bytes:
    if encoding in (b"", b"identity"):
        return body
    try:
        if encoding in (b"gzip", b"x-gzip"):
            return zlib.decompress(body, 16 + zlib.MAX_WBITS)
        if encoding == b"deflate":
            return zlib.decompress(body)
    except zlib.error as exc:
        raise HttpProtocolError(f"a {encoding.decode()} body that does not inflate: {exc}") from exc
    raise HttpProtocolError(f"unsupported Content-Encoding {encoding[:40]!r}")


def _on_asyncio() -> bool:
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no asyncio loop running here (trio, or outside any loop): aiohttp decides
        return False
