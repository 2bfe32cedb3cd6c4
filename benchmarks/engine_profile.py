"""Where a decode step of the built-in engine spends GPU time: `torch.profiler` over two steps.

    python3 -m benchmarks.engine_profile [--batch 128] [--context 256] [--fuse-ops] [--graphs-only]

The 0.6B-shape Qwen3 of `benchmarks.engine` in bf16 on cuda, eager and from CUDA graphs (the
kernels are the same; graphs only remove the launches), then the sampler alone on random float64
logits. Prints the profiler's table sorted by GPU time; BENCHMARKS.md section 7 quotes it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine import _prompts, _rows, qwen3_06b_folder
from engines.kv_forward import DecodeMode, KVCacheForward
from engines.torch_model import ModelRunner, draw_tokens


def main(batch: int, context: int, fuse_ops: bool = False, graphs_only: bool = False) -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine and the benchmark run it
    with tempfile.TemporaryDirectory() as tmp:
        runner = ModelRunner(
            qwen3_06b_folder(Path(tmp) / "q"), dtype=torch.bfloat16, device="cuda", context_length=context + 1
        )
    prompts = _prompts(batch, context - 16, 60)
    outputs: list[tuple[int, ...]] = [() for _ in range(batch)]
    for mode in (DecodeMode.GRAPHS,) if graphs_only else (DecodeMode.EAGER, DecodeMode.GRAPHS):
        kv = KVCacheForward(runner, max_running_requests=batch, decode=mode, fuse_ops=fuse_ops)
        outputs = [() for _ in range(batch)]
        for steps, report in ((3, False), (2, True)):  # the prefill and warm-up, then two profiled steps
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    draws = kv.step(_rows(prompts, outputs))
                    outputs = [(*o, d.token_id) for o, d in zip(outputs, draws, strict=True)]  # type: ignore[union-attr]
                torch.cuda.synchronize()
            if report:
                print(mode, prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
                # Kernels per step: at batch 1 a step is bound by how many there are, not by bytes.
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                print(f"{mode}: {len(kernels) / steps:.0f} GPU kernels/copies per step")
        del kv
    logits = torch.randn(batch, runner.vocab_size, dtype=torch.float64, device="cuda")
    rows = _rows(prompts, outputs)
    draw_tokens(logits.clone(), rows)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        draw_tokens(logits.clone(), rows)
    torch.cuda.synchronize()
    print(f"draw_tokens B={batch}: {(time.perf_counter() - start) / 5 * 1e3:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--fuse-ops", action="store_true", help="as the engine's --fuse-ops")
    parser.add_argument("--graphs-only", action="store_true", help="profile the graph replays only")
    args = parser.parse_args()
    main(args.batch, args.context, args.fuse_ops, args.graphs_only)
