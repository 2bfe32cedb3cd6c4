"""`EngineClient`: HTTP calls to one SGLang-protocol server (an engine, or the router for `/generate`).

Error policy: aiohttp and timeout errors become `EngineUnavailableError`; an engine's non-2xx answer
becomes `EngineError` carrying the URL and status. Only `generate` retries, and only connection
failures and overload answers (408, 429, 500, 502, 503, 504): anything else would fail the same way
again. An HTTP 200 whose `finish_reason.type` is `"abort"` is a result, not an error: it carries
the partial output.
"""

from __future__ import annotations

import gc
import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson

from core.errors import EngineError, EngineUnavailableError
from core.types import FinishReason, PauseMode
from stages.sglang_client.http1 import GeneratePool
from stages.sglang_client.wire import (
    PAUSE_MODES,
    EngineLoad,
    GenerateResult,
    error_text,
    preview,
)

__all__ = ["EngineClient", "EngineStatistics", "RequestCounters", "folder_for_engine"]

# Poll pacing for the two waits that must poll (`flush_cache` while busy, `wait_healthy`).
_POLL_FIRST = 0.05
_POLL_MAX = 1.0

_JSON_HEADERS = {"Content-Type": "application/json"}

# Answers worth sending the same /generate again for: the engine (or the router's queue) is
# overloaded or restarting. sglang-router answers 429 when its queue is full and 408 when a
# request waited in it past --queue-timeout-secs. Any other 4xx would fail the same way again.
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def folder_for_engine(path: str | os.PathLike[str]) -> str:
    """A weights folder as the engine must be told it: absolute.

    An engine resolves a relative path in its own working directory, which is not this process's
    for an engine the user started (`weights/v1` then "does not exist" at the first publish, after
    step 0 was committed). A path that names no local folder is left as it is: a Hub id, or a
    folder only the engine's host has.
    """
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else os.fspath(path)


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    requests: int  # /generate attempts sent, retries included
    retries: int
    errors: int  # calls that ended in an EngineError
    aborts: int  # /generate results that came back aborted (with their partial output)
    control_calls: int


@dataclass(slots=True)
class RequestCounters:
    """Shared by every client of one fleet, so `statistics()` sees the whole fleet."""

    requests: int = 0
    retries: int = 0
    errors: int = 0
    aborts: int = 0
    control_calls: int = 0

    def snapshot(self) -> EngineStatistics:
        return EngineStatistics(self.requests, self.retries, self.errors, self.aborts, self.control_calls)


