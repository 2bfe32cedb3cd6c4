"""The step record under familiar names (issue 31): one name per concept, slime's where slime has
one (issue 45: no alias beside it), reward spread, tokens per second, engine loads, and no key per
policy version."""

from __future__ import annotations

import dataclasses
import math

import pytest

from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
from pipeline.metric_names import RENAMED, engine_load_metrics, throughput_metrics, trainer_record
from pipeline.metrics import MetricsSink, batch_metrics
from stages.sglang_client.wire import EngineLoad
from storage import MemoryStore
from tests.fakes import FakeSGLang
from tests.test_controller import EOS, lengths_by_prompt, plan, run


def _group(rewards: list[float], seq: int) -> Group:
    task = PromptTask(index=seq, prompt_ids=(1, 2), label=None)
    samples = [
        Sample(index=i, prompt_ids=task.prompt_ids).extended(
            Segment((5,) * (i + 1), (-1.0,) * (i + 1), FinishReason.STOP, 0), max_response_len=8
        )
        for i in range(len(rewards))
    ]
    group = Group.fresh(task, epoch=0, n_samples=len(rewards), version=0, seq=seq)
    return group.with_samples([dataclasses.replace(s, reward=r) for s, r in zip(samples, rewards, strict=True)])


def test_reward_spread_and_zero_std_groups():
    batch = Batch(0, (_group([1.0, 0.0, 1.0], 0), _group([0.5, 0.5, 0.5], 1)))
    m = batch_metrics(batch, version=0)
    rewards = [1.0, 0.0, 1.0, 0.5, 0.5, 0.5]
    mean = sum(rewards) / 6
    assert m["rollout/raw_reward"] == mean
    assert math.isclose(m["reward/std"], math.sqrt(sum((r - mean) ** 2 for r in rewards) / 6))
    assert (m["reward/min"], m["reward/max"], m["rollout/zero_std/count"]) == (0.0, 1.0, 1)
    assert (m["rollout/response_len/min"], m["rollout/response_len/max"]) == (1, 3)
    assert not set(m) & set(RENAMED)  # no old name, no alias


def test_rates_and_loads():
    rates = throughput_metrics({"perf/step_time": 2.0, "batch/tokens": 100, "train/tokens": 60})
    assert rates == {"perf/tokens_per_sec": 50.0, "perf/effective_tokens_per_sec": 30.0}
    assert throughput_metrics({"perf/step_time": 0.0}) == {}
    loads = engine_load_metrics({"http://b": EngineLoad(1, 5), "http://a": EngineLoad(2, 0)})
    assert loads["engine/load/0/running"] == 2 and loads["engine/load/1/waiting"] == 5  # sorted by URL
    assert loads["engine/load/max_over_mean"] == 6 / 4


def test_the_trainers_names_become_the_records():
    record = trainer_record({"loss": 0.5, "lr": 1e-3, "tis_mean": 1.0, "reward_mean": 0.25, "ref_log_probs_time": 2.0})
    assert record == {"train/loss": 0.5, "train/lr-pg_0": 1e-3, "train/tis": 1.0, "perf/ref_log_probs_time": 2.0}


@pytest.mark.anyio
async def test_a_run_writes_slimes_names_rates_and_loads(tmp_path):
    sink = MetricsSink(None)
    async with FakeSGLang(token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
        await run(plan(num_steps=3), MemoryStore(), tmp_path, fake, sink)
    for r in sink.records:
        assert not set(r) & set(RENAMED), set(r) & set(RENAMED)
        assert "rollout/raw_reward" in r and "perf/step_time" in r
        assert r["perf/tokens_per_sec"] == r["batch/tokens"] / r["perf/step_time"]
        assert "engine/load/0/running" in r and "engine/load/max_over_mean" in r
    # A fixed key set: nothing is added per step or per policy version.
    assert len({frozenset(r) for r in sink.records}) == 1


def test_the_docs_list_every_rename():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text(encoding="utf-8")
    rows = {line for line in page.splitlines() if line.startswith("| `")}
    for old, kept in RENAMED.items():
        assert any(f"`{old}`" in row.split("|")[1] and f"`{kept}`" in row.split("|")[2] for row in rows), old
