"""The simulated engine: the built-in engine's HTTP surface and scheduler, with a decode-time model
instead of a network, so a benchmark of minutes of GPU time runs in seconds on a laptop.

    python -m launch.sim_engine [--port 30000] [--time-scale 0.01] [--max-running-requests 128]
        [--length-dist lognormal:-1.9,0.8] [--truncate-frac 0.1] [--step-base 0.02] ...

What is real: the HTTP server, request parsing, output shapes, the scheduler with its waiting queue,
`--max-running-requests`, abort, pause (abort / retract / in_place), continue and the flush-cache busy
rule. They are the built-in engine's own code (`EngineServer`, `EngineCore`, `engine_protocol`); only
the forward pass is replaced. What is modelled (`launch.sim_model`):

- time: continuous batching as SGLang schedules it. Each loop turn is ONE forward: a prefill batch if
  requests without KV cache are running (new prompts, resumed prefixes, requests retracted by a
  pause), which gives them their first token while the others wait; otherwise a decode step that
  gives every running request one token. Its engine-time cost is slept for, scaled by `time_scale`.
  Requests keep KV while running (in_place pauses keep it); retract frees it. A small prefix cache
  remembers the sequences that left the batch and the prompts it computed, until `/flush_cache` or a
  weight update, so a resumed prefix is cheap only if no publish happened in between.
- lengths and tokens: deterministic per sample (`sampling_seed` + original prompt), so a resumed
  prefix continues toward the same target with the same tokens.
- weights: `/update_weights_from_disk` accepts any existing path, reads nothing, and takes
  `weight_update` engine seconds between forwards.

Engine time runs on a schedule against the monotonic clock: while the engine is busy, each forward
starts where the previous one was due to end, so event-loop overhead is absorbed instead of
stretching engine time. If overhead exceeds the scaled step time the engine falls behind; `/sim/stats`
reports `max_lag` and `late_forwards` so a benchmark can see that its time scale is too aggressive.

`GET /sim/stats` gives busy time, forwards, tokens, prefill tokens and running-request-seconds, all in
engine seconds: `busy_fraction = busy_time / engine_time` (1.0: the engine computed every moment).

In-process use: `async with open_sim_server(time_scale=0.001) as server: server.url`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
from aiohttp import web
from anyio.abc import TaskStatus

from launch.engine_core import EngineCore, Request
from launch.engine_model import Draw, WeightLoadError
from launch.engine_server import _HTTP2_PROBE_FILTER, EngineServer, _cancel_on_signal, _json, _leaves, running
from launch.sim_model import EOS_ID, DecodeTimeModel, LengthModel, SimTokenizer, sim_logprob, sim_token
from launch.sim_model import strip_generated
from pipeline.errors import ConfigError

__all__ = ["SimClock", "SimCore", "SimModel", "SimServer", "SimStatistics", "main", "open_sim_server", "serve"]

log = logging.getLogger(__name__)

ENGINE_VERSION = "0.5.0-sim"
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class SimModel:
    """What the scheduler and server read from a model runner, with no weights behind it."""

    def __init__(self, *, model_path: str = "simulated", vocab_size: int = 151936, context_length: int = 32768):
        problems = []
        if vocab_size < 16:
            problems.append(f"vocab_size must be at least 16, got {vocab_size}")
        if context_length < 2:
            problems.append(f"context_length must be at least 2, got {context_length}")
        if problems:
            raise ConfigError(problems)
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.tokenizer = SimTokenizer(vocab_size)
        self.eos_token_ids = frozenset({EOS_ID})
        self.config = SimpleNamespace(model_type="simulated", architectures=["SimulatedForCausalLM"])


class SimClock:
    """Engine time on a schedule: `spend(s)` sleeps until `s * time_scale` wall seconds after the
    previous forward was due to end (or after now, when the engine was resting)."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ConfigError([f"time_scale must be > 0, got {time_scale}"])
        self.time_scale = time_scale
        self._origin = anyio.current_time()
        self._due: float | None = None
        self.max_lag = 0.0  # engine seconds a forward ended after it was due
        self.late = 0

    def now(self) -> float:
        """Engine seconds since the clock started."""
        return (anyio.current_time() - self._origin) / self.time_scale

    def rest(self) -> None:
        """The engine waits for work: the next forward starts from the moment it is asked for."""
        self._due = None

    async def spend(self, seconds: float, *, continuous: bool = True) -> None:
        # The one place where sleeping is the model rather than synchronisation.
        now = anyio.current_time()
        start = self._due if continuous and self._due is not None else now
        due = start + seconds * self.time_scale
        if due > now:
            await anyio.sleep_until(due)
        else:
            self.late += 1
            self.max_lag = max(self.max_lag, (now - due) / self.time_scale)
        self._due = due


