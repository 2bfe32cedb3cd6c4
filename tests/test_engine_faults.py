"""Engine faults on real processes: built-in engines (tiny model), the real sglang-router, real
SIGKILL / SIGSTOP. A dead or hung engine is evicted, restarted (or waited for) and re-admitted with
the current weights and version, while the fleet goes on with the engines that live.

Nothing here sleeps to order events: kills happen at points the engines' own state shows (their
running requests, a publish phase reached), and waits for the fleet are deadlines on its state.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from core.clock import VersionClock
from core.errors import EngineError, EngineLostError, EngineUnavailableError
from core.types import FinishReason, Group, PauseMode, PromptTask, SampleStatus
from launch.builtin_engine import start_engines
from launch.engine_restart import ManagedEngines
from launch.router_process import RouterProcess, start_router
from pipeline.tasks.tiny_model import make_model_folder
from stages.admission import Admission
from stages.generator import GeneratorPool
from stages.publisher import publish_weights
from stages.sglang_client import EngineFleet, GenerateResult
from stages.sglang_client.health import FaultPolicy
from storage import AsyncStore, Cursor, GroupState, MemoryStore

pytestmark = pytest.mark.anyio

POLICY = FaultPolicy(interval=0.5, timeout=2.0, first_wait=0.0, min_live=1, max_restarts=3, restart_backoff=0.2)
PROMPT = [5, 6, 7, 8]
DEADLINE = 60.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("model") / "m", seed=0)


@pytest.fixture
async def managed(model: Path) -> AsyncIterator[tuple[ManagedEngines, RouterProcess]]:
    with anyio.fail_after(DEADLINE):
        procs = await start_engines(2, model, max_running_requests=8)
    engines = ManagedEngines(procs, model, max_running_requests=8)
    try:
        with anyio.fail_after(DEADLINE):
            router = await start_router([p.url for p in procs])
        async with router:
            yield engines, router
    finally:
        await engines.stop()


def fleet_of(router: RouterProcess, restarter: ManagedEngines | None) -> EngineFleet:
    return EngineFleet(
        router_url=router.url,
        concurrency=16,
        request_timeout=60,
        control_timeout=10,
        retry_backoff=0.01,
        fault_policy=POLICY,
        restarter=restarter,
    )


async def until(condition: Callable[[], Awaitable[bool]], what: str, deadline: float = DEADLINE) -> None:
    """Wait for another process's state, with a deadline: polling is the only signal it gives."""
    with anyio.fail_after(deadline):
        while not await condition():  # noqa: ASYNC110 - another process's state gives no event to wait on
            await anyio.sleep(0.05)


async def running_on(fleet: EngineFleet, url: str) -> bool:
    return (await fleet.client_for(url).loads()).running > 0


async def test_an_engine_killed_during_generation_is_evicted_restarted_and_readmitted(managed):
    engines, router = managed
    a, b = (p.url for p in engines.processes)
    async with fleet_of(router, engines) as fleet:
        await fleet.update_weight_version("3")  # the fleet's current version, which a restart must get
        outcomes: list[str] = []

        async def one(i: int) -> None:
            try:
                r = await fleet.generate(
                    PROMPT, {"max_new_tokens": 400, "sampling_seed": i, "ignore_eos": True}, rid=f"g{i}"
                )
                outcomes.append(r.finish_reason.value)
            except EngineError as exc:  # the generator hands such a sample back with its prefix
                assert exc.status is None or exc.status >= 500, exc
                outcomes.append("engine-gone")

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
            await until(lambda: running_on(fleet, b), "b runs requests")
            engines.process(b).process.kill()
        assert len(outcomes) == 8  # every request came back: finished, or handed back to resume

        await until(lambda: _live(fleet, {a, b}), "b re-admitted")
        stats = fleet.fault_statistics()
        assert stats is not None
        assert (stats.evictions_total, stats.restarts_total, stats.readmissions_total) == (1, 1, 1)
        assert stats.reduced_capacity_seconds > 0
        assert await fleet.weight_versions() == {a: "3", b: "3"}  # the restarted engine is current
        assert engines.process(b).returncode is None
        r = await fleet.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True}, rid="after")
        assert r.finish_reason is FinishReason.LENGTH


