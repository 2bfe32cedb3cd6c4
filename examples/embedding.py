"""Embedding the pipeline: the README's "Embedding" code, as a file that runs.

    python -m examples.embedding --steps 3                 # your own loop around `Rollout`
    python -m examples.embedding --steps 3 --run-pipeline  # the built-in loop, `run_pipeline`
    python -m examples.embedding --engine-url http://127.0.0.1:30000 --model /models/tiny --steps 100

Without `--engine-url` a built-in engine is started in this process on the tiny model (built in
`--state`/model the first time). Run it again with the same `--state` and more `--steps`: it
resumes where the last run stopped (the LMDB store, the weights of the last committed step).
Paths may be relative: the pipeline sends engines absolute paths, so an engine started in another
folder finds the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio

from pipeline import (
    AsyncStore,
    EngineFleet,
    LmdbStore,
    PromptTask,
    Rollout,
    RolloutMode,
    RolloutPlan,
    Sample,
    run_pipeline,
)
from pipeline.metrics import MetricsSink
from trainers import GRPOTrainer


def score(task: PromptTask, sample: Sample) -> float:
    """Your reward: here the toy task's ("say b x3:" -> "bbb")."""
    from pipeline.tasks.toy import toy_reward

    return toy_reward(task, sample)


# -- your own loop: what the README shows under "Embedding" --------------------------------------


async def own_loop(engine_url: str, state: Path, model: Path, tasks: Sequence[PromptTask], steps: int) -> None:
    plan = RolloutPlan(mode=RolloutMode.ASYNC, batch_size=8, n_samples=8, num_steps=steps, max_staleness=1)
    async with (
        EngineFleet([engine_url]) as engines,
        AsyncStore(LmdbStore(state / "rollout_data")) as store,
    ):
        start = model
        if (step := await store.trained_step()) >= 0:  # resuming: the folder the last committed step saved
            start = state / "weights" / f"v{step + 1}"
            await engines.update_weights_from_disk(str(start), weight_version=str(step + 1))
        my_trainer = GRPOTrainer(start)  # any trainer: train_step(batch) -> dict, save_weights(path) -> path
        async with Rollout(plan, engines=engines, store=store, dataset=tasks, reward_fn=score) as rollout:
            while rollout.next_step < steps:
                batch = await rollout.next_batch()  # a full batch, by the plan's policy
                metrics = await anyio.to_thread.run_sync(my_trainer.train_step, batch)  # off the event loop
                folder = state / "weights" / f"v{rollout.version + 1}"
                await anyio.to_thread.run_sync(my_trainer.save_weights, folder)  # a Hugging Face folder
                await rollout.commit(batch, dict(metrics))  # the step counts as trained (commit, then publish)
                await rollout.publish(folder)  # engines pause, load it, continue; version + 1
                print(f"step {batch.step}: loss {metrics['loss']:.4f}, now serving v{rollout.version}")
            print(rollout.statistics())
    # leaving: requests in flight are aborted and every unfinished group is stored for the next run


# -- the built-in loop: what the README shows under "With the built-in training loop" -----------


async def built_in_loop(engine_url: str, state: Path, model: Path, tasks: Sequence[PromptTask], steps: int) -> None:
    plan = RolloutPlan(RolloutMode.SYNC, batch_size=8, n_samples=8, num_steps=steps, partial=True, over_sampling=16)
    async with (
        EngineFleet([engine_url], concurrency=64) as engines,
        AsyncStore(LmdbStore(state / "rollout_data")) as store,  # leaving closes it: the next run may open it
    ):
        start = model
        if (step := await store.trained_step()) >= 0:  # resuming, as in your own loop
            start = state / "weights" / f"v{step + 1}"
            await engines.update_weights_from_disk(str(start), weight_version=str(step + 1))
        with MetricsSink(state / "metrics.jsonl") as metrics:
            summary = await run_pipeline(
                plan,
                engines=engines,
                store=store,
                trainer=GRPOTrainer(start),
                dataset=tasks,
                reward_fn=score,
                filter_fn=None,
                weights_dir=state / "weights",  # weights/vN, one folder per step
                metrics=metrics,
            )
    print(f"trained {len(summary.metrics)} steps; metrics in {state / 'metrics.jsonl'}")


# -- running it ------------------------------------------------------------------------------------


async def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    from contextlib import AsyncExitStack

    from engines.builtin import open_server  # the built-in SGLang-compatible engine
    from pipeline.tasks.tiny_model import make_model_folder
    from pipeline.tasks.toy import toy_dataset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--state", type=Path, default=Path("runs/embedding"), help="store, weights, metrics")
    parser.add_argument("--engine-url", help="an engine you started (default: start a built-in one here)")
    parser.add_argument("--model", type=Path, help="the model folder the engine serves (default: the tiny model)")
    parser.add_argument("--run-pipeline", action="store_true", help="the built-in loop instead of your own")
    args = parser.parse_args(argv)
    model = args.model or args.state / "model"
    if args.model is None and not (model / "config.json").exists():
        make_model_folder(model, seed=0)
    tasks = toy_dataset(64, seed=0)
    loop = built_in_loop if args.run_pipeline else own_loop
    async with AsyncExitStack() as stack:
        url = args.engine_url
        if url is None:
            server = await stack.enter_async_context(open_server(model, port=0, weight_version="0"))
            url = server.url
        await loop(url, args.state, model, tasks, args.steps)


if __name__ == "__main__":
    anyio.run(main)
