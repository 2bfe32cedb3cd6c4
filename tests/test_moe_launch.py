"""The MoE toy end to end through `python -m pipeline.launch` (issue 32): the tiny Qwen3-MoE built in
the run folder (`--num-experts`), its routes asked of the built-in engine and replayed by the
trainer (`--use-rollout-routing-replay`), over real HTTP."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import aiohttp
import anyio
import pytest
from anyio.from_thread import start_blocking_portal
from safetensors.torch import load_file

from core.errors import ConfigError
from engines.builtin import open_server
from pipeline.config import load_config
from pipeline.run.cli import main
from pipeline.tasks.tiny_model import make_model_folder
from stages.continuation import sampling_seed
from storage import GroupState, LmdbStore
from tests.test_fault_injection import FLAGS, Launcher, Watch

TP2 = ("--tensor-model-parallel-size", "2")
MEGATRON2 = ("--train-backend", "megatron", "--actor-num-gpus-per-node", "2")
MOE = ("--num-experts", "8", "--moe-router-topk", "2", "--use-rollout-routing-replay")
# A small partial-rollout run: 3 groups of 2 admitted for a batch of 1, so two are cut mid-response.
SMALL_RUN = ("--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "3",
             "--no-partial-fill-idle-slots", "--rollout-max-response-len", "32")  # fmt: skip


def run(tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "run"
    code = main(["--output-dir", str(out), "--no-progress", "--log-level", "warning", *flags])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_moe_toy_learns_in_sync_mode_with_routing_replay(tmp_path):
    records = run(tmp_path, "--num-rollout", "40", *MOE)
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and (config["num_local_experts"], config["num_experts_per_tok"]) == (
        8,
        2,
    )
    first = sum(r["rollout/raw_reward"] for r in records[:5]) / 5
    last = sum(r["rollout/raw_reward"] for r in records[-5:]) / 5
    # Measured: 0.061 -> 0.421 over 40 steps.
    assert last > first + 0.2, (first, last)
    # The trainer replays the engine's routes at the weights that sampled: the same log-probs.
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-5


def test_the_moe_toy_learns_in_async_mode_with_partial_rollout_and_routing_replay(tmp_path):
    """Samples span versions here (async, partial rollout): each token's route is the one of the
    version that sampled it, replayed under the weights being trained."""
    records = run(
        tmp_path,
        "--num-rollout",
        "40",
        "--rollout-mode",
        "async",
        "--max-staleness",
        "1",
        "--partial-rollout",
        "--over-sampling-batch-size",
        "16",
        *MOE,
    )
    first = sum(r["rollout/raw_reward"] for r in records[:5]) / 5
    last = sum(r["rollout/raw_reward"] for r in records[-5:]) / 5
    # Measured: 0.056 -> 0.395 over 40 steps, staleness up to 2, 62% of a batch's samples multi-version.
    assert last > first + 0.15, (first, last)
    assert max(r["staleness/max"] for r in records) >= 1
    assert any(r["staleness/multi_version_frac"] > 0 for r in records)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--num-experts", "4", "--hf-checkpoint", "some/model"], "--num-experts=4"),
        (["--num-experts", "4", "--moe-router-topk", "6"], "--moe-router-topk=6"),
        (["--num-experts", "1"], "--num-experts"),
        (
            ["--expert-model-parallel-size", "2", "--num-experts", "4"],
            "--expert-model-parallel-size=2 with --train-backend=torch",
        ),
        (
            [*MEGATRON2, "--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size=2: the tiny model (no --num-experts) is dense",
        ),
        (
            [*MEGATRON2, "--expert-model-parallel-size", "2", "--num-experts", "3", "--moe-router-topk", "1"],
            "--expert-model-parallel-size=2: the tiny model has 3 experts per layer, not divisible by it",
        ),
        (
            [*MEGATRON2, "--expert-model-parallel-size", "4", "--num-experts", "8"],
            "--expert-model-parallel-size=4: must divide the data-parallel size 2 (= 2 ranks / (TP=1 x PP=1))",
        ),
    ],
)
def test_moe_shape_flags_are_refused_by_name(argv, named):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    assert named in str(err.value)


def test_moe_under_tensor_and_expert_parallel_loads():
    """MoE under TP runs megatron's sequence parallel (refused before it was built), with EP too."""
    megatron4 = ("--train-backend", "megatron", "--actor-num-gpus-per-node", "4")
    config = load_config([*megatron4, *TP2, "--expert-model-parallel-size", "2", "--num-experts", "4"])
    assert (config.trainer.tensor_model_parallel_size, config.trainer.expert_model_parallel_size) == (2, 2)


