"""Dashboards fed from the per-step metrics record: TensorBoard and Weights & Biases (extras).

Each sink gets the very record the metrics file gets, and logs every numeric field under the same
name at the record's `step` (`step` itself is the x axis, not a series). Fields that are null in
the file (a mean over nothing) are left out for that step, as the file has no number for them.

Both libraries are optional (`pip install 'rollout-pipeline[tensorboard]'`, `[wandb]`). A sink
whose library is missing, or that fails to start, is one warning naming the sink and the reason,
and the run goes on without it; a sink that fails later is switched off by `MetricsSink` the same
way. W&B's default mode here is offline: it writes under the run folder and needs no network.

The metrics file and the store are the record; dashboards are copies. A record the store writes back
on resume is sent to them too, but a kill between the file's append and a dashboard's write can
leave that one step out of that dashboard.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.errors import ConfigError
from pipeline.metrics import EVAL_STEP, StepSink, is_eval_record

__all__ = ["SinkSettings", "TensorBoardSink", "WandbMode", "WandbSink", "open_step_sinks", "scalars", "wandb_mode"]

WandbMode = Literal["offline", "online", "disabled"]


_WANDB_MODES: dict[str, WandbMode] = {"offline": "offline", "online": "online", "disabled": "disabled"}


def wandb_mode(value: str) -> WandbMode:
    """`value` (the config's `--wandb-mode` string) as a `WandbMode`, or a `ConfigError` naming it."""
    mode = _WANDB_MODES.get(value)
    if mode is None:
        raise ConfigError([f"output.wandb_mode={value!r}: must be one of {list(_WANDB_MODES)}"])
    return mode


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The fields a dashboard plots: numbers (booleans as 0/1), the `step` key left out."""
    out: dict[str, float] = {}
    for name, value in record.items():
        if name == "step" or value is None or isinstance(value, str):
            continue
        if isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


class TensorBoardSink:
    """Scalars into TensorBoard event files, through tensorboardX or torch's writer."""

    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            # torch's writer needs the `tensorboard` package; tensorboardX needs only protobuf.
            from torch.utils.tensorboard import SummaryWriter
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        # The writer hands events to a thread through a queue of `max_queue`. A full disk kills
        # that thread (with a traceback of its own), and a bounded queue then blocks the run at
        # its next `add_scalar`, forever. So the queue is never the bound (one step is a few
        # hundred scalars, flushed every step) and the thread's file writer is guarded
        # (`_GuardedEvents`): a failed write is kept and raised here, where the sinks' guard
        # turns it into one warning.
        self._writer = SummaryWriter(str(logdir), max_queue=1_000_000)
        self._guarded: list[_GuardedEvents] = []

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for name, value in scalars(record).items():
            self._writer.add_scalar(name, value, global_step=step)
            self._guard_events()
        self._writer.flush()  # a kill loses at most the step being written
        for guarded in self._guarded:
            guarded.raise_failure()

    def _guard_events(self) -> None:
        """Wrap the file writer(s) the SummaryWriter made (lazily, at the first scalar) once."""
        if self._guarded:
            return
        for file_writer in (getattr(self._writer, "all_writers", None) or {}).values():
            events = getattr(file_writer, "event_writer", None)
            worker = getattr(events, "_worker", None)
            inner = getattr(events, "_ev_writer", None)
            if events is None or worker is None or inner is None:
                continue  # another writer's internals: unguarded, as before
            guarded = _GuardedEvents(inner)
            events._ev_writer = guarded
            worker._record_writer = guarded
            self._guarded.append(guarded)

    def close(self) -> None:
        try:
            self._writer.close()
        except Exception:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Drop what could not be written (a full disk): the writer's exit hook (atexit) would
        try the same flush again and print a traceback at interpreter exit."""
        for file_writer in getattr(self._writer, "all_writers", {}).values():
            events = getattr(file_writer, "event_writer", None)
            if events is None or getattr(events, "_closed", True):
                continue
            worker = getattr(events, "_worker", None)
            try:
                if worker is not None:
                    worker.stop()
            except Exception:  # the worker died on the same full disk: nothing left to stop
                pass
            events._closed = True


class _GuardedEvents:
    """The event file writer of a TensorBoard writer's thread, which keeps the first `OSError` (a
    full disk) instead of letting it kill the thread; `raise_failure` raises it in the run's thread.
    Once failed, it writes nothing more: the sink is dropped with one warning."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.failure: OSError | None = None

    def write_event(self, event: Any) -> None:
        if self.failure is None:
            try:
                self._inner.write_event(event)
            except OSError as exc:
                self.failure = exc

    def flush(self) -> None:
        if self.failure is None:
            try:
                self._inner.flush()
            except OSError as exc:
                self.failure = exc
        self.raise_failure()

    def close(self) -> None:
        try:
            self._inner.close()
        except OSError:
            if self.failure is None:
                raise

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


