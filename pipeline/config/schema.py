"""The config tree's schema: what each setting is, how it is spelled, its default and bounds.

This module only describes. The frozen dataclasses are the tree `load_config` returns; each
field's metadata (`_opt(default, flag, kind, help=...)`) says its flag (slime's name where slime
has the concept), how a flag or TOML value converts, and its simple bounds. Nothing here reads a
file, imports a heavy module or resolves a plugin: `parsing` reads flags and TOML against this
schema, `rules` checks the values, and `load` runs the one step that touches the outside world.

To add a setting, add one field line to a section below; the flag, its help, TOML key, bounds
and `config_to_dict` follow from it.

Why over 700 lines: it is a table, one field per flag with its help text, in the sections users
see in `--help` and TOML; split further it would be no easier to scan.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from core.types import PauseMode, RolloutMode, StoreTransport, WeightTransport
from storage.declaration import PROFILES

__all__ = [
    "SECTIONS",
    "Config",
    "DataConfig",
    "EngineConfig",
    "Opt",
    "OutputConfig",
    "RolloutConfig",
    "StorageConfig",
    "TrainerConfig",
    "config_to_dict",
    "opt_of",
    "options",
    "section_from_dict",
    "typed",
]


@dataclass(frozen=True, slots=True)
class Opt:
    """How one config field is spelled on the command line, parsed, and bounded."""

    flag: str
    kind: str  # int | float | str | path | choice | bool | urls | strs (choice: an enum's values, or plain strings)
    help: str
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    default_help: str | None = None  # for derived defaults: what None becomes
    why: str = ""  # appended to a bound's message
    metavar: str | None = None


def _opt(default: Any, flag: str, kind: str, *, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"opt": Opt(flag, kind, help, **kw)})


def _resolved(path_field: str) -> Any:
    """A callable filled in by load_config from the `module:function` path in `path_field`."""
    return field(default=None, metadata={"plugin_of": path_field})


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    mode: RolloutMode = _opt(
        RolloutMode.SYNC,
        "--rollout-mode",
        "choice",
        choices=tuple(RolloutMode),
        help="sync: train after each round; async: keep generating across training steps",
    )
    rollout_batch_size: int = _opt(8, "--rollout-batch-size", "int", ge=1, help="groups per training step")
    n_samples_per_prompt: int = _opt(8, "--n-samples-per-prompt", "int", ge=1, help="samples per group (G)")
    over_sampling_batch_size: int | None = _opt(
        None,
        "--over-sampling-batch-size",
        "int",
        ge=1,
        default_help="--rollout-batch-size",
        help="groups admitted per refill; smaller than --rollout-batch-size is allowed",
    )
    partial_rollout: bool = _opt(
        False,
        "--partial-rollout",
        "bool",
        help="sync mode: at the target, abort the rest and resume their prefixes first next round",
    )
    partial_fill_idle_slots: bool = _opt(
        True,
        "--partial-fill-idle-slots",
        "bool",
        help="partial rollout: while a round waits for its stragglers, give idle slots one more group "
        "(more throughput, more off-policy tokens; --no-partial-fill-idle-slots keeps slime's refill rule)",
    )
    mask_offpolicy_in_partial_rollout: bool = _opt(
        False,
        "--mask-offpolicy-in-partial-rollout",
        "bool",
        help="zero the loss mask of the prefix that existed before a continuation",
    )
    max_response_len: int = _opt(64, "--rollout-max-response-len", "int", ge=1, help="response tokens per sample")
    temperature: float = _opt(
        1.0,
        "--rollout-temperature",
        "float",
        gt=0,
        help="sampling temperature",
        why=" (the trainer's log-prob correction divides the logits by it)",
    )
    top_p: float = _opt(1.0, "--rollout-top-p", "float", help="nucleus sampling, in (0, 1]")
    top_k: int = _opt(-1, "--rollout-top-k", "int", help="top-k sampling; -1 = off")
    min_new_tokens: int = _opt(
        0,
        "--rollout-min-new-tokens",
        "int",
        ge=0,
        help="no stop before this many response tokens (a continuation gets it minus its prefix)",
    )
    frequency_penalty: float = _opt(
        0.0, "--rollout-frequency-penalty", "float", help="SGLang's frequency_penalty; not with partial/async"
    )
    presence_penalty: float = _opt(
        0.0, "--rollout-presence-penalty", "float", help="SGLang's presence_penalty; not with partial/async"
    )
    repetition_penalty: float = _opt(
        1.0, "--rollout-repetition-penalty", "float", gt=0, help="SGLang's repetition_penalty; not with partial/async"
    )
    num_rollout: int = _opt(100, "--num-rollout", "int", ge=0, help="training steps (0: set up the run, train nothing)")
    prefetch: int | None = _opt(
        None,
        "--rollout-prefetch",
        "int",
        ge=0,
        default_help="--rollout-batch-size",
        help="ready groups kept ahead of the trainer",
    )
    max_staleness: int | None = _opt(
        None,
        "--max-staleness",
        "int",
        ge=0,
        help="admit no work that would exceed this staleness (versions); unset = no bound",
    )
    pause_mode: PauseMode = _opt(
        PauseMode.ABORT,
        "--pause-mode",
        "choice",
        choices=tuple(PauseMode),
        help="how engines pause for a weight publish",
    )
    update_weight_transport: WeightTransport = _opt(
        WeightTransport.DISK,
        "--update-weight-transport",
        "choice",
        choices=tuple(WeightTransport),
        help="disk: engines read a saved folder; distributed: the trainer broadcasts over torch.distributed",
    )
    overlap_weight_transfer: bool = _opt(
        False,
        "--overlap-weight-transfer",
        "bool",
        help="publish without pausing: engines receive weights while decoding and swap between two "
        "steps (built-in and simulated engines stage updates; SGLang may block generation meanwhile)",
    )
    update_weight_buffer_size: int = _opt(
        512 * 1024 * 1024,
        "--update-weight-buffer-size",
        "int",
        ge=1,
        help="bytes of weights per /update_weights_from_distributed call (distributed transport)",
    )
    seed: int = _opt(42, "--rollout-seed", "int", ge=0, help="sampling and data-order seed")
    request_timeout: float = _opt(600.0, "--rollout-request-timeout", "float", gt=0, help="seconds per engine request")
    max_retries: int = _opt(3, "--rollout-max-retries", "int", ge=0, help="retries of a failed engine request")
    reward_timeout: float = _opt(30.0, "--reward-timeout", "float", gt=0, help="seconds per reward call")
    reward_max_retries: int = _opt(
        0,
        "--reward-max-retries",
        "int",
        ge=0,
        help="call a reward that raised or timed out again, up to N times per sample (reward/retries_total); "
        "a value that is not a number is not retried",
    )
    agent_max_retries: int = _opt(
        0,
        "--agent-max-retries",
        "int",
        ge=0,
        help="run an agent that raised again, up to N times per sample, from where the sample stood "
        "(the failed attempt's tokens are dropped; agent/retries_total)",
    )
    store_batch: int = _opt(
        64,
        "--rollout-store-batch",
        "int",
        ge=1,
        help="the most groups one store call admits, or stores as ready or rejected, of those already "
        "waiting (one transaction, one fsync); 1 = one call per group",
    )
    eval_interval: int | None = _opt(
        None,
        "--eval-interval",
        "int",
        ge=1,
        help="evaluate on the engines every N steps, inline (sync mode only; async: python -m pipeline.eval)",
    )
    # Evaluation (issue 31): slime's flags; the set is never mixed into training data.
    eval_prompt_data: tuple[str, ...] = _opt(
        (),
        "--eval-prompt-data",
        "strs",
        metavar="NAME PATH",
        default_help="the toy task: 64 toy prompts of another seed, named toy; else required",
        help="evaluation sets, as NAME PATH pairs of JSONL prompt files (--input-key/--label-key, "
        "scored by --custom-rm-path)",
    )
    n_samples_per_eval_prompt: int = _opt(
        1, "--n-samples-per-eval-prompt", "int", ge=1, help="responses per eval prompt"
    )
    eval_temperature: float | None = _opt(
        None,
        "--eval-temperature",
        "float",
        ge=0,
        default_help="--rollout-temperature",
        help="eval sampling temperature",
    )
    eval_top_p: float | None = _opt(
        None, "--eval-top-p", "float", gt=0, default_help="--rollout-top-p", help="eval top-p"
    )
    eval_top_k: int | None = _opt(None, "--eval-top-k", "int", default_help="--rollout-top-k", help="eval top-k")
    eval_max_response_len: int | None = _opt(
        None,
        "--eval-max-response-len",
        "int",
        ge=1,
        default_help="--rollout-max-response-len",
        help="eval response length cap",
    )
    # Producers on Ray (issue 13): where the generator pool, reward and filter run.
    producers: str = _opt(
        "local",
        "--rollout-producers",
        "choice",
        choices=("local", "ray"),
        help="local: generate and score in this process; ray: in one Ray actor per eligible node, "
        "leasing work from this controller's store",
    )
    ray_address: str | None = _opt(
        None,
        "--ray-address",
        "str",
        metavar="ADDRESS",
        default_help="start a local Ray cluster",
        help="--rollout-producers ray: join this Ray cluster (e.g. 10.0.0.1:6379 or auto)",
    )
    num_producers: int | None = _opt(
        None,
        "--rollout-num-producers",
        "int",
        ge=1,
        default_help="one per alive Ray node with CPUs",
        help="--rollout-producers ray: producer actors, placed round robin over the eligible nodes",
    )
    producer_lease_seconds: float = _opt(
        5.0,
        "--producer-lease-seconds",
        "float",
        gt=0,
        help="--rollout-producers ray: a producer's leases expire this long after its last answered heartbeat",
    )
    producer_deadline_seconds: float = _opt(
        10.0,
        "--producer-deadline-seconds",
        "float",
        gt=0,
        help="--rollout-producers ray: a producer that does not answer a stop or publish within this is "
        "treated as dead",
    )
    producer_takes_per_second: float = _opt(
        100.0,
        "--producer-takes-per-second",
        "float",
        gt=0,
        help="--rollout-producers ray: the controller takes finished groups back from all producers together "
        "at most this often (a Ray call costs it about 1 ms of CPU whatever it carries; a result waits at most "
        "W/this seconds longer); inf: at once",
    )
    producer_mailbox: bool = _opt(
        True,
        "--producer-mailbox",
        "bool",
        help="--rollout-producers ray: groups go out and results come back through one mailbox actor on this "
        "node, one Ray call each way for all producers, so the controller's calls do not grow with the producers "
        "(--no-producer-mailbox: calls to each producer, cheaper for one or two)",
    )
    # Per-token payloads (R3, SC), asked of the engine with every request and kept token-aligned
    # through continuations and publishes (`stages.sglang.payloads`; the rules: `config/payloads.py`).
    use_rollout_routing_replay: bool = _opt(
        False,
        "--use-rollout-routing-replay",
        "bool",
        help="R3: ask the engines for each token's routed experts (return_routed_experts; SGLang needs "
        "--enable-return-routed-experts) and keep them with the sample",
    )
    moe_router_topk: int | None = _opt(
        None,
        "--moe-router-topk",
        "int",
        ge=1,
        help="experts per token per MoE layer (the model's top-k); splits the engine's routed-experts rows into layers",
    )
    use_score_centering: bool = _opt(
        False,
        "--use-score-centering",
        "bool",
        help="SC: ask the engines for the sampler's top-k per token (top_logprobs_num) and keep them with the sample",
    )
    score_centering_top_k: int | None = _opt(
        None, "--score-centering-top-k", "int", ge=1, help="--use-score-centering: candidates kept per token"
    )

    @property
    def resumes_partial_groups(self) -> bool:
        """Whether aborted groups are kept and resumed: always in async mode, by flag in sync mode."""
        return self.mode is RolloutMode.ASYNC or self.partial_rollout


_FN = "MODULE:FUNCTION"


@dataclass(frozen=True, slots=True)
class DataConfig:
    prompt_data: Path | None = _opt(
        None, "--prompt-data", "path", default_help="the built-in toy task", help="JSONL prompt file"
    )
    input_key: str = _opt("prompt", "--input-key", "str", metavar="KEY", help="JSONL key of the prompt text")
    label_key: str = _opt("label", "--label-key", "str", metavar="KEY", help="JSONL key of the label")
    num_prompts: int = _opt(512, "--num-prompts", "int", ge=1, help="size of the built-in toy dataset")
    task: str = _opt(
        "toy",
        "--task",
        "choice",
        choices=("toy", "tool"),
        help="built-in task without --prompt-data: toy (one turn) or tool (multi-turn: look up, then reply)",
    )
    custom_rm_path: str | None = _opt(
        None, "--custom-rm-path", "str", metavar=_FN, default_help="the toy task's reward", help="reward function"
    )
    dynamic_sampling_filter_path: str | None = _opt(
        None, "--dynamic-sampling-filter-path", "str", metavar=_FN, help="group acceptance filter"
    )
    rollout_all_samples_process_path: str | None = _opt(
        None,
        "--rollout-all-samples-process-path",
        "str",
        metavar=_FN,
        help="sees every group, filtered-out ones too (sync mode only)",
    )
    buffer_filter_path: str | None = _opt(
        None,
        "--buffer-filter-path",
        "str",
        metavar=_FN,
        help="picks groups from the memory store's buffer (memory transport only)",
    )
    custom_generate_function_path: str | None = _opt(
        None,
        "--custom-generate-function-path",
        "str",
        metavar=_FN,
        default_help="one request per sample",
        help="multi-turn agent `async def run(ctx, sample)` (see stages.agent)",
    )
    # Filled by load_config from the paths above; None when the path is unset.
    agent_fn: Callable[..., Any] | None = _resolved("custom_generate_function_path")
    reward_fn: Callable[..., Any] | None = _resolved("custom_rm_path")
    filter_fn: Callable[..., Any] | None = _resolved("dynamic_sampling_filter_path")
    all_samples_process_fn: Callable[..., Any] | None = _resolved("rollout_all_samples_process_path")
    buffer_filter_fn: Callable[..., Any] | None = _resolved("buffer_filter_path")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    urls: tuple[str, ...] = _opt(
        (),
        "--sglang-url",
        "urls",
        metavar="URL",
        default_help="start built-in engines",
        help="an SGLang engine URL (repeatable)",
    )
    router_url: str | None = _opt(
        None, "--sglang-router-url", "str", metavar="URL", help="an SGLang router in front of engines"
    )
    num_engines: int = _opt(
        1,
        "--rollout-num-engines",
        "int",
        ge=1,
        help="built-in engines to start (>1: behind sglang-router); with --sglang-router-url, the engines behind it",
    )
    sglang_server_concurrency: int = _opt(
        64, "--sglang-server-concurrency", "int", ge=1, help="in-flight samples per engine"
    )
    hf_checkpoint: str | None = _opt(
        None,
        "--hf-checkpoint",
        "str",
        metavar="PATH",
        default_help="build the tiny model in the run folder",
        help="model folder (or Hub id)",
    )
    num_experts: int | None = _opt(
        None,
        "--num-experts",
        "int",
        ge=2,
        default_help="dense",
        help="the tiny model built without --hf-checkpoint is a Qwen3-MoE with this many experts per layer, "
        "--moe-router-topk (default 2) routed per token",
    )
    device: str = _opt(
        "cpu",
        "--rollout-device",
        "str",
        metavar="DEVICE",
        help="torch device of the built-in engines: cpu, cuda or cuda:N (the trainer's is --trainer-device)",
    )
    host: str = _opt("127.0.0.1", "--engine-host", "str", metavar="HOST", help="address built-in engines bind to")
    # Real SGLang servers started by the pipeline (launch/sglang_server.py).
    launcher: str = _opt(
        "builtin",
        "--rollout-engine",
        "choice",
        choices=("builtin", "sglang"),
        help="engines the pipeline starts when no URL is given: the built-in engine, or real SGLang "
        "(python -m sglang.launch_server, which must be importable here)",
    )
    sglang_devices: str | None = _opt(
        None,
        "--sglang-devices",
        "str",
        metavar="0,1,...",
        default_help="0 .. engines x GPUs per engine - 1",
        help="--rollout-engine sglang: GPU ids for the engines, in order; each engine takes "
        "--rollout-num-gpus-per-engine of them (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)",
    )
    gpus_per_engine: int = _opt(
        1, "--rollout-num-gpus-per-engine", "int", ge=1, help="--rollout-engine sglang: GPUs per engine (its --tp-size)"
    )
    sglang_mem_fraction_static: float | None = _opt(
        None,
        "--sglang-mem-fraction-static",
        "float",
        gt=0,
        default_help="SGLang's default",
        help="--rollout-engine sglang: GPU memory fraction for weights and KV cache",
    )
    sglang_startup_timeout: float = _opt(
        900.0, "--sglang-startup-timeout", "float", gt=0, help="seconds for a started SGLang server to become healthy"
    )
    api_key: str | None = _opt(
        None,
        "--api-key",
        "str",
        metavar="KEY",
        help="sent to engines and the router as 'Authorization: Bearer KEY', and given to the SGLang servers and "
        "router the pipeline starts",
    )
    # Engine faults (issue 17): slime's flags and defaults, plus the floor the run goes on with.
    use_fault_tolerance: bool = _opt(
        False,
        "--use-fault-tolerance",
        "bool",
        help="evict a dead or hung engine, restart it (built-in) or wait for it (yours), re-admit it current",
    )
    health_check_interval: float = _opt(
        30.0, "--rollout-health-check-interval", "float", gt=0, help="seconds between engine heartbeats"
    )
    health_check_timeout: float = _opt(
        30.0,
        "--rollout-health-check-timeout",
        "float",
        gt=0,
        help="seconds a heartbeat (/health_generate) may take before the engine is evicted",
    )
    health_check_first_wait: float = _opt(
        0.0, "--rollout-health-check-first-wait", "float", ge=0, help="seconds before the first heartbeat"
    )
    min_live_engines: int = _opt(
        1,
        "--min-live-engines",
        "int",
        ge=1,
        help="with --use-fault-tolerance, the run stops once fewer engines than this are live",
    )
    max_engine_restarts: int = _opt(
        3, "--max-engine-restarts", "int", ge=0, help="restart tries per evicted built-in engine"
    )


@dataclass(frozen=True, slots=True)
class StorageConfig:
    transport: StoreTransport = _opt(
        StoreTransport.MEMORY,
        "--rollout-data-transport",
        "choice",
        choices=tuple(StoreTransport),
        help="where rollout state lives",
    )
    data_dir: Path | None = _opt(
        None, "--rollout-data-dir", "path", default_help="<output dir>/rollout_data", help="LMDB folder"
    )
    run_id: str = _opt("default", "--rollout-queue-run-id", "str", metavar="ID", help="names the run and its store")
    declaration: Path | None = _opt(
        None,
        "--rollout-storage-declaration",
        "path",
        metavar="FILE.json",
        help='what the LMDB folder\'s mount is: {"mount_path", "filesystem", "durability": '
        '{"synced_commits"}}; needed on a network filesystem',
    )
    profile: str | None = _opt(
        None,
        "--rollout-storage-profile",
        "choice",
        choices=tuple(PROFILES),
        default_help="detect; local only",
        help="a preset declaration for the LMDB folder's filesystem",
    )
    requeue_failed_groups: bool = _opt(
        False,
        "--requeue-failed-groups",
        "bool",
        help="on resume (LMDB), generate the prompts of groups that failed in earlier runs again now, each once "
        "(the failed groups stay, counted); without it they come again in the next epoch",
    )
    gc_keep_steps: int | None = _opt(
        None,
        "--rollout-gc-keep-steps",
        "int",
        ge=0,
        default_help="keep everything (replay sees the whole run)",
        help="after each step, delete the trained groups and batches of all but the last N steps "
        "(never those after the newest checkpoint: a resume trains them again)",
    )


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    lr: float = _opt(5e-3, "--lr", "float", gt=0, help="learning rate")
    eps_clip: float = _opt(0.2, "--eps-clip", "float", gt=0, help="PPO ratio clip (low side)")
    eps_clip_high: float | None = _opt(
        None, "--eps-clip-high", "float", gt=0, default_help="--eps-clip", help="PPO ratio clip, high side"
    )
    use_tis: bool = _opt(True, "--use-tis", "bool", help="truncated importance sampling")
    tis_clip: float = _opt(2.0, "--tis-clip", "float", gt=0, help="TIS ratio cap")
    max_grad_norm: float = _opt(1.0, "--clip-grad", "float", gt=0, help="gradient norm clip")
    global_batch_size: int | None = _opt(
        None,
        "--global-batch-size",
        "int",
        ge=1,
        default_help="half a rollout batch's samples (two optimizer steps, either backend)",
        help="samples per optimizer step; a smaller value splits each rollout batch into several steps, "
        "with the PPO clip acting against the log-probs recomputed before the first (the trust region that "
        "keeps partial and async rollout stable: BENCHMARKS.md section 8)",
    )
    tis_mode: str = _opt(
        "truncate",
        "--tis-mode",
        "choice",
        choices=("truncate", "icepop", "seq-mask"),
        help="with --use-tis: truncate = clamp the weight to [--tis-clip-low, --tis-clip]; icepop = drop tokens "
        "whose weight leaves it; seq-mask = drop samples whose geometric-mean weight leaves it",
    )
    tis_clip_low: float = _opt(0.0, "--tis-clip-low", "float", ge=0, help="importance weight lower bound")
    use_opsm: bool | None = _opt(
        None,
        "--use-opsm",
        "bool",
        default_help="on with --rollout-mode async or --partial-rollout, off otherwise",
        help="off-policy sequence masking: drop negative-advantage samples whose mean log(mu/pi) > --opsm-delta "
        "(what keeps unbounded async and partial rollout at sync's reward: BENCHMARKS.md section 8)",
    )
    opsm_delta: float = _opt(1e-4, "--opsm-delta", "float", ge=0, help="OPSM threshold")
    loss_agg_mode: str = _opt(
        "token-mean",
        "--loss-agg-mode",
        "choice",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        help="token-mean (slime --calculate-per-token-loss), seq-mean-token-mean (slime's default), "
        "seq-mean-token-sum-norm (Dr.GRPO: divide by samples x --rollout-max-response-len)",
    )
    disable_grpo_std_normalization: bool = _opt(
        False, "--disable-grpo-std-normalization", "bool", help="advantages are reward - group mean (Dr.GRPO)"
    )
    overlong_buffer_len: int = _opt(
        0,
        "--overlong-buffer-len",
        "int",
        ge=0,
        help="DAPO overlong shaping: the last N tokens before --rollout-max-response-len cost reward; 0 = off",
    )
    overlong_penalty_factor: float = _opt(
        1.0, "--overlong-penalty-factor", "float", ge=0, help="DAPO overlong penalty at the length cap"
    )
    mask_truncated_samples: bool = _opt(
        False,
        "--mask-truncated-samples",
        "bool",
        help="truncated samples train no token (their reward still counts in the group's statistics)",
    )
    mask_stale_tokens: int | None = _opt(
        None,
        "--mask-stale-tokens",
        "int",
        ge=0,
        metavar="K",
        help="tokens older than the trained version - K get loss 0; the group and its other tokens train "
        "(--max-staleness instead refuses to admit work)",
    )
    device: str = _opt(
        "cpu",
        "--trainer-device",
        "str",
        help="torch device for the built-in trainer: cpu, cuda, cuda:N (ROCm builds of torch call AMD GPUs cuda too)",
    )
    dtype: str = _opt(
        "float32",
        "--trainer-dtype",
        "choice",
        choices=("float32", "bfloat16"),
        help="what the trainer computes in; bfloat16 keeps fp32 master weights, gradients and optimizer state "
        "(torch: autocast; megatron: bf16 parameters with fp32 masters)",
    )
    backend: str = _opt(
        "torch",
        "--train-backend",
        "choice",
        choices=("torch", "megatron"),
        help="torch: the single-process GRPO trainer; megatron: megatron-core ranks (pip install .[megatron])",
    )
    num_ranks: int = _opt(
        1,
        "--actor-num-gpus-per-node",
        "int",
        ge=1,
        help="--train-backend megatron: trainer ranks per node, one process per device (gloo processes on CPU)",
    )
    num_nodes: int = _opt(
        1,
        "--actor-num-nodes",
        "int",
        ge=1,
        help="--train-backend megatron: nodes of trainer ranks; this host is node 0, each other node runs "
        "`python -m pipeline.launch --node-rank K` with the same flags",
    )
    master_addr: str = _opt(
        "127.0.0.1",
        "--trainer-master-addr",
        "str",
        metavar="HOST",
        help="--train-backend megatron: where the other ranks reach rank 0 (this host); another node needs an "
        "address of this host it can reach",
    )
    master_port: int | None = _opt(
        None,
        "--trainer-master-port",
        "int",
        ge=1,
        metavar="PORT",
        default_help="a free port (one node only)",
        help="--train-backend megatron: the port rank 0 listens on for the trainer group",
    )
    join_timeout: float = _opt(
        600.0,
        "--trainer-join-timeout",
        "float",
        gt=0,
        metavar="SECONDS",
        help="--train-backend megatron: how long rank 0 waits for every rank to join (and a rank for rank 0) "
        "before the run stops, naming the ranks missing",
    )
    tensor_model_parallel_size: int = _opt(
        1, "--tensor-model-parallel-size", "int", ge=1, help="--train-backend megatron: tensor parallel size"
    )
    pipeline_model_parallel_size: int = _opt(
        1,
        "--pipeline-model-parallel-size",
        "int",
        ge=1,
        help="--train-backend megatron: pipeline parallel size (stages of num_layers / PP layers each)",
    )
    micro_batch_size: int = _opt(
        8,
        "--micro-batch-size",
        "int",
        ge=1,
        help="--train-backend megatron: samples per micro-batch, packed into one sequence",
    )
    use_distributed_optimizer: bool = _opt(
        False,
        "--use-distributed-optimizer",
        "bool",
        help="--train-backend megatron on GPU ranks: megatron-core's DDP and distributed optimizer "
        "(optimizer state sharded over data parallel)",
    )
    # Reference KL and entropy (issue 31): slime's flags and semantics (trainers.loss).
    use_kl_loss: bool = _opt(
        False,
        "--use-kl-loss",
        "bool",
        help="add --kl-loss-coef x KL(policy || reference) to the loss; the trainer keeps a frozen reference model "
        "(the run's initial weights, or --ref-load) and scores each batch with it",
    )
    kl_loss_coef: float = _opt(0.0, "--kl-loss-coef", "float", ge=0, help="weight of the KL term (--use-kl-loss)")
    kl_loss_type: str = _opt(
        "k1",
        "--kl-loss-type",
        "choice",
        choices=("k1", "k2", "k3", "low_var_kl"),
        help="KL estimator per token, d = log pi - log pi_ref: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d, "
        "low_var_kl = k3 clamped to [-10, 10]",
    )
    entropy_coef: float = _opt(
        0.0, "--entropy-coef", "float", help="subtract this x the mean token entropy from the loss (> 0: explore)"
    )
    ref_load: Path | None = _opt(
        None,
        "--ref-load",
        "path",
        metavar="FOLDER",
        default_help="the run's initial weights (--hf-checkpoint)",
        help="HF folder of the reference model for --use-kl-loss",
    )


@dataclass(frozen=True, slots=True)
class OutputConfig:
    dir: Path | None = _opt(
        None, "--output-dir", "path", aliases=("--save",), default_help="runs/<run id>", help="run folder"
    )
    metrics_file: Path | None = _opt(
        None, "--metrics-file", "path", default_help="<output dir>/metrics.jsonl", help="metrics JSONL"
    )
    # Checkpoint cadence and retention (pipeline.checkpoints): the engines get weights-only folders
    # between checkpoints, and a resume trains the stored batches after the last checkpoint again.
    save_interval: int = _opt(
        10,
        "--save-interval",
        "int",
        ge=1,
        help="a full checkpoint (weights, optimizer, RNG state, step) every N steps and at the last "
        "one; a resume trains the stored batches of the steps since again",
    )
    save_keep_last: int = _opt(
        3, "--save-keep-last", "int", ge=0, help="checkpoints kept, the newest; 0 keeps every one"
    )
    progress: bool = _opt(True, "--progress", "bool", help="progress bar")
    log_level: str = _opt(
        "info", "--log-level", "choice", choices=("debug", "info", "warning", "error"), help="log level"
    )
    # Dashboards fed from the same per-step record as the metrics file (extras: see pipeline.metric_sinks).
    use_tensorboard: bool = _opt(
        False, "--use-tensorboard", "bool", help="also write each step's metrics to TensorBoard"
    )
    tensorboard_dir: Path | None = _opt(
        None, "--tensorboard-dir", "path", default_help="<output dir>/tensorboard", help="TensorBoard event folder"
    )
    use_wandb: bool = _opt(False, "--use-wandb", "bool", help="also log each step's metrics to Weights & Biases")
    wandb_project: str = _opt("rollout-pipeline", "--wandb-project", "str", metavar="NAME", help="W&B project")
    wandb_group: str | None = _opt(None, "--wandb-group", "str", metavar="NAME", help="W&B run group")
    wandb_mode: str = _opt(
        "offline",
        "--wandb-mode",
        "choice",
        choices=("offline", "online", "disabled"),
        help="offline writes under --wandb-dir with no network (upload later with `wandb sync`)",
    )
    wandb_dir: Path | None = _opt(None, "--wandb-dir", "path", default_help="<output dir>", help="W&B files folder")
    wandb_run_id: str | None = _opt(
        None,
        "--wandb-run-id",
        "str",
        metavar="ID",
        default_help="from the run id and output dir, stable across resumes",
        help="W&B run id; a resumed run continues the same W&B run",
    )


@dataclass(frozen=True, slots=True)
class Config:
    """The whole run. From `load_config`, every derived default is filled in and every path resolved."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # Legal but probably unintended settings, for the launcher to log. Not part of the settings.
    warnings: tuple[str, ...] = field(default=(), compare=False)


