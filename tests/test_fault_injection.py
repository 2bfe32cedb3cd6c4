"""Exactly once, relative to the checkpoint: a real `python -m pipeline.launch` run is SIGKILLed at
many points and restarted with the same command until it finishes, and the LMDB store then proves
that every prompt is accounted for once, no group trained twice, no stored token lost, and partial
groups were continued token-exact. Also: the trainer's checkpoint carries the optimizer, and a run
whose engine dies stops with a clear error and resumes.

How kill points are chosen: the launcher is another process with no hook for tests, so the test
watches what it leaves behind (the store, read-only, and the weights folders) in a poll loop with a
deadline, and kills the whole process group (launcher + engine) the moment a condition holds. That
polling is the only signal a separate process gives; it orders nothing inside the launcher.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from core.errors import PipelineError, StoreError
from core.types import Batch, FinishReason, Group, PromptTask, Sample, SampleStatus, Segment
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import encode
from storage import GroupState, LmdbStore
from trainers import GRPOTrainer
from trainers.checkpoint import OPTIMIZER_DIR

pytestmark = pytest.mark.usefixtures("restore_torch_threads")

ROOT = Path(__file__).resolve().parent.parent

# ---- 1. the trainer's checkpoint is model + optimizer ----------------------------------------


PROMPT = encode("say a x2:")
TASK = PromptTask(index=0, prompt_ids=PROMPT, label={"char": "a", "count": 2})


def _batch(step: int, rewards: list[float]) -> Batch:
    samples = []
    for i, r in enumerate(rewards):
        ids = encode("ab"[: i % 2 + 1] + "a" * i)
        seg = Segment(ids, tuple(-1.5 for _ in ids), FinishReason.STOP, 0)
        sample = Sample(index=i, prompt_ids=PROMPT).extended(seg, max_response_len=64)
        samples.append(dataclasses.replace(sample, reward=r))
    group = Group.fresh(TASK, epoch=0, n_samples=len(samples), version=0, seq=0).with_samples(samples)
    return Batch(step, (group,))


def _weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_a_checkpoint_restores_the_optimizer_so_the_next_step_is_identical(tmp_path):
    base = make_model_folder(tmp_path / "model", seed=0)
    b0, b1, b2 = _batch(0, [0.0, 1.0, 0.5]), _batch(1, [1.0, 0.0, 0.2]), _batch(2, [0.3, 0.9, 0.0])

    straight = GRPOTrainer(base)
    for b in (b0, b1, b2):
        straight.train_step(b)

    first = GRPOTrainer(base)
    first.train_step(b0)
    first.train_step(b1)
    saved = first.save_weights(tmp_path / "weights" / "v2")
    assert {p.name for p in (saved / OPTIMIZER_DIR).iterdir()} == {"state.safetensors", "state.json", "rng.safetensors"}
    meta = json.loads((saved / OPTIMIZER_DIR / "state.json").read_text())
    assert meta["trainer_steps"] == 2 and meta["param_groups"][0]["betas"] == [0.9, 0.999]

    resumed = GRPOTrainer(saved)
    assert resumed.steps == 2
    resumed.train_step(b2)
    expected, got = _weights(straight), _weights(resumed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)

    # Without the optimizer state (Adam's moments start over) the same step lands elsewhere: the
    # equality above is the optimizer's doing, not a coincidence of one step.
    bare = tmp_path / "bare"
    first.save_weights(bare)
    for f in (bare / OPTIMIZER_DIR).iterdir():
        f.unlink()
    (bare / OPTIMIZER_DIR).rmdir()
    fresh = GRPOTrainer(bare)
    assert fresh.steps == 0
    fresh.train_step(b2)
    assert not all(torch.equal(expected[k], v) for k, v in _weights(fresh).items())

    # A checkpoint of the next save carries the state on: the resumed trainer saves step 3.
    again = GRPOTrainer(resumed.save_weights(tmp_path / "weights" / "v3"))
    assert again.steps == 3
    assert not (tmp_path / "weights" / "v3" / OPTIMIZER_DIR / OPTIMIZER_DIR).exists()  # never nested


def test_an_unreadable_optimizer_checkpoint_is_refused_with_its_path(tmp_path):
    trainer = GRPOTrainer(make_model_folder(tmp_path / "model", seed=0))
    trainer.train_step(_batch(0, [0.0, 1.0]))
    saved = trainer.save_weights(tmp_path / "v1")
    (saved / OPTIMIZER_DIR / "state.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PipelineError, match="optimizer checkpoint .*v1/optimizer"):
        GRPOTrainer(saved)


# ---- 2. SIGKILL at many points of a real run ----------------------------------------------------

# Training steps of the run: enough that the last kill points still find steps to train. Three of
# them are spent by the lives killed after a commit; a life whose kill point was missed (its window
# is milliseconds: the first ready group to the batch taken) may train a step more. With 4, one
# such miss under load left nothing for the last kill point; 7 leaves room for three.
K = 7
BATCH = 8  # the default --rollout-batch-size
FLAGS = (
    "--rollout-data-transport", "lmdb", "--partial-rollout", "--over-sampling-batch-size", "16",
    "--rollout-max-response-len", "96", "--num-rollout", str(K), "--no-progress", "--log-level", "warning",
)  # fmt: skip
POLL = 0.005  # seconds between two looks at the store
LIFE_DEADLINE = 120.0  # a kill point not reached by then is a hang (or a changed pipeline)


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (the engine subprocesses of a launcher)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie runs nothing; its parent (init) reaps it when it gets to it


class Launcher:
    """One life of `python -m pipeline.launch`, in its own session so one killpg takes the engine too."""

    def __init__(self, out: Path, life: int, *extra: str) -> None:
        self.out = out
        self.log = out.parent / f"life-{life}.log"
        # The engine's log is a temp file that only a clean stop removes: keep killed lives' logs here.
        tmp = out.parent / "tmp"
        tmp.mkdir(exist_ok=True)
        path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
        env = {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp)}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.launch", "--output-dir", str(out), *FLAGS, *extra],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def engines(self) -> list[int]:
        return _children(self.proc.pid)

    def serving(self) -> bool:
        """The launcher has started its engine (not just any child process)."""
        for pid in self.engines():
            try:
                if b"engines.builtin" in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                    return True
            except OSError:
                continue
        return False

    def wait_until(self, what: str, condition: Callable[[], bool], deadline: float = LIFE_DEADLINE) -> None:
        # Polling: see the module docstring. Each look is a fresh read-only transaction.
        end = time.monotonic() + deadline
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"the launcher exited ({self.proc.returncode}) before {what}:\n{self.log_tail()}")
            if time.monotonic() > end:
                self.kill()
                pytest.fail(f"no {what} within {deadline:.0f}s:\n{self.log_tail()}")
            time.sleep(POLL)

    def finish(self, timeout: float) -> int:
        """The exit code of a life that should end by itself; a hang is killed and fails the test."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the launcher did not exit within {timeout:.0f}s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the launcher and every process of its session, and wait until all are gone."""
        members = [self.proc.pid, *self.engines()]
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        end = time.monotonic() + 30
        while any(_alive(p) for p in members):  # the engine is init's child now: poll, bounded
            assert time.monotonic() < end, f"processes {members} outlived SIGKILL of their group"
            time.sleep(POLL)