class WandbSink:
    """A W&B run; `mode="offline"` writes `<dir>/wandb/offline-run-*` with no network at all.

    The run id is stable across resumes, so a restarted run continues the same W&B run (online) or
    syncs into it (offline, `wandb sync`).
    """

    name = "wandb"

    def __init__(
        self,
        *,
        project: str,
        group: str | None,
        mode: WandbMode,
        dir: Path,
        run_id: str,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        import wandb

        dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(
            project=project,
            group=group,
            mode=mode,
            dir=str(dir),
            id=run_id,
            resume="allow",
            config=dict(config or {}),
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True),
            reinit="create_new",
        )
        # Every evaluation on its own axis, eval/step: W&B's own step only grows, and an evaluation's
        # own line (the starting weights', `python -m pipeline.eval`'s) comes at an earlier step
        # than W&B's by then. An inline evaluation in a step's record is at that step there too.
        self._run.define_metric("eval/*", step_metric=EVAL_STEP)
        self._last_step = -1
        self._eval_pending = False

    def write(self, record: Mapping[str, Any]) -> None:
        values = {k: v for k, v in scalars(record).items() if not math.isnan(v)}
        if is_eval_record(record):
            # An evaluation's own line joins the row W&B has open without closing it: logged as a
            # row of its own, it would take the step the run's next record needs, and W&B drops
            # a record whose step is below its own. A second one before any step's record closes
            # the first's row (python -m pipeline.eval: a row per evaluated version).
            if self._eval_pending:
                self._run.log({})
            self._run.log(values, commit=False)
            self._eval_pending = True
            return
        step = int(record["step"])
        # W&B ignores (with a warning) a step lower than one it has: a record rebuilt after a
        # resume may be; skip it here instead of flooding the log.
        if step <= self._last_step:
            return
        if any(k.startswith("eval/") for k in values):
            values[EVAL_STEP] = float(step)
        self._run.log(values, step=step)
        self._last_step = step
        self._eval_pending = False

    def close(self) -> None:
        self._run.finish()
        # `finish` returns before W&B's writer process has flushed the run file; `teardown` waits
        # for it (this process has no other W&B run).
        self._wandb.teardown()


@dataclass(frozen=True, slots=True)
class SinkSettings:
    """The dashboard flags, as plain values (the launcher reads them from the config)."""

    use_tensorboard: bool = False
    tensorboard_dir: Path | None = None
    use_wandb: bool = False
    wandb_project: str = "rollout-pipeline"
    wandb_group: str | None = None
    wandb_mode: WandbMode = "offline"
    wandb_dir: Path | None = None
    wandb_run_id: str | None = None


def open_step_sinks(
    settings: SinkSettings,
    *,
    output_dir: Path,
    run_id: str,
    warn: Callable[[str], None],
    config: Mapping[str, Any] | None = None,
) -> list[StepSink]:
    """The sinks the settings ask for; one that cannot start is a warning (`warn`) and left out."""
    sinks: list[StepSink] = []
    if settings.use_tensorboard:
        logdir = settings.tensorboard_dir or output_dir / "tensorboard"
        _start(sinks, "tensorboard", "tensorboard", warn, lambda: TensorBoardSink(logdir))
    if settings.use_wandb and settings.wandb_mode != "disabled":
        run = settings.wandb_run_id or _stable_run_id(run_id, output_dir)
        _start(
            sinks,
            "wandb",
            "wandb",
            warn,
            lambda: WandbSink(
                project=settings.wandb_project,
                group=settings.wandb_group,
                mode=settings.wandb_mode,
                dir=settings.wandb_dir or output_dir,
                run_id=run,
                config=config,
            ),
        )
    return sinks


def _start(
    sinks: list[StepSink], name: str, extra: str, warn: Callable[[str], None], make: Callable[[], StepSink]
) -> None:
    try:
        sinks.append(make())
    except ImportError as exc:
        warn(
            f"metrics sink {name!r} is off: its library is not installed ({exc}); "
            f"pip install 'rollout-pipeline[{extra}]'"
        )
    except Exception as exc:  # a dashboard that cannot start never stops the run
        warn(f"metrics sink {name!r} is off: it failed to start ({type(exc).__name__}: {exc})")


def _stable_run_id(run_id: str, output_dir: Path) -> str:
    """The same id on every resume of this run folder; distinct for two folders of one run id."""
    digest = hashlib.sha256(str(output_dir.resolve()).encode()).hexdigest()[:8]
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in run_id)[:40]
    return f"{safe}-{digest}"
