"""The rules a set of values must follow, checked without touching the outside world.

Bounds come from the schema's field metadata; the rules here relate fields to each other (the
seed's forbidden combinations, each with its rule named) or check a value's form. Nothing here
reads a file, imports a heavy module or rewrites a value: that is `load`'s one named step. Each
problem starts with `--flag=value` (and the TOML location, when the value came from the file).
"""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

from core.types import RolloutMode, StoreTransport
from pipeline.config.draft import Draft
from pipeline.config.experts import expert_parallel_rules
from pipeline.config.fields import options
from pipeline.config.history import history_rules, history_warnings
from pipeline.config.payloads import payload_rules
from pipeline.config.schema import SECTIONS
from stages.continuation import PENALTY_RULE

__all__ = [
    "check_bounds",
    "check_rules",
    "derive_defaults",
    "producer_slots_problem",
    "url_problem",
    "warn_odd_settings",
]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# --max-step-kl's default, nats per token: on the toy task (traced in one process) ordinary steps
# moved the policy 0.005-0.2, the steps after which the reward fell 0.8-7 (BENCHMARKS.md section 12 E).
DEFAULT_MAX_STEP_KL = 0.2


def check_bounds(draft: Draft) -> None:
    """Each value against its own field's metadata: choices, lower bounds, non-empty strings."""
    for section, cls in SECTIONS.items():
        for f, opt in options(cls):
            value = draft.values[section][f.name]
            if value is None or not draft.ok(section, f.name):
                continue
            if opt.choices and value not in opt.choices:
                allowed = ", ".join(opt.choices)
                draft.problems.append(f"{draft.show(section, f.name)}: must be one of {allowed}")
            elif opt.ge is not None and value < opt.ge:
                draft.problems.append(f"{draft.show(section, f.name)}: must be >= {opt.ge:g}")
            elif opt.gt is not None and not value > opt.gt:
                draft.problems.append(f"{draft.show(section, f.name)}: must be > {opt.gt:g}{opt.why}")
            elif opt.kind in ("str", "path") and not str(value).strip():
                draft.problems.append(f"{draft.show(section, f.name)}: must not be empty")


def check_rules(draft: Draft) -> None:
    """The rules between fields, and the forms a bound cannot say."""
    r, get, problem = draft.values["rollout"], draft.get, draft.problems.append
    if draft.ok("rollout", "top_p") and not 0 < r["top_p"] <= 1:
        problem(f"{draft.show('rollout', 'top_p')}: must be in (0, 1]")
    if draft.ok("rollout", "top_k") and r["top_k"] != -1 and r["top_k"] < 1:
        problem(f"{draft.show('rollout', 'top_k')}: must be -1 (off) or >= 1")
    continues = get("rollout", "mode") == RolloutMode.ASYNC or get("rollout", "partial_rollout") is True
    for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
        if continues and draft.ok("rollout", name) and r[name] != neutral:
            mode = "--partial-rollout" if get("rollout", "partial_rollout") else "--rollout-mode=async"
            problem(f"{draft.show('rollout', name)} with {mode}: {PENALTY_RULE}")

    _filter_rules(draft)

    # The seed's forbidden combinations, each with its rule.
    if get("rollout", "mode") == RolloutMode.ASYNC and get("rollout", "eval_interval") is not None:
        problem(
            f"{draft.show('rollout', 'eval_interval')} with --rollout-mode=async: async rollout does "
            "not run inline evaluation; evaluate separately: python -m pipeline.eval --output-dir RUN_DIR "
            "evaluates the saved weights (generation never pauses in async mode, so inline evaluation "
            "would mix policies)"
        )
    if get("rollout", "mode") == RolloutMode.ASYNC and get("data", "rollout_all_samples_process_path"):
        problem(
            f"{draft.show('data', 'rollout_all_samples_process_path')} with --rollout-mode=async: "
            "async rollout does not support --rollout-all-samples-process-path (it has no "
            "round boundary to call it at)"
        )
    if get("storage", "transport") == StoreTransport.LMDB and get("data", "buffer_filter_path"):
        problem(
            f"{draft.show('data', 'buffer_filter_path')} with --rollout-data-transport=lmdb: the LMDB "
            "store has its own durable ordering (complete, then partial, then new; oldest first)"
        )
    if get("data", "prompt_data") is not None and not get("data", "custom_rm_path"):
        problem(
            f"{draft.show('data', 'prompt_data')}: a JSONL prompt file needs "
            "--custom-rm-path (the built-in reward only scores the toy task)"
        )
    _eval_rules(draft)
    _engine_rules(draft)
    _producer_rules(draft)
    _trainer_rules(draft)
    _megatron_rules(draft)
    expert_parallel_rules(draft)
    _sglang_rules(draft)
    _colocate_rules(draft)
    payload_rules(draft)
    history_rules(draft)
    run_id = get("storage", "run_id")
    if run_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", run_id):
        problem(
            f"{draft.show('storage', 'run_id')}: must be letters, digits, '.', '_' or '-', starting "
            "with a letter or digit (it names folders and store keys)"
        )


