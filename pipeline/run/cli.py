"""`python -m pipeline.launch`: from flags to a running pipeline, and back to a clean machine.

This is the only module that knows the config tree. It builds plain components from it (store,
engines, trainer, dataset) and hands them to `run_pipeline`. With no engine URL it starts the
built-in engine(s) itself, behind the real sglang-router when there is more than one, and stops
them on exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import structlog

from core.clock import VersionClock
from core.errors import ConfigError, EngineError, PipelineError
from core.types import StoreTransport, WeightTransport
from launch.gc_settings import settle_gc
from pipeline.config import Config, EngineConfig, RolloutConfig, config_to_dict, load_config
from pipeline.config.derived import derived
from pipeline.config.rules import producer_slots_problem
from pipeline.config.show import config_to_toml
from pipeline.controller import run_pipeline
from pipeline.events import EventLog
from pipeline.metric_sinks import SinkSettings, open_step_sinks, wandb_mode
from pipeline.metrics import MetricsSink, RestoredMetrics, restore_metrics_file
from pipeline.plan import RolloutPlan
from pipeline.run.end import RunPaths, StopOnSigterm, error_leaves, report_failure
from pipeline.run.eval_run import EVAL_FILE, InlineEvaluator, eval_sets, eval_settings
from pipeline.run.folder import claim_run_folder, resume_hint, run_line
from pipeline.run.node import node_main
from pipeline.run.state import RunState, open_run_state
from stages.continuation import penalties_in
from stages.producers import ProducersFactory
from stages.sglang import EngineFleet
from stages.sglang.health import FaultPolicy
from stages.sglang.payloads import TokenPayloads
from stages.sglang.publish_distributed import DistributedWeightSender
from storage import AsyncStore, Store

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
    _print_summary(summary, config.rollout.num_rollout)
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
    out = Path(derived(config.output.dir, "output.dir"))
    # Before anything is written: a new run never writes into another run's folder.
    claim_run_folder(config)
    # Checked before anything starts, so that a path that cannot be written is one error line, not
    # a traceback after the engines came up.
    metrics_file = Path(derived(config.output.metrics_file, "output.metrics_file"))
    for flag, path, make in (("--output-dir", out, out), ("--metrics-file", metrics_file, metrics_file.parent)):
        try:
            await anyio.Path(make).mkdir(parents=True, exist_ok=True)
            if path is metrics_file:
                await anyio.Path(path).touch()
        except OSError as exc:  # a file in the way, no permission, a read-only filesystem
            raise ConfigError([f"{flag}={path}: cannot be created ({exc.strerror})"]) from exc
    async with AsyncExitStack() as stack:
        state = open_run_state(config)  # model folder, dataset, store, fingerprints, resume point
        restored = _restore_metrics(config, state.store)
        store = AsyncStore(state.store)
        stack.push_async_callback(store.aclose)
        stack.push(_records_written_back_on_error(config, state.store))
        engines = await stack.enter_async_context(_engines(config, state.model_path))
        clock = VersionClock(state.version)
        # The engines must report the clock's version before the first request: a fresh engine
        # says "default" or "0"; a resumed run loads the weights of the last finished step.
        if state.weights is None:
            await align_weight_versions(engines, clock.version)
            engines.set_current_weights(None, str(clock.version))  # what a re-admitted engine is made
        else:
            await engines.update_weights_from_disk(str(state.weights), weight_version=str(clock.version))
        trainer = await anyio.to_thread.run_sync(state.make_trainer)
        if callable(close := getattr(trainer, "close", None)):
            stack.callback(close)  # the megatron backend: releases and waits for ranks 1..N-1
        transfer = await _weight_transfer(config, trainer, engines, stack)
        # Start-up's heap out of the collector's scans, and a young generation large enough that
        # samples are trained and freed before a collection walks their 1k-token tuples.
        settle_gc()
        sink = _metrics_sink(config, out, restored, state.store)
        stack.callback(sink.close)
        # Engine slots, training steps and publishes, for `python -m pipeline.timeline`.
        events = EventLog(out / "events.jsonl")
        stack.callback(events.close)
        progress = _progress(config, state.start_step)
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
        producers = await _producers(config, state, engines, plan, store, stack)
        evaluate = await _inline_evaluator(config, state, engines, out, sink)
        async with _garbage_collector(store, config.storage.gc_keep_steps, progress.update_step) as on_step:
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
            )
        return summary.metrics


async def _inline_evaluator(
    config: Config, state: RunState, engines: EngineFleet, out: Path, sink: MetricsSink
) -> InlineEvaluator | None:
    """With `--eval-interval` (sync mode; the rules refuse async), the evaluator `run_pipeline` calls
    after each step; a step the crash left unevaluated is evaluated first (pipeline/run/eval_run.py)."""
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
    return evaluator


async def _producers(
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
            reward_path=d.custom_rm_path or _path_of(state.reward_fn),
            reward_timeout=plan.reward_timeout,
            reward_max_retries=plan.reward_max_retries,
            agent_max_retries=plan.agent_max_retries,
            filter_path=d.dynamic_sampling_filter_path,
            agent_path=d.custom_generate_function_path or (_path_of(state.agent) if state.agent else None),
            seed=plan.seed,
            # The version the engines serve when producers get work: a replay (if any) has run by then.
            version=state.start_step,
            request_timeout=r.request_timeout,
            max_retries=r.max_retries,
            api_key=config.engine.api_key or None,
            routed_experts_top_k=plan.payloads.routed_experts_top_k,
            sampler_top_k=plan.payloads.sampler_top_k,
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


def _path_of(fn: Callable[..., Any]) -> str:
    """A built-in function's `module:function` path, for producers that import it themselves."""
    return f"{fn.__module__}:{fn.__qualname__}"


