"""A small in-process server that speaks SGLang's HTTP protocol, for client and stage tests.

It follows `reference/sglang-protocol.md` where a client can tell: 3-element logprob entries, the
four finish-reason shapes (including the waiting-queue abort, which has no `status_code`,
`prompt_tokens` or `cached_tokens`), aborts that return the partial output with HTTP 200, pause
modes, `/flush_cache` answering 400 while requests are held, weight versions stamped when the
output is assembled with per-token spans in `meta_info.weight_versions` (a boundary wherever the
version changed while the request was tracked; `legacy_versions=True` sends only `weight_version`,
like servers before the spans), `min_new_tokens` holding off stops, `/v1/loads`, and the info routes
the real sglang-router reads when it registers a worker (`/health`, `/server_info`, `/model_info`).

It is scriptable without sleeps:

- tokens are a deterministic function of (sampling seed, context), so a continuation of a prefix
  produces exactly the tokens an uninterrupted request would have;
- `hold_at = k` parks every request before its k-th new token until `release()` or an abort,
  and `wait_until(predicate)` wakes on every state change (token, hold, finish, abort, pause);
- `max_running` keeps extra requests in a waiting queue;
- `fail(path, status, times)` and `drop(path, times)` inject 5xx answers and dropped connections;
  `drop_admitted(times)` drops a `/generate` connection after admitting its request, whose rid the
  engine then keeps (as SGLang does until it notices the hang-up) until an abort;
- `legacy_waiting_abort=True` answers a request aborted in the waiting queue as SGLang did up to
  late 2025 ("Abort before prefill": no weight_version, no output_ids, no log-probs);
- `health_waits_while_paused=True` makes `/health` hang while paused (SGLang ~0.5.x serves it with
  `/health_generate`'s handler); `health_generate_gate` (an Event) holds `/health_generate` until
  set; `loading = True` holds `/update_weights_from_disk` (and answers
  `/health*` 503) until cleared;
- a weight update that asks for a flush while requests are held answers 500 and leaves the fake
  unhealthy, as SGLang's scheduler asserts that flush and dies;
- memory occupation as a server started with `--enable-memory-saver` (SGLang 3.3, 3.4): released
  tags are kept (`released`), and what kills SGLang kills the fake (500, unhealthy): a release
  while requests are held (an assertion), a resume of a tag that is not released (torch_memory_saver
  exits the process), a tensor update into released weights or a `/generate` on a released KV
  cache (the kernels touch unmapped memory). `memory_log` keeps (path, body) of the memory and
  tensor calls and `control_log` the path of every call but `/generate` and the health probes, in
  order; `tp_size` is what `/server_info` reports.

Run it with `async with FakeSGLang() as fake:` and point a client at `fake.url` (127.0.0.1, port 0).
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from core.types import PauseMode

from .fake_moe import MoeShape, RouteLog, sampler_head

__all__ = ["FakeRequest", "FakeSGLang", "TokenFn", "default_token_fn", "detokenize"]

# (context = prompt + tokens so far, sampling seed) -> next token id
TokenFn = Callable[[Sequence[int], int], int]

_PAUSE_MODES = tuple(PauseMode)  # the one spelling, core.types
_CACHE_ENTRIES = 256


def default_token_fn(vocab_size: int = 512, *, eos_token_id: int = 0, eos_every: int | None = None) -> TokenFn:
    """Tokens in [1, vocab_size) from a hash of (seed, length, last tokens); with `eos_every=n`,
    about one token in n is `eos_token_id`, so response lengths vary the way real ones do."""

    def next_token(context: Sequence[int], seed: int) -> int:
        h = zlib.crc32(f"{seed}:{len(context)}:{list(context[-4:])}".encode())
        if eos_every and h % eos_every == 0:
            return eos_token_id
        return 1 + (h >> 8) % (vocab_size - 1)

    return next_token


def detokenize(token_ids: Sequence[int]) -> str:
    """The fake's "tokenizer": one letter per token, so stop strings can match."""
    return "".join(chr(ord("a") + t % 26) for t in token_ids)