def test_expert_parallel_reads_the_checkpoints_experts_at_config_load(tmp_path):
    """A --hf-checkpoint folder's config.json says how many experts EP splits (none: a dense model)."""
    dense = make_model_folder(tmp_path / "dense")
    moe = make_model_folder(tmp_path / "moe", arch="moe", hidden_size=32, num_experts=6)
    four = ["--train-backend", "megatron", "--actor-num-gpus-per-node", "4", "--expert-model-parallel-size"]
    with pytest.raises(ConfigError, match=rf"--expert-model-parallel-size=2: --hf-checkpoint='{dense}' is dense"):
        load_config([*four, "2", "--hf-checkpoint", str(dense)])
    with pytest.raises(ConfigError, match=r"--hf-checkpoint='.*moe' has 6 experts per layer, not divisible"):
        load_config([*four, "4", "--hf-checkpoint", str(moe)])
    assert load_config([*four, "2", "--hf-checkpoint", str(moe)]).trainer.expert_model_parallel_size == 2


# ---- routes through a SIGKILL of the controller ------------------------------------------------


def _unfinished_prefixes(store: LmdbStore) -> dict[tuple[str, int], tuple[tuple[int, ...], tuple[float, ...], bytes]]:
    """(group, sample) -> its stored tokens, log-probs and route bytes, for every sample the store
    holds a prefix of (cut by an abort, not finished)."""
    out = {}
    for g in store.groups(GroupState.PARTIAL):
        for s in g.samples:
            if s.response_ids and not s.status.finished:
                assert s.routes is not None, f"{g.group_id} sample {s.index}: a stored prefix without routes"
                out[g.group_id, s.index] = (s.response_ids, tuple(s.logprobs), bytes(s.routes.data))
    return out


async def _uninterrupted(url: str, requests: list[tuple[tuple[int, ...], int]], params: dict) -> list[dict]:
    """Each (prompt, seed) as one request from scratch, all at once."""
    out: list[dict] = [{} for _ in requests]

    async def one(i: int, prompt: tuple[int, ...], seed: int) -> None:
        body = {
            "input_ids": list(prompt),
            "sampling_params": {**params, "sampling_seed": seed},
            "return_logprob": True,
            "return_routed_experts": True,
        }
        async with http.post(url + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            out[i] = await resp.json(content_type=None)

    async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
        for i, (prompt, seed) in enumerate(requests):
            tg.start_soon(one, i, prompt, seed)
    return out


def test_routes_survive_a_sigkill_of_the_controller_byte_for_byte(tmp_path):
    """The controller of a partial-rollout MoE run is SIGKILLed once an over-sampling abort (step
    0's, as a rule) has stored partial prefixes (with their routes) in the LMDB store, and the same command resumes
    it. The engine is a built-in one the test runs (as SGLang servers on other nodes outlive a
    controller). Every sample continued from a prefix stored before the kill must hold what one
    uninterrupted request (same prompt, same sampling seed, same weights) answers: the same tokens
    and routes byte for byte, and log-probs to float noise (the engine's own numerics move ~1e-7
    with the batch shape; the stored prefix's log-probs are checked byte for byte against what the
    kill left). `--lr 1e-30` keeps each published version's weights those of the base (checked
    below), so "the same weights" holds across the step the continuation waits for."""
    out, steps = tmp_path / "run", 24
    model = make_model_folder(out / "model", seed=42, arch="moe", num_experts=8, moe_router_topk=2)
    watch = Watch(out)
    launcher = None
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(
            open_server(model, port=0, weight_version="0", health_check_timeout=0.5)
        ) as server,
    ):
        # At least three steps: a group that finished during step 0's drain may fill step 1 as well,
        # and the stored prefixes are then continued in step 2's round. Twenty-four, so that a loaded
        # machine's poll still finds the run alive when a prefix is stored: three once ran to the end
        # between two looks, and eight once ended (in CI, on a loaded machine) without a look finding
        # a stored prefix with tokens. The kill comes at the first one, so more steps cost only the
        # resumed life's.
        argv = (*SMALL_RUN, *MOE, "--num-rollout", str(steps), "--lr", "1e-30", "--sglang-url", server.url)
        try:
            launcher = Launcher(out, 0, *argv)
            launcher.wait_until("a stored partial prefix", lambda: bool(watch.stored_with_tokens(GroupState.PARTIAL)))
            launcher.kill()
            assert watch.store is not None
            prefixes = _unfinished_prefixes(watch.store)
            assert prefixes
        finally:
            watch.close()
            if launcher is not None and launcher.proc.poll() is None:
                launcher.kill()
        run(tmp_path, *FLAGS, *argv)  # the same command again, to the end

        with LmdbStore(out / "rollout_data", readonly=True) as store:
            now = {}
            for state in GroupState:
                for g in store.groups(state):
                    now.update({(g.group_id, s.index): s for s in g.samples if (g.group_id, s.index) in prefixes})
        assert now.keys() == prefixes.keys()
        assert any(s.response_len > len(prefixes[key][0]) for key, s in now.items()), "no prefix continued"

        r = load_config(["--output-dir", str(out), *argv]).rollout
        params = {
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "max_new_tokens": r.max_response_len,
        }
        keys = sorted(now)
        seeds = [(now[k].prompt_ids, sampling_seed(r.seed, k[0], k[1])) for k in keys]
        answers = portal.call(_uninterrupted, server.url, seeds, params)

    # Adam's steps of 1e-30 are below every weight's last bit; only exact zeros (the pad token's
    # embedding, never read) move, by ~3e-30.
    base, last = (
        load_file(model / "model.safetensors"),
        load_file(out / "checkpoints" / f"v{steps}" / "model.safetensors"),
    )
    assert base.keys() == last.keys() and max((base[k] - last[k]).abs().max().item() for k in base) < 1e-25
    for key, answer in zip(keys, answers, strict=True):
        s, (tokens, logprobs, routes) = now[key], prefixes[key]
        n, p = s.response_len, len(s.prompt_ids)
        # What the kill left in the store is what was trained on (a prefix, byte for byte) ...
        assert s.response_ids[: len(tokens)] == tokens and tuple(s.logprobs[: len(tokens)]) == logprobs, key
        assert s.routes is not None and s.routes.data[: len(routes)] == routes, key
        # ... and the whole sample is the uninterrupted request's (or a prefix of it, if cut again).
        meta = answer["meta_info"]
        assert s.response_ids == tuple(answer["output_ids"][:n]), key
        expected = [lp for lp, _, _ in meta["output_token_logprobs"][:n]]
        assert max(abs(a - b) for a, b in zip(s.logprobs, expected, strict=True)) < 1e-5, key
        row = s.routes.layers * s.routes.top_k * 4
        whole = base64.b64decode(meta["routed_experts"])
        assert s.routes.widened("i").data == whole[(p - 1) * row : (p - 1 + n) * row], key


