"""Run in a fresh process by tests/test_distributed_optimizer.py on a GPU: megatron's distributed
optimizer against the hand-rolled step, and its checkpoint resumed.

`python tests/distopt_check.py OUT_DIR DTYPE` writes OUT_DIR/result.json. One megatron rank (world
1, NCCL): three trainers built from the same tiny Qwen3 folder in one process (megatron's parallel
state is global to it): the hand-rolled path, the distributed optimizer, and the distributed
optimizer resumed from the folder the second saved after its first step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson


def main(out: Path, dtype: str) -> None:
    from safetensors.torch import load_file

    from launch.builtin_engine import free_port
    from launch.megatron_ranks import init_rank
    from pipeline.tasks.tiny_model import make_model_folder
    from tests.megatron_check import fixed_batch
    from trainers import GRPOTrainer
    from trainers.megatron.trainer import MegatronTrainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    device = init_rank(rank=0, world_size=1, tp=1, device="cuda")
    model = make_model_folder(out / "model")
    batch = fixed_batch(GRPOTrainer(model, lr=1e-2))
    common = {"lr": 1e-2, "device": device, "dtype": dtype, "micro_batch_size": 3}
    hand = MegatronTrainer(model, **common)
    sharded = MegatronTrainer(model, **common, distributed_optimizer=True)
    metrics = {"hand": [hand.train_step(batch)], "distributed": [sharded.train_step(batch)]}
    hand.save_weights(out / "hand1")
    sharded.save_weights(out / "distributed1")
    metrics["hand"].append(hand.train_step(batch))
    metrics["distributed"].append(sharded.train_step(batch))
    sharded.save_weights(out / "distributed2")
    resumed = MegatronTrainer(out / "distributed1", **common, distributed_optimizer=True)
    resumed_steps = resumed.steps
    metrics["resumed"] = [resumed.train_step(batch)]
    resumed.save_weights(out / "resumed2")

    def weights(name: str) -> dict:
        return load_file(str(out / name / "model.safetensors"))

    def diff(a: str, b: str) -> float:
        x, y = weights(a), weights(b)
        return max(float((x[k] - y[k]).abs().max()) for k in x)

    result = {
        "metrics": metrics,
        "hand_vs_distributed_1": diff("hand1", "distributed1"),
        "moved_1": diff("hand1", "model"),
        "distributed2_vs_resumed2": diff("distributed2", "resumed2"),
        "moved_2": diff("distributed2", "distributed1"),
        "resumed_steps": resumed_steps,
        "optimizer_files": sorted(p.name for p in (out / "distributed1" / "optimizer").iterdir()),
    }
    (out / "result.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "float32")
