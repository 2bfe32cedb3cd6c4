"""Run in a fresh process by tests/test_megatron_moe.py: several GRPO steps of the megatron trainer on the
tiny Qwen3-MoE with R3, against the torch trainer on the same batches (issue 45: "learns the MoE toy
worse than torch").

`python tests/megatron_moe_steps_check.py OUT_DIR [STEPS]` rolls the toy task out once on the built-in
engine over HTTP with routes asked for, then gives both trainers the same STEPS batches (default 8),
the rollout's two halves in turn, set up as the launcher sets up the MoE toy: half a batch per
optimizer step (two per batch, the second clipped against the proximal log-probs), micro-batches
of 8 rows for megatron and the whole minibatch for torch, R3 on both, no step-KL bound (megatron
has none; the launcher turns it off there). The batches' behaviour log-probs are the engine's at
the start, so later steps train off-policy (TIS weights, PPO clip).

After each batch OUT_DIR/result.json records both trainers' metrics, the weights' largest
difference, and, by tests/adam_bound.py, the first optimizer step's gradient difference over its
fp32 rounding bound and every weight's difference over what AdamW makes of the two runs'
gradient differences (each run's gradients as its optimizer took them). One rank: its trainer
lives in this process, so its gradients can be read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import orjson

BATCH_GROUPS = 4  # groups of 4 samples a batch: two batches from the 8-prompt rollout
MINIBATCH = 8  # samples per optimizer step: half a batch, the launcher's default split
MICRO = 8  # megatron's micro-batch rows (the launcher's default)
LR = 5e-3  # the launcher's default


def main(out: Path, steps: int = 8) -> None:
    import torch

    from core.types import Batch
    from launch.megatron_ranks import start_megatron_trainer
    from pipeline.tasks.tiny_model import make_model_folder
    from tests.adam_bound import adam_tolerance, gradient_excess, moments_apart, record_gradients, weight_excess
    from tests.test_routing_replay import LAYERS, TOP_K, rollout
    from trainers import GRPOTrainer
    from trainers.megatron.qwen3 import hf_to_megatron

    model = make_model_folder(out / "model", arch="moe", hidden_size=32, num_layers=LAYERS, moe_router_topk=TOP_K)
    groups = anyio.run(lambda: rollout(model, prompts=2 * BATCH_GROUPS))
    halves = [tuple(groups[:BATCH_GROUPS]), tuple(groups[BATCH_GROUPS:])]
    batches = [Batch(i, halves[i % 2]) for i in range(steps)]

    torch_trainer = GRPOTrainer(model, lr=LR, global_batch_size=MINIBATCH, routing_replay=True)

    def torch_weights() -> dict[str, torch.Tensor]:
        return hf_to_megatron({n: p.detach().clone() for n, p in torch_trainer.model.named_parameters()}, shape)

    torch_grads = record_gradients(torch_trainer.optimizer, torch_trainer.model.named_parameters())
    mg = start_megatron_trainer(
        model,
        world_size=1,
        tp=1,
        log_dir=out / "logs",
        lr=LR,
        global_batch_size=MINIBATCH,
        micro_batch_size=MICRO,
        routing_replay=True,
    )
    shape = mg.shape
    base = torch_weights()
    mg_grads = record_gradients(mg.optimizer, [(mg._names[n], p) for n, p in mg.master.named()])
    first = batches[0].samples[:MINIBATCH]
    ref: list[dict[str, torch.Tensor]] = []
    records = []
    try:
        for batch in batches:
            torch_metrics, mg_metrics = torch_trainer.train_step(batch), mg.train_step(batch)
            a, b = torch_weights(), mg._gather_full()
            new = [hf_to_megatron(g, shape) for g in torch_grads[len(ref) :]]
            # The largest of this batch's optimizer steps' gradient differences, relative to the gradient.
            apart = max(
                float((g - mg_grads[len(ref) + i][k]).norm() / g.norm())
                for i, step in enumerate(new)
                for k, g in step.items()
                if float(g.norm()) > 0
            )
            ref += new
            tolerance = adam_tolerance(ref, moments_apart(ref, mg_grads), a, lr=LR)
            records.append(
                {
                    "torch": torch_metrics,
                    "megatron": mg_metrics,
                    "optimizer_steps": len(mg_grads),
                    "weights_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
                    "weights_moved": max(float((a[k] - base[k]).abs().max()) for k in a),
                    "weights_excess": weight_excess(b, a, tolerance),
                    "gradient_diff": apart,
                }
            )
    finally:
        mg.close()
    positions = sum(len(s.prompt_ids) + s.response_len for s in first)
    result = {
        "steps": records,
        "gradient_excess": gradient_excess(ref[0], mg_grads[0], positions=positions),
        "routed": all(s.routes is not None for s in batches[0].samples),
    }
    (out / "result.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:3]))
