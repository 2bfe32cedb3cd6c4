"""Colocated on one GPU (issue 47), on a GPU (opt in: `pytest -m gpu`; needs torch-memory-saver).

This process is the trainer; the built-in engine is a subprocess started with `--enable-memory-saver`
on the same GPU, as `--colocate` starts it. Memory is measured from outside the engine, with
`torch.cuda.mem_get_info` (the whole device) in this process.

- an IPC publish makes the engine's weights equal the trainer's, bit for bit;
- a release frees the engine's weights, KV cache and graphs; a resume takes them back; generation
  in between is refused with the reason, and after the resume and the publish it gives the tokens
  it gave before (the CUDA graphs captured before the release replay unchanged);
- a publish into released weights, and a pickle that is not a bucket, are refused (400) and
  change nothing;
- a trainer that died holding the IPC handles: the engine's update fails with a clear message and
  the engine takes the next publish;
- an engine that dies between release and resume: the publish fails naming it and what is kept;
- a `--colocate` run of the quick start to its end, released after every round.
"""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from pipeline.tasks.tiny_model import make_model_folder

pytestmark = [pytest.mark.gpu]

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
PROMPT = [5, 6, 7, 8, 9]


def _ready() -> None:
    import importlib.util

    import torch

    assert torch.cuda.is_available(), "torch sees no GPU"
    assert importlib.util.find_spec("torch_memory_saver"), "pip install torch-memory-saver (benchmarks/gpu_wheels.sh)"


def _used() -> int:
    """Bytes in use on the device, whoever holds them (this process and the engine)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


@asynccontextmanager
async def _engine(folder: Path, *extra: str) -> AsyncIterator[Any]:
    from launch.builtin_engine import start_engine

    args = ["--device", "cuda", "--dtype", "bfloat16", "--enable-memory-saver", "--max-running-requests", "8", *extra]
    async with await start_engine(folder, startup_timeout=300, extra_args=args) as engine:
        yield engine


async def _post(http: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        raw = await resp.read()
        try:
            return resp.status, orjson.loads(raw) if raw.strip() else None
        except orjson.JSONDecodeError:
            return resp.status, raw.decode()


async def _greedy(http: aiohttp.ClientSession, url: str, n: int = 24) -> tuple[int, Any]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    status, out = await _post(http, url + "/generate", body)
    return status, out["output_ids"] if status == 200 else out


def _trainer_model(folder: Path, seed: int) -> Any:
    """The trainer's copy: fp32 masters on the GPU, moved off the engine's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, device="cuda", generator=g) * 1e-2)
    return model


def _colocated(fleet: Any, model: Any, **kw: Any) -> Any:
    import torch

    from stages.sglang_client.publish_tensor import ColocatedWeights

    return ColocatedWeights(model.named_parameters, fleet, device="cuda", send_dtype=torch.bfloat16, **kw)


def test_an_ipc_publish_leaves_the_engines_weights_equal_to_the_trainers_bit_for_bit(tmp_path: Path) -> None:
    _ready()
    folder = make_model_folder(tmp_path / "m", hidden_size=256, num_layers=4, num_heads=8, seed=0)
    anyio.run(_bit_exact, folder)


async def _bit_exact(folder: Path) -> None:
    import torch

    from core.clock import VersionClock
    from core.types import PauseMode
    from stages.publisher import publish_weights
    from stages.sglang_client import EngineFleet

    model = _trainer_model(folder, seed=1)
    async with _engine(folder) as engine, EngineFleet([engine.url]) as fleet, aiohttp.ClientSession() as http:
        colocated = _colocated(fleet, model, bucket_bytes=256 * 1024)  # several buckets
        await colocated.release()
        clock = VersionClock()
        await publish_weights(clock, fleet, folder, pause_mode=PauseMode.ABORT, transfer=colocated)
        assert colocated.buckets_sent > 1 and clock.version == 1
        mismatched = []
        for name, p in model.named_parameters():
            status, values = await _post(
                http, engine.url + "/get_weights_by_name", {"name": name, "truncate_size": p.numel()}
            )
            assert status == 200, values
            got = torch.tensor(values, dtype=torch.float64)
            want = p.detach().to(torch.bfloat16).flatten().double().cpu()
            if not torch.equal(got, want):
                mismatched.append(name)
        assert not mismatched, f"{len(mismatched)} tensors differ after the IPC publish: {mismatched[:4]}"
        status, _ = await _greedy(http, engine.url)
        assert status == 200


