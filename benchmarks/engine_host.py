"""The built-in engine's cost per request in flight: its scheduler and forward together, as a run
drives them, at a few concurrencies.

    python -m benchmarks.engine_host [--requests 22,61] [--tokens 300] [--device cpu]
                                     [--model-path DIR | --hidden 32 --layers 1] [--dtype float32]
                                     [--tail 1024 --group 8 --groups 48]

Why: on the H100's time-to-target set (a 19M model) the engine decoded 6,470 tokens/s with about
22 of its 64 slots in flight (sync) and 9,020 with about 61 (async): each request in flight made a
decode step about 90 us longer, which bounds the async modes' throughput, and with it their time to
a target (BENCHMARKS 16, the tenth session). Was it the engine's own work per request? On two H100
machines it was not: 8-20 us a request beyond 22; and under the set's load (the last case below)
the engine alone made 14,000 tokens/s with 56 requests in flight, 1.55x what the async runs got
from it (the eleventh session). This measures that work where it lives: `EngineCore` (the
scheduler: rows, tokens, finishes, waking waiters) over `KVCacheForward` (the forward: slots,
sampling; CUDA graphs on a GPU), N requests of
`--tokens` tokens each started together, and each one awaited as the HTTP surface awaits it.

For each N it prints the mean decode step and its share per request, twice side by side: with
whole-answer waiters (what `/generate` does, and the pipeline asks for) and with streaming ones
(`"stream": true`, woken at every token), the difference being what waking a waiter at every
token costs. Then N = the largest again with the model's forward replaced by an instant one: the
scheduler alone. The default model is tiny (its forward costs little on any device), so what is
left is host work; `--model-path` times a real one, and `--hidden 512 --layers 8 --heads 8` the
time-to-target set's shape with random weights (`STEPS="engine-host"` in `gpu_check.sh`).

Last, the load a run puts on the engine, which the cases above leave out: requests come and go.
Groups of `--group` requests (one prompt, one asked length, as the time-to-target task's groups)
with lengths drawn as that task draws them (P(n) ~ 1/n up to `--tail`: most answers short, each
group's slots freed and taken again by the next group's prefill), as many groups in flight as fit
in N requests, the next one sent as one finishes. Timed while groups are still waiting to be sent
(the drain, where a few long answers decode alone, is left out), it prints tokens/s against the
decode-alone tokens/s at the same N, and the share of the time the prefills took.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
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


def tail_lengths(groups: int, longest: int, seed: int = 0) -> list[int]:
    """Asked lengths as the time-to-target task draws them: P(n) ~ 1/n for n in 1..`longest`."""
    counts = range(1, longest + 1)
    return random.Random(seed).choices(counts, weights=[1 / n for n in counts], k=groups)


@dataclass(frozen=True)
class Turnover:
    """What the engine did while groups were still waiting to be sent."""

    in_flight: int  # requests in flight: whole groups that fit in N
    seconds: float
    tokens: int  # generated in that time
    steps: int
    prefill_seconds: float  # of those seconds, the steps that prefilled (decoding beside them)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


async def turnover(forward: KVCacheForward, requests: int, group: int, lengths: Sequence[int]) -> Turnover:
    """Groups of `group` requests, the i-th asking for lengths[i] tokens, as many in flight as fit
    in `requests` (a group larger than that is cut to it), the next group sent as one finishes;
    timed until the last group is sent."""
    group = min(group, requests)
    workers = requests // group
    core = EngineCore(forward, max_running_requests=workers * group)
    queue = iter(enumerate(lengths))  # shared: a worker takes the next group as its own finishes
    sent = anyio.Event()

    async def worker() -> None:
        for g, n in queue:
            # The prompt differs per group (no cache shared between them); the end token counts.
            params = SamplingParams(max_new_tokens=n + 1, ignore_eos=True)
            prompt = (3 + g % 5, 4, 5, 6) * 4
            reqs = [Request(rid=f"{g}-{i}", prompt_ids=prompt, params=params) for i in range(group)]
            for req in reqs:
                await core.submit(req)
            for req in reqs:
                await req.wait_finished()
        sent.set()  # the first worker to find the queue empty: the rest is the drain

    async with anyio.create_task_group() as tg:
        await tg.start(core.run)
        before, at_start = forward.statistics(), core.statistics()
        started = time.perf_counter()
        for _ in range(workers):
            tg.start_soon(worker)
        await sent.wait()
        seconds = time.perf_counter() - started
        after, at_end = forward.statistics(), core.statistics()
        tg.cancel_scope.cancel()
    return Turnover(
        in_flight=workers * group,
        seconds=seconds,
        tokens=at_end.generated_tokens - at_start.generated_tokens,
        steps=at_end.steps - at_start.steps,
        prefill_seconds=after.prefill_seconds - before.prefill_seconds,
    )


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
    p.add_argument("--tail", type=int, default=1024, help="the longest asked length of the turnover case")
    p.add_argument("--group", type=int, default=8, help="requests a group in the turnover case")
    p.add_argument("--groups", type=int, default=48, help="groups the turnover case sends (0: no such case)")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.requests.split(",")]
    if any(n < 1 for n in counts) or args.tokens < 2:
        p.error(f"--requests {args.requests!r} and --tokens {args.tokens}: at least 1 request and 2 tokens")
    if args.groups < 0 or args.tail < 1 or args.group < 1:
        p.error(f"--groups {args.groups}, --tail {args.tail}, --group {args.group}: groups >= 0, tail and group >= 1")
    longest = max(args.tokens, args.tail + 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = (
            Path(args.model_path)
            if args.model_path
            else make_model_folder(
                Path(tmp) / "m",
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=args.heads,
                max_positions=longest + 64,
            )
        )
        runner = ModelRunner(path, dtype=getattr(torch, args.dtype), device=args.device, context_length=longest + 32)
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
    if args.groups:
        lengths = tail_lengths(args.groups, args.tail)
        print(f"turnover: groups of {args.group}, asked lengths 1/n up to {args.tail} (mean "
              f"{statistics.fmean(lengths):.0f}), {args.groups} groups sent, timed until the last is sent")  # fmt: skip
        print(f"{'requests':>8} {'in flight':>10} {'tokens/s':>9} {'decode alone':>13} {'ratio':>6} "
              f"{'ms/step':>8} {'prefill share':>14}")  # fmt: skip
        for n in counts:
            runs = [anyio.run(turnover, forward, n, args.group, lengths) for _ in range(args.repeats)]
            t = sorted(runs, key=lambda r: r.tokens_per_second)[len(runs) // 2]  # the median run
            alone_rate = n / statistics.median(seconds[(n, False)])
            print(f"{n:>8} {t.in_flight:>10} {t.tokens_per_second:>9.0f} {alone_rate:>13.0f} "
                  f"{t.tokens_per_second / alone_rate:>5.2f}x {t.seconds / max(t.steps, 1) * 1e3:>8.2f} "
                  f"{t.prefill_seconds / t.seconds:>14.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
