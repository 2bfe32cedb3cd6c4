"""The lean `/generate` connections (`stages.sglang_client.http1`) against a raw scripted HTTP/1.1 server.

The fake SGLang server (aiohttp) covers what SGLang and the router send (see test_sglang_client.py,
which runs every client test over both transports); this covers the rest of HTTP/1.1 a proxy
may use: chunked bodies, interim answers, compression, bodies delimited by a close, and the
connection handling around cancellations and deadlines.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator

import anyio
import pytest

from core.errors import EngineUnavailableError
from stages.sglang_client.engine_client import EngineClient
from stages.sglang_client.http1 import GeneratePool, HttpProtocolError

pytestmark = pytest.mark.anyio

HOLD = b"<hold>"  # script entry: read the request, never answer
CLOSE = b"<close>"  # script entry: read the request, close the connection without an answer
CUT = b"<cut>"  # ends a script entry: send what comes before, then close the connection


class Scripted:
    """A raw server on 127.0.0.1: each request read in full, answered with the next script entry."""

    def __init__(self, *answers: bytes) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.hung_up = anyio.Event()  # a client closed a connection it had a request pending on
        self.url = ""

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = next(int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                              if k.lower() == b"content-length")  # fmt: skip
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if answer is HOLD:
                    await reader.read()  # until the client hangs up
                    self.hung_up.set()
                    return
                if answer is CLOSE:
                    return
                writer.write(answer.removesuffix(CUT))
                await writer.drain()
                if b"Connection: close" in answer or b"HTTP/1.0" in answer or answer.endswith(CUT):
                    return
        finally:
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%bContent-Length: %d\r\n\r\n%b" % (
        extra, len(body), body,
    )  # fmt: skip


@pytest.fixture
async def pools() -> AsyncIterator[list[GeneratePool]]:
    made: list[GeneratePool] = []
    yield made
    for pool in made:
        await pool.aclose()


def pool_for(server: Scripted, made: list[GeneratePool], **kw) -> GeneratePool:  # type: ignore[no-untyped-def]
    pool = GeneratePool(server.url, **kw)
    made.append(pool)
    return pool


async def test_requests_are_plain_http_and_reuse_one_connection(pools):
    async with Scripted(ok(b'{"a":1}'), ok(b'{"a":2}'), ok(b"")) as server:
        pool = pool_for(server, pools, headers={"Authorization": "Bearer k"})
        assert await pool.post(b'{"x":1}', 5) == (200, b'{"a":1}')
        assert await pool.post(b'{"x":2}', 5) == (200, b'{"a":2}')
        assert await pool.post(b"{}", 5) == (200, b"")
        assert server.connections == 1
        port = server.url.rsplit(":", 1)[1]
        assert server.requests[0] == (
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:%b\r\nContent-Type: application/json\r\n"
            b'Authorization: Bearer k\r\nContent-Length: 7\r\n\r\n{"x":1}' % port.encode()
        )


async def test_chunked_bodies_with_extensions_and_trailers_and_interim_answers(pools):
    chunked = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'4;ext=1\r\n{"a"\r\n3\r\n:12\r\n1\r\n}\r\n0\r\nX-Trailer: t\r\n\r\n'
    )
    async with Scripted(chunked, ok(b"{}")) as server:
        pool = pool_for(server, pools)
        assert await pool.post(b"{}", 5) == (200, b'{"a":12}')
        assert await pool.post(b"{}", 5) == (200, b"{}")  # the connection was left in step
        assert server.connections == 1


async def test_gzip_bodies_are_inflated(pools):
    async with Scripted(ok(gzip.compress(b'{"z":0}'), b"Content-Encoding: gzip\r\n")) as server:
        assert await pool_for(server, pools).post(b"{}", 5) == (200, b'{"z":0}')


async def test_close_delimited_and_connection_close_answers_open_a_new_connection(pools):
    async with Scripted(
        b"HTTP/1.0 503 Service Unavailable\r\n\r\nbusy", ok(b"{}", b"Connection: close\r\n"), ok(b"[]")
    ) as server:
        pool = pool_for(server, pools)
        assert await pool.post(b"{}", 5) == (503, b"busy")
        assert await pool.post(b"{}", 5) == (200, b"{}")
        assert await pool.post(b"{}", 5) == (200, b"[]")
        assert server.connections == 3


async def test_a_malformed_answer_is_a_protocol_error_and_the_client_calls_it_unavailable(pools):
    async with Scripted(b"SMTP ready\r\n\r\n", b"SMTP ready\r\n\r\n") as server:
        with pytest.raises(HttpProtocolError, match="not an HTTP/1.x status line"):
            await pool_for(server, pools).post(b"{}", 5)
        engine = EngineClient(server.url, None, request_timeout=5, control_timeout=5, max_retries=0,  # type: ignore[arg-type]
                              generate_pool=pool_for(server, pools))  # fmt: skip
        with pytest.raises(EngineUnavailableError, match="HttpProtocolError") as info:
            await engine.generate([1, 2], {}, rid="r")
        assert info.value.url == server.url + "/generate"


async def test_a_deadline_or_a_cancellation_hangs_up_and_the_next_request_starts_afresh(pools):
    async with Scripted(HOLD, HOLD, ok(b"{}")) as server:
        pool = pool_for(server, pools)
        with anyio.fail_after(5):
            with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
                await pool.post(b"{}", 0.2)
            await server.hung_up.wait()  # the engine sees the disconnect, as SGLang aborts on it
            server.hung_up = anyio.Event()
            with anyio.move_on_after(0.2) as scope:
                await pool.post(b"{}", 60)
            assert scope.cancelled_caught
            await server.hung_up.wait()
            assert await pool.post(b"{}", 5) == (200, b"{}")
        assert server.connections == 3


async def test_an_unreachable_engine_is_a_connection_error(pools):
    async with Scripted() as server:
        url = server.url
    with pytest.raises(ConnectionRefusedError):
        await GeneratePool(url).post(b"{}", 5)


def test_only_plain_http_is_spoken():
    with pytest.raises(ValueError, match="plain http"):
        GeneratePool("https://127.0.0.1:1")


async def test_a_keep_alive_connection_the_engine_closed_is_resent_on_a_new_one_as_a_new_request(pools):
    """uvicorn closes a connection idle for 5 s; a request sent on it just then gets no answer. The
    pool does not resend it by itself (the engine may have started it): the client's retry does,
    on a new connection and under a new rid."""
    answer = b'{"meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 0}, "weight_version": "0"}}'
    async with Scripted(ok(answer), CLOSE, ok(answer)) as server:
        engine = EngineClient(server.url, None, request_timeout=5, control_timeout=5, max_retries=1,  # type: ignore[arg-type]
                              retry_backoff=0.001, generate_pool=pool_for(server, pools))  # fmt: skip
        await engine.generate([1], {}, rid="first")
        result = await engine.generate([1], {}, rid="second")
    assert result.finish_reason.value == "length"
    assert server.connections == 2 and engine.statistics().retries == 1
    rids = [r.rsplit(b'"rid":', 1)[1].split(b",", 1)[0] for r in server.requests]
    assert rids == [b'"first"', b'"second"', b'"second.retry1"']


async def test_a_connection_reset_mid_body_is_a_connection_error_and_the_client_resends(pools):
    answer = b'{"meta_info": {"finish_reason": {"type": "length", "length": 0}, "weight_version": "0"}}'
    truncated = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(answer), answer[:20]) + CUT
    async with Scripted(truncated, truncated, ok(answer)) as server:
        with pytest.raises(ConnectionResetError, match="before its answer was complete"):
            await pool_for(server, pools).post(b"{}", 5)
        engine = EngineClient(server.url, None, request_timeout=5, control_timeout=5, max_retries=1,  # type: ignore[arg-type]
                              retry_backoff=0.001, generate_pool=pool_for(server, pools))  # fmt: skip
        result = await engine.generate([1], {}, rid="r")
    assert result.finish_reason.value == "length" and engine.statistics().retries == 1
