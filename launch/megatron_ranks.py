"""Megatron ranks: one process per device, torchrun-style; rank 0 is the controller's process.

    trainer = start_megatron_trainer(model_dir, world_size=4, tp=2, pp=2, ep=1, log_dir=..., **trainer_kwargs)
    ...  trainer.train_step(batch); trainer.save_weights(path)  ...
    trainer.close()     # releases the followers and waits for them to exit

Rank 0 runs in the controller's process, so the controller talks to the trainer as it does to
the torch one. On the controller's node (node 0), ranks 1..N-1 are `python -m launch.megatron_ranks`
subprocesses (guarded: they die with the controller). On each other node k of a multi-node run
(`--actor-num-nodes M`), one command started by the user,

    python -m pipeline.launch --node-rank K <the controller's flags, or --config the same file>

derives the same trainer spec from the same config (`pipeline.trainer_settings.megatron_settings`),
starts that node's N ranks (global rank
K*N + local, LOCAL_RANK = local) and waits for them. Every rank builds the same trainer and runs
its `follow()` loop. They meet at rank 0's address (`--trainer-master-addr`, loopback by default;
`--trainer-master-port`, a free port on one node): a handshake first (`trainer_group.py`: same
spec, same model folder, everyone present within `--trainer-join-timeout`), then `torch.distributed`,
gloo on CPU, NCCL on GPU with local rank r on device r. Environment variables are torchrun's (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from core.errors import ConfigError, PipelineError
from launch.builtin_engine import free_port
from launch.orphan_guard import guarded
from launch.trainer_group import host_group, join_group

if TYPE_CHECKING:  # the trainer imports megatron-core and torch: only when a rank starts
    from trainers.megatron.trainer import MegatronTrainer

__all__ = ["MegatronRanks", "init_rank", "run_node", "start_megatron_trainer"]

_STOP_TIMEOUT = 30.0
# What collectives run under once the group exists (a step, a save); joining has its own timeout.
_COLLECTIVE_TIMEOUT = timedelta(minutes=30)
_JOIN_TIMEOUT = 600.0


def init_rank(
    *,
    rank: int,
    world_size: int,
    tp: int,
    pp: int = 1,
    ep: int = 1,
    device: str = "cpu",
    seed: int = 0,
    store: Any = None,
) -> str:
    """Join the process group (over `store` when given, else the env variables) and set up
    megatron's parallel state; return this rank's device."""
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
    if (world_size // (tp * pp)) % ep:
        raise ConfigError(
            [
                f"--expert-model-parallel-size={ep}: must divide the data-parallel size "
                f"{world_size // (tp * pp)} (= {world_size} ranks / (TP={tp} x PP={pp}))"
            ]
        )
    on_gpu = device != "cpu"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = f"cuda:{torch.cuda.current_device()}"
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if on_gpu else "gloo", rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT, store=store
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    if on_gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from trainers.megatron.cpu_patches import apply_cpu_patches

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
    ep: int = 1,
    device: str = "cpu",
    seed: int = 0,
    log_dir: Path,
    nodes: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    join_timeout: float = _JOIN_TIMEOUT,
    **trainer_kwargs: Any,
) -> MegatronTrainer:
    """Start this node's ranks 1..N-1, become rank 0, wait for every node's ranks, and return rank 0's
    `MegatronTrainer` (its `close()` stops the followers)."""
    from trainers.megatron.trainer import MegatronTrainer

    if world_size % nodes:
        raise ConfigError([f"{world_size} megatron ranks do not split over {nodes} nodes"])
    if nodes > 1 and master_port is None:
        raise ConfigError([f"--actor-num-nodes={nodes}: needs --trainer-master-port (the other nodes must know it)"])
    port = master_port if master_port is not None else free_port()
    per_node = world_size // nodes
    spec = _spec(world_size=world_size, nodes=nodes, tp=tp, pp=pp, ep=ep, device=device, seed=seed, **trainer_kwargs)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = _rank_env(world_size, master_addr, port)
    processes, logs = [], []
    for rank in range(1, per_node):
        log = log_dir / f"megatron-rank{rank}.log"
        with log.open("wb") as fh:
            processes.append(_start_rank(spec, join_timeout, env, rank=rank, local=rank, stdout=fh))
        logs.append(log)
    ranks = MegatronRanks(processes, logs)
    try:
        os.environ.update({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT")})
        try:
            store = host_group(
                addr=master_addr,
                port=port,
                world=world_size,
                per_node=per_node,
                spec=spec,
                model_path=model_path,
                timeout=join_timeout,
            )
        except PipelineError:
            ranks.check()  # a local rank that died says why, with its log
            raise
        device = init_rank(rank=0, world_size=world_size, tp=tp, pp=pp, ep=ep, device=device, seed=seed, store=store)
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


def _spec(
    *, world_size: int, nodes: int, tp: int, pp: int, ep: int = 1, device: str, seed: int, **trainer: Any
) -> dict[str, Any]:
    """What every rank must agree on, as JSON (a LossSettings as its fields, enums by value)."""
    return {
        "world": world_size,
        "nodes": nodes,
        "tp": tp,
        "pp": pp,
        "ep": ep,
        "device": device,
        "seed": seed,
        "trainer": orjson.loads(orjson.dumps(trainer)),
    }


def _start_rank(
    spec: dict[str, Any], join_timeout: float, env: dict[str, str], *, rank: int, local: int, stdout: Any
) -> subprocess.Popen[bytes]:
    payload = orjson.dumps({"spec": spec, "join_timeout": join_timeout}).decode()
    return subprocess.Popen(
        [*guarded(), sys.executable, "-m", "launch.megatron_ranks", "--rank", payload],
        env={**env, "RANK": str(rank), "LOCAL_RANK": str(local)},
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
    )


def _rank_env(world_size: int, addr: str, port: int) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's code, as engines get it
    return {
        **os.environ,
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }


def _rank_main(raw: str) -> None:
    """One follower rank: join, build the same trainer from rank 0's model folder, follow."""
    from trainers.megatron.trainer import MegatronTrainer
    from trainers.step_settings import loss_from_json

    payload = orjson.loads(raw)
    spec = payload["spec"]
    rank = int(os.environ["RANK"])
    store, model_path = join_group(
        addr=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        rank=rank,
        spec=spec,
        timeout=payload["join_timeout"],
    )
    trainer_kwargs = dict(spec["trainer"])
    if trainer_kwargs.get("loss") is not None:  # a LossSettings, sent as JSON (enums by value)
        trainer_kwargs["loss"] = loss_from_json(trainer_kwargs["loss"])
    device = init_rank(
        rank=rank,
        world_size=spec["world"],
        tp=spec["tp"],
        pp=spec["pp"],
        ep=spec["ep"],
        device=spec["device"],
        seed=spec["seed"],
        store=store,
    )
    MegatronTrainer(model_path, device=device, **trainer_kwargs).follow()