class EngineClient:
    """HTTP calls to one SGLang-protocol server. Holds no connection of its own: `session` does.

    `request_timeout` bounds one `/generate` attempt (a long generation is normal) and weight
    updates; `control_timeout` bounds every other call.
    """

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        request_timeout: float,
        control_timeout: float,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
        max_backoff: float = 8.0,
        counters: RequestCounters | None = None,
        generate_pool: GeneratePool | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        # With a pool, `/generate` goes over its lean keep-alive connections (see http1.py); the
        # pool's owner (the fleet) closes it. Every other call uses the aiohttp session.
        self._generate_pool = generate_pool
        self._request_timeout = request_timeout
        self._control_timeout = control_timeout
        self._max_retries = max_retries
        self._retry_backoff = retry_backoff
        self._max_backoff = max_backoff
        self._counters = counters if counters is not None else RequestCounters()

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    def statistics(self) -> EngineStatistics:
        return self._counters.snapshot()

    # -- generation ---------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str,
        return_logprob: bool = True,
        **fields: Any,
    ) -> GenerateResult:
        """Generate from `input_ids` (token-in, token-out). An abort comes back as a result.

        `fields` are further top-level request fields (`return_routed_experts`,
        `routed_experts_start_len`, `top_logprobs_num`: `stages.sglang_client.payloads`).

        Connection failures and overload answers (408, 429, 500, 502, 503, 504) are retried
        `max_retries` times with exponential backoff; any other status, or a timed-out attempt,
        is raised at once (a timeout means the engine is stuck, and resending would only queue a
        duplicate behind it).
        """
        url = self.url + "/generate"
        # orjson writes tuples and dicts as they are: copy only what it cannot write (a column,
        # core.columns, is an array: `tolist` copies it in C).
        if type(input_ids) not in (tuple, list):
            input_ids = input_ids.tolist() if isinstance(input_ids, array) else list(input_ids)
        doc = {
            "input_ids": input_ids,
            "sampling_params": sampling_params if type(sampling_params) is dict else dict(sampling_params),
            "rid": rid,
            "return_logprob": return_logprob,
            **fields,
        }
        body = orjson.dumps(doc)
        attempt = 0
        while True:
            if attempt:
                # A resend is a new request to the engine: the one before may still be running there
                # (SGLang notices a hung-up client only seconds later), and a second request under
                # its rid is refused as a duplicate or shares its state. The suffix keeps `rid` a
                # prefix, so `abort(rid)` (a prefix match) still reaches every attempt.
                doc["rid"] = f"{rid}.retry{attempt}"
                body = orjson.dumps(doc)
            self._counters.requests += 1
            try:
                status, data = await self._post_generate(url, body)
            except EngineUnavailableError as exc:
                if isinstance(exc.__cause__, TimeoutError) or attempt >= self._max_retries:
                    self._counters.errors += 1
                    raise
            else:
                if status == 200:
                    result = self._parse_generate(url, data, rid)
                    if result.finish_reason is FinishReason.ABORT:
                        self._counters.aborts += 1
                    return result
                if status not in _RETRY_STATUSES or attempt >= self._max_retries:
                    self._counters.errors += 1
                    raise EngineError(url, f"request {rid}: {error_text(data)}", status=status)
            attempt += 1
            self._counters.retries += 1
            await anyio.sleep(min(self._max_backoff, self._retry_backoff * 2 ** (attempt - 1)))

    async def _post_generate(self, url: str, body: bytes) -> tuple[int, bytes]:
        if self._generate_pool is None:
            return await self._send("POST", "/generate", body, self._request_timeout)
        try:
            return await self._generate_pool.post(body, self._request_timeout)
        except TimeoutError as exc:  # before OSError, which it subclasses; cancellation is neither
            raise EngineUnavailableError(url, f"no answer within {self._request_timeout:g} s") from exc
        except OSError as exc:
            raise EngineUnavailableError(url, f"{type(exc).__name__}: {exc}") from exc

    def _parse_generate(self, url: str, data: bytes, rid: str) -> GenerateResult:
        # The parsed body holds one small list per token, 1k per answer: enough to set off
        # CPython's cyclic GC on every answer (a young collection needs 700 new containers), and
        # an older, whole-heap one every few dozen. None of those lists outlives this call, so the
        # collector is held off until they are freed again; nothing here awaits or calls user code.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return GenerateResult.from_response(orjson.loads(data), url=url, rid=rid)
        except orjson.JSONDecodeError as exc:
            self._counters.errors += 1
            raise EngineError(url, f"request {rid}: answer is not JSON: {data[:200]!r}", status=200) from exc
        except EngineError:
            self._counters.errors += 1
            raise
        finally:
            if collecting:
                gc.enable()

    # -- control ------------------------------------------------------------------------------

    async def abort(self, rid: str) -> None:
        """Abort requests whose rid starts with `rid` (SGLang matches by prefix); unknown rids are a no-op."""
        await self._control("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        """Abort every request; each in-flight `/generate` returns its partial output."""
        await self._control("POST", "/abort_request", {"abort_all": True})

    async def pause(self, mode: PauseMode | str) -> None:
        """Stop generation. `abort` returns in-flight requests partial; `retract` and `in_place`
        keep them inside the engine. New requests wait in the engine until `continue_generation`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {[str(m) for m in PAUSE_MODES]}, got {mode!r}")
        await self._control("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._control("POST", "/continue_generation", {})

    async def flush_cache(self, deadline: float) -> None:
        """Flush the prefix cache, retrying while the engine answers 400 because it still holds
        requests, for at most `deadline` seconds."""
        url = self.url + "/flush_cache"
        last = "no answer yet"
        with anyio.move_on_after(deadline):
            delay = _POLL_FIRST
            while True:
                status, data = await self.control_raw("POST", "/flush_cache", None)
                if status == 200:
                    return
                if status != 400:
                    self._counters.errors += 1
                    raise EngineError(url, error_text(data), status=status)
                last = error_text(data)
                await anyio.sleep(delay)
                delay = min(delay * 2, _POLL_MAX)
        self._counters.errors += 1
        raise EngineError(url, f"still busy after {deadline:g} s: {last}", status=400)

    async def update_weights_from_disk(self, path: str, *, weight_version: str, flush_cache: bool = True) -> None:
        """Load weights from `path` (a folder the engine can read) and stamp `weight_version`.

        Bounded by `request_timeout`: loading a real checkpoint takes far longer than a control call.
        `flush_cache=False` while the engine holds requests (an in_place or retract pause): SGLang
        asserts that its flush after loading succeeded, and it cannot then. Servers before the
        field (late 2025) ignore it and always flush.
        """
        body: dict[str, Any] = {"model_path": folder_for_engine(path), "weight_version": weight_version}
        if not flush_cache:
            body["flush_cache"] = False
        doc = await self._control("POST", "/update_weights_from_disk", body, timeout=self._request_timeout)
        self._check_success("/update_weights_from_disk", doc)

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the weight-update group (SGLang 3.2). Blocks until every rank joined, so the caller
        joins rank 0 concurrently; bounded by `request_timeout`."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        doc = await self._control("POST", "/init_weights_update_group", body, timeout=self._request_timeout)
        self._check_success("/init_weights_update_group", doc)

    async def update_weights_from_distributed(
        self, specs: Sequence[Any], *, group_name: str, weight_version: str | None, flush_cache: bool = True
    ) -> None:
        """Receive one bucket of tensors (`TensorSpec`s: name, dtype, shape) that rank 0 broadcasts
        while this call is pending; the plural batched form of SGLang >= mid-2025."""
        body = {
            "names": [s.name for s in specs],
            "dtypes": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        doc = await self._control("POST", "/update_weights_from_distributed", body, timeout=self._request_timeout)
        self._check_success("/update_weights_from_distributed", doc)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        weight_version: str | None,
        flush_cache: bool = True,
        load_format: str = "flattened_bucket",
    ) -> None:
        """Hand over one bucket of tensors by CUDA IPC (SGLang 3.3): one serialized entry per TP rank
        of the engine (`stages.sglang_client.publish_tensor`). Returns once the engine has copied them, so
        the caller may free what the handles point to. Bounded by `request_timeout`."""
        body = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        doc = await self._control("POST", "/update_weights_from_tensor", body, timeout=self._request_timeout)
        self._check_success("/update_weights_from_tensor", doc)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Give the engine's GPU memory back (SGLang 3.4; the server needs `--enable-memory-saver`):
        `tags` among weights, kv_cache, cuda_graph; None is all. Bounded by `request_timeout`:
        unmapping tens of GB is no quick control call."""
        body = {"tags": None if tags is None else list(tags)}
        await self._control("POST", "/release_memory_occupation", body, timeout=self._request_timeout)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take released GPU memory again (SGLang 3.4); resumed weights hold nothing until a publish."""
        body = {"tags": None if tags is None else list(tags)}
        await self._control("POST", "/resume_memory_occupation", body, timeout=self._request_timeout)

    async def tp_size(self) -> int:
        """The engine's tensor-parallel size (`/server_info`, or `/get_server_info` on older servers)."""
        status, data = await self.control_raw("GET", "/server_info", None)
        path = "/server_info"
        if status == 404:
            path = "/get_server_info"
            status, data = await self.control_raw("GET", path, None)
        doc = self.expect_ok(path, status, data)
        size = doc.get("tp_size", 1) if isinstance(doc, Mapping) else None
        if not isinstance(size, int) or size < 1:
            self._counters.errors += 1
            raise EngineError(self.url + path, f"no usable tp_size in {preview(doc)}")
        return size

    async def destroy_weights_update_group(self, group_name: str) -> None:
        doc = await self._control("POST", "/destroy_weights_update_group", {"group_name": group_name})
        self._check_success("/destroy_weights_update_group", doc)

    async def update_weight_version(self, weight_version: str) -> None:
        # `abort_all_requests` defaults to True in newer SGLang; say no explicitly.
        body = {"new_version": weight_version, "abort_all_requests": False}
        doc = await self._control("POST", "/update_weight_version", body)
        self._check_success("/update_weight_version", doc)

    async def weight_version(self) -> str:
        """The engine's current `weight_version` (`/model_info`, or `/get_model_info` on older servers)."""
        status, data = await self.control_raw("GET", "/model_info", None)
        path = "/model_info"
        if status == 404:
            path = "/get_model_info"
            status, data = await self.control_raw("GET", path, None)
        doc = self.expect_ok(path, status, data)
        if not isinstance(doc, Mapping) or doc.get("weight_version") is None:
            self._counters.errors += 1
            # A server that answers every path with a page (a web app) is not SGLang: say so.
            said = error_text(data) if isinstance(doc, str) else f"no weight_version in {preview(doc)}"
            raise EngineError(self.url + path, said)
        return str(doc["weight_version"])

    async def loads(self) -> EngineLoad:
        doc = await self._control("GET", "/v1/loads?include=core", None)
        rows = doc.get("loads") if isinstance(doc, Mapping) else None
        if not isinstance(rows, list):
            self._counters.errors += 1
            raise EngineError(self.url + "/v1/loads", f"no loads list in {preview(doc)}")
        running = sum(int(r.get("num_running_reqs", 0)) for r in rows)
        waiting = sum(int(r.get("num_waiting_reqs", 0)) for r in rows)
        return EngineLoad(running, waiting)

    async def health(self) -> bool:
        """Whether `GET /health` answers 200 now. Unreachable counts as unhealthy, not as an error."""
        try:
            status, _ = await self.control_raw("GET", "/health", None)
        except EngineUnavailableError:
            return False
        return status == 200

    async def wait_healthy(self, deadline: float) -> None:
        """Wait up to `deadline` seconds until `/health_generate` answers 200.

        This polls, the one place that does: it waits for another process to come up, and
        there is nothing to be notified by.
        """
        url = self.url + "/health_generate"
        end = anyio.current_time() + deadline
        delay = _POLL_FIRST
        last = "no answer yet"
        while (left := end - anyio.current_time()) > 0:
            try:
                status, data = await self._send("GET", "/health_generate", None, min(self._control_timeout, left))
            except EngineUnavailableError as exc:
                last = str(exc)
            else:
                if status == 200:
                    return
                last = f"HTTP {status}: {error_text(data)}"
            await anyio.sleep(min(delay, max(0.0, end - anyio.current_time())))
            delay = min(delay * 2, _POLL_MAX)
        self._counters.errors += 1
        raise EngineUnavailableError(url, f"not healthy within {deadline:g} s; last: {last}")

    async def router_workers(self) -> tuple[str, ...]:
        """The engine URLs a router routes to (`GET /workers`, or `/list_workers` up to sglang-router 0.2.1)."""
        status, data = await self.control_raw("GET", "/workers", None)
        if status == 404:  # sglang-router <= 0.2.1
            doc = self.expect_ok("/list_workers", *await self.control_raw("GET", "/list_workers", None))
            urls = doc.get("urls") if isinstance(doc, Mapping) else None
        else:
            doc = self.expect_ok("/workers", status, data)
            rows = doc.get("workers") if isinstance(doc, Mapping) else None
            urls = [w.get("url") for w in rows] if isinstance(rows, list) else None
        if not urls or not all(isinstance(u, str) for u in urls):
            raise EngineError(self.url, f"router lists no workers: {preview(doc)}")
        return tuple(urls)

    # -- plumbing -----------------------------------------------------------------------------

    async def _control(self, method: str, path: str, body: object, *, timeout: float | None = None) -> Any:
        status, data = await self.control_raw(method, path, body, timeout=timeout)
        return self.expect_ok(path, status, data)

    async def control_raw(
        self, method: str, path: str, body: object, *, timeout: float | None = None
    ) -> tuple[int, bytes]:
        """One control call, its status and body as they came: for a caller that reads an answer
        other than 200 itself (an older server's 404, a router's 202); `expect_ok` checks the rest."""
        self._counters.control_calls += 1
        payload = None if body is None else orjson.dumps(body)
        try:
            return await self._send(method, path, payload, self._control_timeout if timeout is None else timeout)
        except EngineError:
            self._counters.errors += 1
            raise

    def expect_ok(self, path: str, status: int, data: bytes) -> Any:
        """The body of a 200 answer (JSON, else text, None when empty); any other status raises
        `EngineError` with the engine's message."""
        if status != 200:
            self._counters.errors += 1
            raise EngineError(self.url + path, error_text(data), status=status)
        if not data.strip():
            return None  # /abort_request answers 200 with an empty body
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            return data.decode("utf-8", "replace")  # /flush_cache and friends answer plain text

    def _check_success(self, path: str, doc: object) -> None:
        if isinstance(doc, Mapping) and doc.get("success") is False:
            self._counters.errors += 1
            raise EngineError(self.url + path, str(doc.get("message", "success: false")))

    async def probe(self, path: str, timeout: float) -> tuple[int, bytes]:
        """One `GET path` within `timeout`, not counted as a control call and never retried: a
        health probe, whose status the caller reads (a 503 can be an answer, not an error)."""
        return await self._send("GET", path, None, timeout)

    async def _send(self, method: str, path: str, payload: bytes | None, timeout: float) -> tuple[int, bytes]:
        """One HTTP exchange with a total deadline. Translates aiohttp's errors; never retries."""
        url = self.url + path
        try:
            async with self._session.request(
                method,
                url,
                data=payload,
                headers=_JSON_HEADERS if payload is not None else None,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError as exc:  # aiohttp's timeouts subclass TimeoutError; cancellation does not
            raise EngineUnavailableError(url, f"no answer within {timeout:g} s") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailableError(url, f"{type(exc).__name__}: {exc}") from exc
