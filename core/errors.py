"""The project's one exception tree. Third-party errors are translated at the boundary.

    PipelineError
    ├── ConfigError            every problem in a config, listed together
    ├── PluginError            a `module:function` path that does not resolve or has the wrong shape
    ├── StoreError             rollout state cannot be read or written
    │   ├── StoreCorruptionError  stored bytes are damaged: a checksum, LMDB's own pages, counters
    │   │   │                     that disagree with the records (names the key or the file)
    │   │   └── CorruptRecordError  one record fails its checksum or does not decode (names the key)
    │   ├── IncompatibleStoreError  the store belongs to another run, dataset or schema
    │   └── StoreLockedError   another controller holds the store
    ├── EngineError            an engine answered badly or not at all (names the URL and status)
    │   ├── EngineUnavailableError  cannot connect, or timed out
    │   │   └── EngineLostError     no engine will serve the request: the run stops (a /generate
    │   │                           past its deadline without fault tolerance; every restart failed)
    │   └── VersionMismatchError    an engine reports a weight version the clock did not publish
    ├── PublishError           a weight publish failed; the old version keeps serving
    ├── GroupsFailingError     every group of a long run of them failed (names the last error)
    ├── AgentError             an agent broke its contract (names the agent and the value)
    │   └── AgentStateError    an agent's `ctx.state` is not JSON-serialisable
    └── ReplayError            a run directory, step range or group that replay cannot use

    AgentInterrupted (a BaseException, as CancelledError is) the pool stopped during `ctx.generate`

A stage that dies takes the pipeline's task group down with it: `run_pipeline` raises the
original error (inside anyio's ExceptionGroup), and `python -m pipeline.launch` prints it as one
`error:` line with a hint to resume.

Each error keeps the offending value as an attribute and in its message. A reward function that
raises or times out is not an error of the pipeline: it is recorded on the sample (`Sample.error`)
and its group is stored as failed.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AgentError",
    "AgentInterrupted",
    "AgentStateError",
    "ConfigError",
    "CorruptRecordError",
    "EngineError",
    "EngineLostError",
    "EngineUnavailableError",
    "GroupsFailingError",
    "IncompatibleStoreError",
    "PipelineError",
    "PluginError",
    "PublishError",
    "ReplayError",
    "StoreCorruptionError",
    "StoreError",
    "StoreLockedError",
    "VersionMismatchError",
]


class PipelineError(Exception):
    """Base of every error this library raises on purpose."""


class ConfigError(PipelineError):
    """A config with one or more problems. `problems` lists each, naming the value and the rule."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the config:\n{lines}")


class PluginError(PipelineError):
    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"{path!r}: {reason}")


class StoreError(PipelineError):
    """Rollout state cannot be read or written. Nothing already stored is lost by this error."""


class StoreCorruptionError(StoreError):
    """Stored bytes are damaged (disk or copy corruption), never a bug of the caller.

    `where` names the damaged thing: a record's key (`groups/e0000-p000000001`), an LMDB page or
    file (`data.mdb meta page 1`), or a counter. A launcher moves such a store aside; replay reports
    it and goes on.
    """

    def __init__(self, where: bytes | str, reason: str) -> None:
        self.where, self.reason = where, reason
        shown = where.decode(errors="backslashreplace") if isinstance(where, bytes) else where
        super().__init__(f"the rollout store is damaged at {shown}: {reason}")


class CorruptRecordError(StoreCorruptionError):
    """One record fails its checksum or does not decode; `key` names it."""

    def __init__(self, key: bytes | str, reason: str) -> None:
        StoreError.__init__(self, f"record {key!r} does not decode: {reason}")
        self.key = self.where = key
        self.reason = reason


class IncompatibleStoreError(StoreError):
    """`reason`, when given, replaces the generic message (it must name both values too)."""

    def __init__(self, field: str, stored: object, given: object, *, reason: str | None = None) -> None:
        self.field, self.stored, self.given = field, stored, given
        super().__init__(reason or f"the store was written with {field}={stored!r}, this run has {field}={given!r}")


