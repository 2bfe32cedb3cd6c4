"""Every seam declared (issue 51): the pipeline reaches its trainer, engines and store only through
the members their protocols name (`pipeline.plan`, `storage.protocol`), and an optional feature is a
declared capability checked with `isinstance`, never an attribute probed by name. A new
`getattr`/`hasattr` in pipeline/, stages/, storage/ or launch/ fails here until it is either made a
declared member or added below with the reason it is not a seam."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from pipeline.plan import (
    BuiltInTrainer,
    Closable,
    Engines,
    HasWeightVersions,
    ReplaysSettings,
    ReportsFaults,
    ReportsLoads,
    RolloutFields,
    RolloutParts,
    SavesModel,
)

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("pipeline", "stages", "storage", "launch")

# (file, attribute): the attribute is the string probed, or the expression naming it when it is not
# a literal. None of these reaches a trainer, an engine or a store.
ALLOWED: dict[tuple[str, str], str] = {
    # The standard library's platform constants (mmap.MADV_RANDOM exists on Linux and macOS only).
    ("storage/lmdb_pages.py", "MADV_RANDOM"): "mmap's madvise constant, absent where the platform lacks it",
    # A frozen dataclass's own fields, walked by name.
    ("pipeline/config/schema.py", "section"): "the config tree's sections",
    ("pipeline/config/schema.py", "f.name"): "a config section's fields",
    ("pipeline/plan.py", "name"): "RolloutPlan's enum fields, converted in __post_init__",
    ("pipeline/trainer_settings.py", "f.name"): "StepSettings' fields",
    ("pipeline/run/resume_settings.py", "name"): "RunMeta's fields",
    ("stages/sglang_client/payloads.py", "name"): "TokenPayloads' fields",
    ("stages/sglang_client/health.py", "name"): "HealthCheck's fields",
    ("storage/codec.py", "name"): "the codec header's fields",
    # Third-party objects, whose attributes vary by version.
    ("pipeline/tasks/jsonl.py", "chat_template"): "a transformers tokenizer",
    ("pipeline/metric_sinks.py", "all_writers"): "tensorboard's SummaryWriter internals",
    ("pipeline/metric_sinks.py", "event_writer"): "tensorboard's SummaryWriter internals",
    ("pipeline/metric_sinks.py", "_worker"): "tensorboard's SummaryWriter internals",
    ("pipeline/metric_sinks.py", "_ev_writer"): "tensorboard's SummaryWriter internals",
    ("pipeline/metric_sinks.py", "_closed"): "tensorboard's SummaryWriter internals",
    ("pipeline/run/end.py", "filename"): "any exception that names a file (OSError and kin)",
    ("launch/ray_producers.py", "method"): "a Ray actor handle's remote method, by the name called",
    # Names resolved from the user's text or for display.
    ("stages/plugins.py", "part"): "a `module:attr.path` plugin resolved once at start",
    ("stages/agent.py", "__module__"): "an agent's name, for messages",
    ("stages/agent.py", "__qualname__"): "an agent's name, for messages",
    # Left for their own change (not the trainer, engines or store): a user filter's verdict may
    # carry a `reason`; the eval progress bar may have a `close`.
    ("stages/filter.py", "reason"): "a user filter's verdict object (keep, optional reason)",
}


def _probes(root: Path) -> list[tuple[str, str, int]]:
    """Every `getattr`/`hasattr` call under the scanned rooms: (file, attribute, line)."""
    found = []
    for room in SCANNED:
        for path in sorted((root / room).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2
                ):
                    name = node.args[1]
                    attr = name.value if isinstance(name, ast.Constant) else ast.unparse(name)
                    found.append((rel, str(attr), node.lineno))
    return found


def test_no_undeclared_attribute_probe() -> None:
    probes = _probes(ROOT)
    new = [f"{file}:{line} probes {attr!r}" for file, attr, line in probes if (file, attr) not in ALLOWED]
    assert not new, (
        "an attribute probed by name where a seam should declare it: make it a member of the protocol "
        "(pipeline.plan, storage.protocol) or a runtime_checkable capability checked with isinstance; "
        "if it is no seam (a dataclass's fields, a third-party object), add it to ALLOWED with why:\n" + "\n".join(new)
    )
    seen = {(file, attr) for file, attr, _ in probes}
    assert not set(ALLOWED) - seen, f"ALLOWED names probes that are gone: {sorted(set(ALLOWED) - seen)}"


def test_the_scan_finds_a_new_probe(tmp_path: Path) -> None:
    """The scan is not vacuous: a probe of a trainer's optional method is caught, with its line."""
    (tmp_path / "pipeline").mkdir()
    for room in SCANNED[1:]:
        (tmp_path / room).mkdir()
    (tmp_path / "pipeline" / "loop.py").write_text(
        "def run(trainer):\n    if hasattr(trainer, 'warm_up'):\n        trainer.warm_up()\n"
    )
    assert _probes(tmp_path) == [("pipeline/loop.py", "warm_up", 2)]