@dataclass
class Watch:
    """Read-only views of a run's durable state, for kill conditions and for the final checks."""

    out: Path
    _store: LmdbStore | None = None
    # group id -> per sample (tokens, behaviour log-probs, token versions) at the latest kill
    stored: dict[str, list[tuple[tuple, ...]]] = field(default_factory=dict)

    @property
    def store(self) -> LmdbStore | None:
        if self._store is None and (self.out / "rollout_data" / "data.mdb").exists():
            try:
                self._store = LmdbStore(self.out / "rollout_data", readonly=True)
            except StoreError:  # the launcher is creating it right now: look again next poll
                return None
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def count(self, state: GroupState) -> int:
        return 0 if self.store is None else self.store.count(state)

    def stored_with_tokens(self, state: GroupState) -> set[str]:
        if self.store is None:
            return set()
        return {g.group_id for g in self.store.groups(state) if any(s.response_ids for s in g.samples)}

    def weights_id(self, version: int) -> tuple[int, int] | None:
        """The folder the engines are given for `version`: a publish folder, or a checkpoint."""
        for where in ("weights", "checkpoints"):
            try:
                st = (self.out / where / f"v{version}").stat()
            except FileNotFoundError:
                continue
            return st.st_ino, st.st_mtime_ns
        return None

    def snapshot(self) -> int:
        """Remember every stored token of every unfinished group (the process is dead: stable)."""
        n = 0
        if self.store is None:
            return n
        for state in (GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.BATCHED):
            for g in self.store.groups(state):
                now = _per_token(g)
                old = self.stored.get(g.group_id)
                if old is not None:  # a later kill must find every token an earlier one found
                    _assert_prefixes(g.group_id, old, now)
                self.stored[g.group_id] = now
                n += sum(len(s.response_ids) for s in g.samples)
        return n


