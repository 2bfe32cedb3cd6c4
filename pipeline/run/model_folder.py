"""The model a run starts from: `--hf-checkpoint` (a folder or a Hub id), or the run folder's tiny model.

The tiny model is built once per run folder, by its first run. It is built where no run is (a
temporary folder, `TMPDIR`), read from there until the run owns its folder, then copied in under
a hidden name and renamed to `model/` whole (`StartingModel.install`). So a refused start writes
no model into another run's folder, and a full disk or a kill never leaves a half-built `model/`
that every later start trips on: before, one start on a full disk left `model/config.json`
without weights or tokenizer, and each start after it failed on it. A `model/` left unfinished
that way by an earlier version is moved aside (never deleted: it may be a folder of the user's)
and built again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from core.errors import ConfigError
from pipeline.config import Config
from pipeline.run.end import WriteError
from pipeline.run.hub import checkpoint_path

__all__ = ["StartingModel", "starting_model"]

log = structlog.get_logger("launch")

MODEL_DIR = "model"
_BUILDING = "building the tiny model"


@dataclass
class StartingModel:
    path: Path  # the model every engine and the trainer start from, once installed
    source: Path  # where its files can be read now: the staged build, or `path`
    staged: Path | None = None  # a build to move into `path` once the run owns its folder

    def install(self) -> Path:
        """Move the staged build into the run folder (the run owns it now); `path`.

        Raises WriteError naming the model folder when the disk refuses it; nothing half-made stays."""
        if self.staged is None:
            return self.path
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            for left in self.path.parent.glob(f".{self.path.name}.tmp-*"):  # a start killed while copying
                shutil.rmtree(left, ignore_errors=True)
            shutil.copytree(self.staged, tmp)
            if self.path.exists() or self.path.is_symlink():
                _move_aside(self.path)
            os.rename(tmp, self.path)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WriteError("writing the model folder", self.path) from exc
        self.discard()
        self.source = self.path
        return self.path

    def discard(self) -> None:
        """Remove the staged build (installed, or the start failed)."""
        staged, self.staged = self.staged, None
        if staged is not None:
            shutil.rmtree(staged.parent, ignore_errors=True)


def starting_model(config: Config, out: Path) -> StartingModel:
    """The model this run starts from; writes nothing into `out` (a tiny model not built yet is
    built in a temporary folder: `StartingModel.install` moves it in).

    Raises ConfigError for a Hub id that cannot be had or a tiny model of another shape, and
    WriteError when the temporary folder cannot be written."""
    from pipeline.tasks.tiny_model import built_shape_problem

    e = config.engine
    if e.hf_checkpoint:
        path = checkpoint_path(e.hf_checkpoint)
        return StartingModel(path, path)
    model = out / MODEL_DIR
    if _finished(model):
        problem = built_shape_problem(model, num_experts=e.num_experts, moe_router_topk=config.rollout.moe_router_topk)
        if problem is not None:
            raise ConfigError([problem])
        return StartingModel(model, model)
    staged = _build(config)
    return StartingModel(model, staged, staged)


def _build(config: Config) -> Path:
    from pipeline.tasks.tiny_model import make_model_folder

    e = config.engine
    root = None
    try:
        root = Path(tempfile.mkdtemp(prefix="pipeline-model-"))
        staged = root / MODEL_DIR
        if e.num_experts is None:
            make_model_folder(staged, seed=config.rollout.seed)
        else:  # the tiny Qwen3-MoE (R3 has routes to replay)
            make_model_folder(
                staged,
                seed=config.rollout.seed,
                arch="moe",
                num_experts=e.num_experts,
                moe_router_topk=config.rollout.moe_router_topk or 2,
            )
    except Exception as exc:  # a full or read-only temporary disk (safetensors wraps the OSError)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        where = root or Path(tempfile.gettempdir())
        raise WriteError(_BUILDING, where, room="point TMPDIR at a folder with room") from exc
    return staged


def _finished(model: Path) -> bool:
    """A model folder with its config, weights and tokenizer (what a build that ran to its end
    leaves); one that exists without them is unfinished: installing a build moves it aside."""
    if not (model / "config.json").is_file():
        return False
    weights = any(model.glob("*.safetensors")) or any(model.glob("*.bin"))
    tokenizer = any((model / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    return weights and tokenizer


def _move_aside(model: Path) -> None:
    if model.is_dir() and not model.is_symlink() and not any(model.iterdir()):
        model.rmdir()
        return
    aside = model.with_name(f"{model.name}.unfinished-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    os.rename(model, aside)
    log.warning(
        "the run folder's model folder was unfinished (a start stopped while building it): moved aside, "
        "and a fresh build takes its place",
        moved_to=str(aside),
    )
