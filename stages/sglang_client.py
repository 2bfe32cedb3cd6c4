"""The pipeline's HTTP client for SGLang engines (real SGLang, the built-in engine, the simulator).

Two layers:

- `EngineClient` speaks to one URL: an engine, or the router for `/generate`.
- `EngineFleet` is what the pipeline holds: `/generate` goes to one URL (the router, or the only
  engine), and every control call fans out to every engine concurrently, because the router does
  not forward `/abort_request`, `/pause_generation` or the weight endpoints.

Error policy: aiohttp and timeout errors become `EngineUnavailableError`; an engine's non-2xx answer
becomes `EngineError` carrying the URL and status. Only `generate` retries, and only connection
failures and overload answers (429, 500, 502, 503, 504): anything else would fail the same way
again. An HTTP 200 whose `finish_reason.type` is `"abort"` is a result, not an error: it carries
the partial output.
The wire format is `reference/sglang-protocol.md`.
"""

from __future__ import annotations

import gc
import operator
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import anyio
import orjson

from pipeline.errors import EngineError, EngineUnavailableError
from pipeline.types import FinishReason, Segment

__all__ = [
    "PAUSE_MODES",
    "EngineClient",
    "EngineFleet",
    "EngineLoad",
    "EngineStatistics",
    "GenerateResult",
]

# What `/pause_generation` accepts (SGLang >= 0.5.6; older servers ignore the body and abort).
PAUSE_MODES = ("abort", "retract", "in_place")

# Connections kept free for control calls on top of the generation concurrency. Without them a
# pool saturated by `/generate` requests would queue the very `/abort_request` that frees it.
CONTROL_HEADROOM = 32

# Poll pacing for the two waits that must poll (`flush_cache` while busy, `wait_healthy`).
_POLL_FIRST = 0.05
_POLL_MAX = 1.0

_JSON_HEADERS = {"Content-Type": "application/json"}

