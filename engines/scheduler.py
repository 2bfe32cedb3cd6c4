"""The engines' scheduler: many concurrent requests, one batched forward pass per decode step.

    submit ──► waiting (FIFO) ──admit (≤ max_running)──► running ──step──► finished
                  ▲                                         │
                  └──────── retract (pause mode) ◄──────────┘

One task (`run`) owns the loop: admit from the waiting queue, run ONE forward over every running
request (through the `ModelForward` seam, which keeps torch off the event loop), append each
request's token, finish what is done, repeat. The forward never touches request state: it gets
immutable `Row`s. Weight loads go through the same one-slot compute lane, so they land between
decode steps.

Control (abort, pause, continue, weight version) happens on the event loop between steps and takes
effect at once: an aborted running request finishes with the tokens it has (a step in flight for it is
discarded), which is what SGLang's client sees too (HTTP 200, partial tokens, finish type "abort").
Paused engines hold new requests at the gate (`submit` waits) instead of rejecting them.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from core.errors import ConfigError
from engines.length_tail import LengthTail
from engines.request import (
    EngineClosedError,
    Finish,
    FinishKind,
    GenerationHeldError,
    InvalidRequestError,
    PauseMode,
    Request,
    RequestState,
)
from engines.seam import Draw, ModelForward, Row, SamplingParams

__all__ = ["CoreStatistics", "EngineCore"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CoreStatistics:
    num_running: int
    num_waiting: int
    num_held: int  # held at the pause gate, not yet queued (SGLang does not count these either)
    paused: str | None  # the pause mode, or None
    steps: int
    generated_tokens: int
    max_batch_size: int  # the largest batch one forward pass has served
    finished_requests: int
    aborted_requests: int
    weight_updates: int


class EngineCore:
    """The scheduler over one `ModelForward`. Start `run()` in a task group before submitting."""

    def __init__(
        self,
        model: ModelForward,
        *,
        max_running_requests: int = 64,
        weight_version: str = "0",
        random_seed: int | None = None,
        length_tail: LengthTail | None = None,
    ) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.model = model
        self.max_running_requests = max_running_requests
        self.weight_version = weight_version
        self.model_path = model.model_path
        self.length_tail = length_tail
        if length_tail is not None and not model.eos_token_ids:
            raise ConfigError([f"a length tail ends requests with EOS, and {model.model_path!r} names no EOS id"])
        self._seeds = random.Random(random_seed)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._tracked: dict[str, Request] = {}
        self._pause: PauseMode | None = None
        # Why no request may run now (the engine's memory is released: `occupation.py`), or None.
        self._held_by: str | None = None
        self._unpaused = anyio.Event()
        self._unpaused.set()
        self._work = anyio.Event()  # set when the loop may have something new to do
        self._stepped = anyio.Event()  # set (and replaced) after every decode step
        self._lane = anyio.CapacityLimiter(1)  # the one compute thread: steps and weight loads
        self._update_lock = anyio.Lock()
        self._stepping = False
        self._alive = False
        self._closed = False
        self._held = 0  # requests waiting at the pause gate (not yet queued)
        self._steps = self._generated = self._max_batch = 0
        self._finished = self._aborted = self._updates = 0
        self._serials = 0

    # ---- requests ----------------------------------------------------------------------------------

    async def submit(self, req: Request) -> None:
        """Queue a request; waits while the engine is paused (SGLang holds, it does not reject).
        Raises GenerationHeldError while generation is held (memory released), before or after
        the pause gate: a request held at the gate must not run on memory given back meanwhile."""
        self.validate(req)
        self._check_held()
        self._held += 1
        try:
            while self._pause is not None and not self._closed:
                await self._unpaused.wait()
        finally:
            self._held -= 1
        if self._closed:
            raise EngineClosedError("the engine is shutting down")
        self._check_held()
        self.check_rid(req)  # it may have been taken while we were held
        req.seed = req.params.sampling_seed if req.params.sampling_seed is not None else self._seeds.getrandbits(62)
        self._serials += 1
        req.serial = self._serials
        if self.length_tail is not None:
            req.end_at = self.length_tail.end_at(req.seed, req.prompt_ids, req.params)
        req.state = RequestState.WAITING
        req.mark_version(self.weight_version)
        self._tracked[req.rid] = req
        self._waiting.append(req)
        self._work.set()

    def validate(self, req: Request) -> None:
        """Raise InvalidRequestError if the engine cannot serve `req` (bad ids, too long, rid in use)."""
        self.check_rid(req)
        self.check_prompt(req)

    def check_rid(self, req: Request) -> None:
        if req.rid in self._tracked:
            raise InvalidRequestError(f"Duplicate request ID: {req.rid!r}", req.rid)

    def check_prompt(self, req: Request) -> None:
        """`validate` without the rid: it reads only the model's constants, so a worker thread may run it."""
        if not req.prompt_ids:
            raise InvalidRequestError("input_ids cannot be empty.", req.prompt_ids)
        bad = [t for t in req.prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids {bad[:8]} are outside the vocabulary [0, {self.model.vocab_size})", bad
            )
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if len(req.prompt_ids) >= self.model.context_length or total > self.model.context_length:
            raise InvalidRequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.model.context_length} tokens. You requested a total of {total} tokens: "
                f"{len(req.prompt_ids)} tokens from the input and {req.params.max_new_tokens} "
                "tokens for the completion.",
                total,
            )

    def cancel(self, req: Request) -> None:
        """Abort exactly this request if it is still queued or running (its client went away)."""
        if self._tracked.get(req.rid) is req:
            self._abort_where(lambda r: r is req)

    def close(self) -> None:
        """Abort everything and refuse new requests, releasing any held at the pause gate."""
        self._closed = True
        self.abort(abort_all=True)
        self._unpaused.set()

    def abort(self, rid: str = "", *, abort_all: bool = False) -> int:
        """Finish every request whose rid starts with `rid` (all of them with abort_all); count them.

        An empty rid without abort_all matches nothing, as in SGLang.
        """
        if not abort_all and not rid:
            return 0
        return self._abort_where(lambda r: abort_all or r.rid.startswith(rid))

    def _abort_where(self, hit: Callable[[Request], bool]) -> int:
        n = 0
        for req in [r for r in self._waiting if hit(r)]:
            self._waiting.remove(req)
            self._finish(req, Finish(FinishKind.ABORT_WAITING))
            n += 1
        for req in [r for r in self._running if hit(r)]:
            self._leave_running(req)
            self._finish(req, Finish(FinishKind.ABORT))
            n += 1
        self._aborted += n
        return n

    # ---- pause / continue --------------------------------------------------------------------------

    @property
    def paused(self) -> PauseMode | None:
        return self._pause

    def pause(self, mode: PauseMode) -> None:
        """Stop decoding and hold new requests until `resume()`; what happens to requests in flight
        depends on the mode. Pausing a paused engine switches the mode."""
        self._pause = PauseMode(mode)
        if self._unpaused.is_set():
            self._unpaused = anyio.Event()
        if self._pause is PauseMode.ABORT:
            self.abort(abort_all=True)
        elif self._pause is PauseMode.RETRACT and not self._stepping:
            self._retract_running()
        # A step already in flight completes and is applied; the loop then sees the pause.

    async def wait_no_step(self) -> None:
        """Wait until no decode step is in flight (after `pause`, nothing decodes once this returns)."""
        while self._stepping:
            await self._stepped.wait()

    def resume(self) -> None:
        self._pause = None
        self._unpaused.set()
        self._work.set()

    # ---- holding generation (memory released) ----------------------------------------------------

    def hold_generation(self, reason: str | None) -> None:
        """Refuse new requests with `reason` and run no step until called with None. The caller
        (`occupation.MemoryOccupation`) holds only an idle engine."""
        self._held_by = reason
        self._work.set()

    @property
    def generation_held(self) -> str | None:
        """Why requests are refused now, or None."""
        return self._held_by

    def _check_held(self) -> None:
        if self._held_by is not None:
            raise GenerationHeldError(self._held_by)

    async def run_in_lane(self, fn: Callable[[], object]) -> None:
        """Run the blocking `fn` on the compute thread's lane: between two forwards, never beside
        one, and to its end once started (a release or resume of GPU memory must not be cut)."""
        with anyio.CancelScope(shield=True):
            async with self._lane:
                await anyio.to_thread.run_sync(fn)

    def _retract_running(self) -> None:
        # Back to the head of the queue, in order, so they are re-admitted before newer requests.
        for req in reversed(self._running):
            self.model.release(self._row(req))  # a retracted request holds no cache
            req.state = RequestState.WAITING
            self._waiting.appendleft(req)
        self._running.clear()

    # ---- weights -----------------------------------------------------------------------------------

    def set_weight_version(self, version: str) -> None:
        """Serve `version` from the next decode step on; every request in flight (running, waiting,
        retracted or held in place) records the boundary at its current output length."""
        self.weight_version = version
        for req in self._tracked.values():
            req.mark_version(version)

    async def update_weights(self, folder: str | Path, *, weight_version: str | None = None) -> None:
        """Load new weights from `folder` between decode steps; set the weight version only on success.

        Raises WeightLoadError (the old weights keep serving).
        """
        folder = str(folder)
        async with self._update_lock:
            staged = await self.model.read_weights(folder)
            await self._swap(staged, weight_version)
            self.model_path = folder
        log.info("loaded weights from %s (weight_version %s)", folder, self.weight_version)

    async def apply_staged(self, staged: object, *, weight_version: str | None = None) -> None:
        """Make weights staged elsewhere (received over torch.distributed) live between two decode
        steps, as `update_weights` does once it has read a folder."""
        async with self._update_lock:
            await self._swap(staged, weight_version)
        log.info("applied received weights (weight_version %s)", self.weight_version)

    async def _swap(self, staged: object, weight_version: str | None) -> None:
        # Once the copy starts it must finish and be recorded, or weights and version disagree.
        with anyio.CancelScope(shield=True):
            async with self._lane:
                await self.model.apply_weights(staged)
                # Inside the lane: no forward runs between the swap and the version mark, so the
                # spans of running requests split exactly at the first step on the new weights.
                if weight_version is not None:
                    self.set_weight_version(weight_version)
            self._updates += 1

    # ---- state -------------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def is_idle(self) -> bool:
        """Nothing holds cache: no running or waiting request. Requests retracted by a pause hold
        no cache, so they do not count (what slime's patched SGLang does, so that a publish can flush)."""
        if self._pause is PauseMode.RETRACT:
            return not self._running
        return not self._running and not self._waiting

    def context_tokens(self) -> int:
        """Tokens of every running request's sequence: the KV cache they hold, where one is kept."""
        return sum(len(r.prompt_ids) + len(r.output_ids) for r in self._running)

    def flush_cache(self) -> bool:
        """Forget cached prefixes if nothing holds cache; say whether it did (SGLang's /flush_cache)."""
        if not self.is_idle():
            return False
        self.model.flush_cache()
        return True

    async def wait_step(self) -> None:
        """Wait until the next decode step completes."""
        await self._stepped.wait()

    def statistics(self) -> CoreStatistics:
        return CoreStatistics(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_held=self._held,
            paused=None if self._pause is None else self._pause.value,
            steps=self._steps,
            generated_tokens=self._generated,
            max_batch_size=self._max_batch,
            finished_requests=self._finished,
            aborted_requests=self._aborted,
            weight_updates=self._updates,
        )

    # ---- the loop ----------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Decode until cancelled. On the way out every tracked request is aborted, so no client hangs."""
        self._alive = True
        task_status.started()
        try:
            while True:
                await self._wait_work()
                batch = self._admit()
                if batch:
                    await self._step(batch)
        finally:
            self._alive = False
            self.abort(abort_all=True)

    async def _wait_work(self) -> None:
        while self._pause is not None or self._held_by is not None or not (self._running or self._waiting):
            self.model.idle()
            self._work = anyio.Event()
            await self._work.wait()

    def _admit(self) -> list[Request]:
        while self._waiting and len(self._running) < self.max_running_requests:
            req = self._waiting.popleft()
            if req.params.max_new_tokens <= len(req.output_ids):  # max_new_tokens=0: nothing to do
                self._finish(req, Finish(FinishKind.LENGTH, length=req.params.max_new_tokens))
                continue
            req.state = RequestState.RUNNING
            self._running.append(req)
        return list(self._running)

    async def _step(self, batch: list[Request]) -> None:
        """One forward for `batch`, with the bookkeeping every engine shares around it: waiters
        on `wait_step` wake afterwards, and a retract pause takes effect between forwards."""
        self._stepping = True
        try:
            await self._forward(batch)
        finally:
            self._stepping = False
            stepped, self._stepped = self._stepped, anyio.Event()
            stepped.set()
        if self._pause is PauseMode.RETRACT:
            self._retract_running()

    async def _forward(self, batch: list[Request]) -> None:
        """One forward over `batch`; every request still running gets the token drawn for it."""
        try:
            async with self._lane:
                # Rows are built once the lane is ours: a request aborted while we waited is not sent.
                batch = [req for req in batch if req.state is RequestState.RUNNING]
                if not batch:
                    return
                draws = await self.model.forward([self._row(req) for req in batch])
        except Exception as exc:  # a failed forward ends its batch, not the server
            log.exception("decode step failed for %d requests", len(batch))
            for req in batch:
                if req.state is RequestState.RUNNING:
                    self._leave_running(req)
                    self._finish(req, Finish(FinishKind.ERROR, message=f"{type(exc).__name__}: {exc}"))
            return
        self._apply(batch, draws)
        self._steps += 1
        self._max_batch = max(self._max_batch, len(batch))

    def _row(self, req: Request) -> Row:
        p = req.params
        banned: tuple[int, ...] = ()
        if len(req.output_ids) < p.min_new_tokens:
            banned = tuple(sorted(self._stop_ids(p)))
        return Row(
            prompt_ids=req.prompt_ids,
            output_ids=tuple(req.output_ids),
            params=p,
            seed=req.seed,
            banned=banned,
            rid=req.rid,
            key=req.serial,
            end_at=req.end_at,
            end_token=min(self.model.eos_token_ids) if req.end_at is not None else -1,
            routes_from=req.routed_positions if req.return_routed_experts else None,
            top_logprobs=req.top_logprobs_num,
        )

    def _stop_ids(self, p: SamplingParams) -> frozenset[int]:
        return p.stop_token_ids if p.ignore_eos else p.stop_token_ids | self.model.eos_token_ids

    def _apply(self, batch: Sequence[Request], draws: Sequence[Draw | None]) -> None:
        for req, draw in zip(batch, draws, strict=True):
            if draw is None or req.state is not RequestState.RUNNING:  # no token, or aborted meanwhile
                continue
            if draw.routes:  # R3: the rows of the positions this forward read that the request lacked
                req.routes += draw.routes
                req.routed_positions = len(req.prompt_ids) + len(req.output_ids)
            if req.top_logprobs_num:
                req.output_top_logprobs.append(draw.top)
            req.output_ids.append(draw.token_id)
            req.output_logprobs.append(draw.logprob)
            self._generated += 1
            finish = self._check_finished(req)
            if finish is None:
                req._notify()
            else:
                self._leave_running(req)
                self._finish(req, finish)

    def _check_finished(self, req: Request) -> Finish | None:
        # SGLang's order (Req.check_finished): length first, then stop tokens, then stop strings.
        p = req.params
        if len(req.output_ids) >= p.max_new_tokens:
            return Finish(FinishKind.LENGTH, length=p.max_new_tokens)
        last = req.output_ids[-1]
        if last in self._stop_ids(p):
            return Finish(FinishKind.STOP_TOKEN, matched=last)
        if p.stop:
            tail = self.model.tokenizer.decode(req.output_ids[-(max(map(len, p.stop)) + 8) :])
            for s in p.stop:
                if s in tail:
                    return Finish(FinishKind.STOP_STR, matched=s)
        return None

    def _leave_running(self, req: Request) -> None:
        self._running.remove(req)
        self.model.release(self._row(req))

    def _finish(self, req: Request, finish: Finish) -> None:
        req.finish = finish
        req.finished_at = time.perf_counter()
        req.state = RequestState.FINISHED
        self._tracked.pop(req.rid, None)
        self._finished += 1
        req._notify()
