"""How a run ends when it does not finish: a stop signal, or an error, said in one line.

Two things live here, both at the launcher's boundary:

- `StopOnSigterm`: SIGTERM stops the run as a first Ctrl-C does (its stages and engines stopped,
  its store closed, exit 143), whatever signal dispositions the process inherited. It cancels the
  run's main task itself, as asyncio's runner does for SIGINT, instead of raising SIGINT: a job a
  non-interactive script starts with `&` inherits SIGINT *ignored*, and a SIGINT raised there does
  nothing (the run trained on to its end and exited 0). SIGINT itself is left as inherited
  (`sigint_ignored`): the shell ignores it in such a job on purpose, and the launcher says so
  when it starts.
- `report_failure`: turns whatever ended the run (a pipeline error, an `OSError` such as a full
  disk, a safetensors or TensorBoard error that wraps one, anything crossing the task groups) into
  one `error:` line per distinct cause (one per engine fault, however many requests it failed),
  naming what was being written, the cause and the fix, plus whether and how the run resumes.
  Only a bug (an exception this library does not know) keeps a traceback, and then only its own,
  not the task groups' it crossed.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio

from core.errors import EngineError, PipelineError, StoreError

__all__ = ["RunPaths", "StopOnSigterm", "WriteError", "error_leaves", "report_failure", "sigint_ignored"]


def sigint_ignored() -> bool:
    """Whether this process inherited SIGINT ignored, as a job started with `&` from a
    non-interactive script does. The shell does that on purpose: without job control its background
    jobs share the terminal's process group with it, and a Ctrl-C meant for the script's foreground
    command must not stop them. Python then installs no KeyboardInterrupt handler, and the launcher
    keeps the shell's choice rather than override it: Ctrl-C and `kill -INT` do nothing to such a
    run, SIGTERM (`kill PID`) stops it (`StopOnSigterm`)."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


class StopOnSigterm:
    """SIGTERM cancels the run's main task, as asyncio's runner does for a first SIGINT.

    Use: `with stop.installed(): anyio.run(stop.bound(main))`. A second SIGTERM (or one that comes
    before the run started) raises KeyboardInterrupt at once, as a second Ctrl-C does. The handler
    is installed whatever SIGTERM's inherited disposition (a job runner may start jobs with it
    ignored; the scheduler's SIGTERM still means stop), and the previous one comes back on the way
    out. Only from the main thread, where signal handlers live; elsewhere nothing is installed.
    """

    def __init__(self) -> None:
        self.terminated = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[object] | None = None

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
            self._loop = self._task = None

    def bind(self) -> None:
        """Called first thing in the run's main task: the task a SIGTERM cancels."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        first = not self.terminated.is_set()
        self.terminated.set()
        task, loop = self._task, self._loop
        if first and task is not None and loop is not None and not task.done():
            # What asyncio.Runner does on SIGINT: the main task is cancelled, so every stage,
            # engine and store on its way out is stopped and closed as on Ctrl-C; the loop is
            # woken in case it sleeps in select() with a long timeout.
            task.cancel()
            loop.call_soon_threadsafe(lambda: None)
            return
        raise KeyboardInterrupt


class WriteError(Exception):
    """Writing `what` in `where` failed (the cause is chained): `report_failure` names this writer,
    not the library it called (safetensors, for a model folder, would say "saving the weights").
    `room` says where more room comes from, when not from the run's own flags."""

    def __init__(self, what: str, where: Path, *, room: str | None = None) -> None:
        super().__init__(f"{what} ({where}) failed")
        self.what, self.where, self.room = what, where, room


@dataclass(frozen=True)
class RunPaths:
    """What the run writes, to name the writer that failed and where to free space."""

    output_dir: Path
    metrics_file: Path
    store_dir: Path | None  # None for a memory store: nothing to resume from
    tensorboard_dir: Path | None = None


def report_failure(exc: BaseException, paths: RunPaths) -> int:
    """Print why the run ended, one line per distinct cause, and return the exit code (1)."""
    leaves = error_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    if not leaves:  # only consequences (cancellations): nothing to explain but the group itself
        leaves = [exc]
    lines: list[str] = []
    faults: set[tuple[type[BaseException], str, int | None]] = set()
    for leaf in leaves:
        if isinstance(leaf, EngineError):
            # One engine fault fails every request and call in flight on it, each in its own words
            # (its rid, its count): the first says it for all of them.
            fault = (type(leaf), leaf.url.split("/", 3)[2] if "://" in leaf.url else leaf.url, leaf.status)
            if fault in faults:
                continue
            faults.add(fault)
        message = _explain(leaf, paths)
        if message is None:  # a bug: its own traceback (not the task groups'), then the one line
            message = f"{type(leaf).__name__}: {leaf} (an unexpected error: please report it with the traceback above)"
            if message not in lines:
                traceback.print_exception(leaf, file=sys.stderr)
        lines.append(message)
    for line in dict.fromkeys(lines):  # the same error from many tasks: once
        print(f"error: {line}", file=sys.stderr)
    print(_resume_line(paths), file=sys.stderr)
    return 1


def _resume_line(paths: RunPaths) -> str:
    if paths.store_dir is None:
        return (
            "the rollout state was in memory (--rollout-data-transport memory): running the same command again "
            "starts the run over"
        )
    return "rollout state is in the store; fix the cause and run the same command again to resume"