# The built-in filters that reject every group of one sample (`stages.filter`), by either path form.
_SPREAD_FILTERS = ("stages.filter:reward_std_nonzero", "stages.filter.reward_std_nonzero")


def _filter_rules(draft: Draft) -> None:
    path, n = draft.get("data", "dynamic_sampling_filter_path"), draft.get("rollout", "n_samples_per_prompt")
    if path in _SPREAD_FILTERS and n == 1:
        group_size = draft.show("rollout", "n_samples_per_prompt")
        draft.problems.append(
            f"{draft.show('data', 'dynamic_sampling_filter_path')} with {group_size}: "
            "a group of one has no reward spread, so the filter would reject every group and no batch would fill"
        )


def _eval_rules(draft: Draft) -> None:
    get, problem = draft.get, draft.problems.append
    pairs = get("rollout", "eval_prompt_data") or ()
    shown = draft.show("rollout", "eval_prompt_data") if pairs else ""
    if len(pairs) % 2:
        problem(f"{shown}: must be NAME PATH pairs, got {len(pairs)} values")
    names = list(pairs[0::2])
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            problem(f"{shown}: set name {name!r} must be letters, digits, '.', '_' or '-' (it names metric keys)")
    if len(set(names)) != len(names):
        problem(f"{shown}: set names must be unique, got {names}")
    if pairs and not get("data", "custom_rm_path"):
        problem(f"{shown}: evaluation sets need --custom-rm-path (the built-in reward only scores the toy task)")
    if get("rollout", "eval_interval") is not None and not pairs and get("data", "prompt_data") is not None:
        problem(
            f"{draft.show('rollout', 'eval_interval')} with --prompt-data: name the evaluation sets with "
            "--eval-prompt-data NAME PATH (only the toy task has a built-in held-out set)"
        )


def _trainer_rules(draft: Draft) -> None:
    t, r, ok, problem = draft.values["trainer"], draft.values["rollout"], draft.ok, draft.problems.append
    if not t["use_kl_loss"] and ok("trainer", "kl_loss_coef") and t["kl_loss_coef"] > 0:
        problem(
            f"{draft.show('trainer', 'kl_loss_coef')} without --use-kl-loss: the KL term is off, so the "
            "coefficient would do nothing; add --use-kl-loss"
        )
    if t["backend"] == "megatron" and ok("trainer", "max_step_kl") and (t["max_step_kl"] or 0) > 0:
        problem(
            f"{draft.show('trainer', 'max_step_kl')} with --train-backend megatron: the step-KL check is built "
            "into the torch trainer only; leave it out (megatron runs without it)"
        )
    if not t["use_kl_loss"] and t["ref_load"] is not None:
        problem(
            f"{draft.show('trainer', 'ref_load')} without --use-kl-loss: nothing uses the reference model; "
            "add --use-kl-loss (and --kl-loss-coef)"
        )
    if ok("trainer", "tis_clip_low") and ok("trainer", "tis_clip") and not t["tis_clip_low"] < t["tis_clip"]:
        problem(
            f"{draft.show('trainer', 'tis_clip_low')}: must be below "
            f"{draft.show('trainer', 'tis_clip')} (the weight's bounds)"
        )
    if (
        ok("trainer", "overlong_buffer_len")
        and ok("rollout", "max_response_len")
        and (t["overlong_buffer_len"] > r["max_response_len"])
    ):
        problem(
            f"{draft.show('trainer', 'overlong_buffer_len')}: must be <= "
            f"{draft.show('rollout', 'max_response_len')} (the buffer ends at the cap)"
        )
    batch_ok = ok("rollout", "rollout_batch_size") and ok("rollout", "n_samples_per_prompt")
    if batch_ok and ok("trainer", "global_batch_size") and t["global_batch_size"] is not None:
        samples = r["rollout_batch_size"] * r["n_samples_per_prompt"]
        if t["global_batch_size"] > samples:
            problem(
                f"{draft.show('trainer', 'global_batch_size')}: must be <= the samples of one "
                f"rollout batch ({samples} = --rollout-batch-size x --n-samples-per-prompt)"
            )


