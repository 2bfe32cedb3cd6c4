"""The `trainer` section of the config tree: the loss (clipping, importance sampling, KL,
entropy, aggregation), the optimizer, batch sizes, the backend (torch or megatron-core) and its
parallelism. Describes only (`schema` has the whole tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config.fields import opt

__all__ = ["TrainerConfig"]


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    lr: float = opt(5e-3, "--lr", "float", gt=0, help="learning rate")
    eps_clip: float = opt(0.2, "--eps-clip", "float", gt=0, help="PPO ratio clip (low side)")
    eps_clip_high: float | None = opt(
        None, "--eps-clip-high", "float", gt=0, default_help="--eps-clip", help="PPO ratio clip, high side"
    )
    use_tis: bool = opt(True, "--use-tis", "bool", help="truncated importance sampling")
    tis_clip: float = opt(2.0, "--tis-clip", "float", gt=0, help="TIS ratio cap")
    max_grad_norm: float = opt(1.0, "--clip-grad", "float", gt=0, help="gradient norm clip")
    global_batch_size: int | None = opt(
        None,
        "--global-batch-size",
        "int",
        ge=1,
        default_help="half a rollout batch's samples (two optimizer steps, either backend)",
        help="samples per optimizer step; a smaller value splits each rollout batch into several steps, "
        "with the PPO clip acting against the log-probs recomputed before the first (the trust region that "
        "keeps partial and async rollout stable: BENCHMARKS.md section 8)",
    )
    tis_mode: str = opt(
        "truncate",
        "--tis-mode",
        "choice",
        choices=("truncate", "icepop", "seq-mask"),
        help="with --use-tis: truncate = clamp the weight to [--tis-clip-low, --tis-clip]; icepop = drop tokens "
        "whose weight leaves it; seq-mask = drop samples whose geometric-mean weight leaves it",
    )
    tis_clip_low: float = opt(0.0, "--tis-clip-low", "float", ge=0, help="importance weight lower bound")
    use_opsm: bool | None = opt(
        None,
        "--use-opsm",
        "bool",
        default_help="on with --rollout-mode async or --partial-rollout, off otherwise",
        help="off-policy sequence masking: drop negative-advantage samples whose mean log(mu/pi) > --opsm-delta "
        "(what keeps unbounded async and partial rollout at sync's reward: BENCHMARKS.md section 8)",
    )
    opsm_delta: float = opt(1e-4, "--opsm-delta", "float", ge=0, help="OPSM threshold")
    opsm_against: str = opt(
        "current",
        "--opsm-against",
        "choice",
        choices=("current", "proximal"),
        help="OPSM's pi: current (slime's: after the batch's earlier optimizer steps, so it also drops "
        "negative samples of an on-policy batch) or proximal (before the batch's first optimizer step: "
        "the rollout's staleness alone)",
    )
    loss_agg_mode: str = opt(
        "token-mean",
        "--loss-agg-mode",
        "choice",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        help="token-mean (slime --calculate-per-token-loss), seq-mean-token-mean (slime's default), "
        "seq-mean-token-sum-norm (Dr.GRPO: divide by samples x --rollout-max-response-len)",
    )
    disable_grpo_std_normalization: bool = opt(
        False, "--disable-grpo-std-normalization", "bool", help="advantages are reward - group mean (Dr.GRPO)"
    )
    overlong_buffer_len: int = opt(
        0,
        "--overlong-buffer-len",
        "int",
        ge=0,
        help="DAPO overlong shaping: the last N tokens before --rollout-max-response-len cost reward; 0 = off",
    )
    overlong_penalty_factor: float = opt(
        1.0, "--overlong-penalty-factor", "float", ge=0, help="DAPO overlong penalty at the length cap"
    )
    mask_truncated_samples: bool = opt(
        False,
        "--mask-truncated-samples",
        "bool",
        help="truncated samples train no token (their reward still counts in the group's statistics)",
    )
    mask_stale_tokens: int | None = opt(
        None,
        "--mask-stale-tokens",
        "int",
        ge=0,
        metavar="K",
        help="tokens older than the trained version - K get loss 0; the group and its other tokens train "
        "(--max-staleness instead refuses to admit work)",
    )
    device: str = opt(
        "cpu",
        "--trainer-device",
        "str",
        help="torch device for the built-in trainer: cpu, cuda, cuda:N (ROCm builds of torch call AMD GPUs cuda too)",
    )
    dtype: str = opt(
        "float32",
        "--trainer-dtype",
        "choice",
        choices=("float32", "bfloat16"),
        help="what the trainer computes in; bfloat16 keeps fp32 master weights, gradients and optimizer state "
        "(torch: autocast; megatron: bf16 parameters with fp32 masters)",
    )
    backend: str = opt(
        "torch",
        "--train-backend",
        "choice",
        choices=("torch", "megatron"),
        help="torch: the single-process GRPO trainer; megatron: megatron-core ranks (pip install .[megatron])",
    )
    num_ranks: int = opt(
        1,
        "--actor-num-gpus-per-node",
        "int",
        ge=1,
        help="--train-backend megatron: trainer ranks per node, one process per device (gloo processes on CPU)",
    )
    num_nodes: int = opt(
        1,
        "--actor-num-nodes",
        "int",
        ge=1,
        help="--train-backend megatron: nodes of trainer ranks; this host is node 0, each other node runs "
        "`python -m pipeline.launch --node-rank K` with the same flags",
    )
    master_addr: str = opt(
        "127.0.0.1",
        "--trainer-master-addr",
        "str",
        metavar="HOST",
        help="--train-backend megatron: where the other ranks reach rank 0 (this host); another node needs an "
        "address of this host it can reach",
    )
    master_port: int | None = opt(
        None,
        "--trainer-master-port",
        "int",
        ge=1,
        metavar="PORT",
        default_help="a free port (one node only)",
        help="--train-backend megatron: the port rank 0 listens on for the trainer group",
    )
    join_timeout: float = opt(
        600.0,
        "--trainer-join-timeout",
        "float",
        gt=0,
        metavar="SECONDS",
        help="--train-backend megatron: how long rank 0 waits for every rank to join (and a rank for rank 0) "
        "before the run stops, naming the ranks missing",
    )
    tensor_model_parallel_size: int = opt(
        1, "--tensor-model-parallel-size", "int", ge=1, help="--train-backend megatron: tensor parallel size"
    )
    pipeline_model_parallel_size: int = opt(
        1,
        "--pipeline-model-parallel-size",
        "int",
        ge=1,
        help="--train-backend megatron: pipeline parallel size (stages of num_layers / PP layers each)",
    )
    expert_model_parallel_size: int = opt(
        1,
        "--expert-model-parallel-size",
        "int",
        ge=1,
        help="--train-backend megatron, MoE models: expert parallel size (each rank holds num_experts / EP of "
        "every layer's experts; must divide the data-parallel size, ranks / (TP x PP))",
    )
    micro_batch_size: int | None = opt(
        None,
        "--micro-batch-size",
        "int",
        ge=1,
        help="samples per forward and backward inside one optimizer step (gradients accumulate; the step "
        "equals the unsplit one). megatron: packed into one sequence, default 8; torch: default the whole "
        "--global-batch-size (set it when a minibatch's logits do not fit the device)",
    )
    max_tokens_per_gpu: int | None = opt(
        None,
        "--max-tokens-per-gpu",
        "int",
        ge=1,
        help="the most tokens in one forward and backward (slime's flag; the step equals the unsplit one). "
        "megatron: packed tokens (prompt + response) of a micro-batch, at most --micro-batch-size samples; "
        "torch: padded positions (samples x the longest), micro-batches cut from the minibatch sorted by "
        "length. Default: no budget",
    )
    trainer_compile: bool = opt(
        False,
        "--trainer-compile",
        "bool",
        help="--train-backend torch: compile each decoder layer and the token scorer with torch.compile (dynamic "
        "shapes; attention stays eager): fuses the norms, rotary, casts and the log-softmax over the vocabulary "
        "that dominate a GPU step's elementwise time; on a GPU, AdamW's fused kernel too. The first steps pay the "
        "compile (tens of seconds)",
    )
    use_distributed_optimizer: bool = opt(
        False,
        "--use-distributed-optimizer",
        "bool",
        help="--train-backend megatron on GPU ranks: megatron-core's DDP and distributed optimizer "
        "(optimizer state sharded over data parallel)",
    )
    # Reference KL and entropy (issue 31): slime's flags and semantics (trainers.loss).
    use_kl_loss: bool = opt(
        False,
        "--use-kl-loss",
        "bool",
        help="add --kl-loss-coef x KL(policy || reference) to the loss; the trainer keeps a frozen reference model "
        "(the run's initial weights, or --ref-load) and scores each batch with it",
    )
    kl_loss_coef: float = opt(0.0, "--kl-loss-coef", "float", ge=0, help="weight of the KL term (--use-kl-loss)")
    kl_loss_type: str = opt(
        "k1",
        "--kl-loss-type",
        "choice",
        choices=("k1", "k2", "k3", "low_var_kl"),
        help="KL estimator per token, d = log pi - log pi_ref: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d, "
        "low_var_kl = k3 clamped to [-10, 10]",
    )
    entropy_coef: float = opt(
        0.0, "--entropy-coef", "float", help="subtract this x the mean token entropy from the loss (> 0: explore)"
    )
    max_step_kl: float | None = opt(
        None,
        "--max-step-kl",
        "float",
        ge=0,
        metavar="NATS",
        default_help="0.2 with --train-backend torch; 0 with megatron, which does not have the check yet",
        help="after each optimizer step, halve the step while it moved the policy more than this KL per "
        "trained token of its minibatch (k3; 0 = no bound): the trust region PPO's clip cannot give a batch's "
        "first step, whose outliers collapse runs (BENCHMARKS.md section 12)",
    )
    ref_load: Path | None = opt(
        None,
        "--ref-load",
        "path",
        metavar="FOLDER",
        default_help="the run's initial weights (--hf-checkpoint)",
        help="HF folder of the reference model for --use-kl-loss",
    )
