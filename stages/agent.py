"""Multi-turn agents inside the generator pool (issue 9): the `ctx` an agent drives a sample with.

An agent is `async def run(ctx: AgentContext, sample: Sample) -> None`, named on the command line
by `--custom-generate-function-path module:function` (slime's flag). It builds one sample's
transcript turn by turn:

- `await ctx.generate()` runs one model turn on the current transcript. The model's tokens are
  appended with their behaviour log-probs, loss mask 1 and the engine's version spans, exactly as
  the single-turn path stores them (the same request code in `GeneratorPool`).
- `ctx.append(token_ids)` adds environment/tool tokens: loss mask 0, behaviour log-prob 0.0 (never
  read: the mask keeps them out of the loss and the importance weights), see `Sample.with_environment`.
- `ctx.state` is a small dict the agent owns (turn counter, tool results). It must stay JSON: it is
  stored with the sample (`Sample.metadata["agent"]`, in the msgpack record, never pickled).

Abort contract. When the pool stops (partial rollout's "enough", an abort-mode publish, shutdown),
`ctx.generate` raises `AgentInterrupted`; the agent lets it propagate (it is a BaseException, as
asyncio's CancelledError is, so an `except Exception` around a turn does not catch it). The transcript so far (with
the interrupted turn's tokens) and `ctx.state` are what is stored, and the resumed sample re-enters
the agent from the top with them: the agent reads `ctx.state` to see where it was and continues,
and its next `ctx.generate` continues an interrupted turn token-exactly (the turn's token budget
and `min_new_tokens` count what it already made). So an agent is written as a small state machine
over `ctx.state`, and it updates `ctx.state` in the same synchronous step as the `ctx.append` whose
result it records (no `await` between them), so no stop can separate the two.

Tool side effects are not replayed, but a tool call whose result was not yet appended when the
pool stopped (or the process died) runs again on resume: tools must be idempotent, or the agent
records their result in `ctx.state` before acting on it.

An exception from the agent fails its sample (`Sample.error` names the agent and the exception);
the pool keeps running.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio.lowlevel

from core.columns import LogProbs, TokenIds
from core.errors import (
    AgentError,
    AgentInterrupted,
    AgentStateError,
    EngineUnavailableError,
)
from core.types import FinishReason, Group, Sample, SampleStatus
from stages.continuation import N_RULE, Detokenize
from stages.failures import first_traceback

__all__ = ["AGENT_KEY", "Agent", "AgentContext", "Turn", "TurnRunner", "agent_name", "run_agent_sample"]

# Where an agent's record lives in `Sample.metadata`: {"state": ..., "turn_start": ..., "turns": ...}.
AGENT_KEY = "agent"

_STATE_RULE = "ctx.state must be JSON (dict/list/str/int/float/bool/None with str keys): it is stored with the sample"


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished model turn: the tokens `ctx.generate` appended and how the engine ended them."""

    token_ids: TokenIds
    logprobs: LogProbs
    finish_reason: FinishReason  # STOP (EOS or a stop string) or LENGTH (turn or sample budget)


def agent_name(agent: Callable[..., Any]) -> str:
    """`module:function`, for messages."""
    return f"{getattr(agent, '__module__', '?')}:{getattr(agent, '__qualname__', repr(agent))}"


def _first_non_json(value: Any, where: str) -> tuple[str, Any] | None:
    """The path and value of the first leaf that JSON cannot hold, or None."""
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (where, value)
    if isinstance(value, (list, tuple)):
        for k, item in enumerate(value):
            if (bad := _first_non_json(item, f"{where}[{k}]")) is not None:
                return bad
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return (f"{where} key", key)
            if (bad := _first_non_json(item, f"{where}[{key!r}]")) is not None:
                return bad
        return None
    return (where, value)