def test_release_gives_the_memory_back_and_resume_takes_it_again_with_the_graphs_intact(tmp_path: Path) -> None:
    _ready()
    # Large enough that the memory moved is far beyond the device's noise: a slot cache of 64 slots
    # of up to 32k positions, capped at a fifth of the GPU.
    folder = make_model_folder(tmp_path / "m", hidden_size=512, num_layers=8, num_heads=8, seed=0, max_positions=32768)
    anyio.run(_release_resume, folder)


async def _release_resume(folder: Path) -> None:
    from core.clock import VersionClock
    from core.types import PauseMode
    from stages.publisher import publish_weights
    from stages.sglang_client import EngineFleet

    async with (
        _engine(folder, "--mem-fraction-static", "0.2", "--max-running-requests", "64") as engine,
        EngineFleet([engine.url]) as fleet,
        aiohttp.ClientSession() as http,
    ):
        status, before = await _greedy(http, engine.url)
        assert status == 200
        info = await (await http.get(engine.url + "/server_info")).json()
        kv = int(info["kv_cache_bytes"])
        assert info["enable_memory_saver"] and kv > 4 * GIB, info
        resident = _used()
        assert (await _post(http, engine.url + "/release_memory_occupation", {}))[0] == 200
        released = _used()
        gone = (resident - released) / GIB
        print(f"engine resident {resident / GIB:.2f} GiB, released {gone:.2f} GiB (KV {kv / GIB:.2f})")
        assert resident - released >= 0.95 * kv, (resident, released, kv)
        status, body = await _greedy(http, engine.url)
        assert status == 503 and "released" in body["error"]["message"]
        # Resumed weights hold nothing until a publish: refused until it comes.
        assert (await _post(http, engine.url + "/resume_memory_occupation", {"tags": ["weights"]}))[0] == 200
        rest = {"tags": ["kv_cache", "cuda_graph"]}
        assert (await _post(http, engine.url + "/resume_memory_occupation", rest))[0] == 200
        assert _used() - released >= 0.95 * kv
        status, body = await _greedy(http, engine.url)
        assert status == 503 and "without a CPU backup" in body["error"]["message"]
        # The same weights again, by disk: the graphs captured before the release must give the same tokens.
        await publish_weights(VersionClock(), fleet, folder, pause_mode=PauseMode.ABORT)
        status, after = await _greedy(http, engine.url)
        assert status == 200 and after == before


def test_refused_publishes_change_nothing(tmp_path: Path) -> None:
    _ready()
    folder = make_model_folder(tmp_path / "m", hidden_size=256, num_layers=2, num_heads=8, seed=0)
    anyio.run(_refusals, folder, tmp_path)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


async def _refusals(folder: Path, tmp_path: Path) -> None:
    from core.clock import VersionClock
    from core.errors import PublishError
    from core.types import PauseMode
    from stages.publisher import publish_weights
    from stages.sglang_client import EngineFleet

    model = _trainer_model(folder, seed=2)
    async with _engine(folder) as engine, EngineFleet([engine.url]) as fleet, aiohttp.ClientSession() as http:
        status, before = await _greedy(http, engine.url)
        marker = tmp_path / "ran"
        evil = base64.b64encode(pickle.dumps({"flattened_tensor": _Evil(marker), "metadata": []})).decode()
        status, body = await _post(
            http,
            engine.url + "/update_weights_from_tensor",
            {"serialized_named_tensors": [evil], "load_format": "flattened_bucket"},
        )
        assert status == 400 and "refused posix.system" in body["message"], body
        assert not marker.exists()
        # A publish that arrives while the weights are released: refused, naming the resume.
        await _post(http, engine.url + "/release_memory_occupation", {})
        colocated = _colocated(fleet, model)
        colocated.released.clear()  # as a client that does not know it released would send it
        with pytest.raises(PublishError, match="resume_memory_occupation"):
            await publish_weights(VersionClock(), fleet, folder, pause_mode=PauseMode.ABORT, transfer=colocated)
        await _post(http, engine.url + "/resume_memory_occupation", {})
        await publish_weights(VersionClock(), fleet, folder, pause_mode=PauseMode.ABORT)  # the old weights, by disk
        status, after = await _greedy(http, engine.url)
        assert status == 200 and after == before