@pytest.mark.parametrize(
    ("built", "argv", "named"),
    [
        ({"num_experts": 8}, ["--num-experts", "4"], "--num-experts=4"),
        (
            {"num_experts": 8, "moe_router_topk": 2},
            ["--num-experts", "8", "--moe-router-topk", "4"],
            "--moe-router-topk=4",
        ),
        ({"num_experts": 8}, [], "--num-experts unset"),
        (None, ["--num-experts", "8"], "--num-experts=8"),
    ],
)
def test_a_resume_that_reshapes_the_tiny_model_is_refused_by_name(tmp_path, capsys, built, argv, named):
    """The run folder's tiny model is built by its first run; a later run asking for another
    shape is refused before the store is opened, naming the flag, the shape built and the rule."""
    out = tmp_path / "run"
    shape = {"arch": "moe", **built} if built is not None else {}
    model = make_model_folder(out / "model", hidden_size=32, **shape)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    assert main(["--output-dir", str(out), "--no-progress", "--rollout-data-transport", "lmdb", *argv]) == 2
    said = capsys.readouterr().err
    assert named in said and str(model) in said and "built once per folder" in said, said
    assert ("--num-experts=8 --moe-router-topk=2" if built is not None else "dense (without --num-experts)") in said
    # Refused before the store is opened, and the model folder is as it was.
    assert not (out / "rollout_data").exists() and {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_a_resume_with_the_same_shape_leaves_the_model_folder_as_it_is(tmp_path):
    """The same flags (and an unset --moe-router-topk, which takes the built one's) pass the check."""
    from pipeline.tasks.tiny_model import built_shape_problem

    model = make_model_folder(tmp_path / "model", hidden_size=32, arch="moe", num_experts=4, moe_router_topk=3)
    assert built_shape_problem(model, num_experts=4, moe_router_topk=3) is None
    assert built_shape_problem(model, num_experts=4, moe_router_topk=None) is None
    dense = make_model_folder(tmp_path / "dense", hidden_size=32)
    assert built_shape_problem(dense, num_experts=None, moe_router_topk=None) is None


def test_the_megatron_backend_takes_routing_replay():
    """R3 with megatron (tests/test_megatron_moe.py runs it): the config loads, and the ranks' spec asks for it."""
    from pipeline.trainer_settings import megatron_settings

    config = load_config([*MOE, "--train-backend", "megatron", "--actor-num-gpus-per-node", "2"])
    assert megatron_settings(config)["routing_replay"] is True
    assert megatron_settings(load_config(["--train-backend", "megatron"]))["routing_replay"] is False
