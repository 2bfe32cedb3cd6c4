"""Megatron ranks on several nodes: the config, the join handshake, and a two-"node" run over loopback.

Real multi-node was not run; here node 0 (the controller) and node 1 (`python -m
pipeline.launch --node-rank 1 <the same flags>`) are two processes on this host, meeting at
127.0.0.1 as two hosts meet at rank 0's address.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from core.errors import ConfigError, PipelineError
from launch.builtin_engine import free_port
from launch.trainer_group import host_group, join_group, model_fingerprint
from pipeline.config import load_config

ROOT = Path(__file__).resolve().parent.parent
MEGATRON = ["--train-backend", "megatron"]


def test_nodes_multiply_the_world_and_the_parallel_sizes_must_divide_it():
    config = load_config(
        [
            *MEGATRON,
            "--actor-num-nodes",
            "2",
            "--actor-num-gpus-per-node",
            "2",
            "--tensor-model-parallel-size",
            "4",
            "--trainer-master-port",
            "29500",
        ]
    )
    t = config.trainer
    assert (t.num_nodes, t.num_ranks, t.master_addr, t.master_port) == (2, 2, "127.0.0.1", 29500)
    assert any("--trainer-master-addr='127.0.0.1': only ranks on this host" in w for w in config.warnings)
    from pipeline.trainer_settings import megatron_settings

    assert megatron_settings(config)["world_size"] == 4
    with pytest.raises(ConfigError) as err:
        load_config(
            [
                *MEGATRON,
                "--actor-num-nodes",
                "3",
                "--actor-num-gpus-per-node",
                "2",
                "--tensor-model-parallel-size",
                "4",
                "--trainer-master-port",
                "70000",
            ]
        )
    text = str(err.value)
    assert (
        "--tensor-model-parallel-size=4: must divide the 6 ranks of --actor-num-nodes=3 x --actor-num-gpus-per-node=2"
        in text
    )
    assert "--trainer-master-port=70000: must be a TCP port, 1..65535" in text
    with pytest.raises(ConfigError, match=r"--actor-num-nodes=2 without --trainer-master-port"):
        load_config([*MEGATRON, "--actor-num-nodes", "2"])
    with pytest.raises(ConfigError, match=r"--actor-num-nodes=2 with --train-backend=torch"):
        load_config(["--actor-num-nodes", "2", "--trainer-master-port", "29500"])
    one_node = load_config(MEGATRON).trainer  # today's defaults: one node, loopback, a free port
    assert (one_node.num_nodes, one_node.master_addr, one_node.master_port) == (1, "127.0.0.1", None)


def _spec(**overrides: Any) -> dict[str, Any]:
    return {"world": 2, "nodes": 2, "tp": 1, "pp": 1, "device": "cpu", "seed": 0, "trainer": {"lr": 0.01}, **overrides}


class _Host(threading.Thread):
    """Rank 0's side of the handshake, in a thread; `error` is what it raised."""

    def __init__(self, port: int, model: Path, *, world: int = 2, timeout: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.port, self.model, self.world, self.timeout = port, model, world, timeout
        self.error: BaseException | None = None
        self.store: Any = None

    def run(self) -> None:
        try:
            self.store = host_group(
                addr="127.0.0.1",
                port=self.port,
                world=self.world,
                per_node=1,
                spec=_spec(world=self.world),
                model_path=self.model,
                timeout=self.timeout,
            )
        except BaseException as exc:
            self.error = exc


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"x" * 10)
    return model


def test_a_rank_with_another_spec_is_refused_on_both_sides(tmp_path):
    port, model = free_port(), _model(tmp_path)
    host = _Host(port, model)
    host.start()
    with pytest.raises(ConfigError) as err:
        join_group(addr="127.0.0.1", port=port, rank=1, spec=_spec(tp=2), timeout=30)
    host.join(timeout=30)
    assert not host.is_alive()
    assert "megatron rank 1: its trainer spec" in str(err.value)
    assert "tp: rank 0 has 1, this rank has 2" in str(err.value)
    assert isinstance(host.error, ConfigError)
    assert "megatron rank 1 (node 1) refused to join" in str(host.error)
    assert "tp: rank 0 has 1, this rank has 2" in str(host.error)


def test_a_rank_that_never_joins_stops_rank_0_with_its_number_and_releases_the_others(tmp_path):
    port, model = free_port(), _model(tmp_path)
    host = _Host(port, model, world=3, timeout=3.0)
    host.start()
    # Rank 1 joins and is told rank 0 gave up; rank 2 never comes.
    with pytest.raises(PipelineError, match=r"megatron rank 1: rank 0 gave up: .*ranks \[2\] never joined"):
        join_group(addr="127.0.0.1", port=port, rank=1, spec=_spec(world=3), timeout=30)
    host.join(timeout=30)
    assert isinstance(host.error, PipelineError)
    assert f"did not form within 3 s (--trainer-join-timeout) at 127.0.0.1:{port}, world size 3" in str(host.error)
    assert "ranks [2] never joined (nodes [2]" in str(host.error)


