"""Publish stall and transfer time: disk vs torch.distributed vs CUDA IPC, paused vs overlapped, on one engine.

    python -m benchmarks.publish_transfer [--quick] [--device cpu|cuda] [--dtype bfloat16]
        [--model-size tiny|0.6b] [--publishes 3] [--bucket-mb 512]

A built-in engine subprocess serves the model while one long streamed request decodes; the trainer
side (this process) holds the same model and publishes it `--publishes` times per way:

- disk: `save_pretrained` into a fresh folder, then `/update_weights_from_disk` (save time shown apart);
- distributed: broadcast over the weight-update group (gloo on CPU, NCCL on a GPU);
- ipc (GPU): `/update_weights_from_tensor`, the trainer's tensors handed over as CUDA IPC handles in
  flattened buckets (what `--colocate` sends; `stages/sglang_client/publish_tensor.py`): built
  before the gate closes, one a dtype, while the engine holds its memory; `--bucket-mb` each after
  a release (the colocated row). A line after the table splits its time: `prepare` (building
  the buckets, before the gate), `engines` (the update calls), and the engine's own open, copy
  and close of the last bucket (`/server_info`'s `last_tensor_update_seconds`);
- each paused (`in_place`: the engine stops for the whole update) and overlapped (the engine keeps
  decoding into a staging copy and swaps between two steps); ipc is paused only (the rules refuse
  overlap with it: each bucket goes into the live weights);
- ipc, colocated (GPU, torch-memory-saver installed): slime's sequence with nothing streaming, as
  after a sync round: release every tag, then the publish (resume weights, the buckets, resume the
  KV cache and graphs); its stall is the gate, the engine's whole stop, and `resume` the part of it
  the two resumes took.

Columns (medians, seconds): save (disk only), transfer (the update call), gate (the publish end to
end, as the pipeline's admission gate sees it), stall (the longest gap between two streamed
tokens of the running request during the publish: what decoding actually lost).
`--quick` is the tiny model for a CPU smoke run; `--model-size 0.6b` the random-init Qwen3-0.6B shape.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import torch

from core.clock import VersionClock
from core.types import PauseMode
from launch.builtin_engine import start_engine
from pipeline.tasks.tiny_model import make_model_folder
from stages.publisher import publish_weights
from stages.sglang_client import EngineFleet
from stages.sglang_client.publish_distributed import DistributedWeightSender
from stages.sglang_client.publish_tensor import ColocatedWeights


class _Stream:
    """Long streamed requests, one after another; records when each chunk arrived."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []

    async def run(self, url: str, max_new_tokens: int) -> None:
        body = {
            "input_ids": [5, 6, 7, 8],
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.0},
        }
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while True:  # one request after another, so that one is always decoding
                async with s.post(url + "/generate", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data:") and b"[DONE]" not in line:
                            self.arrivals.append(time.perf_counter())

    def longest_gap(self, start: float, end: float) -> float:
        # The gap that spans the publish counts too: take arrivals from just before it.
        times = [t for t in self.arrivals if t <= end]
        before = [t for t in times if t < start]
        window = ([before[-1]] if before else []) + [t for t in times if t >= start]
        return max((b - a for a, b in itertools.pairwise(window)), default=float("nan"))


def _model_folder(args: argparse.Namespace, root: Path) -> Path:
    if args.model_size == "0.6b":
        from benchmarks.engine import qwen3_06b_folder

        return qwen3_06b_folder(root / "qwen3-0.6b")
    return make_model_folder(root / "tiny", seed=0)


async def _publish_once(
    way: str,
    overlap: bool,
    clock: VersionClock,
    fleet: EngineFleet,
    model: torch.nn.Module,
    senders: dict[str, Any],
    root: Path,
    stream: _Stream,
) -> dict[str, float]:
    with torch.no_grad():  # new values each time, so every publish really changes the weights
        next(model.parameters()).add_(1e-3)
    save = 0.0
    folder = root / f"v{clock.version + 1}"
    if way == "disk":
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(lambda: model.save_pretrained(folder))
        save = time.perf_counter() - t0
    start = time.perf_counter()
    report = await publish_weights(
        clock,
        fleet,
        folder,
        pause_mode=PauseMode.IN_PLACE,
        overlap=overlap,
        transfer=senders.get(way),
    )
    end = time.perf_counter()
    await anyio.sleep(0.5)  # let the stream show the first token after the publish
    row = {
        "save": save,
        "transfer": report.update_seconds,
        "gate": report.gate_closed_seconds,
        "stall": stream.longest_gap(start, end + 0.5),
    }
    sender = senders.get(way)
    if isinstance(sender, ColocatedWeights):  # where an IPC publish's time goes, both sides
        row.update(prepare=sender.timings.get("prepare", 0.0), engines=sender.timings["engines"])
        row.update({f"engine {k}": v for k, v in (await _engine_update_timings(fleet)).items()})
    return row


async def _engine_update_timings(fleet: EngineFleet) -> dict[str, float]:
    """The engine's own split of its last `/update_weights_from_tensor` (open, copy, close)."""
    async with aiohttp.ClientSession() as s, s.get(fleet.worker_urls[0] + "/server_info") as r:
        info = await r.json()
    return {k: float(v) for k, v in (info.get("last_tensor_update_seconds") or {}).items()}


def _placement(device: str) -> tuple[str, tuple[str, ...]]:
    """The engine's device and the ways to publish: NCCL refuses two ranks on one GPU, so on a
    one-GPU machine the distributed rows are left out (said in the output); CUDA IPC needs the
    engine on the trainer's GPU, so with two GPUs it has its own run (`--ipc-only`)."""
    if not device.startswith("cuda"):
        print("CPU: CUDA IPC rows left out", flush=True)
        return device, ("disk", "distributed")
    if torch.cuda.device_count() > 1:
        return "cuda:1", ("disk", "distributed")
    print("one GPU: NCCL cannot join trainer and engine on it; distributed rows left out", flush=True)
    return device, ("disk", "ipc")


def _memory_saver(device: str) -> list[str]:
    """Colocated rows need the engine's memory saver (and its package)."""
    import importlib.util

    if device.startswith("cuda") and importlib.util.find_spec("torch_memory_saver") is not None:
        return ["--enable-memory-saver"]
    return []


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = _model_folder(args, root)
        dtype = getattr(torch, args.dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
        engine_device, ways = _placement(args.device)
        saver = _memory_saver(engine_device) if "ipc" in ways else []
        engine = await start_engine(
            path,
            startup_timeout=600,
            extra_args=[
                "--device", engine_device, "--dtype", args.dtype, "--context-length", str(args.context), *saver,
            ],
        )  # fmt: skip
        rows: dict[str, list[dict[str, float]]] = {}
        async with engine, EngineFleet([engine.url]) as fleet:
            senders: dict[str, Any] = {}
            if "distributed" in ways:
                senders["distributed"] = DistributedWeightSender(model.named_parameters, fleet, device=args.device)
            if "ipc" in ways:
                senders["ipc"] = ColocatedWeights(
                    model.named_parameters, fleet, device=args.device, bucket_bytes=args.bucket_mb << 20
                )
            clock = VersionClock()
            stream = _Stream()
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.run, engine.url, args.context - 8)
                while len(stream.arrivals) < 3:  # noqa: ASYNC110 - a benchmark waiting for a stream's first tokens
                    await anyio.sleep(0.05)
                for way in ways:
                    for overlap in (False, True) if not way.startswith("ipc") else (False,):
                        name = f"{way}, {'overlapped' if overlap else 'paused'}"
                        for _ in range(args.publishes):
                            one = await _publish_once(way, overlap, clock, fleet, model, senders, root, stream)
                            rows.setdefault(name, []).append(one)
                        print(f"{name}: {orjson.dumps(rows[name][-1]).decode()}", flush=True)
                tg.cancel_scope.cancel()
            if saver:
                await fleet.abort_all()  # the stream's last request: a release needs an idle engine
                colocated = senders["ipc"]
                for _ in range(args.publishes):
                    one = await _colocated_once(clock, fleet, model, colocated, root)
                    rows.setdefault("ipc, colocated", []).append(one)
                print(f"ipc, colocated: {orjson.dumps(rows['ipc, colocated'][-1]).decode()}", flush=True)
            if "distributed" in senders:
                await senders["distributed"].close()
    _table(args, rows)


async def _colocated_once(
    clock: VersionClock, fleet: EngineFleet, model: torch.nn.Module, colocated: ColocatedWeights, root: Path
) -> dict[str, float]:
    """slime's sequence after a sync round: release, (training), publish with the resumes."""
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    await colocated.release()
    report = await publish_weights(clock, fleet, root, pause_mode=PauseMode.ABORT, transfer=colocated)
    t = colocated.timings
    return {
        "save": 0.0,
        "transfer": t["buckets"],
        "gate": report.gate_closed_seconds,
        "stall": report.gate_closed_seconds,
        "resume": t["resume_weights"] + t["resume_rest"],
    }


def _table(args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]]) -> None:
    print(f"\n{args.model_size} model, {args.dtype} on {args.device}; medians of {args.publishes} publishes (seconds)")
    cols = ["save", "transfer", "gate", "stall", "resume"]
    print(f"{'way':26}" + "".join(f"{c:>10}" for c in cols))
    for name, runs in rows.items():
        cells = [statistics.median(r[c] for r in runs) if c in runs[0] else float("nan") for c in cols]
        print(f"{name:26}" + "".join(f"{v:>10.3f}" for v in cells))
    # An IPC publish's transfer, split: the sender's wait for the engines' answers (the rest is
    # HTTP and bookkeeping), and the engine's own open, copy and close of the last bucket.
    split = ["prepare", "engines", "engine open", "engine copy", "engine close"]
    for name, runs in rows.items():
        if "engines" in runs[0]:
            parts = ", ".join(f"{c} {statistics.median(r.get(c, float('nan')) for r in runs) * 1e3:.1f}" for c in split)
            print(f"{name}: ms: {parts} (prepare: before the gate closed)")
    ipc = rows.get("ipc, paused")
    if ipc:
        stall = statistics.median(r["stall"] for r in ipc)
        verdict = "met" if stall <= 0.020 else "MISSED"
        print(f"target ipc publish stall <= 20 ms: {stall * 1e3:.1f} ms ({verdict})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (trainer and engine share it)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "0.6b"])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 publishes per way (CPU smoke run)")
    parser.add_argument("--publishes", type=int, default=3)
    parser.add_argument("--context", type=int, default=4096, help="the streamed request's room (tokens)")
    parser.add_argument("--bucket-mb", type=int, default=512, help="ipc: the most MiB in one bucket (slime's 512)")
    a = parser.parse_args()
    if a.quick:
        a.model_size, a.publishes, a.context = "tiny", 2, min(a.context, 500)
    anyio.run(main, a)