SECTIONS: dict[str, type] = {
    "rollout": RolloutConfig,
    "data": DataConfig,
    "engine": EngineConfig,
    "storage": StorageConfig,
    "trainer": TrainerConfig,
    "output": OutputConfig,
}


def options(cls: type) -> list[tuple[Field[Any], Opt]]:
    """The fields of a section that are settings (resolved callables are not), with their metadata."""
    return [(f, f.metadata["opt"]) for f in fields(cls) if "opt" in f.metadata]


def opt_of(section: str, name: str) -> Opt:
    return next(opt for f, opt in options(SECTIONS[section]) if f.name == name)


def typed(f: Field[Any], value: Any) -> Any:
    """A checked choice as its enum, for fields whose default is one (`"async"` -> RolloutMode.ASYNC)."""
    if isinstance(f.default, enum.Enum) and value is not None and not isinstance(value, type(f.default)):
        return type(f.default)(value)
    return value


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """The settings as JSON-able data (paths as strings, tuples as lists), for run metadata and logs.

    Resolved callables are left out: their `module:function` paths are in the dict already.
    """
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        part = getattr(config, section)
        out[section] = {f.name: _jsonable(getattr(part, f.name)) for f, _ in options(type(part))}
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


_Section = TypeVar("_Section")


def section_from_dict(cls: type[_Section], data: Mapping[str, Any]) -> _Section:
    """A section rebuilt from `config_to_dict`'s output (run metadata): unknown keys are ignored and
    missing ones take the schema's default, so a run recorded by an older version still reads.

    No rule is checked: the values were checked when that run loaded its config.
    """
    kwargs: dict[str, Any] = {}
    for f, opt in options(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if opt.kind == "path" and value is not None:
            value = Path(value)
        elif opt.kind in ("urls", "strs"):
            value = tuple(value)
        kwargs[f.name] = typed(f, value)
    return cls(**kwargs)
