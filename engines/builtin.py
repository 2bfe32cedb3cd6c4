"""The built-in engine: an SGLang-compatible HTTP server running a real torch causal LM.

    python -m engines.builtin --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--max-running-requests 64] [--context-length N] [--device cpu|cuda|cuda:N]
        [--dtype float32] [--kv-cache slots|none] [--disable-cuda-graph] [--cuda-graph-max-bs N] [--fuse-ops]
        [--weight-version 0] [--log-level info] [--api-key KEY] [--max-body-mb MIB]
        [--length-tail lognormal:-1.9,0.8] [--length-tail-truncate-frac 0.1] [--length-tail-limit N]
        [--enable-memory-saver] [--enable-weights-cpu-backup] [--mem-fraction-static F]

The HTTP surface (`http.py`) and scheduler (`scheduler.py`) are every engine's; this module loads
the model folder and picks the forward: `kv_forward.KVCacheForward` (the default: a KV cache of
`max-running-requests x context-length` slots, continuous batching) or, with `--kv-cache none`,
`torch_model.TorchForward` (recomputes every sequence each step; kept as the reference the cached
path is tested against). On a cuda device the KV forward's decode step is replayed from CUDA
graphs (`decode_graphs.py`); `--disable-cuda-graph` (SGLang's flag) keeps it eager and
`--cuda-graph-max-bs` bounds the largest graphed batch. No prefix cache (`cached_tokens` is
always 0); weights change through `/update_weights_from_disk` or over torch.distributed
(`/init_weights_update_group`, `/update_weights_from_distributed`: `weight_group.py`, staged and
swapped the same way, by copying into the live tensors, which the graphs read).

Publishing without stopping the engine: an update sent without a pause is read from disk into a
staging copy while decoding goes on, then copied into the live weights between two decode steps;
the version spans of running requests mark that step exactly. (With the KV forward, running
requests keep the K/V their earlier tokens got from the old weights, as SGLang's do.)

Colocated with a trainer on one GPU (slime's `--colocate`): `--enable-memory-saver` (SGLang's flag)
allocates the weights, the KV cache and the CUDA graphs' pool in releasable regions
(`memory_saver.py`), so `/release_memory_occupation` gives them back while the trainer trains and
`/resume_memory_occupation` takes them again (`occupation.py`); the new weights come by CUDA IPC
(`/update_weights_from_tensor`, `tensor_weights.py`). `--mem-fraction-static F` (SGLang's) caps the
weights plus the KV cache at F of the GPU's memory, by shortening the cache's context (its slots
are the concurrency the pipeline counts on), so that trainer and engine fit side by side.

In-process use (tests): `async with open_server(model_dir, port=0) as server: server.url`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from core.errors import ConfigError
from engines.guards import add_guard_arguments, guard_options
from engines.http import EngineServer
from engines.kv_forward import DecodeMode, KVCacheForward, kv_bytes_per_position
from engines.length_tail import LengthTail
from engines.memory_saver import open_memory_saver, preload_environment
from engines.occupation import MemoryOccupation
from engines.serving import open_engine, run_main
from engines.sim_model import LengthModel
from engines.tensor_weights import TensorWeightReceiver
from engines.torch_model import ModelRunner, TorchForward, WeightLoadError
from engines.weight_group import WeightGroupReceiver

__all__ = ["EngineServer", "main", "open_server", "serve"]

log = logging.getLogger(__name__)


@asynccontextmanager
async def open_server(
    model_path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    context_length: int | None = None,
    kv_cache: str = "slots",
    max_running_requests: int = 64,
    disable_cuda_graph: bool = False,
    cuda_graph_max_bs: int | None = None,
    fuse_ops: bool = False,
    length_tail: LengthTail | None = None,
    enable_memory_saver: bool = False,
    weights_cpu_backup: bool = False,
    mem_fraction_static: float | None = None,
    **options: Any,
) -> AsyncIterator[EngineServer]:
    """Load the model, start the decode loop and listen; yield the server (port 0 picks a free port).

    `kv_cache` is "slots" (KV cache, continuous batching) or "none" (recompute every step);
    on a cuda device the slots' decode step runs from CUDA graphs unless `disable_cuda_graph`;
    `context_length` caps the model's window (and so the cache). `options` are
    `serving.open_engine`'s (host, port, weight_version, random_seed, served_model_name,
    health_check_timeout). On exit every request in flight is
    aborted (clients get their partial output), then the listener and the loop stop.
    """
    import torch

    problems = []
    if kv_cache not in ("slots", "none"):
        problems.append(f"kv_cache must be 'slots' or 'none', got {kv_cache!r}")
    if context_length is not None and context_length < 2:
        problems.append(f"context_length must be at least 2, got {context_length}")
    if max_running_requests < 1:
        problems.append(f"max_running_requests must be >= 1, got {max_running_requests}")
    if cuda_graph_max_bs is not None and cuda_graph_max_bs < 1:
        problems.append(f"cuda_graph_max_bs must be >= 1, got {cuda_graph_max_bs}")
    if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
        problems.append(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    if problems:
        raise ConfigError(problems)
    try:
        saver = open_memory_saver(
            torch.device(device), enabled=enable_memory_saver, weights_cpu_backup=weights_cpu_backup
        )
    except RuntimeError as exc:  # a device string torch does not know
        raise ConfigError([f"device {device!r} is not usable here: {exc}"]) from exc
    load = functools.partial(
        ModelRunner,
        model_path,
        dtype=getattr(torch, dtype),
        device=device,
        context_length=context_length,
        memory=saver,
    )
    runner = await anyio.to_thread.run_sync(load)
    if mem_fraction_static is not None and kv_cache == "slots":
        runner.context_length = _fitting_context(runner, max_running_requests, mem_fraction_static)
    if runner.device.type == "cuda":
        # cuDNN's SDPA builds a graph for every new KV length: 79-95 ms a step cold on an H200.
        torch.backends.cuda.enable_cudnn_sdp(False)
    graphs = runner.device.type == "cuda" and not disable_cuda_graph
    forward = (
        KVCacheForward(
            runner,
            max_running_requests=max_running_requests,
            decode=DecodeMode.GRAPHS if graphs else DecodeMode.EAGER,
            graph_max_batch=cuda_graph_max_bs,
            fuse_ops=fuse_ops,
        )
        if kv_cache == "slots"
        else TorchForward(runner)
    )
    async with open_engine(
        forward, max_running_requests=max_running_requests, length_tail=length_tail, **options
    ) as server:
        occupation = MemoryOccupation(
            saver,
            server.core,
            weight_groups=runner.tied_groups,
            after_kv_resume=forward.zero_cache if isinstance(forward, KVCacheForward) else lambda: None,
            device=runner.device if runner.device.type == "cuda" else None,
        )
        server.occupation = occupation
        server.weight_group = WeightGroupReceiver(runner, server.core, occupation=occupation)
        server.weight_tensors = TensorWeightReceiver(runner, server.core, occupation)
        log.info("built-in engine serving %s at %s", model_path, server.url)
        yield server


def _fitting_context(runner: ModelRunner, slots: int, fraction: float) -> int:
    """The longest context whose slot cache, beside the weights, stays within `fraction` of the
    GPU's memory (SGLang's --mem-fraction-static: weights plus KV pool); never above the model's."""
    import torch

    if runner.device.type != "cuda":
        raise ConfigError([f"--mem-fraction-static sizes GPU memory; this engine runs on {runner.device}"])
    _, total = torch.cuda.mem_get_info(runner.device)
    budget = fraction * total - runner.weight_bytes()
    per_position = kv_bytes_per_position(runner.config, runner.model.dtype) * (slots + 1)
    context = min(runner.context_length, int(budget // per_position))
    if context < 2:
        raise ConfigError(
            [
                f"--mem-fraction-static {fraction:g}: {fraction:g} of {total / 2**30:.1f} GiB leaves "
                f"{max(budget, 0) / 2**30:.2f} GiB beside {runner.weight_bytes() / 2**30:.2f} GiB of weights, "
                f"less than a KV cache of {slots} slots of 2 positions; raise it or lower --max-running-requests"
            ]
        )
    log.info("--mem-fraction-static %g: KV cache context %d positions x %d slots", fraction, context, slots)
    return context


async def serve(
    model_path: str | Path,
    *,
    task_status: TaskStatus[EngineServer] = anyio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """Run the server until cancelled; `await tg.start(serve, path)` returns the running EngineServer."""
    async with open_server(model_path, **options) as server:
        task_status.started(server)
        await anyio.sleep_forever()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m engines.builtin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", "--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--random-seed", type=int, default=None)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (ROCm builds of torch say cuda too)")
    ap.add_argument("--context-length", type=int, default=None, help="cap on the model's window; bounds the KV cache")
    ap.add_argument("--kv-cache", default="slots", choices=["slots", "none"], help="none: recompute every step")
    ap.add_argument(
        "--disable-cuda-graph", action="store_true", help="decode eagerly on a GPU (CUDA graphs are the default there)"
    )
    ap.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, help="largest batch decoded by a CUDA graph (default: all)"
    )
    ap.add_argument(
        "--fuse-ops",
        action="store_true",
        help="compile the model's RMSNorms and rotary embedding into one kernel each (torch.compile) and run "
        "the q/k/v and gate/up projections as one matmul each (fewer launches a decode step)",
    )
    ap.add_argument(
        "--length-tail",
        default=None,
        metavar="DIST",
        help="end each request at a length drawn from the simulated engine's distribution (lognormal:MU,SIGMA "
        "or fixed:FRACTION of the limit), as if it sampled EOS there: a long tail on a real model (benchmarks)",
    )
    ap.add_argument("--length-tail-truncate-frac", type=float, default=0.10, help="share that runs to the limit")
    ap.add_argument(
        "--length-tail-limit",
        type=int,
        default=None,
        help="the run's response limit, so that a resumed request heads for its first request's end",
    )
    ap.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="SGLang's: allocate weights, KV cache and CUDA graphs so that /release_memory_occupation can give "
        "their GPU memory back (torch_memory_saver; GPU only)",
    )
    ap.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="SGLang's: keep a CPU copy of the weights while released, so a resume brings them back unchanged",
    )
    ap.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="SGLang's: weights plus KV cache within this fraction of the GPU's memory (shortens the cache's context)",
    )
    ap.add_argument("--health-check-timeout", type=float, default=20.0)
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--skip-server-warmup", action="store_true", help="accepted for SGLang compatibility")
    add_guard_arguments(ap)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.enable_memory_saver and (env := preload_environment()) is not None:
        # torch_memory_saver hooks the CUDA allocator through LD_PRELOAD, which only a process's
        # start reads: start again, in place (same pid), with it.
        argv = list(sys.argv[1:] if argv is None else argv)
        os.execve(sys.executable, [sys.executable, "-m", "engines.builtin", *argv], env)
    guards, problems = guard_options(args)
    if problems:
        logging.basicConfig(stream=sys.stderr)
        log.error("%s", ConfigError(problems))
        return 2
    tail = None
    if args.length_tail:
        try:
            tail = LengthTail(
                LengthModel.parse(args.length_tail, truncate_frac=args.length_tail_truncate_frac),
                args.length_tail_limit,
            )
        except ConfigError as exc:
            logging.basicConfig(stream=sys.stderr)
            log.error("%s", exc)
            return 2
    run = functools.partial(
        serve,
        args.model_path,
        host=args.host,
        port=args.port,
        max_running_requests=args.max_running_requests,
        weight_version=args.weight_version,
        random_seed=args.random_seed,
        served_model_name=args.served_model_name,
        health_check_timeout=args.health_check_timeout,
        dtype=args.dtype,
        device=args.device,
        context_length=args.context_length,
        kv_cache=args.kv_cache,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        fuse_ops=args.fuse_ops,
        length_tail=tail,
        enable_memory_saver=args.enable_memory_saver,
        weights_cpu_backup=args.enable_weights_cpu_backup,
        mem_fraction_static=args.mem_fraction_static,
        **guards,
    )
    # An unusable model folder or a port taken: say why in a line.
    return run_main(run, log_level=args.log_level, startup_errors=(WeightLoadError, ConfigError, OSError))


if __name__ == "__main__":
    sys.exit(main())