def _logprob(context: Sequence[int], token: int, seed: int) -> float:
    h = zlib.crc32(f"lp:{seed}:{len(context)}:{token}".encode())
    return -((h % 3000) + 1) / 1000.0


class _QuietHttp2Probe(logging.Filter):
    """sglang-router opens with an HTTP/2 preface before falling back to HTTP/1.1; aiohttp logs
    each such probe as an error with a traceback, which buries real failures in test output."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI" in str(exc))


_quiet_probe = _QuietHttp2Probe()


@dataclass
class FakeRequest:
    """One tracked `/generate` request, as the fake's scheduler sees it."""

    rid: str
    input_ids: tuple[int, ...]
    sampling_params: dict[str, Any]
    return_logprob: bool
    seed: int
    state: str = "waiting"  # waiting | running
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False
    held: bool = False  # parked at the hold gate or by an in-place/retract pause right now
    started: float = field(default_factory=time.perf_counter)
    # (first output index, weight version) for each run of tokens decoded under one version.
    version_marks: list[tuple[int, str]] = field(default_factory=list)
    # R3 and SC, when asked for (`fake_moe`): the routes of every forward, the top-k of every step.
    routes: RouteLog | None = None
    routed_experts_start_len: int = 0
    top_logprobs_num: int = 0
    heads: list[list[Any]] = field(default_factory=list)

    def mark_version(self, version: str) -> None:
        """Tokens from here on come from `version`, as SGLang records a boundary on a publish."""
        at = len(self.output_ids)
        if self.version_marks and self.version_marks[-1][0] == at:
            self.version_marks.pop()  # no token came from the version it replaces
        if not self.version_marks or self.version_marks[-1][1] != version:
            self.version_marks.append((at, version))

    def version_spans(self) -> list[dict[str, Any]]:
        """`meta_info.weight_versions`: contiguous from 0, the last end is the output length."""
        ends = [start for start, _ in self.version_marks[1:]] + [len(self.output_ids)]
        return [
            {"version": version, "start": start, "end": end}
            for (start, version), end in zip(self.version_marks, ends, strict=True)
        ]


@dataclass(frozen=True, slots=True)
class _Fault:
    status: int | None  # None: drop the connection without answering
    message: str


