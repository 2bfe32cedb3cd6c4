"""Which settings a step ran with, read back from the store's record of settings.

The store keeps the settings in force (`RunMeta.extra["config"]`, a `config_to_dict` tree) and
every change a resume accepted, with the first step trained with the new value
(`extra["config_changes"]`; `pipeline.run.resume_settings` writes both). Undoing, newest first,
the changes that took effect after a step gives the settings that step ran with: what a resumed
run trains a stored batch again with (`pipeline.checkpoints`), and what `replay train` feeds each
step (`pipeline.replay`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["changes_after", "settings_at"]

SettingChange = dict[str, Any]  # {"step": int, "setting": "section.name", "from": old, "to": new}


def settings_at(extra: Mapping[str, Any], step: int) -> dict[str, dict[str, Any]] | None:
    """The `config_to_dict` tree step `step` was trained with; None when the store records no
    settings (a store written before they were recorded, or by a user's own loop)."""
    now = extra.get("config")
    if not isinstance(now, Mapping):
        return None
    tree = {section: dict(part) for section, part in now.items() if isinstance(part, Mapping)}
    for change in reversed(changes_after(extra, step)):
        section, name = str(change["setting"]).split(".", 1)
        part = tree.setdefault(section, {})
        if change["from"] is None:
            # None is also how a change records a setting the store's writer did not have yet:
            # left out, the schema's default applies (`section_from_dict`), as it did for that writer.
            part.pop(name, None)
        else:
            part[name] = change["from"]
    return tree


def changes_after(extra: Mapping[str, Any], step: int) -> list[SettingChange]:
    """The recorded changes that took effect after step `step` (so that step ran with their "from"),
    in the order they were recorded."""
    changes = extra.get("config_changes") or ()
    return [dict(c) for c in changes if isinstance(c, Mapping) and int(c.get("step", -1)) > step]