class StoreLockedError(StoreError):
    def __init__(self, path: str, holder: str) -> None:
        self.path, self.holder = path, holder
        super().__init__(
            f"the rollout store {path} is held by {holder}; stop that controller first (there is no automatic failover)"
        )


class EngineError(PipelineError):
    """An engine answered with an error. `url` and `status` say which and how."""

    def __init__(self, url: str, message: str, *, status: int | None = None) -> None:
        self.url, self.status = url, status
        where = f"{url} (HTTP {status})" if status is not None else url
        super().__init__(f"{where}: {message}")

    @property
    def refused(self) -> bool:
        """The engine refused this very request (a 4xx, or a 200 it could not read): sending it
        again fails the same way. 408 and 429 are not refusals: a router in front of the engines
        answers them when its queue is full or a request waited in it too long."""
        return self.status is not None and self.status < 500 and self.status not in (408, 429)


class EngineUnavailableError(EngineError):
    """The engine could not be reached, or did not answer within its deadline."""

    @property
    def timed_out(self) -> bool:
        """No answer within the deadline (the connection itself may have been accepted: a hung
        engine's kernel still completes the handshake), as opposed to a refused or reset one."""
        return isinstance(self.__cause__, TimeoutError)


class EngineLostError(EngineUnavailableError):
    """No engine will serve the request, so the run stops rather than send it again: without
    fault tolerance, an engine held a `/generate` past its deadline (sent there again, it would
    wait as long again); with it, fewer than `--min-live-engines` remain once restarts failed.
    The generator pool puts its groups back in the store on the way down."""


class VersionMismatchError(EngineError):
    def __init__(self, url: str, reported: object, expected: object) -> None:
        self.reported, self.expected = reported, expected
        super().__init__(url, f"engine reports weight_version {reported!r}, the clock expects {expected!r}")


class PublishError(PipelineError):
    def __init__(self, version: int, reason: str) -> None:
        self.version, self.reason = version, reason
        super().__init__(f"publishing version {version} failed, version {version - 1} keeps serving: {reason}")


class GroupsFailingError(PipelineError):
    """The last `count` groups to finish all failed, none succeeded in between (a prompt longer
    than the engine's context, a reward function that always raises, an engine refusing every
    request). Starting more would only spend the dataset on failures, so the run stops instead.
    Every failed group is in the store with its error; `last_error` is the newest one."""

    def __init__(self, count: int, last_error: str | None) -> None:
        self.count, self.last_error = count, last_error
        super().__init__(
            f"the last {count} groups all failed, none succeeded in between; the newest failure: "
            f"{last_error or 'no error recorded'}"
        )


class ReplayError(PipelineError):
    """A run directory, step range or group that replay cannot use; the message names it."""


class AgentError(PipelineError):
    """An agent (`--custom-generate-function-path`) broke its contract. Recorded on the sample,
    which fails visibly; the pool keeps running."""

    def __init__(self, agent: str, value: object, rule: str) -> None:
        self.agent = agent
        self.value = value
        super().__init__(f"agent {agent!r}: {value!r}: {rule}")


class AgentStateError(AgentError):
    """`ctx.state` holds something that is not JSON (it is stored with the sample, never pickled)."""


class AgentInterrupted(BaseException):
    """The pool stopped (partial rollout's "enough", an abort-mode publish, shutdown) while the
    agent awaited `ctx.generate`. The transcript and `ctx.state` are already stored with the sample;
    the agent must let this propagate (not catch it) and is re-entered with them on resume.

    A BaseException, not a PipelineError, for the reason asyncio's CancelledError is one: agent code
    wraps its tool calls and turns in `except Exception`, and an interruption caught there would
    have the agent call `ctx.generate` again, be interrupted again, and hold the stop forever."""

    def __init__(self, sample: str) -> None:
        self.sample = sample
        super().__init__(f"sample {sample}: the generator pool stopped; the agent resumes later")