async def _weight_transfer(
    config: Config, trainer: Any, engines: EngineFleet, stack: AsyncExitStack
) -> DistributedWeightSender | None:
    """With `--update-weight-transport distributed`, the trainer is rank 0 of a group with the
    engines: join it now (a failure shows at start, not at the first publish), leave it at exit."""
    if config.rollout.update_weight_transport != WeightTransport.DISTRIBUTED:
        return None
    # The torch trainer's parameters carry HF names already; the megatron backend gathers its
    # tensor-parallel shards and converts them (`MegatronTrainer.hf_weights`).
    weights = getattr(trainer, "hf_weights", None) or trainer.model.named_parameters
    sender = DistributedWeightSender(
        weights,
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


@asynccontextmanager
async def _garbage_collector(
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


def _restore_metrics(config: Config, store: Store) -> RestoredMetrics:
    """One metrics record per trained step before this run appends any: see `pipeline.metrics`."""
    path = Path(derived(config.output.metrics_file, "output.metrics_file"))
    restored = restore_metrics_file(path, trained_step=store.trained_step(), stored=store.step_metrics())
    if restored.rebuilt:
        log.warning("metrics records written back from the store", file=str(path), steps=list(restored.rebuilt))
    if restored.dropped:
        log.warning("metrics records moved aside", file=str(path) + ".dropped", why=list(restored.dropped))
    if restored.missing:
        log.warning("trained steps with no metrics record anywhere", steps=list(restored.missing))
    return restored


def _records_written_back_on_error(config: Config, store: Store) -> Callable[..., None]:
    """An exit hook: a run that ends in an error (or a stop) after committing a step whose record
    it had not appended yet (the publish after the commit failed) writes that record to the
    metrics file from the store before it exits, instead of leaving it to the next resume."""

    def on_exit(exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            return
        try:
            _restore_metrics(config, store)
        except (OSError, PipelineError) as error:  # a full disk says so itself, in the error line
            log.warning("the metrics records of committed steps were not written back", error=str(error))

    return on_exit


def dashboard_settings(config: Config) -> SinkSettings:
    """The dashboard flags as the sinks take them (the run and `python -m pipeline.eval` alike)."""
    o = config.output
    return SinkSettings(
        use_tensorboard=o.use_tensorboard,
        tensorboard_dir=o.tensorboard_dir,
        use_wandb=o.use_wandb,
        wandb_project=o.wandb_project,
        wandb_group=o.wandb_group,
        wandb_mode=wandb_mode(o.wandb_mode),
        wandb_dir=o.wandb_dir,
        wandb_run_id=o.wandb_run_id,
    )


def _metrics_sink(config: Config, out: Path, restored: RestoredMetrics, store: Store) -> MetricsSink:
    """The metrics file plus the dashboards asked for; records rebuilt from the store go to them too."""
    o = config.output
    settings = dashboard_settings(config)
    warn = log.warning
    extras = open_step_sinks(
        settings, output_dir=out, run_id=config.storage.run_id, warn=warn, config=config_to_dict(config)
    )
    sink = MetricsSink(Path(derived(o.metrics_file, "output.metrics_file")), extras, warn=warn)
    if extras and restored.rebuilt:
        stored = store.step_metrics(min(restored.rebuilt))
        for step in restored.rebuilt:
            sink.write_extras(stored[step])
    return sink


async def align_weight_versions(engines: EngineFleet, version: int) -> None:
    """Make every engine report `version` before the first request (a fresh SGLang says "default").

    Engines that already do are left alone; an engine too old for `/update_weight_version` is
    named, with the launch flag that fixes it.
    """
    reported = await engines.weight_versions()
    if all(v == str(version) for v in reported.values()):
        return
    try:
        await engines.update_weight_version(str(version))
    except EngineError as exc:
        if exc.status != 404:
            raise
        raise EngineError(
            exc.url,
            f"reports weight_version {reported} and has no /update_weight_version; "
            f"start it with --weight-version {version}",
            status=404,
        ) from exc


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
        payloads=TokenPayloads(
            routed_experts_top_k=r.moe_router_topk if r.use_rollout_routing_replay else None,
            sampler_top_k=r.score_centering_top_k if r.use_score_centering else None,
        ),
    )


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


def _fault_policy(e: EngineConfig) -> FaultPolicy | None:
    if not e.use_fault_tolerance:
        return None
    return FaultPolicy(
        interval=e.health_check_interval,
        timeout=e.health_check_timeout,
        first_wait=e.health_check_first_wait,
        min_live=e.min_live_engines,
        max_restarts=e.max_engine_restarts,
    )


class _engines:
    """The engines for this run: the user's, or built-in ones this process starts and stops."""

    def __init__(self, config: Config, model_path: Path) -> None:
        self._config = config
        self._model_path = model_path
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> EngineFleet:
        from launch.engine_process import start_engines
        from launch.engine_restart import ManagedEngines
        from launch.router_process import start_router

        e = self._config.engine
        slots = e.sglang_server_concurrency
        timeout = self._config.rollout.request_timeout
        retries = self._config.rollout.max_retries
        key = e.api_key or None  # sent as 'Authorization: Bearer KEY'
        await self._stack.__aenter__()
        faults: dict[str, Any] = {"fault_policy": _fault_policy(e)}
        try:
            if e.router_url:
                fleet = EngineFleet(
                    router_url=e.router_url,
                    concurrency=slots,
                    request_timeout=timeout,
                    max_retries=retries,
                    api_key=key,
                    **faults,
                )
            elif len(e.urls) == 1:
                fleet = EngineFleet(
                    list(e.urls), concurrency=slots, request_timeout=timeout, max_retries=retries, api_key=key, **faults
                )
            elif e.urls:
                # Several engines need a router in front of them; the pipeline starts one.
                router = await start_router(list(e.urls), host=e.host, log_path=self._router_log(), api_key=e.api_key)
                self._stack.push_async_exit(router)
                fleet = EngineFleet(
                    list(e.urls),
                    router_url=router.url,
                    concurrency=slots * len(e.urls),
                    request_timeout=timeout,
                    max_retries=retries,
                    api_key=key,
                    **faults,
                )
            else:
                log_dir = Path(derived(self._config.output.dir, "output.dir")) / "logs"
                if e.launcher == "sglang":
                    from launch.sglang_server import start_sglang_servers

                    procs = await start_sglang_servers(
                        self._model_path,
                        engine=e,
                        log_dir=log_dir,
                        seed=self._config.rollout.seed,
                    )
                else:
                    procs = await start_engines(
                        e.num_engines,
                        self._model_path,
                        host=e.host,
                        max_running_requests=slots,
                        log_dir=log_dir,
                        extra_args=["--device", e.device],
                    )
                if e.use_fault_tolerance and e.launcher != "sglang":
                    # Restarted engines replace the started ones: stop whichever run at exit.
                    managed = ManagedEngines(procs, self._model_path, host=e.host, max_running_requests=slots)
                    self._stack.push_async_callback(managed.stop)
                    faults["restarter"] = managed
                else:
                    for proc in procs:
                        self._stack.push_async_exit(proc)  # stopped on exit, whatever happens
                urls = [p.url for p in procs]
                if len(urls) > 1:
                    router = await start_router(urls, host=e.host, log_path=self._router_log(), api_key=e.api_key)
                    self._stack.push_async_exit(router)
                    fleet = EngineFleet(
                        urls,
                        router_url=router.url,
                        concurrency=slots * len(urls),
                        request_timeout=timeout,
                        max_retries=retries,
                        api_key=key,
                        **faults,
                    )
                else:
                    fleet = EngineFleet(
                        urls, concurrency=slots, request_timeout=timeout, max_retries=retries, api_key=key, **faults
                    )
            return await self._stack.enter_async_context(fleet)
        except BaseException:
            await self._stack.aclose()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.__aexit__(exc_type, exc, tb)

    def _router_log(self) -> Path:
        logs = Path(derived(self._config.output.dir, "output.dir")) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return logs / "router.log"


class _progress:
    def __init__(self, config: Config, start_step: int) -> None:
        self._bar = None
        if config.output.progress and sys.stderr.isatty():  # in a log file, plain lines (below)
            from tqdm import tqdm

            self._bar = tqdm(total=config.rollout.num_rollout, initial=start_step, unit="step", dynamic_ncols=True)

    def update_step(self, record: dict[str, Any]) -> None:
        if self._bar is None:
            log.info(
                "step",
                step=record["step"],
                reward=round(record["reward/mean"], 3),
                staleness_max=record["staleness/max"],
                multi_version=round(record["staleness/multi_version_frac"], 3),
                groups_per_s=round(record["groups/per_second"], 2),
                engine_busy=round(record["engine/busy_frac"], 2),
                trainer_idle=round(record["trainer/idle_frac"], 2),
            )
            return
        self._bar.set_postfix(
            reward=f"{record['reward/mean']:.3f}",
            len=f"{record['response_len/mean']:.1f}",
            stale=record["staleness/max"],
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _print_summary(records: list[dict[str, Any]], num_rollout: int) -> None:
    if not records:
        print(f"nothing to do: the run has trained all of its --num-rollout={num_rollout} steps")
        return
    k = max(1, min(5, len(records) // 4))
    first = statistics.fmean(r["reward/mean"] for r in records[:k])
    last = statistics.fmean(r["reward/mean"] for r in records[-k:])
    print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({len(records)} steps)")


def _configure_logging(level: str) -> None:
    # transformers draws a progress bar for every tiny save and load; one bar (ours) is enough.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(message)s")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())))
