"""GPU checks of the built-in engine and the distributed publish (opt in: `pytest -m gpu`).

- cached decode vs recompute on the GPU at bf16: token-exact is not expected there, so the two
  must agree on most tokens and, where they agree, on the log-probs within bf16 noise;
- the CUDA-graph decode vs the eager decode at fp32, token for token under continuous batching, and
  a weight publish (copied into the live tensors the graphs read) changing the graphs' tokens;
- the weight publish over NCCL between a trainer (this process, cuda:0) and an engine process on
  cuda:1: NCCL refuses two ranks of one group on one GPU, so it is skipped on a one-GPU machine;
- a short learning run of the quick-start task with engine and trainer on the GPU.
"""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import anyio
import pytest

from pipeline.tasks.tiny_model import make_model_folder

pytestmark = [pytest.mark.gpu]


def _cuda() -> None:
    import torch

    assert torch.cuda.is_available(), "torch sees no GPU"


def test_cached_decode_matches_recompute_at_bf16(tmp_path: Path) -> None:
    import torch

    from engines.kv_forward import KVCacheForward
    from engines.seam import Row, SamplingParams
    from engines.torch_model import ModelRunner

    _cuda()
    folder = make_model_folder(tmp_path / "m", hidden_size=256, num_layers=4, num_heads=8, seed=0)
    runner = ModelRunner(folder, dtype=torch.bfloat16, device="cuda")
    kv = KVCacheForward(runner, max_running_requests=8)
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.0)
    prompts = [tuple(rng.randrange(3, 60) for _ in range(rng.randrange(2, 40))) for _ in range(8)]
    agreed = total = 0
    worst = 0.0
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(params.max_new_tokens):
        rows = [
            Row(p, tuple(o), params, seed=i, rid=f"r{i}", key=i + 1)
            for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
        ]
        cached, reference = kv.step(rows), runner.step(rows)
        for i, (c, r) in enumerate(zip(cached, reference, strict=True)):
            assert c is not None
            total += 1
            if c.token_id == r.token_id:
                agreed += 1
                worst = max(worst, abs(c.logprob - r.logprob))
            outs[i].append(r.token_id)  # teacher-force the recompute path's token: both see one sequence
    assert agreed / total >= 0.9, f"only {agreed} of {total} greedy tokens agree"
    assert worst < 0.1, f"log-probs differ by {worst} where tokens agree"


def test_graph_decode_equals_eager_decode_at_fp32(tmp_path: Path) -> None:
    import torch

    from engines.kv_forward import DecodeMode, KVCacheForward
    from engines.torch_model import ModelRunner
    from tests.test_kv_forward import _run_batched

    _cuda()
    folder = make_model_folder(tmp_path / "m", hidden_size=256, num_layers=4, num_heads=8, seed=0)
    runner = ModelRunner(folder, dtype=torch.float32, device="cuda", context_length=160)
    rng = random.Random(0)
    # 13 requests through 6 slots (batch buckets 1, 2, 4, 6), KV lengths across the 64 and 128 buckets.
    prompts = [tuple(rng.randrange(3, 60) for _ in range(rng.randrange(1, 120))) for _ in range(13)]
    eager = _run_batched(KVCacheForward(runner, max_running_requests=6, decode=DecodeMode.EAGER), prompts, 6)
    kv = KVCacheForward(runner, max_running_requests=6, decode=DecodeMode.GRAPHS)
    graphed = _run_batched(kv, prompts, 6)
    for ref, got in zip(eager, graphed, strict=True):
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref, strict=True)) < 1e-4
    stats = kv.statistics().graphs
    assert stats is not None and stats.capturing, "capture failed: the decode fell back to eager"
    assert stats.graphs >= 3 and stats.replays == kv.statistics().decode_steps


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports warn
def test_fused_norm_graph_decode_equals_recompute_at_fp32(tmp_path: Path) -> None:
    """The fast path whole (slots read in place, folded GQA heads, compiled norms, CUDA graphs)
    against the recompute forward (transformers' own attention, no cache), token for token at fp32."""
    import torch

    from engines.fused_ops import unfuse_ops
    from engines.kv_forward import DecodeMode, KVCacheForward
    from engines.torch_model import ModelRunner
    from tests.test_kv_forward import _run_batched

    _cuda()
    folder = make_model_folder(tmp_path / "m", hidden_size=256, num_layers=4, num_heads=8, seed=0)
    runner = ModelRunner(folder, dtype=torch.float32, device="cuda", context_length=160)
    rng = random.Random(2)
    prompts = [tuple(rng.randrange(3, 60) for _ in range(rng.randrange(1, 120))) for _ in range(13)]
    reference = _run_batched(runner, prompts, len(prompts))
    kv = KVCacheForward(runner, max_running_requests=6, decode=DecodeMode.GRAPHS, fuse_ops=True)
    try:
        for ref, got in zip(reference, _run_batched(kv, prompts, 6), strict=True):
            assert [t for t, _ in got] == [t for t, _ in ref]
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref, strict=True)) < 1e-4
        assert "forward" in vars(runner.model.base_model.norm), "the norms were not compiled"
        assert kv.statistics().moves > 0
    finally:
        # The compiled rotary function replaces the modeling module's own for the whole process (an
        # engine owns its process); here later tests train Qwen3 in this one, so it goes back.
        unfuse_ops(runner.model)


