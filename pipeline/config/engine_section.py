"""The `engine` section of the config tree: the SGLang engines a run uses (URLs, a router) or how
many built-in engines (or real SGLang servers) to start, on which device, and how engine faults
are handled. Describes only (`schema` has the whole tree).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.fields import opt

__all__ = ["EngineConfig"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    urls: tuple[str, ...] = opt(
        (),
        "--sglang-url",
        "urls",
        metavar="URL",
        default_help="start built-in engines",
        help="an SGLang engine URL (repeatable)",
    )
    router_url: str | None = opt(
        None, "--sglang-router-url", "str", metavar="URL", help="an SGLang router in front of engines"
    )
    num_engines: int = opt(
        1,
        "--rollout-num-engines",
        "int",
        ge=1,
        help="built-in engines to start (>1: behind sglang-router); with --sglang-router-url, the engines behind it",
    )
    sglang_server_concurrency: int = opt(
        64, "--sglang-server-concurrency", "int", ge=1, help="in-flight samples per engine"
    )
    hf_checkpoint: str | None = opt(
        None,
        "--hf-checkpoint",
        "str",
        metavar="PATH",
        default_help="build the tiny model in the run folder",
        help="model folder (or Hub id)",
    )
    num_experts: int | None = opt(
        None,
        "--num-experts",
        "int",
        ge=2,
        default_help="dense",
        help="the tiny model built without --hf-checkpoint is a Qwen3-MoE with this many experts per layer, "
        "--moe-router-topk (default 2) routed per token",
    )
    device: str = opt(
        "cpu",
        "--rollout-device",
        "str",
        metavar="DEVICE",
        help="torch device of the built-in engines: cpu, cuda or cuda:N (the trainer's is --trainer-device)",
    )
    host: str = opt("127.0.0.1", "--engine-host", "str", metavar="HOST", help="address built-in engines bind to")
    # slime's --colocate (issue 47): trainer and engine share the GPU.
    colocate: bool = opt(
        False,
        "--colocate",
        "bool",
        help="the engine shares the trainer's GPU: in sync mode it releases its memory while the trainer trains "
        "and takes the new weights by CUDA IPC (update_weights_from_tensor); in async mode it keeps its memory",
    )
    # Real SGLang servers started by the pipeline (launch/sglang_server.py).
    launcher: str = opt(
        "builtin",
        "--rollout-engine",
        "choice",
        choices=("builtin", "sglang"),
        help="engines the pipeline starts when no URL is given: the built-in engine, or real SGLang "
        "(python -m sglang.launch_server, which must be importable here)",
    )
    sglang_devices: str | None = opt(
        None,
        "--sglang-devices",
        "str",
        metavar="0,1,...",
        default_help="0 .. engines x GPUs per engine - 1",
        help="--rollout-engine sglang: GPU ids for the engines, in order; each engine takes "
        "--rollout-num-gpus-per-engine of them (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)",
    )
    gpus_per_engine: int = opt(
        1, "--rollout-num-gpus-per-engine", "int", ge=1, help="--rollout-engine sglang: GPUs per engine (its --tp-size)"
    )
    sglang_mem_fraction_static: float | None = opt(
        None,
        "--sglang-mem-fraction-static",
        "float",
        gt=0,
        default_help="SGLang's default; 0.4 for a colocated built-in engine",
        help="GPU memory fraction for the engine's weights and KV cache (SGLang's --mem-fraction-static), for "
        "--rollout-engine sglang and, with --colocate, the built-in engine (0.4 there unless given)",
    )
    sglang_startup_timeout: float = opt(
        900.0, "--sglang-startup-timeout", "float", gt=0, help="seconds for a started SGLang server to become healthy"
    )
    api_key: str | None = opt(
        None,
        "--api-key",
        "str",
        metavar="KEY",
        help="sent to engines and the router as 'Authorization: Bearer KEY', and given to the engines (built-in "
        "or SGLang) and router the pipeline starts, which then refuse requests without it",
    )
    # Engine faults (issue 17): slime's flags and defaults, plus the floor the run goes on with.
    use_fault_tolerance: bool = opt(
        False,
        "--use-fault-tolerance",
        "bool",
        help="evict a dead or hung engine, restart it (built-in) or wait for it (yours), re-admit it current",
    )
    health_check_interval: float = opt(
        30.0, "--rollout-health-check-interval", "float", gt=0, help="seconds between engine heartbeats"
    )
    health_check_timeout: float = opt(
        30.0,
        "--rollout-health-check-timeout",
        "float",
        gt=0,
        help="seconds a heartbeat (/health_generate) may take before the engine is evicted",
    )
    health_check_first_wait: float = opt(
        0.0, "--rollout-health-check-first-wait", "float", ge=0, help="seconds before the first heartbeat"
    )
    min_live_engines: int = opt(
        1,
        "--min-live-engines",
        "int",
        ge=1,
        help="with --use-fault-tolerance, the run stops once fewer engines than this are live",
    )
    max_engine_restarts: int = opt(
        3, "--max-engine-restarts", "int", ge=0, help="restart tries per evicted built-in engine"
    )
    # Issue 46: without fault tolerance nothing evicts a hung engine, but the run says so.
    silence_warning: float = opt(
        30.0,
        "--engine-silence-warning",
        "float",
        gt=0,
        help="without --use-fault-tolerance, warn once an engine has not answered /health for this many seconds "
        "while requests wait on it (it is asked every sixth of that, only while requests wait)",
    )
