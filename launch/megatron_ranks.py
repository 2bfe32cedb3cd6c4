"""Megatron ranks: one process per device, torchrun-style; rank 0 is the controller's process.

    trainer = start_megatron_trainer(model_dir, world_size=4, tp=2, pp=2, log_dir=..., **trainer_kwargs)
    ...  trainer.train_step(batch); trainer.save_weights(path)  ...
    trainer.close()     # releases the followers and waits for them to exit

Rank 0 runs in the controller's process, so the controller talks to the trainer as it does to
the torch one; ranks 1..N-1 are `python -m launch.megatron_ranks` subprocesses (guarded: they
die with the controller) that build the same trainer and run its `follow()` loop. All meet in
`torch.distributed` over loopback (`MASTER_ADDR=127.0.0.1`, a free port): gloo on CPU, NCCL on
GPU with rank r on device r (`LOCAL_RANK`). Environment variables are torchrun's (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so `torchrun` can start followers as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from launch.engine_process import free_port
from launch.orphan_guard import guarded
from pipeline.errors import ConfigError, PipelineError

if TYPE_CHECKING:  # the trainer imports megatron-core and torch: only when a rank starts
    from stages.trainer.megatron.trainer import MegatronTrainer

__all__ = ["MegatronRanks", "init_rank", "start_megatron_trainer"]

_STOP_TIMEOUT = 30.0


def init_rank(*, rank: int, world_size: int, tp: int, pp: int = 1, device: str = "cpu", seed: int = 0) -> str:
    """Join the process group and set up megatron's parallel state; return this rank's device."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if world_size % (tp * pp):
        raise ConfigError(
            [
                f"--tensor-model-parallel-size={tp} x --pipeline-model-parallel-size={pp}: must divide "
                f"the {world_size} megatron ranks (data parallel = ranks / (TP x PP))"
            ]
        )
    on_gpu = device != "cpu"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = f"cuda:{torch.cuda.current_device()}"
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if on_gpu else "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=30)
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if on_gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from stages.trainer.megatron.cpu_patches import apply_cpu_patches

        apply_cpu_patches(seed)
    return device


class MegatronRanks:
    """The follower processes of one run; `stop()` waits for them, then kills what is left."""

    def __init__(self, processes: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
        self.processes, self.logs = processes, logs

    def stop(self, timeout: float = _STOP_TIMEOUT) -> None:
        for p in self.processes:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def check(self) -> None:
        for p, log in zip(self.processes, self.logs, strict=True):
            if p.poll() not in (None, 0):
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise PipelineError(f"megatron rank (pid {p.pid}) exited with {p.returncode}; log {log}:\n{tail}")


def start_megatron_trainer(
    model_path: Path,
    *,
    world_size: int,
    tp: int,
    pp: int = 1,
    device: str = "cpu",
    seed: int = 0,
    log_dir: Path,
    **trainer_kwargs: Any,
) -> MegatronTrainer:
    """Start ranks 1..N-1, become rank 0, and return rank 0's `MegatronTrainer` (its `close()` stops them)."""
    from stages.trainer.megatron.trainer import MegatronTrainer

    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model_path": str(model_path),
        "tp": tp,
        "pp": pp,
        "device": device,
        "seed": seed,
        "trainer": trainer_kwargs,
    }
    env = _rank_env(world_size, port)
    processes, logs = [], []
    for rank in range(1, world_size):
        log = log_dir / f"megatron-rank{rank}.log"
        with log.open("wb") as fh:
            processes.append(
                subprocess.Popen(
                    [*guarded(), sys.executable, "-m", "launch.megatron_ranks", orjson.dumps(spec).decode()],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                )
            )
        logs.append(log)
    ranks = MegatronRanks(processes, logs)
    try:
        os.environ.update({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT")})
        device = init_rank(rank=0, world_size=world_size, tp=tp, pp=pp, device=device, seed=seed)
        trainer = MegatronTrainer(model_path, device=device, **trainer_kwargs)
    except BaseException:
        for p in processes:
            p.kill()
        ranks.stop()
        raise
    close = trainer.close

    def close_all() -> None:
        close()
        ranks.stop()

    trainer.close = close_all  # type: ignore[method-assign]
    return trainer


def _rank_env(world_size: int, port: int) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's code, as engines get it
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }


def _loss_settings(raw: dict[str, Any]) -> Any:
    from stages.trainer.loss import ImportanceCorrection, LossAggregation, LossSettings

    raw = {
        **raw,
        "correction": ImportanceCorrection(raw["correction"]),
        "aggregation": LossAggregation(raw["aggregation"]),
    }
    return LossSettings(**raw)


def _follower_main(raw_spec: str) -> None:
    from stages.trainer.megatron.trainer import MegatronTrainer

    spec = orjson.loads(raw_spec)
    if spec["trainer"].get("loss") is not None:  # a LossSettings, sent as JSON (enums by value)
        spec["trainer"]["loss"] = _loss_settings(spec["trainer"]["loss"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init_rank(
        rank=rank, world_size=world, tp=spec["tp"], pp=spec["pp"], device=spec["device"], seed=spec["seed"]
    )
    trainer = MegatronTrainer(Path(spec["model_path"]), device=device, **spec["trainer"])
    trainer.follow()


if __name__ == "__main__":
    _follower_main(sys.argv[1])