def test_rollout_fields_and_parts_name_the_same_parts() -> None:
    """`Rollout(plan, engines=..., ...)` and `run_pipeline` take `RolloutFields`, which become one
    `RolloutParts`: the two must list the same names, with the same types, the same ones required."""
    # As written (pipeline.plan postpones annotations, so NotRequired is in the text, not the keys).
    fields = {name: ref.__forward_arg__ for name, ref in RolloutFields.__annotations__.items()}
    parts = {
        f.name: f.type if f.default is dataclasses.MISSING else f"NotRequired[{f.type}]"
        for f in dataclasses.fields(RolloutParts)
    }
    assert fields == parts


class _UsersTrainer:
    """A trainer of the user's, with only what `Trainer` asks (`docs/agents-and-embedding.md`)."""

    def train_step(self, batch: object) -> dict[str, float]:
        return {}

    def save_weights(self, path: Path) -> Path:
        return path


class _FullTrainer(_UsersTrainer):
    step_settings = None

    def save_model(self, path: Path) -> Path:
        return path

    def use_settings(self, settings: object) -> None: ...

    def close(self) -> None: ...


class _FullEngines:
    def fault_metrics(self) -> dict[str, float]:
        return {}

    async def weight_versions(self) -> dict[str, str]:
        return {}

    async def loads(self) -> dict[str, object]:
        return {}


CAPABILITIES = (SavesModel, ReplaysSettings, Closable, ReportsFaults, HasWeightVersions, ReportsLoads)


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: c.__name__)
def test_a_capability_is_had_only_by_what_declares_its_members(capability: type) -> None:
    """The seam's own members are no capability; each capability is recognised by its members
    alone (a user's object needs no base class)."""
    full = _FullEngines() if capability in (ReportsFaults, HasWeightVersions, ReportsLoads) else _FullTrainer()
    assert isinstance(full, capability)
    assert not isinstance(_UsersTrainer(), capability)


def test_the_built_in_backends_and_the_fleet_have_every_capability() -> None:
    """What the launcher and the step record rely on. mypy checks both backends against
    `BuiltInTrainer` where the launcher builds them; the engines' capabilities are optional to
    mypy, so a renamed one would silently drop a step record's keys: named here."""
    from stages.sglang_client import EngineFleet
    from trainers.grpo import GRPOTrainer

    # (MegatronTrainer too, by mypy: importing megatron here would cost the suite seconds.)
    members = {"train_step", "save_weights", "save_model", "step_settings", "use_settings", "close", "hf_weights"}
    assert not members - set(dir(GRPOTrainer))
    assert not {"fault_metrics", "weight_versions", "loads"} - set(dir(EngineFleet))
    assert issubclass(BuiltInTrainer, SavesModel | ReplaysSettings | Closable)
    assert not typing.get_type_hints(Engines)  # the engine seam is its methods (test_public_api)


def test_parts_given_both_ways_are_refused_naming_the_keywords() -> None:
    """`Rollout` has one constructor: the parts as keywords or as one `RolloutParts`, not both."""
    from pipeline import MemoryStore, Rollout, RolloutMode, RolloutPlan
    from storage import AsyncStore

    store = AsyncStore(MemoryStore())
    parts = RolloutParts(engines=typing.cast(Engines, None), store=store, dataset=[], reward_fn=lambda *_: 0.0)
    plan = RolloutPlan(RolloutMode.SYNC, batch_size=1, n_samples=1, num_steps=1)
    with pytest.raises(TypeError, match=r"parts given twice.*\['dataset', 'store'\]"):
        Rollout(plan, parts, store=store, dataset=[])  # type: ignore[call-overload]
