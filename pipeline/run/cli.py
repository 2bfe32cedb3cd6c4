"""`python -m pipeline.launch`: from flags to a running pipeline, and back to a clean machine.

With `pipeline.run`'s other modules, the only code that knows the config tree. It builds plain
components from it (store, engines, trainer, dataset) and hands them to `run_pipeline`, and it
turns how the run ended into an exit status. Built elsewhere in `pipeline/run/`: the engines
(`engines`: the user's, or built-in ones started and stopped here), what the run records beside
the store (`records`: metrics file, dashboards, progress), the parts flags switch on (`parts`: Ray
producers, distributed weight transfer, garbage collection, inline evaluation), the run's
state from its folder (`state`), the model it starts from (`model_folder`, `hub`), and its folder
(`folder`: checked first, written once owned, removed again when the start fails).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import orjson
import structlog

from core.clock import VersionClock
from core.errors import ConfigError, PipelineError
from core.types import StoreTransport
from launch.gc_settings import settle_gc
from pipeline.config import Config, RolloutConfig, load_config
from pipeline.config.derived import derived
from pipeline.config.experts import routed_expert_count
from pipeline.config.show import config_to_toml
from pipeline.controller import run_pipeline
from pipeline.events import EventLog
from pipeline.plan import RolloutPlan
from pipeline.run.end import RunPaths, StopOnSigterm, error_leaves, report_failure, sigint_ignored
from pipeline.run.folder import RunFolder, cannot_create, check_run_folder, resume_hint, run_line
from pipeline.run.node import node_main
from pipeline.run.parts import engine_memory, garbage_collector, inline_evaluator, ray_producers, weight_transfer
from pipeline.run.records import Progress, metrics_sink, print_summary, records_written_back_on_error, restore_metrics
from pipeline.run.run_engines import RunEngines, load_starting_weights
from pipeline.run.state import open_run_state
from stages.continuation import penalties_in
from stages.sglang_client.payloads import TokenPayloads
from storage import AsyncStore

__all__ = ["main"]

log = structlog.get_logger("launch")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--node-rank"]:  # another node of a multi-node megatron run
        return node_main(args[1:])
    show = "--print-config" in args  # print the resolved settings as TOML, run nothing
    try:
        config = load_config([a for a in args if a != "--print-config"])
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if show:
        print(config_to_toml(config), end="")
        return 0
    _configure_logging(config.output.log_level)
    for warning in config.warnings:
        log.warning(warning)
    if sigint_ignored():
        log.warning(
            "SIGINT is ignored in this process (inherited: a job started with & from a script): Ctrl-C and "
            "kill -INT do not stop this run; SIGTERM does (kill PID)"
        )
    stop = StopOnSigterm()
    started = time.monotonic()
    try:
        with stop.installed():
            summary = anyio.run(_run_stoppable, config, stop)
    except (KeyboardInterrupt, asyncio.CancelledError):
        # Ctrl-C arrives as KeyboardInterrupt (asyncio's runner); SIGTERM cancels the main task
        # (`StopOnSigterm`), which comes out of the runner as CancelledError.
        return _stopped(stop.terminated.is_set(), config)
    except ConfigError as exc:  # found once the run folder, dataset or model are looked at
        print(exc, file=sys.stderr)
        return 2
    except PipelineError as exc:  # refused before the run started (a store of another run, a path)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (Exception, BaseExceptionGroup) as exc:  # what crossed the task groups, a full disk, a bug
        if stop.terminated.is_set() and isinstance(exc, BaseExceptionGroup) and not error_leaves(exc):
            return _stopped(True, config)
        leaves = error_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
        if leaves and all(isinstance(e, ConfigError) for e in leaves):  # a setting found wrong once started
            for message in dict.fromkeys(str(e) for e in leaves):  # the same error from many tasks: once
                print(message, file=sys.stderr)
            return 2
        return report_failure(exc, _run_paths(config))
    if stop.terminated.is_set():  # a SIGTERM the run's end swallowed: it still did not finish by itself
        return _stopped(True, config)
    print_summary(summary, config.rollout.num_rollout)
    print(run_line(summary, config, time.monotonic() - started))
    return 0


def _stopped(terminated: bool, config: Config) -> int:
    how = "terminated (SIGTERM)" if terminated else "interrupted"
    if config.storage.transport is StoreTransport.LMDB:
        print(f"{how}: rollout state is in the store; run the same command again to resume", file=sys.stderr)
    else:
        print(f"{how}: {resume_hint(config)}", file=sys.stderr)
    return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


def _run_paths(config: Config) -> RunPaths:
    o, s = config.output, config.storage
    out = Path(derived(o.dir, "output.dir"))
    return RunPaths(
        output_dir=out,
        metrics_file=Path(derived(o.metrics_file, "output.metrics_file")),
        store_dir=Path(derived(s.data_dir, "storage.data_dir")) if s.transport is StoreTransport.LMDB else None,
        tensorboard_dir=Path(o.tensorboard_dir) if o.tensorboard_dir else out / "tensorboard",
    )


async def _run_stoppable(config: Config, stop: StopOnSigterm) -> list[dict[str, Any]]:
    stop.bind()  # this task is the one a SIGTERM cancels
    return await _run(config)


async def _run(config: Config) -> list[dict[str, Any]]:
    # Before anything is written: a new run never writes into another run's folder, and writes
    # nothing into its own before it owns it (`open_run_state` takes it once the store is open).
    folder = check_run_folder(config)
    try:
        return await _run_in(config, folder)
    except BaseException:
        folder.undo()  # a start that failed leaves no run folder behind (a run that started keeps its own)
        raise


async def _run_in(config: Config, folder: RunFolder) -> list[dict[str, Any]]:
    out = folder.path
    # Checked before anything starts, so that a path that cannot be written is one error line, not
    # a traceback after the engines came up.
    metrics_file = Path(derived(config.output.metrics_file, "output.metrics_file"))
    if (problem := cannot_create(metrics_file.parent)) is not None:
        raise ConfigError([f"--metrics-file={metrics_file}: cannot be created ({problem})"])
    async with AsyncExitStack() as stack:
        state = open_run_state(config, folder)  # model, dataset, store, fingerprints, resume point; the folder
        store = AsyncStore(state.store)
        stack.push_async_callback(store.aclose)
        try:
            await anyio.Path(metrics_file.parent).mkdir(parents=True, exist_ok=True)
            await anyio.Path(metrics_file).touch()
        except OSError as exc:  # a file in the way, no permission, a read-only filesystem
            raise ConfigError([f"--metrics-file={metrics_file}: cannot be created ({exc.strerror})"]) from exc
        restored = restore_metrics(config, state.store)
        stack.push(records_written_back_on_error(config, state.store))
        run_engines = RunEngines(config, state.model_path)
        engines = await stack.enter_async_context(run_engines)
        clock = VersionClock(state.version)
        # An engine's weights are what the run says they are: the engines this process started
        # hold the base model; any other engine (the user's, a reused one) is loaded with the
        # run's starting weights, never relabelled (`pipeline.run.run_engines.load_starting_weights`).
        await load_starting_weights(
            engines,
            version=clock.version,
            weights=state.weights or state.model_path,
            started_on_them=run_engines.started_here and state.weights is None,
        )
        trainer = await anyio.to_thread.run_sync(state.make_trainer)
        stack.callback(trainer.close)  # the megatron backend: releases and waits for ranks 1..N-1
        transfer = await weight_transfer(config, trainer, engines, stack)
        # Start-up's heap out of the collector's scans, and a young generation large enough that
        # samples are trained and freed before a collection walks their 1k-token tuples.
        settle_gc()
        sink = metrics_sink(config, out, restored, state.store)
        stack.callback(sink.close)
        # Engine slots, training steps and publishes, for `python -m pipeline.timeline`.
        events = EventLog(out / "events.jsonl")
        stack.callback(events.close)
        for regenerated in state.regenerated:  # prompts generated again after damage to the store, named
            events.record("regenerated", **regenerated)
        progress = Progress(config, state.start_step)
        stack.callback(progress.close)
        log.info(
            "run starts",
            output=str(out),
            mode=config.rollout.mode,
            partial=config.rollout.partial_rollout,
            transport=config.storage.transport,
            engines=engines.worker_urls,
            start_step=state.start_step,
        )
        plan = _plan(config)
        producers = await ray_producers(config, state, engines, plan, store, stack)
        evaluate = await inline_evaluator(config, state, engines, out, sink)
        folder.started()  # runs/latest points here from now on
        async with garbage_collector(store, config.storage.gc_keep_steps, progress.update_step) as on_step:
            summary = await run_pipeline(
                plan,
                engines=engines,
                store=store,
                trainer=trainer,
                dataset=state.dataset,
                reward_fn=state.reward_fn,
                filter_fn=config.data.filter_fn,
                weights_dir=out / "weights",
                metrics=sink,
                clock=clock,
                on_step=on_step,
                events=events,
                weight_transfer=transfer,
                agent=config.data.agent_fn or state.agent,
                producers=producers,
                evaluate=evaluate,
                checkpoints=state.checkpoints,
                resume_from=state.replay_from,
                engine_memory=engine_memory(config, transfer),
            )
        return summary.metrics


def _plan(config: Config) -> RolloutPlan:
    r = config.rollout
    n_engines = max(1, len(config.engine.urls) or config.engine.num_engines)
    return RolloutPlan(
        mode=r.mode,
        batch_size=r.rollout_batch_size,
        n_samples=r.n_samples_per_prompt,
        num_steps=r.num_rollout,
        partial=r.partial_rollout,
        over_sampling=r.over_sampling_batch_size,
        prefetch=r.prefetch,
        fill_idle_slots=r.partial_fill_idle_slots,
        max_staleness=r.max_staleness,
        pace_async=r.pace_async,
        pause_mode=r.pause_mode,
        overlap_publish=r.overlap_weight_transfer,
        slots=config.engine.sglang_server_concurrency * n_engines,
        max_response_len=r.max_response_len,
        sampling_params=_sampling_params(r),
        reward_timeout=r.reward_timeout,
        reward_max_retries=r.reward_max_retries,
        agent_max_retries=r.agent_max_retries,
        seed=r.seed,
        store_batch=r.store_batch,
        skip_zero_std=r.skip_zero_std_prompts,
        skip_explore_floor=r.skip_explore_floor,
        length_aware_admission=r.length_aware_admission,
        payloads=TokenPayloads(
            routed_experts_top_k=r.moe_router_topk if r.use_rollout_routing_replay else None,
            sampler_top_k=r.score_centering_top_k if r.use_score_centering else None,
            routed_experts_count=_expert_count(config) if r.use_rollout_routing_replay else None,
        ),
    )


def _expert_count(config: Config) -> int | None:
    """The model's experts per MoE layer, where a file says it (the tiny model's --num-experts, a
    local --hf-checkpoint's config.json): R3's routes are then packed by it, one byte an id up to
    255. A Hub id's is not read here: the routes are packed by the ids the engines send."""
    if config.engine.num_experts is not None:
        return config.engine.num_experts
    folder = Path(config.engine.hf_checkpoint).expanduser() if config.engine.hf_checkpoint else None
    try:
        found = orjson.loads((folder / "config.json").read_bytes()) if folder is not None else None
    except (OSError, orjson.JSONDecodeError):
        return None  # the load step named an unreadable config.json already
    return routed_expert_count(found) if isinstance(found, dict) else None


def _sampling_params(r: RolloutConfig) -> dict[str, Any]:
    """The engine's sampling parameters; the optional ones only when set, so engines that do not
    know them never see them."""
    params: dict[str, Any] = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}
    if r.min_new_tokens:
        params["min_new_tokens"] = r.min_new_tokens
    params.update(
        penalties_in(
            {
                "frequency_penalty": r.frequency_penalty,
                "presence_penalty": r.presence_penalty,
                "repetition_penalty": r.repetition_penalty,
            }
        )
    )
    return params


def _configure_logging(level: str) -> None:
    # transformers draws a progress bar for every tiny save and load; one bar (ours) is enough.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(message)s")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())))
