"""The generator pool: runs samples on the engines, at most `slots` requests at a time.

Slots are counted in samples, not groups: when most samples of a group are done, their slots take
samples of the next group instead of idling behind one straggler.

Continuation is token-exact: a sample with a prefix is resent as `prompt + response_so_far` in
`input_ids`, with `max_new_tokens = max_response_len - len(response_so_far)`; nothing is ever
re-tokenized, and a finished sample is never regenerated.

Versions are the engine's: each segment is stamped from the spans in `meta_info.weight_versions`.
An older engine sends one `weight_version` per answer; when it differs from the clock's version at
send time, the tokens before the publish are of unknown version and the whole segment is stamped
with the older one (never the newer), counted in `unknown_boundary_tokens`. Any version the clock
has published is accepted, however late the answer is processed; a version from the future fails
that one request, visibly, and nothing else.

`stop()` is the partial-rollout "enough": no new request starts, every engine aborts what it runs,
and each group ends somewhere: finished groups go downstream, the rest go to the store as partial
groups with every prefix they have. Nothing generated is dropped.

Multi-turn agents (`stages.agent`) run each model turn through `run_agent_turn`, which shares
`_request` (retries, stamping, stop boundaries, the timeline) with the single-turn loop. That is why
this module runs past 400 lines: one request path for both, rather than a second copy elsewhere.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from core.clock import VersionClock
from core.columns import LogProbs, TokenIds
from core.errors import EngineError, EngineLostError, EngineUnavailableError, PipelineError, VersionMismatchError
from core.types import FinishReason, Group, Sample, SampleStatus, Segment, VersionSpan
from stages.admission import Admission, Outcome
from stages.agent import Agent, AgentContext, agent_name, run_agent_sample
from stages.continuation import (
    Detokenize,
    continuation_params,
    cut_at,
    sampling_seed,
    stop_across_boundary,
    stop_strings,
)
from stages.failures import FailureLog
from stages.sglang_client.payloads import TokenPayloads, routes_for_new_tokens
from stages.sglang_client.wire import GenerateResult
from stages.store_ports import PoolStore

__all__ = ["GenerateEngine", "GeneratorPool", "GeneratorStatistics", "RequestLog"]

# How long a stop waits for aborted requests to come back before it aborts again. A request that
# was on the wire while the first abort ran reaches the engine after it, and needs a second one.
REABORT_INTERVAL = 0.25
# Attempts a sample gets when its requests find no engine while others are answered; each attempt
# is itself retried with backoff by the client.
SAMPLE_ATTEMPTS = 3
# How long a pool going down may spend putting its groups back in the store.
SAVE_DEADLINE = 10.0

log = structlog.get_logger("generator")


class GenerateEngine(Protocol):
    """What the pool needs from the engines (an `EngineFleet` in production, a fake in tests)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str,
        return_logprob: bool = True,
        **fields: object,
    ) -> GenerateResult:
        """One `/generate` with `input_ids` and `return_logprob`; SGLang's sampling params (JSON);
        `fields`, when given, are further top-level request fields (R3 and SC: `TokenPayloads`)."""
        ...

    async def abort_all(self) -> None:
        """`/abort_request` for everything in flight on every engine; the requests answer `abort`."""
        ...


