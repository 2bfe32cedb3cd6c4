"""`python -m pipeline.replay RUN_DIR [summary | group GROUP_ID | train | timeline]`: look back at a run.

A run launched with `--rollout-data-transport lmdb` leaves its whole rollout history in
`RUN_DIR/rollout_data` (or its `--rollout-data-dir`, which `RUN_DIR/run.json` records): every group
in its final state, the batch of every step, the cursor and the run's settings. This tool reads it
without an engine:

    summary             groups by state, versions, staleness of trained batches, partial prefixes
    groups [--state S]  every group, one line each: id, state, prompt row, epoch, mean reward, error
    verify              every record read and checked; what is damaged; exit status 1 if anything is
    group GROUP_ID      one group in full, decoded with the run's tokenizer (`--json` for machines);
                        `group 17` finds the groups of the prompt in row 17
    train               the recorded batches fed again to a fresh GRPOTrainer, one JSON line per step
    timeline [-o FILE]  RUN_DIR/events.jsonl drawn as an HTML timeline (default RUN_DIR/timeline.html)
    metrics [--csv FILE]  the per-step metrics table, from the store and the metrics file, and
                        where the two disagree (`pipeline.replay_metrics`)

Replay never changes the run: the store is opened with `LmdbStore(readonly=True)`, which takes no
writer lock and cannot write, so a replay can even watch a run that is still going.

`train` is deterministic: the trainer is built with the run's own settings and seed (from the run
meta), on one CPU thread, so two replays print identical metrics. Replaying from the base model
reproduces the run's own `train/*` metrics step for step; replaying from `--weights checkpoints/vN`
starts with a fresh optimizer, so it matches the run only in what the batches were, not in AdamW state.

A run launched with `--rollout-gc-keep-steps N` keeps only the last N steps' batches and trained
groups; summary and train see what is left (train's default range starts after the collected steps).
`timeline` reads only the event log, so it works for memory-transport runs too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from core.errors import CorruptRecordError, PipelineError, ReplayError, StoreCorruptionError
from core.types import StoreTransport
from pipeline.replay_report import format_group, format_history, format_summary, group_record, summarize
from pipeline.run.folder import RUN_RECORD
from pipeline.settings_history import settings_at
from pipeline.trainer_settings import build_trainer, replayed_settings
from storage import GroupState, LmdbStore, RunMeta

__all__ = [
    "ReplayError",
    "main",
    "open_run_store",
    "parse_steps",
    "replay_training",
    "verify_progress",
    "write_timeline",
]

STORE_DIR = "rollout_data"  # where `--rollout-data-transport lmdb` puts the store by default
MODEL_DIR = "model"  # where the launcher writes the base model when no --hf-checkpoint is given
EVENTS_FILE = "events.jsonl"  # the launcher's event log in the run dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error: argparse has printed why
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "group":
            return _group(args)
        if args.command == "groups":
            return _groups(args)
        if args.command == "train":
            return _train(args)
        if args.command == "timeline":
            return _timeline(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "metrics":
            return _metrics(args)
        return _summary(args)
    except (PipelineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the --output-dir of an lmdb-transport run (or its store dir)")
    sub = parser.add_subparsers(dest="command", metavar="{summary,verify,groups,group,train,timeline,metrics}")
    sub.add_parser("summary", help="groups by state, versions, staleness, partial prefixes (the default)")
    sub.add_parser("verify", help="check every record; exit status 1 if anything is damaged")
    groups = sub.add_parser("groups", help="every group: id, state, prompt, epoch, mean reward, error")
    groups.add_argument("--state", choices=[s.value for s in GroupState], help="only groups in this state")
    group = sub.add_parser("group", help="one group in full")
    group.add_argument("group_id", help="e.g. e0000-p000000003, or a prompt's row number (17: its groups)")
    group.add_argument("--json", action="store_true", help="print the group as one JSON object")
    train = sub.add_parser("train", help="feed the recorded batches to a fresh trainer, no engine")
    train.add_argument("--steps", default=None, help="A:B replays steps A..B-1 (default: every trained step)")
    train.add_argument(
        "--weights", type=Path, default=None, help="start from this model folder, e.g. RUN_DIR/checkpoints/v3"
    )
    train.add_argument("--seed", type=int, default=None, help="trainer seed (default: the run's --rollout-seed)")
    timeline = sub.add_parser("timeline", help="draw RUN_DIR/events.jsonl as an HTML timeline")
    timeline.add_argument("-o", "--output", type=Path, default=None, help="HTML file (default: RUN_DIR/timeline.html)")
    metrics = sub.add_parser("metrics", help="the per-step metrics table, store against metrics file")
    metrics.add_argument("--csv", type=Path, default=None, help="also write every field of every step to FILE")
    metrics.add_argument(
        "--metrics-file",
        type=Path,
        default=None,
        help="the run's metrics JSONL (default: RUN_DIR/metrics.jsonl, else the run's --metrics-file)",
    )
    metrics.add_argument("--columns", default=None, help="comma-separated fields to print (default: a few)")
    return parser


# --- opening a run ------------------------------------------------------------------------------


@contextmanager
def open_run_store(run_dir: str | Path) -> Iterator[tuple[Path, LmdbStore]]:
    """(run dir, the run's store opened read-only). Accepts the run dir or the store dir itself."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReplayError(f"there is no run directory at {run_dir}")
    if (run_dir / "data.mdb").exists():
        store_dir, run_dir = run_dir, run_dir.parent
    else:
        store_dir = _store_dir(run_dir)
    store = LmdbStore(store_dir, readonly=True)
    try:
        yield run_dir, store
    finally:
        store.close()


def _store_dir(run_dir: Path) -> Path:
    """The run folder's store: `rollout_data` in it, else where its `run.json` says the run put it
    (`--rollout-data-dir` elsewhere: recorded absolute, or relative to the run folder)."""
    default = run_dir / STORE_DIR
    if (default / "data.mdb").exists():
        return default
    record = _run_record(run_dir)
    recorded = record.get("store")
    if record.get("transport") == StoreTransport.LMDB and isinstance(recorded, str):
        store_dir = run_dir / recorded  # an absolute path stays as it is
        if (store_dir / "data.mdb").exists():
            return store_dir
        raise ReplayError(
            f"{run_dir / RUN_RECORD} says the run's rollout store is {store_dir}, and there is none there "
            f"({store_dir / 'data.mdb'} is missing); if it moved, give its folder instead of the run's: "
            f"python -m pipeline.replay STORE_DIR ..."
        )
    raise ReplayError(
        f"{run_dir} has no rollout store ({default / 'data.mdb'} is missing): a run with "
        "--rollout-data-transport memory keeps nothing to replay; launch it with lmdb"
    )


def _run_record(run_dir: Path) -> dict[str, Any]:
    """The run folder's `run.json` (`pipeline.run.folder`); {} when there is none, or it is unreadable."""
    try:
        record = json.loads((run_dir / RUN_RECORD).read_bytes())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _model_dir(run_dir: Path, meta: RunMeta | None) -> Path | None:
    """The run's base model: RUN_DIR/model, or the --hf-checkpoint the run was launched with."""
    if (run_dir / MODEL_DIR / "config.json").exists():
        return run_dir / MODEL_DIR
    checkpoint = (meta.extra.get("config", {}).get("engine", {}) if meta else {}).get("hf_checkpoint")
    if checkpoint and (Path(checkpoint) / "config.json").exists():
        return Path(checkpoint)
    return None


def _decoder(model_dir: Path | None) -> Callable[[Sequence[int]], str] | None:
    if model_dir is None:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):  # a model folder without a usable tokenizer: show ids only
        return None

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode


