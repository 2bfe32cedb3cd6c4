"""Agents end to end through `python -m pipeline.launch`: the built-in multi-turn task (`--task tool`)
learns; partial rollout, async and LMDB keep every agent transcript and state; a SIGKILLed run
resumes each stored conversation where it stopped (the kill harness of test_fault_injection)."""

from __future__ import annotations

import json
from pathlib import Path

from core.types import Sample, SampleStatus
from pipeline.run.cli import main
from pipeline.tasks.tool_task import CALL_TURN_LEN, model_turns
from pipeline.tasks.toy import encode
from stages.agent import AGENT_KEY
from storage import GroupState, LmdbStore
from tests.test_fault_injection import (
    BATCH,
    Launcher,
    Watch,
    _check_exactly_once,
    _new_partial_with_tokens,
)

CALL = encode("?")[0]


def run(out: Path, *flags: str) -> list[dict]:
    code = main(["--output-dir", str(out), "--no-progress", "--log-level", "warning", "--task", "tool", *flags])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_conversation(s: Sample) -> None:
    """A finished tool-task transcript: call turn, the tool's answer (mask 0) only after a call, reply."""
    assert s.status is SampleStatus.COMPLETED, s
    state = s.metadata[AGENT_KEY]["state"]
    assert state["step"] == "done"
    turns = model_turns(s)
    tool = [i for i, m in enumerate(s.loss_mask) if not m]
    if len(turns) == 1:  # no tool call: one turn, nothing else
        assert CALL not in turns[0] and not tool
        return
    assert len(turns) == 2 and CALL in turns[0] and len(turns[0]) <= CALL_TURN_LEN
    assert len(tool) == 3 and tool == list(range(tool[0], tool[0] + 3))  # "=c." once, in one place
    assert all(s.logprobs[i] == 0.0 for i in tool) and all(
        s.logprobs[i] < 0 for i in range(s.response_len) if s.loss_mask[i]
    )


def test_the_built_in_tool_task_learns(tmp_path: Path) -> None:
    records = run(tmp_path / "run", "--num-rollout", "24")
    first = sum(r["rollout/raw_reward"] for r in records[:5]) / 5
    last = sum(r["rollout/raw_reward"] for r in records[-5:]) / 5
    assert last > first + 0.1, (first, last)
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3  # tool tokens never weigh in


def test_partial_and_async_rollout_keep_agent_transcripts_on_lmdb(tmp_path: Path) -> None:
    for mode in ("sync", "async"):
        out = tmp_path / mode
        records = run(
            out,
            "--num-rollout",
            "4",
            "--rollout-mode",
            mode,
            "--partial-rollout",
            "--over-sampling-batch-size",
            "16",
            "--rollout-data-transport",
            "lmdb",
            "--max-staleness",
            "1",
        )
        assert len(records) == 4
        with LmdbStore(out / "rollout_data", readonly=True) as store:
            trained = [g for step in range(4) for g in store.batch(step).groups]
            assert len({g.group_id for g in trained}) == 4 * BATCH
            for g in trained:
                for s in g.samples:
                    check_conversation(s)
            partial = list(store.groups(GroupState.PARTIAL))
            if mode == "sync":
                assert records[-1]["groups/partial_total"] > 0
            for g in partial:  # put aside mid-conversation: the agent's record is stored with it
                for s in g.samples:
                    if s.response_len:
                        assert AGENT_KEY in s.metadata


def test_sigkill_then_restart_continues_the_same_conversations(tmp_path: Path) -> None:
    out = tmp_path / "run"
    watch = Watch(out)
    launcher = None
    try:
        launcher = Launcher(out, 0, "--task", "tool")
        launcher.wait_until("the store", lambda: watch.store is not None)
        launcher.wait_until("a partial group with tokens", _new_partial_with_tokens(watch, launcher))
        launcher.kill()
        watch.snapshot()
        stored = {g.group_id: g for g in watch.store.groups(GroupState.PARTIAL)}
        watch.close()
        launcher = Launcher(out, 1, "--task", "tool")
        assert launcher.finish(300) == 0, launcher.log_tail()
    finally:
        watch.close()
        if launcher is not None and launcher.proc.poll() is None:
            launcher.kill()
    _check_exactly_once(out, watch.stored)  # every stored token kept, every group trained once
    assert stored
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        for gid, before in stored.items():
            _, now = store.get(gid)
            for old, new in zip(before.samples, now.samples, strict=True):
                assert new.response_ids[: old.response_len] == old.response_ids
                assert new.loss_mask[: old.response_len] == old.loss_mask
                if new.status.finished:
                    check_conversation(new)
                if old.response_len and new.status.finished:
                    # the agent continued from its stored step, it did not start over
                    was = old.metadata[AGENT_KEY]["state"].get("step", "call")
                    assert was == "call" or new.metadata[AGENT_KEY]["state"]["step"] == "done"
