"""Starting real SGLang servers: detection, devices, command line, API key, router, stop.

SGLang cannot be installed on the CPU machines, so a stand-in package (tests/fakes/sglang_standin:
`python -m sglang.launch_server` with SGLang's flags, served by the built-in engine, enforcing
`--api-key` as SGLang does) takes its place. Everything else is real: processes, HTTP, the router.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import aiohttp
import pytest

from core.errors import ConfigError
from launch.sglang_server import engine_devices, sglang_command_args, start_sglang_servers
from pipeline.config import EngineConfig, load_config
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import encode
from stages.sglang_client import EngineFleet
from tests.conftest import run_python_module

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "fakes" / "sglang_standin"


def test_missing_sglang_is_an_error_naming_the_flag():
    with pytest.raises(ConfigError, match=r"--rollout-engine=sglang: SGLang is not installed"):
        load_config(["--rollout-engine", "sglang"])


def test_devices_split_into_engines_in_order_and_bad_splits_are_named(monkeypatch):
    assert engine_devices("4,5,6,7", engines=2, per_engine=2) == [["4", "5"], ["6", "7"]]
    assert engine_devices(None, engines=3, per_engine=1) == [["0"], ["1"], ["2"]]
    assert sglang_command_args(per_engine=2, mem_fraction=0.7, api_key="k", seed=1) == [
        "--tp-size",
        "2",
        "--random-seed",
        "1",
        "--mem-fraction-static",
        "0.7",
        "--api-key",
        "k",
    ]
    # R3: real SGLang answers return_routed_experts only when started with its flag.
    r3 = sglang_command_args(per_engine=1, mem_fraction=None, api_key=None, seed=0, routed_experts=True)
    assert "--enable-return-routed-experts" in r3
    monkeypatch.syspath_prepend(str(STANDIN))  # "installed"
    config = load_config(
        ["--rollout-engine", "sglang", "--sglang-devices", "0,1,2,3", "--rollout-num-gpus-per-engine", "2"]
    )
    assert config.engine.num_engines == 2
    with pytest.raises(ConfigError) as err:
        load_config(
            [
                "--rollout-engine",
                "sglang",
                "--sglang-devices",
                "0,1,2",
                "--rollout-num-gpus-per-engine",
                "2",
                "--sglang-mem-fraction-static",
                "1.5",
                "--sglang-url",
                "http://127.0.0.1:1",
            ]
        )
    text = str(err.value)
    assert "--sglang-devices='0,1,2': 3 GPUs do not split into engines of --rollout-num-gpus-per-engine=2" in text
    assert "--sglang-mem-fraction-static=1.5: must be in (0, 1)" in text
    assert "--rollout-engine=sglang with --sglang-url" in text


@pytest.mark.anyio
async def test_started_servers_get_their_devices_and_require_the_api_key(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.setenv("PYTHONPATH", str(STANDIN))  # the servers' Python finds the stand-in too
    model = make_model_folder(tmp_path / "model")
    engine = EngineConfig(
        launcher="sglang",
        sglang_devices="3",
        num_engines=1,
        sglang_server_concurrency=4,
        sglang_mem_fraction_static=0.5,
        api_key="s3cret",
        sglang_startup_timeout=120.0,
    )
    [server] = await start_sglang_servers(model, engine=engine, log_dir=tmp_path / "logs")
    async with server:
        log = server.log_tail()
        assert "tp_size=1 mem_fraction_static=0.5 api_key=set CUDA_VISIBLE_DEVICES=3 HIP_VISIBLE_DEVICES=3" in log
        async with aiohttp.ClientSession() as session:  # no key: refused, as SGLang refuses it
            async with session.post(server.url + "/generate", json={"input_ids": [2, 3]}) as resp:
                assert resp.status == 401
        async with EngineFleet([server.url], concurrency=2, api_key="s3cret") as fleet:
            result = await fleet.generate(list(encode("say a x2:")), {"max_new_tokens": 4}, rid="r0")
            assert 0 < len(result.token_ids) <= 4
    assert server.returncode is not None  # stopped with the block


@pytest.mark.slow
def test_a_run_starts_two_sglang_servers_behind_the_router_with_the_key(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STANDIN), str(ROOT)])}
    done = run_python_module(
        "pipeline.launch",
        "--output-dir",
        str(out),
        "--no-progress",
        "--log-level",
        "warning",
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "4",
        "--rollout-engine",
        "sglang",
        "--sglang-devices",
        "0,1",
        "--api-key",
        "s3cret",
        # R3 on the MoE toy: the servers are started with SGLang's flag for it, and since the
        # router (0.3.2) drops the routes' fields, R3 requests go to them directly, key and all.
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--use-rollout-routing-replay",
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [0, 1]
    for i in (0, 1):
        assert f"CUDA_VISIBLE_DEVICES={i} " in (out / "logs" / f"sglang-{i}.log").read_text()
        assert "api_key=set" in (out / "logs" / f"sglang-{i}.log").read_text()
        assert "enable_return_routed_experts=True" in (out / "logs" / f"sglang-{i}.log").read_text()
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-5  # the routes were replayed
    # Both servers refuse requests without the key, so every generation that trained went through
    # the router with it.