# --- summary and group --------------------------------------------------------------------------


def _summary(args: argparse.Namespace) -> int:
    with open_run_store(args.run_dir) as (_, store):
        print(format_summary(summarize(store, store_path=store.path)))
    return 0


def _verify(args: argparse.Namespace) -> int:
    try:
        with open_run_store(args.run_dir) as (_, store), verify_progress(store.statistics().bytes_used) as progress:
            report = store.verify(progress=progress)
            path = store.path
    except StoreCorruptionError as exc:  # LMDB's own pages: nothing can be read through LMDB
        print(f"damaged: {exc}\nthe store does not open; a resume moves it aside and salvages what it can")
        return 1
    if report.ok:
        print(f"store: {path}\nok: {report.records} records checked, nothing damaged")
        return 0
    print(f"store: {path}\n{len(report.damaged)} damaged ({report.records} records checked):")
    print("\n".join(f"  {d}" for d in report.damaged))
    return 1


@contextmanager
def verify_progress(
    total: int, stream: TextIO | None = None, *, every: float = 10.0
) -> Iterator[Callable[[int], None]]:
    """A progress callback for `verify` over `total` bytes (the store's pages in use), on stderr:
    a tqdm bar on a terminal, else a plain line every `every` seconds and one at the end (a log
    file or a CI job has no use for a redrawn bar)."""
    out = sys.stderr if stream is None else stream
    start = time.monotonic()
    if out.isatty():
        from tqdm import tqdm

        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", file=out) as bar:
            yield bar.update
        return
    done, next_line = 0, start + every

    def update(n: int) -> None:
        nonlocal done, next_line
        done += n
        now = time.monotonic()
        if now >= next_line:
            next_line = now + every
            print(_progress_line(done, total, now - start), file=out, flush=True)

    yield update
    print(_progress_line(done, 0, time.monotonic() - start), file=out, flush=True)