def test_a_node_rank_started_twice_is_refused(tmp_path):
    port, model = free_port(), _model(tmp_path)
    host = _Host(port, model, world=3, timeout=30.0)
    host.start()
    errors: list[BaseException | None] = []

    def claim_rank_1() -> None:
        try:
            join_group(addr="127.0.0.1", port=port, rank=1, spec=_spec(world=3), timeout=30)
            errors.append(None)
        except BaseException as exc:
            errors.append(exc)

    twins = [threading.Thread(target=claim_rank_1) for _ in range(2)]
    for t in twins:
        t.start()
    join_group(addr="127.0.0.1", port=port, rank=2, spec=_spec(world=3), timeout=30)
    for t in (*twins, host):
        t.join(timeout=30)
    # Whichever claimed rank 1 first joins; the other is refused.
    assert sorted(str(e) for e in errors if e is not None) == [
        "1 problem(s) in the config:\n  - megatron rank 1 is already taken: is another node running with the "
        "same --node-rank?"
    ]
    assert errors.count(None) == 1
    assert host.error is None and host.store is not None


def test_the_node_command_refuses_a_node_rank_outside_the_run():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.launch",
            "--node-rank",
            "2",
            "--",
            *MEGATRON,
            "--actor-num-nodes",
            "2",
            "--trainer-master-port",
            "29500",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--node-rank=2: must be 1..1 for --actor-num-nodes=2 (node 0 is the controller's)" in done.stderr


def test_a_rank_that_cannot_reach_rank_0_says_where_it_looked():
    port = free_port()
    with pytest.raises(PipelineError, match=rf"megatron rank 1: could not reach megatron rank 0 at 127.0.0.1:{port}"):
        join_group(addr="127.0.0.1", port=port, rank=1, spec=_spec(), timeout=1)


def test_the_model_fingerprint_sees_the_config_and_the_file_sizes(tmp_path):
    model = _model(tmp_path)
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    (model / "model.safetensors").write_bytes(b"x" * 11)
    assert model_fingerprint(model) != before
    (model / "model.safetensors").write_bytes(b"x" * 10)
    (model / "config.json").write_text('{"hidden_size": 16}')
    assert model_fingerprint(model) != before


# --- two "nodes" over loopback, end to end -------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}


def _two_nodes(tmp_path: Path, node1_extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str], ...]:
    pytest.importorskip("megatron.core")
    port = free_port()
    flags = [
        *MEGATRON,
        "--actor-num-nodes",
        "2",
        "--trainer-master-port",
        str(port),
        "--num-rollout",
        "12",
        "--trainer-join-timeout",
        "120",
    ]
    controller = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.launch",
            "--output-dir",
            str(tmp_path / "run"),
            "--no-progress",
            "--log-level",
            "warning",
            *flags,
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Node 1 may start before the controller listens: its rank retries until the join timeout.
        node1 = subprocess.run(
            [sys.executable, "-m", "pipeline.launch", "--node-rank", "1", "--", *flags, *node1_extra],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        out, err = controller.communicate(timeout=600)
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.communicate()
    return subprocess.CompletedProcess(controller.args, controller.returncode, out, err), node1


@pytest.mark.slow
def test_the_built_in_task_learns_with_ranks_on_two_nodes(tmp_path):
    """Node 0 (controller, rank 0) and node 1 (rank 1) train DP=2; reward rises as with one node."""
    controller, node1 = _two_nodes(tmp_path)
    assert controller.returncode == 0, controller.stderr[-4000:]
    assert node1.returncode == 0, node1.stderr[-4000:]
    records = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert [r["version"] for r in records] == list(range(12))
    first = sum(r["rollout/raw_reward"] for r in records[:3]) / 3
    last = sum(r["rollout/raw_reward"] for r in records[-3:]) / 3
    assert last > first + 0.05, (first, last)
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-4
    # Node 1's rank wrote its optimizer shard into the folder rank 0 named (a shared filesystem's job).
    optimizer = tmp_path / "run" / "checkpoints" / "v12" / "optimizer"
    assert sorted(p.name for p in optimizer.iterdir()) == [
        "rank0.json",
        "rank0.safetensors",
        "rank1.json",
        "rank1.safetensors",
    ]


@pytest.mark.slow
def test_a_node_started_with_another_tensor_parallel_size_stops_both_sides(tmp_path):
    controller, node1 = _two_nodes(tmp_path, ("--tensor-model-parallel-size", "2"))
    assert node1.returncode == 1, node1.stderr[-4000:]
    assert "tp: rank 0 has 1, this rank has 2" in node1.stderr, node1.stderr[-4000:]
    # A setting found wrong once the run started is a config error too: exit 2 (issue 33).
    assert controller.returncode == 2, controller.stderr[-4000:]
    assert "megatron rank 1 (node 1) refused to join" in controller.stderr, controller.stderr[-4000:]
    assert "tp: rank 0 has 1, this rank has 2" in controller.stderr
