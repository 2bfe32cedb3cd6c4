"""The parts of a run its flags switch on, each built from the config and closed with the run:
Ray producers (`--rollout-producers ray`), the distributed weight transfer
(`--update-weight-transport distributed`) or by CUDA IPC (`--colocate`), the store's garbage collection
(`--rollout-gc-keep-steps`) and inline evaluation (`--eval-interval`). Each is None (or a plain
pass-through) when its flag is off.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import structlog

from core.errors import ConfigError, EngineError
from core.types import RolloutMode, WeightTransport
from pipeline.config import Config
from pipeline.config.rules import producer_slots_problem
from pipeline.metrics import MetricsSink
from pipeline.plan import BuiltInTrainer, RolloutPlan
from pipeline.run.eval_run import EVAL_FILE, InlineEvaluator, eval_sets, eval_settings
from pipeline.run.state import RunState
from stages.producers import ProducersFactory
from stages.sglang_client import EngineFleet
from stages.sglang_client.publish_distributed import DistributedWeightSender
from stages.sglang_client.publish_tensor import ColocatedWeights
from storage import AsyncStore

__all__ = ["engine_memory", "garbage_collector", "inline_evaluator", "path_of", "ray_producers", "weight_transfer"]

log = structlog.get_logger("launch")


async def inline_evaluator(
    config: Config, state: RunState, engines: EngineFleet, out: Path, sink: MetricsSink
) -> InlineEvaluator | None:
    """With `--eval-interval` (sync mode; the rules refuse async), the evaluator `run_pipeline` calls
    after each step. First, a step the crash left unevaluated is evaluated, or, in a run starting at
    step 0, the starting weights (unless `--skip-eval-before-train`): pipeline/run/eval_run.py."""
    if config.rollout.eval_interval is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(state.model_path)
    evaluator = InlineEvaluator(
        engines,
        eval_sets(config, tokenizer),
        eval_settings(config),
        interval=config.rollout.eval_interval,
        log_path=out / EVAL_FILE,
    )
    await evaluator.catch_up(state.start_step - 1, sink)
    if not config.rollout.skip_eval_before_train:
        await evaluator.before_training(state.start_step, sink)
    return evaluator


async def ray_producers(
    config: Config, state: RunState, engines: EngineFleet, plan: RolloutPlan, store: AsyncStore, stack: AsyncExitStack
) -> ProducersFactory | None:
    """With `--rollout-producers ray`, the Ray producers (started now, stopped at exit); else None."""
    r, d = config.rollout, config.data
    if r.producers != "ray":
        return None
    from launch.ray_cluster import RaySettings, engine_shares, group_slots, open_ray_producers
    from launch.ray_producer import ProducerSpec

    n_engines = max(1, len(engines.worker_urls))

    def spec_for(i: int, count: int) -> ProducerSpec:
        concurrency = config.engine.sglang_server_concurrency
        if why := producer_slots_problem(concurrency, n_engines, count, plan.n_samples):
            raise ConfigError([f"--rollout-producers=ray with {count} producers: {why}"])
        urls, router = engine_shares(engines.worker_urls, engines.router_url, count)[i]
        return ProducerSpec(
            name=f"producer-{i}",
            engine_urls=urls,
            router_url=router,
            group_slots=group_slots(plan.slots, plan.n_samples, count)[i],
            n_samples=plan.n_samples,
            sampling_params=dict(plan.sampling_params),
            max_response_len=plan.max_response_len,
            reward_path=d.custom_rm_path or path_of(state.reward_fn),
            reward_timeout=plan.reward_timeout,
            reward_max_retries=plan.reward_max_retries,
            agent_max_retries=plan.agent_max_retries,
            filter_path=d.dynamic_sampling_filter_path,
            agent_path=d.custom_generate_function_path or (path_of(state.agent) if state.agent else None),
            seed=plan.seed,
            # The version the engines serve when producers get work: a replay (if any) has run by then.
            version=state.start_step,
            request_timeout=r.request_timeout,
            max_retries=r.max_retries,
            api_key=config.engine.api_key or None,
            routed_experts_top_k=plan.payloads.routed_experts_top_k,
            sampler_top_k=plan.payloads.sampler_top_k,
            routed_experts_count=plan.payloads.routed_experts_count,
        )

    settings = RaySettings(
        r.ray_address,
        r.num_producers,
        r.producer_lease_seconds,
        r.producer_deadline_seconds,
        r.overlap_weight_transfer,
        takes_per_second=r.producer_takes_per_second,
        mailbox=r.producer_mailbox,
    )
    return await stack.enter_async_context(
        open_ray_producers(settings, spec_for, store=store, n_samples=plan.n_samples, store_batch=plan.store_batch)
    )


def path_of(fn: Callable[..., Any]) -> str:
    """A built-in function's `module:function` path, for producers that import it themselves."""
    return f"{fn.__module__}:{fn.__qualname__}"


