"""One producer's stages in process (`launch.ray_producer.ProducerCore`, no Ray): what it answers
the controller, over real HTTP to the protocol-speaking fake engine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import orjson
import pytest

from core.errors import PluginError
from core.types import Group, PromptTask, SampleStatus
from launch.ray_producer import ProducerCore, ProducerSpec, ResultKind
from storage.codec import decode_group, encode_group
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio

G = 2


def reward(task, sample) -> float:
    return 1.0


def spec(url: str, **kw) -> ProducerSpec:
    values = dict(
        name="producer-0",
        engine_urls=(url,),
        router_url=None,
        group_slots=2,
        n_samples=G,
        sampling_params={},
        max_response_len=6,
        reward_path="tests.test_producer_core:reward",
    )
    return ProducerSpec(**{**values, **kw})


def group(i: int) -> Group:
    return Group.fresh(PromptTask(index=i, prompt_ids=(5, 100 + i)), epoch=0, n_samples=G, version=0, seq=i)


def test_a_spec_from_another_code_version_still_reads() -> None:
    s = spec("http://127.0.0.1:1")
    assert ProducerSpec.from_json(s.to_json()) == s
    newer = orjson.loads(s.to_json()) | {"a_field_from_the_future": 1}
    del newer["seed"]  # and one it does not send: the default
    assert ProducerSpec.from_json(orjson.dumps(newer)) == s


async def test_results_come_back_as_codec_bytes_and_a_publish_returns_the_partials() -> None:
    async with FakeSGLang(weight_version="0") as fake:
        core = ProducerCore(spec(fake.url), node="here")
        async with anyio.create_task_group() as tg:
            await tg.start(core.run)
            await core.submit(encode_group(group(0)))
            with anyio.fail_after(10):
                ((kind, data),) = await core.take_results(8)
            done = decode_group(data)
            assert kind == ResultKind.ACCEPTED.value and done.group_id == group(0).group_id
            assert all(s.status is SampleStatus.TRUNCATED and s.reward == 1.0 for s in done.samples)

            fake.hold(2)  # the next group's requests park after two tokens: a publish finds them running
            await core.submit(encode_group(group(1)))
            with anyio.fail_after(10):
                await fake.wait_until(lambda: fake.held == G)
                partial = await core.begin_publish(1, "abort", False)
            ((kind, data),) = partial
            back = decode_group(data)
            assert kind == ResultKind.PARTIAL.value and all(s.response_len == 2 for s in back.samples)
            assert core.clock.publishing and core.statistics()["in_hand"] == 0
            await core.end_publish(1)
            assert core.clock.version == 1 and not core.clock.publishing
            fake.release()
            tg.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def publish_with_one_running_one_waiting() -> AsyncIterator[tuple[FakeSGLang, ProducerCore, list]]:
    """One group's slots: A runs (parked after two tokens), B waits its turn here; then an
    abort-mode publish begins. Yields the engine, the producer and the publish's answer."""
    async with FakeSGLang(weight_version="0") as fake:
        core = ProducerCore(spec(fake.url, group_slots=1), node="here")
        async with anyio.create_task_group() as tg:
            await tg.start(core.run)
            fake.hold(2)
            await core.submit_many([encode_group(group(0)), encode_group(group(1))])
            with anyio.fail_after(10):
                await fake.wait_until(lambda: fake.held == G)
                partial = await core.begin_publish(1, "abort", False)
            yield fake, core, partial
            fake.release()
            tg.cancel_scope.cancel()


async def test_a_publish_keeps_the_groups_that_had_not_started_and_runs_them_after_it() -> None:
    """The abort sends A back with its prefixes; B, which the stopping pool let through untouched,
    has nothing worth sending back: it stays, still in hand, and runs once the publish ends."""
    async with publish_with_one_running_one_waiting() as (fake, core, partial):
        ((kind, data),) = partial  # A alone
        back = decode_group(data)
        assert kind == ResultKind.PARTIAL.value and back.group_id == group(0).group_id
        assert all(s.response_len == 2 for s in back.samples)
        assert core.statistics()["in_hand"] == 1 and len(core.results) == 0  # B: kept, not sent
        fake.release()
        fake.weight_version = "1"
        await core.end_publish(1)
        with anyio.fail_after(10):
            ((kind, data),) = await core.take_results(8)
        done = decode_group(data)
        assert kind == ResultKind.ACCEPTED.value and done.group_id == group(1).group_id
        assert all(s.status is SampleStatus.TRUNCATED for s in done.samples)
        assert {span.version for s in done.samples for span in s.spans} == {1}  # generated after it
        assert core.statistics()["in_hand"] == 0


async def test_a_stop_during_a_publish_sends_the_kept_groups_back() -> None:
    """The run ends (or a sync round's stop comes) inside a publish: what the publish kept goes
    back as partial too, so the producer ends with nothing in hand."""
    async with publish_with_one_running_one_waiting() as (_, core, _):
        assert core.statistics()["in_hand"] == 1
        with anyio.fail_after(10):
            async with anyio.create_task_group() as stopping:
                stopping.start_soon(core.stop)  # returns once the controller took everything
                ((kind, data),) = await core.take_results(8)
        assert kind == ResultKind.PARTIAL.value and decode_group(data) == group(1)
        assert core.statistics()["in_hand"] == 0


async def test_groups_submitted_together_come_back_together_in_one_take() -> None:
    """The controller hands out what is waiting in one call and takes back all that is finished in
    one call: three groups in, each once, and, once all are done, all three from one take."""
    async with FakeSGLang(weight_version="0") as fake:
        core = ProducerCore(spec(fake.url, group_slots=3), node="here")
        async with anyio.create_task_group() as tg:
            await tg.start(core.run)
            fake.hold(2)  # every request parks after two tokens, so all three finish at once
            await core.submit_many([encode_group(group(i)) for i in range(3)])
            with anyio.fail_after(10):
                await fake.wait_until(lambda: fake.held == 3 * G)
                assert core.statistics()["in_hand"] == 3
                fake.release()
                await core.admission.wait_settled()  # each one settled READY as it left
                taken = await core.take_results(64)
            assert [kind for kind, _ in taken] == [ResultKind.ACCEPTED.value] * 3
            assert sorted(decode_group(data).group_id for _, data in taken) == sorted(
                group(i).group_id for i in range(3)
            )
            assert len(core.results) == 0
            tg.cancel_scope.cancel()


async def test_a_reward_path_that_does_not_import_names_the_node() -> None:
    core = ProducerCore(spec("http://127.0.0.1:9", reward_path="tests.no_such_module:reward"), node="node-7")
    with pytest.raises(PluginError, match=r"reward function cannot be imported on producer node node-7: module"):
        await core.run(task_status=anyio.TASK_STATUS_IGNORED)
