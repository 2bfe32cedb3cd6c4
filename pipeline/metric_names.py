"""The step record under the names RL engineers know: slime's aliases, rates, engine loads.

Our keys stay what they are (dashboards and tools read them); where slime logs the same concept,
`slime_aliases` adds its key beside ours with the same value, in the record itself, so the file,
the store's copy, TensorBoard and W&B all carry both. `SLIME_NAMES` is the one table of them (the
README's metric table lists it, with verl's names too). A concept slime has no key for keeps ours
alone; a slime key whose meaning differs (slime's `train/ppo_kl` is old - new log-prob, ours
`train/approx_kl_k3` is k3 between the engine and the trainer) is not aliased.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.sglang.wire import EngineLoad

__all__ = ["SLIME_NAMES", "engine_load_metrics", "slime_aliases", "throughput_metrics"]

# our key -> slime's key for the same value
SLIME_NAMES: dict[str, str] = {
    "reward/mean": "rollout/raw_reward",
    "response_len/mean": "rollout/response_len/mean",
    "response_len/max": "rollout/response_len/max",
    "response_len/min": "rollout/response_len/min",
    "truncated_ratio": "rollout/truncated_ratio",
    "reward/zero_std_groups": "rollout/zero_std/count",
    "time/step": "perf/step_time",
    "time/train": "perf/train_time",
    "time/rollout": "perf/train_wait_time",
    "time/save": "perf/save_model_time",
    "train/ref_log_probs_time": "perf/ref_log_probs_time",
    "train/lr": "train/lr-pg_0",
    "train/tis_mean": "train/tis",
    "train/tis_clip_ratio": "train/tis_clipfrac",
    "train/opsm_mask_frac": "train/opsm_clipfrac",
}


def slime_aliases(record: Mapping[str, Any]) -> dict[str, Any]:
    """slime's key for each of the record's keys slime has a name for (same value)."""
    return {slime: record[ours] for ours, slime in SLIME_NAMES.items() if ours in record}


def throughput_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """Tokens per second of the step: every response token of the batch (`perf/tokens_per_sec`),
    and those that trained (`perf/effective_tokens_per_sec`, after the loss mask and every
    token rule), over the step's wall time (commit to commit)."""
    seconds = float(record.get("time/step", 0.0))
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
