"""Run in a fresh process by tests/test_megatron.py: the megatron backend publishes over torch.distributed.

`python tests/megatron_publish_check.py OUT_DIR WORLD TP` starts one built-in engine and megatron
ranks (rank 0 here, the others children), trains one step, sends the weights over a gloo weight
group (`--update-weight-transport distributed`), and writes OUT_DIR/result.json: for every tensor
of the engine's model, whether it equals the one the trainer saves for a disk publish, and whether
the weights-only folder (`save_model`, what a disk publish between checkpoints writes) holds the
same tensors as the full checkpoint and no optimizer state.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import anyio
import orjson
import torch

if TYPE_CHECKING:
    from trainers.megatron.trainer import MegatronTrainer


async def _live(http: aiohttp.ClientSession, url: str, name: str) -> torch.Tensor:
    async with http.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 10**7}) as resp:
        assert resp.status == 200, await resp.text()
        return torch.tensor(await resp.json())


async def _publish(out: Path, model: Path, trainer: MegatronTrainer) -> dict[str, object]:
    from safetensors.torch import load_file

    from launch.builtin_engine import start_engines
    from stages.sglang_client.fleet import EngineFleet
    from stages.sglang_client.publish_distributed import DistributedWeightSender
    from tests.megatron_check import fixed_batch

    (engine,) = await start_engines(1, model, log_dir=out / "logs", startup_timeout=120)
    try:
        async with EngineFleet([engine.url]) as fleet, aiohttp.ClientSession() as http:
            sender = DistributedWeightSender(trainer.hf_weights, fleet, bucket_bytes=16 * 1024, timeout=60)
            with anyio.fail_after(120):
                await sender.connect()
                batch = fixed_batch(trainer)
                metrics = await anyio.to_thread.run_sync(trainer.train_step, batch)
                saved = await anyio.to_thread.run_sync(trainer.save_weights, out / "v1")
                weights_only = await anyio.to_thread.run_sync(trainer.save_model, out / "w1")
                buckets = len(await anyio.to_thread.run_sync(sender.buckets))
                await sender.send("1")
            expected = load_file(str(saved / "model.safetensors"))
            start = load_file(str(model / "model.safetensors"))
            only = load_file(str(weights_only / "model.safetensors"))
            same_as_checkpoint = sorted(only) == sorted(expected) and all(
                torch.equal(only[n], expected[n]) for n in expected
            )
            equal = {
                name: bool(torch.equal(await _live(http, engine.url, name), t.flatten()))
                for name, t in expected.items()
            }
            moved = {name: not torch.equal(t, start[name]) for name, t in expected.items()}
            versions = list((await fleet.weight_versions()).values())
            await sender.close()
    finally:
        await engine.stop()
    return {
        "equal": equal,
        "moved": moved,
        "versions": versions,
        "buckets": buckets,
        "sent": sorted(name for name, _ in trainer.hf_weights()),
        "optimizer_steps": metrics["optimizer_steps"],
        "weights_only_equal": same_as_checkpoint,
        "weights_only_files": sorted(p.name for p in weights_only.iterdir()),
    }


def main(out: Path, world: int, tp: int) -> None:
    from launch.megatron_ranks import start_megatron_trainer
    from pipeline.tasks.tiny_model import make_model_folder

    model = make_model_folder(out / "model")
    trainer = start_megatron_trainer(model, world_size=world, tp=tp, log_dir=out / "logs", lr=1e-2)
    try:
        result = anyio.run(_publish, out, model, trainer)
    finally:
        trainer.close()
    (out / "result.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
