"""The resolved config as TOML (`python -m pipeline.launch ... --print-config`).

Every setting with its derived default filled in, keyed by its flag's name, so that the output is a
`--config` file that reproduces the run (`config.json` in the run folder holds the same settings).
"""

from __future__ import annotations

import json

from pipeline.config.fields import options
from pipeline.config.schema import SECTIONS, Config, config_to_dict

__all__ = ["config_to_toml"]


def config_to_toml(config: Config) -> str:
    values = config_to_dict(config)
    lines: list[str] = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        for f, opt in options(cls):
            value = values[section][f.name]
            key = opt.flag[2:]
            # TOML has no null: an unset setting is shown commented out, with what it means.
            if value is None:
                lines.append(f"# {key} = (unset: {opt.default_help or 'none'})")
            else:
                lines.append(f"{key} = {json.dumps(value)}")  # JSON strings, numbers, lists are TOML
        lines.append("")
    return "\n".join(lines)