def _megatron_rules(draft: Draft) -> None:
    get, show, problem = draft.get, draft.show, draft.problems.append
    parallel = (
        "num_ranks",
        "num_nodes",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
    )
    if get("trainer", "backend") != "megatron":
        for name in parallel:
            if (get("trainer", name) or 1) > 1:
                problem(
                    f"{show('trainer', name)} with --train-backend=torch: the torch trainer is "
                    "one process; add --train-backend megatron"
                )
        for name in ("master_addr", "master_port", "join_timeout"):
            if draft.given("trainer", name):
                draft.warnings.append(f"{show('trainer', name)} without --train-backend megatron: ignored")
        if get("trainer", "use_distributed_optimizer"):
            problem(
                f"{show('trainer', 'use_distributed_optimizer')} with --train-backend=torch: megatron's "
                "distributed optimizer is the megatron backend's; add --train-backend megatron"
            )
        return
    if get("trainer", "trainer_compile"):
        problem(
            f"{show('trainer', 'trainer_compile')} with --train-backend=megatron: it compiles the torch "
            "trainer's layers; megatron-core has its own fusions"
        )
    per_node, nodes = get("trainer", "num_ranks"), get("trainer", "num_nodes")
    tp, pp = get("trainer", "tensor_model_parallel_size"), get("trainer", "pipeline_model_parallel_size")
    ranks = per_node * nodes if per_node and nodes else None
    world = (
        show("trainer", "num_ranks")
        if nodes == 1
        else f"the {ranks} ranks of {show('trainer', 'num_nodes')} x {show('trainer', 'num_ranks')}"
    )
    if ranks and tp and ranks % tp:
        problem(
            f"{show('trainer', 'tensor_model_parallel_size')}: must divide {world} (data parallel = ranks / (TP x PP))"
        )
    elif ranks and tp and pp and ranks % (tp * pp):
        problem(
            f"{show('trainer', 'tensor_model_parallel_size')} x {show('trainer', 'pipeline_model_parallel_size')}: "
            f"must divide {world} (data parallel = ranks / (TP x PP))"
        )
    port = get("trainer", "master_port")
    if port is not None and draft.ok("trainer", "master_port") and port > 65535:
        problem(f"{show('trainer', 'master_port')}: must be a TCP port, 1..65535")
    if nodes and nodes > 1 and port is None:
        problem(
            f"{show('trainer', 'num_nodes')} without --trainer-master-port: the other nodes' ranks must know "
            "the port rank 0 listens on (a free port is picked only for one node)"
        )
    if nodes and nodes > 1 and get("trainer", "master_addr") in _LOOPBACK:
        draft.warnings.append(
            f"{show('trainer', 'num_nodes')} with {show('trainer', 'master_addr')}: only ranks on this host can "
            "reach rank 0; give an address of this host the other nodes reach"
        )
    if get("trainer", "use_distributed_optimizer") and (pp or 1) > 1:
        problem(
            f"{show('trainer', 'use_distributed_optimizer')} with {show('trainer', 'pipeline_model_parallel_size')}: "
            "the pipeline runs its own schedule, without megatron's DDP hooks across stages; "
            "drop one of the two"
        )
    if get("trainer", "use_distributed_optimizer") and get("trainer", "device") == "cpu":
        problem(
            f"{show('trainer', 'use_distributed_optimizer')} with {show('trainer', 'device')}: megatron-core "
            "allocates its DDP buffers on the GPU; use a GPU trainer device or drop the flag"
        )


