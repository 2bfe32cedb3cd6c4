"""The step record's names: one per concept, slime's where slime has the concept.

Until issue 45 the record carried our key and slime's beside it with the same value (and the
trainer's copy of the batch's reward and length figures under a third name): 19 concepts under two
or three names each. Now each has one name. `RENAMED` is the table, an old name to the name
kept (docs/metrics.md prints it): a dashboard or script that read an old name reads the kept one.
Records written before the change carry both names for the slime ones, so a reader of the kept
names reads old files too. A concept slime has no key for keeps ours (`reward/std`,
`rollout/zero_std/count`: slime splits that one by reward value); a slime key whose meaning
differs (slime's `train/ppo_kl` is old - new log-prob, ours `train/approx_kl_k3` is k3 between the
engine and the trainer) is not taken.

The trainer reports its own names (`trainers/metrics.py`, the same for every backend);
`trainer_record` turns them into the record's: `train/<name>`, slime's name where it has one,
and without the figures the batch's own keys already say.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.sglang_client.wire import EngineLoad

__all__ = ["RENAMED", "engine_load_metrics", "throughput_metrics", "trainer_record"]

# The name a concept had (beside another, with the same value) -> the one name it has now.
RENAMED: dict[str, str] = {
    "reward/mean": "rollout/raw_reward",
    "train/reward_mean": "rollout/raw_reward",
    "train/reward_std": "reward/std",
    "train/reward_min": "reward/min",
    "train/reward_max": "reward/max",
    "reward/zero_std_groups": "rollout/zero_std/count",
    "train/zero_std_groups": "rollout/zero_std/count",
    "response_len/mean": "rollout/response_len/mean",
    "train/response_len_mean": "rollout/response_len/mean",
    "response_len/max": "rollout/response_len/max",
    "response_len/min": "rollout/response_len/min",
    "truncated_ratio": "rollout/truncated_ratio",
    "train/truncated_ratio": "rollout/truncated_ratio",
    "time/step": "perf/step_time",
    "time/train": "perf/train_time",
    "time/rollout": "perf/train_wait_time",
    "time/save": "perf/save_model_time",
    "train/ref_log_probs_time": "perf/ref_log_probs_time",
    "train/lr": "train/lr-pg_0",
    "train/tis_mean": "train/tis",
    "train/tis_clip_ratio": "train/tis_clipfrac",
    "train/opsm_mask_frac": "train/opsm_clipfrac",
    "eval/<name>/truncated_ratio": "eval/<name>-truncated_ratio",
}

# The trainer's figures the batch's keys already give, for the same samples (a ready batch holds
# no failed sample, so "the samples that train" are all of them): left out of the record.
_SAID_BY_THE_BATCH = frozenset(
    {"reward_mean", "reward_std", "reward_min", "reward_max", "zero_std_groups", "response_len_mean", "truncated_ratio"}
)
# The trainer's name -> the record's, where it is not `train/<name>`.
_TRAINER_NAMES = {
    "lr": "train/lr-pg_0",
    "tis_mean": "train/tis",
    "tis_clip_ratio": "train/tis_clipfrac",
    "opsm_mask_frac": "train/opsm_clipfrac",
    "ref_log_probs_time": "perf/ref_log_probs_time",
}


def trainer_record(metrics: Mapping[str, float]) -> dict[str, float]:
    """The trainer's metrics under the record's names (module docstring)."""
    return {
        _TRAINER_NAMES.get(name, f"train/{name}"): value
        for name, value in metrics.items()
        if name not in _SAID_BY_THE_BATCH
    }


def throughput_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """Tokens per second of the step: every response token of the batch (`perf/tokens_per_sec`),
    and those that trained (`perf/effective_tokens_per_sec`, after the loss mask and every
    token rule), over the step's wall time (commit to commit)."""
    seconds = float(record.get("perf/step_time", 0.0))
    if seconds <= 0:
        return {}
    return {
        "perf/tokens_per_sec": float(record.get("batch/tokens", 0.0)) / seconds,
        "perf/effective_tokens_per_sec": float(record.get("train/tokens", 0.0)) / seconds,
    }


def engine_load_metrics(loads: Mapping[str, EngineLoad]) -> dict[str, float]:
    """Requests each engine holds (running + waiting, `GET /v1/loads`), by its index in the fleet's
    sorted URLs, and the spread: `engine/load/max_over_mean` is 1 for an even split."""
    out: dict[str, float] = {}
    totals = []
    for i, url in enumerate(sorted(loads)):
        load = loads[url]
        out[f"engine/load/{i}/running"] = float(load.running)
        out[f"engine/load/{i}/waiting"] = float(load.waiting)
        totals.append(load.total)
    if totals:
        mean = sum(totals) / len(totals)
        out["engine/load/max_over_mean"] = max(totals) / mean if mean > 0 else 1.0
    return out