def _progress_line(done: int, total: int, seconds: float) -> str:
    """`total` 0: the last line (the pages in use hold more than the records: it never says 100%)."""
    share = f" of about {total / 1e6:,.0f} MB ({min(100 * done / total, 99):.0f}%)" if total else " (done)"
    return f"verify: {done / 1e6:,.0f} MB read{share} in {seconds:,.1f} s, {done / 1e6 / max(seconds, 1e-9):,.0f} MB/s"


def _groups(args: argparse.Namespace) -> int:
    """One line per group, in id order (prompt by prompt, epoch by epoch): where group ids come from."""
    states = [GroupState(args.state)] if args.state else list(GroupState)
    with open_run_store(args.run_dir) as (_, store):
        rows = []
        damaged: list[CorruptRecordError] = []
        for state in states:
            for g in store.groups(state, damaged=damaged):
                rewards = [x.reward for x in g.samples if x.reward is not None]
                mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
                error = next((x.error for x in g.samples if x.error), "")
                rows.append((g.group_id, state.value, g.task.index, g.epoch, mean, error[:60]))
    rows.sort()
    print(f"{'group':<28} {'state':<11} {'prompt':>6} {'epoch':>5} {'reward':>7}  error")
    for gid, state_name, index, epoch, mean, error in rows:
        print(f"{gid:<28} {state_name:<11} {index:>6} {epoch:>5} {mean:>7}  {error}")
    print(f"{len(rows)} groups" + (f"; {len(damaged)} damaged records skipped" if damaged else ""))
    return 0


def _groups_of_prompt(store: LmdbStore, index: int) -> list[str]:
    """The ids of every group of dataset row `index` (any epoch, requeued ones too)."""
    found = [g.group_id for state in GroupState for g in store.groups(state, damaged=[]) if g.task.index == index]
    return sorted(found)


def _group(args: argparse.Namespace) -> int:
    with open_run_store(args.run_dir) as (run_dir, store):
        if args.group_id.isdigit():  # a prompt's row number: its group, or the list of its groups
            ids = _groups_of_prompt(store, int(args.group_id))
            if not ids:
                raise ReplayError(f"no group of prompt {args.group_id} in the store at {store.path}")
            if len(ids) > 1:
                print(f"prompt {args.group_id} has {len(ids)} groups: " + ", ".join(ids))
                print(format_history(store.prompt_history([int(args.group_id)]).get(int(args.group_id))))
                print(f"show one with: python -m pipeline.replay {args.run_dir} group {ids[0]}")
                return 0
            args.group_id = ids[0]
        try:
            found = store.get(args.group_id)
        except CorruptRecordError as exc:
            print(f"group {args.group_id}: damaged, never trained (quarantined, its prompt generated again): {exc}")
            return 1
        if found is None:
            raise ReplayError(f"group {args.group_id!r} is not in the store at {store.path}")
        state, group = found
        record = group_record(state, group, _decoder(_model_dir(run_dir, store.read_meta())))
    print(json.dumps(record) if args.json else format_group(record))
    return 0


# --- train --------------------------------------------------------------------------------------


def parse_steps(text: str | None, trained_step: int, *, first: int = 0) -> range:
    """`A:B` -> steps A..B-1; either end may be left out (`first` and trained_step + 1). None: every
    trained step from `first` (the first step whose batch garbage collection kept)."""
    if text is None:
        return range(first, trained_step + 1)
    start, sep, stop = text.partition(":")
    try:
        a = int(start) if start.strip() else first
        b = int(stop) if stop.strip() else trained_step + 1
    except ValueError:
        raise ReplayError(f"--steps {text!r}: expected A:B with integers, e.g. 0:3") from None
    if not sep or a < 0 or b <= a:
        raise ReplayError(f"--steps {text!r}: expected A:B with 0 <= A < B")
    return range(a, b)


