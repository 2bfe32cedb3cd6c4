"""Bytes written per training step, before and after checkpoint cadence (issue 30).

    python -m benchmarks.checkpoint_bytes [--save-interval 10] [--save-keep-last 3] [--steps 100]

Before: every step wrote a full checkpoint (weights + AdamW state) to `weights/vN`, and kept it.
After: a full checkpoint every `--save-interval` steps (the newest `--save-keep-last` kept), and
between them a weights-only publish folder for the engines (nothing with the distributed transport),
deleted once the engines serve a later one.

The toy row is measured: the built-in trainer on the quick start's tiny model trains one step, then
writes both folders for real (`save_weights`, `save_model`), and their files are counted. The 0.6B
row is computed from the parameter count of the Qwen3-0.6B shape (built on the meta device, so no
memory): the torch trainer keeps fp32 master weights (4 bytes each) and AdamW two fp32 moments
(8 bytes), and saves both as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch


def _toy() -> tuple[int, int]:
    from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
    from pipeline.checkpoints import folder_bytes
    from pipeline.tasks.tiny_model import make_model_folder
    from pipeline.tasks.toy import encode
    from trainers import GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trainer = GRPOTrainer(make_model_folder(root / "model", seed=0))
        task = PromptTask(index=0, prompt_ids=encode("say a x2:"), label=None)
        samples = []
        for i in range(4):
            ids = encode("a" * (i + 1))
            seg = Segment(ids, tuple(-1.0 for _ in ids), FinishReason.STOP, 0)
            sample = Sample(index=i, prompt_ids=task.prompt_ids).extended(seg, max_response_len=64)
            samples.append(dataclasses.replace(sample, reward=float(i % 2)))
        group = Group.fresh(task, epoch=0, n_samples=4, version=0, seq=0).with_samples(samples)
        trainer.train_step(Batch(0, (group,)))  # AdamW's moments exist from the first step on
        full = folder_bytes(trainer.save_weights(root / "checkpoint"))
        weights = folder_bytes(trainer.save_model(root / "publish"))
    return full, weights


def _qwen3_06b() -> tuple[int, int, int]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    return params, 12 * params, 4 * params  # full: fp32 weights + two fp32 moments; publish: weights


def _row(name: str, full: int, weights: int, interval: int, keep: int, steps: int) -> str:
    before = full
    after_disk = ((interval - 1) * weights + full) / interval
    after_dist = full / interval
    held_before = steps * full  # weights/v1..v<steps>, every one kept
    held_after = keep * full + weights
    mb = 1e6
    return (
        f"| {name} | {full / mb:,.2f} | {weights / mb:,.2f} | {before / mb:,.2f} | {after_disk / mb:,.2f} "
        f"({before / after_disk:.1f}x less) | {after_dist / mb:,.2f} ({before / after_dist:.0f}x less) "
        f"| {held_before / mb:,.0f} | {held_after / mb:,.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--save-keep-last", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    n, k, steps = args.save_interval, args.save_keep_last, args.steps
    full, weights = _toy()
    params, full06, weights06 = _qwen3_06b()
    print(f"--save-interval {n}, --save-keep-last {k}, {steps} steps; MB = 10^6 bytes")
    print(
        "| model | checkpoint MB | publish folder MB | before: MB/step | after, disk transport: MB/step "
        "| after, distributed: MB/step | before: MB on disk at the end | after: MB on disk at the end |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(_row("toy (measured)", full, weights, n, k, steps))
    print(_row(f"Qwen3-0.6B shape, {params / 1e6:.0f}M params (computed)", full06, weights06, n, k, steps))


if __name__ == "__main__":
    main()