def _per_token(group: Group) -> list[tuple[tuple, ...]]:
    return [(s.response_ids, s.logprobs, tuple(s.token_versions())) for s in group.samples]


def _assert_prefixes(gid: str, before: list[tuple[tuple, ...]], now: list[tuple[tuple, ...]]) -> None:
    for i, (old, new) in enumerate(zip(before, now, strict=True)):
        for what, a, b in zip(("tokens", "log-probs", "versions"), old, new, strict=True):
            assert b[: len(a)] == a, f"{gid} sample {i}: the {len(a)} stored {what} were not kept"


@dataclass(frozen=True)
class KillPoint:
    name: str
    arm: Callable[[Watch, Launcher], Callable[[], bool]]  # called at the life's start: its baseline
    stop_engine_first: bool = False
    # Killed after the step's commit and before its metrics line: the file lacks the last record.
    loses_last_record: bool = False


def _after_first_admit(w: Watch, _: Launcher) -> Callable[[], bool]:
    return lambda: w.store is not None and w.store.cursor().index > 0


def _first_ready(w: Watch, _: Launcher) -> Callable[[], bool]:
    before = w.count(GroupState.READY)
    return lambda: w.count(GroupState.READY) > before


def _new_partial_with_tokens(w: Watch, _: Launcher) -> Callable[[], bool]:
    before = w.stored_with_tokens(GroupState.PARTIAL)
    return lambda: bool(w.stored_with_tokens(GroupState.PARTIAL) - before)


def _batch_taken(w: Watch, _: Launcher) -> Callable[[], bool]:
    return lambda: w.count(GroupState.BATCHED) > 0


def _publishing(w: Watch, launcher: Launcher) -> Callable[[], bool]:
    """The engine is frozen once a batch is taken; the new weights folder then appears and the
    launcher is stuck inside publish (pause/update wait on the frozen engine) when it is killed."""
    armed: dict[str, object] = {}

    def condition() -> bool:
        if "version" not in armed:
            stats = w.store.statistics() if w.store is not None else None  # one read transaction
            if stats is None or stats.counts[GroupState.BATCHED] == 0:
                return False
            engines = launcher.engines()
            assert engines, "the launcher has no engine to freeze"
            for pid in engines:
                os.kill(pid, signal.SIGSTOP)
            if w.store.statistics().trained_step != stats.trained_step:  # the step ended before the stop
                for pid in engines:
                    os.kill(pid, signal.SIGCONT)
                return False
            version = stats.trained_step + 2  # the batch being trained publishes this version
            armed["version"], armed["before"] = version, w.weights_id(version)
        now = w.weights_id(armed["version"])  # type: ignore[arg-type]
        return now is not None and now != armed["before"]

    return condition


def _step_finished(w: Watch, _: Launcher) -> Callable[[], bool]:
    before = w.store.trained_step() if w.store is not None else -1
    return lambda: w.store is not None and w.store.trained_step() > before


def _committed_before_metrics_line(w: Watch, launcher: Launcher) -> Callable[[], bool]:
    """The engine is frozen once a batch is taken: training goes on (it needs no engine), the step
    commits, and the publish that follows waits on the frozen engine, so the launcher is stuck
    between the commit and the metrics line when it is killed."""
    armed: dict[str, int] = {}

    def condition() -> bool:
        if "trained" not in armed:
            stats = w.store.statistics() if w.store is not None else None
            if stats is None or stats.counts[GroupState.BATCHED] == 0:
                return False
            engines = launcher.engines()
            assert engines, "the launcher has no engine to freeze"
            for pid in engines:
                os.kill(pid, signal.SIGSTOP)
            if w.store.statistics().trained_step != stats.trained_step:  # the step ended before the stop
                for pid in engines:
                    os.kill(pid, signal.SIGCONT)
                return False
            armed["trained"] = stats.trained_step
        return w.store.trained_step() > armed["trained"]

    return condition


