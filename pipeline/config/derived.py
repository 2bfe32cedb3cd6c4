"""Reading a setting that `load_config` derives when it is not given.

Settings such as `output.metrics_file` or `storage.data_dir` are typed `X | None` because a
config can be built field by field before its defaults are derived; after `load_config` they
always hold a value. `derived` turns that guarantee into a type, and a config that skipped the
load step into a clear error instead of a `TypeError` deep in a stage.
"""

from __future__ import annotations

from typing import TypeVar

from core.errors import ConfigError

__all__ = ["derived"]

T = TypeVar("T")


def derived(value: T | None, setting: str) -> T:
    """`value`, which `load_config` derives for `setting` (e.g. "output.dir") when none is given."""
    if value is None:
        raise ConfigError([f"{setting} is None: it is derived by load_config, which this config did not go through"])
    return value
