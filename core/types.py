"""The vocabulary every stage speaks: prompts, samples, groups, version spans, batches.

Everything here is a frozen, slotted dataclass. A stage never mutates a sample; it builds the
next one with `Sample.extended(...)` or `dataclasses.replace`. Per-token columns (a segment's and a
sample's token ids, log-probs and loss mask) are read-only arrays (`core.columns`): compact, and
they compare, hash and concatenate as the tuples they stand for, so a sample can still be hashed,
compared and shared between tasks without copies going stale. Any sequence of numbers is accepted
where a column is built and stored as the column type.

The central invariant: `response_ids`, `logprobs` and `loss_mask` always have the same length,
and `spans` tile `[0, len(response_ids))` exactly, in order, with no gaps. `Sample.extended` is
the only way tokens are added, and it keeps that invariant.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .columns import LogProbs, LossMask, SamplerHeads, TokenIds, TokenRoutes

__all__ = [
    "Batch",
    "FinishReason",
    "Group",
    "PauseMode",
    "PromptTask",
    "RolloutMode",
    "Sample",
    "SampleStatus",
    "Segment",
    "StoreTransport",
    "VersionSpan",
    "WeightTransport",
    "group_id_for",
]


class SampleStatus(enum.Enum):
    """Where one sample stands. `COMPLETED` and `TRUNCATED` are the two finished states."""

    PENDING = "pending"  # never sent to an engine
    RUNNING = "running"  # a request is in flight
    PARTIAL = "partial"  # aborted with a prefix (possibly empty) that a later round continues
    COMPLETED = "completed"  # the engine stopped on EOS or a stop token
    TRUNCATED = "truncated"  # reached the response length limit
    FAILED = "failed"  # the engine or the reward failed for good; `Sample.error` says why

    @property
    def finished(self) -> bool:
        return self in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


class FinishReason(enum.Enum):
    """SGLang's `meta_info.finish_reason.type`, plus `error` for a request that failed."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Response tokens `[start, end)` were produced by policy version `version`."""

    start: int
    end: int
    version: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"a version span needs 0 <= start < end, got [{self.start}, {self.end})")


@dataclass(frozen=True, slots=True)
class PromptTask:
    """One dataset row: the prompt already tokenized, plus whatever the reward function needs."""

    index: int  # position in the dataset
    prompt_ids: tuple[int, ...]  # any sequence of ints is taken (a list, a numpy array) and kept as a tuple
    label: Any = None  # ground truth for the reward function (a JSON value)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = self.prompt_ids
        if type(ids) is tuple:  # the loaders' own form: nothing to convert (datasets are large)
            return
        # A task is compared with, and stored like, the tuple the store gives back: a list or an
        # array would compare unequal to its own round trip (or not at all, for an array).
        if isinstance(ids, (str, bytes)):
            raise ValueError(f"PromptTask {self.index}: prompt_ids is text ({ids[:40]!r}); tokenize it first")
        values = ids.tolist() if hasattr(ids, "tolist") else ids
        if not all(isinstance(t, int) for t in values):
            raise ValueError(f"PromptTask {self.index}: prompt_ids must be integers, got {values[:8]!r}")
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in values))


@dataclass(frozen=True, slots=True)
class Segment:
    """What one engine call added to a sample: new tokens, their log-probs, and how it ended."""

    token_ids: TokenIds
    logprobs: LogProbs
    finish_reason: FinishReason
    version: int  # the weight version of these tokens (of the last ones, when `spans` says more)
    error: str | None = None
    # Which version produced which of these tokens, over indices into `token_ids`, when a request
    # crossed a publish (the engine's `meta_info.weight_versions`). Empty: every token is `version`.
    spans: tuple[VersionSpan, ...] = ()
    # R3 and SC payloads of these tokens (one row each), when the request asked for them.
    routes: TokenRoutes | None = None
    heads: SamplerHeads | None = None

    def __post_init__(self) -> None:
        _as_column(self, "token_ids", TokenIds)
        _as_column(self, "logprobs", LogProbs)
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"a segment needs one log-prob per token, got {len(self.token_ids)} tokens "
                f"and {len(self.logprobs)} log-probs"
            )
        if self.routes is not None or self.heads is not None:  # the hot path has neither: no call
            _check_payloads("a segment", len(self.token_ids), self.routes, self.heads)
        if self.spans:
            covered = 0
            for span in self.spans:
                if span.start != covered:
                    raise ValueError(f"segment version spans leave a gap or overlap at {covered}: {self.spans}")
                covered = span.end
            if covered != len(self.token_ids):
                raise ValueError(f"segment version spans cover {covered} of {len(self.token_ids)} tokens")

    def version_spans(self) -> tuple[VersionSpan, ...]:
        """The spans over this segment's tokens: `spans`, or one span of `version` (none for no tokens)."""
        if self.spans or not self.token_ids:
            return self.spans
        return (VersionSpan(0, len(self.token_ids), self.version),)