def _sglang_rules(draft: Draft) -> None:
    get, show, problem = draft.get, draft.show, draft.problems.append
    if get("engine", "launcher") != "sglang":
        for name in ("sglang_devices", "sglang_mem_fraction_static"):
            if name == "sglang_mem_fraction_static" and get("engine", "colocate"):
                continue  # sizes the colocated built-in engine too
            if draft.given("engine", name):
                draft.warnings.append(f"{show('engine', name)} without --rollout-engine sglang: ignored")
        return
    if draft.values["engine"]["urls"] or get("engine", "router_url"):
        problem(
            "--rollout-engine=sglang with --sglang-url/--sglang-router-url: the pipeline starts "
            "engines only when it is given none"
        )
    fraction = get("engine", "sglang_mem_fraction_static")
    if fraction is not None and fraction >= 1:
        problem(f"{show('engine', 'sglang_mem_fraction_static')}: must be in (0, 1)")
    devices = get("engine", "sglang_devices")
    per = get("engine", "gpus_per_engine") or 1
    if devices is not None:
        ids = [d.strip() for d in devices.split(",")]
        if not all(d.isdigit() for d in ids) or len(set(ids)) != len(ids):
            problem(f"{show('engine', 'sglang_devices')}: must be distinct GPU ids separated by commas")
        elif len(ids) % per:
            problem(
                f"{show('engine', 'sglang_devices')}: {len(ids)} GPUs do not split into engines "
                f"of {show('engine', 'gpus_per_engine')}"
            )
        elif draft.given("engine", "num_engines") and get("engine", "num_engines") != len(ids) // per:
            problem(
                f"{show('engine', 'num_engines')}: --sglang-devices makes {len(ids) // per} "
                "engines; leave --rollout-num-engines out"
            )


def _colocate_rules(draft: Draft) -> None:
    """--colocate (slime's): one engine on the torch trainer's GPU, weights by CUDA IPC."""
    get, show, problem = draft.get, draft.show, draft.problems.append
    if not get("engine", "colocate"):
        return
    flag = show("engine", "colocate")
    device = str(get("trainer", "device") or "")
    if not device.startswith("cuda"):
        problem(
            f"{flag} with {show('trainer', 'device')}: colocated means the trainer and the engine share a GPU "
            "(CUDA IPC hands the weights over, the engine's memory is released while the trainer trains); "
            "use --trainer-device cuda (or cuda:N), or drop --colocate on a CPU"
        )
    rollout_device = get("engine", "device")
    if draft.given("engine", "device") and device.startswith("cuda") and rollout_device != device:
        problem(
            f"{flag} with {show('engine', 'device')} and {show('trainer', 'device')}: the engine runs on the "
            "trainer's GPU; leave --rollout-device out (it follows --trainer-device)"
        )
    if get("trainer", "backend") == "megatron":
        problem(
            f"{flag} with --train-backend=megatron: colocating megatron ranks with engines is not built; "
            "use the torch trainer, or --update-weight-transport distributed with engines on their own GPUs"
        )
    if get("rollout", "update_weight_transport") == "distributed":
        problem(
            f"{flag} with {show('rollout', 'update_weight_transport')}: colocated weights go by CUDA IPC "
            "(update_weights_from_tensor); leave --update-weight-transport out"
        )
    urls = get("engine", "urls") or ()
    engines = len(urls) if urls else get("engine", "num_engines")
    if engines is not None and engines > 1:
        problem(
            f"{flag} with {engines} engines: the torch trainer uses one GPU and one engine shares it "
            "(more would each hold the weights again on that GPU); use one engine"
        )
    if get("engine", "launcher") == "sglang" and (get("engine", "gpus_per_engine") or 1) > 1:
        problem(
            f"{flag} with {show('engine', 'gpus_per_engine')}: the engine shares the trainer's one GPU; "
            "use --rollout-num-gpus-per-engine 1"
        )
    if get("engine", "use_fault_tolerance"):
        problem(
            f"{flag} with --use-fault-tolerance: a restarted engine would allocate its weights and KV cache "
            "while the trainer holds the GPU; run colocated without it (an engine fault stops the run, which "
            "resumes from the store)"
        )
    if get("rollout", "overlap_weight_transfer"):
        problem(
            f"{flag} with {show('rollout', 'overlap_weight_transfer')}: an IPC publish writes each bucket into "
            "the live weights, so decoding between buckets would mix versions; leave it out"
        )
    if get("rollout", "producers") == "ray":
        problem(f"{flag} with --rollout-producers=ray: not combined; the engine shares this host's GPU anyway")
    for url in [*urls, *([get("engine", "router_url")] if get("engine", "router_url") else [])]:
        host = urllib.parse.urlsplit(url).hostname
        if host not in _LOOPBACK:
            problem(f"{flag} with --sglang-url={url!r}: a colocated engine runs on this host, on the trainer's GPU")
    fraction = get("engine", "sglang_mem_fraction_static")
    if fraction is not None and draft.ok("engine", "sglang_mem_fraction_static") and fraction >= 1:
        problem(f"{show('engine', 'sglang_mem_fraction_static')}: must be in (0, 1)")