async def _live(fleet: EngineFleet, urls: set[str]) -> bool:
    return set(fleet.worker_urls) == urls


async def test_a_publish_completes_on_the_live_engine_when_one_dies_in_any_phase(managed, model):
    engines, router = managed
    a, b = (p.url for p in engines.processes)
    clock = VersionClock()
    async with fleet_of(router, engines) as fleet:
        # One fleet, three publishes: engine b dies in a different phase of each, and is back
        # (restarted, current) before the next one.
        for version, phase in enumerate(("after_pause", "during_update", "before_continue"), start=1):
            report = await publish_weights(clock, _Killing(fleet, engines, b, phase), model, pause_mode=PauseMode.ABORT)
            assert report.version == version and clock.version == version  # every live engine took it
            await until(lambda: _live(fleet, {a, b}), f"b back after {phase}")
            assert await fleet.weight_versions() == {a: str(version), b: str(version)}, phase
            stats = fleet.fault_statistics()
            assert stats is not None and stats.restarts_total == version, phase


class _Killing:
    """The fleet as a publish target, killing one engine at one phase of the publish."""

    def __init__(self, fleet: EngineFleet, engines: ManagedEngines, url: str, phase: str) -> None:
        self.fleet, self.engines, self.url, self.phase = fleet, engines, url, phase

    def kill(self) -> None:
        self.engines.process(self.url).process.kill()

    async def pause(self, mode: PauseMode) -> None:
        await self.fleet.pause(mode)
        if self.phase == "after_pause":
            self.kill()

    async def flush_cache(self, deadline: float) -> None:
        await self.fleet.flush_cache(deadline)

    async def update_weights_from_disk(self, path: str, *, weight_version: str, flush_cache: bool = True) -> None:
        if self.phase != "during_update":
            await self.fleet.update_weights_from_disk(path, weight_version=weight_version, flush_cache=flush_cache)
            if self.phase == "before_continue":
                self.kill()
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: self.fleet.update_weights_from_disk(
                    path, weight_version=weight_version, flush_cache=flush_cache
                )
            )
            await anyio.wait_all_tasks_blocked()  # the update requests are on the wire
            self.kill()

    async def continue_generation(self) -> None:
        await self.fleet.continue_generation()


async def test_a_hung_user_engine_is_evicted_within_the_timeout_and_readmitted_when_it_answers(managed):
    engines, router = managed
    a, b = (p.url for p in engines.processes)
    pid = engines.process(b).pid
    async with fleet_of(router, None) as fleet:  # no restarter: engines the user runs
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            await until(lambda: _live(fleet, {a}), "b evicted", deadline=POLICY.interval + POLICY.timeout + 5)
            detected = time.monotonic() - stopped
            assert detected <= POLICY.interval + POLICY.timeout + 2.0, detected
            await fleet.update_weight_version("7")  # control fan-out skips the hung engine
            assert await fleet.weight_versions() == {a: "7"}
        finally:
            os.kill(pid, signal.SIGCONT)
        await until(lambda: _live(fleet, {a, b}), "b re-admitted")
        assert await fleet.weight_versions() == {a: "7", b: "7"}  # made current before it takes work
        stats = fleet.fault_statistics()
        assert stats is not None and (stats.evictions_total, stats.restarts_total) == (1, 0)


async def test_without_a_router_losing_the_only_engine_stops_with_a_clear_error(model):
    with anyio.fail_after(DEADLINE):
        (proc,) = await start_engines(1, model, max_running_requests=4)
    async with proc:
        fleet = EngineFleet([proc.url], concurrency=4, control_timeout=5, fault_policy=POLICY)
        with pytest.raises(BaseExceptionGroup) as caught:
            async with fleet:
                proc.process.kill()
                with anyio.fail_after(DEADLINE):
                    await anyio.sleep_forever()  # the heartbeat ends this with its error
        (error,) = caught.value.exceptions
        assert isinstance(error, EngineUnavailableError)
        assert proc.url in str(error) and "--min-live-engines 1" in str(error)