@dataclass(frozen=True, slots=True)
class SimStatistics:
    """Everything in engine seconds (wall seconds / time_scale)."""

    time_scale: float
    engine_time: float  # since the engine started
    busy_time: float  # prefill + decode
    busy_fraction: float
    decode_time: float
    prefill_time: float
    weight_update_time: float
    decode_steps: int
    prefill_batches: int
    generated_tokens: int
    prefill_tokens: int  # tokens computed by prefills (prompts, resumed prefixes, retracted requests)
    cached_prefill_tokens: int  # tokens a prefill found in the prefix cache instead
    running_request_seconds: float  # integral of the running-request count over busy time
    max_batch_size: int
    late_forwards: int  # forwards that ended after their due time (event loop too slow for the scale)
    max_lag: float
    num_running: int
    num_waiting: int
    paused: str | None
    finished_requests: int
    aborted_requests: int
    weight_updates: int


@dataclass(frozen=True, slots=True)
class _Held:
    """A running request's KV cache: where its EOS falls (None: it runs to its length limit)."""

    eos_at: int | None


class SimCore(EngineCore):
    """`EngineCore` with the forward replaced by the time and length models.

    It overrides the forward (`_step`), the weight update, and the hooks where KV cache is made or
    freed (`_finish`, `_retract_running`, `_wait_work` for the clock); queueing, admission, abort,
    pause and continue are the built-in engine's.
    """

    def __init__(
        self,
        model: SimModel,
        *,
        clock: SimClock,
        timing: DecodeTimeModel = DecodeTimeModel(),
        lengths: LengthModel = LengthModel(),
        max_running_requests: int = 128,
        weight_version: str = "0",
        random_seed: int | None = None,
        prefix_cache_entries: int = 4096,
    ) -> None:
        super().__init__(
            model,  # type: ignore[arg-type]  # the runner attributes the scheduler reads
            max_running_requests=max_running_requests,
            weight_version=weight_version,
            random_seed=random_seed,
        )
        self.clock, self.timing, self.lengths = clock, timing, lengths
        self._kv: dict[int, _Held] = {}  # id(request) -> its KV, for running requests that have one
        self._prefix: OrderedDict[int, None] = OrderedDict()  # hashes of cached sequences, LRU
        self._prefix_entries = prefix_cache_entries
        self._busy = self._decode_s = self._prefill_s = self._update_s = self._rrs = 0.0
        self._decode_steps = self._prefill_batches = self._prefill_tokens = self._cached_tokens = 0

    # ---- the forward -------------------------------------------------------------------------------

    async def _forward(self, batch: list[Request]) -> None:
        """A prefill if any request lacks its KV cache, else one decode step, each charged the
        time the model says; then every request still running gets its token."""
        async with self._lane:  # weight updates land between forwards
            fresh = [r for r in batch if id(r) not in self._kv]
            if fresh:  # SGLang runs a waiting prefill before the next decode step
                work, tokens = fresh, sum(self._prefill(r) for r in fresh)
                seconds = self.timing.prefill_time(tokens)
                self._prefill_s += seconds
                self._prefill_batches += 1
                self._prefill_tokens += tokens
            else:
                work = batch
                context = sum(len(r.prompt_ids) + len(r.output_ids) for r in batch)
                seconds = self.timing.decode_time(len(batch), context)
                self._decode_s += seconds
                self._decode_steps += 1
            await self.clock.spend(seconds)
        self._busy += seconds
        self._rrs += seconds * len(batch)
        running = {id(r) for r in self._running}
        alive = [r for r in work if id(r) in running]  # aborts during the forward drop their token
        self._apply(alive, [self._draw(r) for r in alive])
        self._steps += 1
        self._max_batch = max(self._max_batch, len(batch))

    def _prefill(self, req: Request) -> int:
        """Give `req` its KV cache and its plan; return the tokens the prefill computes for it."""
        vocab = self.runner.vocab_size
        seq = req.prompt_ids + tuple(req.output_ids)
        start = strip_generated(req.prompt_ids, req.seed, vocab)  # where this sample's response began
        p = req.params
        limit = p.max_new_tokens + len(req.prompt_ids) - start  # the first request's max_new_tokens
        target = None if p.ignore_eos else self.lengths.target(req.seed, req.prompt_ids[:start], limit)
        eos_at = None
        if target is not None:
            eos_at = max(start + target - 1, len(req.prompt_ids) + p.min_new_tokens - 1)
        self._kv[id(req)] = _Held(eos_at)
        cached = 0
        if self._prefix_entries:
            for n in (len(seq), len(req.prompt_ids), start):
                if n > cached and self._cache_hit(seq[:n]):
                    cached = n
            cached = min(cached, len(seq) - 1)  # the last token is always computed
            self._cache_put(req.prompt_ids[:start])  # siblings of this sample share the prompt
            self._cache_put(req.prompt_ids)
        self._cached_tokens += cached
        return len(seq) - cached

    def _draw(self, req: Request) -> Draw:
        position = len(req.prompt_ids) + len(req.output_ids)
        eos_at = self._kv[id(req)].eos_at
        token = EOS_ID if eos_at is not None and position >= eos_at else sim_token(
            req.seed, position, self.runner.vocab_size
        )
        return Draw(token, sim_logprob(req.seed, position))

    # ---- KV cache ----------------------------------------------------------------------------------

    def _finish(self, req: Request, finish: Any) -> None:
        super()._finish(req, finish)
        if self._kv.pop(id(req), None) is not None:
            self._cache_put(req.prompt_ids + tuple(req.output_ids))

    def _retract_running(self) -> None:
        for req in self._running:  # retract frees a request's KV; what it computed stays in the cache
            if self._kv.pop(id(req), None) is not None:
                self._cache_put(req.prompt_ids + tuple(req.output_ids))
        super()._retract_running()

    def _cache_hit(self, seq: tuple[int, ...]) -> bool:
        key = hash(seq)
        if key in self._prefix:
            self._prefix.move_to_end(key)
            return True
        return False

    def _cache_put(self, seq: tuple[int, ...]) -> None:
        if not self._prefix_entries:
            return
        self._prefix[hash(seq)] = None
        self._prefix.move_to_end(hash(seq))
        while len(self._prefix) > self._prefix_entries:
            self._prefix.popitem(last=False)

    def flush_cache(self) -> None:
        """Forget every cached prefix (SGLang's /flush_cache; the server checks the engine is idle)."""
        self._prefix.clear()

    # ---- clock and weights -------------------------------------------------------------------------

    async def _wait_work(self) -> None:
        if self._pause is not None or not (self._running or self._waiting):
            self.clock.rest()  # idle time is not owed to the schedule
        await super()._wait_work()

    async def update_weights(self, folder: str | Path, *, weight_version: str | None = None) -> None:
        """Take `weight_update` engine seconds between forwards; read nothing. Any existing path works."""
        folder = str(folder)
        if not Path(folder).exists():
            raise WeightLoadError(folder, "the path does not exist")
        async with self._update_lock, self._lane:
            with anyio.CancelScope(shield=True):  # once started, weights and version must agree
                await self.clock.spend(self.timing.weight_update, continuous=False)
                self._update_s += self.timing.weight_update
                self.model_path = folder
                if weight_version is not None:
                    self.set_weight_version(weight_version)
                self._updates += 1
                self._prefix.clear()  # new weights: every cached KV is stale
        log.info("simulated weight update from %s (weight_version %s)", folder, self.weight_version)

    # ---- statistics --------------------------------------------------------------------------------

    def context_tokens(self) -> int:
        return sum(len(r.prompt_ids) + len(r.output_ids) for r in self._running)

    def sim_statistics(self) -> SimStatistics:
        core = self.statistics()
        now = self.clock.now()
        return SimStatistics(
            time_scale=self.clock.time_scale,
            engine_time=now,
            busy_time=self._busy,
            busy_fraction=self._busy / now if now > 0 else 0.0,
            decode_time=self._decode_s,
            prefill_time=self._prefill_s,
            weight_update_time=self._update_s,
            decode_steps=self._decode_steps,
            prefill_batches=self._prefill_batches,
            generated_tokens=core.generated_tokens,
            prefill_tokens=self._prefill_tokens,
            cached_prefill_tokens=self._cached_tokens,
            running_request_seconds=self._rrs,
            max_batch_size=core.max_batch_size,
            late_forwards=self.clock.late,
            max_lag=self.clock.max_lag,
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            paused=core.paused,
            finished_requests=core.finished_requests,
            aborted_requests=core.aborted_requests,
            weight_updates=core.weight_updates,
        )


