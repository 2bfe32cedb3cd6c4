"""Start real SGLang servers (`python -m sglang.launch_server`) for a run, and stop them with it.

    engines = await start_sglang_servers(model_dir, engine=config.engine, log_dir=out / "logs")

One server per engine, each on the GPUs `--sglang-devices` names (`--rollout-num-gpus-per-engine`
of them, passed as its `--tp-size`), pinned with CUDA_VISIBLE_DEVICES (NVIDIA) and
HIP_VISIBLE_DEVICES (AMD ROCm; ROCm builds of SGLang read it). Each is started with the model
path, a free loopback port (or `--engine-host`), `--weight-version 0` (the clock's first version),
`--max-running-requests` = `--sglang-server-concurrency`, the memory fraction and the API key when
given (with `--colocate`: `--enable-memory-saver`, on the trainer's GPU), and waited for until
`/health_generate` answers. The caller puts them behind the router when
there are several, as it does for built-in engines, and stops them on exit (SIGTERM, then SIGKILL;
guarded, so they die with the controller too).

Process handling is `launch.builtin_engine.start_engine`'s: the same command-line shape is what
the built-in engine accepts, which is how the CPU tests stand a fake `sglang` package in for SGLang.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import anyio

from core.errors import ConfigError
from launch.builtin_engine import EngineProcess, start_engine

__all__ = ["engine_devices", "sglang_command_args", "start_sglang_servers", "torch_device_index"]

_MODULE = "sglang.launch_server"


def engine_devices(devices: str | None, *, engines: int, per_engine: int) -> list[list[str]]:
    """GPU ids per engine: `devices` ("0,1,2,3") split in order, or 0..engines*per_engine-1."""
    ids = [d.strip() for d in devices.split(",")] if devices else [str(i) for i in range(engines * per_engine)]
    if len(ids) != engines * per_engine:
        raise ConfigError(
            [
                f"--sglang-devices={devices!r}: {engines} engines x {per_engine} GPUs need "
                f"{engines * per_engine} ids, got {len(ids)}"
            ]
        )
    return [ids[i * per_engine : (i + 1) * per_engine] for i in range(engines)]


def sglang_command_args(
    *,
    per_engine: int,
    mem_fraction: float | None,
    api_key: str | None,
    seed: int,
    routed_experts: bool = False,
    memory_saver: bool = False,
) -> list[str]:
    """The SGLang flags beyond those every engine gets (model path, host, port, concurrency, version).
    `routed_experts` (R3): SGLang answers `return_routed_experts` only when started with its flag.
    `memory_saver`: colocated with the trainer, the server must be able to release its memory."""
    args = ["--tp-size", str(per_engine), "--random-seed", str(seed)]
    if routed_experts:
        args.append("--enable-return-routed-experts")
    if mem_fraction is not None:
        args += ["--mem-fraction-static", str(mem_fraction)]
    if memory_saver:
        args += ["--enable-memory-saver"]
    if api_key:
        args += ["--api-key", api_key]
    return args


def torch_device_index(device: str) -> int:
    """The index in "cuda:N" (0 for plain "cuda")."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


async def start_sglang_servers(
    model_path: Path, *, engine: Any, log_dir: Path, seed: int = 0, routed_experts: bool = False
) -> list[EngineProcess]:
    """Start `engine.num_engines` SGLang servers (an `EngineConfig`); all healthy, or none left running."""
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            [
                "--rollout-engine=sglang: SGLang is not installed for this Python "
                "(pip install sglang), or use --rollout-engine builtin"
            ]
        )
    devices = engine.sglang_devices
    if engine.colocate and devices is None:  # on the trainer's GPU (the engine's device follows it)
        devices = str(torch_device_index(engine.device))
    groups = engine_devices(devices, engines=engine.num_engines, per_engine=engine.gpus_per_engine)
    extra = sglang_command_args(
        per_engine=engine.gpus_per_engine,
        mem_fraction=engine.sglang_mem_fraction_static,
        api_key=engine.api_key,
        seed=seed,
        routed_experts=routed_experts,
        memory_saver=engine.colocate,
    )
    await anyio.Path(log_dir).mkdir(parents=True, exist_ok=True)
    started: list[EngineProcess | None] = [None] * len(groups)
    errors: list[Exception] = []

    async def one(i: int, gpus: list[str]) -> None:
        visible = ",".join(gpus)
        try:
            started[i] = await start_engine(
                model_path,
                host=engine.host,
                max_running_requests=engine.sglang_server_concurrency,
                weight_version="0",
                extra_args=extra,
                startup_timeout=engine.sglang_startup_timeout,
                log_path=log_dir / f"sglang-{i}.log",
                module=_MODULE,
                env={"CUDA_VISIBLE_DEVICES": visible, "HIP_VISIBLE_DEVICES": visible},
            )
        except Exception as exc:  # collected so the caller gets the error itself, not a group
            errors.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            for i, gpus in enumerate(groups):
                tg.start_soon(one, i, gpus)
    finally:
        if errors or any(p is None for p in started):
            with anyio.CancelScope(shield=True):
                for p in started:
                    if p is not None:
                        await p.stop(timeout=30.0)
    if errors:
        raise errors[0]
    return [p for p in started if p is not None]
