"""Run in a fresh process by tests/test_megatron.py: one GRPO step, torch trainer vs megatron ranks.

`python tests/megatron_check.py OUT_DIR WORLD TP [MICRO_BATCH[/MAX_TOKENS] [DEVICE [LOSS [GLOBAL_BATCH
[DTYPE [switched]]]]]]` writes OUT_DIR/result.json with both trainers' metrics, log-probs before the
step, the largest difference between their published weights and, by tests/adam_bound.py, how close
the first optimizer step's gradients (rank 0's) come to their fp32 rounding bound and the weights to
what AdamW makes of the two runs' moments (the last step's from every rank's saved AdamW state;
an earlier one's, with GLOBAL_BATCH, from the first step's rounding bound). `switched`: the megatron
ranks start with other settings (learning rate, temperature, the default loss) and are given the
torch trainer's by `use_settings` before the step. A process of its own, because megatron's
parallel state and the process group are global.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import orjson


def with_heads(batch):
    """`batch` with a sampler head of k=3 on every token (SC): the token, and two ids from the other
    half of the vocabulary, at made-up sampler log-probs that sum to less than 1."""
    import struct

    from core.columns import SamplerHeads
    from core.types import Batch

    def heads(s):
        ids = [i for t in s.response_ids.tolist() for i in (t, (t + 32) % 64, (t + 45) % 64)]
        lps = [lp for j in range(s.response_len) for lp in (-0.4 - 0.1 * (j % 3), -1.9, -3.0)]
        return SamplerHeads(struct.pack(f"<{len(ids)}i", *ids), struct.pack(f"<{len(lps)}d", *lps), k=3)

    groups = [g.with_samples([dataclasses.replace(s, heads=heads(s)) for s in g.samples]) for g in batch.groups]
    return Batch(batch.step, tuple(groups))


def fixed_batch(reference, shift: float = 0.0):
    from core.types import Batch, FinishReason, Group, Sample, Segment
    from pipeline.tasks.tiny_model import EOS_ID
    from pipeline.tasks.toy import encode, toy_dataset

    groups = []
    for g, task in enumerate(toy_dataset(2, seed=0)):
        tokens = [(*encode(a), EOS_ID) for a in ("b", "bb", "xyz", "7 = 3+4")]
        blank = [Sample(index=i, prompt_ids=task.prompt_ids) for i in range(len(tokens))]
        drafts = [
            s.extended(Segment(t, (0.0,) * len(t), FinishReason.STOP, 0), max_response_len=16)
            for s, t in zip(blank, tokens, strict=True)
        ]
        # Behaviour log-probs a little off the trainer's, so TIS weights are not all 1 (some hit the cap).
        # `shift` moves every token's further, so that a sample's mean divergence is never 0 plus float
        # noise: OPSM at a small delta then decides the same on both backends, not by rounding.
        behaviour = [
            [x + shift - 0.9 * ((j + g) % 3 - 1) for j, x in enumerate(lp)] for lp in reference.logprobs(drafts)
        ]
        samples = [
            dataclasses.replace(
                s.extended(Segment(t, tuple(lp), FinishReason.STOP, 0), max_response_len=16), reward=float(i % 3)
            )
            for i, (s, t, lp) in enumerate(zip(blank, tokens, behaviour, strict=True))
        ]
        groups.append(Group.fresh(task, epoch=0, n_samples=4, version=0, seq=g).with_samples(samples))
    return Batch(0, tuple(groups))


VARIANTS = {  # LOSS: the shared loss's other corrections and aggregations, on both trainers
    "default": {},
    "icepop-seqmean-opsm": {
        "correction": "icepop",
        "tis_clip_low": 0.5,
        "aggregation": "seq-mean-token-mean",
        "use_opsm": True,
        "opsm_delta": 1e-3,
    },
    "seqmask-tokenmean": {"correction": "seq-mask", "tis_clip_low": 0.3, "tis_clip": 1.5},
    # Reference KL against another model (--ref-load) and an entropy bonus, with its gradient; and SC's
    # score-centering term, its head ids on both halves of a TP=2 vocabulary (`with_heads`).
    "kl-entropy": {
        "use_kl_loss": True,
        "kl_loss_coef": 0.5,
        "kl_loss_type": "low_var_kl",
        "entropy_coef": 0.05,
        "score_centering": True,
    },
    "kl-k1-seqmean": {"use_kl_loss": True, "kl_loss_coef": 0.3, "aggregation": "seq-mean-token-mean"},
}


def _settings(variant: str):
    from trainers.loss import ImportanceCorrection, KLType, LossAggregation, LossSettings

    raw = dict(VARIANTS[variant])
    if "correction" in raw:
        raw["correction"] = ImportanceCorrection(raw["correction"])
    if "aggregation" in raw:
        raw["aggregation"] = LossAggregation(raw["aggregation"])
    if "kl_loss_type" in raw:
        raw["kl_loss_type"] = KLType(raw["kl_loss_type"])
    return LossSettings(**raw)


def _torch_moments(folder: Path, shape) -> dict:
    """The torch trainer's saved AdamW moments, (exp_avg, exp_avg_sq) by megatron name (full tensors)."""
    from safetensors.torch import load_file

    from trainers.megatron.qwen3 import hf_to_megatron

    names = orjson.loads((folder / "optimizer" / "state.json").read_bytes())["param_names"]
    state = load_file(str(folder / "optimizer" / "state.safetensors"))
    m, v = (
        hf_to_megatron({n: state[f"{i}.{key}"] for i, n in enumerate(names)}, shape)
        for key in ("exp_avg", "exp_avg_sq")
    )
    return {k: (t, v[k]) for k, t in m.items()}


