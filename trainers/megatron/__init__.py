"""The megatron-core trainer backend (`--train-backend megatron`).

    trainer.py     MegatronTrainer: the Trainer protocol on megatron ranks (rank 0 leads, others follow)
    rows.py        a Batch as rows for the ranks, and the shared loss (trainers.loss) on them
    commands.py    rank 0's commands to the other ranks (train, save, log-probs, gather, stop)
    packing.py     samples packed into one sequence, log-probs and entropy over the TP-split vocabulary
    schedule.py    micro-batches through pipeline stages: all forwards, then all backwards
    grads.py       gradients across ranks: DP sum, TP sum of the q/k norms, tied embedding over PP, the norm clip
    master.py      fp32 master weights for a bf16 model (--trainer-dtype bfloat16)
    checkpoint.py  HF weights in and out, one AdamW shard per rank
    qwen3.py       the Qwen3-shaped GPTModel, and HF <-> megatron weight conversion (exact)
    moe.py         Qwen3-MoE's router and experts: megatron's MoE settings and their HF conversion
    router_replay.py  R3: the rollout's routes replayed through megatron-core's RouterReplay
    cpu_patches.py the runtime patches megatron-core 0.16.1 needs on CPU, applied only there

How ranks are started is `launch.megatron_ranks`; import the trainer from `trainers.megatron.trainer`.
Importing this package does not import megatron-core (an optional dependency:
`pip install 'rollout-pipeline[megatron]'`).
"""
