"""The killed process of `test_token_payloads`' SIGKILL test (run as `python -m tests.payload_kill_child STORE`).

It is the pipeline's one LMDB writer: it generates one group with R3 and SC payloads against the
protocol fake, stops at 3 tokens a sample (partial rollout's "enough": the group goes to the store
partial, with its rows), then starts continuing it and prints HELD while the continuations are in
flight and the group is leased (RUNNING) in the store. The test SIGKILLs it there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio

from core.clock import VersionClock
from stages.sglang_client import EngineFleet
from storage import LmdbStore
from tests.fakes import FakeSGLang
from tests.test_token_payloads import N_SAMPLES, SHAPE, Rig, _run_one_round


async def main(path: Path) -> None:
    async with FakeSGLang(weight_version="0", moe=SHAPE) as fake:
        with LmdbStore(path) as store:
            await _run_one_round(fake, store, stop_at=3)
            fake.hold(2)
            async with EngineFleet([fake.url], concurrency=8) as fleet, anyio.create_task_group() as tg:
                rig = Rig(fleet, store, VersionClock())
                await rig.start(tg)
                rig.admission.grant(1)
                await fake.wait_until(lambda: fake.held == N_SAMPLES)
                print("HELD", flush=True)
                await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