def test_a_publish_changes_the_graph_decodes_tokens(tmp_path: Path) -> None:
    """Graphs hold the addresses of the weights they read: a publish copies into those tensors, so
    the next replay decodes with the new weights, with no recapture."""
    import torch

    from engines.kv_forward import DecodeMode, KVCacheForward
    from engines.seam import Row, SamplingParams
    from engines.torch_model import ModelRunner

    _cuda()
    old = make_model_folder(tmp_path / "v0", hidden_size=128, num_layers=2, seed=0)
    new = make_model_folder(tmp_path / "v1", hidden_size=128, num_layers=2, seed=1)
    runner = ModelRunner(old, dtype=torch.float32, device="cuda")
    kv = KVCacheForward(runner, max_running_requests=4, decode=DecodeMode.GRAPHS)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.0)
    prompts = [(5, 9, 11), (7, 8), (21, 22, 23, 24)]

    def decode(forward: object, first_key: int) -> list[list[int]]:
        outs: list[list[int]] = [[] for _ in prompts]
        for _ in range(params.max_new_tokens):
            rows = [
                Row(p, tuple(o), params, seed=i, rid=f"r{first_key + i}", key=first_key + i)
                for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
            ]
            for o, d in zip(outs, forward.step(rows), strict=True):  # type: ignore[attr-defined]
                assert d is not None
                o.append(d.token_id)
        for i, p in enumerate(prompts):
            forward.release(Row(p, (), params, seed=i, rid=f"r{first_key + i}", key=first_key + i))  # type: ignore[attr-defined]
        return outs

    before = decode(kv, 1)
    graphs = kv.statistics().graphs
    assert graphs is not None and graphs.capturing and graphs.graphs > 0
    runner.apply_weights(runner.read_weights(new))
    after = decode(kv, 100)
    expected = decode(
        KVCacheForward(ModelRunner(new, device="cuda"), max_running_requests=4, decode=DecodeMode.EAGER), 1
    )
    assert after == expected and after != before
    again = kv.statistics().graphs
    assert again is not None and again.graphs == graphs.graphs  # no recapture: same graphs, new weights


async def _nccl_publish(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from launch.builtin_engine import start_engine
    from stages.sglang_client.fleet import EngineFleet
    from stages.sglang_client.publish_distributed import DistributedWeightSender

    old = make_model_folder(tmp_path / "v0", hidden_size=64, num_layers=2, seed=0)
    new = make_model_folder(tmp_path / "v1", hidden_size=64, num_layers=2, seed=1)
    engine_device = "cuda:1"
    model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).to("cuda:0")
    async with await start_engine(old, startup_timeout=300, extra_args=["--device", engine_device]) as engine:
        async with EngineFleet([engine.url]) as fleet, aiohttp.ClientSession() as http:
            sender = DistributedWeightSender(model.named_parameters, fleet, device="cuda:0", timeout=120)
            assert sender.backend == "nccl"
            with anyio.fail_after(300):
                await sender.send("1")
            assert list((await fleet.weight_versions()).values()) == ["1"]
            for name, param in model.named_parameters():
                body = {"name": name, "truncate_size": 10**7}
                async with http.post(engine.url + "/get_weights_by_name", json=body) as resp:
                    got = torch.tensor(await resp.json())
                assert torch.equal(got, param.detach().flatten().cpu()), name
            await sender.close()


def test_distributed_publish_over_nccl(tmp_path: Path) -> None:
    import torch

    _cuda()
    if torch.cuda.device_count() < 2:  # NCCL: "Duplicate GPU detected" for two ranks on one device
        pytest.skip("NCCL needs the engine on a second GPU (run on a 2-GPU machine); gloo covers one host's CPU")
    anyio.run(_nccl_publish, tmp_path)


def test_quick_start_learns_on_the_gpu(tmp_path: Path) -> None:
    """Engine and trainer on one GPU (`--rollout-device cuda --trainer-device cuda`); publishes from disk, because NCCL
    refuses two ranks on one GPU (the NCCL test above takes a second GPU when there is one)."""
    import json

    from pipeline.run.cli import main

    _cuda()
    out = tmp_path / "run"
    code = main(
        [
            "--output-dir",
            str(out),
            "--no-progress",
            "--log-level",
            "warning",
            "--num-rollout",
            "30",
            "--rollout-device",
            "cuda",
            "--trainer-device",
            "cuda",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["rollout/raw_reward"] for r in records[:5]) / 5
    last = sum(r["rollout/raw_reward"] for r in records[-5:]) / 5
    assert last > first + 0.1, (first, last)