@dataclass(frozen=True, slots=True)
class Sample:
    """One response to one prompt, possibly built over several engine calls and policy versions."""

    index: int  # position inside its group, 0..G-1
    prompt_ids: tuple[int, ...]
    response_ids: TokenIds = TokenIds()
    logprobs: LogProbs = LogProbs()  # behaviour log-prob of each response token, as the engine reported it
    loss_mask: LossMask = LossMask()  # 1 = the token trains
    spans: tuple[VersionSpan, ...] = ()
    status: SampleStatus = SampleStatus.PENDING
    finish_reason: FinishReason | None = None
    reward: float | None = None
    error: str | None = None
    # Response length at each continuation: a sample resumed twice, at 5 and 12 tokens, has (5, 12).
    # The trainer masks `[0, resumed_at[0])` under --mask-offpolicy-in-partial-rollout.
    resumed_at: tuple[int, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # Per-token payloads, one row per response token when present (None: never asked for).
    # R3: the experts each MoE layer chose in the forward that sampled the token; SC: the
    # sampler's top-k ids and log-probs at that step. Both follow the tokens through every
    # continuation exactly as the log-probs do (`extended`).
    routes: TokenRoutes | None = None
    heads: SamplerHeads | None = None

    def __post_init__(self) -> None:
        _as_column(self, "response_ids", TokenIds)
        _as_column(self, "logprobs", LogProbs)
        _as_column(self, "loss_mask", LossMask)
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"sample {self.index}: per-token arrays out of step: {n} tokens, "
                f"{len(self.logprobs)} log-probs, {len(self.loss_mask)} mask entries"
            )
        if self.routes is not None or self.heads is not None:
            _check_payloads(f"sample {self.index}", n, self.routes, self.heads)
        covered = 0
        for span in self.spans:
            if span.start != covered:
                raise ValueError(f"sample {self.index}: version spans leave a gap or overlap at {covered}")
            covered = span.end
        if covered != n:
            raise ValueError(f"sample {self.index}: version spans cover {covered} of {n} tokens")

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def oldest_version(self) -> int | None:
        """The policy version of the oldest token, or None for a sample with no tokens yet."""
        return min((s.version for s in self.spans), default=None)

    @property
    def versions(self) -> tuple[int, ...]:
        """Each distinct policy version that produced tokens, in the order they appear."""
        out: list[int] = []
        for span in self.spans:
            if not out or out[-1] != span.version:
                out.append(span.version)
        return tuple(out)

    def token_versions(self) -> list[int]:
        """The behaviour version of every response token, position by position."""
        out: list[int] = []
        for span in self.spans:
            out.extend([span.version] * (span.end - span.start))
        return out

    def extended(self, segment: Segment, *, max_response_len: int) -> Sample:
        """This sample with `segment` appended, its status set from the segment's finish reason.

        A continued prefix keeps its own log-probs and versions; the new tokens get the segment's
        spans, each merged into the previous one when the version did not change.
        """
        start = len(self.response_ids)
        spans = list(self.spans)
        for part in segment.version_spans():
            end = start + part.end
            if spans and spans[-1].version == part.version:
                spans[-1] = VersionSpan(spans[-1].start, end, part.version)
            else:
                spans.append(VersionSpan(start + part.start, end, part.version))
        response_ids = self.response_ids + segment.token_ids
        status = _status_after(segment.finish_reason, len(response_ids), max_response_len)
        n_old, n_new = len(self.response_ids), len(segment.token_ids)
        payloads = not (self.routes is None and self.heads is None and segment.routes is None and segment.heads is None)
        return dataclasses.replace(
            self,
            response_ids=response_ids,
            logprobs=self.logprobs + segment.logprobs,
            loss_mask=self.loss_mask + LossMask.ones(n_new),
            spans=tuple(spans),
            status=status,
            finish_reason=segment.finish_reason,
            error=segment.error,
            routes=_joined_routes(self.routes, n_old, segment.routes, n_new) if payloads else None,
            heads=_joined_heads(self.heads, n_old, segment.heads, n_new) if payloads else None,
        )

    def with_reward(self, reward: float) -> Sample:
        """This sample scored with `reward`."""
        return dataclasses.replace(self, reward=reward)

    def with_environment(self, token_ids: Sequence[int], *, version: int) -> Sample:
        """This sample with environment/tool tokens appended (an agent's `ctx.append`).

        They are transcript, not policy output: loss mask 0 (never trained) and behaviour log-prob
        0.0, a placeholder that the trainer never reads because the mask excludes the token from the
        loss and the importance weights alike. Their version span continues the previous span (or
        takes `version` for a response that starts with them), so spans still tile the response
        and a sample's staleness is set by its model tokens only.
        """
        tokens = tuple(int(t) for t in token_ids)
        if not tokens:
            return self
        start, end = len(self.response_ids), len(self.response_ids) + len(tokens)
        spans = list(self.spans)
        if spans:
            spans[-1] = VersionSpan(spans[-1].start, end, spans[-1].version)
        else:
            spans.append(VersionSpan(start, end, version))
        return dataclasses.replace(
            self,
            response_ids=self.response_ids + tokens,
            logprobs=self.logprobs + LogProbs.zeros(len(tokens)),
            loss_mask=self.loss_mask + LossMask.zeros(len(tokens)),
            spans=tuple(spans),
            # No sampler forward made these tokens: their payload rows say so (NO_ROUTE, id -1).
            routes=_joined_routes(self.routes, start, None, len(tokens)),
            heads=_joined_heads(self.heads, start, None, len(tokens)),
        )

    def resumed(self) -> Sample:
        """This partial sample marked as continued from its current length (for the off-policy mask)."""
        if self.response_len == 0 or (self.resumed_at and self.resumed_at[-1] == self.response_len):
            return self
        return dataclasses.replace(self, resumed_at=(*self.resumed_at, self.response_len))