def _resumed_group_running(w: Watch, _: Launcher) -> Callable[[], bool]:
    return lambda: bool(w.stored_with_tokens(GroupState.RUNNING))


KILL_POINTS = (
    KillPoint("step 0, right after the first admit", _after_first_admit),
    KillPoint("step 0, first group ready", _first_ready),
    KillPoint("over-sampling abort storing partial groups", _new_partial_with_tokens),
    KillPoint("batch taken, training", _batch_taken),
    KillPoint("new weights saved, publish in progress", _publishing),
    KillPoint("a step finished", _step_finished),
    KillPoint(
        "step committed, its metrics line not yet written", _committed_before_metrics_line, loses_last_record=True
    ),
    KillPoint("continuing a stored partial group", _resumed_group_running),
)


@pytest.mark.slow
def test_sigkill_anywhere_then_restart_trains_every_group_exactly_once(tmp_path):
    out = tmp_path / "run"
    watch = Watch(out)
    used = []
    started = time.monotonic()
    launcher = None
    try:
        for life, point in enumerate(KILL_POINTS):
            watch.close()  # a fresh handle per life (the previous writer is gone)
            launcher = Launcher(out, life)
            # The launcher starts its engine after it opened and recovered the store: from then on
            # the store holds no leftovers of the last kill, and the kill point's baseline is valid.
            launcher.wait_until("the engine", lambda launcher=launcher: launcher.serving() and watch.store is not None)
            _check_metrics_restored(watch)  # after a `loses_last_record` kill: the line is back
            condition = point.arm(watch, launcher)
            launcher.wait_until(point.name, condition)
            launcher.kill()
            _check_metrics_after_kill(watch, point)
            tokens = watch.snapshot()
            stats = watch.store.statistics()
            counts = {k.value: v for k, v in stats.counts.items() if v}
            used.append(
                (
                    point.name,
                    f"trained {stats.trained_step}",
                    f"cursor {stats.cursor.index}",
                    counts,
                    f"{tokens} tokens",
                )
            )
        # What a kill inside `save_weights` leaves behind (a kill point too narrow to hit by polling).
        unfinished = out / "checkpoints" / f".v{K}.tmp-killed"
        unfinished.mkdir(parents=True)
        (unfinished / "model.safetensors").write_bytes(b"half a file")
        damage = _append_damage(out)
        launcher = Launcher(out, len(KILL_POINTS))
        assert launcher.finish(300) == 0, launcher.log_tail()
        assert (out / "metrics.jsonl.dropped").read_bytes().splitlines() == damage
        # The one checkpoint (--save-interval 10: the last step's), no publish folder left, and the
        # note of which store counts them (pipeline.run.state).
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"v{K}"]
        assert sorted(p.name for p in (out / "weights").iterdir()) == ["owner.json"]
    finally:
        watch.close()
        if launcher is not None and launcher.proc.poll() is None:
            launcher.kill()
    elapsed = time.monotonic() - started
    print(f"{len(used)} kills in {elapsed:.0f}s:", *used, sep="\n  ")
    _check_exactly_once(out, watch.stored)


def _metric_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _check_metrics_after_kill(w: Watch, point: KillPoint) -> None:
    """A dead launcher's file: in order, no duplicate, no step the store does not count; at most
    the last committed step's line missing, and exactly that where the kill point says so."""
    steps, trained = _metric_steps(w.out), w.store.trained_step()
    assert steps == list(range(len(steps))), f"{point.name}: metrics steps {steps}"
    lost = trained + 1 - len(steps)
    assert lost in (0, 1), f"{point.name}: metrics steps {steps}, trained step {trained}"
    if point.loses_last_record:  # the kill point is where it says it is
        assert lost == 1, f"{point.name}: metrics steps {steps}, trained step {trained}"