class TurnRunner(Protocol):
    """What a context needs from the pool that runs it (`GeneratorPool` is one): the version the
    clock serves, and one model turn run through the pool's request path."""

    @property
    def clock_version(self) -> int: ...

    async def run_agent_turn(
        self, ctx: AgentContext, params: Mapping[str, Any], turn_start: int, cap: int
    ) -> FinishReason: ...


class AgentContext:
    """What an agent may do to its sample. Everything it changes is stored with the sample."""

    def __init__(
        self,
        pool: TurnRunner,
        name: str,
        group: Group,
        samples: list[Sample],
        i: int,
        *,
        sampling_params: Mapping[str, Any],
        max_response_len: int,
        detokenize: Detokenize | None,
        tokenizer: object | None,
    ) -> None:
        self._pool, self._name, self._group, self._samples, self._i = pool, name, group, samples, i
        self._params = dict(sampling_params)
        self._max_len = max_response_len
        self._detokenize = detokenize
        self.tokenizer = tokenizer  # the run's tokenizer object when there is one (None otherwise)
        record = samples[i].metadata.get(AGENT_KEY) or {}
        self.state: dict[str, Any] = dict(record.get("state") or {})
        self._turn_start: int | None = record.get("turn_start")
        self._turns = int(record.get("turns", 0))
        self.last_finish: FinishReason | None = None
        self._empty_turn = False  # the last ctx.generate had no budget and made no request

    # -- what the agent reads -----------------------------------------------------------------
    @property
    def sample(self) -> Sample:
        """The sample as it stands now (prompt, every response token so far, masks, spans)."""
        return self._samples[self._i]

    @property
    def group(self) -> Group:
        return self._group

    @property
    def transcript(self) -> TokenIds:
        """Prompt and response tokens: what the next model turn sees."""
        s = self.sample
        return s.prompt_ids + s.response_ids

    @property
    def remaining(self) -> int:
        """Response tokens left before the sample is truncated (`--rollout-max-response-len`)."""
        return max(0, self._max_len - self.sample.response_len)

    @property
    def sampling_params(self) -> Mapping[str, Any]:
        return dict(self._params)

    @property
    def turns(self) -> int:
        """Model turns finished so far, across resumes."""
        return self._turns

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._detokenize is None:
            raise AgentError(
                self._name, list(token_ids), "ctx.decode needs a detokenizer (run_pipeline(detokenize=...))"
            )
        return self._detokenize(token_ids)

    # -- what the agent does ------------------------------------------------------------------
    def append(self, token_ids: Sequence[int]) -> int:
        """Append environment/tool tokens (loss mask 0); returns how many fit in the budget."""
        if isinstance(token_ids, (str, bytes)):  # iterating it would give characters, not token ids
            raise AgentError(
                self._name, token_ids[:40], "ctx.append takes token ids, not text: encode it with the run's tokenizer"
            )
        tokens = [int(t) for t in token_ids][: self.remaining]
        if self._turn_start is not None:
            raise AgentError(self._name, tokens, "ctx.append during an unfinished model turn")
        self._put(self.sample.with_environment(tokens, version=self._pool.clock_version))
        return len(tokens)

    async def generate(self, *, max_new_tokens: int | None = None, **overrides: Any) -> Turn:
        """One model turn on the transcript, continued across aborts and publishes until the engine
        stops it (EOS, a stop string, or the turn's or sample's token budget). Raises
        `AgentInterrupted` when the pool stops; the turn continues on the sample's resume."""
        cap = self.remaining if max_new_tokens is None else max_new_tokens
        if self._turn_start is None and min(cap, self.remaining) <= 0:
            # A turn with no budget makes no request and returns at once. Once is an answer (the
            # sample is full); again in a row is an agent looping without `ctx.remaining`, which
            # would hold the event loop forever: it fails this sample instead.
            if self._empty_turn:
                raise AgentError(
                    self._name,
                    {"remaining": self.remaining, "max_new_tokens": max_new_tokens},
                    "ctx.generate again with no token budget left (the last turn made no token either); "
                    "end the agent when ctx.remaining is 0",
                )
            self._empty_turn = True
            await anyio.lowlevel.checkpoint()
            return Turn(TokenIds(), LogProbs(), FinishReason.LENGTH)
        self._empty_turn = False
        if self._turn_start is None:
            self._turn_start = self.sample.response_len
            self._put(self.sample)
        turn_start = self._turn_start
        params = dict(self._params, **overrides)
        if params.get("n", 1) != 1:
            raise AgentError(self._name, {"n": params["n"]}, f"ctx.generate's n {N_RULE}")
        reason = await self._pool.run_agent_turn(self, params, turn_start, cap)
        s = self.sample
        self._turn_start = None
        self._turns += 1
        self.last_finish = reason
        self._put(s)
        return Turn(s.response_ids[turn_start:], s.logprobs[turn_start:], reason)

    # -- bookkeeping (the pool's side) --------------------------------------------------------
    def _record(self) -> dict[str, Any]:
        bad = _first_non_json(self.state, "ctx.state")
        if bad is not None:
            raise AgentStateError(self._name, bad[1], f"{bad[0]} is not JSON; {_STATE_RULE}")
        state = json.loads(json.dumps(self.state))  # a copy the agent cannot change afterwards
        return {"state": state, "turn_start": self._turn_start, "turns": self._turns}

    def _put(self, sample: Sample, *, status: SampleStatus = SampleStatus.PARTIAL) -> None:
        """Store `sample` (with the agent's record) as the pool's copy: what a stop or crash keeps."""
        meta = dict(sample.metadata, **{AGENT_KEY: self._record()})
        self._samples[self._i] = dataclasses.replace(sample, status=status, metadata=meta)

    def _interrupted(self) -> AgentInterrupted:
        return AgentInterrupted(f"{self._group.group_id}/{self._i}")