def replay_training(
    store: LmdbStore, model_dir: Path, steps: range, *, seed: int | None = None
) -> Iterator[dict[str, Any]]:
    """Train a fresh GRPOTrainer from `model_dir` on the recorded batches of `steps`, yielding each
    step's metrics. Every batch is checked to exist before the (slow) trainer is built."""
    missing = [s for s in steps if store.batch(s) is None]
    if missing:
        raise ReplayError(
            f"no batch is recorded for step(s) {missing} in {store.path} (trained step {store.trained_step()})"
        )
    # The run's own settings, as its config recorded them; what an older run did not record takes
    # the schema's default, the same default the launcher used. A setting a resume changed applies
    # from the step recorded with it: each step trains with the settings it ran with.
    extra = meta.extra if (meta := store.read_meta()) else {}
    config = extra.get("config", {})
    trainer = build_trainer(model_dir, config, seed=seed, device="cpu")
    own = trainer.step_settings
    records = store.step_metrics(steps.start)
    for step in steps:
        then = settings_at(extra, step)
        trainer.use_settings(own if then is None else replayed_settings(own, then, config))
        batch = store.batch(step)
        assert batch is not None  # checked above; a read-only store does not lose batches
        # The version the run trained the batch at (what --mask-stale-tokens measures from): its
        # step record says; a store without records, its step (each step publishes once). Left
        # out, the trainer would take the batch's newest token, a version early in async mode.
        version = records.get(step, {}).get("version", step)
        batch = dataclasses.replace(batch, train_version=int(version))
        yield {"step": step, "groups": len(batch.groups), **trainer.train_step(batch)}


def _train(args: argparse.Namespace) -> int:
    with open_run_store(args.run_dir) as (run_dir, store):
        steps = parse_steps(args.steps, store.trained_step(), first=store.statistics().collected_step + 1)
        if args.weights is not None:
            if not (args.weights / "config.json").exists():
                raise ReplayError(f"--weights {args.weights} is not a model folder (no config.json)")
            model_dir = args.weights
        elif (model_dir := _model_dir(run_dir, store.read_meta())) is None:
            raise ReplayError(f"{run_dir / MODEL_DIR} holds no model; pass --weights DIR")
        _quiet_transformers()
        for record in replay_training(store, model_dir, steps, seed=args.seed):
            print(json.dumps(record), flush=True)
    return 0


# --- timeline -----------------------------------------------------------------------------------


def write_timeline(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Render RUN_DIR/events.jsonl to an HTML file (default RUN_DIR/timeline.html); returns its path."""
    from pipeline.timeline import write_html

    run_dir = Path(run_dir)
    if (run_dir / "data.mdb").exists():  # the store dir was given, as the other commands accept
        run_dir = run_dir.parent
    if not run_dir.is_dir():
        raise ReplayError(f"there is no run directory at {run_dir}")
    if not (run_dir / EVENTS_FILE).is_file():
        raise ReplayError(
            f"{run_dir} has no event log ({run_dir / EVENTS_FILE} is missing): is it the --output-dir of a run?"
        )
    return write_html(run_dir / EVENTS_FILE, Path(output) if output is not None else run_dir / "timeline.html")


def _timeline(args: argparse.Namespace) -> int:
    out = write_timeline(args.run_dir, args.output)
    print(f"timeline written to {out}")
    return 0


# --- metrics ------------------------------------------------------------------------------------


def _metrics(args: argparse.Namespace) -> int:
    from pipeline.replay_metrics import DEFAULT_COLUMNS, compare_metrics, format_metrics, write_csv

    with open_run_store(args.run_dir) as (run_dir, store):
        stored, trained = store.step_metrics(), store.trained_step()
        meta = store.read_meta()
    # The run folder's own file first: a copied or moved run folder still names the old path.
    configured = (meta.extra.get("config", {}).get("output", {}) if meta else {}).get("metrics_file")
    path = args.metrics_file or run_dir / "metrics.jsonl"
    if args.metrics_file is None and not path.exists() and configured:
        path = Path(configured)
    try:
        lines = path.read_bytes().splitlines() if path.exists() else []
    except OSError as exc:
        raise ReplayError(f"cannot read the metrics file {path}: {exc}") from exc
    table = compare_metrics(lines, stored, trained)
    columns = tuple(c.strip() for c in args.columns.split(",")) if args.columns else DEFAULT_COLUMNS
    print(f"{path}{'' if path.exists() else ' (missing)'} against the store at {run_dir}:")
    print(format_metrics(table, columns))
    if args.csv is not None:
        write_csv(table, args.csv)
        print(f"table written to {args.csv}")
    return 0


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _cli() -> int:
    """`main` for the shell: a reader that stops early (`| head`) ends replay quietly."""
    try:
        code = main()
        sys.stdout.flush()  # here, where a closed pipe can be caught, not in the interpreter's exit
    except BrokenPipeError:
        # What the reader did not take was not wanted. stdout now points at /dev/null, so the
        # interpreter's own flush at exit finds nothing to fail on; the status is a shell's for
        # a process ended by SIGPIPE (128 + 13), whether or not replay had its answer yet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code


if __name__ == "__main__":
    sys.exit(_cli())