def _check_metrics_restored(w: Watch) -> None:
    """A resumed launcher restores the file before it starts its engine: from then on the file
    holds exactly steps 0..trained (the live launcher may append a step meanwhile; the store is
    read before and after the file, so the bounds hold)."""
    before = w.store.trained_step()
    steps = _metric_steps(w.out)
    after = w.store.trained_step()
    assert steps == list(range(len(steps))) and before + 1 <= len(steps) <= after + 1, (steps, before, after)


def _append_damage(out: Path) -> list[bytes]:
    """What another crash could leave in the file (a duplicate, a phantom step, a torn line)."""
    path = out / "metrics.jsonl"
    last = path.read_bytes().splitlines()[-1]
    damage = [last, json.dumps({"step": K + 5, "version": K + 5}).encode(), b'{"step": 1, "rewa']
    with path.open("ab") as f:
        f.write(b"".join(line + b"\n" for line in damage))
    return damage


def _check_exactly_once(
    out: Path, snapshots: dict[str, list[tuple[tuple, ...]]], *, expect_resumed: bool = True
) -> dict[GroupState, int]:
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        assert store.trained_step() == K - 1
        counts = {s: store.count(s) for s in GroupState}
        assert counts[GroupState.RUNNING] == 0 and counts[GroupState.BATCHED] == 0, counts
        cursor = store.cursor()
        assert cursor.epoch == 0
        # Every prompt the cursor handed out is in the store exactly once, and nothing else is.
        ids = [g.group_id for s in GroupState for g in store.groups(s)]
        assert len(ids) == len(set(ids)) == sum(counts.values()) == cursor.index
        assert sorted(int(i.split("-p")[1]) for i in ids) == list(range(cursor.index))

        trained: list[str] = []
        resumed = 0
        for step in range(K):
            batch = store.batch(step)
            assert batch is not None and len(batch.groups) == BATCH, step
            trained += [g.group_id for g in batch.groups]
            for g in batch.groups:
                assert store.get(g.group_id)[0] is GroupState.TRAINED
                for s in g.samples:
                    _check_sample(s, step)
                    resumed += bool(s.resumed_at)
        assert len(trained) == len(set(trained)) == K * BATCH == counts[GroupState.TRAINED]
        assert resumed > 0 or not expect_resumed, "no trained sample was ever continued from a stored prefix"

        # No stored token lost: what a group held at any kill (tokens, their behaviour log-probs
        # and versions) is a prefix of what it holds now.
        for gid, before in snapshots.items():
            found = store.get(gid)
            assert found is not None, gid
            _assert_prefixes(gid, before, _per_token(found[1]))
    # The final checkpoint's optimizer took exactly K steps: no batch was trained twice into the
    # weights that survived, however often a step was trained and then killed before it counted.
    optimizer = out / "checkpoints" / f"v{K}" / OPTIMIZER_DIR
    # torch writes state.json; megatron writes rank0.json
    meta_file = optimizer / "state.json" if (optimizer / "state.json").exists() else optimizer / "rank0.json"
    meta = json.loads(meta_file.read_text())
    assert meta["trainer_steps"] == K
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["version"] == r["step"] for r in records)
    # Exactly one record per trained step, 0..K-1, each the one committed with its step.
    assert [r["step"] for r in records] == list(range(K))
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        stored = store.step_metrics()
    assert sorted(stored) == list(range(K))
    for r in records:
        assert {k: r[k] for k in stored[r["step"]]} == stored[r["step"]], r["step"]
    return counts


def _check_sample(s: Sample, step: int) -> None:
    assert s.status.finished or s.status is SampleStatus.FAILED
    n = s.response_len
    assert len(s.logprobs) == len(s.loss_mask) == n
    # The spans tile the response, versions never go down, and none is newer than the step's policy.
    assert [(a.start, a.end) for a in s.spans[:1]] == [(0, s.spans[0].end)] if n else s.spans == ()
    assert all(a.end == b.start for a, b in itertools.pairwise(s.spans)) and (not n or s.spans[-1].end == n)
    versions = s.token_versions()
    assert versions == sorted(versions) and all(v <= step for v in versions)
    assert all(0 < r <= n for r in s.resumed_at) and list(s.resumed_at) == sorted(set(s.resumed_at))


