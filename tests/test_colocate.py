"""Colocated on one GPU (issue 47), the parts a CPU can check: the wire format both ends read
(flattened buckets, the restricted unpickler refusing what is not a bucket), the client's request
bodies against SGLang's field names, slime's sequence through the real publisher and `Rollout`
over real HTTP to the protocol-speaking fake, the built-in engine's refusals on a CPU and its
memory state machine, and the config rules. What needs a GPU (CUDA IPC, memory really released,
measured from outside) is in tests/test_gpu_colocate.py (`pytest -m gpu`)."""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
import torch

from core.clock import VersionClock
from core.errors import ConfigError, PublishError
from core.types import PauseMode, PromptTask, RolloutMode, Sample
from engines.builtin import EngineServer, open_server
from engines.memory_saver import ALL_TAGS, MemorySaver
from engines.occupation import MemoryOccupation
from engines.tensor_wire import Bucket, BucketEntry, WireError, load_bucket, unflatten
from launch.sglang_server import sglang_command_args
from pipeline import AsyncStore, EngineFleet, MemoryStore, Rollout, RolloutPlan
from pipeline.config import load_config
from pipeline.run.run_engines import builtin_engine_args
from stages.publisher import publish_weights
from stages.sglang_client.publish_tensor import ColocatedWeights, FlatBucket, flatten_bucket, plan_buckets
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio


# ---- the wire: flattened buckets and the restricted unpickler ------------------------------------------


def _entries(bucket: FlatBucket) -> list[BucketEntry]:
    """The client's metadata as the engine's unpickler builds it (REDUCE, then BUILD)."""
    out = []
    for m in bucket.metadata:
        entry = BucketEntry()
        entry.__setstate__(vars(m))
        out.append(entry)
    return out


def test_a_flattened_bucket_comes_back_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    named = [
        ("embed", torch.randn(5, 3, generator=g)),  # fp32 masters, sent as bf16
        ("norm", torch.randn(7, generator=g)),
        ("proj", torch.randn(2, 3, 4, generator=g)),
    ]
    bucket = flatten_bucket(named, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert bucket.flat.dtype == torch.bfloat16 and [m.start_idx for m in bucket.metadata] == [0, 15, 22]
    got = unflatten(Bucket(bucket.flat, _entries(bucket)))
    assert [n for n, _ in got] == ["embed", "norm", "proj"]
    for (_, sent), (_, back) in zip(named, got, strict=True):
        assert back.dtype == torch.bfloat16 and back.shape == sent.shape
        assert torch.equal(back.view(torch.int16), sent.to(torch.bfloat16).view(torch.int16))
    # Without a send dtype each bucket takes one dtype of its own (every SGLang reads that layout).
    mixed = [("a", torch.arange(3)), ("b", torch.ones(2)), ("c", torch.zeros(2))]
    plan = plan_buckets(mixed, bucket_bytes=1 << 20, dtype=None)
    assert [[n for n, _ in b] for b in plan] == [["a"], ["b", "c"]]
    with pytest.raises(ValueError, match="one dtype"):
        flatten_bucket(mixed, dtype=None, device=torch.device("cpu"))


def test_sglangs_byte_layout_for_mixed_dtypes_is_read_too() -> None:
    """What slime sends to a newer SGLang: one uint8 buffer, byte offsets, a dtype per entry."""
    parts = [("w", torch.randn(3, 2).to(torch.bfloat16)), ("b", torch.randn(4))]
    flat = torch.cat([parts[0][1].flatten().view(torch.uint8), parts[1][1].view(torch.uint8)])
    entries = []
    for (name, t), start in zip(parts, (0, 12), strict=True):
        entry = BucketEntry()
        nbytes = t.numel() * t.element_size()
        entry.__setstate__(
            {"name": name, "shape": t.shape, "dtype": t.dtype, "start_idx": start, "end_idx": start + nbytes}
        )
        entries.append(entry)
    got = dict(unflatten(Bucket(flat, entries)))
    assert torch.equal(got["w"].view(torch.int16), parts[0][1].view(torch.int16)) and torch.equal(got["b"], parts[1][1])


def test_the_older_single_dtype_layout_is_read_too() -> None:
    """SGLang before mixed dtypes: the flat tensor has the entries' dtype, offsets in elements."""
    flat = torch.arange(10, dtype=torch.float32)
    entry = BucketEntry()
    entry.__setstate__(
        {"name": "w", "shape": torch.Size([2, 3]), "dtype": torch.float32, "start_idx": 4, "end_idx": 10}
    )
    ((name, t),) = unflatten(Bucket(flat, [entry]))
    assert name == "w" and torch.equal(t, torch.arange(4, 10, dtype=torch.float32).reshape(2, 3))


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({"start_idx": 0, "end_idx": 64}, "past the bucket"),
        ({"start_idx": 2, "end_idx": 10}, "not aligned"),
        ({"start_idx": 0, "end_idx": 6}, "6 bytes for 2 values"),
        ({"start_idx": 8, "end_idx": 0}, "0 <= start <= end"),
        ({"shape": (-1,)}, "non-negative"),
        ({"name": ""}, "non-empty"),
    ],
)
def test_a_bucket_whose_metadata_does_not_fit_is_refused(state: dict[str, Any], why: str) -> None:
    entry = BucketEntry()
    entry.__setstate__({"name": "w", "shape": (2,), "dtype": torch.float32, "start_idx": 0, "end_idx": 8, **state})
    with pytest.raises(WireError, match=why):
        unflatten(Bucket(torch.zeros(32, dtype=torch.uint8), [entry]))


