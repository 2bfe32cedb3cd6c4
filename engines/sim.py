"""The simulated engine: the built-in engine's HTTP surface and scheduler, with a decode-time model
instead of a network, so a benchmark of minutes of GPU time runs in seconds on a laptop.

    python -m engines.sim [--port 30000] [--time-scale 0.01] [--max-running-requests 128]
        [--length-dist lognormal:-1.9,0.8] [--truncate-frac 0.1] [--length-prompt-sigma 0] [--step-base 0.02] ...

What is real: the HTTP server, request parsing, output shapes, the scheduler with its waiting queue,
`--max-running-requests`, abort, pause (abort / retract / in_place), continue and the flush-cache busy
rule. They are every engine's code (`http.EngineServer`, `scheduler.EngineCore`, `protocol`); only
the forward is different: `SimModel` is a `ModelForward` (seam.py) whose forward costs modelled time.
What is modelled (`sim_model.py`):

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
  `weight_update` engine seconds between forwards; with `--staged-weight-updates` the transfer
  runs into a staging copy while decoding goes on, and only the swap (`weight_swap`, default 0)
  happens between two forwards (publishing without stopping the engine).

Engine time runs on a schedule against the monotonic clock: while the engine is busy, each forward
starts where the previous one was due to end, so event-loop overhead is absorbed instead of
stretching engine time. If overhead exceeds the scaled step time the engine falls behind; `/sim/stats`
reports `max_lag` and `late_forwards` so a benchmark can see that its time scale is too aggressive.

`POST /sim/slowdown {"factor": f}` makes every forward f times slower until it is set back to 1: a
benchmark's simulated trainer sets it while it trains, to model an engine that shares its GPU with
the trainer (measured on the built-in engine: decode 1.2x slower beside a training step).

`GET /sim/stats` gives busy time, forwards, tokens, prefill tokens and running-request-seconds, all in
engine seconds: `busy_fraction = busy_time / engine_time` (1.0: the engine computed every moment).

In-process use: `async with open_sim_server(time_scale=0.001) as server: server.url`.

Over 400 lines because the command line mirrors every knob of the time and length models
(about 100 lines of flags and their one-error validation); the model itself is about 300.
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
from typing import Any

import anyio
from aiohttp import web
from anyio.abc import TaskStatus

from core.errors import ConfigError
from engines.guards import add_guard_arguments, guard_options
from engines.http import EngineServer, json_body, json_response
from engines.scheduler import CoreStatistics
from engines.seam import Draw, Row, WeightLoadError
from engines.serving import open_engine, run_main
from engines.sim_model import (
    EOS_ID,
    DecodeTimeModel,
    LengthModel,
    SimTokenizer,
    sim_logprob,
    sim_token,
    strip_generated,
)

__all__ = ["SimClock", "SimModel", "SimServer", "SimStatistics", "main", "open_sim_server", "serve"]

log = logging.getLogger(__name__)

ENGINE_VERSION = "0.5.0-sim"
SimServer = EngineServer  # the simulated engine is the shared HTTP surface over a `SimModel`


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

    async def overlap(self, seconds: float) -> None:
        """Let `seconds` of engine time pass for work that runs beside the forwards (a staged weight
        transfer); the forward schedule is not touched."""
        await anyio.sleep(seconds * self.time_scale)

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


class SimModel:
    """A `ModelForward` with no weights: each forward costs what the time model says, and tokens
    and lengths come from the length model. It keeps the KV-cache bookkeeping a real engine would
    (which running requests hold cache, a small prefix cache) because that decides the cost."""

    engine_version = ENGINE_VERSION
    keeps_kv_cache = True

    def __init__(
        self,
        *,
        clock: SimClock | None = None,
        timing: DecodeTimeModel = DecodeTimeModel(),
        lengths: LengthModel = LengthModel(),
        model_path: str = "simulated",
        vocab_size: int = 151936,
        context_length: int = 32768,
        prefix_cache_entries: int = 4096,
        staged_weight_updates: bool = False,
    ) -> None:
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
        self.eos_token_ids = frozenset({EOS_ID})
        self._tokenizer = SimTokenizer(vocab_size)
        self.clock = clock if clock is not None else SimClock()
        self.timing, self.lengths = timing, lengths
        self._kv: dict[str, _Held] = {}  # rid -> its KV, for running requests that have one
        self._prefix: OrderedDict[int, None] = OrderedDict()  # hashes of cached sequences, LRU
        self.prefix_cache_entries = prefix_cache_entries
        self.staged_weight_updates = staged_weight_updates
        self._busy = self._decode_s = self._prefill_s = self._update_s = self._rrs = 0.0
        self._decode_steps = self._prefill_batches = self._prefill_tokens = self._cached_tokens = 0
        self.slowdown = 1.0  # `/sim/slowdown`: a trainer on the same GPU, while it trains

    @property
    def tokenizer(self) -> SimTokenizer:
        return self._tokenizer

    # ---- the forward -------------------------------------------------------------------------------

    async def forward(self, rows: Sequence[Row]) -> Sequence[Draw | None]:
        """A prefill if any request lacks its KV cache, else one decode step, each charged the
        time the model says; the rows it served get their token."""
        fresh = [r for r in rows if r.rid not in self._kv]
        if fresh:  # SGLang runs a waiting prefill before the next decode step
            served, tokens = {r.rid for r in fresh}, sum(self._prefill(r) for r in fresh)
            seconds = self.timing.prefill_time(tokens) * self.slowdown
            self._prefill_s += seconds
            self._prefill_batches += 1
            self._prefill_tokens += tokens
        else:
            served = {r.rid for r in rows}
            seconds = self.timing.decode_time(len(rows), sum(r.position for r in rows)) * self.slowdown
            self._decode_s += seconds
            self._decode_steps += 1
        await self.clock.spend(seconds)
        self._busy += seconds
        self._rrs += seconds * len(rows)
        # A request aborted during the forward has released its cache: it gets no token.
        return [self._draw(r) if r.rid in served and r.rid in self._kv else None for r in rows]

    def _prefill(self, row: Row) -> int:
        """Give `row` its KV cache and its plan; return the tokens the prefill computes for it."""
        seq = row.token_ids
        start = strip_generated(row.prompt_ids, row.seed, self.vocab_size)  # where the response began
        p = row.params
        limit = p.max_new_tokens + len(row.prompt_ids) - start  # the first request's max_new_tokens
        target = None if p.ignore_eos else self.lengths.target(row.seed, row.prompt_ids[:start], limit)
        eos_at = None
        if target is not None:
            eos_at = max(start + target - 1, len(row.prompt_ids) + p.min_new_tokens - 1)
        self._kv[row.rid] = _Held(eos_at)
        cached = 0
        if self.prefix_cache_entries:
            for n in (len(seq), len(row.prompt_ids), start):
                if n > cached and self._cache_hit(seq[:n]):
                    cached = n
            cached = min(cached, len(seq) - 1)  # the last token is always computed
            self._cache_put(row.prompt_ids[:start])  # siblings of this sample share the prompt
            self._cache_put(row.prompt_ids)
        self._cached_tokens += cached
        return len(seq) - cached

    def _draw(self, row: Row) -> Draw:
        position = row.position
        eos_at = self._kv[row.rid].eos_at
        token = EOS_ID if eos_at is not None and position >= eos_at else sim_token(row.seed, position, self.vocab_size)
        return Draw(token, sim_logprob(row.seed, position))

    # ---- KV cache ----------------------------------------------------------------------------------

    def release(self, row: Row) -> None:
        """Free the request's KV; what it computed stays in the prefix cache."""
        if self._kv.pop(row.rid, None) is not None:
            self._cache_put(row.token_ids)

    def _cache_hit(self, seq: tuple[int, ...]) -> bool:
        key = hash(seq)
        if key in self._prefix:
            self._prefix.move_to_end(key)
            return True
        return False

    def _cache_put(self, seq: tuple[int, ...]) -> None:
        if not self.prefix_cache_entries:
            return
        self._prefix[hash(seq)] = None
        self._prefix.move_to_end(hash(seq))
        while len(self._prefix) > self.prefix_cache_entries:
            self._prefix.popitem(last=False)

    def flush_cache(self) -> None:
        self._prefix.clear()

    # ---- clock and weights -------------------------------------------------------------------------

    def idle(self) -> None:
        self.clock.rest()  # idle time is not owed to the schedule

    async def read_weights(self, folder: str) -> object:
        """Read nothing; any existing path works. A staged update spends its transfer time here,
        while forwards go on."""
        if not await anyio.Path(folder).exists():
            raise WeightLoadError(folder, "the path does not exist")
        if self.staged_weight_updates:
            await self.clock.overlap(self.timing.weight_update)
        return folder

    async def apply_weights(self, staged: object) -> None:
        """Between forwards: the whole `weight_update` time, or only the swap of a staged copy."""
        seconds = self.timing.weight_swap if self.staged_weight_updates else self.timing.weight_update
        await self.clock.spend(seconds, continuous=False)
        self._update_s += seconds
        self._prefix.clear()  # new weights: every cached KV is stale
        log.info("simulated weight update from %s", staged)

    # ---- what the server reports -------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        return {"model_type": "simulated", "architectures": ["SimulatedForCausalLM"]}

    def server_details(self) -> dict[str, Any]:
        return {
            "device": "simulated",
            "dtype": "bfloat16",
            "disable_radix_cache": self.prefix_cache_entries == 0,
            "staged_weight_updates": self.staged_weight_updates,
            "sim": {
                "time_model": asdict(self.timing),
                "length_model": asdict(self.lengths),
                "time_scale": self.clock.time_scale,
            },
        }

    def accelerator(self) -> tuple[str, int]:
        return "simulated", 1

    def statistics(self, core: CoreStatistics) -> SimStatistics:
        """The scheduler's counts with this model's times, in engine seconds."""
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