def _engine_rules(draft: Draft) -> None:
    urls = draft.get("engine", "urls") or ()
    for url in urls:
        if reason := url_problem(url):
            draft.problems.append(f"--sglang-url={url!r}: {reason}")
    # Compared as the load step will write them: a trailing slash does not make another engine.
    normalized = [u.rstrip("/") for u in urls]
    for url in sorted({u for u in normalized if normalized.count(u) > 1}):
        draft.problems.append(f"--sglang-url={url!r}: given more than once")
    router = draft.get("engine", "router_url")
    if router and (reason := url_problem(router)):
        draft.problems.append(f"{draft.show('engine', 'router_url')}: {reason}")
    if urls and router:
        draft.problems.append(
            f"{draft.show('engine', 'router_url')} with --sglang-url: pass engine URLs or one router URL, not both"
        )
    # The trainer hosts the weight-update group on loopback: engines elsewhere could never join it.
    if draft.get("rollout", "update_weight_transport") == "distributed":
        for url in [*urls, *([router] if router else [])]:
            host = urllib.parse.urlsplit(url).hostname
            if host not in _LOOPBACK:
                draft.problems.append(
                    f"--update-weight-transport=distributed with --sglang-url={url!r}: the trainer hosts the "
                    "weight-update group on 127.0.0.1, so engines must run on this host (or use disk)"
                )
    live, engines = draft.get("engine", "min_live_engines"), draft.get("engine", "num_engines")
    count = len(urls) if urls else engines
    if draft.get("engine", "use_fault_tolerance") and live is not None and count is not None and live > count:
        draft.problems.append(
            f"{draft.show('engine', 'min_live_engines')}: more than the {count} engines of this "
            "run, so the first fault would stop it"
        )
    if urls and draft.given("engine", "num_engines") and engines not in (None, len(urls)):
        draft.problems.append(
            f"{draft.show('engine', 'num_engines')}: {len(urls)} --sglang-url given; the "
            "engine count is the number of URLs (leave --rollout-num-engines out)"
        )


def producer_slots_problem(concurrency: int, engines: int, producers: int, n_samples: int) -> str | None:
    """Why `producers` Ray producers cannot each get a group slot, or None.

    The K = floor(C*E/G) group slots are split over W producers by quotient and remainder, so every
    producer needs one: C*E >= W*G. Also checked by the launcher once Ray says how many nodes it has."""
    if concurrency * engines >= producers * n_samples:
        return None
    return (
        f"{producers} producers x {n_samples} samples per group = {producers * n_samples} sample slots, but "
        f"--sglang-server-concurrency x engines = {concurrency} x {engines} = {concurrency * engines}: "
        "each producer needs at least one group slot (C*E >= W*G); raise the concurrency or use fewer producers"
    )


