"""Decode speed of the built-in engine's forwards: recompute (old) vs KV cache, eager and (on a GPU)
from CUDA graphs, in one run.

    python -m benchmarks.engine [--device cpu] [--dtype float32] [--batches 1,16,64,256]
        [--contexts 256] [--sweep-batch 64] [--sweep-contexts 64,448] [--steps 6] [--model-path DIR]
        [--skip-old] [--disable-cuda-graph] [--reference-batches 128]

For each (running requests B, context T): B requests whose sequences are T tokens long decode
`--steps` tokens each; the table gives decode tokens/s (B x steps / time) and the mean step time.
The KV forward's prefill of the B prompts and one decode step are done first and not timed (the
prefill is what a request pays once; decode is what it pays every token), and on a GPU the graphs
for the timed shapes are captured before timing. Every forward runs the same model object, the
same rows, the same sampling (temperature 1, per-request seeds): the only differences are the
cache and how the decode step is launched ("same tokens": the share of the graphs' tokens equal
to the eager KV decode's, which at bf16 may differ in a few).

"bw" is the share of the memory-bandwidth limit a step reaches: the fewest bytes a decode step must
move (every weight read once, plus each row's K/V up to its length, read once) over the device's
copy bandwidth measured in the same run (a large device-to-device copy, bytes read plus written),
divided by the measured step time. 100% is the floor no decode step can beat; on a CPU the
"bandwidth" is the same copy measured in host memory.

With `--reference-batches`, transformers' static-cache `generate` (compiled) runs beside the
engine on the same prompts, and the lines end with the targets' verdicts: at batch 128 the
engine's step no slower than the reference's, at batch 1 a step of at most 3 ms.

The model is the quick start's tiny Qwen3 (built here, random weights) unless `--model-path` names a
Hugging Face folder; `--device cuda` runs the same table on a GPU. No HTTP or scheduler is timed.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from engines.kv_forward import DecodeMode, KVCacheForward
from engines.seam import Row, SamplingParams
from engines.torch_model import ModelRunner
from pipeline.tasks.tiny_model import make_model_folder

FUSE_OPS = False  # --fuse-ops

_PARAMS = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True, temperature=1.0)


def _prompts(batch: int, context: int, vocab: int) -> list[tuple[int, ...]]:
    return [tuple(random.Random(i).randrange(3, vocab) for _ in range(context)) for i in range(batch)]


def _rows(prompts: Sequence[tuple[int, ...]], outputs: Sequence[tuple[int, ...]]) -> list[Row]:
    """What the scheduler hands a forward each step (it builds these rows every step too)."""
    return [
        Row(prompt_ids=p, output_ids=o, params=_PARAMS, seed=i, rid=f"b{i}", key=i + 1)
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(runner: ModelRunner, forward: object, batch: int, context: int, steps: int) -> tuple[float, list[int]]:
    """Seconds per decode step of `forward` (a ModelRunner or a KVCacheForward) for B rows of length
    T, and the tokens the timed steps drew."""
    step = forward.step  # type: ignore[attr-defined]
    outputs: list[tuple[int, ...]] = [() for _ in range(batch)]
    # The sequences reach `context` tokens over the timed steps.
    prompts = _prompts(batch, context - steps - 2, min(runner.vocab_size, 60))
    graphs = getattr(forward, "graphs", None)
    if graphs is not None:  # capture the timed shapes' graphs ahead: what a server warm-up does
        graphs.prepare(batch, max_kv=context, min_kv=context - steps - 1)
    for _ in range(2):  # KV: the prefill, then a warm decode step; recompute: two warm-up steps
        draws = step(_rows(prompts, outputs))
        outputs = [(*o, d.token_id) for o, d in zip(outputs, draws, strict=True)]
    _sync(runner.device)
    start = time.perf_counter()
    for _ in range(steps):
        draws = step(_rows(prompts, outputs))
        outputs = [(*o, d.token_id) for o, d in zip(outputs, draws, strict=True)]
    _sync(runner.device)
    return (time.perf_counter() - start) / steps, [t for o in outputs for t in o[2:]]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (bytes read plus bytes written), median of 5."""
    n = 1 << 30 if device.type == "cuda" else 1 << 27
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * n / sorted(times[1:])[2]