_DYING_TRAINER = textwrap.dedent(
    """
    import sys, torch
    from stages.sglang_client.publish_tensor import flatten_bucket, serialize_bucket
    names = sys.argv[2].split(",")
    shapes = [tuple(int(d) for d in s.split("x")) for s in sys.argv[3].split(",")]
    named = [(n, torch.zeros(s, device="cuda")) for n, s in zip(names, shapes)]
    entry = serialize_bucket(flatten_bucket(named, dtype=torch.bfloat16, device=torch.device("cuda")))
    open(sys.argv[1], "w").write(entry)
    # exits here: its memory, and the handles' meaning, go with it
    """
)


def test_a_trainer_that_died_holding_the_handles_fails_the_update_cleanly(tmp_path: Path) -> None:
    _ready()
    folder = make_model_folder(tmp_path / "m", hidden_size=256, num_layers=2, num_heads=8, seed=0)
    model = _trainer_model(folder, seed=3)
    named = list(model.named_parameters())[:3]
    entry_file = tmp_path / "entry.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _DYING_TRAINER,
            str(entry_file),
            ",".join(n for n, _ in named),
            ",".join("x".join(str(d) for d in p.shape) for _, p in named),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    anyio.run(_dead_trainer, folder, model, entry_file.read_text())


async def _dead_trainer(folder: Path, model: Any, entry: str) -> None:
    from core.clock import VersionClock
    from core.types import PauseMode
    from stages.publisher import publish_weights
    from stages.sglang_client import EngineFleet

    async with _engine(folder) as engine, EngineFleet([engine.url]) as fleet, aiohttp.ClientSession() as http:
        status, before = await _greedy(http, engine.url)
        body = {"serialized_named_tensors": [entry], "load_format": "flattened_bucket"}
        status, out = await _post(http, engine.url + "/update_weights_from_tensor", body)
        assert status == 400 and out["success"] is False and "CUDA IPC handle" in out["message"], out
        status, after = await _greedy(http, engine.url)
        assert status == 200 and after == before  # nothing was written
        colocated = _colocated(fleet, model)
        await publish_weights(VersionClock(), fleet, folder, pause_mode=PauseMode.ABORT, transfer=colocated)
        assert (await _greedy(http, engine.url))[0] == 200


def test_an_engine_that_dies_between_release_and_resume_stops_the_publish_naming_it(tmp_path: Path) -> None:
    _ready()
    folder = make_model_folder(tmp_path / "m", hidden_size=256, num_layers=2, num_heads=8, seed=0)
    anyio.run(_dies_released, folder)


async def _dies_released(folder: Path) -> None:
    from core.clock import VersionClock
    from core.errors import PublishError
    from core.types import PauseMode
    from stages.publisher import publish_weights
    from stages.sglang_client import EngineFleet

    model = _trainer_model(folder, seed=4)
    async with _engine(folder) as engine, EngineFleet([engine.url], control_timeout=5) as fleet:
        colocated = _colocated(fleet, model)
        await colocated.release()
        engine.process.kill()
        await engine.process.wait()
        clock = VersionClock()
        with pytest.raises(PublishError) as failed:
            await publish_weights(clock, fleet, folder, pause_mode=PauseMode.ABORT, transfer=colocated)
        said = str(failed.value)
        assert engine.url in said and clock.version == 0
        print(said)


def test_a_colocated_run_trains_and_generates_on_one_gpu(tmp_path: Path) -> None:
    """`python -m pipeline.launch --colocate`: the engine started with the memory saver on the
    trainer's GPU, released after every round, the weights by CUDA IPC, the run to its end."""
    import json

    from pipeline.run.cli import main

    _ready()
    out = tmp_path / "run"
    argv = ["--output-dir", str(out), "--no-progress", "--log-level", "warning", "--num-rollout", "3"]
    code = main([*argv, "--colocate", "--trainer-device", "cuda", "--trainer-dtype", "bfloat16"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert len(records) == 3 and kinds.count("release") == 3 and kinds.count("publish") == 3
    assert all(r["time/publish_update"] > 0 for r in records)
