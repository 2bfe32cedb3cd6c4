"""Run in a fresh process by tests/test_megatron_moe.py: the megatron trainer on the tiny Qwen3-MoE,
against the engine that sampled (R3) and the torch trainer (parity).

`python tests/megatron_moe_check.py OUT_DIR [WORLD [PP [EP [MICRO [DROP [TP [BUDGET]]]]]]]` rolls the toy task out
on the built-in engine over HTTP with routes asked for (fp32, then bf16: test_routing_replay.py's
`rollout`), then on the fp32 rollout runs one GRPO step with the torch trainer and with WORLD
megatron ranks (default 1; WORLD=2, and WORLD=2 PP=2, pass too, run by hand; WORLD=2 EP=2 is
test_megatron_moe's), PP stages, EP expert-parallel ranks and MICRO rows per micro-batch (default
4), both replaying the routes. DROP samples are taken off the last group of the trained batch: an
odd batch splits unevenly over the DP ranks, so that under EP one rank runs a padding-only
micro-batch to meet the other's token dispatch. OUT_DIR/result.json: both steps' metrics; the
experts rank 0 holds; the largest |trainer - engine| log-prob of the rollout tokens (megatron with
the routes; on the bf16 rollout with them and without them: the same samples with their routes
taken off, so the routers choose); the largest torch-vs-megatron log-prob difference; both
trainers' published weights compared. A process of its own: megatron's parallel state is global.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import anyio
import orjson

EXPERTS_OF_LAYER_0 = "decoder.layers.0.mlp.experts.local_experts."


def worst(samples: list, logprobs: list[list[float]]) -> float:
    """The largest |trainer - engine| log-prob over the samples' tokens."""
    return max(abs(a - b) for s, lp in zip(samples, logprobs, strict=True) for a, b in zip(lp, s.logprobs, strict=True))


def flat(a: dict, b: dict):
    """Every tensor of `a` minus `b`'s, as one vector."""
    import torch

    return torch.cat([(a[k] - b[k]).flatten() for k in a])


def main(
    out: Path, world: int = 1, pp: int = 1, ep: int = 1, micro: int = 4, drop: int = 0, tp: int = 1, budget: int = 0
) -> None:
    from safetensors.torch import load_file

    from core.types import Batch
    from launch.megatron_ranks import start_megatron_trainer
    from pipeline.tasks.tiny_model import PAD_ID, make_model_folder
    from tests.test_routing_replay import LAYERS, TOP_K, rollout, samples_of
    from trainers import GRPOTrainer
    from trainers.megatron.packing import packs
    from trainers.megatron.rows import Row

    model = make_model_folder(out / "model", arch="moe", hidden_size=32, num_layers=LAYERS, moe_router_topk=TOP_K)
    fp32 = anyio.run(lambda: rollout(model, prompts=4))
    bf16 = samples_of(anyio.run(lambda: rollout(model, dtype="bfloat16", prompts=4)))
    samples = samples_of(fp32)
    # `drop` samples off the last group: an odd batch splits unevenly over the DP ranks.
    last = dataclasses.replace(fp32[-1], samples=fp32[-1].samples[: len(fp32[-1].samples) - drop])
    batch = Batch(0, (*fp32[:-1], last))

    torch_trainer = GRPOTrainer(model, lr=1e-2, routing_replay=True)
    torch_lp = torch_trainer.logprobs(samples)
    torch_metrics = torch_trainer.train_step(batch)
    torch_trainer.save_weights(out / "torch")

    mg = start_megatron_trainer(
        model,
        world_size=world,
        tp=tp,
        pp=pp,
        ep=ep,
        log_dir=out / "logs",
        lr=1e-2,
        micro_batch_size=micro,
        max_tokens_per_gpu=budget or None,  # BUDGET: --max-tokens-per-gpu (0: none)
        routing_replay=True,
    )
    try:
        mg_lp = mg.logprobs(samples)
        result = {
            "fp32_with": worst(samples, mg_lp),
            "bf16_with": worst(bf16, mg.logprobs(bf16)),
            "bf16_without": worst(bf16, mg.logprobs([dataclasses.replace(s, routes=None) for s in bf16])),
            "megatron": mg.train_step(batch),
            # The experts of layer 0 that rank 0 holds (all of them without expert parallel).
            "rank0_experts": sorted(
                {
                    int(full.removeprefix(EXPERTS_OF_LAYER_0).split(".")[0])
                    for full in mg._names.values()
                    if full.startswith(EXPERTS_OF_LAYER_0)
                }
            ),
        }
        mg.save_weights(out / "megatron")
    finally:
        mg.close()
    a, b = load_file(str(out / "torch" / "model.safetensors")), load_file(str(out / "megatron" / "model.safetensors"))
    base = load_file(str(model / "model.safetensors"))
    rows, dp = [Row.of(s) for s in batch.samples], world // (tp * pp)
    result |= {
        "torch": torch_metrics,
        "logprob_diff": max(
            abs(x - y) for p, q in zip(torch_lp, mg_lp, strict=True) for x, y in zip(p, q, strict=True)
        ),
        "weights_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
        # The two updates' difference relative to the update (module docstring of the test).
        "update_diff": float(flat(a, b).norm() / flat(a, base).norm()),
        "sampled_pad": any(PAD_ID in s.response_ids.tolist() for s in samples),
        "weights_moved": max(float((a[k] - base[k]).abs().max()) for k in a),
        "names": [sorted(a), sorted(b), sorted(base)],
        # Micro-batches each DP rank's rows are cut into (before padding-only ones even them out).
        "micro_batches": [len(packs(rows[r::dp], max_rows=micro, max_tokens=budget or None)) for r in range(dp)],
    }
    (out / "result.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:9]))