def step_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """The fewest bytes one decode step moves: each weight once, each row's K/V (context tokens) once."""
    config = runner.config
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())  # tied: counted once
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    element = runner.model.dtype.itemsize
    kv = batch * context * int(config.num_hidden_layers) * 2 * kv_heads * head_dim * element
    return weights + kv


def _same(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def reference_generate(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """Seconds per decode step of transformers' own `generate` with a static cache on the same
    prompts (sampling at temperature 1, no stop), the reference the built-in engine is held to.

    transformers compiles the static-cache decode step on first use (tens of seconds on a GPU), so
    a warm-up call with the same shapes comes first; the prefill is taken out by timing
    `steps + 1` new tokens against 1.
    """
    prompts = torch.tensor(_prompts(batch, context, runner.config.vocab_size), device=runner.device)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        cache_implementation="static",
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones_like(prompts),
    )

    def timed(new_tokens: int) -> float:
        _sync(runner.device)
        start = time.perf_counter()
        with torch.no_grad():
            runner.model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        _sync(runner.device)
        return time.perf_counter() - start

    timed(steps + 1)  # compile and warm up at these shapes
    return max(timed(steps + 1) - timed(1), 0.0) / steps


def qwen3_06b_folder(path: Path, layers: int = 28) -> Path:
    """A random-init Qwen3 with the 0.6B model's shape (596M parameters), with the tiny tokenizer
    (the benchmark feeds token ids; no text is decoded). Fewer `layers` keep each token's cost
    structure (the widths, the vocabulary) at a CPU's scale."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.tasks.tiny_model import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1_000_000,
        torch_dtype="bfloat16",
        # The tiny tokenizer's ids: an engine with a length tail ends requests with EOS, and
        # refuses a model that names none (the modes benchmark's tail engine did, on the H200).
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def main(args: argparse.Namespace) -> None:
    global FUSE_OPS
    FUSE_OPS = args.fuse_ops
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_path:
            path = Path(args.model_path)
        elif args.qwen3_06b:
            path = qwen3_06b_folder(Path(tmp) / "qwen3-0.6b")
        else:
            path = make_model_folder(Path(tmp) / "model", seed=0, max_positions=args.max_positions)
        context_cap = max(_ints(args.contexts) + _ints(args.sweep_contexts)) + 1
        runner = ModelRunner(path, dtype=getattr(torch, args.dtype), device=args.device, context_length=context_cap)
        if runner.device.type == "cuda":
            # cuDNN's SDPA builds a graph for every new KV length: a decode step pays it each time.
            torch.backends.cuda.enable_cudnn_sdp(False)
        cases = [(b, t) for t in _ints(args.contexts) for b in _ints(args.batches)]
        verdicts: list[str] = []
        cases += [(args.sweep_batch, t) for t in _ints(args.sweep_contexts) if (args.sweep_batch, t) not in cases]
        print(
            f"model {runner.config.model_type} ({sum(p.numel() for p in runner.model.parameters()):,} params), "
            f"{args.dtype} on {runner.device}, {torch.get_num_threads()} threads, {args.steps} timed steps"
        )
        graphed = runner.device.type == "cuda" and not args.disable_cuda_graph
        bandwidth = copy_bandwidth(runner.device)
        print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); bw = floor / step time")

        def bw(batch: int, context: int, seconds: float) -> str:
            return f"{step_bytes(runner, batch, context) / bandwidth / seconds:>6.1%}"

        print(
            f"{'running':>8} {'context':>8} {'old tok/s':>10} {'old ms':>8} {'eager tok/s':>12} {'eager ms':>9} "
            + (f"{'graphs tok/s':>13} {'graphs ms':>10} {'replay ms':>10} {'same tokens':>12} " if graphed else "")
            + f"{'speed-up':>9} {'bw':>6}"
        )
        for batch, context in cases:
            old = math.nan if args.skip_old else measure(runner, runner, batch, context, args.steps)[0]
            eager, eager_tokens, _ = _kv(runner, batch, context, args.steps, DecodeMode.EAGER)
            line = f"{batch:>8} {context:>8} {batch / old:>10.0f} {old * 1e3:>8.1f} "
            line += f"{batch / eager:>12.0f} {eager * 1e3:>9.1f} "
            best = eager
            if graphed:
                best, tokens, replay = _kv(runner, batch, context, args.steps, DecodeMode.GRAPHS)
                line += f"{batch / best:>13.0f} {best * 1e3:>10.1f} {replay * 1e3:>10.1f} "
                line += f"{_same(tokens, eager_tokens):>12.1%} "
            # On a GPU: graphs over eager; on a CPU: the KV cache over recompute.
            print(line + f"{(eager if graphed else old) / best:>8.1f}x {bw(batch, context, best)}", flush=True)
            if batch == 1:
                verdicts.append(f"batch 1: {best * 1e3:.2f} ms/step (target <= 3 ms): {_verdict(best <= 3e-3)}")
        for batch in _ints(args.reference_batches):
            context = _ints(args.contexts)[0]
            ref = reference_generate(runner, batch, context, args.steps)
            eager = _kv(runner, batch, context, args.steps, DecodeMode.EAGER)[0]
            mode = DecodeMode.GRAPHS if graphed else DecodeMode.EAGER
            new = _kv(runner, batch, context, args.steps, mode)[0]
            print(
                f"reference: transformers generate (static cache) B={batch} T={context}: {batch / ref:.0f} tok/s, "
                f"{ref * 1e3:.1f} ms/step, bw {bw(batch, context, ref).strip()}; built-in KV engine, {mode.value}: "
                f"{batch / new:.0f} tok/s, {new * 1e3:.1f} ms/step, bw {bw(batch, context, new).strip()} "
                f"({new / ref:.2f}x the reference's step time; eager {eager * 1e3:.1f} ms/step)",
                flush=True,
            )
            verdicts.append(
                f"batch {batch}: {new / ref:.2f}x transformers' static-cache generate (target <= 1.0): "
                f"{_verdict(new <= ref)}"
            )
        for line in verdicts:
            print(f"target {line}")


def _kv(runner: ModelRunner, batch: int, context: int, steps: int, mode: DecodeMode) -> tuple[float, list[int], float]:
    """`measure` on a fresh KV forward of `batch` slots, freed afterwards (its cache and graphs),
    plus the time of a graph replay alone (NaN without graphs)."""
    kv = KVCacheForward(runner, max_running_requests=batch, decode=mode, fuse_ops=FUSE_OPS)
    try:
        step, tokens = measure(runner, kv, batch, context, steps)
        replay = math.nan
        if kv.graphs is not None and not kv.graphs.statistics().capturing:
            print(f"WARNING: CUDA graph capture failed at B={batch}: that case's graphs column is eager")
        elif kv.graphs is not None:
            replay = _replay_time(runner, kv, batch, context, steps)
        return step, tokens, replay
    finally:
        del kv
        gc.collect()
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()


def _replay_time(runner: ModelRunner, kv: KVCacheForward, batch: int, context: int, steps: int) -> float:
    """Seconds of the graph's decode alone (no LM head, no sampling, no host work around it)."""
    assert kv.graphs is not None
    args = ([5] * batch, [context - 2] * batch, list(range(batch)))
    with torch.inference_mode():
        kv.graphs.decode(*args)
        _sync(runner.device)
        start = time.perf_counter()
        for _ in range(steps):
            kv.graphs.decode(*args)
        _sync(runner.device)
    return (time.perf_counter() - start) / steps


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model-path", default=None, help="a Hugging Face folder; default: the tiny quick-start model")
    parser.add_argument("--qwen3-06b", action="store_true", help="a random-init Qwen3 of the 0.6B shape")
    parser.add_argument("--max-positions", type=int, default=512, help="context window of the built tiny model")
    parser.add_argument("--batches", default="1,16,64,256", help="running requests, at each of --contexts")
    parser.add_argument("--contexts", default="256", help="tokens per sequence")
    parser.add_argument("--sweep-batch", type=int, default=64, help="running requests for the context sweep")
    parser.add_argument("--sweep-contexts", default="64,448")
    parser.add_argument("--skip-old", action="store_true", help="time only the KV-cache forward")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="on a GPU, time the eager KV decode only")
    parser.add_argument("--steps", type=int, default=6, help="timed decode steps per case")
    parser.add_argument(
        "--fuse-ops", action="store_true", help="the engine's RMSNorms and rotary embedding compiled (fused_ops.py)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--reference-batches",
        default="",
        help="also time transformers' static-cache generate at these batch sizes (e.g. 128)",
    )
    main(parser.parse_args())
