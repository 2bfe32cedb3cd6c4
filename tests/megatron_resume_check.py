"""Run in a fresh process by tests/test_megatron.py: a bf16 megatron trainer resumes from its checkpoint.

`python tests/megatron_resume_check.py OUT_DIR train` trains one bf16 step (TP=2 ranks) and saves
OUT_DIR/v1; `... resume` starts new ranks from OUT_DIR/v1 and writes OUT_DIR/result.json: whether
the fp32 masters equal the saved weights, the bf16 parameters their rounding, the AdamW state the
saved shards, and the trainer's step count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch


def main(out: Path, mode: str) -> None:
    from safetensors.torch import load_file

    from launch.megatron_ranks import start_megatron_trainer
    from pipeline.tasks.tiny_model import make_model_folder
    from tests.megatron_check import fixed_batch

    start = make_model_folder(out / "model") if mode == "train" else out / "v1"
    trainer = start_megatron_trainer(start, world_size=2, tp=2, log_dir=out / f"logs-{mode}", lr=1e-2, dtype="bfloat16")
    try:
        if mode == "train":
            trainer.train_step(fixed_batch(trainer))
            trainer.save_weights(out / "v1")
            return
        masters = dict(trainer.master.named())
        shard = load_file(str(out / "v1" / "optimizer" / "rank0.safetensors"))
        saved = dict(trainer.hf_weights())  # the masters, joined over TP and under HF names
        on_disk = load_file(str(out / "v1" / "model.safetensors"))
        result = {
            "steps": trainer.steps,
            "masters_equal_saved": set(saved) == set(on_disk)
            and all(torch.equal(saved[k], on_disk[k]) for k in on_disk),
            "params_are_rounded_masters": all(
                torch.equal(p, masters[n].to(p.dtype)) for n, p in trainer.model.named_parameters()
            ),
            "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "adam_state_restored": all(
                torch.equal(trainer.optimizer.state[masters[k.rsplit(".", 1)[0]]][k.rsplit(".", 1)[1]], t)
                for k, t in shard.items()
            ),
            "adam_entries": len(shard),
        }
        metrics = trainer.train_step(fixed_batch(trainer))
        result["next_step_loss_finite"] = bool(torch.isfinite(torch.tensor(metrics["loss"])))
        result["steps_after"] = trainer.steps
        (out / "result.json").write_bytes(orjson.dumps(result))
    finally:
        trainer.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