def _as_column(obj: object, name: str, column: type[TokenIds] | type[LogProbs] | type[LossMask]) -> None:
    value = getattr(obj, name)
    if type(value) is not column:  # a tuple or list given by the caller: stored as the column
        try:
            converted = column(value)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"{type(obj).__name__}.{name} cannot be stored: {exc}") from exc
        object.__setattr__(obj, name, converted)


def _check_payloads(what: str, n: int, routes: TokenRoutes | None, heads: SamplerHeads | None) -> None:
    if routes is not None and len(routes) != n:
        raise ValueError(f"{what}: {len(routes)} rows of routed experts for {n} tokens (R3 out of step)")
    if heads is not None and len(heads) != n:
        raise ValueError(f"{what}: {len(heads)} rows of sampler heads for {n} tokens (SC out of step)")


# Appending a payload: where one side has rows and the other does not (tokens from before the
# payload was asked for, environment tokens, an answer that carried none), the missing side gets
# placeholder rows, so the column stays aligned with the tokens instead of shifting.


def _joined_routes(old: TokenRoutes | None, n_old: int, new: TokenRoutes | None, n_new: int) -> TokenRoutes | None:
    if new is None:
        if old is None or not n_new:
            return old
        return old.joined(TokenRoutes.unrouted(n_new, layers=old.layers, top_k=old.top_k, code=old.code))
    if old is None:
        old = TokenRoutes.unrouted(n_old, layers=new.layers, top_k=new.top_k, code=new.code)
    return old.joined(new)


def _joined_heads(old: SamplerHeads | None, n_old: int, new: SamplerHeads | None, n_new: int) -> SamplerHeads | None:
    if new is None:
        if old is None or not n_new:
            return old
        return old.joined(SamplerHeads.unsampled(n_new, k=old.k))
    if old is None:
        old = SamplerHeads.unsampled(n_old, k=new.k)
    return old.joined(new)


