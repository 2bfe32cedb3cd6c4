"""The length tail on the built-in engine: a real model ends each request where the simulated
engine's length model puts its EOS, and a resumed prefix heads for the same end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engines.builtin import open_server
from engines.length_tail import LengthTail
from engines.sim_model import LengthModel
from pipeline.tasks.tiny_model import make_model_folder

LIMIT = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("tail") / "m", hidden_size=32, num_layers=2, seed=0)


async def _generate(
    http: aiohttp.ClientSession, url: str, ids: list[int], seed: int, new: int, eos: int
) -> dict[str, Any]:
    # The bias keeps the random model from sampling EOS itself: every end seen is the tail's.
    params = {"max_new_tokens": new, "sampling_seed": seed, "logit_bias": {str(eos): -20.0}}
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": params}
    async with http.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        return await resp.json()  # type: ignore[no-any-return]


@pytest.mark.anyio
async def test_requests_end_at_the_length_models_target_and_resumes_head_for_it(model_dir: Path) -> None:
    lengths = LengthModel(truncate_frac=0.2)
    prompts = {seed: [3 + (seed * 5 + j) % 50 for j in range(4 + seed % 5)] for seed in range(12)}
    targets = {s: lengths.target(s, tuple(p), LIMIT) for s, p in prompts.items()}
    assert len({t for t in targets.values()}) > 3 and None in targets.values()  # a spread and a capped one
    async with (
        open_server(model_dir, length_tail=LengthTail(lengths, limit=LIMIT)) as server,
        aiohttp.ClientSession() as http,
    ):
        eos = min(server.core.model.eos_token_ids)
        for seed, prompt in prompts.items():
            out = await _generate(http, server.url, prompt, seed, LIMIT, eos)
            ids, finish = out["output_ids"], out["meta_info"]["finish_reason"]
            target = targets[seed]
            if target is None:
                assert len(ids) == LIMIT and finish["type"] == "length"
                continue
            assert len(ids) == target and ids[-1] == eos and finish["type"] == "stop"
            # Resumed after k tokens: the original prompt is found from the limit, same end.
            k = max(1, target // 2)
            again = await _generate(http, server.url, prompt + ids[:k], seed, LIMIT - k, eos)
            assert again["output_ids"] == ids[k:]
            logprob = out["meta_info"]["output_token_logprobs"][-1][0]
            assert logprob < 0  # EOS's own log-prob under the sampling distribution, not a made-up 0