def _sim_routes(server: EngineServer) -> list[web.RouteDef]:
    model = server.core.model
    assert isinstance(model, SimModel)

    async def sim_stats(request: web.Request) -> web.Response:
        return json_response(asdict(model.statistics(server.core.statistics())))

    async def sim_slowdown(request: web.Request) -> web.Response:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        factor = body.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            return json_response({"success": False, "message": f"factor must be a number > 0, got {factor!r}"}, 400)
        model.slowdown = float(factor)
        return json_response({"success": True, "factor": model.slowdown})

    return [web.get("/sim/stats", sim_stats), web.post("/sim/slowdown", sim_slowdown)]


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
    staged_weight_updates: bool = False,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
) -> AsyncIterator[EngineServer]:
    """Start the decode loop and listen; yield the server (port 0 picks a free port).

    On exit every request in flight is aborted (clients get their partial output), then the listener
    and the loop stop.
    """
    if max_running_requests < 1:
        raise ConfigError([f"max_running_requests must be >= 1, got {max_running_requests}"])
    model = SimModel(
        clock=SimClock(time_scale),
        timing=timing,
        lengths=lengths,
        model_path=model_path,
        vocab_size=vocab_size,
        context_length=context_length,
        prefix_cache_entries=prefix_cache_entries,
        staged_weight_updates=staged_weight_updates,
    )
    async with open_engine(
        model,
        host=host,
        port=port,
        max_running_requests=max_running_requests,
        weight_version=weight_version,
        random_seed=random_seed,
        served_model_name=served_model_name,
        health_check_timeout=health_check_timeout,
        routes=_sim_routes,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
    ) as server:
        log.info("simulated engine at %s (time scale %g)", server.url, time_scale)
        yield server


