"""What several test files set up alike, one section each: the session's environment and markers;
child processes of this checkout; the torch trainer's tiny model; HTTP to an engine; the real
router; the producer side of the pipeline over HTTP; small runs of the whole pipeline into LMDB,
and their damage. The project's modules (and torch, lmdb) are imported inside the helpers that use
them, so a test module loads only what its own tests need."""

import hashlib
import math
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

# ---- the session: no model hub, asyncio for anyio tests, GPU tests opt-in ------------------------

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def anyio_backend():
    return "asyncio"


def pytest_collection_modifyitems(config, items):
    if config.getoption("-m") and "gpu" in config.getoption("-m"):
        return
    skip_gpu = pytest.mark.skip(reason="GPU test: opt in with `pytest -m gpu` on a GPU machine")
    for item in items:
        # The marker, not `item.keywords`: keywords hold the folder names too, so a checkout in a
        # folder named `gpu` would skip every test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


# ---- child processes of this checkout ------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_env() -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH: a child process
    imports this checkout's modules whatever its working directory."""
    path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path}


def run_python_module(
    module: str, *args: str, cwd: Path = REPO_ROOT, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m module args` in a child process as a user would (in `cwd`, with `repo_env()`
    unless `env` is given) and wait for it: its exit code and its captured text output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=repo_env() if env is None else env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


# ---- the torch trainer on the tiny model ---------------------------------------------------------


@pytest.fixture(scope="module")
def restore_torch_threads():
    """The trainer sets torch's process-wide thread count; give later test modules theirs back.
    A module that trains opts in with `pytestmark = pytest.mark.usefixtures("restore_torch_threads")`."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """One tiny model folder (default shape, seed 0) for a test module's trainers to load."""
    from pipeline.tasks.tiny_model import make_model_folder

    return make_model_folder(tmp_path_factory.mktemp("tiny") / "model", seed=0)


# ---- HTTP to an engine (built-in, simulated or fake) ---------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for a test's own requests to an engine, each bounded at 60 s."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def post_generate(http: aiohttp.ClientSession, url: str, **body: Any) -> tuple[int, Any]:
    """POST `body` to the engine's /generate: the status and the JSON answer (the raw bytes where
    the answer is not JSON)."""
    async with http.post(url + "/generate", json=body) as resp:
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if resp.content_type == "application/json" else raw)


async def post_raw(http: aiohttp.ClientSession, url: str, json: Any = None) -> tuple[int, bytes]:
    """POST `json` to `url`: the status and the answer's bytes."""
    async with http.post(url, json=json) as resp:
        return resp.status, await resp.read()


async def sse_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """Parse a streamed (SSE) /generate body into JSON chunks; the literal `[DONE]` is yielded as a
    string. Every event must be a `data: ` line."""
    buffer = b""
    async for data in resp.content.iter_any():
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            payload = event[len(b"data: ") :]
            yield "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)


async def get_ok_json(http: aiohttp.ClientSession, url: str) -> Any:
    """GET `url`, which must answer 200: its JSON."""
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


# ---- the real router -----------------------------------------------------------------------------


@asynccontextmanager
async def router_in_front_of(engines: Iterable[Any]) -> AsyncIterator[Any]:
    """The real sglang-router (a subprocess, up within 30 s) in front of `engines` (each with a
    `url`), stopped on leaving the block."""
    from launch.router_process import start_router

    with anyio.fail_after(30):
        router = await start_router([e.url for e in engines])
    async with router:
        yield router


# ---- the producer side over HTTP -----------------------------------------------------------------


class PoolRig:
    """Dispenser -> generator pool -> collector on one clock and one store: the producer side of
    the pipeline without reward and filter, so a test decides when groups are admitted (by
    `admission.grant`). Each test file fixes its tasks, sample count, slots and payloads.
    `engine` is what the pool sends requests to: an `EngineFleet`, or a wrapper around one."""

    def __init__(
        self,
        engine,
        store,
        clock,
        *,
        tasks,
        n_samples,
        max_len,
        slots,
        payloads=None,
        sampling_params=None,
        detokenize=None,
        collect_buffer=4,
    ):
        from stages.admission import Admission
        from stages.collector import Collector
        from stages.dispenser import Dispenser
        from stages.generator import GeneratorPool
        from storage import AsyncStore

        self.store, self.clock, self.admission, self.n_samples = store, clock, Admission(), n_samples
        astore = AsyncStore(store)
        self.dispenser = Dispenser(astore, tasks, n_samples=n_samples, clock=clock, admission=self.admission)
        self.pool = GeneratorPool(
            engine,
            slots=slots,
            sampling_params={} if sampling_params is None else sampling_params,
            max_response_len=max_len,
            clock=clock,
            store=astore,
            admission=self.admission,
            payloads=payloads,
            detokenize=detokenize,
        )
        self._collect_buffer = collect_buffer
        self.collector = Collector(store=astore, admission=self.admission, capacity=math.inf)

    async def start(self, tg) -> None:
        to_pool_send, to_pool = anyio.create_memory_object_stream(0)
        to_collect_send, to_collect = anyio.create_memory_object_stream(self._collect_buffer)
        await tg.start(self.dispenser.run, to_pool_send)
        await tg.start(self.pool.run, to_pool, to_collect_send)
        await tg.start(self.collector.run, to_collect)

    @property
    def admitted(self):
        return self.store.statistics().cursor.index

    def ready_groups(self):
        from storage import GroupState

        return list(self.store.groups(GroupState.READY))

    async def park_granted(self, fake, *, groups: int = 1, tokens: int = 2) -> None:
        """Grant `groups` groups and return once each of their requests is parked at the protocol
        fake `fake` (its hold gate) after `tokens` tokens; `fake.release()` lets them go on."""
        fake.hold(tokens)
        self.admission.grant(groups)
        await fake.wait_until(lambda: fake.held == groups * self.n_samples)

    async def publish_with_one_group_held(self, fake, fleet, folder, mode) -> None:
        """Grant one group, park its requests at `fake` after 2 tokens, publish `folder` in pause
        `mode` while they are parked (with "abort", wait until the continuations park again),
        release them and wait until the group settles."""
        from stages.publisher import publish_weights

        with anyio.fail_after(10):
            await self.park_granted(fake)
            await publish_weights(self.clock, fleet, folder, pause_mode=mode)
            if mode == "abort":
                await fake.wait_until(lambda: fake.held == self.n_samples)  # the continuations, on v1
            fake.release()
            await self.admission.wait_settled()


# ---- small runs of the whole pipeline into LMDB, and their damage --------------------------------

# Small enough for seconds on a shared CPU: 2 prompts of 4 samples a step, 32 tokens at most.
SMALL_LMDB_RUN = (
    "--rollout-data-transport",
    "lmdb",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-max-response-len",
    "32",
    "--no-progress",
)


def small_lmdb_run(out: Path, *flags: str, steps: int = 3, level: str = "warning") -> int:
    """Run the pipeline in process (the `launch` CLI, toy task, built-in trainer) for `steps` steps
    into the output folder `out`, with `SMALL_LMDB_RUN` and then `flags`; its exit code."""
    from pipeline.run.cli import main as launch

    return launch(
        ["--output-dir", str(out), "--num-rollout", str(steps), "--log-level", level, *SMALL_LMDB_RUN, *flags]
    )


def copy_of_run(run: Path, tmp_path: Path) -> Path:
    """A copy of the output folder `run` at `tmp_path / "run"`: a module's one run, for a test to
    damage or resume without touching the other tests' copies."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes: that a file is left as it was."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_a_stored_group_bit(store_dir: Path, group_id: str) -> None:
    """Flip one bit inside the sealed record of group `group_id` in the LMDB store at `store_dir`,
    as a disk would: the record's seal no longer matches."""
    import lmdb

    from storage import keys
    from storage.seal import OVERHEAD

    env = lmdb.open(str(store_dir), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        db = env.open_db(keys.GROUPS, txn=txn)
        value = bytearray(txn.get(group_id.encode(), db=db))
        value[OVERHEAD + 5] ^= 0x01  # one bit, as a disk would flip it
        txn.put(group_id.encode(), bytes(value), db=db)
    env.close()