class _Evil:
    """A pickle that would run a shell command when loaded by a plain unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _CudaTensorOnTheWire:
    """What torch's CUDA reduction writes for a tensor (15 arguments to `rebuild_cuda_tensor`),
    made on a CPU: the handle bytes are made up, the stream's globals are the real ones."""

    def __reduce__(self) -> tuple[Any, ...]:
        from torch.multiprocessing import reductions

        args = (
            torch.Tensor, torch.Size([64]), (1,), 0, torch.storage.TypedStorage, torch.uint8,
            "GPU-00000000-0000-0000-0000-000000000000", b"\x00" * 64, 64, 0, False, b"ref", 0, b"ev", True,
        )  # fmt: skip
        return (reductions.rebuild_cuda_tensor, args)


def _wire(obj: object) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda marker: _Evil(marker), id="os.system"),
        pytest.param(lambda marker: {"flattened_tensor": _Evil(marker), "metadata": []}, id="nested os.system"),
        pytest.param(lambda marker: {"flattened_tensor": torch.zeros(2), "metadata": []}, id="cpu tensor"),
        pytest.param(lambda marker: {"x": eval}, id="builtins.eval"),
        pytest.param(lambda marker: {"x": torch.load}, id="torch.load"),
    ],
)
def test_the_restricted_unpickler_refuses_what_is_not_a_bucket_before_running_it(payload: Any, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(WireError, match=r"refused \S+"):
        load_bucket(_wire(payload(marker)))
    assert not marker.exists()  # nothing ran


def test_a_well_formed_bucket_reaches_the_guarded_rebuild_which_needs_a_gpu() -> None:
    """The admitted names (torch's CUDA rebuild, Tensor, Size, TypedStorage, dtypes, the metadata
    class) load; the rebuild itself then says a CPU cannot open CUDA IPC handles."""
    meta = types.SimpleNamespace(name="w", shape=torch.Size([8]), dtype=torch.bfloat16, start_idx=0, end_idx=16)
    payload = {"flattened_tensor": _CudaTensorOnTheWire(), "metadata": [meta]}
    with pytest.raises(WireError, match="no GPU"):
        load_bucket(_wire(payload))


def test_sglangs_own_metadata_class_is_read_as_the_engines() -> None:
    """slime pickles `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` (a dataclass):
    the engine, which has no SGLang, reads it as its own entry, built from the state alone."""

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    FlattenedTensorMetadata.__module__ = module.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = FlattenedTensorMetadata  # type: ignore[attr-defined]
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync", module.__name__]
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update({n: types.ModuleType(n) for n in names[:-1]} | {module.__name__: module})
    try:
        meta = FlattenedTensorMetadata("w", torch.Size([4]), torch.float32, 0, 16, 16)
        raw = pickle.dumps({"metadata": [meta]})
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    with pytest.raises(WireError, match="expected") as refused:  # no flattened_tensor in this one
        load_bucket(base64.b64encode(raw).decode())
    assert "FlattenedTensorMetadata" not in str(refused.value)  # the class itself was admitted


def test_a_bucket_that_is_not_base64_or_not_a_pickle_is_refused_clearly() -> None:
    with pytest.raises(WireError, match="not base64"):
        load_bucket("not base64!")
    with pytest.raises(WireError, match="not a readable pickle"):
        load_bucket(base64.b64encode(b"\x80\x05garbage").decode())


def test_buckets_are_bounded_and_keep_the_order() -> None:
    named = [(f"w{i}", torch.zeros(100)) for i in range(10)]  # 200 bf16 bytes each
    plan = plan_buckets(named, bucket_bytes=500, dtype=torch.bfloat16)
    assert [len(b) for b in plan] == [2, 2, 2, 2, 2]
    assert [n for b in plan for n, _ in b] == [n for n, _ in named]
    big = plan_buckets([("huge", torch.zeros(1000)), ("small", torch.zeros(1))], bucket_bytes=500, dtype=None)
    assert [[n for n, _ in b] for b in big] == [["huge"], ["small"]]  # a tensor over the bound goes alone


# ---- the client: bodies and slime's sequence through the real publisher ---------------------------------


def _cpu_entry(bucket: FlatBucket) -> str:
    """Stands in for the CUDA IPC serializer on a CPU: what the fake records is the entry's place."""
    return base64.b64encode(orjson.dumps(bucket.names)).decode()


def _colocated(fleet: EngineFleet, model: torch.nn.Module, *, bucket_bytes: int = 1 << 20) -> ColocatedWeights:
    return ColocatedWeights(
        model.named_parameters,
        fleet,
        device="cpu",
        send_dtype=torch.bfloat16,
        bucket_bytes=bucket_bytes,
        serialize=_cpu_entry,
    )


async def test_a_colocated_publish_runs_slimes_sequence_with_sglangs_fields(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))  # 4 tensors
    async with FakeSGLang() as fake, EngineFleet([fake.url], concurrency=4) as fleet:
        fake.tp_size = 2
        colocated = _colocated(fleet, model, bucket_bytes=8 * 1024)  # the 64x64 weight alone in a bucket
        await colocated.release()
        assert fake.released == set(ALL_TAGS)
        clock = VersionClock()
        await publish_weights(clock, fleet, tmp_path, pause_mode=PauseMode.ABORT, transfer=colocated)
        assert fake.healthy and fake.released == set() and clock.version == 1 and fake.weight_version == "1"
        assert fake.control_log == [
            "/flush_cache",
            "/release_memory_occupation",
            "/pause_generation",
            "/flush_cache",
            "/server_info",
            "/resume_memory_occupation",
            *["/update_weights_from_tensor"] * 2,
            "/resume_memory_occupation",
            "/continue_generation",
        ]
        memory = [(path, body) for path, body in fake.memory_log if "memory" in path]
        assert memory == [
            ("/release_memory_occupation", {"tags": None}),
            ("/resume_memory_occupation", {"tags": ["weights"]}),
            ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
        ]
        updates = [body for path, body in fake.memory_log if path == "/update_weights_from_tensor"]
        # SGLang's UpdateWeightsFromTensorReqInput, one entry per TP rank; version and flush on the last.
        assert [set(u) for u in updates] == [
            {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version"}
        ] * 2
        assert [(u["load_format"], u["weight_version"], u["flush_cache"]) for u in updates] == [
            ("flattened_bucket", None, False),
            ("flattened_bucket", "1", True),
        ]
        entries = [u["serialized_named_tensors"] for u in updates]
        assert all(len(e) == 2 and e[0] == e[1] for e in entries)
        sent = [orjson.loads(base64.b64decode(e[0])) for e in entries]
        assert sent == [["0.weight"], ["0.bias", "1.weight", "1.bias"]]


async def test_a_publish_without_a_release_resumes_nothing(tmp_path: Path) -> None:
    """SGLang's memory saver exits the server on a resume of memory that is not released: a
    colocated publish that follows no release (async mode, a first publish) must not send one."""
    model = torch.nn.Linear(4, 4)
    async with FakeSGLang() as fake, EngineFleet([fake.url], concurrency=4) as fleet:
        await publish_weights(
            VersionClock(), fleet, tmp_path, pause_mode=PauseMode.ABORT, transfer=_colocated(fleet, model)
        )
        assert fake.healthy and "/resume_memory_occupation" not in fake.control_log
        assert fake.calls["/update_weights_from_tensor"] == 1


async def test_engines_holding_their_memory_get_buckets_built_before_the_gate_closes(tmp_path: Path) -> None:
    """Async on one GPU the engines keep generating until the publish pauses them: every bucket is
    built and serialized before the admission gate closes, so the stall is the engines' copies. A
    publish that fails after that keeps nothing built; the next one builds the new weights."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    clock = VersionClock()
    built_while: list[bool] = []  # whether the gate was open when each bucket was serialized

    def serialize(bucket: FlatBucket) -> str:
        built_while.append(not clock.publishing)
        return _cpu_entry(bucket)

    async with FakeSGLang() as fake, EngineFleet([fake.url], concurrency=4) as fleet:
        colocated = ColocatedWeights(
            model.named_parameters, fleet, device="cpu", send_dtype=torch.bfloat16, bucket_bytes=8 * 1024,
            serialize=serialize,
        )  # fmt: skip
        await publish_weights(clock, fleet, tmp_path, pause_mode=PauseMode.IN_PLACE, transfer=colocated)
        # Built ahead, one bucket a dtype: all of them are held at once anyway, and one round trip stalls least.
        assert built_while == [True] and clock.version == 1 and fake.weight_version == "1"
        assert set(colocated.timings) >= {"prepare", "engines", "buckets"} and colocated.timings["build"] == 0.0
        updates = [orjson.loads(base64.b64decode(b["serialized_named_tensors"][0])) for p, b in fake.memory_log
                   if p == "/update_weights_from_tensor"]  # fmt: skip
        assert updates == [["0.weight", "0.bias", "1.weight", "1.bias"]]
        assert "/resume_memory_occupation" not in fake.control_log  # nothing was released

        fake.drop("/pause_generation")  # the next publish fails after its buckets were built
        with pytest.raises(PublishError):
            await publish_weights(clock, fleet, tmp_path, pause_mode=PauseMode.IN_PLACE, transfer=colocated)
        assert len(built_while) == 2 and colocated._prepared is None and clock.version == 1
        assert fake.calls["/update_weights_from_tensor"] == 1  # nothing of the failed publish was sent


async def test_an_engine_that_died_after_the_release_stops_the_publish_naming_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    async with FakeSGLang() as fake, EngineFleet([fake.url], concurrency=4, control_timeout=2) as fleet:
        colocated = _colocated(fleet, model)
        await colocated.release()
        fake.drop("/resume_memory_occupation")  # gone between release and resume
        clock = VersionClock()
        with pytest.raises(PublishError, match=fake.url) as failed:
            await publish_weights(clock, fleet, tmp_path, pause_mode=PauseMode.ABORT, transfer=colocated)
        assert "did not take it back" in str(failed.value) and "store and the checkpoints are intact" in str(
            failed.value
        )
        assert clock.version == 0 and fake.calls["/update_weights_from_tensor"] == 0  # nothing was sent


DATASET = [PromptTask(index=i, prompt_ids=(5, 6, 7), label=i) for i in range(16)]


def _reward(task: PromptTask, sample: Sample) -> float:
    return float(sample.response_len % 2)


async def test_a_sync_rollout_releases_after_each_round_and_the_publish_takes_the_memory_back(tmp_path: Path) -> None:
    """The sequencing in a real `Rollout` (the stage graph, the real publisher) against the fake:
    no request reaches the engine while it is released (the fake would die)."""
    model = torch.nn.Linear(4, 4)
    plan = RolloutPlan(mode=RolloutMode.SYNC, batch_size=2, n_samples=2, num_steps=2, slots=8, max_response_len=4)
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=8) as fleet:
        colocated = _colocated(fleet, model)
        async with (
            AsyncStore(MemoryStore()) as store,
            Rollout(
                plan,
                engines=fleet,
                store=store,
                dataset=DATASET,
                reward_fn=_reward,
                weight_transfer=colocated,
                engine_memory=colocated,
            ) as rollout,
        ):
            with anyio.fail_after(20):
                for _ in range(2):
                    batch = await rollout.next_batch()
                    assert fake.released == set(ALL_TAGS)  # given to the trainer for the step
                    await rollout.commit(batch, {})
                    await rollout.publish(tmp_path)
                    assert fake.released == set()
        assert fake.healthy and rollout.version == 2
        steps = [p for p in fake.control_log if "memory" in p or p.endswith("tensor")]
        assert steps == ["/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_tensor",
                         "/resume_memory_occupation"] * 2  # fmt: skip


# ---- the built-in engine on a CPU: refusals, and the memory state over real HTTP ---------------------


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.tasks.tiny_model import make_model_folder

    return make_model_folder(tmp_path_factory.mktemp("colocate") / "v0", hidden_size=32, num_layers=2, seed=0)


@pytest.fixture
async def cpu_engine(engine_model: Path) -> AsyncIterator[EngineServer]:
    async with open_server(engine_model, port=0, health_check_timeout=0.5) as server:
        yield server


async def _post(http: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw.strip() else None


GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


async def test_a_cpu_engine_refuses_the_colocated_endpoints_saying_why(
    cpu_engine: EngineServer, http: aiohttp.ClientSession
) -> None:
    url = cpu_engine.url
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        status, body = await _post(http, url + path, {"tags": ["kv_cache"]})
        assert (
            status == 400
            and "runs on cpu" in body["error"]["message"]
            and "--enable-memory-saver" in body["error"]["message"]
        )
    status, body = await _post(
        http,
        url + "/update_weights_from_tensor",
        {"serialized_named_tensors": ["x"], "load_format": "flattened_bucket"},
    )
    assert (
        status == 400
        and body["success"] is False
        and "CUDA IPC" in body["message"]
        and "runs on cpu" in body["message"]
    )
    status, _ = await _post(http, url + "/generate", GENERATE)
    assert status == 200  # refused calls change nothing


async def test_memory_saver_on_a_cpu_is_a_config_error_naming_the_flag(engine_model: Path) -> None:
    with pytest.raises(ConfigError, match="--enable-memory-saver needs a GPU engine"):
        async with open_server(engine_model, port=0, enable_memory_saver=True):
            pass


class _RecordingSaver(MemorySaver):
    """The library's contract on a CPU: it exits on a pause of paused memory or a resume of active
    memory, so this raises there; it records what moved."""

    enabled = True

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[str, str]] = []
        self.paused: set[str] = set()

    def pause(self, tag: str) -> None:
        assert tag not in self.paused, f"torch_memory_saver would exit: {tag} paused twice"
        self.paused.add(tag)
        self.moves.append(("pause", tag))

    def resume(self, tag: str) -> None:
        assert tag in self.paused, f"torch_memory_saver would exit: {tag} resumed while active"
        self.paused.discard(tag)
        self.moves.append(("resume", tag))


@pytest.fixture
def recording(cpu_engine: EngineServer) -> Iterator[_RecordingSaver]:
    """The engine's memory state machine over a saver that records instead of unmapping."""
    saver = _RecordingSaver()
    runner = cpu_engine.core.model.runner  # type: ignore[attr-defined]
    zeroed: list[bool] = []
    occupation = MemoryOccupation(
        saver, cpu_engine.core, weight_groups=runner.tied_groups, after_kv_resume=lambda: zeroed.append(True)
    )
    cpu_engine.occupation = occupation
    cpu_engine.weight_group._occupation = occupation
    yield saver
    assert bool(zeroed) == (("resume", "kv_cache") in saver.moves)


async def test_a_released_engine_refuses_generation_and_publishes_until_resumed_and_rewritten(
    cpu_engine: EngineServer, recording: _RecordingSaver, http: aiohttp.ClientSession, engine_model: Path
) -> None:
    url = cpu_engine.url
    assert (await _post(http, url + "/release_memory_occupation", {}))[0] == 200
    assert (await _post(http, url + "/release_memory_occupation", {"tags": ["kv_cache"]}))[0] == 200  # no second pause
    assert recording.paused == set(ALL_TAGS)
    status, body = await _post(http, url + "/generate", GENERATE)
    assert status == 503 and "released" in body["error"]["message"]
    async with http.get(url + "/health_generate") as resp:
        assert resp.status == 503 and "released" in await resp.text()
    status, body = await _post(http, url + "/update_weights_from_disk", {"model_path": str(engine_model)})
    assert status == 400 and '"tags": ["weights"]' in body["message"]  # the call that fixes it
    # slime's order: weights, then the publish, then the KV cache and graphs.
    assert (await _post(http, url + "/resume_memory_occupation", {"tags": ["weights"]}))[0] == 200
    assert (await _post(http, url + "/resume_memory_occupation", {"tags": ["weights"]}))[0] == 200  # no double resume
    status, _ = await _post(http, url + "/update_weights_from_disk", {"model_path": str(engine_model)})
    assert status == 200
    status, body = await _post(http, url + "/generate", GENERATE)
    assert status == 503 and "kv_cache" in body["error"]["message"]  # still released
    assert (await _post(http, url + "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}))[0] == 200
    assert (await _post(http, url + "/generate", GENERATE))[0] == 200
    assert recording.moves == [("pause", t) for t in ALL_TAGS] + [
        ("resume", "weights"),
        ("resume", "kv_cache"),
        ("resume", "cuda_graph"),
    ]


async def test_weights_resumed_without_a_publish_are_refused_until_one_arrives(
    cpu_engine: EngineServer, recording: _RecordingSaver, http: aiohttp.ClientSession, engine_model: Path
) -> None:
    """A publish that never came (the trainer died after the resume): the engine answers, says
    why it will not generate, and takes the next publish (the resumed run's, from disk)."""
    url = cpu_engine.url
    await _post(http, url + "/release_memory_occupation", {})
    await _post(http, url + "/resume_memory_occupation", {})
    status, body = await _post(http, url + "/generate", GENERATE)
    assert status == 503 and "without a CPU backup" in body["error"]["message"]
    assert (await _post(http, url + "/update_weights_from_disk", {"model_path": str(engine_model)}))[0] == 200
    assert (await _post(http, url + "/generate", GENERATE))[0] == 200


async def test_a_release_while_requests_run_is_refused_and_unknown_tags_are_named(
    cpu_engine: EngineServer, recording: _RecordingSaver, http: aiohttp.ClientSession
) -> None:
    url = cpu_engine.url
    status, body = await _post(http, url + "/release_memory_occupation", {"tags": ["kv", "weights"]})
    assert status == 400 and "['kv']" in body["error"]["message"]
    long = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    async with anyio.create_task_group() as tg:
        tg.start_soon(_post, http, url + "/generate", long)
        with anyio.fail_after(30):
            while cpu_engine.core.num_running == 0:
                await cpu_engine.core.wait_step()
        status, body = await _post(http, url + "/release_memory_occupation", {})
        assert status == 400 and "needs an idle engine" in body["error"]["message"]
        await _post(http, url + "/abort_request", {"abort_all": True})
    assert recording.moves == []


# ---- config and launch ----------------------------------------------------------------------------


def test_colocate_needs_a_gpu_trainer_and_says_so() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(["--colocate"])
    assert "--colocate=True with --trainer-device='cpu'" in str(refused.value)
    assert "use --trainer-device cuda" in str(refused.value)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--train-backend", "megatron"], "not built"),
        (["--update-weight-transport", "distributed"], "CUDA IPC"),
        (["--rollout-num-engines", "2"], "one engine"),
        (["--use-fault-tolerance"], "restarted engine"),
        (["--overlap-weight-transfer"], "mix versions"),
        (["--rollout-device", "cuda:1"], "trainer's GPU"),
    ],
)
def test_colocate_refuses_what_it_cannot_combine(flags: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        load_config(["--colocate", "--trainer-device", "cuda", *flags])


def test_a_colocated_engine_runs_on_the_trainers_gpu_with_the_memory_saver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the load step looks for the GPU
    config = load_config(["--colocate", "--trainer-device", "cuda:0", "--rollout-mode", "async"])
    assert config.engine.device == "cuda:0"  # async is allowed: the engine keeps its memory
    assert builtin_engine_args(config.engine) == [
        "--device", "cuda:0", "--enable-memory-saver", "--mem-fraction-static", "0.4",
    ]  # fmt: skip
    args = sglang_command_args(per_engine=1, mem_fraction=None, api_key=None, seed=0, memory_saver=True)
    assert "--enable-memory-saver" in args
    plain = load_config([])
    assert builtin_engine_args(plain.engine) == ["--device", "cpu"]