class FakeSGLang:
    """One fake engine. `weight_version` starts as real SGLang's ("default") unless given;
    `eos_token_id` ends a response (unless `ignore_eos`) whenever `token_fn` produces it; the
    default `token_fn` never does, so responses run to `max_new_tokens` (use
    `default_token_fn(eos_every=n)` for varied lengths)."""

    def __init__(
        self,
        *,
        weight_version: str = "default",
        token_fn: TokenFn | None = None,
        eos_token_id: int = 0,
        max_running: int | None = None,
        model_path: str = "fake-sglang-model",
        legacy_model_info: bool = False,
        legacy_versions: bool = False,
        legacy_waiting_abort: bool = False,
        health_waits_while_paused: bool = False,
        moe: MoeShape | None = None,
        ignore_routed_experts_start_len: bool = False,
    ) -> None:
        self._requests: dict[str, FakeRequest] = {}
        # An MoE model answers `return_routed_experts` (`fake_moe`); None refuses it, as SGLang
        # started without --enable-return-routed-experts does. Some builds ignore
        # `routed_experts_start_len` and answer every row from 0 without echoing it.
        self.moe = moe
        self.ignore_routed_experts_start_len = ignore_routed_experts_start_len
        self._weight_version = weight_version
        # Older servers (before the late-2026 spans) send only `meta_info.weight_version`.
        self.legacy_versions = legacy_versions
        # SGLang up to late 2025 answers a request aborted before prefill with `meta_info` holding
        # only id, finish_reason ("Abort before prefill"), prompt_tokens 0 and completion_tokens 0:
        # no weight_version, no output_ids, no log-probs.
        self.legacy_waiting_abort = legacy_waiting_abort
        # SGLang ~0.5.x serves /health with /health_generate's handler, which waits (up to 20 s)
        # for a decode step: while paused, both hang rather than answer.
        self.health_waits_while_paused = health_waits_while_paused
        # Set to an Event: `/health_generate` waits for it (a probe waiting for its decode step), then
        # answers as it would at that moment (503 if a pause began meanwhile).
        self.health_generate_gate: anyio.Event | None = None
        self.token_fn = token_fn or default_token_fn(eos_token_id=eos_token_id)
        self.eos_token_id = eos_token_id
        self.max_running = max_running
        self.model_path = model_path
        # Older servers have only /get_model_info; /model_info then answers 404.
        self.legacy_model_info = legacy_model_info

        # Script knobs a test sets directly.
        self.hold_at: int | None = None
        self.healthy = True
        self.starting_polls = 0  # /health* answer 503 this many more times, like a server still starting
        self.flush_busy_times = 0  # /flush_cache answers 400 this many more times even when idle
        self.weight_update_error: str | None = None  # while set, weight updates fail with this message
        self.tp_size = 1
        self._loading = False

        # What happened, for assertions.
        self.calls: Counter[str] = Counter()
        self.control_log: list[str] = []
        self.memory_log: list[tuple[str, Any]] = []
        self.released: set[str] = set()
        self.generate_payloads: list[dict[str, Any]] = []
        self.loaded_paths: list[str] = []
        self.finished: list[FakeRequest] = []

        self.paused: str | None = None
        self._faults: dict[str, deque[_Fault]] = {}
        # Requests whose client hung up after they were admitted: SGLang keeps such a request (and
        # its rid) until it notices the disconnect, seconds later; the fake until an abort.
        self._orphans: set[str] = set()
        self._orphan_next = 0
        self._cache: deque[tuple[int, ...]] = deque(maxlen=_CACHE_ENTRIES)
        self._changed = anyio.Event()
        self._closing = False
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def loading(self) -> bool:
        """While set, `/update_weights_from_disk` waits (a checkpoint loading) until it is cleared;
        meanwhile `/health*` answer 503, as SGLang's do when no output arrives for 20 s."""
        return self._loading

    @loading.setter
    def loading(self, value: bool) -> None:
        self._loading = value
        self._notify()

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        """A new version serves from the next token on: every tracked request (running, waiting,
        held in place or retracted) records the boundary at its current length, as SGLang does."""
        self._weight_version = version
        for req in self._requests.values():
            req.mark_version(version)

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> FakeSGLang:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        server_log = logging.getLogger("aiohttp.server")
        if _quiet_probe not in server_log.filters:
            server_log.addFilter(_quiet_probe)
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        app.add_routes(self._routes())
        # handler_cancellation: a client that hangs up cancels its request, as SGLang aborts it.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        self._runner = runner
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        """Finish every request (aborted) and close the server."""
        self._closing = True
        for req in self._requests.values():
            req.aborted = True
        self.paused = None
        self._notify()
        if self._runner is not None:
            with anyio.move_on_after(5, shield=True):
                await self._runner.cleanup()
            self._runner = None

    # -- scripting ----------------------------------------------------------------------------

    @property
    def requests(self) -> list[FakeRequest]:
        """Requests the fake currently tracks (waiting or running)."""
        return list(self._requests.values())

    @property
    def running(self) -> int:
        return sum(1 for r in self._requests.values() if r.state == "running")

    @property
    def waiting(self) -> int:
        return sum(1 for r in self._requests.values() if r.state == "waiting")

    @property
    def held(self) -> int:
        return sum(1 for r in self._requests.values() if r.held)

    def hold(self, k: int | None) -> None:
        """Park requests before their k-th new token from now on (None: never)."""
        self.hold_at = k
        self._notify()

    def release(self) -> None:
        """Let held requests run to the end."""
        self.hold_at = None
        self._notify()

    def fail(self, path: str, *, status: int = 503, times: int = 1, message: str = "injected failure") -> None:
        """The next `times` calls to `path` answer `status` with an SGLang-style error body."""
        self._faults.setdefault(path, deque()).extend([_Fault(status, message)] * times)

    def drop(self, path: str, *, times: int = 1) -> None:
        """The next `times` calls to `path` get their connection closed without an answer."""
        self._faults.setdefault(path, deque()).extend([_Fault(None, "")] * times)

    def drop_admitted(self, *, times: int = 1) -> None:
        """The next `times` `/generate` calls are admitted, then lose their connection; the engine
        keeps each such request's rid (a resend with the same rid is a duplicate) until an abort."""
        self._orphan_next += times

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; it is re-checked after every change in the fake, so it
        must read the fake's state (a client's result lands later, after the HTTP answer)."""
        while True:
            changed = self._changed
            if predicate():
                return
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # -- HTTP ---------------------------------------------------------------------------------

    def _routes(self) -> list[web.RouteDef]:
        return [
            web.post("/generate", self._generate),
            web.put("/generate", self._generate),
            web.post("/abort_request", self._abort_request),
            web.post("/pause_generation", self._pause),
            web.post("/continue_generation", self._continue),
            web.get("/flush_cache", self._flush_cache),
            web.post("/flush_cache", self._flush_cache),
            web.post("/update_weights_from_disk", self._update_weights_from_disk),
            web.post("/update_weights_from_distributed", self._update_weights_stub),
            web.post("/update_weights_from_tensor", self._update_weights_from_tensor),
            web.post("/init_weights_update_group", self._update_weights_stub),
            web.post("/destroy_weights_update_group", self._update_weights_stub),
            web.post("/update_weight_version", self._update_weight_version),
            web.get("/get_weight_version", self._get_weight_version),
            web.get("/model_info", self._model_info),
            web.get("/get_model_info", self._model_info),
            web.get("/server_info", self._server_info),
            web.get("/get_server_info", self._server_info),
            web.get("/health", self._health),
            web.get("/health_generate", self._health),
            web.get("/v1/loads", self._loads),
            web.get("/v1/models", self._models),
            web.route("*", "/release_memory_occupation", self._memory_occupation),
            web.route("*", "/resume_memory_occupation", self._memory_occupation),
        ]

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.calls[request.path] += 1
        if request.path != "/generate" and not request.path.startswith("/health"):
            self.control_log.append(request.path)
        self._notify()
        faults = self._faults.get(request.path)
        if faults:
            fault = faults.popleft()
            if fault.status is None:
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=500)  # never reaches the client
            return _json({"error": {"message": fault.message}}, status=fault.status)
        return await handler(request)

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"invalid JSON: {exc}")
        self.generate_payloads.append(body)
        problem = _validate_generate(body)
        if problem:
            return _error(400, problem)
        rid = body.get("rid") or uuid.uuid4().hex
        if rid in self._requests or rid in self._orphans:
            return _error(400, f"Duplicate request ID {rid}")
        if self._orphan_next > 0:
            self._orphan_next -= 1
            self._orphans.add(rid)
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)  # never reaches the client
        if "kv_cache" in self.released:
            return self._die("illegal memory access: a forward on the released KV cache")
        params = dict(body.get("sampling_params") or {})
        # New requests wait in the tokenizer manager while paused: not tracked, not in loads.
        await self.wait_until(lambda: self.paused is None or self._closing)
        req = FakeRequest(
            rid=rid,
            input_ids=tuple(body["input_ids"]),
            sampling_params=params,
            return_logprob=bool(body.get("return_logprob")),
            seed=int(params.get("sampling_seed") or 0),
            top_logprobs_num=int(body.get("top_logprobs_num") or 0),
        )
        if body.get("return_routed_experts"):
            if self.moe is None:
                return _error(400, "return_routed_experts needs --enable-return-routed-experts")
            req.routes = RouteLog(self.moe)
            if not self.ignore_routed_experts_start_len:
                req.routed_experts_start_len = int(body.get("routed_experts_start_len") or 0)
        req.mark_version(self.weight_version)
        self._requests[rid] = req
        self._notify()
        try:
            out = await self._run(req)
        finally:
            del self._requests[rid]
            self.finished.append(req)
            self._cache.append(req.input_ids + tuple(req.output_ids))
            self._notify()
        return _json(out)

    async def _run(self, req: FakeRequest) -> dict[str, Any]:
        params = req.sampling_params
        max_new = params.get("max_new_tokens")
        max_new = 128 if max_new is None else int(max_new)
        stop_ids = set(params.get("stop_token_ids") or ())
        if not params.get("ignore_eos"):
            stop_ids.add(self.eos_token_id)
        stop = params.get("stop") or []
        stop_strs = [stop] if isinstance(stop, str) else list(stop)
        # SGLang checks nothing but the length before `min_new_tokens` output tokens.
        min_new = int(params.get("min_new_tokens") or 0)

        def admitted() -> bool:
            return req.aborted or self.max_running is None or self.running < self.max_running

        await self.wait_until(admitted)
        if req.aborted:
            if self.legacy_waiting_abort:
                meta = {"id": req.rid, "finish_reason": {"type": "abort", "message": "Abort before prefill"}}
                return {"text": "", "meta_info": meta | {"prompt_tokens": 0, "completion_tokens": 0}}
            return self._output(req, {"type": "abort", "message": "Abort in waiting queue"}, waiting=True)
        req.state = "running"
        cached = self._cached_prefix(req.input_ids)
        if req.routes is not None:
            req.routes.prefilled(req.input_ids, self.weight_version)
        self._notify()
        while True:
            if req.aborted:
                return self._output(req, _ABORTED, cached=cached)
            if len(req.output_ids) >= max_new:
                return self._output(req, {"type": "length", "length": max_new}, cached=cached)
            if self._must_park(req):
                req.held = True
                if self.paused == "retract":
                    req.state = "waiting"  # retracted to the waiting queue, KV freed
                self._notify()
                await self.wait_until(lambda: req.aborted or not self._must_park(req))
                req.held, req.state = False, "running"
                self._notify()
                continue
            context = req.input_ids + tuple(req.output_ids)
            token = int(self.token_fn(context, req.seed))
            if req.routes is not None:
                req.routes.stepped(context, self.weight_version)
            if req.top_logprobs_num:
                shape = self.moe or MoeShape()
                req.heads.append(sampler_head(shape, self.weight_version, context, req.seed, req.top_logprobs_num))
            req.output_ids.append(token)
            req.logprobs.append(_logprob(context, token, req.seed))
            self._notify()
            if len(req.output_ids) < min_new:
                await anyio.lowlevel.checkpoint()
                continue
            if token in stop_ids:
                return self._output(req, {"type": "stop", "matched": token}, cached=cached)
            # Like SGLang, stop strings are looked for in the output alone, never the prompt.
            text = detokenize(req.output_ids)
            for s in stop_strs:
                if s and text.endswith(s):
                    return self._output(req, {"type": "stop", "matched": s}, cached=cached)
            await anyio.lowlevel.checkpoint()

    def _must_park(self, req: FakeRequest) -> bool:
        if self._closing:
            return False
        if self.paused in ("retract", "in_place"):
            return True
        return self.hold_at is not None and len(req.output_ids) >= self.hold_at

    def _output(
        self, req: FakeRequest, finish_reason: dict[str, Any], *, cached: int = 0, waiting: bool = False
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": req.rid, "finish_reason": finish_reason}
        if not waiting:  # _handle_abort_req leaves these out
            meta["prompt_tokens"] = len(req.input_ids)
        meta["weight_version"] = self.weight_version  # read now: the version when the output is assembled
        if not self.legacy_versions:
            meta["weight_versions"] = req.version_spans()
        meta["completion_tokens"] = len(req.output_ids)
        if not waiting:
            meta["cached_tokens"] = cached
        meta["e2e_latency"] = time.perf_counter() - req.started
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids, strict=True)]
            meta["input_token_logprobs"] = []
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = list(req.heads)
        if req.routes is not None and not waiting:  # _handle_abort_req sends no routes either
            meta["routed_experts"] = req.routes.answer(req.routed_experts_start_len, len(req.output_ids))
            if not self.ignore_routed_experts_start_len:
                meta["routed_experts_start_len"] = req.routed_experts_start_len
        return {"text": detokenize(req.output_ids), "output_ids": list(req.output_ids), "meta_info": meta}

    def _cached_prefix(self, input_ids: tuple[int, ...]) -> int:
        best = 0
        for seen in self._cache:
            n = 0
            for a, b in zip(seen, input_ids, strict=False):  # a prefix check: lengths differ
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, max(0, len(input_ids) - 1))  # the last prompt token is always computed

    def _abort(self, rid: str, abort_all: bool) -> None:
        self._orphans = {r for r in self._orphans if not (abort_all or (rid and r.startswith(rid)))}
        for req in self._requests.values():
            # SGLang matches a rid by prefix; an empty rid aborts nothing (as newer builds do).
            if abort_all or (rid and req.rid.startswith(rid)):
                req.aborted = True
        self._notify()

    async def _abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        self._abort(str(body.get("rid") or ""), bool(body.get("abort_all")))
        return web.Response(status=200)

    async def _pause(self, request: web.Request) -> web.Response:
        body = await _body(request)
        mode = body.get("mode") or "abort"
        if mode not in _PAUSE_MODES:
            return _error(400, f"invalid pause mode {mode!r}")
        self.paused = mode
        if mode == "abort":
            # Like the tokenizer manager: abort until no request is left holding the model.
            self._abort("", abort_all=True)
            await self.wait_until(lambda: not self._requests)
        else:
            await self.wait_until(lambda: all(r.held or r.state == "waiting" for r in self._requests.values()))
        self._notify()
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        self.paused = None
        self._notify()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        # Upstream flushes only when fully idle; retracted requests sit in the waiting queue, so
        # a retract pause does not make flushing possible either (slime patches this).
        if self.flush_busy_times > 0 or self._requests:
            self.flush_busy_times = max(0, self.flush_busy_times - 1)
            return web.Response(
                status=400,
                text=f"Cache not flushed because there are pending requests. #queue-req: {self.waiting}, "
                f"#running-req: {self.running}\n",
            )
        self._cache.clear()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.\n")

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if not body.get("model_path"):
            return _error(400, "model_path is required")
        if self.weight_update_error is not None:
            return _json({"success": False, "message": self.weight_update_error, "num_paused_requests": 0}, status=400)
        if body.get("flush_cache", True) and self._requests:
            # SGLang flushes after loading (unless told not to, since late 2025) and asserts that
            # it could; it cannot while it holds requests (an in_place or retract pause).
            self.healthy = False
            return _error(500, "AssertionError: Cache flush failed after updating weights")
        await self.wait_until(lambda: not self.loading or self._closing)
        self.loaded_paths.append(str(body["model_path"]))
        self._cache.clear()
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {self.weight_version}."
        self._notify()
        return _json({"success": True, "message": message, "num_paused_requests": 0})

    async def _update_weights_stub(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if self.weight_update_error is not None:
            return _json({"success": False, "message": self.weight_update_error}, status=400)
        updates = ("/update_weights_from_distributed", "/update_weights_from_tensor")
        if request.path in updates and body.get("flush_cache", True) and self._requests:
            # SGLang's scheduler asserts that the flush after the update succeeded; it refuses
            # while it holds requests (an in_place or retract pause, or none), and the engine dies.
            self.healthy = False
            return _error(500, "AssertionError: Cache flush failed after updating weights")
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return _json({"success": True, "message": "Succeeded."})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("new_version") is None:
            return _json({"success": False, "message": "new_version is required"}, status=400)
        if body.get("abort_all_requests", True):  # the default in newer SGLang
            self._abort("", abort_all=True)
        self.weight_version = str(body["new_version"])
        self._notify()
        return _json({"success": True, "message": "Weight version updated.", "new_version": self.weight_version})

    async def _get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self.weight_version})

    async def _model_info(self, request: web.Request) -> web.Response:
        if self.legacy_model_info and request.path == "/model_info":
            return _json({"detail": "Not Found"}, status=404)
        return _json(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.model_path,
                "tp_size": self.tp_size,
                "dp_size": 1,
                "pp_size": 1,
                "disaggregation_mode": "null",
                "weight_version": self.weight_version,
                "version": "0.0.0-fake",
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        if self.starting_polls > 0:
            self.starting_polls -= 1
            return web.Response(status=503)
        if self.health_waits_while_paused and self.paused is not None:
            await self.wait_until(lambda: self.paused is None or self._closing)
        if request.path == "/health_generate" and (gate := self.health_generate_gate) is not None:
            await gate.wait()
        if not self.healthy or self.loading or (request.path == "/health_generate" and self.paused is not None):
            return web.Response(status=503)
        return web.Response(status=200)

    async def _loads(self, request: web.Request) -> web.Response:
        load = {"dp_rank": 0, "num_running_reqs": self.running, "num_waiting_reqs": self.waiting}
        return _json({"timestamp": time.time(), "version": "0.0.0-fake", "loads": [load]})

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_path, "object": "model", "created": 0, "owned_by": "sglang", "root": self.model_path}
        return _json({"object": "list", "data": [card]})

    async def _memory_occupation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        self.memory_log.append((request.path, body))
        tags = body.get("tags") or ["weights", "kv_cache", "cuda_graph"]
        if request.path == "/release_memory_occupation":
            if self._requests:
                return self._die("AssertionError: release_memory_occupation should be called only when idle.")
            self.released.update(tags)
        else:
            if any(t not in self.released for t in tags):
                return self._die(f"[torch_memory_saver.cpp] Cannot resume allocation that is not paused ({tags})")
            self.released.difference_update(tags)
        self._notify()
        return _json(None)

    async def _update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await _body(request)
        self.memory_log.append((request.path, body))
        if "weights" in self.released:
            return self._die("illegal memory access: weights loaded into released memory")
        return await self._update_weights_stub(request)

    def _die(self, message: str) -> web.Response:
        """What takes a real SGLang server down: it answers no more."""
        self.healthy = False
        self._notify()
        return _error(500, message)


_ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def _validate_generate(body: object) -> str | None:
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    if body.get("stream"):
        return "the fake does not stream"
    ids = body.get("input_ids")
    if ids is None:
        return "Either text, input_ids or input_embeds should be provided."  # the fake has no tokenizer
    if not isinstance(ids, list) or not ids:
        return "input_ids cannot be empty."
    if not all(isinstance(t, int) for t in ids):
        return "the fake serves one prompt per request (input_ids must be a flat list of ints)"
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        return "sampling_params must be an object"
    if (params.get("n") or 1) != 1:
        return "the fake does not support n > 1"
    max_new = params.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or max_new < 0):
        return f"max_new_tokens must be a non-negative int, got {max_new!r}"
    return None


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    doc = orjson.loads(raw)
    return doc if isinstance(doc, dict) else {}


def _json(doc: object, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message}}, status=status)