def error_leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions inside nested groups, consequences (cancellation, broken streams) left out."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out += error_leaves(exc)
        # Cancellations and broken streams follow the real error: a stage that died closed its
        # streams, and its neighbours found them closed.
        elif not isinstance(exc, (asyncio.CancelledError, anyio.BrokenResourceError, anyio.ClosedResourceError)):
            out.append(exc)
    return out


# --- explaining one error ------------------------------------------------------------------------

# An OS error number inside a third party's message: safetensors' `IoError(Os { code: 28, ... })`,
# Rust's and C's "(os error 28)", or the bare strerror text.
_ERRNO_IN_TEXT = (re.compile(r"code: (\d+)"), re.compile(r"os error (\d+)"))
_DISK_ERRORS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO))
_STRERROR = {os.strerror(n): n for n in _DISK_ERRORS}


def _explain(exc: BaseException, paths: RunPaths) -> str | None:
    """One line for `exc`, or None for an error this library does not know (a bug)."""
    if isinstance(exc, PipelineError):
        # The library's own errors say what and why already; a store write the disk refused
        # also gets the fix (an engine's refused connection is an OSError too: not a disk's).
        number = _os_errno(exc)
        if isinstance(exc, StoreError) and number in _DISK_ERRORS:
            return _os_line(number, "writing the rollout store", paths.store_dir or paths.output_dir, exc)
        return str(exc)
    number = _os_errno(exc)
    if number is not None:
        writer, where = _writer(exc, paths)
        return _os_line(number, writer, where, exc, room=exc.room if isinstance(exc, WriteError) else None)
    if isinstance(exc, OSError):  # no errno to go by: say what it is and where
        writer, where = _writer(exc, paths)
        return f"{writer} ({where}) failed: {type(exc).__name__}: {exc}"
    return None


def _os_errno(exc: BaseException) -> int | None:
    """The OS error number behind `exc` or its causes, wherever a library wrapped it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current.errno
        text = str(current)
        for pattern in _ERRNO_IN_TEXT:  # only numbers a disk gives: "code: 500" is no errno
            if (match := pattern.search(text)) is not None and int(match[1]) in _DISK_ERRORS:
                return int(match[1])
        for strerror, number in _STRERROR.items():
            if strerror in text:
                return number
        current = current.__cause__ or current.__context__
    return None


# Which writer a frame belongs to: (a fragment of the file's path, or a function name) -> writer.
_WRITERS = (
    ("trainers/checkpoint.py", "weights"),
    ("save_weights", "weights"),
    ("safetensors", "weights"),
    ("tensorboard", "tensorboard"),
    ("pipeline/metric_sinks.py", "tensorboard"),
    ("pipeline/events.py", "events"),
    ("pipeline/metrics.py", "metrics"),
    ("storage/", "store"),
)


def _writer(exc: BaseException, paths: RunPaths) -> tuple[str, Path]:
    """(what was being written, the path that names its filesystem), from where `exc` was raised."""
    if isinstance(exc, WriteError):
        return exc.what, exc.where
    frames = traceback.extract_tb(exc.__traceback__)
    kind = None
    for frame in reversed(frames):  # innermost first: the writer nearest the failing call
        where = frame.filename.replace(os.sep, "/")
        for fragment, name in _WRITERS:
            if fragment in where or frame.name == fragment:
                kind = name
                break
        if kind is not None:
            break
    filename = getattr(exc, "filename", None)
    if kind == "weights":
        return "saving the weights", paths.output_dir / "weights"
    if kind == "tensorboard":
        return "writing the TensorBoard logs", paths.tensorboard_dir or paths.output_dir
    if kind == "events":
        return "writing the event log", paths.output_dir / "events.jsonl"
    if kind == "metrics":
        return "writing the metrics file", paths.metrics_file
    if kind == "store" or (paths.store_dir is not None and "rollout store" in str(exc)):
        return "writing the rollout store", paths.store_dir or paths.output_dir
    if filename:
        return f"writing {filename}", Path(os.fsdecode(filename))
    return "writing the run's files", paths.output_dir


def _os_line(number: int, writer: str, where: Path, exc: BaseException, *, room: str | None = None) -> str:
    cause = os.strerror(number)
    if number == errno.EIO and _nearly_full(where):
        # LMDB reports a short write (the disk filled up in the middle of it) as EIO.
        number, cause = errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (reported as: {cause})"
    if number in (errno.ENOSPC, errno.EDQUOT):
        free = _free_space(where)
        room = room or "give the run more room: --output-dir, --rollout-data-dir, --metrics-file"
        return f"{writer} ({where}) failed: {cause}{free}; free space on that filesystem (or {room})"
    if number in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{writer} ({where}) failed: {cause}; make it writable for this user"
    if number == errno.EIO:
        return f"{writer} ({where}) failed: {cause}; the disk reported an I/O error: check it (dmesg) first"
    return f"{writer} ({where}) failed: {cause} ({type(exc).__name__}: {exc})"


def _usage(where: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the filesystem holding `where` (or its nearest existing parent)."""
    for candidate in (where, *where.parents):
        try:
            usage = shutil.disk_usage(candidate)
        except OSError:
            continue
        return usage.free, usage.total
    return None


def _nearly_full(where: Path) -> bool:
    usage = _usage(where)
    return usage is not None and usage[0] < 2**20


def _free_space(where: Path) -> str:
    usage = _usage(where)
    if usage is None:
        return ""
    return f" ({usage[0] / 2**20:.1f} MiB free of {usage[1] / 2**20:.0f} MiB there)"