def run_node(node: int, settings: dict[str, Any], ranks_per_node: int) -> int:
    """Start node `node`'s ranks of a multi-node run from the controller's `megatron_settings` and
    wait for them (`python -m pipeline.launch --node-rank K <the controller's flags>`)."""
    settings = dict(settings)
    group = {k: settings.pop(k) for k in ("master_addr", "master_port", "join_timeout")}
    spec = _spec(**settings)
    env = _rank_env(spec["world"], group["master_addr"], group["master_port"])
    processes = {
        p.pid: p
        for p in (
            _start_rank(spec, group["join_timeout"], env, rank=node * ranks_per_node + local, local=local, stdout=None)
            for local in range(ranks_per_node)
        )
    }
    # Wait for whichever rank ends first; one that fails takes its node's others down with it
    # (they would wait in a collective for it until the 30-minute timeout).
    code = 0
    while processes:
        pid, status = os.wait()
        ended = processes.pop(pid, None)
        if ended is None:
            continue
        exit_code = ended.returncode = os.waitstatus_to_exitcode(status)
        if exit_code and not code:
            code = exit_code
            for p in processes.values():
                p.kill()
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        try:
            _rank_main(sys.argv[2])
        except PipelineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(1)
    else:
        sys.exit(
            "a rank process of a megatron run; another node's ranks: python -m pipeline.launch --node-rank K <flags>"
        )
