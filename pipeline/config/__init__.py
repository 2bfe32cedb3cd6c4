"""The run's configuration: one frozen tree, loaded once, every problem reported together.

    Config
    ├── rollout: RolloutConfig   when batches train, partial rollout, sampling, pacing, timeouts
    ├── data:    DataConfig      prompts, and the user functions (resolved here, at load)
    ├── engine:  EngineConfig    SGLang URLs, or how many built-in engines to start
    ├── storage: StorageConfig   where rollout state lives (memory | lmdb)
    ├── trainer: TrainerConfig   the built-in GRPO trainer's knobs
    └── output:  OutputConfig    run folder, metrics, logging

`load_config(argv)` reads an optional TOML file (`--config FILE.toml`; sections named like the
fields above, keys named like the dataclass fields), lets flags override it, fills the derived
defaults, checks every rule, imports every `module:function` path, and either returns a `Config`
or raises one `ConfigError` that lists every problem, each naming the flag, the value and the rule.
Flags reuse slime's names wherever slime has the concept, so launch scripts carry over.

The package's rooms: `schema` (the tree and its small sections), `rollout_section`,
`engine_section` and `trainer_section` (the large ones: dataclasses that only describe), `fields`
(how a field describes its setting), `parsing` (flags and TOML), `rules` (checks without side
effects), `load` (`load_config` and the one load step that reads files, imports torch and
plugins, and rewrites URLs).

Only the launcher sees this tree: components take plain parameters (torchtune's recipes vs
components), so nothing downstream re-reads flags or resolves plugins in the hot path.
Relative paths, in flags and in the TOML file alike, are relative to the working directory.
"""

from __future__ import annotations

from pipeline.config.engine_section import EngineConfig
from pipeline.config.load import load_config
from pipeline.config.parsing import build_parser
from pipeline.config.rollout_section import RolloutConfig
from pipeline.config.schema import (
    Config,
    DataConfig,
    OutputConfig,
    StorageConfig,
    config_to_dict,
    section_from_dict,
)
from pipeline.config.trainer_section import TrainerConfig

__all__ = [
    "Config",
    "DataConfig",
    "EngineConfig",
    "OutputConfig",
    "RolloutConfig",
    "StorageConfig",
    "TrainerConfig",
    "build_parser",
    "config_to_dict",
    "load_config",
    "section_from_dict",
]