class SimServer(EngineServer):
    """The built-in engine's HTTP server over a `SimCore`, with `/sim/stats` and honest info pages."""

    core: SimCore

    def _build_app(self) -> web.Application:
        app = super()._build_app()
        app.router.add_get("/sim/stats", self.sim_stats)
        return app

    async def sim_stats(self, request: web.Request) -> web.Response:
        return _json(asdict(self.core.sim_statistics()))

    async def flush_cache(self, request: web.Request) -> web.Response:
        c = self.core
        if not c.is_idle():
            return web.Response(
                status=400,
                text=f"Cache not flushed: {c.num_running} running and {c.num_waiting} waiting request(s).\n",
            )
        c.flush_cache()
        return web.Response(status=200, text=_FLUSHED)

    def model_identity(self) -> dict[str, Any]:
        return {"model_type": "simulated", "architectures": ["SimulatedForCausalLM"]}

    def server_details(self) -> dict[str, Any]:
        c = self.core
        return {
            "device": "simulated",
            "dtype": "bfloat16",
            "disable_radix_cache": c._prefix_entries == 0,
            "sim": {"time_model": asdict(c.timing), "length_model": asdict(c.lengths), "time_scale": c.clock.time_scale},
        }

    def accelerator(self) -> tuple[str, int]:
        return "simulated", 1

    def used_tokens(self) -> int:
        return self.core.context_tokens()