def _megatron_moments(folder: Path, tp: int) -> dict:
    """The megatron ranks' saved AdamW moments joined over TP (ranks 0..TP-1 are DP rank 0's), by name."""
    from safetensors.torch import load_file

    from trainers.megatron.qwen3 import unshard

    shards = [load_file(str(folder / "optimizer" / f"rank{r}.safetensors")) for r in range(tp)]
    names = {k.rsplit(".", 1)[0] for k in shards[0] if k.endswith(".exp_avg")}
    return {n: tuple(unshard(n, [s[f"{n}.{key}"] for s in shards]) for key in ("exp_avg", "exp_avg_sq")) for n in names}


def main(
    out: Path,
    world: int,
    tp: int,
    micro: str,
    device: str = "cpu",
    variant: str = "default",
    gbs: int | None = None,
    dtype: str = "float32",
    switched: bool = False,
) -> None:
    from safetensors.torch import load_file

    from launch.megatron_ranks import start_megatron_trainer
    from pipeline.tasks.tiny_model import make_model_folder
    from tests.adam_bound import (
        adam_tolerance,
        first_step_bound,
        gradient_excess,
        record_gradients,
        saved_moments_apart,
        weight_excess,
    )
    from trainers import GRPOTrainer
    from trainers.megatron.qwen3 import hf_to_megatron, shard

    model = make_model_folder(out / "model")
    settings = _settings(variant)
    # A reference other than the starting weights, so the KL term and its gradient are not 0 at step 0.
    ref = make_model_folder(out / "ref", seed=7) if settings.use_kl_loss else None
    torch_trainer = GRPOTrainer(
        model, lr=1e-2, loss=settings, global_batch_size=gbs, device=device, dtype=dtype, ref_path=ref
    )
    # OPSM needs samples whose divergence is clearly above its delta (see fixed_batch).
    batch = fixed_batch(torch_trainer, shift=0.05 if VARIANTS[variant].get("use_opsm") else 0.0)
    if settings.score_centering:
        batch = with_heads(batch)
    torch_lp = torch_trainer.logprobs(batch.samples)
    torch_grads = record_gradients(torch_trainer.optimizer, torch_trainer.model.named_parameters())
    torch_metrics = torch_trainer.train_step(batch)
    torch_trainer.save_weights(out / "torch")

    mg = start_megatron_trainer(
        model,
        world_size=world,
        tp=tp,
        log_dir=out / "logs",
        device=device,
        loss=None if switched else settings,
        lr=3e-3 if switched else 1e-2,
        temperature=0.6 if switched else 1.0,
        # MICRO_BATCH is M, or M/T: also --max-tokens-per-gpu T (packed tokens a micro-batch).
        micro_batch_size=int(micro.split("/")[0]),
        max_tokens_per_gpu=int(micro.split("/")[1]) if "/" in micro else None,
        global_batch_size=gbs,
        dtype=dtype,
        ref_path=None if ref is None else str(ref),
    )
    try:
        if switched:
            mg.use_settings(dataclasses.replace(mg.step_settings, lr=1e-2, loss=settings, temperature=1.0))
        model_dtypes = sorted({str(p.dtype) for p in mg.model.parameters()})
        mg_lp = mg.logprobs(batch.samples)
        # Rank 0's gradients as its optimizer takes them (its TP shard; every DP rank's summed).
        mg_grads = record_gradients(mg.optimizer, [(mg._names[n], p) for n, p in mg.master.named()])
        mg_metrics = mg.train_step(batch)
        mg.save_weights(out / "megatron")
    finally:
        mg.close()
    a, b = load_file(str(out / "torch" / "model.safetensors")), load_file(str(out / "megatron" / "model.safetensors"))
    base = load_file(str(model / "model.safetensors"))
    # tests/adam_bound.py: the first step's gradients against fp32's rounding of the minibatch's sums,
    # the weights against what AdamW makes of the gradients' differences.
    shape, steps = mg.shape, len(torch_grads)
    ref = [hf_to_megatron(g, shape) for g in torch_grads]
    positions = sum(len(s.prompt_ids) + s.response_len for s in batch.samples[: gbs or len(batch.samples)])
    # Every rank's moments are in its saved shard, so the last step's are known for all the weights;
    # the earlier step (a half-batch split) differs by the first step's rounding bound.
    assert steps <= 2, f"{steps} optimizer steps: only the first and the last are bounded here"
    apart = [{k: (d, d) for k, d in first_step_bound(ref[0], positions=positions).items()}] * (steps - 1)
    apart.append(
        saved_moments_apart(_torch_moments(out / "torch", shape), _megatron_moments(out / "megatron", tp), step=steps)
    )
    weights = hf_to_megatron(a, shape)
    tolerance = adam_tolerance(ref, apart, weights, lr=1e-2)
    result = {
        # Rank 0's first-step gradients (its TP shard of the reference's) against the rounding bound.
        "gradient_excess": gradient_excess(
            ref[0], mg_grads[0], positions=positions, shard=lambda name, full: shard(name, full, 0, tp)
        ),
        "weights_excess": weight_excess(hf_to_megatron(b, shape), weights, tolerance),
        "torch": torch_metrics,
        "megatron": mg_metrics,
        "logprob_diff": max(
            abs(x - y) for p, q in zip(torch_lp, mg_lp, strict=True) for x, y in zip(p, q, strict=True)
        ),
        "weights_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
        "weights_moved": max(float((a[k] - base[k]).abs().max()) for k in a),
        "names": [sorted(a), sorted(b)],
        "optimizer_files": sorted(p.name for p in (out / "megatron" / "optimizer").iterdir()),
        "model_dtypes": model_dtypes,
        "saved_dtypes": sorted({str(t.dtype) for t in b.values()}),
        # The published weights are the fp32 masters, not their bf16 rounding.
        "saved_beyond_bf16": any(bool((t != t.bfloat16().float()).any()) for t in b.values()),
    }
    (out / "result.json").write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main(
        Path(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4] if len(sys.argv) > 4 else "8",
        sys.argv[5] if len(sys.argv) > 5 else "cpu",
        sys.argv[6] if len(sys.argv) > 6 else "default",
        int(sys.argv[7]) if len(sys.argv) > 7 and sys.argv[7] != "none" else None,
        sys.argv[8] if len(sys.argv) > 8 else "float32",
        len(sys.argv) > 9 and sys.argv[9] == "switched",
    )