class Agent(Protocol):
    """A multi-turn agent: `async def run(ctx, sample) -> None`, driving one sample through `ctx`
    (see the module docstring for the abort contract). Named by `--custom-generate-function-path`."""

    def __call__(self, ctx: AgentContext, sample: Sample, /) -> Awaitable[None]: ...


async def run_agent_sample(ctx: AgentContext, agent: Agent) -> None:
    """Run the agent over its sample; the sample ends finished, partial (stopped) or failed."""
    name = ctx._name
    try:
        await agent(ctx, ctx.sample)
    except BaseException as exc:
        if _interrupted(exc):
            _save_quietly(ctx)
            return
        if isinstance(exc, EngineUnavailableError):
            _save_quietly(ctx)  # no engine serves at all: the pool ends, as on the single-turn path
            raise
        if not isinstance(exc, Exception):  # cancelled: the pipeline is going down; keep what the agent has
            _save_quietly(ctx)
            raise
        error = str(exc) if isinstance(exc, AgentError) else f"agent {name!r} raised {type(exc).__name__}: {exc}"
        if not isinstance(exc, AgentError):  # the user's code: where it raised, once per error and line
            first_traceback(f"agent {name!r}", exc)
        ctx._samples[ctx._i] = dataclasses.replace(
            ctx.sample, status=SampleStatus.FAILED, finish_reason=FinishReason.ERROR, error=error
        )
        return
    truncated = ctx.remaining == 0
    status = SampleStatus.TRUNCATED if truncated else SampleStatus.COMPLETED
    ctx._put(ctx.sample, status=status)
    ctx._samples[ctx._i] = dataclasses.replace(
        ctx.sample, finish_reason=FinishReason.LENGTH if truncated else FinishReason.STOP, error=None
    )


def _interrupted(exc: BaseException) -> bool:
    """An interruption, alone or as every error of a group (an agent that runs turns in a task
    group of its own gets them wrapped)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(AgentInterrupted)[1] is None
    return isinstance(exc, AgentInterrupted)


def _save_quietly(ctx: AgentContext) -> None:
    try:
        ctx._put(ctx.sample)
    except AgentStateError:
        pass  # the last good record (after the last append or turn) stays
