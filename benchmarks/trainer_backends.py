"""One GRPO step, torch backend vs megatron backend, same model and batch: seconds per step.

    python -m benchmarks.trainer_backends --device cuda            # a Qwen3-0.6B-shaped model (random init)
    python -m benchmarks.trainer_backends --device cuda --dtype bfloat16     # both backends in bf16
    python -m benchmarks.trainer_backends --device cpu --tiny      # the tiny model: a smoke run

The model is built from a Qwen3 config of the 0.6B shape (28 layers, hidden 1024, 16 heads / 8
key-value heads of 128, FFN 3072, vocab 151,936, tied embeddings), randomly initialised and saved
once; both trainers load the same folder and keep fp32 master weights; `--dtype bfloat16` computes in
bf16 (`--trainer-dtype`: torch under autocast, megatron with bf16 parameters). One optimizer step
per batch for both (`--global-batch-size` left at the whole batch). The batch is
`--groups` x `--samples` samples of `--prompt-len` + `--response-len` random tokens, with
behaviour log-probs and rewards that give every token a gradient. The megatron backend runs one
rank (TP=1) in this process with `--micro-batch-size` samples packed per micro-batch. The first
step of each backend is a warm-up and is reported apart. On a GPU the megatron backend runs a
second time with `--use-distributed-optimizer` (`megatron_distopt`: megatron-core's DDP and
distributed optimizer instead of the hand-rolled step). Prints one JSON line per `--dtype`.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import torch

from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment


def _model(folder: Path, tiny: bool) -> Path:
    from benchmarks.engine import qwen3_06b_folder
    from pipeline.tasks.tiny_model import make_model_folder

    # The same 0.6B-shaped model the engine benchmark builds; the trainers load it in fp32.
    return make_model_folder(folder) if tiny else qwen3_06b_folder(folder)


def _batch(vocab: int, groups: int, samples: int, prompt_len: int, response_len: int) -> Batch:
    rng = random.Random(0)
    out = []
    for g in range(groups):
        task = PromptTask(index=g, prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(prompt_len)))
        group = []
        for i in range(samples):
            ids = tuple(rng.randrange(3, vocab) for _ in range(response_len))
            seg = Segment(ids, tuple(-rng.uniform(4.0, 12.0) for _ in ids), FinishReason.LENGTH, 0)
            sample = Sample(index=i, prompt_ids=task.prompt_ids).extended(seg, max_response_len=response_len)
            group.append(dataclasses.replace(sample, reward=float(i % 2)))
        out.append(Group.fresh(task, epoch=0, n_samples=samples, version=0, seq=g).with_samples(group))
    return Batch(0, tuple(out))


def _time(trainer: Any, batch: Batch, steps: int, device: str) -> dict[str, float]:
    times = []
    for _ in range(steps + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        trainer.train_step(batch)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {"first_s": times[0], "median_s": statistics.median(times[1:]), "steps": steps}


def _compare(model: Path, batch: Batch, args: argparse.Namespace, dtype: str, logs: Path) -> dict[str, Any]:
    """Both backends on `batch` in `dtype`, one after the other (each freed before the next)."""
    from launch.megatron_ranks import start_megatron_trainer
    from trainers import GRPOTrainer

    cuda = args.device.startswith("cuda")
    result: dict[str, Any] = {
        "model": "tiny" if args.tiny else "qwen3-0.6b-shape",
        "device": args.device,
        "dtype": dtype,
        "batch": f"{args.groups}x{args.samples} x ({args.prompt_len}+{args.response_len})",
    }
    trainer = GRPOTrainer(model, device=args.device, dtype=dtype, num_threads=None)
    result["torch"] = _time(trainer, batch, args.steps, args.device)
    del trainer
    if cuda:
        result["torch"]["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    # The megatron backend as is, then (GPU only) with megatron's DDP and distributed optimizer.
    for key, distributed in (("megatron", False), ("megatron_distopt", True)):
        if distributed and not cuda:
            continue
        mg = start_megatron_trainer(
            model,
            world_size=1,
            tp=1,
            device=args.device,
            dtype=dtype,
            log_dir=logs,
            micro_batch_size=args.micro_batch_size,
            num_threads=None,
            distributed_optimizer=distributed,
        )
        try:
            result[key] = _time(mg, batch, args.steps, args.device)
        finally:
            mg.close()
        if cuda:
            result[key]["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        _release_megatron(mg, cuda)
    return result


def _release_megatron(trainer: Any, cuda: bool) -> None:
    """Make room for the next dtype: drop the model and optimizer, and megatron's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    trainer.model = trainer.optimizer = trainer.master = trainer.distopt = None
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, or both comma-separated (one line each)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = _model(Path(tmp) / "model", args.tiny)
        vocab = 64 if args.tiny else 151936
        batch = _batch(vocab, args.groups, args.samples, args.prompt_len, args.response_len)
        for dtype in args.dtype.split(","):
            print(orjson.dumps(_compare(model, batch, args, dtype, Path(tmp) / "logs")).decode(), flush=True)


if __name__ == "__main__":
    main()
