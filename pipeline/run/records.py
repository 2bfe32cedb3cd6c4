"""What a run writes about its steps, beside the store: the metrics file (restored from the store
on resume, written back on a failed exit), the dashboards (TensorBoard, W&B), the progress line
and the closing summary.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from core.errors import PipelineError
from pipeline.config import Config, config_to_dict
from pipeline.config.derived import derived
from pipeline.metric_sinks import SinkSettings, open_step_sinks, wandb_mode
from pipeline.metrics import MetricsSink, RestoredMetrics, restore_metrics_file
from storage import Store

__all__ = [
    "Progress",
    "dashboard_settings",
    "draws_a_bar",
    "metrics_sink",
    "print_summary",
    "records_written_back_on_error",
    "restore_metrics",
]

log = structlog.get_logger("launch")


def restore_metrics(config: Config, store: Store) -> RestoredMetrics:
    """One metrics record per trained step before this run appends any: see `pipeline.metrics`."""
    path = Path(derived(config.output.metrics_file, "output.metrics_file"))
    restored = restore_metrics_file(path, trained_step=store.trained_step(), stored=store.step_metrics())
    if restored.rebuilt:
        log.warning("metrics records written back from the store", file=str(path), steps=list(restored.rebuilt))
    if restored.dropped:
        log.warning("metrics records moved aside", file=str(path) + ".dropped", why=list(restored.dropped))
    if restored.missing:
        log.warning("trained steps with no metrics record anywhere", steps=list(restored.missing))
    return restored


def records_written_back_on_error(config: Config, store: Store) -> Callable[..., None]:
    """An exit hook: a run that ends in an error (or a stop) after committing a step whose record
    it had not appended yet (the publish after the commit failed) writes that record to the
    metrics file from the store before it exits, instead of leaving it to the next resume."""

    def on_exit(exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            return
        try:
            restore_metrics(config, store)
        except (OSError, PipelineError) as error:  # a full disk says so itself, in the error line
            log.warning("the metrics records of committed steps were not written back", error=str(error))

    return on_exit


def dashboard_settings(config: Config) -> SinkSettings:
    """The dashboard flags as the sinks take them (the run and `python -m pipeline.eval` alike)."""
    o = config.output
    return SinkSettings(
        use_tensorboard=o.use_tensorboard,
        tensorboard_dir=o.tensorboard_dir,
        use_wandb=o.use_wandb,
        wandb_project=o.wandb_project,
        wandb_group=o.wandb_group,
        wandb_mode=wandb_mode(o.wandb_mode),
        wandb_dir=o.wandb_dir,
        wandb_run_id=o.wandb_run_id,
    )


def metrics_sink(config: Config, out: Path, restored: RestoredMetrics, store: Store) -> MetricsSink:
    """The metrics file plus the dashboards asked for; records rebuilt from the store go to them too."""
    o = config.output
    settings = dashboard_settings(config)
    warn = log.warning
    extras = open_step_sinks(
        settings, output_dir=out, run_id=config.storage.run_id, warn=warn, config=config_to_dict(config)
    )
    sink = MetricsSink(Path(derived(o.metrics_file, "output.metrics_file")), extras, warn=warn)
    if extras and restored.rebuilt:
        stored = store.step_metrics(min(restored.rebuilt))
        for step in restored.rebuilt:
            sink.write_extras(stored[step])
    return sink


def draws_a_bar(config: Config) -> bool:
    """Whether a progress bar is drawn: `--progress` and stderr a terminal. A bar redraws itself with
    carriage returns, which a log file keeps, one per refresh; there, plain lines say it instead."""
    return config.output.progress and sys.stderr.isatty()


class Progress:
    def __init__(self, config: Config, start_step: int) -> None:
        self._bar = None
        if draws_a_bar(config):  # in a log file, plain lines (below)
            from tqdm import tqdm

            self._bar = tqdm(total=config.rollout.num_rollout, initial=start_step, unit="step", dynamic_ncols=True)

    def update_step(self, record: dict[str, Any]) -> None:
        if self._bar is None:
            log.info(
                "step",
                step=record["step"],
                reward=round(record["rollout/raw_reward"], 3),
                staleness_max=record["staleness/max"],
                multi_version=round(record["staleness/multi_version_frac"], 3),
                groups_per_s=round(record["groups/per_second"], 2),
                engine_busy=round(record["engine/busy_frac"], 2),
                trainer_idle=round(record["trainer/idle_frac"], 2),
            )
            return
        self._bar.set_postfix(
            reward=f"{record['rollout/raw_reward']:.3f}",
            len=f"{record['rollout/response_len/mean']:.1f}",
            stale=record["staleness/max"],
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def print_summary(records: list[dict[str, Any]], num_rollout: int) -> None:
    if not records:
        print(f"nothing to do: the run has trained all of its --num-rollout={num_rollout} steps")
        return
    k = max(1, min(5, len(records) // 4))
    first = statistics.fmean(r["rollout/raw_reward"] for r in records[:k])
    last = statistics.fmean(r["rollout/raw_reward"] for r in records[-k:])
    print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({len(records)} steps)")