SMALL = ("--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--over-sampling-batch-size", "4",
         "--rollout-max-response-len", "32")  # fmt: skip


@pytest.mark.slow
def test_a_kill_between_the_commit_and_the_metrics_line_is_repaired_on_resume(tmp_path):
    """The one kill point the metrics file can lose a record at, on a small run: the record is
    written back from the store on resume, and the run ends with one record per step."""
    out = tmp_path / "run"
    watch = Watch(out)
    launcher = None
    point = next(p for p in KILL_POINTS if p.loses_last_record)
    caught: list[int] = []  # the step each kill lost the record of
    try:
        # Twice: at step 0 and at step 1 (after a restore), or a step later where a loaded machine
        # let the millisecond window of the one before pass.
        for life in range(2):
            watch.close()
            launcher = Launcher(out, life, *SMALL)
            launcher.wait_until("the engine", lambda launcher=launcher: launcher.serving() and watch.store is not None)
            _check_metrics_restored(watch)
            launcher.wait_until(point.name, point.arm(watch, launcher))
            launcher.kill()
            _check_metrics_after_kill(watch, point)
            trained = watch.store.trained_step()
            assert trained > max(caught, default=-1) and _metric_steps(out) == list(range(trained))
            caught.append(trained)
        watch.close()
        launcher = Launcher(out, 2, *SMALL)
        assert launcher.finish(300) == 0, launcher.log_tail()
    finally:
        watch.close()
        if launcher is not None and launcher.proc.poll() is None:
            launcher.kill()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(K))
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        stored = store.step_metrics()
    # The caught steps were written back from the store (no publish timings); the others appended.
    assert [r == stored[r["step"]] for r in records] == [r["step"] in caught for r in records], caught
    assert "time/publish_update" in records[caught[-1] + 1] and not (out / "metrics.jsonl.dropped").exists()


# ---- 3. an engine dies mid-run -------------------------------------------------------------------


@pytest.mark.slow
def test_a_dead_engine_stops_the_run_with_a_clear_error_and_it_resumes(tmp_path):
    out = tmp_path / "run"
    watch = Watch(out)
    try:
        launcher = Launcher(out, 0)
        launcher.wait_until("the first admit", lambda: watch.store is not None and watch.store.cursor().index > 0)
        engines = launcher.engines()
        assert len(engines) == 1
        os.kill(engines[0], signal.SIGKILL)
        killed = time.monotonic()
        code = launcher.finish(90)
        print(f"the launcher exited {time.monotonic() - killed:.1f}s after its engine died")
        log = launcher.log.read_text(errors="replace")
        assert code == 1, log
        # Said in one line, not a traceback of task groups.
        assert "Traceback" not in log and any(
            line.startswith("error: ") and "engine" in line for line in log.splitlines()
        ), log
        watch.snapshot()
    finally:
        watch.close()
    final = Launcher(out, 1)
    assert final.finish(300) == 0, final.log_tail()
    counts = _check_exactly_once(out, watch.stored)
    # Samples whose engine died keep their prefixes and go back as partial: no prompt is lost.
    assert counts[GroupState.FAILED] == 0, f"{counts[GroupState.FAILED]} groups failed because their engine died"


@pytest.mark.slow
def test_sigterm_stops_the_run_like_ctrl_c_and_it_resumes(tmp_path):
    """A cluster scheduler preempts with SIGTERM: the launcher stops as on Ctrl-C (exit 143, one
    line, its engine stopped, the store closed), and the same command resumes. Groups in flight are
    not drained first: they stay RUNNING in the store and come back as partial on resume, as after
    a kill, with the prefixes stored at their last abort."""
    out = tmp_path / "run"
    watch = Watch(out)
    try:
        launcher = Launcher(out, 0)
        launcher.wait_until("a group in flight after the first commit", lambda: (
            watch.store is not None and watch.store.trained_step() >= 0 and watch.count(GroupState.RUNNING) > 0
        ))  # fmt: skip
        engines = launcher.engines()
        os.kill(launcher.proc.pid, signal.SIGTERM)  # the launcher alone: it stops its engine itself
        code = launcher.finish(120)
        log = launcher.log.read_text(errors="replace")
        assert code == 128 + signal.SIGTERM, log
        assert "Traceback" not in log and "terminated (SIGTERM): rollout state is in the store" in log, log
        assert not [pid for pid in engines if Path(f"/proc/{pid}").exists()], "an engine outlived the launcher"
        watch.close()
        assert watch.store is not None and watch.store.trained_step() < K - 1
        watch.snapshot()
    finally:
        watch.close()
    final = Launcher(out, 1)
    assert final.finish(300) == 0, final.log_tail()
    _check_exactly_once(out, watch.stored, expect_resumed=False)