def _producer_rules(draft: Draft) -> None:
    get, show, problem = draft.get, draft.show, draft.problems.append
    if get("rollout", "producers") != "ray":
        for name in ("ray_address", "num_producers"):
            if get("rollout", name) is not None:
                problem(f"{show('rollout', name)}: only used with --rollout-producers=ray")
        return
    producers = get("rollout", "num_producers")
    urls = get("engine", "urls") or ()
    engines = len(urls) if urls else get("engine", "num_engines")  # rules run before defaults are derived
    values = [get("engine", "sglang_server_concurrency"), engines, producers]
    if all(isinstance(v, int) for v in values) and isinstance(get("rollout", "n_samples_per_prompt"), int):
        why = producer_slots_problem(values[0], values[1], producers, get("rollout", "n_samples_per_prompt"))
        if why is not None:
            problem(f"{show('rollout', 'num_producers')}: {why}")


def url_problem(url: str) -> str | None:
    """Why `url` is not an engine or router URL, or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        return f"not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http(s)://host:port URL"
    return None


def derive_defaults(draft: Draft) -> None:
    """Fill the defaults that depend on other settings. Skipped where their input is bad."""
    r, e, s, t, o = (draft.values[k] for k in ("rollout", "engine", "storage", "trainer", "output"))
    if o["dir"] is None and draft.ok("storage", "run_id"):
        o["dir"] = Path("runs") / s["run_id"]
    if o["metrics_file"] is None and isinstance(o["dir"], Path):
        o["metrics_file"] = o["dir"] / "metrics.jsonl"
    if s["data_dir"] is None and isinstance(o["dir"], Path):
        s["data_dir"] = o["dir"] / "rollout_data"
    if draft.ok("rollout", "rollout_batch_size"):
        for name in ("over_sampling_batch_size", "prefetch"):
            if r[name] is None:
                r[name] = r["rollout_batch_size"]
    if draft.ok("engine", "urls") and e["urls"]:
        e["num_engines"] = len(e["urls"])
    if e.get("colocate") and not draft.given("engine", "device") and str(t.get("device") or "").startswith("cuda"):
        e["device"] = t["device"]  # the colocated engine runs on the trainer's GPU
    devices = draft.get("engine", "sglang_devices") if e.get("launcher") == "sglang" else None
    if devices is not None and not draft.given("engine", "num_engines"):
        # Each engine takes --rollout-num-gpus-per-engine of the listed GPUs (checked in the rules).
        e["num_engines"] = max(1, len(devices.split(",")) // (e["gpus_per_engine"] or 1))
    batch_ok = draft.ok("rollout", "rollout_batch_size") and draft.ok("rollout", "n_samples_per_prompt")
    if t["global_batch_size"] is None and batch_ok:
        # Two optimizer steps per rollout batch: the second is clipped against the proximal log-probs,
        # which is what keeps off-policy modes from dipping (BENCHMARKS.md section 8). Both backends.
        samples = r["rollout_batch_size"] * r["n_samples_per_prompt"]
        t["global_batch_size"] = max(1, samples // 2)
    if t["use_opsm"] is None and draft.ok("rollout", "mode") and draft.ok("rollout", "partial_rollout"):
        # Where tokens can come from older policies, negative-advantage samples the current policy has
        # already moved away from are dropped (slime's OPSM). Off in plain sync, where mu == pi up to
        # engine/trainer numerics and the mask would act on rounding alone (BENCHMARKS.md section 8).
        # Score centering does not compose with OPSM (slime's rule, config/payloads.py): not derived on.
        off_policy = r["mode"] == RolloutMode.ASYNC or r["partial_rollout"] is True
        t["use_opsm"] = off_policy and r["use_score_centering"] is not True
    if t["micro_batch_size"] is None and draft.ok("trainer", "backend") and t["backend"] == "megatron":
        t["micro_batch_size"] = 8  # megatron packs a micro-batch into one sequence; torch takes the minibatch
    if t["max_step_kl"] is None and draft.ok("trainer", "backend"):
        # The step-KL check (trainers.step_kl) is built into the torch trainer; megatron runs without it.
        t["max_step_kl"] = DEFAULT_MAX_STEP_KL if t["backend"] == "torch" else 0.0
    if t["eps_clip_high"] is None and draft.ok("trainer", "eps_clip"):
        t["eps_clip_high"] = t["eps_clip"]


def warn_odd_settings(draft: Draft) -> None:
    """Settings that are legal but probably unintended; run only on a config without problems."""
    r, d, s = (draft.values[k] for k in ("rollout", "data", "storage"))
    warn = draft.warnings.append
    sync_without_partial = r["mode"] == RolloutMode.SYNC and r["partial_rollout"] is False
    if sync_without_partial and draft.given("rollout", "over_sampling_batch_size"):
        warn(
            f"{draft.show('rollout', 'over_sampling_batch_size')} without --partial-rollout: sync mode does "
            "not abort and resume the groups admitted past the target; add --partial-rollout to keep their "
            "prefixes for the next round"
        )
    if sync_without_partial and r["mask_offpolicy_in_partial_rollout"] is True:
        warn(
            "--mask-offpolicy-in-partial-rollout without --partial-rollout in sync mode: "
            "no sample is ever continued, so nothing is masked"
        )
    if r["min_new_tokens"] and r["min_new_tokens"] >= r["max_response_len"]:
        # Legal (fixed-length generation), but usually a mistake: the engine caps it at the limit.
        warn(
            f"{draft.show('rollout', 'min_new_tokens')} with {draft.show('rollout', 'max_response_len')}: "
            "no sample may stop before the cap, so every sample ends truncated (the toy reward scores "
            "those 0; --mask-truncated-samples would train none)"
        )
    history_warnings(draft)
    if r["n_samples_per_prompt"] == 1:
        warn(
            "--n-samples-per-prompt=1: group-normalized (GRPO) advantages of a group of "
            "one are 0, so nothing is learned"
        )
    if s["transport"] == StoreTransport.MEMORY and draft.given("storage", "data_dir"):
        warn(
            f"{draft.show('storage', 'data_dir')} with --rollout-data-transport=memory: "
            "nothing is stored on disk; add --rollout-data-transport lmdb to use it"
        )
    for name in ("declaration", "profile"):
        if s["transport"] == StoreTransport.MEMORY and draft.given("storage", name):
            warn(
                f"{draft.show('storage', name)} with --rollout-data-transport=memory: "
                "there is no store on disk to declare; it is ignored"
            )
    if d["prompt_data"] is not None and draft.given("data", "num_prompts"):
        warn(
            f"{draft.show('data', 'num_prompts')} with --prompt-data: it sizes only the "
            "built-in toy dataset and is ignored"
        )
    _warn_unbuilt(draft)
    _warn_engines(draft)


def _warn_unbuilt(draft: Draft) -> None:
    # Accepted so slime scripts load and so the seed's forbidden combinations can be named,
    # but not run by this pipeline yet: say so instead of ignoring them in silence.
    r, d, s = (draft.values[k] for k in ("rollout", "data", "storage"))
    for name in ("rollout_all_samples_process_path", "buffer_filter_path"):
        forbidden_here = (name == "rollout_all_samples_process_path" and r["mode"] == RolloutMode.ASYNC) or (
            name == "buffer_filter_path" and s["transport"] == StoreTransport.LMDB
        )
        if d[name] and not forbidden_here:
            draft.warnings.append(
                f"{draft.show('data', name)}: resolved, but this pipeline does not call it "
                "(partial groups are served oldest version first by the store)"
            )


def _warn_engines(draft: Draft) -> None:
    e = draft.values["engine"]
    external = bool(e["urls"]) or bool(e["router_url"])
    if external and e["hf_checkpoint"] is None:
        draft.warnings.append(
            "external engines without --hf-checkpoint: the trainer builds the tiny "
            "model, which must be the model those engines serve"
        )
    if not external and e["host"] not in _LOOPBACK:
        draft.warnings.append(
            f"{draft.show('engine', 'host')}: built-in engines will accept connections from the network"
        )
