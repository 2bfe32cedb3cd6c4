"""The small typed helpers that narrow config values at their use: `derived` and `wandb_mode`."""

from pathlib import Path

import pytest

from core.errors import ConfigError
from pipeline.config import load_config
from pipeline.config.derived import derived
from pipeline.metric_sinks import wandb_mode


def test_derived_passes_a_value_through_and_names_the_setting_when_none():
    assert derived(Path("runs/x"), "output.dir") == Path("runs/x")
    assert derived(0, "rollout.seed") == 0  # a falsy value is a value
    with pytest.raises(ConfigError, match=r"output\.metrics_file is None"):
        derived(None, "output.metrics_file")


def test_load_config_derives_every_setting_the_launcher_reads(tmp_path):
    config = load_config(["--output-dir", str(tmp_path / "run")])
    assert derived(config.output.dir, "output.dir") == tmp_path / "run"
    assert derived(config.output.metrics_file, "output.metrics_file") == tmp_path / "run" / "metrics.jsonl"
    assert derived(config.storage.data_dir, "storage.data_dir") == tmp_path / "run" / "rollout_data"


@pytest.mark.parametrize("mode", ["offline", "online", "disabled"])
def test_wandb_mode_accepts_the_config_choices(mode):
    assert wandb_mode(mode) == mode


def test_wandb_mode_names_a_bad_value():
    with pytest.raises(ConfigError, match=r"output\.wandb_mode='cloud'.*offline"):
        wandb_mode("cloud")
