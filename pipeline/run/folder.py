"""One run, one folder: a new run never writes into another run's folder.

A run folder holds one run's model, weights, metrics, events, logs and (LMDB) store. Two runs in
one folder mix silently: weights of both side by side, one timeline drawing both, events appended
to events, metrics moved aside. So a run checks its folder before it writes anything, and writes
nothing into it before it owns it:

- a folder with no run in it (missing, empty, or only files a run does not write) may be taken;
- a folder claimed by an LMDB run is that run's: the same store may resume it (the store's own
  checks then refuse other settings that would change the run), another store or a memory run
  is refused (`run_state._check_weights_owner` names the store);
- a folder claimed by a memory run, or holding a run's files without `run.json` and without an
  LMDB store (a memory run from before `run.json`), is refused: a memory run cannot be resumed,
  and a new one belongs in a new folder. The error names the fix.

`check_run_folder` makes those checks and writes nothing. The run owns the folder once its store
is open (an LMDB store's writer lock taken) and has passed its checks (`pipeline.run.state`);
only then does `RunFolder.take` write `run.json` (the run id, store, when it started) and
`config.json` (its resolved settings, what `--print-config` shows). A second controller refused
on a live store, or a store of another run id, leaves the folder as it found it.

A start that fails (a model that does not load, an engine that does not come up, a full disk)
in a folder it made leaves nothing behind (`RunFolder.undo`): no empty run folder per attempt.
`runs/latest` points at the newest run that started in `runs/` (`RunFolder.started`), never at a
failed start.

Default folders (`pipeline.config.load`): a memory run without `--output-dir` or a run id gets a
fresh `runs/<run id>-<UTC time>`; an LMDB run gets `runs/<run id>`, so the same command resumes it.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from core.errors import ConfigError
from core.types import StoreTransport
from pipeline.config import Config, config_to_dict
from pipeline.config.derived import derived
from pipeline.run.resume_settings import without_secrets

__all__ = ["RUN_RECORD", "RunFolder", "cannot_create", "check_run_folder", "resume_hint", "run_line"]

RUN_RECORD = "run.json"
CONFIG_RECORD = "config.json"

# What a run writes into its folder; anything else (a user's notes, a README) is not a run.
# (A model folder alone is not a run: a folder whose first start failed may have one.)
_RUN_FILES = ("metrics.jsonl", "events.jsonl", "weights", "rollout_data", "timeline.html")


@dataclass
class RunFolder:
    """The folder a run checked (`check_run_folder`), and what its start made there."""

    path: Path  # absolute
    given: Path  # as configured: `runs/...` is where runs/latest lives
    # The run folder when this start creates it or finds it empty; None when it held something:
    # undo removes only this (its contents, when it was there).
    made: Path | None
    keep_made: bool  # `made` was there (empty) before: undo empties it and keeps it
    write_record: bool  # run.json to write (none yet, or another transport's)
    store: Path | None  # the LMDB store, absolute
    store_made: Path | None  # the store folder when outside `path` and this start creates it
    owned: bool = field(default=False, init=False)
    has_started: bool = field(default=False, init=False)

    def take(self, config: Config) -> None:
        """The run owns the folder now (its store open and checked): record the run and its settings.

        Raises ConfigError when the folder cannot be written."""
        out = self.path
        self.owned = True
        try:
            out.mkdir(parents=True, exist_ok=True)
            if self.write_record:
                _write(
                    out / RUN_RECORD,
                    {
                        "run_id": config.storage.run_id,
                        "transport": str(config.storage.transport),
                        # Relative when inside the folder, so a run folder moved whole keeps its store.
                        "store": _relative(self.store, out) if self.store is not None else None,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    },
                )
            # The settings of the latest start (a resumed run may change some): printable, reusable.
            _write(out / CONFIG_RECORD, without_secrets(config_to_dict(config)))
        except OSError as exc:  # no permission, a read-only filesystem, a full disk
            raise ConfigError([f"--output-dir={self.given}: cannot be written ({exc.strerror})"]) from exc

    def started(self) -> None:
        """The run is under way (engines up, trainer built): `runs/latest` may point at it."""
        self.has_started = True
        # Where default folders go (relative to the working directory); by the folder's own name,
        # so that `--output-dir runs/latest` (a resume through the link) keeps pointing at it.
        if self.given.parent == Path("runs") and self.path.parent == Path("runs").resolve():
            _point_latest(self.path)

    def undo(self) -> None:
        """A start that failed after taking the folder removes what it made there: a folder it
        created, or the contents of the empty one it was given, and a store folder it created
        elsewhere. What was there before is never touched; a start refused before it owned the
        folder wrote nothing (it may be another run's, live)."""
        if not self.owned or self.has_started:
            return
        if self.store_made is not None:
            shutil.rmtree(self.store_made, ignore_errors=True)
        if self.made is None:
            return
        if not self.keep_made:
            shutil.rmtree(self.made, ignore_errors=True)
            return
        for entry in list(self.made.iterdir()) if self.made.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def check_run_folder(config: Config) -> RunFolder:
    """Check the run folder for this run (see the module docstring); writes nothing.

    Raises ConfigError naming the folder, the run it holds and the flag that fixes it.
    """
    given = Path(derived(config.output.dir, "output.dir"))
    out = given.resolve()
    if (problem := cannot_create(out)) is not None:
        raise ConfigError([f"--output-dir={given}: cannot be created ({problem})"])
    ours = _store_of(config)
    record = _read_record(out)
    if record is not None:
        # A memory run that wrote nothing yet (it stopped at start-up, say on a missing model)
        # leaves nothing to mix with: the folder may be used again.
        if record.get("transport") == StoreTransport.MEMORY and _run_files(out):
            raise ConfigError(
                [_refusal(given, f"the memory run {record.get('run_id')!r} started {record.get('started')}")]
            )
        # An LMDB run's folder: the same store resumes it; while that store exists, nothing else
        # may write here (its checkpoints and metrics are what a resume reads).
        theirs = out / record["store"] if isinstance(record.get("store"), str) else None
        if theirs is not None and theirs.is_dir() and theirs.resolve() != ours:
            this_run = f"--rollout-data-dir={ours}" if ours is not None else "--rollout-data-transport=memory"
            raise ConfigError(
                [
                    f"--output-dir={given}: the folder is the LMDB run whose store is {theirs}; this run "
                    f"({this_run}) would write over its checkpoints and metrics. Give this run another "
                    f"--output-dir, or resume that run with --rollout-data-transport lmdb --rollout-data-dir {theirs}"
                ]
            )
    else:
        found = _run_files(out)
        lmdb_here = (out / "rollout_data").is_dir()
        if found and not lmdb_here and not (ours is not None and ours.is_dir()):
            raise ConfigError([_refusal(given, "another run's files (" + ", ".join(found) + ")")])
    made, keep = _made_by_this_start(out)
    store_made = None
    if ours is not None and not ours.is_relative_to(out) and not ours.exists():
        store_made = ours
    return RunFolder(
        path=out,
        given=given,
        made=made,
        keep_made=keep,
        write_record=record is None or record.get("transport") != config.storage.transport,
        store=ours,
        store_made=store_made,
    )


def _made_by_this_start(path: Path) -> tuple[Path | None, bool]:
    """(`path`, whether it was there) when this start makes the folder or finds it empty; (None,
    False) when it holds something. Never a parent: another run may be starting beside it."""
    if not path.exists():
        return path, False
    if path.is_dir() and not any(path.iterdir()):
        return path, True
    return None, False


def cannot_create(path: Path) -> str | None:
    """Why the folder `path` cannot be made (a file in the way, no permission), or None; looks only."""
    for candidate in (path, *path.parents):
        if not candidate.exists() and not candidate.is_symlink():
            continue
        if not candidate.is_dir():
            return os.strerror(errno.ENOTDIR)
        if not os.access(candidate, os.W_OK | os.X_OK):
            return os.strerror(errno.EACCES)
        return None
    return None


def _refusal(out: Path, holds: str) -> str:
    return (
        f"--output-dir={out}: the folder holds {holds}; a new run never writes into another run's "
        "folder (a memory run cannot be resumed). Give this run another --output-dir (or leave it out: "
        "a memory run then gets a fresh runs/<run id>-<time>), or remove the folder"
    )


def _relative(store: Path, out: Path) -> str:
    base = out.resolve()
    return str(store.relative_to(base) if store.is_relative_to(base) else store)


def _store_of(config: Config) -> Path | None:
    if config.storage.transport is not StoreTransport.LMDB:
        return None
    return Path(derived(config.storage.data_dir, "storage.data_dir")).resolve()


def _read_record(out: Path) -> dict[str, Any] | None:
    path = out / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ConfigError([f"{path}: not the JSON object a run writes ({exc}); remove it if no run owns it"]) from exc
    if not isinstance(record, dict):
        raise ConfigError([f"{path}: not the JSON object a run writes; remove it if no run owns it"])
    return record


def _run_files(out: Path) -> list[str]:
    return [name for name in _RUN_FILES if _holds(out / name)]


def _holds(path: Path) -> bool:
    """A run file that holds something: an empty metrics file (touched before a failed start) does not,
    nor a folder the user made ready for the run (`weights` linked to another disk, say) that holds
    only hidden entries or a file system's `lost+found`."""
    if path.is_dir():
        return any(not p.name.startswith(".") and p.name != "lost+found" for p in path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def _write(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    os.replace(tmp, path)


def _point_latest(out: Path) -> None:
    """`runs/latest` -> the newest run folder started by default (best effort: a filesystem
    without symlinks just has none)."""
    latest = out.parent / "latest"
    try:
        tmp = out.parent / f".latest.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out.name, target_is_directory=True)
        os.replace(tmp, latest)
    except OSError:
        pass


def resume_hint(config: Config) -> str:
    """What the next command does: an LMDB run resumes from its folder; a memory run kept nothing."""
    out = derived(config.output.dir, "output.dir")
    if config.storage.transport is StoreTransport.LMDB:
        return f"rollout state is in the store ({out}); fix the cause and run the same command again to resume"
    return (
        f"a memory run keeps no rollout state: the same command starts a new run at step 0 (in a new folder when "
        f"--output-dir is not given; {out} is this run's). Use --rollout-data-transport lmdb to resume"
    )


def run_line(records: list[dict[str, Any]], config: Config, seconds: float) -> str:
    """One line at the end: where the run is, how long it took, how fast it went, where to look."""
    out = Path(derived(config.output.dir, "output.dir"))
    r = config.rollout
    samples = len(records) * r.rollout_batch_size * r.n_samples_per_prompt
    # Counted by the producers since this process started: the steps it trained, and what they made.
    tokens = records[-1].get("tokens/generated_total", 0) if records else 0
    rate = f"{samples / seconds:.1f} samples/s, {tokens / seconds:.0f} tokens/s" if seconds > 0 else ""
    metrics = Path(derived(config.output.metrics_file, "output.metrics_file"))
    return (
        f"run {out}: {len(records)} steps in {seconds:.0f} s ({rate}); metrics in {metrics} "
        f"(python -m pipeline.plot {out} draws them)"
    )
