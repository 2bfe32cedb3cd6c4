"""The docs' "Embedding" code (docs/agents-and-embedding.md; the README's before the docs moved to
docs/) runs as written: every block is part of `examples/embedding.py`,
and that file runs, with relative paths, against an engine the user started in another folder
(a real built-in engine process over HTTP, a real LMDB store), then resumes."""

from __future__ import annotations

import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from launch.builtin_engine import EngineProcess, start_engine
from pipeline.tasks.tiny_model import make_model_folder
from stages.sglang_client.engine_client import folder_for_engine
from stages.sglang_client.wire import error_text
from storage import LmdbStore
from tests.conftest import run_python_module
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "agents-and-embedding.md"
EXAMPLE = ROOT / "examples" / "embedding.py"


def embedding_blocks() -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## Embedding") :]  # the page's last section
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_every_embedding_block_of_the_docs_is_part_of_the_example_file() -> None:
    blocks, source = embedding_blocks(), EXAMPLE.read_text(encoding="utf-8")
    assert len(blocks) >= 2
    for block in blocks:
        # Split at blank lines: the page may leave out what lies between two definitions.
        for part in filter(str.strip, block.split("\n\n")):
            assert part.strip("\n") in source, f"{PAGE.name} block not in {EXAMPLE.name}:\n{part}"


@pytest.fixture
async def engine_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[EngineProcess, Path]]:
    """A built-in engine process whose working directory is not the user's."""
    model = make_model_folder(tmp_path / "model", seed=0)
    (tmp_path / "engine-cwd").mkdir()
    monkeypatch.chdir(tmp_path / "engine-cwd")  # the child inherits it
    engine = await start_engine(model, log_path=tmp_path / "engine.log")
    try:
        yield engine, model
    finally:
        await engine.stop(timeout=10.0)


def run_example(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_python_module("examples.embedding", *args, cwd=cwd)


async def test_the_example_runs_with_relative_paths_against_an_engine_started_elsewhere_and_resumes(
    engine_elsewhere: tuple[EngineProcess, Path], tmp_path: Path
) -> None:
    engine, model = engine_elsewhere
    user = tmp_path / "user"
    user.mkdir()
    flags = ("--engine-url", engine.url, "--model", str(model), "--state", "state")
    first = run_example(user, *flags, "--steps", "2")
    # Before: "cannot load weights from 'state/weights/v1': the folder does not exist" at the first
    # publish (the engine looked in its own working directory), after step 0 was committed.
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "now serving v2" in first.stdout
    second = run_example(user, *flags, "--steps", "3", "--run-pipeline")  # the built-in loop resumes it
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "trained 1 steps" in second.stdout
    with LmdbStore(user / "state" / "rollout_data", readonly=True) as store:
        assert store.trained_step() == 2
    assert not (tmp_path / "engine-cwd" / "state").exists()


async def test_a_relative_weights_folder_reaches_the_engine_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.sglang_client import EngineFleet

    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights" / "v1").mkdir(parents=True)
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url]) as fleet:
        await fleet.update_weights_from_disk("weights/v1", weight_version="1")
    assert fake.loaded_paths == [str(tmp_path / "weights" / "v1")]
    # A path that names no local folder (a Hub id, a folder only the engine's host has) is left alone.
    assert folder_for_engine("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_an_html_page_is_named_not_dumped() -> None:
    page = b"<!DOCTYPE html>\n<html><head><title>Jupyter Server</title></head><body>" + b"x" * 5000 + b"</body></html>"
    said = error_text(page)
    assert "'Jupyter Server'" in said and "SGLang" in said and len(said) < 200
