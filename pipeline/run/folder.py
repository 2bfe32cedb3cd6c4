"""One run, one folder: a new run never writes into another run's folder.

A run folder holds one run's model, weights, metrics, events, logs and (LMDB) store. Two runs in
one folder mix silently: weights of both side by side, one timeline drawing both, events appended
to events, metrics moved aside. So the first thing a run does, before it writes anything, is claim
its folder:

- a folder with no run in it (missing, empty, or only files a run does not write) is claimed:
  `run.json` records the run (run id, store, when it started) and `config.json` its resolved
  settings (what `--print-config` shows before a run);
- a folder claimed by an LMDB run is that run's: the same store may resume it (the store's own
  checks then refuse other settings that would change the run), another store or a memory run
  is refused (`run_state._claim_weights` names the store);
- a folder claimed by a memory run, or holding a run's files without `run.json` and without an
  LMDB store (a memory run from before `run.json`), is refused: a memory run cannot be resumed,
  and a new one belongs in a new folder. The error names the fix.

Default folders (`pipeline.config.load`): a memory run without `--output-dir` or a run id gets a
fresh `runs/<run id>-<UTC time>`; an LMDB run gets `runs/<run id>`, so the same command resumes it.
`runs/latest` points at the newest run started in `runs/`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson

from core.errors import ConfigError
from core.types import StoreTransport
from pipeline.config import Config, config_to_dict
from pipeline.config.derived import derived
from pipeline.run.resume_settings import without_secrets

__all__ = ["RUN_RECORD", "claim_run_folder", "resume_hint", "run_line"]

RUN_RECORD = "run.json"
CONFIG_RECORD = "config.json"

# What a run writes into its folder; anything else (a user's notes, a README) is not a run.
# (A model folder alone is not a run: the tiny model is built before anything can fail.)
_RUN_FILES = ("metrics.jsonl", "events.jsonl", "weights", "rollout_data", "timeline.html")


def claim_run_folder(config: Config) -> Path:
    """Claim the run folder for this run (see the module docstring); the folder, absolute.

    Raises ConfigError naming the folder, the run it holds and the flag that fixes it.
    """
    out = Path(derived(config.output.dir, "output.dir"))
    ours = _store_of(config)
    record = _read_record(out)
    if record is not None:
        # A memory run that wrote nothing yet (it stopped at start-up, say on a missing model)
        # leaves nothing to mix with: the folder may be used again.
        if record.get("transport") == StoreTransport.MEMORY and _run_files(out):
            raise ConfigError(
                [_refusal(out, f"the memory run {record.get('run_id')!r} started {record.get('started')}")]
            )
        # An LMDB run's folder: the same store resumes it; while that store exists, nothing else
        # may write here (its checkpoints and metrics are what a resume reads).
        theirs = out / record["store"] if isinstance(record.get("store"), str) else None
        if theirs is not None and theirs.is_dir() and theirs.resolve() != ours:
            this_run = f"--rollout-data-dir={ours}" if ours is not None else "--rollout-data-transport=memory"
            raise ConfigError(
                [
                    f"--output-dir={out}: the folder is the LMDB run whose store is {theirs}; this run "
                    f"({this_run}) would write over its checkpoints and metrics. Give this run another "
                    f"--output-dir, or resume that run with --rollout-data-transport lmdb --rollout-data-dir {theirs}"
                ]
            )
    else:
        found = _run_files(out)
        lmdb_here = (out / "rollout_data").is_dir()
        if found and not lmdb_here and not (ours is not None and ours.is_dir()):
            raise ConfigError([_refusal(out, "another run's files (" + ", ".join(found) + ")")])
    try:
        out.mkdir(parents=True, exist_ok=True)
        if record is None or record.get("transport") != config.storage.transport:
            _write(
                out / RUN_RECORD,
                {
                    "run_id": config.storage.run_id,
                    "transport": str(config.storage.transport),
                    # Relative when inside the folder, so a run folder moved whole keeps its store.
                    "store": _relative(ours, out) if ours is not None else None,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
            )
        # The settings of the latest start (a resumed run may change some): printable, reusable.
        _write(out / CONFIG_RECORD, without_secrets(config_to_dict(config)))
    except OSError as exc:  # a file in the way, no permission, a read-only filesystem
        raise ConfigError([f"--output-dir={out}: cannot be created ({exc.strerror})"]) from exc
    if out.parent == Path("runs"):  # where default folders go (relative to the working directory)
        _point_latest(out)
    return out.resolve()


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
