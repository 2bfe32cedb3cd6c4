"""Run in a fresh process by tests/test_megatron_pp.py: one GRPO step of megatron ranks in a given layout.

`python tests/megatron_pp_check.py OUT NAME WORLD TP PP [START [DTYPE [LOSS]]]` starts WORLD ranks (TP x PP,
the rest data parallel) from START (`none` or left out: OUT/model, the built-in tiny model, made if
missing), computing in DTYPE (default float32), with LOSS `default` or `kl` (reference KL against
OUT/ref, another tiny model, and an entropy bonus: the reference model's forward goes through the
pipeline too),
computes the fixed batch's log-probs, trains one rollout batch (two optimizer steps: the
proximal log-probs go through the pipeline too), saves OUT/NAME and writes OUT/NAME.json: the
metrics, the log-probs, the trainer's steps, and whether `hf_weights()` equals the saved folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch


def main(out: Path, name: str, world: int, tp: int, pp: int, start: Path | None, dtype: str, loss: str) -> None:
    from safetensors.torch import load_file

    from launch.megatron_ranks import start_megatron_trainer
    from pipeline.tasks.tiny_model import make_model_folder
    from tests.megatron_check import fixed_batch

    if start is None:
        start = out / "model" if (out / "model" / "config.json").exists() else make_model_folder(out / "model")
    extra = {}
    if loss == "kl":
        from trainers.loss import KLType, LossSettings

        ref = out / "ref" if (out / "ref" / "config.json").exists() else make_model_folder(out / "ref", seed=7)
        settings = LossSettings(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type=KLType.K3, entropy_coef=0.05)
        extra = {"loss": settings, "ref_path": str(ref)}
    trainer = start_megatron_trainer(
        start,
        world_size=world,
        tp=tp,
        pp=pp,
        log_dir=out / f"logs-{name}",
        lr=1e-2,
        micro_batch_size=3,
        global_batch_size=4,
        dtype=dtype,
        **extra,
    )
    try:
        batch = fixed_batch(trainer)
        logprobs = trainer.logprobs(batch.samples)
        metrics = trainer.train_step(batch)
        trainer.save_weights(out / name)
        published = dict(trainer.hf_weights())
        steps = trainer.steps
    finally:
        trainer.close()
    saved = load_file(str(out / name / "model.safetensors"))
    result = {
        "metrics": metrics,
        "logprobs": logprobs,
        "steps": steps,
        "published_equals_saved": set(published) == set(saved)
        and all(torch.equal(published[k], saved[k]) for k in saved),
        "shards": {p.name: orjson.loads(p.read_bytes()) for p in sorted((out / name / "optimizer").glob("rank*.json"))},
    }
    (out / f"{name}.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main(
        Path(sys.argv[1]),
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        int(sys.argv[5]),
        Path(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "none" else None,
        sys.argv[7] if len(sys.argv) > 7 else "float32",
        sys.argv[8] if len(sys.argv) > 8 else "default",
    )