# ---- running it ----------------------------------------------------------------------------------------


@asynccontextmanager
async def open_sim_server(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    time_scale: float = 1.0,
    timing: DecodeTimeModel = DecodeTimeModel(),
    lengths: LengthModel = LengthModel(),
    max_running_requests: int = 128,
    weight_version: str = "0",
    random_seed: int | None = None,
    model_path: str = "simulated",
    served_model_name: str | None = None,
    vocab_size: int = 151936,
    context_length: int = 32768,
    prefix_cache_entries: int = 4096,
    health_check_timeout: float = 20.0,
) -> AsyncIterator[SimServer]:
    """Start the decode loop and listen; yield the server (port 0 picks a free port).

    On exit every request in flight is aborted (clients get their partial output), then the listener
    and the loop stop.
    """
    if max_running_requests < 1:
        raise ConfigError([f"max_running_requests must be >= 1, got {max_running_requests}"])
    logging.getLogger("aiohttp.server").addFilter(_HTTP2_PROBE_FILTER)
    model = SimModel(model_path=model_path, vocab_size=vocab_size, context_length=context_length)
    core = SimCore(
        model,
        clock=SimClock(time_scale),
        timing=timing,
        lengths=lengths,
        max_running_requests=max_running_requests,
        weight_version=weight_version,
        random_seed=random_seed,
        prefix_cache_entries=prefix_cache_entries,
    )
    server = SimServer(
        core,
        host=host,
        port=port,
        served_model_name=served_model_name,
        health_check_timeout=health_check_timeout,
        random_seed=random_seed,
    )
    async with running(server, host, port):
        log.info("simulated engine at %s (time scale %g)", server.url, time_scale)
        yield server


