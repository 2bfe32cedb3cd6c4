"""The `rollout` section of the config tree: when batches train (sync or async, staleness,
prefetch), partial rollout, sampling, the weight publish, pacing, evaluation, timeouts and
retries. Describes only, as every section does (`schema` has the whole tree).

Why near 300 lines: it is a table, one field per flag with its help text.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.types import PauseMode, RolloutMode, WeightTransport
from pipeline.config.fields import opt

__all__ = ["RolloutConfig"]


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    mode: RolloutMode = opt(
        RolloutMode.SYNC,
        "--rollout-mode",
        "choice",
        choices=tuple(RolloutMode),
        help="sync: train after each round; async: keep generating across training steps",
    )
    rollout_batch_size: int = opt(8, "--rollout-batch-size", "int", ge=1, help="groups per training step")
    n_samples_per_prompt: int = opt(8, "--n-samples-per-prompt", "int", ge=1, help="samples per group (G)")
    over_sampling_batch_size: int | None = opt(
        None,
        "--over-sampling-batch-size",
        "int",
        ge=1,
        default_help="--rollout-batch-size",
        help="groups admitted per refill; smaller than --rollout-batch-size is allowed",
    )
    partial_rollout: bool = opt(
        False,
        "--partial-rollout",
        "bool",
        help="sync mode: at the target, abort the rest and resume their prefixes first next round",
    )
    partial_fill_idle_slots: bool = opt(
        True,
        "--partial-fill-idle-slots",
        "bool",
        help="partial rollout: while a round waits for its stragglers, give idle slots one more group "
        "(more throughput, more off-policy tokens; --no-partial-fill-idle-slots keeps slime's refill rule)",
    )
    mask_offpolicy_in_partial_rollout: bool = opt(
        False,
        "--mask-offpolicy-in-partial-rollout",
        "bool",
        help="zero the loss mask of the prefix that existed before a continuation",
    )
    max_response_len: int = opt(64, "--rollout-max-response-len", "int", ge=1, help="response tokens per sample")
    temperature: float = opt(
        1.0,
        "--rollout-temperature",
        "float",
        gt=0,
        help="sampling temperature",
        why=" (the trainer's log-prob correction divides the logits by it)",
    )
    top_p: float = opt(1.0, "--rollout-top-p", "float", help="nucleus sampling, in (0, 1]")
    top_k: int = opt(-1, "--rollout-top-k", "int", help="top-k sampling; -1 = off")
    min_new_tokens: int = opt(
        0,
        "--rollout-min-new-tokens",
        "int",
        ge=0,
        help="no stop before this many response tokens (a continuation gets it minus its prefix)",
    )
    frequency_penalty: float = opt(
        0.0, "--rollout-frequency-penalty", "float", help="SGLang's frequency_penalty; not with partial/async"
    )
    presence_penalty: float = opt(
        0.0, "--rollout-presence-penalty", "float", help="SGLang's presence_penalty; not with partial/async"
    )
    repetition_penalty: float = opt(
        1.0, "--rollout-repetition-penalty", "float", gt=0, help="SGLang's repetition_penalty; not with partial/async"
    )
    # The prompts' stored histories (issue 50, `stages.selection`): both off by default.
    skip_zero_std_prompts: bool = opt(
        False,
        "--skip-zero-std-prompts",
        "bool",
        help="skip, before generating it, a prompt whose last k groups all had equal rewards (what the "
        "DAPO filter rejects after generating them), with probability 1 - 2^-k capped at 1 - "
        "--skip-explore-floor; stored as a rejected group (filter/rejected/skipped_zero_std). Pays "
        "where prompts repeat over epochs",
    )
    skip_explore_floor: float = opt(
        0.1,
        "--skip-explore-floor",
        "float",
        gt=0,
        help="--skip-zero-std-prompts: the least probability, in (0, 1], that a prompt on a streak is "
        "generated again when the cursor reaches it, so one the policy can now learn from comes back",
    )
    length_aware_admission: bool = opt(
        False,
        "--length-aware-admission",
        "bool",
        help="sync mode: hand a round's new prompts to the engines longest first, predicted from their "
        "past groups' lengths (a prompt never seen counts as longest), so the last requests to start are short",
    )
    num_rollout: int = opt(100, "--num-rollout", "int", ge=0, help="training steps (0: set up the run, train nothing)")
    prefetch: int | None = opt(
        None,
        "--rollout-prefetch",
        "int",
        ge=0,
        default_help="--rollout-batch-size",
        help="the most ready groups kept ahead of the trainer (async pacing keeps fewer when they would only age)",
    )
    max_staleness: int | None = opt(
        None,
        "--max-staleness",
        "int",
        ge=0,
        help="admit no work that would exceed this staleness (versions); unset = no bound",
    )
    pace_async: bool = opt(
        True,
        "--async-pacing",
        "bool",
        help="async mode: admit only as far ahead of the trainer as keeps it fed, so a trainer-bound run "
        "trains about 1 version stale (--no-async-pacing: always the collector's bound plus twice the slots' groups)",
    )
    pause_mode: PauseMode = opt(
        PauseMode.ABORT,
        "--pause-mode",
        "choice",
        choices=tuple(PauseMode),
        help="how engines pause for a weight publish",
    )
    update_weight_transport: WeightTransport = opt(
        WeightTransport.DISK,
        "--update-weight-transport",
        "choice",
        choices=tuple(WeightTransport),
        help="disk: engines read a saved folder; distributed: the trainer broadcasts over torch.distributed",
    )
    overlap_weight_transfer: bool = opt(
        False,
        "--overlap-weight-transfer",
        "bool",
        help="publish without pausing: engines receive weights while decoding and swap between two "
        "steps (built-in and simulated engines stage updates; SGLang may block generation meanwhile)",
    )
    update_weight_buffer_size: int = opt(
        512 * 1024 * 1024,
        "--update-weight-buffer-size",
        "int",
        ge=1,
        help="bytes of weights per /update_weights_from_distributed call (distributed transport), and per "
        "/update_weights_from_tensor call of a colocated publish after a release (async colocated: one bucket a dtype)",
    )
    seed: int = opt(42, "--rollout-seed", "int", ge=0, help="sampling and data-order seed")
    request_timeout: float = opt(600.0, "--rollout-request-timeout", "float", gt=0, help="seconds per engine request")
    max_retries: int = opt(3, "--rollout-max-retries", "int", ge=0, help="retries of a failed engine request")
    reward_timeout: float = opt(30.0, "--reward-timeout", "float", gt=0, help="seconds per reward call")
    reward_max_retries: int = opt(
        0,
        "--reward-max-retries",
        "int",
        ge=0,
        help="call a reward that raised or timed out again, up to N times per sample (reward/retries_total); "
        "a value that is not a number is not retried",
    )
    agent_max_retries: int = opt(
        0,
        "--agent-max-retries",
        "int",
        ge=0,
        help="run an agent that raised again, up to N times per sample, from where the sample stood "
        "(the failed attempt's tokens are dropped; agent/retries_total)",
    )
    store_batch: int = opt(
        64,
        "--rollout-store-batch",
        "int",
        ge=1,
        help="the most groups one store call admits, or stores as ready or rejected, of those already "
        "waiting (one transaction, one fsync); 1 = one call per group",
    )
    eval_interval: int | None = opt(
        None,
        "--eval-interval",
        "int",
        ge=1,
        help="evaluate on the engines every N steps, inline (sync mode only; async: python -m pipeline.eval)",
    )
    skip_eval_before_train: bool = opt(
        False,
        "--skip-eval-before-train",
        "bool",
        help="with --eval-interval: do not evaluate the starting weights before the first step (slime's flag); "
        "a resumed run never does",
    )
    # Evaluation (issue 31): slime's flags; the set is never mixed into training data.
    eval_prompt_data: tuple[str, ...] = opt(
        (),
        "--eval-prompt-data",
        "strs",
        metavar="NAME PATH",
        default_help="the toy task: 64 toy prompts of another seed, named toy; else required",
        help="evaluation sets, as NAME PATH pairs of JSONL prompt files (--input-key/--label-key, "
        "scored by --custom-rm-path)",
    )
    n_samples_per_eval_prompt: int = opt(
        1, "--n-samples-per-eval-prompt", "int", ge=1, help="responses per eval prompt"
    )
    eval_temperature: float | None = opt(
        None,
        "--eval-temperature",
        "float",
        ge=0,
        default_help="--rollout-temperature",
        help="eval sampling temperature",
    )
    eval_top_p: float | None = opt(
        None, "--eval-top-p", "float", gt=0, default_help="--rollout-top-p", help="eval top-p"
    )
    eval_top_k: int | None = opt(None, "--eval-top-k", "int", default_help="--rollout-top-k", help="eval top-k")
    eval_max_response_len: int | None = opt(
        None,
        "--eval-max-response-len",
        "int",
        ge=1,
        default_help="--rollout-max-response-len",
        help="eval response length cap",
    )
    # Producers on Ray (issue 13): where the generator pool, reward and filter run.
    producers: str = opt(
        "local",
        "--rollout-producers",
        "choice",
        choices=("local", "ray"),
        help="local: generate and score in this process; ray: in one Ray actor per eligible node, "
        "leasing work from this controller's store",
    )
    ray_address: str | None = opt(
        None,
        "--ray-address",
        "str",
        metavar="ADDRESS",
        default_help="start a local Ray cluster",
        help="--rollout-producers ray: join this Ray cluster (e.g. 10.0.0.1:6379 or auto)",
    )
    num_producers: int | None = opt(
        None,
        "--rollout-num-producers",
        "int",
        ge=1,
        default_help="one per alive Ray node with CPUs",
        help="--rollout-producers ray: producer actors, placed round robin over the eligible nodes",
    )
    producer_lease_seconds: float = opt(
        5.0,
        "--producer-lease-seconds",
        "float",
        gt=0,
        help="--rollout-producers ray: a producer's leases expire this long after its last answered heartbeat",
    )
    producer_deadline_seconds: float = opt(
        10.0,
        "--producer-deadline-seconds",
        "float",
        gt=0,
        help="--rollout-producers ray: a producer that does not answer a stop or publish within this is "
        "treated as dead",
    )
    producer_takes_per_second: float = opt(
        100.0,
        "--producer-takes-per-second",
        "float",
        gt=0,
        help="--rollout-producers ray: the controller takes finished groups back from all producers together "
        "at most this often (a Ray call costs it about 1 ms of CPU whatever it carries; a result waits at most "
        "W/this seconds longer); inf: at once",
    )
    producer_mailbox: bool = opt(
        True,
        "--producer-mailbox",
        "bool",
        help="--rollout-producers ray: groups go out and results come back through one mailbox actor on this "
        "node, one Ray call each way for all producers, so the controller's calls do not grow with the producers "
        "(--no-producer-mailbox: calls to each producer, cheaper for one or two)",
    )
    # Per-token payloads (R3, SC), asked of the engine with every request and kept token-aligned
    # through continuations and publishes (`stages.sglang_client.payloads`; the rules: `config/payloads.py`).
    use_rollout_routing_replay: bool = opt(
        False,
        "--use-rollout-routing-replay",
        "bool",
        help="R3: ask the engines for each token's routed experts (return_routed_experts; SGLang needs "
        "--enable-return-routed-experts) and keep them with the sample",
    )
    moe_router_topk: int | None = opt(
        None,
        "--moe-router-topk",
        "int",
        ge=1,
        help="experts per token per MoE layer (the model's top-k); splits the engine's routed-experts rows into layers",
    )
    use_score_centering: bool = opt(
        False,
        "--use-score-centering",
        "bool",
        help="SC: ask the engines for the sampler's top-k per token (top_logprobs_num) and keep them with the sample",
    )
    score_centering_top_k: int | None = opt(
        None, "--score-centering-top-k", "int", ge=1, help="--use-score-centering: candidates kept per token"
    )

    @property
    def resumes_partial_groups(self) -> bool:
        """Whether aborted groups are kept and resumed: always in async mode, by flag in sync mode."""
        return self.mode is RolloutMode.ASYNC or self.partial_rollout
