"""The megatron-core trainer backend on CPU (gloo): conversions, parity with the torch trainer, ranks.

Skipped when megatron-core is not installed (`pip install -e .[megatron]`). Trainer runs happen in
a fresh process (tests/megatron_check.py): megatron's parallel state and the process group are
process-wide, and a TP=2 run needs rank 0 in a process of its own anyway.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

pytest.importorskip("megatron.core")

from tests.conftest import repo_env, run_python_module
from tests.megatron_check import VARIANTS
from trainers.megatron.qwen3 import Qwen3Shape, hf_to_megatron, megatron_to_hf, shard, unshard

ROOT = Path(__file__).resolve().parent.parent


def _hf_state(tmp_path: Path, *, tied: bool) -> tuple[dict[str, torch.Tensor], Qwen3Shape]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
        rope_theta=1_000_000.0,
    )
    model = Qwen3ForCausalLM(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")  # what save_pretrained writes for tied embeddings
    return state, Qwen3Shape.from_hf(config)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_round_trip_is_exact_through_tensor_parallel_shards(tmp_path, tied, tp):
    hf, shape = _hf_state(tmp_path, tied=tied)
    assert shape.rope_theta == 1_000_000.0 and shape.tied is tied
    full = hf_to_megatron(hf, shape)
    assert ("output_layer.weight" in full) is not tied
    rejoined = {name: unshard(name, [shard(name, t, r, tp) for r in range(tp)]) for name, t in full.items()}
    back = megatron_to_hf(rejoined, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_layout_puts_each_query_group_with_its_key_and_value(tmp_path):
    hf, shape = _hf_state(tmp_path, tied=True)
    qkv = hf_to_megatron(hf, shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per_group = shape.head_dim, shape.num_heads // shape.num_kv_heads
    block = (per_group + 2) * d
    k_of_group1 = qkv[block + per_group * d : block + (per_group + 1) * d]
    assert torch.equal(k_of_group1, hf["model.layers.0.self_attn.k_proj.weight"][d : 2 * d])
    # Under TP=2 each rank holds whole groups: rank 1's shard starts with group 1's queries.
    assert torch.equal(
        shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 1, 2)[:d],
        hf["model.layers.0.self_attn.q_proj.weight"][per_group * d : per_group * d + d],
    )


def test_uneven_tensor_parallel_split_is_refused_with_the_numbers(tmp_path):
    from core.errors import ConfigError

    _, shape = _hf_state(tmp_path, tied=True)
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size=3: attention heads \(4\)"):
        shape.check_tensor_parallel(3)


def _check(
    tmp_path: Path,
    world: int,
    tp: int,
    micro: int | str,
    device: str = "cpu",
    variant: str = "default",
    gbs: int | None = None,
    dtype: str = "float32",
    switched: bool = False,
) -> dict:
    env = repo_env()
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "megatron_check.py"),
            str(tmp_path),
            str(world),
            str(tp),
            str(micro),
            device,
            variant,
            str(gbs or "none"),
            dtype,
            *(["switched"] if switched else []),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return orjson.loads((tmp_path / "result.json").read_bytes())


def _assert_same_steps(r: dict) -> None:
    """The two backends took the same optimizer steps (tests/adam_bound.py): the first step's
    gradients within fp32's rounding of the minibatch's sums, and every weight within what AdamW
    makes of the gradients' differences. Not a fixed bound on the weights: where a gradient is
    near its rounding, AdamW's step there is rounding too, of up to lr (1e-4 failed on AVX2)."""
    assert r["gradient_excess"] <= 1.0, r["gradient_excess"]
    assert r["weights_excess"] <= 1.0, (r["weights_excess"], r["weights_diff"])