# Answers worth sending the same /generate again for: the engine (or the router's queue) is
# overloaded or restarting. Any other 4xx would fail the same way again.
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One finished `/generate` call, including an aborted one with its partial output.

    `token_ids` and `logprobs` come from `meta_info.output_token_logprobs` (as slime reads them),
    so they are aligned by construction. `prompt_tokens` and `cached_tokens` are None when the
    engine left them out (a request aborted while still in the waiting queue).
    """

    rid: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    matched: int | str | None  # the stop token id or stop string, for `stop`
    finish_message: str | None  # the abort message, for `abort`
    weight_version: str  # the engine's version when it assembled this output
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None

    @classmethod
    def from_response(cls, payload: object, *, url: str, rid: str) -> GenerateResult:
        """Parse a non-streaming `/generate` body. Anything malformed is an `EngineError` naming `url`."""
        if not isinstance(payload, Mapping):
            raise EngineError(url, f"expected one JSON object from /generate, got {type(payload).__name__}")
        meta = payload.get("meta_info")
        if not isinstance(meta, Mapping):
            raise EngineError(url, f"response has no meta_info object: {_preview(payload)}")
        reason, matched, message = _parse_finish_reason(meta.get("finish_reason"), url)
        entries = meta.get("output_token_logprobs")
        if entries is not None:
            token_ids, logprobs = _parse_logprobs(entries, url)
        else:
            token_ids, logprobs = _int_tuple(payload.get("output_ids", ()), url, "output_ids"), ()
        version = meta.get("weight_version")
        if version is None:
            # SGLang before ~0.5.1 does not stamp outputs; guessing a version would be worse.
            raise EngineError(url, "response has no meta_info.weight_version (SGLang older than 0.5.1?)")
        completion = meta.get("completion_tokens")
        return cls(
            rid=str(meta.get("id", rid)),
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            matched=matched,
            finish_message=message,
            weight_version=str(version),
            prompt_tokens=_opt_int(meta.get("prompt_tokens")),
            completion_tokens=len(token_ids) if completion is None else int(completion),
            cached_tokens=_opt_int(meta.get("cached_tokens")),
        )

    def to_segment(self, version: int) -> Segment:
        """These tokens as a `Segment` stamped with `version`, the clock's integer for
        `weight_version` (the caller checks the two agree)."""
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"request {self.rid} was sent without return_logprob; a segment needs log-probs")
        return Segment(self.token_ids, self.logprobs, self.finish_reason, version)


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


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_INT_ONLY = frozenset({int})
_NUMBERS = frozenset({int, float})
_FLOAT_ONLY = frozenset({float})


def _parse_logprobs(entries: object, url: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    # Real SGLang sends [logprob, token_id, text|null]; some fakes send [logprob, token_id].
    if not isinstance(entries, list):
        raise EngineError(url, f"output_token_logprobs is not a list: {_preview(entries)}")
    fast = _transpose_logprobs(entries)
    if fast is not None:
        return fast
    token_ids: list[int] = []
    logprobs: list[float] = []
    for i, item in enumerate(entries):
        if not isinstance(item, (list, tuple)) or len(item) < 2:
            raise EngineError(url, f"output_token_logprobs[{i}] is not [logprob, token_id, ...]: {item!r}")
        lp, tid = item[0], item[1]
        if not _is_number(lp) or isinstance(tid, bool) or not isinstance(tid, int):
            # orjson writes NaN as null, so a null here is a NaN or a missing value: either way unusable.
            raise EngineError(url, f"output_token_logprobs[{i}] has no usable logprob/token id: {item!r}")
        token_ids.append(tid)
        logprobs.append(float(lp))
    return tuple(token_ids), tuple(logprobs)


def _transpose_logprobs(entries: list) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """The hot path of the whole controller (1k entries per sample): pick the two columns in C,
    then check each column's set of exact types, about a quarter of the cost of a Python loop.

    None when anything is off (a short or non-list entry, a null log-prob, a bool token id): the
    loop then finds the entry and says what is wrong with it. Exact `type` checks refuse bools,
    which `isinstance(x, int)` would let through. A JSON body holds no subscriptable entries besides
    lists, strings and objects; a string yields strings here and an object fails the lookup.
    """
    try:
        logprobs = tuple(map(_FIRST, entries))
        token_ids = tuple(map(_SECOND, entries))
    except (LookupError, TypeError):  # a short entry, an object, or a number
        return None
    if not set(map(type, token_ids)) <= _INT_ONLY:
        return None
    kinds = set(map(type, logprobs))
    if kinds <= _FLOAT_ONLY:
        return token_ids, logprobs
    if kinds <= _NUMBERS:
        return token_ids, tuple(map(float, logprobs))
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_tuple(raw: object, url: str, name: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, int) for x in raw):
        raise EngineError(url, f"{name} is not a list of token ids: {_preview(raw)}")
    return tuple(raw)


def _opt_int(raw: object) -> int | None:
    return None if raw is None else int(raw)  # type: ignore[call-overload]


def _preview(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _error_text(body: bytes) -> str:
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
    return (text[:500] + "...") if len(text) > 500 else (text or "(empty body)")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Requests an engine holds, summed over its data-parallel ranks (`GET /v1/loads`)."""

    running: int
    waiting: int

    @property
    def total(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    requests: int  # /generate attempts sent, retries included
    retries: int
    errors: int  # calls that ended in an EngineError
    aborts: int  # /generate results that came back aborted (with their partial output)
    control_calls: int


@dataclass(slots=True)
class _Counters:
    """Shared by every client of one fleet, so `statistics()` sees the whole fleet."""

    requests: int = 0
    retries: int = 0
    errors: int = 0
    aborts: int = 0
    control_calls: int = 0

    def snapshot(self) -> EngineStatistics:
        return EngineStatistics(self.requests, self.retries, self.errors, self.aborts, self.control_calls)


# --------------------------------------------------------------------------------------------
# One engine


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
        counters: _Counters | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._request_timeout = request_timeout
        self._control_timeout = control_timeout
        self._max_retries = max_retries
        self._retry_backoff = retry_backoff
        self._max_backoff = max_backoff
        self._counters = counters if counters is not None else _Counters()

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
    ) -> GenerateResult:
        """Generate from `input_ids` (token-in, token-out). An abort comes back as a result.

        Connection failures and overload answers (429, 500, 502, 503, 504) are retried
        `max_retries` times with exponential backoff; any other status, or a timed-out attempt,
        is raised at once (a timeout means the engine is stuck, and resending would only queue a
        duplicate behind it).
        """
        url = self.url + "/generate"
        body = orjson.dumps(
            {
                "input_ids": list(input_ids),
                "sampling_params": dict(sampling_params),
                "rid": rid,
                "return_logprob": return_logprob,
            }
        )
        attempt = 0
        while True:
            self._counters.requests += 1
            try:
                status, data = await self._send("POST", "/generate", body, self._request_timeout)
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
                    raise EngineError(url, f"request {rid}: {_error_text(data)}", status=status)
            attempt += 1
            self._counters.retries += 1
            await anyio.sleep(min(self._max_backoff, self._retry_backoff * 2 ** (attempt - 1)))

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

    async def pause(self, mode: str) -> None:
        """Stop generation. `abort` returns in-flight requests partial; `retract` and `in_place`
        keep them inside the engine. New requests wait in the engine until `continue_generation`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
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
                status, data = await self._control_raw("POST", "/flush_cache", None)
                if status == 200:
                    return
                if status != 400:
                    self._counters.errors += 1
                    raise EngineError(url, _error_text(data), status=status)
                last = _error_text(data)
                await anyio.sleep(delay)
                delay = min(delay * 2, _POLL_MAX)
        self._counters.errors += 1
        raise EngineError(url, f"still busy after {deadline:g} s: {last}", status=400)

    async def update_weights_from_disk(self, path: str, *, weight_version: str) -> None:
        """Load weights from `path` (a folder the engine can read) and stamp `weight_version`.

        Bounded by `request_timeout`: loading a real checkpoint takes far longer than a control call.
        """
        body = {"model_path": str(path), "weight_version": weight_version}
        doc = await self._control("POST", "/update_weights_from_disk", body, timeout=self._request_timeout)
        self._check_success("/update_weights_from_disk", doc)

    async def update_weight_version(self, weight_version: str) -> None:
        # `abort_all_requests` defaults to True in newer SGLang; say no explicitly.
        body = {"new_version": weight_version, "abort_all_requests": False}
        doc = await self._control("POST", "/update_weight_version", body)
        self._check_success("/update_weight_version", doc)

    async def weight_version(self) -> str:
        """The engine's current `weight_version` (`/model_info`, or `/get_model_info` on older servers)."""
        status, data = await self._control_raw("GET", "/model_info", None)
        path = "/model_info"
        if status == 404:
            path = "/get_model_info"
            status, data = await self._control_raw("GET", path, None)
        doc = self._expect_ok(path, status, data)
        if not isinstance(doc, Mapping) or doc.get("weight_version") is None:
            self._counters.errors += 1
            raise EngineError(self.url + path, f"no weight_version in {_preview(doc)}")
        return str(doc["weight_version"])

    async def loads(self) -> EngineLoad:
        doc = await self._control("GET", "/v1/loads?include=core", None)
        rows = doc.get("loads") if isinstance(doc, Mapping) else None
        if not isinstance(rows, list):
            self._counters.errors += 1
            raise EngineError(self.url + "/v1/loads", f"no loads list in {_preview(doc)}")
        running = sum(int(r.get("num_running_reqs", 0)) for r in rows)
        waiting = sum(int(r.get("num_waiting_reqs", 0)) for r in rows)
        return EngineLoad(running, waiting)

    async def health(self) -> bool:
        """Whether `GET /health` answers 200 now. Unreachable counts as unhealthy, not as an error."""
        try:
            status, _ = await self._control_raw("GET", "/health", None)
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
                last = f"HTTP {status}: {_error_text(data)}"
            await anyio.sleep(min(delay, max(0.0, end - anyio.current_time())))
            delay = min(delay * 2, _POLL_MAX)
        self._counters.errors += 1
        raise EngineUnavailableError(url, f"not healthy within {deadline:g} s; last: {last}")

    # -- plumbing -----------------------------------------------------------------------------

    async def _control(self, method: str, path: str, body: object, *, timeout: float | None = None) -> Any:
        status, data = await self._control_raw(method, path, body, timeout=timeout)
        return self._expect_ok(path, status, data)

    async def _control_raw(
        self, method: str, path: str, body: object, *, timeout: float | None = None
    ) -> tuple[int, bytes]:
        self._counters.control_calls += 1
        payload = None if body is None else orjson.dumps(body)
        try:
            return await self._send(method, path, payload, self._control_timeout if timeout is None else timeout)
        except EngineError:
            self._counters.errors += 1
            raise

    def _expect_ok(self, path: str, status: int, data: bytes) -> Any:
        if status != 200:
            self._counters.errors += 1
            raise EngineError(self.url + path, _error_text(data), status=status)
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