async def test_the_only_built_in_engine_is_given_up_only_once_its_restarts_are_spent(model, tmp_path):
    """Issue 46.5: evicting the single engine the launcher started ended the run at once, with no
    restart tried. Here every restart fails (its model folder is gone): the run ends only then."""
    with anyio.fail_after(DEADLINE):
        (proc,) = await start_engines(1, model, max_running_requests=4)
    engines = ManagedEngines([proc], tmp_path / "no-such-model", max_running_requests=4)
    policy = FaultPolicy(interval=0.25, timeout=2.0, max_restarts=1, restart_backoff=0.0)
    try:
        fleet = EngineFleet([proc.url], concurrency=4, control_timeout=5, fault_policy=policy, restarter=engines)
        with pytest.raises(BaseExceptionGroup) as caught, anyio.fail_after(DEADLINE):
            async with fleet:
                proc.process.kill()
                await anyio.sleep_forever()  # the fault handling ends this with its error
    finally:
        await engines.stop()
    (error,) = caught.value.exceptions
    assert isinstance(error, EngineLostError)
    said = str(error)
    assert proc.url in said and "not back after 1 restart tries" in said and "0 of 1 engines live" in said, said


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("interval", 0.0, "interval must be > 0"),
        ("timeout", -1.0, "timeout must be > 0"),
        ("min_live", 0, "min_live must be >= 1"),
        ("max_restarts", -1, "max_restarts must be >= 0"),
    ],
)
def test_a_fault_policy_refuses_bad_values_naming_them(field, value, rule):
    with pytest.raises(ValueError, match=rule) as caught:
        FaultPolicy(**{field: value})
    assert str(value) in str(caught.value)


async def test_eviction_needs_a_fault_policy():
    fleet = EngineFleet(["http://127.0.0.1:9"], concurrency=1)
    with pytest.raises(RuntimeError, match="fault_policy"):
        await fleet.evict("http://127.0.0.1:9", "test")


class _StoppingBeforeContinue:
    """The fleet as a publish target; one engine is stopped (SIGSTOP) once it loaded the weights,
    before it is told to continue: a hung engine at the one point where it used to go unnoticed."""

    def __init__(self, fleet: EngineFleet, pid: int) -> None:
        self.fleet, self.pid = fleet, pid

    async def pause(self, mode: PauseMode) -> None:
        await self.fleet.pause(mode)

    async def flush_cache(self, deadline: float) -> None:
        await self.fleet.flush_cache(deadline)

    async def update_weights_from_disk(self, path: str, *, weight_version: str, flush_cache: bool = True) -> None:
        await self.fleet.update_weights_from_disk(path, weight_version=weight_version, flush_cache=flush_cache)
        os.kill(self.pid, signal.SIGSTOP)

    async def continue_generation(self) -> None:
        await self.fleet.continue_generation()


@pytest.mark.slow
async def test_without_fault_tolerance_a_hung_continue_is_an_error_naming_the_engine(model):
    """With the fleet's default control timeout (30 s): the publish used to wait 30 s for the
    continue, give up silently and report success while the engine sat paused on its requests."""
    with anyio.fail_after(DEADLINE):
        (proc,) = await start_engines(1, model, max_running_requests=4)
    async with proc:
        try:
            async with EngineFleet([proc.url], concurrency=4) as fleet:
                target = _StoppingBeforeContinue(fleet, proc.pid)
                with anyio.fail_after(2 * DEADLINE), pytest.raises(EngineUnavailableError) as caught:
                    await publish_weights(VersionClock(), target, model, pause_mode=PauseMode.ABORT)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    assert proc.url in str(caught.value) and "continue_generation" in str(caught.value), caught.value


async def test_with_fault_tolerance_a_hung_continue_evicts_the_engine(managed, model):
    engines, router = managed
    a, b = (p.url for p in engines.processes)
    clock = VersionClock()
    pid = engines.process(b).pid
    async with fleet_of(router, None) as fleet:  # engines the user runs: waited for, not restarted
        try:
            report = await publish_weights(
                clock, _StoppingBeforeContinue(fleet, pid), model, pause_mode=PauseMode.ABORT
            )
            assert report.version == 1 == clock.version
            assert fleet.worker_urls == (a,)
            stats = fleet.fault_statistics()
            assert stats is not None and stats.evictions_total == 1
        finally:
            os.kill(pid, signal.SIGCONT)
        await until(lambda: _live(fleet, {a, b}), "b re-admitted")
        assert await fleet.weight_versions() == {a: "1", b: "1"}


