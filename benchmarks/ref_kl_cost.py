"""What the reference model of `--use-kl-loss` costs the torch trainer's step, measured side by side.

    python -m benchmarks.ref_kl_cost [--device cuda] [--dtype bfloat16] [--hidden 1024 --layers 16]
                                     [--batch 64 --prompt 128 --response 512] [--steps 5]

A randomly initialised Qwen3-shaped model (no download) is trained on a fixed batch with the
run's default shape of a step (two optimizer steps per batch: `--global-batch-size` = half), once
without and once with the KL term (k3, coef 0.01), alternating step by step so that drift of the
machine hits both alike. It prints the median step time of each, their ratio, the reference
forward's own seconds (`ref_log_probs_time`) and the memory the second copy of the weights takes.
The first step of each trainer is a warm-up and is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path


def _model(folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(1, hidden // 128)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=128 if hidden >= 128 else hidden,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def _batch(n: int, prompt: int, response: int, vocab: int):
    from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment

    rng = random.Random(0)
    groups = []
    for g in range(n // 8):
        task = PromptTask(index=g, prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(prompt)), label=None)
        samples = []
        for i in range(8):
            ids = tuple(rng.randrange(3, vocab) for _ in range(response))
            s = Sample(index=i, prompt_ids=task.prompt_ids).extended(
                Segment(ids, (-2.0,) * response, FinishReason.LENGTH, 0), max_response_len=response
            )
            samples.append(dataclasses.replace(s, reward=float(i % 2)))
        groups.append(Group.fresh(task, epoch=0, n_samples=8, version=0, seq=g).with_samples(samples))
    return Batch(0, tuple(groups))


def main(argv: list[str] | None = None) -> int:
    import torch

    from trainers import GRPOTrainer
    from trainers.loss import KLType, LossSettings

    p = argparse.ArgumentParser(prog="python -m benchmarks.ref_kl_cost", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = _model(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        batch = _batch(args.batch, args.prompt, args.response, args.vocab)
        kw = {"device": args.device, "dtype": args.dtype, "global_batch_size": args.batch // 2, "lr": 1e-5}
        kw["num_threads"] = None
        plain = GRPOTrainer(folder, loss=LossSettings(), **kw)  # type: ignore[arg-type]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        kl = GRPOTrainer(
            folder,
            loss=LossSettings(use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type=KLType.K3),
            **kw,  # type: ignore[arg-type]
        )
        extra_gib = 0.0
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
            params = sum(p.numel() for p in plain.model.parameters())
            extra_gib = (torch.cuda.memory_allocated() - before) / 2**30
            print(
                f"model: {params / 1e6:.0f}M parameters; the KL trainer (policy + reference) took {extra_gib:.2f} GiB"
            )
        times: dict[str, list[float]] = {"plain": [], "kl": []}
        ref: list[float] = []
        for step in range(args.steps + 1):
            for name, trainer in (("plain", plain), ("kl", kl)):
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                started = time.perf_counter()
                metrics = trainer.train_step(dataclasses.replace(batch, step=step))
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                if step:  # the first is a warm-up
                    times[name].append(time.perf_counter() - started)
                    if name == "kl":
                        ref.append(metrics["ref_log_probs_time"])
        a, b = statistics.median(times["plain"]), statistics.median(times["kl"])
        tokens = args.batch * (args.prompt + args.response)
        print(
            f"{args.device} {args.dtype}, batch {args.batch} x ({args.prompt} + {args.response}) tokens = {tokens}: "
            f"step {a * 1e3:.0f} ms without KL, {b * 1e3:.0f} ms with ({b / a:.2f}x); "
            f"reference forward {statistics.median(ref) * 1e3:.0f} ms ({statistics.median(ref) / b:.0%} of the KL step)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
