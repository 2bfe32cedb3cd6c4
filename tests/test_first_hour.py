"""Late or silent surprises a newcomer hit in the first hour (issue 33, item 4), each now found
when the config loads or said in one line, through `pipeline.run.cli.main` as a user runs it."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from core.errors import ConfigError
from pipeline.config import load_config
from pipeline.run.cli import main

REWARD = ("--custom-rm-path", "tests.test_launch:short_answer_reward")


def problems_of(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(argv)
    return caught.value.problems


def write_prompts(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_bad_line_of_the_prompt_file_is_a_config_error_before_anything_is_written(tmp_path, capsys):
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [json.dumps({"prompt": "say a:", "label": 1}), '{"prompt": "say b:", "label": 2', json.dumps([1, 2])],
    )
    out = tmp_path / "run"
    code = main(["--output-dir", str(out), "--prompt-data", str(prompts), *REWARD, "--rollout-batch-size", "2"])
    # Before: exit 1 after the model folder and an empty metrics.jsonl were written.
    assert code == 2
    err = capsys.readouterr().err
    assert "2 bad record(s): line 2: not JSON" in err and "line 3: a JSON list, not an object" in err
    assert not out.exists()


def test_prompts_with_characters_the_tiny_tokenizer_lacks_are_refused_by_name(tmp_path):
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [json.dumps({"prompt": p, "label": 1}) for p in ("say a:", "Say B:", "ok", "über:")],
    )
    [problem] = problems_of(["--prompt-data", str(prompts), *REWARD, "--rollout-batch-size", "4"])
    assert "line 2 'Say B:' has 'BS'" in problem and "line 4 'über:' has 'ü'" in problem
    assert "--hf-checkpoint" in problem and "line 1" not in problem


def test_a_batch_larger_than_the_dataset_is_said_when_the_config_loads(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [json.dumps({"prompt": f"say {c}:", "label": 1}) for c in "abc"])
    config = load_config(["--prompt-data", str(prompts), *REWARD, "--rollout-batch-size", "8"])
    [warning] = config.warnings
    assert "--rollout-batch-size=8 with --prompt-data=" in warning and "(3 prompts)" in warning
    assert "lower it to 3" in warning
    [warning] = load_config(["--num-prompts", "4"]).warnings  # the built-in task, batch 8
    assert "--rollout-batch-size=8 with --num-prompts=4" in warning


def test_several_engines_without_the_router_installed_fail_at_config_load(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang_router", None)  # what find_spec sees when it is not installed
    for flags in (["--rollout-num-engines", "2"], ["--sglang-url", "http://h:1", "--sglang-url", "http://h:2"]):
        [problem] = problems_of(flags)
        assert "sglang-router" in problem and "pip install 'rollout-pipeline[router]'" in problem
    load_config(["--rollout-num-engines", "1"])  # one engine needs no router


def test_an_offline_hub_id_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flags = ["--output-dir", str(tmp_path / "run"), "--no-progress"]
    code = main([*flags, "--hf-checkpoint", "nobody-here/no-such-model"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--hf-checkpoint='nobody-here/no-such-model': no such local folder" in err
    assert "Traceback" not in err and len(err.splitlines()) == 2  # the count line and the problem


def test_ray_producers_without_ray_installed_fail_at_config_load(monkeypatch):
    """Issue 45.7: before, the engines started, and 8 s later a traceback asked for a bug report."""
    monkeypatch.setitem(sys.modules, "ray", None)  # what find_spec sees when it is not installed
    [problem] = problems_of(["--rollout-producers", "ray"])
    assert "--rollout-producers='ray': Ray is not installed" in problem
    assert "pip install 'rollout-pipeline[ray]'" in problem and "--rollout-producers local" in problem


@pytest.fixture
def unreachable_hub(tmp_path, monkeypatch) -> str:
    """A Hub address nobody answers at (a closed loopback port), and an empty Hugging Face cache;
    offline mode (conftest's, so that no test reaches a real hub) off, since nothing answers."""
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return endpoint


def test_an_unreachable_hub_is_one_line_at_once(tmp_path, unreachable_hub, capsys):
    """Issue 45.8: a Hub id with no network took 51 s and 44 retry lines before its one clear line."""
    out = tmp_path / "run"
    code = main(["--output-dir", str(out), "--no-progress", "--hf-checkpoint", "nobody-here/no-such-model"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--hf-checkpoint='nobody-here/no-such-model': no such local folder, not in the Hugging Face cache" in err
    assert f"the Hub ({unreachable_hub}) cannot be reached" in err and "hf download nobody-here/no-such-model" in err
    assert "Retrying" not in err and len(err.splitlines()) == 2  # the count line and the problem
    assert not out.exists()


def test_an_unreachable_hub_loads_the_model_from_the_cache(tmp_path, unreachable_hub):
    from pipeline.run.hub import checkpoint_path
    from pipeline.tasks.tiny_model import make_model_folder

    repo = tmp_path / "hub-cache" / "models--someone--tiny"
    snapshot = make_model_folder(repo / "snapshots" / "0123abcd", seed=1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    assert checkpoint_path("someone/tiny") == snapshot  # the folder: nothing later asks the Hub either


@pytest.fixture
async def web_app() -> AsyncIterator[str]:
    """Not SGLang: a web app answering every path with its page (a notebook server, say)."""

    async def page(request: web.Request) -> web.Response:
        html = "<!DOCTYPE html><html><head><title>Home Page</title></head><body>" + "<p>x</p>" * 500
        return web.Response(text=html + "</body></html>", content_type="text/html", status=200)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.anyio
async def test_a_web_page_at_the_sglang_url_is_named_in_one_line(web_app, tmp_path, capsys):
    import anyio

    flags = ["--output-dir", str(tmp_path / "run"), "--sglang-url", web_app, "--no-progress", "--num-rollout", "1"]
    code = await anyio.to_thread.run_sync(main, flags)
    assert code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and web_app in err[0] and "'Home Page'" in err[0] and "SGLang" in err[0]
    assert "<p>" not in err[0]


# --- item 3: failures in the user's own code ---------------------------------------------------

_FLAKED: set[tuple[int, int]] = set()


def raising_reward(task, sample):
    """Raises on every sample whose response has an odd length (about half of them)."""
    if sample.response_len % 2:
        return {"scores": []}["answer"]  # a KeyError deep in the user's code
    return 1.0


def flaky_reward(task, sample):
    """Raises the first time each sample is scored (a service that times out now and then).

    Keyed by prompt row and sample index, not `id(sample)`: ids of freed samples are reused, and a
    new sample that got one never raised (the count came out one short, now and then)."""
    key = (task.index, sample.index)
    if key not in _FLAKED:
        _FLAKED.add(key)
        raise ConnectionError("reward service busy")
    return float(sample.response_len > 2)


SCORING = ("--no-progress", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4")


def test_the_first_traceback_of_a_users_reward_is_shown_in_full_once(tmp_path, capsys):
    code = main(
        ["--output-dir", str(tmp_path / "run"), *SCORING, "--custom-rm-path", "tests.test_first_hour:raising_reward"]
    )
    assert code in (0, 1)  # (1 when every group of the run happened to fail)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    # Before: only "reward: KeyError('answer')", with no line of the user's function.
    assert out.count("Traceback (most recent call last)") == 1
    assert 'in raising_reward\n    return {"scores": []}["answer"]' in out


def test_a_flaky_reward_is_retried_and_counted(tmp_path):
    out = tmp_path / "run"
    _FLAKED.clear()
    flags = [*SCORING, "--custom-rm-path", "tests.test_first_hour:flaky_reward", "--log-level", "warning"]
    assert main(["--output-dir", str(out), *flags, "--reward-max-retries", "1"]) == 0
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["groups/failed_total"] == 0 and record["reward/retries_total"] >= 8


def odd_prompts_raise(task, sample):
    """A bug that hits every prompt with an odd index."""
    if task.index % 2:
        raise RuntimeError("bug in the reward")
    return float(sample.response_len > 2)


def fixed_reward(task, sample):
    return float(sample.response_len > 2)


def test_failed_groups_are_named_on_resume_and_requeued_when_asked(tmp_path, capsys):
    from storage import GroupState, LmdbStore
    from storage.transitions import requeue_id

    out = tmp_path / "run"
    flags = ["--output-dir", str(out), "--no-progress", "--rollout-data-transport", "lmdb", "--num-prompts", "16"]
    flags += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"]
    assert main([*flags, "--num-rollout", "1", "--custom-rm-path", "tests.test_first_hour:odd_prompts_raise"]) == 0
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        failed = [g.group_id for g in store.groups(GroupState.FAILED)]
    assert failed
    capsys.readouterr()
    fixed = [*flags, "--custom-rm-path", "tests.test_first_hour:fixed_reward"]
    assert main([*fixed, "--num-rollout", "1"]) == 0  # nothing to train: the resume only looks
    said = capsys.readouterr()
    assert "failed groups of earlier runs" in said.out + said.err and "--requeue-failed-groups" in said.out + said.err
    assert main([*fixed, "--num-rollout", "3", "--requeue-failed-groups"]) == 0
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        for gid in failed:
            assert store.get(gid)[0] is GroupState.FAILED  # kept, counted
            assert store.get(requeue_id(gid)) is not None  # and its prompt generated again


_AGENT_FLAKED: set[tuple[int, int]] = set()


async def flaky_agent(ctx, sample):
    """One model turn, then (the first time for each sample) a tool that raises. Keyed by prompt row
    and sample index: ids of freed samples are reused (see `flaky_reward`)."""
    await ctx.generate(max_new_tokens=4)
    key = (ctx.group.task.index, sample.index)
    if key not in _AGENT_FLAKED:
        _AGENT_FLAKED.add(key)
        raise ConnectionError("tool server busy")


def test_an_agent_that_raised_is_run_again_from_where_its_sample_stood(tmp_path):
    from storage import LmdbStore

    out = tmp_path / "run"
    _AGENT_FLAKED.clear()
    flags = ["--output-dir", str(out), *SCORING, "--log-level", "warning", "--rollout-data-transport", "lmdb"]
    flags += ["--custom-generate-function-path", "tests.test_first_hour:flaky_agent"]
    flags += ["--rollout-max-response-len", "16"]
    assert main([*flags, "--agent-max-retries", "1"]) == 0
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["groups/failed_total"] == 0 and record["agent/retries_total"] >= 8
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        samples = [s for g in store.batch(0).groups for s in g.samples]
    assert samples and all(s.response_len <= 4 for s in samples)  # the failed attempt's turn dropped