class _SentOnce:
    """The fleet as the pool's engine, failing the test the moment a request goes out again under
    a rid already sent: a timed-out request resent unchanged (no token came back) has the same rid."""

    def __init__(self, fleet: EngineFleet, logs: list[dict[str, object]]) -> None:
        self.fleet, self.logs = fleet, logs
        self.rids: list[str] = []
        self.warned_when_lost: bool | None = None

    async def generate(self, input_ids, sampling_params, *, rid, **fields) -> GenerateResult:
        assert rid not in self.rids, f"{rid} was sent to the engine again after it timed out there"
        self.rids.append(rid)
        try:
            return await self.fleet.generate(input_ids, sampling_params, rid=rid, **fields)
        except EngineLostError:
            if self.warned_when_lost is None:
                self.warned_when_lost = any("has not answered /health" in str(e["event"]) for e in self.logs)
            raise

    async def abort_all(self) -> None:
        await self.fleet.abort_all()


async def test_without_fault_tolerance_a_hung_engine_is_named_while_requests_wait_and_not_sent_them_again(model):
    """Issue 46.4: with the engine SIGSTOPped mid-generation the run said nothing for two request
    timeouts, and sent the timed-out requests back to the stopped engine. Now the liveness watch
    names it while the requests wait, and the first timeout stops the run, naming the engine and
    the fix, with the group back in the store."""
    timeout, silence = 8.0, 1.5  # the watch must speak well before the requests' deadline
    with anyio.fail_after(DEADLINE):
        (proc,) = await start_engines(1, model, max_running_requests=8)
    async with proc:
        store, admission, clock = AsyncStore(MemoryStore()), Admission(), VersionClock()
        group = Group.fresh(PromptTask(0, tuple(PROMPT)), epoch=0, n_samples=4, version=0, seq=0)
        await store.admit([group], Cursor(0, 1, 1))
        admission.grant(1)
        fleet = EngineFleet([proc.url], concurrency=8, request_timeout=timeout, silence_warning=silence)
        to_pool_send, to_pool = anyio.create_memory_object_stream[Group](0)
        out_send, out = anyio.create_memory_object_stream[Group](4)
        try:
            with capture_logs() as logs, pytest.raises(BaseExceptionGroup) as caught, anyio.fail_after(DEADLINE):
                sent = _SentOnce(fleet, logs)
                pool = GeneratorPool(
                    sent,
                    slots=8,
                    sampling_params={"ignore_eos": True},
                    max_response_len=400,
                    clock=clock,
                    store=store,
                    admission=admission,
                )
                async with fleet, to_pool_send, out, anyio.create_task_group() as tg:
                    await fleet.update_weight_version("0")
                    await tg.start(pool.run, to_pool, out_send)
                    await admission.take_ticket()
                    await to_pool_send.send(group)
                    await until(lambda: running_on(fleet, proc.url), "the engine generating")
                    os.kill(proc.pid, signal.SIGSTOP)
                    await anyio.sleep_forever()  # the pool ends this, at the first request's deadline
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    errors = _leaves(caught.value)
    assert errors and all(isinstance(e, EngineLostError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1  # the run's end says it in one line
    said = str(errors[0])
    assert proc.url in said and "hung" in said and "--use-fault-tolerance" in said, said
    assert sent.warned_when_lost, [e["event"] for e in logs]  # named while the requests still waited
    warning = next(str(e["event"]) for e in logs if "has not answered /health" in str(e["event"]))
    assert proc.url in warning and "4 requests wait on it" in warning, warning
    assert sorted(sent.rids) == sorted(f"{group.group_id}-s{i}-0" for i in range(4))  # each sent once
    state, stored = await store.get(group.group_id) or (None, None)
    assert state is GroupState.PARTIAL and stored is not None  # back in the store, nothing lost
    assert all(s.status is not SampleStatus.FAILED for s in stored.samples)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out