async def serve(*, task_status: TaskStatus[EngineServer] = anyio.TASK_STATUS_IGNORED, **options: Any) -> None:
    """Run until cancelled; `await tg.start(serve, ...)` returns the running server."""
    async with open_sim_server(**options) as server:
        task_status.started(server)
        await anyio.sleep_forever()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d, lm = DecodeTimeModel(), LengthModel()
    ap = argparse.ArgumentParser(prog="python -m engines.sim", description=__doc__.split("\n\n")[0])
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
    ap.add_argument(
        "--length-prompt-sigma",
        type=float,
        default=lm.prompt_sigma,
        help="spread of each prompt's own length factor (log scale; 0: every prompt alike)",
    )
    ap.add_argument("--step-base", type=float, default=d.step_base)
    ap.add_argument("--step-per-request", type=float, default=d.step_per_request)
    ap.add_argument("--step-per-context-token", type=float, default=d.step_per_context_token)
    ap.add_argument("--prefill-base", type=float, default=d.prefill_base)
    ap.add_argument("--prefill-per-token", type=float, default=d.prefill_per_token)
    ap.add_argument("--weight-update-time", type=float, default=d.weight_update)
    ap.add_argument("--weight-swap-time", type=float, default=d.weight_swap)
    ap.add_argument(
        "--staged-weight-updates",
        action="store_true",
        help="receive weights beside decoding; stop only for the swap between two forwards",
    )
    ap.add_argument("--prefix-cache-entries", type=int, default=4096, help="0 disables the prefix cache")
    ap.add_argument("--health-check-timeout", type=float, default=20.0)
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--skip-server-warmup", action="store_true", help="accepted for SGLang compatibility")
    add_guard_arguments(ap)
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
            weight_swap=args.weight_swap_time,
        )
    except ConfigError as exc:
        problems += exc.problems
    try:
        lengths = LengthModel.parse(
            args.length_dist, truncate_frac=args.truncate_frac, prompt_sigma=args.length_prompt_sigma
        )
    except ConfigError as exc:
        problems += exc.problems
    if not args.time_scale > 0:
        problems.append(f"--time-scale must be > 0, got {args.time_scale}")
    if args.max_running_requests < 1:
        problems.append(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    guards, bad_guards = guard_options(args)
    problems += bad_guards
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
        staged_weight_updates=args.staged_weight_updates,
        health_check_timeout=args.health_check_timeout,
        **guards,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        options = options_from_args(args)
    except ConfigError as exc:
        logging.basicConfig(stream=sys.stderr)
        log.error("%s", exc)
        return 2
    # A port taken: say why in a line.
    return run_main(
        functools.partial(serve, **options), log_level=args.log_level, startup_errors=(ConfigError, OSError)
    )


if __name__ == "__main__":
    sys.exit(main())
