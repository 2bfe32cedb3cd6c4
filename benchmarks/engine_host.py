"""The built-in engine's cost per request in flight: its scheduler and forward together, as a run
drives them, at a few concurrencies.

    python -m benchmarks.engine_host [--requests 22,61] [--tokens 300] [--device cpu]
                                     [--model-path DIR | --hidden 32 --layers 1] [--dtype float32]

Why: on the H100's time-to-target set (a 19M model) the engine decoded 6,470 tokens/s with about
22 of its 64 slots in flight (sync) and 9,020 with about 61 (async): each request in flight made a
decode step about 90 us longer, so the async modes' throughput, and with it their time to a target,
is bounded by host work per request, not by the device (BENCHMARKS 16, the tenth session). This
measures that work where it lives: `EngineCore` (the scheduler: rows, tokens, finishes, waking
waiters) over `KVCacheForward` (the forward: slots, sampling; CUDA graphs on a GPU), N requests of
`--tokens` tokens each started together, and each one awaited as the HTTP surface awaits it.

For each N it prints the mean decode step and its share per request, twice side by side: with
whole-answer waiters (what `/generate` does, and the pipeline asks for) and with streaming ones
(`"stream": true`, woken at every token), the difference being what waking a waiter at every
token costs. Then N = the largest again with the model's forward replaced by an instant one: the
scheduler alone. The default model is tiny (its forward costs little on any device), so what is
left is host work; `--model-path` times a real one, and `--hidden 512 --layers 8 --heads 8` the
time-to-target set's shape with random weights (`STEPS="engine-host"` in `gpu_check.sh`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import torch

from engines.kv_forward import DecodeMode, KVCacheForward
from engines.request import Request
from engines.scheduler import EngineCore
from engines.seam import Draw, ModelForward, Row, SamplingParams
from engines.torch_model import ModelRunner
from pipeline.tasks.tiny_model import make_model_folder


class InstantForward:
    """The forward's seam answered at once (token 5 for every row): the scheduler alone."""

    model_path = "instant"
    vocab_size = 16
    context_length = 1 << 20
    eos_token_ids = frozenset({1})
    engine_version = "instant"
    keeps_kv_cache = False
    tokenizer = None

    async def forward(self, rows: Sequence[Row]) -> Sequence[Draw | None]:
        return [Draw(5, -0.5) for _ in rows]

    def release(self, row: Row) -> None:
        pass

    def idle(self) -> None:
        pass


async def decode(forward: ModelForward, requests: int, tokens: int, stream: bool) -> float:
    """Seconds a decode step took with `requests` requests of `tokens` tokens started together,
    each awaited whole or streamed (the prefill step left out)."""
    core = EngineCore(forward, max_running_requests=requests)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    reqs = [Request(rid=str(i), prompt_ids=(3, 4, 5, 6) * 4, params=params) for i in range(requests)]

    async def wait(req: Request) -> None:
        if stream:
            async for _ in req.changes():
                pass
        else:
            await req.wait_finished()

    async with anyio.create_task_group() as tg:
        await tg.start(core.run)
        for req in reqs:
            await core.submit(req)
        await core.wait_step()  # the prefill
        started, first = time.perf_counter(), core.statistics().steps
        async with anyio.create_task_group() as waiters:
            for req in reqs:
                waiters.start_soon(wait, req)
        seconds = time.perf_counter() - started
        steps = core.statistics().steps - first
        tg.cancel_scope.cancel()
    return seconds / max(steps, 1)  # each finished request released its slot as it left


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", default="22,61", help="requests in flight, comma-separated")
    p.add_argument("--tokens", type=int, default=300, help="tokens each request decodes")
    p.add_argument("--repeats", type=int, default=3, help="runs of each case, alternating; the median is shown")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model-path", default=None, help="a Hugging Face folder (default: a tiny model built here)")
    p.add_argument("--hidden", type=int, default=32, help="the tiny model's width")
    p.add_argument("--layers", type=int, default=1, help="the tiny model's layers")
    p.add_argument("--heads", type=int, default=2, help="the tiny model's attention heads")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.requests.split(",")]
    if any(n < 1 for n in counts) or args.tokens < 2:
        p.error(f"--requests {args.requests!r} and --tokens {args.tokens}: at least 1 request and 2 tokens")
    with tempfile.TemporaryDirectory() as tmp:
        path = (
            Path(args.model_path)
            if args.model_path
            else make_model_folder(
                Path(tmp) / "m",
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=2,
                max_positions=args.tokens + 64,
            )
        )
        runner = ModelRunner(
            path, dtype=getattr(torch, args.dtype), device=args.device, context_length=args.tokens + 32
        )
    if runner.device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine runs it
    mode = DecodeMode.GRAPHS if runner.device.type == "cuda" else DecodeMode.EAGER
    params = sum(x.numel() for x in runner.model.parameters())
    print(f"{runner.config.model_type} ({params:,} params), {args.dtype} on {runner.device}, decode {mode.value}, "
          f"{args.tokens} tokens a request, median of {args.repeats}")  # fmt: skip
    print(f"{'requests':>8} {'whole ms/step':>14} {'us/request':>11} {'stream ms/step':>15} {'us/request':>11} "
          f"{'stream/whole':>13}")  # fmt: skip
    largest = max(counts)
    forward = KVCacheForward(runner, max_running_requests=largest, decode=mode)
    cases = [(n, stream) for n in counts for stream in (False, True)]
    cases.append((largest, None))  # None: the instant forward, whole answers
    seconds: dict[tuple[int, bool | None], list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):  # alternating, so the machine's drift falls on every case alike
        for n, stream in cases:
            used: ModelForward = InstantForward() if stream is None else forward
            seconds[(n, stream)].append(anyio.run(decode, used, n, args.tokens, bool(stream)))
    for n in counts:
        whole, streamed = (statistics.median(seconds[(n, s)]) for s in (False, True))
        print(f"{n:>8} {whole * 1e3:>14.2f} {whole / n * 1e6:>11.1f} {streamed * 1e3:>15.2f} "
              f"{streamed / n * 1e6:>11.1f} {streamed / whole:>12.2f}x")  # fmt: skip
    alone = statistics.median(seconds[(largest, None)])
    print(f"the scheduler alone (an instant forward), {largest} requests: {alone * 1e3:.2f} ms a step, "
          f"{alone / largest * 1e6:.1f} us a request")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