class RequestLog(Protocol):
    """Where the pool records each request's span for the timeline (the run's `pipeline.events.EventLog`).

    A Protocol, passed in by the controller, so that this stage does not import `pipeline.events`:
    imports point down (launch -> pipeline -> stages -> storage), never back up.
    """

    def since(self, perf_counter_time: float) -> float: ...

    def record(self, kind: str, **fields: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class GeneratorStatistics:
    slots: int
    running_requests: int
    groups_in_flight: int
    requests: int
    aborted_requests: int
    resumed_samples: int
    generated_tokens: int
    failed_samples: int
    busy_slot_seconds: float  # sum over requests of their time in flight
    # Tokens an engine without per-token spans stamped with a version other than the one serving
    # when the request was sent: stamped with the older version, since the boundary is unknown.
    unknown_boundary_tokens: int = 0
    agent_retries: int = 0  # agent runs made again after the agent raised (--agent-max-retries)
    # R3: tokens kept without their routes (`NO_ROUTE` rows), from aborted answers that carried
    # none: SGLang answers a request aborted in its waiting queue (one it had retracted, with
    # tokens) without `routed_experts`. The trainer's router routes those tokens itself.
    unrouted_tokens: int = 0


class GeneratorPool:
    def __init__(
        self,
        engine: GenerateEngine,
        *,
        slots: int,
        sampling_params: Mapping[str, Any],
        max_response_len: int,
        clock: VersionClock,
        store: PoolStore,
        admission: Admission,
        seed: int = 0,
        events: RequestLog | None = None,
        detokenize: Detokenize | None = None,
        agent: Agent | None = None,
        tokenizer: object | None = None,
        agent_max_retries: int = 0,
        payloads: TokenPayloads | None = None,
    ) -> None:
        self._engine = engine
        # An agent that raised runs again from where its sample stood, up to this many times.
        self._agent_retries = agent_max_retries
        # R3 routes and SC sampler heads asked for with every request (`stages.sglang_client.payloads`).
        self._payloads = payloads if payloads is not None else TokenPayloads()
        self._route_layers: int | None = None  # the model's MoE layers, learned from the first answer
        # A multi-turn agent drives each sample through `stages.agent.AgentContext` instead of
        # the one-request-per-continuation loop below; both send requests through `_request`.
        self._agent = agent
        self._tokenizer = tokenizer
        # fast_acquire: a free slot is taken without a trip through the event loop (the default
        # yields on every acquire, once per request and once per group); every request then awaits
        # the network, which is the checkpoint. A full pool still blocks and is cancellable.
        self._slots = anyio.Semaphore(slots, fast_acquire=True)
        # Which slot a request runs in, for the timeline; the semaphore guarantees one is free.
        self._free_slots = list(range(slots - 1, -1, -1))
        # Made only while someone waits (`wait_slot_freed`): an Event per request cost 6 us.
        self._slot_freed: anyio.Event | None = None
        self._events = events
        self._n_slots = slots
        self._params = dict(sampling_params)
        # Stop strings over a prefix/continuation boundary need the tokenizer's decode; without
        # one they are refused for modes that continue (`continuation.sampling_problems`).
        self._stops = stop_strings(sampling_params) if detokenize is not None else ()
        self._detokenize = detokenize
        self._max_len = max_response_len
        self._clock = clock
        self._store = store
        self._admission = admission
        self._seed = seed
        self._stopping = False
        self._groups_in_flight = 0
        self._running = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._stats = dict(
            requests=0, aborted=0, resumed=0, tokens=0, failed=0, unknown_boundary=0, agent_retries=0, unrouted=0
        )
        self._failures = FailureLog("generate")
        self._busy = 0.0
        # Requests that failed for want of an engine since the last one that got an answer.
        self._unavailable_run = 0

    async def run(
        self,
        receive: MemoryObjectReceiveStream[Group],
        send: MemoryObjectSendStream[Group],
        *,
        task_status: TaskStatus[None],
    ) -> None:
        async with receive, send, anyio.create_task_group() as tg:
            task_status.started()
            while True:
                # Take the next group only once a slot is free, so queued groups stay with the
                # dispenser (where a stop can still return them untouched) rather than here.
                async with self._slots:
                    pass
                try:
                    group = await receive.receive()
                except anyio.EndOfStream:
                    return
                self._groups_in_flight += 1
                self._idle = anyio.Event() if self._idle.is_set() else self._idle
                tg.start_soon(self._run_group, group, send.clone())

    # -- stop and resume (partial rollout) ----------------------------------------------------
    async def stop(self) -> None:
        """Start no new request, abort every running one, and wait until every group has left."""
        self._stopping = True
        while self._groups_in_flight:
            await self._engine.abort_all()
            with anyio.move_on_after(REABORT_INTERVAL):
                await self._idle.wait()

    @property
    def idle_slots(self) -> int:
        """Slots that no request holds and no sample is queued for."""
        return self._slots.value

    async def wait_slot_freed(self) -> None:
        if self._slot_freed is None:
            self._slot_freed = anyio.Event()
        await self._slot_freed.wait()

    def resume(self) -> None:
        self._stopping = False

    # -- one group ----------------------------------------------------------------------------
    async def _run_group(self, group: Group, send: MemoryObjectSendStream[Group]) -> None:
        samples = list(group.samples)
        async with send:
            try:
                todo = [i for i, sample in enumerate(samples) if not sample.status.finished]
                if todo:
                    async with anyio.create_task_group() as tg:
                        # The group's own task runs the last sample instead of idling in the task
                        # group: one task fewer per group (an anyio task costs about 40 us).
                        for i in todo[:-1]:
                            tg.start_soon(self._run_sample, group, samples, i)
                        await self._run_sample(group, samples, todo[-1])
                await self._dispose(group.with_samples(samples), send)
            except BaseException:
                # The pipeline is going down (a stage crashed, or no engine is left). What this
                # group generated so far goes back to the store as a partial group, so the next
                # run continues it rather than losing it.
                await self._save_partial_on_the_way_down(group.with_samples(samples))
                raise
            finally:
                self._groups_in_flight -= 1
                if not self._groups_in_flight:
                    self._idle.set()

    async def _save_partial_on_the_way_down(self, group: Group) -> None:
        with anyio.move_on_after(SAVE_DEADLINE, shield=True):
            try:
                await self._store.put_partial(group)
            except PipelineError as exc:  # e.g. it already reached the ready or failed set
                log.warning("group not stored as partial while stopping", group=group.group_id, reason=str(exc))

    async def _dispose(self, group: Group, send: MemoryObjectSendStream[Group]) -> None:
        if group.failed:
            self._failures.failed(group)
            await self._store.put_failed(group)
            self._admission.settle(Outcome.FAILED, group)
        elif group.finished:
            await send.send(group)
        else:
            # Shielded: once a group is out of the engines, it must reach the store even if the
            # pipeline is being cancelled, or its prefixes would be lost.
            with anyio.CancelScope(shield=True):
                await self._store.put_partial(group)
            self._admission.settle(Outcome.PARTIAL)

    async def _run_sample(self, group: Group, samples: list[Sample], i: int) -> None:
        """Run `samples[i]` until it finishes, fails, or the pool stops; `samples[i]` always holds
        every token received so far, so a group saved on the way down keeps them."""
        if self._agent is not None:
            if samples[i].status is SampleStatus.FAILED:
                return
            before = samples[i]
            for attempt in range(1 + self._agent_retries):
                if attempt:
                    # Bounded and counted (`--agent-max-retries`, agent/retries_total): the failed
                    # attempt's tokens are dropped and the agent starts again where the sample stood.
                    self._stats["agent_retries"] += 1
                    samples[i] = before
                ctx = AgentContext(
                    self,
                    agent_name(self._agent),
                    group,
                    samples,
                    i,
                    sampling_params=self._params,
                    max_response_len=self._max_len,
                    detokenize=self._detokenize,
                    tokenizer=self._tokenizer,
                )
                await run_agent_sample(ctx, self._agent)
                if samples[i].status is not SampleStatus.FAILED or self._stopping:
                    return
            return
        sample = samples[i]
        unanswered = 0  # attempts in a row that found no engine (each already retried by the client)
        while not sample.status.finished and sample.status is not SampleStatus.FAILED:
            left = self._max_len - sample.response_len
            if left <= 0:
                samples[i] = dataclasses.replace(
                    sample, status=SampleStatus.TRUNCATED, finish_reason=FinishReason.LENGTH
                )
                return
            async with self._slots:
                if self._stopping:
                    return
                if sample.response_len:
                    sample = sample.resumed()
                    self._stats["resumed"] += 1
                segment = await self._request(group, sample, left)
            unanswered = unanswered + 1 if segment.error is not None else 0
            if unanswered > SAMPLE_ATTEMPTS:
                # Other requests get answers but this one never does (e.g. a prompt that crashes
                # the engine): the sample fails visibly rather than being retried forever.
                self._stats["failed"] += 1
                samples[i] = dataclasses.replace(
                    sample,
                    status=SampleStatus.FAILED,
                    finish_reason=FinishReason.ERROR,
                    error=f"no answer after {unanswered} attempts: {segment.error}",
                )
                return
            sample = samples[i] = sample.extended(segment, max_response_len=self._max_len)
            if sample.status is SampleStatus.PARTIAL:
                # Aborted, or no engine answered. While stopping, the prefix goes to the store
                # with its group. Otherwise a publish paused the engines (resume as soon as the
                # new version serves) or an engine is away (try again; `_engines_gone` ends the
                # run once every slot's worth of requests in a row found no engine).
                if self._stopping:
                    return
                await self._clock.wait_serving()

    # -- one agent turn -------------------------------------------------------------------------
    @property
    def clock_version(self) -> int:
        return self._clock.version

    async def run_agent_turn(
        self, ctx: AgentContext, params: Mapping[str, Any], turn_start: int, cap: int
    ) -> FinishReason:
        """Run one model turn of an agent's sample until the engine ends it; the same requests,
        retries and stamping as `_run_sample`, over the turn's own token budget. Each answer is
        stored through the context at once, so a stop or a crash keeps it."""
        unanswered = 0
        while True:
            sample = ctx.sample
            made = sample.response_len - turn_start
            left = min(cap - made, self._max_len - sample.response_len)
            if left <= 0:
                return FinishReason.LENGTH
            async with self._slots:
                if self._stopping:
                    raise ctx._interrupted()
                if made:
                    sample = sample.resumed()
                    self._stats["resumed"] += 1
                segment = await self._request(
                    ctx.group, sample, left, params=continuation_params(params, made, left), continued=made
                )
            unanswered = unanswered + 1 if segment.error is not None else 0
            if segment.finish_reason is FinishReason.ERROR or unanswered > SAMPLE_ATTEMPTS:
                if unanswered > SAMPLE_ATTEMPTS:
                    self._stats["failed"] += 1
                raise PipelineError(f"model turn failed after {unanswered} attempt(s): {segment.error}")
            ctx._put(sample.extended(segment, max_response_len=self._max_len))
            if segment.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                return segment.finish_reason
            if self._stopping:
                raise ctx._interrupted()
            await self._clock.wait_serving()

    async def _request(
        self,
        group: Group,
        sample: Sample,
        max_new_tokens: int,
        *,
        params: dict[str, Any] | None = None,
        continued: int | None = None,
    ) -> Segment:
        """One request for `sample`. An agent passes its turn's `params` and how many tokens the
        turn already `continued` (the boundary a stop string may straddle); else the whole response."""
        if params is None:
            params = continuation_params(self._params, sample.response_len, max_new_tokens)
        continued = sample.response_len if continued is None else continued
        params["sampling_seed"] = sampling_seed(self._seed, group.group_id, sample.index)
        rid = f"{group.group_id}-s{sample.index}-{sample.response_len}"
        self._running += 1
        self._stats["requests"] += 1
        slot = self._free_slots.pop()
        started = time.perf_counter()
        sent_version = self._clock.version
        input_ids = sample.prompt_ids + sample.response_ids
        fields = (
            self._payloads.request_fields(len(input_ids), all_rows=self._route_layers is None)
            if self._payloads.any
            else {}
        )
        try:
            result = await self._engine.generate(input_ids, params, rid=rid, **fields)
        except EngineLostError:
            raise  # no engine will serve it: the run stops, and the group goes back to the store
        except EngineError as exc:
            # Retries already happened inside the client. A request the engine refused (4xx) is
            # this sample's own problem: it fails, visibly. No engine at all (unreachable, 5xx, an
            # overloaded router's 408 or 429) is nobody's sample's fault: it keeps its prefix and
            # goes back like an aborted one.
            self._engines_gone(exc)
            result = None
            if exc.refused:
                self._stats["failed"] += 1
                segment = Segment(TokenIds(), LogProbs(), FinishReason.ERROR, self._clock.version, error=str(exc))
            else:
                segment = Segment(TokenIds(), LogProbs(), FinishReason.ABORT, self._clock.version, error=str(exc))
        finally:
            self._running -= 1
            self._free_slots.append(slot)
            if self._slot_freed is not None:
                self._slot_freed.set()
                self._slot_freed = None
            ended = time.perf_counter()
            self._busy += ended - started
        if result is not None:
            self._unavailable_run = 0
            segment = self._stamped(result, sent_version)
            if self._payloads.any:
                segment = self._with_payloads(segment, result, sample, len(input_ids), fields)
            if self._stops and continued:
                segment = self._stop_at_boundary(sample, segment)
            self._stats["tokens"] += len(segment.token_ids)
            if segment.finish_reason is FinishReason.ABORT:
                self._stats["aborted"] += 1
        if self._events is not None:
            self._events.record(
                "request",
                slot=slot,
                group=group.group_id,
                sample=sample.index,
                start=round(self._events.since(started), 6),
                end=round(self._events.since(ended), 6),
                prefix=sample.response_len,
                tokens=len(segment.token_ids),
                finish=segment.finish_reason.value,
                version=segment.version,
            )
        return segment

    def _engines_gone(self, exc: EngineError) -> None:
        """Fail the pool once `slots` requests in a row found no engine (unreachable or 5xx after
        retries): a full round of the slots failing means no engine serves, and failing group after
        group would only burn through the dataset while the trainer waits for a batch forever.
        One bad request (a 4xx) is that sample's problem, and does not count."""
        if exc.refused:
            return
        self._unavailable_run += 1
        if self._unavailable_run >= self._n_slots:
            # The same words from every request that gets here, so the run's end says it once.
            raise EngineUnavailableError(
                exc.url, f"{self._n_slots} requests in a row found no engine to serve them; the last: {exc}"
            ) from exc

    def _stamped(self, result: GenerateResult, sent_version: int) -> Segment:
        """The answer as a segment whose spans say which version produced which token.

        A version the clock never published (from the future, or not a version at all) fails this
        request like an answer the engine refused: the sample fails visibly, the run goes on.
        """
        if result.weight_version is None:  # an abort before prefill: no token to stamp
            return result.to_segment(sent_version)
        try:
            if result.weight_versions is not None:
                spans = tuple(
                    VersionSpan(s.start, s.end, self._published(s.version, result.rid))
                    for s in result.weight_versions
                    if s.end > s.start  # an abort before the first token, or two publishes in a row
                )
                newest = self._published(result.weight_version, result.rid)
                if len(spans) <= 1:
                    return result.to_segment(spans[0].version if spans else newest)
                return result.to_segment(spans[-1].version, spans)
            reported = self._published(result.weight_version, result.rid)
            if reported != sent_version and result.token_ids:
                # An older engine: the version changed while the request ran, but not at which
                # token. The older version is the truthful bound for staleness and the off-policy
                # share; the newer one would claim prefix tokens for a policy that never made them.
                self._stats["unknown_boundary"] += len(result.token_ids)
            return result.to_segment(min(reported, sent_version))
        except VersionMismatchError as exc:
            self._stats["failed"] += 1
            log.warning("answer from an unpublished version", rid=result.rid, reason=str(exc))
            return Segment(TokenIds(), LogProbs(), FinishReason.ERROR, self._clock.version, error=str(exc))

    def _with_payloads(
        self, segment: Segment, result: GenerateResult, sample: Sample, input_len: int, fields: Mapping[str, Any]
    ) -> Segment:
        """The segment with the R3 rows of its own tokens (never the prefix's re-prefill rows) and
        its SC heads checked. An answer without what was asked for fails this request, by name."""
        n = len(segment.token_ids)
        if segment.finish_reason is FinishReason.ERROR or n == 0:
            return dataclasses.replace(segment, routes=None, heads=None)
        try:
            routes = None
            top_k = self._payloads.routed_experts_top_k
            if top_k is not None and result.routed_experts is None and segment.finish_reason is FinishReason.ABORT:
                # SGLang collects a request's routes when it finishes in a forward; one aborted
                # in the waiting queue (retracted earlier, so it has tokens) is answered without
                # them (tokenizer_manager._handle_abort_req). Its tokens stay, routed by the
                # trainer's own router (`NO_ROUTE` rows), rather than be generated again.
                self._stats["unrouted"] += n
                top_k = None
            if top_k is not None:
                if result.routed_experts is None:
                    raise EngineError(
                        result.rid,
                        "answer has no meta_info.routed_experts although return_routed_experts was asked "
                        "(SGLang needs --enable-return-routed-experts; some gateways drop the field)",
                    )
                layers = sample.routes.layers if sample.routes is not None else self._route_layers
                routes = routes_for_new_tokens(
                    result.routed_experts,
                    echoed_start=result.routed_experts_start_len,
                    sent_start=int(fields["routed_experts_start_len"]),
                    input_len=input_len,
                    completion=n,
                    top_k=top_k,
                    layers=layers,
                    url=result.rid,
                    experts=self._payloads.routed_experts_count,
                )
                if routes is not None:
                    self._route_layers = routes.layers
            k = self._payloads.sampler_top_k
            if k is not None and (segment.heads is None or segment.heads.k != k):
                got = "none" if segment.heads is None else f"top-{segment.heads.k}"
                raise EngineError(
                    result.rid, f"answer has {got} meta_info.output_top_logprobs, top_logprobs_num={k} asked"
                )
            return dataclasses.replace(segment, routes=routes, heads=segment.heads if k is not None else None)
        except EngineError as exc:
            self._stats["failed"] += 1
            log.warning("answer without the asked per-token payloads", rid=result.rid, reason=str(exc))
            return Segment(TokenIds(), LogProbs(), FinishReason.ERROR, segment.version, error=str(exc))

    def _stop_at_boundary(self, sample: Sample, segment: Segment) -> Segment:
        """End a continuation where a stop string that started in its prefix ends, as SGLang would
        have for the uninterrupted request; the tokens after it were never meant to exist."""
        assert self._detokenize is not None
        found = stop_across_boundary(
            sample.response_ids,
            segment.token_ids,
            self._stops,
            self._detokenize,
            min_new_tokens=int(self._params.get("min_new_tokens") or 0),
        )
        return segment if found is None else cut_at(segment, found[0])

    def _published(self, reported: str, rid: str) -> int:
        """The clock's integer for an engine's version string, if the clock has published it:
        anything up to the current version, and the next one while it is being published."""
        newest = self._clock.version + (1 if self._clock.publishing else 0)
        try:
            version = int(reported)
        except (TypeError, ValueError):
            version = -1
        if not 0 <= version <= newest:
            raise VersionMismatchError(f"request {rid}", reported, f"a published version, 0..{newest}")
        return version

    def statistics(self) -> GeneratorStatistics:
        s = self._stats
        return GeneratorStatistics(
            self._n_slots,
            self._running,
            self._groups_in_flight,
            s["requests"],
            s["aborted"],
            s["resumed"],
            s["tokens"],
            s["failed"],
            self._busy,
            s["unknown_boundary"],
            s["agent_retries"],
            s["unrouted"],
        )