async def serve(*, task_status: TaskStatus[SimServer] = anyio.TASK_STATUS_IGNORED, **options: Any) -> None:
    """Run until cancelled; `await tg.start(serve, ...)` returns the running SimServer."""
    async with open_sim_server(**options) as server:
        task_status.started(server)
        await anyio.sleep_forever()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d, lm = DecodeTimeModel(), LengthModel()
    ap = argparse.ArgumentParser(prog="python -m launch.sim_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per engine second")
    ap.add_argument("--max-running-requests", type=int, default=128)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--random-seed", type=int, default=None)
    ap.add_argument("--model-path", "--model", default="simulated", help="only reported; nothing is read")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--context-length", type=int, default=32768)
    ap.add_argument(
        "--length-dist",
        default=f"lognormal:{lm.mu},{lm.sigma}",
        help="lognormal:MU,SIGMA or fixed:FRACTION, as fractions of the length limit",
    )
    ap.add_argument("--truncate-frac", type=float, default=lm.truncate_frac, help="share that runs to the limit")
    ap.add_argument("--step-base", type=float, default=d.step_base)
    ap.add_argument("--step-per-request", type=float, default=d.step_per_request)
    ap.add_argument("--step-per-context-token", type=float, default=d.step_per_context_token)
    ap.add_argument("--prefill-base", type=float, default=d.prefill_base)
    ap.add_argument("--prefill-per-token", type=float, default=d.prefill_per_token)
    ap.add_argument("--weight-update-time", type=float, default=d.weight_update)
    ap.add_argument("--prefix-cache-entries", type=int, default=4096, help="0 disables the prefix cache")
    ap.add_argument("--health-check-timeout", type=float, default=20.0)
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--skip-server-warmup", action="store_true", help="accepted for SGLang compatibility")
    return ap.parse_args(argv)


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """`open_sim_server` keyword arguments from parsed flags; ConfigError lists every bad value."""
    problems: list[str] = []
    timing, lengths = DecodeTimeModel(), LengthModel()
    try:
        timing = DecodeTimeModel(
            step_base=args.step_base,
            step_per_request=args.step_per_request,
            step_per_context_token=args.step_per_context_token,
            prefill_base=args.prefill_base,
            prefill_per_token=args.prefill_per_token,
            weight_update=args.weight_update_time,
        )
    except ConfigError as exc:
        problems += exc.problems
    try:
        lengths = LengthModel.parse(args.length_dist, truncate_frac=args.truncate_frac)
    except ConfigError as exc:
        problems += exc.problems
    if not args.time_scale > 0:
        problems.append(f"--time-scale must be > 0, got {args.time_scale}")
    if args.max_running_requests < 1:
        problems.append(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if problems:
        raise ConfigError(problems)
    return dict(
        host=args.host,
        port=args.port,
        time_scale=args.time_scale,
        timing=timing,
        lengths=lengths,
        max_running_requests=args.max_running_requests,
        weight_version=args.weight_version,
        random_seed=args.random_seed,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        vocab_size=args.vocab_size,
        context_length=args.context_length,
        prefix_cache_entries=args.prefix_cache_entries,
        health_check_timeout=args.health_check_timeout,
    )


async def _run(options: dict[str, Any]) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_signal, tg.cancel_scope)
        server = await tg.start(functools.partial(serve, **options))
        log.info("The server is fired up and ready to roll! %s", server.url)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        options = options_from_args(args)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    failed = False
    try:
        anyio.run(_run, options)
    except* (ConfigError, OSError) as group:  # port taken: say why in a line
        for exc in _leaves(group):
            log.error("%s", exc)
        failed = True
    if not failed:
        log.info("engine stopped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