def _status_after(reason: FinishReason, response_len: int, max_response_len: int) -> SampleStatus:
    if reason is FinishReason.STOP:
        return SampleStatus.COMPLETED
    if reason is FinishReason.LENGTH or response_len >= max_response_len:
        return SampleStatus.TRUNCATED
    if reason is FinishReason.ABORT:
        return SampleStatus.PARTIAL
    return SampleStatus.FAILED


def group_id_for(epoch: int, index: int) -> str:
    """The stable id of the group for dataset row `index` in pass `epoch` over the dataset.

    Derived, never random: the same prompt in the same epoch is the same group across restarts,
    so the store can refuse to create it twice.
    """
    return f"e{epoch:04d}-p{index:09d}"


@dataclass(frozen=True, slots=True)
class Group:
    """One prompt times G samples: the unit of scheduling, acceptance, persistence and requeue."""

    group_id: str
    task: PromptTask
    epoch: int
    samples: tuple[Sample, ...]
    admitted_version: int  # the clock's version when the group was first admitted
    seq: int = 0  # FIFO order, assigned once at admission and kept across requeues
    rejected_reason: str | None = None  # set by the dynamic filter

    @classmethod
    def fresh(cls, task: PromptTask, *, epoch: int, n_samples: int, version: int, seq: int) -> Group:
        samples = tuple(Sample(index=i, prompt_ids=task.prompt_ids) for i in range(n_samples))
        return cls(group_id_for(epoch, task.index), task, epoch, samples, version, seq)

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.samples)

    @property
    def failed(self) -> bool:
        return any(s.status is SampleStatus.FAILED for s in self.samples)

    @property
    def oldest_version(self) -> int:
        """The oldest token version in the group; the admission version while it has no tokens."""
        versions = [v for s in self.samples if (v := s.oldest_version) is not None]
        return min(versions, default=self.admitted_version)

    def staleness(self, current_version: int) -> int:
        return current_version - self.oldest_version

    @property
    def multi_version(self) -> bool:
        return any(len(s.versions) > 1 for s in self.samples)

    def with_samples(self, samples: Sequence[Sample]) -> Group:
        return dataclasses.replace(self, samples=tuple(samples))


@dataclass(frozen=True, slots=True)
class Batch:
    """`rollout_batch_size` ready groups handed to one training step."""

    step: int
    groups: tuple[Group, ...]
    # The policy version this batch trains against (the clock's version when it is trained); the
    # controller sets it. None (a batch read back from a store) lets the trainer use the newest
    # token version in the batch.
    train_version: int | None = None

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


# --- modes: the run's decisions, one spelling each ------------------------------------------
# StrEnums, unlike the enums above, because each value is also a flag value, a TOML string and a
# wire value (SGLang's `/pause_generation` body): `PauseMode.RETRACT == "retract"` holds, so a
# value read back from JSON (run metadata, an HTTP body) compares equal without conversion.


class RolloutMode(enum.StrEnum):
    """When a batch goes to training (`--rollout-mode`)."""

    SYNC = "sync"  # after the round that made it; generation waits for training
    ASYNC = "async"  # producers keep generating across training steps


class PauseMode(enum.StrEnum):
    """How engines pause for a weight publish (`--pause-mode`, SGLang's `/pause_generation` mode)."""

    ABORT = "abort"  # abort everything in flight; requests come back partial
    RETRACT = "retract"  # move running requests back to the waiting queue, keep their tokens
    IN_PLACE = "in_place"  # keep running requests where they are, just stop stepping


class WeightTransport(enum.StrEnum):
    """How a publish moves weights to the engines (`--update-weight-transport`, slime's name)."""

    DISK = "disk"  # save a folder, engines read it (`/update_weights_from_disk`)
    DISTRIBUTED = "distributed"  # broadcast over torch.distributed (`/update_weights_from_distributed`)


class StoreTransport(enum.StrEnum):
    """Where rollout state lives (`--rollout-data-transport`)."""

    MEMORY = "memory"  # lost on exit
    LMDB = "lmdb"  # durable: tasks, partial and ready groups, batches, cursor
