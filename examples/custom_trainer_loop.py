"""Your own training loop driving the pipeline: `pipeline.Rollout` over engines, store and dataset.

    python -m examples.custom_trainer_loop --steps 3

The loop is yours: ask for a batch, train it however you like (here the built-in GRPO trainer on
the tiny model, but any torch code will do), save the weights as a Hugging Face folder, commit the
step, publish the folder. The rollout side (admission, partial rollout, async, the store, the
engines' pause and weight load) is the same machinery `python -m pipeline.launch` runs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import anyio

from engines.builtin import (
    open_server,  # the built-in SGLang-compatible engine, in process
)
from pipeline import (
    AsyncStore,
    EngineFleet,
    MemoryStore,
    Rollout,
    RolloutMode,
    RolloutPlan,
)
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import toy_dataset, toy_reward
from trainers import GRPOTrainer


async def main(steps: int, workdir: Path) -> list[float]:
    model = make_model_folder(workdir / "model", seed=0)
    trainer = GRPOTrainer(model)
    plan = RolloutPlan(mode=RolloutMode.SYNC, batch_size=4, n_samples=4, num_steps=steps, max_response_len=32)
    rewards = []
    async with (
        open_server(model, port=0, weight_version="0") as server,
        EngineFleet([server.url], concurrency=16) as fleet,
        AsyncStore(MemoryStore()) as store,
        Rollout(plan, engines=fleet, store=store, dataset=toy_dataset(64, seed=0), reward_fn=toy_reward) as rollout,
    ):
        for _ in range(steps):
            batch = await rollout.next_batch()
            metrics = await anyio.to_thread.run_sync(trainer.train_step, batch)  # keep the loop free
            folder = await anyio.to_thread.run_sync(trainer.save_weights, workdir / f"v{rollout.version + 1}")
            await rollout.commit(batch, dict(metrics))
            await rollout.publish(folder)
            rewards.append(sum(s.reward or 0.0 for s in batch.samples) / len(batch.samples))
            print(f"step {batch.step}: reward {rewards[-1]:.3f}, now serving v{rollout.version}")
        print("statistics:", rollout.statistics())
    return rewards


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, args.steps, Path(tmp))
