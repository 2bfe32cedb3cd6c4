"""The README's "Embedding" snippets, run as written (only the engine URL and the step count are
substituted), twice in one process on the same store: what a notebook user does. Real parts: the
LMDB store, real HTTP to the protocol-speaking fake engine."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pipeline.types import Batch, PromptTask, Sample
from storage import LmdbStore
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio

README = Path(__file__).resolve().parent.parent / "README.md"


def snippet(starts_with: str) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)]
    (found,) = [b for b in blocks if b.startswith(starts_with)]
    return found


class Trainer:
    """`my_trainer` of the snippets: trains nothing, saves an empty folder."""

    def __init__(self, root: Path) -> None:
        self.root, self.steps = root, 0

    def train_step(self, batch: Batch) -> dict[str, float]:
        self.steps += 1
        return {"loss": 0.0}

    def save_weights(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return path

    def train_and_save(self, batch: Batch) -> Path:
        self.train_step(batch)
        return self.save_weights(self.root / f"w{self.steps}-{id(batch)}")


def score(task: PromptTask, sample: Sample) -> float:
    return float(sample.response_len % 2)


async def run(code: str, url: str, steps: int, root: Path) -> Trainer:
    code = code.replace("http://127.0.0.1:30000", url).replace("100", str(steps)).replace("...", "0.0")
    source = "async def _snippet(tasks, score, my_trainer):\n" + textwrap.indent(code, "    ")
    namespace: dict[str, Any] = {}
    exec(compile(source, str(README), "exec"), namespace)
    trainer = Trainer(root)
    tasks = [PromptTask(index=i, prompt_ids=(5, 6, 7), label=i) for i in range(64)]
    await namespace["_snippet"](tasks, score, trainer)
    return trainer


@pytest.mark.parametrize("starts_with", ["from pipeline import AsyncStore", "from pathlib import Path"])
async def test_a_snippet_runs_twice_in_one_process_and_resumes(
    starts_with: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the snippets use relative paths ("state/", "weights")
    code = snippet(starts_with)
    async with FakeSGLang(weight_version="0") as fake:
        first = await run(code, fake.url, 2, tmp_path)
        second = await run(code, fake.url, 3, tmp_path)  # the store is free again, step 2 follows
    assert (first.steps, second.steps) == (2, 1)
    with LmdbStore(tmp_path / "state", readonly=True) as store:
        assert store.trained_step() == 2