@pytest.mark.parametrize(
    ("world", "tp", "micro", "variant"),
    [
        (1, 1, 3, "default"),
        (2, 2, 3, "default"),
        (2, 1, 8, "default"),
        (2, 1, 3, "icepop-seqmean-opsm"),
        (1, 1, 5, "seqmask-tokenmean"),
        (2, 2, 3, "kl-entropy"),
        (2, 1, 3, "kl-k1-seqmean"),
        (1, 1, "8/30", "default"),  # --max-tokens-per-gpu 30: packs of 1 and 2 rows of 11-17 tokens
    ],
    ids=[
        "tp1-microbatched",
        "tp2",
        "dp2",
        "dp2-icepop-seqmean-opsm",
        "seqmask",
        "tp2-kl-entropy",
        "dp2-kl-k1",
        "tp1-token-budget",
    ],
)
def test_one_step_matches_the_torch_trainer(tmp_path, world, tp, micro, variant):
    """Same batch, same start, same shared loss: every metric, log-probs and the published weights agree."""
    r = _check(tmp_path, world, tp, micro, variant=variant)
    torch_m, mg = r["torch"], r["megatron"]
    assert set(mg) == set(torch_m)
    for key, value in torch_m.items():
        if key.endswith("_time"):  # seconds, measured on each
            continue
        assert mg[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert torch_m["grad_norm"] > 1.0  # the gradient clip is active
    if variant == "default":
        assert torch_m["tis_clip_ratio"] > 0  # the TIS cap is active
    elif "opsm" in variant:
        assert torch_m["is_mask_frac"] > 0 and torch_m["opsm_mask_frac"] > 0  # both dropped tokens
    elif variant.startswith("kl"):
        assert torch_m["kl_loss"] != 0 and torch_m["ref_log_probs_time"] > 0  # against another model
        assert torch_m["loss"] == pytest.approx(
            torch_m["pg_loss"]
            + VARIANTS[variant]["kl_loss_coef"] * torch_m["kl_loss"]
            - VARIANTS[variant].get("entropy_coef", 0.0) * torch_m["entropy_loss"],
            rel=1e-5,
        )
    else:
        assert torch_m["is_mask_frac"] > 0  # tokens were dropped
    assert r["logprob_diff"] < 1e-5
    assert r["weights_moved"] > 5e-3  # Adam's first step moves every weight by ~lr
    _assert_same_steps(r)
    assert r["names"][0] == r["names"][1]
    assert r["optimizer_files"] == sorted(f"rank{i}.{ext}" for i in range(world) for ext in ("json", "safetensors"))


@pytest.mark.parametrize(
    ("world", "tp", "micro", "variant"),
    [(1, 1, 3, "default"), (2, 2, 2, "default"), (2, 1, 3, "icepop-seqmean-opsm"), (2, 1, 2, "seqmask-tokenmean")],
    ids=["tp1", "tp2", "dp2-icepop-seqmean-opsm", "dp2-seqmask"],
)
def test_half_batch_steps_match_the_torch_trainer(tmp_path, world, tp, micro, variant):
    """--global-batch-size = half the batch: two optimizer steps, the second clipped against the
    proximal log-probs computed before the first; both backends agree on every metric and weight."""
    r = _check(tmp_path, world, tp, micro, variant=variant, gbs=4)
    torch_m, mg = r["torch"], r["megatron"]
    assert set(mg) == set(torch_m)
    for key, value in torch_m.items():
        assert mg[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert torch_m["optimizer_steps"] == 2
    # The second step's ratio against the proximal policy left the trust region for some tokens.
    assert torch_m["pg_clipfrac"] > 0
    assert r["weights_moved"] > 5e-3
    _assert_same_steps(r)


def test_settings_given_between_steps_reach_every_rank(tmp_path):
    """`use_settings` (what a replayed step runs with, `pipeline.checkpoints`): TP=2 ranks started
    with another learning rate, temperature and loss (no KL term: no reference model) are given the
    torch trainer's before the step; both ranks load their reference shard then, and the step is the
    torch trainer's (a rank left at the old learning rate would move its shard by 3e-3, not 1e-2)."""
    r = _check(tmp_path, 2, 2, 3, variant="kl-k1-seqmean", switched=True)
    torch_m, mg = r["torch"], r["megatron"]
    for key, value in torch_m.items():
        if not key.endswith("_time"):
            assert mg[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert torch_m["kl_loss"] != 0 and mg["lr"] == 1e-2
    assert r["logprob_diff"] < 1e-5
    assert r["weights_moved"] > 5e-3
    # Within what AdamW makes of the two runs' fp32 rounding (tests/adam_bound.py), as the one-step test.
    assert r["gradient_excess"] <= 1.0 and r["weights_excess"] <= 1.0, (r["weights_excess"], r["weights_diff"])


def test_bf16_computes_in_bf16_and_steps_fp32_master_weights(tmp_path):
    """--trainer-dtype bfloat16: the megatron model's matrices are bf16 (its norms stay fp32, as
    megatron keeps them), the optimizer steps fp32 masters and the publish writes them; the step is
    the torch trainer's under autocast, within bf16 rounding."""
    r = _check(tmp_path, 2, 2, 3, variant="default", gbs=4, dtype="bfloat16")
    assert r["model_dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert r["saved_dtypes"] == ["torch.float32"] and r["saved_beyond_bf16"]
    torch_m, mg = r["torch"], r["megatron"]
    assert mg["optimizer_steps"] == torch_m["optimizer_steps"] == 2
    for key in ("loss", "grad_norm", "entropy", "tis_mean"):
        assert mg[key] == pytest.approx(torch_m[key], rel=0.02, abs=1e-3), key
    assert r["logprob_diff"] < 0.1
    assert r["weights_moved"] > 5e-3


def test_a_distributed_publish_from_tp2_ranks_gives_the_engine_the_saved_weights(tmp_path):
    """--update-weight-transport distributed with the megatron backend: rank 0 gathers the TP
    shards, converts them to HF names and shapes, and broadcasts them in buckets over a gloo group
    to a built-in engine process; afterwards every tensor of the engine equals the saved folder's."""
    env = repo_env()
    script = str(ROOT / "tests" / "megatron_publish_check.py")
    done = subprocess.run(
        [sys.executable, script, str(tmp_path), "2", "2"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    r = orjson.loads((tmp_path / "result.json").read_bytes())
    assert r["versions"] == ["1"] and r["buckets"] > 2 and r["optimizer_steps"] >= 1
    assert r["sent"] == sorted(r["equal"])  # the same names as the saved HF folder, no more
    assert all(r["equal"].values()), [name for name, ok in r["equal"].items() if not ok]
    assert any(r["moved"].values())  # the step changed the weights the engine now serves
    # The weights-only publish folder: the checkpoint's tensors, gathered over both TP ranks, and no
    # optimizer shards (a third of the bytes with AdamW).
    assert r["weights_only_equal"] and "optimizer" not in r["weights_only_files"]
    assert "model.safetensors" in r["weights_only_files"]


def test_a_bf16_run_resumes_from_its_fp32_master_weights_and_adam_state(tmp_path):
    env = repo_env()
    script = str(ROOT / "tests" / "megatron_resume_check.py")
    for mode in ("train", "resume"):
        done = subprocess.run(
            [sys.executable, script, str(tmp_path), mode], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-4000:]
    r = orjson.loads((tmp_path / "result.json").read_bytes())
    assert r["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert r["steps"] == 1 and r["steps_after"] == 2 and r["next_step_loss_finite"]
    assert r["masters_equal_saved"] and r["params_are_rounded_masters"]
    assert r["adam_state_restored"] and r["adam_entries"] > 0


def test_parallel_flags_are_checked_at_config_load():
    from core.errors import ConfigError
    from pipeline.config import load_config

    config = load_config(
        [
            "--train-backend",
            "megatron",
            "--actor-num-gpus-per-node",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--micro-batch-size",
            "4",
        ]
    )
    t = config.trainer
    assert (t.backend, t.num_ranks, t.tensor_model_parallel_size, t.micro_batch_size) == ("megatron", 4, 2, 4)
    # The same trust region as the torch backend by default: two optimizer steps per rollout batch.
    samples = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    assert t.global_batch_size == samples // 2 == load_config([]).trainer.global_batch_size
    assert load_config(["--train-backend", "megatron", "--global-batch-size", "3"]).trainer.global_batch_size == 3
    with pytest.raises(ConfigError) as err:
        load_config(
            [
                "--train-backend",
                "megatron",
                "--actor-num-gpus-per-node",
                "3",
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ]
        )
    text = str(err.value)
    assert "--tensor-model-parallel-size=2: must divide --actor-num-gpus-per-node=3" in text
    pipelined = ["--train-backend", "megatron", "--actor-num-gpus-per-node", "4", "--pipeline-model-parallel-size", "2"]
    assert load_config(pipelined).trainer.pipeline_model_parallel_size == 2
    with pytest.raises(ConfigError) as err:
        load_config([*pipelined, "--tensor-model-parallel-size", "4", "--use-distributed-optimizer"])
    text = str(err.value)
    assert (
        "--tensor-model-parallel-size=4 x --pipeline-model-parallel-size=2: must divide --actor-num-gpus-per-node=4"
        in text
    )
    assert "--use-distributed-optimizer=True with --pipeline-model-parallel-size=2" in text
    distributed = ["--train-backend", "megatron", "--update-weight-transport", "distributed"]
    assert load_config(distributed).rollout.update_weight_transport == "distributed"
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size=2 with --train-backend=torch"):
        load_config(["--tensor-model-parallel-size", "2"])


def _launch(tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "run"
    argv = ["--output-dir", str(out), "--no-progress", "--log-level", "warning", "--num-rollout", "12"]
    done = run_python_module("pipeline.launch", *argv, "--train-backend", "megatron", *flags, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--micro-batch-size", "16"),
        ("--trainer-dtype", "bfloat16"),
        (
            "--actor-num-gpus-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--update-weight-transport",
            "distributed",
        ),
        ("--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"),
    ],
    ids=["tp1", "tp2", "tp1-bf16", "tp2-distributed-publish", "pp2"],
)
def test_the_built_in_task_learns_with_megatron_ranks(tmp_path, flags):
    """End to end: built-in engine, megatron ranks, a publish per step; reward rises in 12 steps.

    The engine's log-probs for tokens it sampled with the published weights match what the trainer
    computes for them (`train_rollout_logprob_abs_diff`): the HF folder it loads is the trainer's model.
    """
    records = _launch(tmp_path, *flags)
    assert [r["version"] for r in records] == list(range(12))
    first = sum(r["rollout/raw_reward"] for r in records[:3]) / 3
    last = sum(r["rollout/raw_reward"] for r in records[-3:]) / 3
    assert last > first + 0.05, (first, last)
    # bf16: the trainer computes in bf16 while the engine samples from the fp32 weights it publishes.
    tolerance = 0.05 if "bfloat16" in flags else 1e-4
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < tolerance
    world = 2 if "--actor-num-gpus-per-node" in flags else 1
    optimizer = tmp_path / "run" / "checkpoints" / "v12" / "optimizer"
    assert sorted(p.name for p in optimizer.iterdir()) == sorted(
        f"rank{i}.{ext}" for i in range(world) for ext in ("json", "safetensors")
    )


def test_an_optimizer_shard_restores_exactly_and_refuses_another_layout(tmp_path):
    """Another world size, TP, PP or EP is refused with both layouts named; a shard saved before
    PP or EP were recorded reads as one stage and EP=1."""
    from core.errors import PipelineError
    from trainers.megatron.checkpoint import load_optimizer_shard, save_optimizer_shard

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    layout = {"rank": 0, "world": 1, "tp": 1, "pp": 1}
    named = list(model.named_parameters())
    save_optimizer_shard(optimizer, named, tmp_path, layout=layout, steps=7)

    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert load_optimizer_shard(fresh, named, tmp_path, layout=layout) == 7
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[p][key], optimizer.state[p][key])
    with pytest.raises(
        PipelineError,
        match=r"this run is \{'format': 1, 'backend': 'megatron', 'world': 2, 'tp': 2, 'pp': 1, 'ep': 1\}",
    ):
        load_optimizer_shard(fresh, named, tmp_path, layout={"rank": 0, "world": 2, "tp": 2, "pp": 1})
    with pytest.raises(PipelineError, match="no shard for megatron rank 1: it was saved by the torch backend"):
        load_optimizer_shard(fresh, named, tmp_path, layout={"rank": 1, "world": 2, "tp": 2, "pp": 1})
    # The same ranks as two pipeline stages are another layout: the shard holds other parameters.
    with pytest.raises(
        PipelineError, match=r"'pp': 1, 'ep': 1, 'trainer_steps': 7\}; this run is .*'pp': 2, 'ep': 1\}"
    ):
        load_optimizer_shard(fresh, named, tmp_path, layout={"rank": 0, "world": 1, "tp": 1, "pp": 2})
    # Expert parallel: each rank holds other experts, so their moments would land on the wrong ones.
    two = {"rank": 0, "world": 2, "tp": 1, "pp": 1}
    save_optimizer_shard(optimizer, named, tmp_path, layout={**two, "ep": 2}, steps=7)
    with pytest.raises(PipelineError, match=r"'ep': 2, 'trainer_steps': 7\}; this run is .*'ep': 1\}"):
        load_optimizer_shard(fresh, named, tmp_path, layout=two)
    meta = orjson.loads((tmp_path / "rank0.json").read_bytes())
    del meta["ep"], meta["pp"]  # as written before pipeline and expert parallel
    (tmp_path / "rank0.json").write_bytes(orjson.dumps(meta))
    assert load_optimizer_shard(fresh, named, tmp_path, layout=two) == 7


@pytest.mark.parametrize(
    ("keywords", "said"),
    [
        ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
        ({"dtype": "float16"}, r"dtype must be one of \['bfloat16', 'float32'\], got 'float16'"),
        ({"micro_batch_size": 0}, "micro_batch_size must be >= 1, got 0"),
        ({"max_tokens_per_gpu": 0}, r"max_tokens_per_gpu must be >= 1 tokens or None \(no budget\), got 0"),
        ({"global_batch_size": 0}, "global_batch_size must be >= 1 samples or None, got 0"),
        ({"temperature": 0.0, "dtype": "float16"}, "temperature must be"),  # the first refusal is the temperature's
    ],
)
def test_bad_megatron_trainer_arguments_are_refused_by_name_before_any_model_is_read(tmp_path, keywords, said):
    """Checked first: no torch.distributed, no parallel state and no model folder are needed to be refused."""
    from trainers.megatron.trainer import MegatronTrainer

    with pytest.raises(ValueError, match=said):
        MegatronTrainer(tmp_path / "no-model-here", **keywords)