# --------------------------------------------------------------------------------------------
# The fleet


@dataclass(slots=True)
class _FleetState:
    session: aiohttp.ClientSession
    generator: EngineClient
    workers: tuple[EngineClient, ...] = field(default=())


class EngineFleet:
    """Every engine the pipeline uses, behind one aiohttp session.

    Build it with the engines' URLs (one engine, or several plus `router_url`), or with only
    `router_url`, in which case the workers are discovered from the router on entry
    (`GET /workers`, or `GET /list_workers` on routers up to 0.2.1). Use it as an async context
    manager: the session lives between enter and exit.

    `concurrency` is the most `/generate` requests the caller keeps in flight; the connection pool
    is that plus `CONTROL_HEADROOM`, so control calls never queue behind generation.
    """

    def __init__(
        self,
        worker_urls: Sequence[str] | None = None,
        *,
        router_url: str | None = None,
        concurrency: int = 64,
        request_timeout: float = 3600.0,
        control_timeout: float = 30.0,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
        api_key: str | None = None,
    ) -> None:
        if not worker_urls and router_url is None:
            raise ValueError("an EngineFleet needs worker URLs, a router URL, or both")
        if worker_urls is not None and len(worker_urls) > 1 and router_url is None:
            raise ValueError(f"{len(worker_urls)} engines need a router in front of them: {list(worker_urls)}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._given_workers = tuple(u.rstrip("/") for u in worker_urls) if worker_urls else None
        self._router_url = router_url.rstrip("/") if router_url else None
        self._concurrency = concurrency
        self._client_kw: dict[str, Any] = dict(
            request_timeout=request_timeout,
            control_timeout=control_timeout,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
        )
        self._counters = _Counters()
        self._state: _FleetState | None = None
        # SGLang's --api-key: every request (engines and router alike) carries it.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None

    async def __aenter__(self) -> EngineFleet:
        if self._state is not None:
            raise RuntimeError("this EngineFleet is already open")
        connector = aiohttp.TCPConnector(limit=self._concurrency + CONTROL_HEADROOM)
        session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        try:
            generate_url = self._router_url or self._given_workers[0]  # type: ignore[index]
            self._state = _FleetState(session, self._client(session, generate_url))
            if self._given_workers is not None:
                self._state.workers = tuple(self._client(session, u) for u in self._given_workers)
            else:
                await self.discover_workers()
        except BaseException:
            self._state = None
            with anyio.move_on_after(5, shield=True):
                await session.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        state, self._state = self._state, None
        if state is not None:
            with anyio.move_on_after(5, shield=True):
                await state.session.close()

    def _client(self, session: aiohttp.ClientSession, url: str) -> EngineClient:
        return EngineClient(url, session, counters=self._counters, **self._client_kw)

    @property
    def _open(self) -> _FleetState:
        if self._state is None:
            raise RuntimeError("use the EngineFleet inside `async with` first")
        return self._state

    @property
    def generate_url(self) -> str:
        return self._open.generator.url

    @property
    def worker_urls(self) -> tuple[str, ...]:
        return tuple(w.url for w in self._open.workers)

    @property
    def workers(self) -> tuple[EngineClient, ...]:
        return self._open.workers

    def statistics(self) -> EngineStatistics:
        return self._counters.snapshot()

    async def discover_workers(self) -> tuple[str, ...]:
        """Ask the router which engines it routes to, and fan control calls out to those from now on."""
        state = self._open
        if self._router_url is None:
            raise RuntimeError("worker discovery needs a router_url")
        router = state.generator
        status, data = await router._control_raw("GET", "/workers", None)
        if status == 404:  # sglang-router <= 0.2.1
            doc = router._expect_ok("/list_workers", *await router._control_raw("GET", "/list_workers", None))
            urls = doc.get("urls") if isinstance(doc, Mapping) else None
        else:
            doc = router._expect_ok("/workers", status, data)
            rows = doc.get("workers") if isinstance(doc, Mapping) else None
            urls = [w.get("url") for w in rows] if isinstance(rows, list) else None
        if not urls or not all(isinstance(u, str) for u in urls):
            raise EngineError(router.url, f"router lists no workers: {_preview(doc)}")
        state.workers = tuple(self._client(state.session, u) for u in urls)
        return self.worker_urls

    # -- generation goes to one URL -----------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str,
        return_logprob: bool = True,
    ) -> GenerateResult:
        return await self._open.generator.generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob)

    # -- control calls reach every engine -----------------------------------------------------

    async def abort(self, rid: str) -> None:
        # The router does not forward aborts and does not say where it sent a request.
        await self._fan_out("abort", lambda w: w.abort(rid))

    async def abort_all(self) -> None:
        await self._fan_out("abort_all", lambda w: w.abort_all())

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._fan_out("pause", lambda w: w.pause(mode))

    async def continue_generation(self) -> None:
        await self._fan_out("continue_generation", lambda w: w.continue_generation())

    async def flush_cache(self, deadline: float) -> None:
        await self._fan_out("flush_cache", lambda w: w.flush_cache(deadline))

    async def update_weights_from_disk(self, path: str, *, weight_version: str) -> None:
        await self._fan_out(
            "update_weights_from_disk", lambda w: w.update_weights_from_disk(path, weight_version=weight_version)
        )

    async def update_weight_version(self, weight_version: str) -> None:
        await self._fan_out("update_weight_version", lambda w: w.update_weight_version(weight_version))

    async def weight_versions(self) -> dict[str, str]:
        return await self._fan_out("weight_version", lambda w: w.weight_version())

    async def loads(self) -> dict[str, EngineLoad]:
        return await self._fan_out("loads", lambda w: w.loads())

    async def wait_healthy(self, deadline: float) -> None:
        await self._fan_out("wait_healthy", lambda w: w.wait_healthy(deadline))

    async def _fan_out(self, what: str, call: Callable[[EngineClient], Awaitable[T]]) -> dict[str, T]:
        """Run `call` on every worker at once. Every worker gets the call even if another fails;
        then any failure is raised, naming each worker that failed."""
        workers = self._open.workers
        results: dict[str, T] = {}
        failures: dict[str, EngineError] = {}

        async def one(worker: EngineClient) -> None:
            try:
                results[worker.url] = await call(worker)
            except EngineError as exc:
                failures[worker.url] = exc

        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(one, worker)
        if failures:
            raise _fan_out_error(what, failures, len(workers))
        return {w.url: results[w.url] for w in workers}


def _fan_out_error(what: str, failures: Mapping[str, EngineError], total: int) -> EngineError:
    first = next(iter(failures.values()))
    unreachable = all(isinstance(e, EngineUnavailableError) for e in failures.values())
    kind = EngineUnavailableError if unreachable else EngineError
    status = first.status if len(failures) == 1 else None
    detail = "; ".join(str(e) for e in failures.values())
    error = kind(", ".join(failures), f"{what} failed on {len(failures)} of {total} engines: {detail}", status=status)
    error.__cause__ = first
    return error