ASYNC_KILL_POINTS = (
    KillPoint("async: first group ready", _first_ready),
    KillPoint("async: batch taken, training while generation goes on", _batch_taken),
    KillPoint("async: a step finished", _step_finished),
    KillPoint(
        "async: step committed, its metrics line not yet written",
        _committed_before_metrics_line,
        loses_last_record=True,
    ),
)


@pytest.mark.slow
def test_sigkill_in_async_mode_then_restart_trains_every_group_exactly_once(tmp_path):
    """The same guarantees while generation runs across training steps and publishes: the step is
    committed before its publish, so no token stamped with a new version outlives a restart that
    falls back to the old one (versions never go down inside a sample). In async mode tokens reach
    the store only when a group is put aside (a publish's aborts are resumed in process), so the
    kill points are the ones a running async pipeline passes through."""
    out = tmp_path / "run"
    watch = Watch(out)
    launcher = None
    try:
        for life, point in enumerate(ASYNC_KILL_POINTS):
            watch.close()
            launcher = Launcher(out, life, "--rollout-mode", "async")
            launcher.wait_until("the engine", lambda launcher=launcher: launcher.serving() and watch.store is not None)
            _check_metrics_restored(watch)
            condition = point.arm(watch, launcher)
            launcher.wait_until(point.name, condition)
            launcher.kill()
            _check_metrics_after_kill(watch, point)
            watch.snapshot()
        launcher = Launcher(out, len(ASYNC_KILL_POINTS), "--rollout-mode", "async")
        assert launcher.finish(300) == 0, launcher.log_tail()
    finally:
        watch.close()
        if launcher is not None and launcher.proc.poll() is None:
            launcher.kill()
    # In async mode a trained sample is continued only if it was in flight at a publish, which
    # depends on how fast the engine is against the trainer; the sync test's "continuing a stored
    # partial group" kill point is the one that proves prefixes are continued across a kill.
    _check_exactly_once(out, watch.stored, expect_resumed=False)


MEGATRON_KILL_POINTS = (
    KillPoint("megatron: batch taken, ranks training", _batch_taken),
    KillPoint("megatron: a step finished", _step_finished),
)
MEGATRON = ("--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2")


@pytest.mark.slow
def test_sigkill_with_megatron_ranks_then_restart_trains_every_group_exactly_once(tmp_path):
    """The megatron backend (TP=2: rank 0 in the launcher, rank 1 its child) keeps the same promise:
    its checkpoint (HF weights + one optimizer shard per rank) is complete before the step commits,
    and a restart resumes every rank from it. The kill takes rank 1 with the launcher's session."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "run"
    watch = Watch(out)
    launcher = None
    try:
        for life, point in enumerate(MEGATRON_KILL_POINTS):
            watch.close()
            launcher = Launcher(out, life, *MEGATRON)
            launcher.wait_until(
                "the engine", lambda launcher=launcher: bool(launcher.engines()) and watch.store is not None
            )
            condition = point.arm(watch, launcher)
            # Starting rank 1 and building the model on both ranks comes first: more time than a torch life.
            launcher.wait_until(point.name, condition, deadline=2 * LIFE_DEADLINE)
            launcher.kill()
            watch.snapshot()
        launcher = Launcher(out, len(MEGATRON_KILL_POINTS), *MEGATRON)
        assert launcher.finish(300) == 0, launcher.log_tail()
        shards = sorted(p.name for p in (out / "checkpoints" / f"v{K}" / OPTIMIZER_DIR).iterdir())
        assert shards == ["rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors"]
    finally:
        watch.close()
        if launcher is not None and launcher.proc.poll() is None:
            launcher.kill()
    _check_exactly_once(out, watch.stored)