async def weight_transfer(
    config: Config, trainer: BuiltInTrainer, engines: EngineFleet, stack: AsyncExitStack
) -> DistributedWeightSender | ColocatedWeights | None:
    """With `--update-weight-transport distributed`, the trainer is rank 0 of a group with the
    engines: join it now (a failure shows at start, not at the first publish), leave it at exit.
    With `--colocate`, the weights go by CUDA IPC from the trainer's GPU (`publish_tensor`); in
    sync mode the same object releases the engines' memory after each round (`engine_memory`)."""
    if config.engine.colocate:
        import torch

        return ColocatedWeights(
            trainer.model.named_parameters,
            engines,
            device=trainer.device,
            # What the torch trainer saves for the engines: bf16 when it trains under bf16 autocast.
            send_dtype=torch.bfloat16 if trainer.autocast else None,
            bucket_bytes=config.rollout.update_weight_buffer_size,
        )
    if config.rollout.update_weight_transport != WeightTransport.DISTRIBUTED:
        return None
    # The torch trainer's parameters carry HF names already; the megatron backend gathers its
    # tensor-parallel shards and converts them (`MegatronTrainer.hf_weights`).
    sender = DistributedWeightSender(
        trainer.hf_weights,
        engines,
        device=trainer.device,
        bucket_bytes=config.rollout.update_weight_buffer_size,
    )
    await sender.connect()

    async def leave() -> None:
        try:
            await sender.close()
        except EngineError as exc:  # engines already gone at exit: nothing left to leave
            log.warning("leaving the weight update group failed: %s", exc)

    stack.push_async_callback(leave)
    return sender


def engine_memory(config: Config, transfer: object) -> ColocatedWeights | None:
    """Colocated in sync mode, what releases the engines' memory after each round (the transfer
    itself); in async mode the engine keeps its memory and generates while the trainer trains."""
    if isinstance(transfer, ColocatedWeights) and config.rollout.mode is RolloutMode.SYNC:
        return transfer
    return None


@asynccontextmanager
async def garbage_collector(
    store: AsyncStore, keep_steps: int | None, on_step: Callable[[dict[str, Any]], None]
) -> AsyncIterator[Callable[[dict[str, Any]], None]]:
    """`on_step`, plus (with `--rollout-gc-keep-steps N`) collecting the steps older than the last N.

    `on_step` runs after the step is committed (`finish_batch`), so its checkpoint is durable and
    its groups may go. The callback is synchronous; it hands the step to a task that calls the
    store through `AsyncStore` (whose one worker thread keeps the store single-writer), in order.
    Leaving the block waits for the last collection.

    The hand-over holds one request. That bound loses nothing: `collect_garbage(up_to)` collects
    every step up to `up_to`, so a newer request covers a waiting older one, which is dropped
    instead of blocking the (synchronous) step callback or queueing without bound.
    """
    if keep_steps is None:
        yield on_step
        return
    send, receive = anyio.create_memory_object_stream[int](1)

    async def collect() -> None:
        async with receive:
            async for up_to in receive:
                deleted = await store.collect_garbage(up_to)
                log.debug("collected", up_to_step=up_to, groups=deleted)

    def step_done(record: dict[str, Any]) -> None:
        on_step(record)
        # Never past the newest checkpoint: a resume trains the batches after it again.
        up_to = min(record["step"] - keep_steps, record.get("checkpoint/step", record["step"]))
        if up_to >= 0:
            try:
                send.send_nowait(up_to)
            except anyio.WouldBlock:
                receive.receive_nowait()  # the waiting, older request: `up_to` covers it
                send.send_nowait(up_to)

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect)
        with send:
            yield step_done
