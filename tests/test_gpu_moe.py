"""The tiny Qwen3-MoE in the built-in engine on a GPU (opt in: `pytest -m gpu`; issue 32).

CUDA graphs serve the decode steps of requests that do not ask for routes; a step whose batch asks
for routes (R3) runs eagerly, since a graph's replay runs no hooks. Both kinds share the batch here,
and the routed request's rows must still be the experts a plain forward's routers pick (fp32).
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path

import aiohttp
import anyio
import numpy as np
import pytest

from pipeline.tasks.tiny_model import make_model_folder

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]


async def test_routes_on_the_gpu_with_cuda_graphs_serving_the_other_requests(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from engines.builtin import open_server
    from engines.moe_routes import RouteRecorder

    assert torch.cuda.is_available(), "torch sees no GPU"
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference forward below at full fp32
    model = make_model_folder(tmp_path / "m", arch="moe", hidden_size=64, num_layers=2, seed=0)
    prompt = [5, 6, 7, 8, 9]
    params = {"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 1}
    async with (
        open_server(model, port=0, device="cuda", health_check_timeout=2.0) as server,
        aiohttp.ClientSession() as http,
    ):
        assert server.core.model.graphs is not None  # type: ignore[attr-defined]

        async def generate(**body: object) -> dict:
            async with http.post(server.url + "/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                out: dict = await resp.json()
                return out

        results: dict[str, dict] = {}

        async def one(name: str, **extra: object) -> None:
            results[name] = await generate(input_ids=prompt, sampling_params=params, **extra)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "plain")
            tg.start_soon(functools.partial(one, "routed", return_routed_experts=True))
        alone = await generate(input_ids=prompt, sampling_params=params)  # graphs only
        stats = server.core.model.statistics()  # type: ignore[attr-defined]
    assert stats.graphs is not None and stats.graphs.replays > 0
    assert results["plain"]["output_ids"] == results["routed"]["output_ids"] == alone["output_ids"]
    ids = prompt + results["routed"]["output_ids"]
    got = np.frombuffer(base64.b64decode(results["routed"]["meta_info"]["routed_experts"]), dtype="<i4")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to("cuda")
    recorder = RouteRecorder.attach(hf)
    assert recorder is not None
    with torch.no_grad(), recorder.recording():
        hf(input_ids=torch.tensor([ids[:-1]], device="cuda"))
    want = recorder.take().numpy()
    assert (got.reshape(want.shape) == want).all()
