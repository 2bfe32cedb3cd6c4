"""Before the first request, every engine serves the run's starting weights at the clock's version:
engines this run started on them are left alone; any other engine is loaded, never relabelled
(issue 45.1: a reused engine at v3 was renamed v0 and step 0 trained on another run's samples)."""

import json
from pathlib import Path

import pytest
from anyio.from_thread import start_blocking_portal

from core.errors import EngineError
from engines.builtin import open_server
from pipeline.run.cli import main
from pipeline.run.run_engines import load_starting_weights
from pipeline.tasks.tiny_model import make_model_folder
from stages.sglang_client import EngineFleet
from tests.fakes import FakeSGLang

SMALL = ("--no-progress", "--log-level", "warning", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4")
SMALL += ("--rollout-max-response-len", "16", "--num-prompts", "16")


@pytest.mark.anyio
async def test_an_engine_the_run_did_not_start_is_loaded_whatever_version_it_reports():
    # "default": a fresh SGLang, whatever --model-path it was given; "0": the start version, but of
    # whose weights nobody knows (another run's that never published, say); "3": a reused engine.
    for reported in ("default", "0", "3"):
        async with FakeSGLang(weight_version=reported) as fake, EngineFleet([fake.url], concurrency=2) as fleet:
            await load_starting_weights(fleet, version=0, weights=Path("/models/base"))
            assert fake.loaded_paths == ["/models/base"] and fake.weight_version == "0", reported
            assert fake.calls["/update_weight_version"] == 0  # never a new label on old weights


@pytest.mark.anyio
async def test_engines_started_on_the_weights_are_left_alone_unless_they_report_another_version():
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=2) as fleet:
        await load_starting_weights(fleet, version=0, weights=Path("/models/base"), started_on_them=True)
        assert fake.loaded_paths == []  # the launcher's own engines: nothing sent, no reload
        fake.weight_version = "2"
        await load_starting_weights(fleet, version=0, weights=Path("/models/base"), started_on_them=True)
        assert fake.loaded_paths == ["/models/base"] and fake.weight_version == "0"


@pytest.mark.anyio
async def test_an_engine_that_cannot_load_the_weights_is_named_with_its_version_and_the_fix():
    async with FakeSGLang(weight_version="3") as fake, EngineFleet([fake.url], concurrency=2, max_retries=0) as fleet:
        fake.weight_update_error = "No such file or directory: /models/base"
        with pytest.raises(EngineError) as err:
            await load_starting_weights(fleet, version=0, weights=Path("/models/base"))
        said = str(err.value)
        assert fake.url in said and "reports weight_version '3'" in said and "/models/base" in said
        assert "readable at that path where the engine runs" in said
        assert fake.weight_version == "3" and fake.calls["/update_weight_version"] == 0


def test_a_reused_engine_serves_the_runs_own_weights_at_step_0(tmp_path):
    """Two runs, one after the other, against one built-in engine the user started (real HTTP).
    The first leaves the engine at v1 on its own trained weights; the second must sample step 0
    from the base model it trains from: its trainer's log-probs then match the engine's (float
    noise, ~1e-7). Before, the second run relabelled the engine v0 and step 0 trained on samples
    of the first run's weights (the difference was 0.3 after three steps of that run)."""
    model = make_model_folder(tmp_path / "base", seed=3)
    flags = (*SMALL, "--hf-checkpoint", str(model), "--num-rollout", "1", "--lr", "1e-3")
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(open_server(model, port=0, weight_version="0")) as server,
    ):
        assert main(["--output-dir", str(tmp_path / "first"), "--sglang-url", server.url, *flags]) == 0
        assert main(["--output-dir", str(tmp_path / "second"), "--sglang-url", server.url, *flags]) == 0
    for run in ("first", "second"):
        [step0] = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert step0["train/train_rollout_logprob_abs_diff"] < 1e-4, (run, step0)
