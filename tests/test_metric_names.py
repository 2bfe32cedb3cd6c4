"""The step record under familiar names (issue 31): slime's aliases beside our keys, reward
spread, tokens per second, engine loads, and no key per policy version."""

from __future__ import annotations

import dataclasses
import math

import pytest

from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
from pipeline.metric_names import SLIME_NAMES, engine_load_metrics, slime_aliases, throughput_metrics
from pipeline.metrics import MetricsSink, batch_metrics
from stages.sglang.wire import EngineLoad
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
    assert m["reward/mean"] == mean
    assert math.isclose(m["reward/std"], math.sqrt(sum((r - mean) ** 2 for r in rewards) / 6))
    assert (m["reward/min"], m["reward/max"], m["reward/zero_std_groups"]) == (0.0, 1.0, 1)
    assert (m["response_len/min"], m["response_len/max"]) == (1, 3)
    aliases = slime_aliases(m)
    assert aliases["rollout/raw_reward"] == mean and aliases["rollout/zero_std/count"] == 1
    assert aliases["rollout/truncated_ratio"] == m["truncated_ratio"]


def test_rates_and_loads():
    rates = throughput_metrics({"time/step": 2.0, "batch/tokens": 100, "train/tokens": 60})
    assert rates == {"perf/tokens_per_sec": 50.0, "perf/effective_tokens_per_sec": 30.0}
    assert throughput_metrics({"time/step": 0.0}) == {}
    loads = engine_load_metrics({"http://b": EngineLoad(1, 5), "http://a": EngineLoad(2, 0)})
    assert loads["engine/load/0/running"] == 2 and loads["engine/load/1/waiting"] == 5  # sorted by URL
    assert loads["engine/load/max_over_mean"] == 6 / 4


@pytest.mark.anyio
async def test_a_run_writes_slimes_names_rates_and_loads_beside_ours(tmp_path):
    sink = MetricsSink(None)
    async with FakeSGLang(token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
        await run(plan(num_steps=3), MemoryStore(), tmp_path, fake, sink)
    for r in sink.records:
        for ours, slime in SLIME_NAMES.items():
            if ours in r:
                assert r[slime] == r[ours], (ours, slime)
        assert r["rollout/raw_reward"] == r["reward/mean"] and r["perf/step_time"] == r["time/step"]
        assert r["perf/tokens_per_sec"] == r["batch/tokens"] / r["time/step"]
        assert "engine/load/0/running" in r and "engine/load/max_over_mean" in r
    # A fixed key set: nothing is added per step or per policy version.
    assert len({frozenset(r) for r in sink.records}) == 1
