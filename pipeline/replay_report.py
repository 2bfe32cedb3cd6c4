"""What `python -m pipeline.replay` prints: a run's store summarised, and one group in full.

Pure functions over a `Store` (opened read-only by the caller) and plain data; nothing here
writes. The summary is computed once into a frozen `RunSummary`, then formatted, so tests can
check numbers without parsing text.

Versions and staleness follow the store's own definitions: a group's version is its oldest token
version (`Group.oldest_version`, the admission version while it has no tokens), and the batch of
step `s` was trained by policy version `s`, so its groups' staleness is `s - oldest_version`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import CorruptRecordError
from core.types import Batch, Group, Sample
from stages.selection import SKIP_REASON, predicted_length
from storage import Cursor, GroupState, PromptHistory, RunMeta, Store

__all__ = [
    "RunSummary",
    "format_group",
    "format_history",
    "format_summary",
    "group_record",
    "recorded_batches",
    "summarize",
]

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class RunSummary:
    store_path: str
    meta: RunMeta | None
    cursor: Cursor
    trained_step: int
    counts: Mapping[GroupState, int]
    admitted_versions: Mapping[int, int]  # admission version -> groups
    token_versions: Mapping[int, int]  # policy version -> response tokens, over every stored sample
    staleness: Mapping[int, int]  # staleness -> groups, over the batches of trained steps
    open_batches: tuple[int, ...]  # steps taken but not finished (BATCHED groups)
    partial_groups: int
    partial_prefix_lens: Mapping[int, int]  # prefix length -> samples of PARTIAL groups
    partial_finished_samples: int  # samples of PARTIAL groups that already finished
    partial_samples: int
    resumed_samples: int  # samples, in any state, continued at least once after an abort
    collected: int = 0  # TRAINED groups deleted by garbage collection (--rollout-gc-keep-steps)
    collected_step: int = -1  # the last step garbage collection covered; its batches are gone
    damaged: tuple[str, ...] = ()  # records that failed their checksum: reported, left out of the numbers
    rejected_reasons: Mapping[str, int] = field(default_factory=dict)  # REJECTED groups by reason, skips included
    skipped_by_epoch: Mapping[int, int] = field(default_factory=dict)  # prompts skipped before generation


def recorded_batches(store: Store, damaged: list[CorruptRecordError] | None = None) -> Iterator[Batch]:
    """Every recorded batch in step order: the trained ones, then any taken but not finished.

    Steps finish in order and batches are taken in order, so the first missing step ends the list.
    Garbage collection deletes the batches of the oldest steps, so the list starts after them.
    With `damaged`, a damaged group is listed there and left out of its batch.
    """
    step = store.statistics().collected_step + 1
    while (batch := store.batch(step, damaged=damaged)) is not None:
        yield batch
        step += 1


def summarize(store: Store, *, store_path: str) -> RunSummary:
    stats = store.statistics()
    admitted: Counter[int] = Counter()
    tokens: Counter[int] = Counter()
    prefix_lens: Counter[int] = Counter()
    partial_groups = partial_samples = partial_finished = resumed = 0
    reasons: Counter[str] = Counter()
    skipped: Counter[int] = Counter()
    damaged: list[CorruptRecordError] = []
    for state in GroupState:
        if state is GroupState.QUARANTINED:
            continue  # their records are damaged by definition: counted, never decoded
        for group in store.groups(state, damaged=damaged):
            admitted[group.admitted_version] += 1
            for sample in group.samples:
                for span in sample.spans:
                    tokens[span.version] += span.end - span.start
                resumed += bool(sample.resumed_at)
            if state is GroupState.REJECTED:
                reasons[group.rejected_reason or "rejected"] += 1
                if group.rejected_reason == SKIP_REASON:
                    skipped[group.epoch] += 1
            if state is GroupState.PARTIAL:
                partial_groups += 1
                for sample in group.samples:
                    partial_samples += 1
                    prefix_lens[sample.response_len] += 1
                    partial_finished += sample.status.finished
    staleness: Counter[int] = Counter()
    open_batches = []
    for batch in recorded_batches(store, damaged):
        if batch.step > stats.trained_step:
            open_batches.append(batch.step)
            continue
        for group in batch.groups:
            staleness[batch.step - group.oldest_version] += 1
    return RunSummary(
        store_path=store_path,
        meta=store.read_meta(),
        cursor=stats.cursor,
        trained_step=stats.trained_step,
        counts=dict(stats.counts),
        admitted_versions=dict(sorted(admitted.items())),
        token_versions=dict(sorted(tokens.items())),
        staleness=dict(sorted(staleness.items())),
        open_batches=tuple(open_batches),
        partial_groups=partial_groups,
        partial_prefix_lens=dict(sorted(prefix_lens.items())),
        partial_finished_samples=partial_finished,
        partial_samples=partial_samples,
        resumed_samples=resumed,
        collected=stats.collected,
        collected_step=stats.collected_step,
        damaged=tuple(dict.fromkeys(str(exc) for exc in damaged)),
        rejected_reasons=dict(sorted(reasons.items())),
        skipped_by_epoch=dict(sorted(skipped.items())),
    )


def format_summary(s: RunSummary) -> str:
    lines = [f"store: {s.store_path}"]
    if s.meta is None:
        lines.append("run meta: none recorded")
    else:
        m = s.meta
        lines.append(
            f"run meta: run_id={m.run_id} dataset={m.dataset_fingerprint} tokenizer={m.tokenizer_fingerprint} "
            f"n_samples_per_prompt={m.n_samples_per_prompt} schema={m.schema_version}"
        )
        rollout = m.extra.get("config", {}).get("rollout", {})
        if rollout:
            shown = ("mode", "partial_rollout", "rollout_batch_size", "over_sampling_batch_size", "max_staleness")
            lines.append("rollout: " + " ".join(f"{k}={rollout[k]}" for k in shown if k in rollout))
        # Settings a resume changed (accepted and recorded by the launcher): both values, and
        # the first step trained with the new one; the lines above show the values now in force.
        for change in m.extra.get("config_changes", ()):
            lines.append(
                f"setting changed from step {change['step']}: {change['setting']} "
                f"{change['from']!r} -> {change['to']!r}"
            )
    c = s.cursor
    lines.append(f"cursor: epoch={c.epoch} index={c.index} next_seq={c.next_seq}")
    lines.append(f"trained step: {s.trained_step} ({s.trained_step + 1} steps trained)")
    salvaged = (s.meta.extra.get("salvaged_from") if s.meta is not None else None) or {}
    if salvaged:
        # A fresh store seeded from a damaged one starts at its trained step: the batches and
        # groups of the steps before are not lost, they are in the store moved aside.
        lines.append(
            f"salvaged: steps 0..{salvaged['trained_step']} were trained before this store was seeded from a "
            f"damaged one; their batches and groups are in the moved-aside store {salvaged['store']}"
        )
    if s.collected_step >= 0 and not (salvaged and s.collected == 0):
        lines.append(
            f"garbage collected: {s.collected} trained groups and the batches of steps 0..{s.collected_step}"
            " (not in this summary)"
        )
    if s.open_batches:
        lines.append(f"batches taken, not trained: steps {', '.join(map(str, s.open_batches))}")
    total = sum(s.counts.values())
    lines.append(f"groups: {total} in all")
    lines += [f"  {state.value:<9} {s.counts.get(state, 0)}" for state in GroupState]
    if s.rejected_reasons:
        lines.append("rejected groups by reason: " + ", ".join(f"{r} {n}" for r, n in s.rejected_reasons.items()))
    if s.skipped_by_epoch:
        # The epoch's accounting of --skip-zero-std-prompts: each is a REJECTED group without tokens.
        lines.append(
            f"prompts skipped before generation ({SKIP_REASON}: their latest groups all had equal rewards), "
            f"by epoch: {_histogram(s.skipped_by_epoch, 'e')}"
        )
    lines.append("versions:")
    lines.append(f"  admitted at (version: groups)      {_histogram(s.admitted_versions, 'v')}")
    lines.append(f"  response tokens (version: tokens)  {_histogram(s.token_versions, 'v')}")
    lines.append(f"staleness of trained groups (steps behind: groups): {_histogram(s.staleness, '')}")
    if s.staleness:
        lines.append(f"  max {max(s.staleness)}, mean {_weighted_mean(s.staleness):.2f}")
    lines.append(f"partial groups: {s.partial_groups}")
    if s.partial_groups:
        lines.append(
            f"  samples: {s.partial_samples}, already finished: {s.partial_finished_samples}, "
            f"tokens kept: {sum(n * k for n, k in s.partial_prefix_lens.items())}"
        )
        lines.append(f"  prefix lengths (tokens: samples) {_histogram(s.partial_prefix_lens, '')}")
    lines.append(f"samples continued after an abort: {s.resumed_samples}")
    quarantined = s.counts.get(GroupState.QUARANTINED, 0)
    if s.damaged or quarantined:
        lines.append(
            f"damaged: {len(s.damaged)} records fail their checksum (left out of the numbers above), "
            f"{quarantined} groups quarantined; `verify` checks every record"
        )
        lines += [f"  {d}" for d in s.damaged]
    return "\n".join(lines)


def group_record(state: GroupState, group: Group, decode: Decode | None) -> dict[str, Any]:
    """One group as JSON-able data; `decode` (the run's tokenizer) adds prompt and response text."""
    task = group.task
    record: dict[str, Any] = {
        "group_id": group.group_id,
        "state": state.value,
        "epoch": group.epoch,
        "seq": group.seq,
        "admitted_version": group.admitted_version,
        "oldest_version": group.oldest_version,
        "rejected_reason": group.rejected_reason,
        "task": {"index": task.index, "label": task.label, "metadata": dict(task.metadata)},
        "prompt_ids": list(task.prompt_ids),
        "prompt_text": decode(task.prompt_ids) if decode else None,
        "samples": [],
    }
    for s in group.samples:
        record["samples"].append(
            {
                "index": s.index,
                "status": s.status.value,
                "finish_reason": s.finish_reason.value if s.finish_reason else None,
                "reward": s.reward,
                "response_len": s.response_len,
                "spans": [[span.start, span.end, span.version] for span in s.spans],
                "resumed_at": list(s.resumed_at),
                "error": s.error,
                "response_ids": list(s.response_ids),
                "response_text": decode(s.response_ids) if decode else None,
                **_payloads_record(s),
            }
        )
    return record


def _payloads_record(s: Sample) -> dict[str, Any]:
    # Only where a sample has them, so records of runs without R3/SC read as before. The decode
    # that built `s` already checked them: one row per token, whole rows (else the record is damaged).
    out: dict[str, Any] = {}
    if s.routes is not None:
        out["routed_experts"] = {
            "layers": s.routes.layers,
            "top_k": s.routes.top_k,
            "rows": len(s.routes),
            "bytes_per_id": s.routes.itemsize,
            "unrouted_tokens": s.routes.unrouted_rows(),
            "experts": s.routes.as_ids().tolist(),  # NO_ROUTE (-1) where none was recorded
        }
    if s.heads is not None:
        out["sampler_heads"] = {
            "k": s.heads.k,
            "rows": len(s.heads),
            "token_ids": s.heads.token_ids_view().tolist() if len(s.heads) else [],
            "logprobs": s.heads.logprobs_view().tolist() if len(s.heads) else [],
        }
    return out


def format_group(r: Mapping[str, Any]) -> str:
    lines = [
        f"group {r['group_id']}: {r['state']}",
        f"  epoch={r['epoch']} seq={r['seq']} admitted_version={r['admitted_version']} "
        f"oldest_version={r['oldest_version']}",
        f"  task index={r['task']['index']} label={r['task']['label']!r}",
    ]
    if r["rejected_reason"]:
        lines.append(f"  rejected: {r['rejected_reason']}")
    # Text is shown quoted (newlines and padding visible); without a tokenizer, the token ids.
    shown = repr(r["prompt_text"]) if r["prompt_text"] is not None else f"<ids> {r['prompt_ids']}"
    lines.append(f"  prompt: {shown}")
    for s in r["samples"]:
        spans = " ".join(f"[{a},{b})@v{v}" for a, b, v in s["spans"]) or "-"
        lines.append(
            f"  sample {s['index']}: {s['status']} finish={s['finish_reason']} reward={s['reward']} "
            f"len={s['response_len']} spans={spans} resumed_at={s['resumed_at']}"
        )
        if s["error"]:
            lines.append(f"    error: {s['error']}")
        if "routed_experts" in s:
            r3 = s["routed_experts"]
            first = f"; token 0: {r3['experts'][0]}" if r3["experts"] else ""
            lines.append(
                f"    R3: {r3['rows']} tokens x {r3['layers']} layers x top-{r3['top_k']}, "
                f"{r3['unrouted_tokens']} unrouted{first}"
            )
        if "sampler_heads" in s:
            sc = s["sampler_heads"]
            head = zip(sc["token_ids"][0], sc["logprobs"][0], strict=True) if sc["token_ids"] else ()
            first = ("; token 0: " + " ".join(f"{t}:{lp:.3f}" for t, lp in head)) if sc["token_ids"] else ""
            lines.append(f"    SC: {sc['rows']} tokens x top-{sc['k']}{first}")
        if s["response_text"] is not None:
            lines.append(f"    response: {s['response_text']!r}")
    return "\n".join(lines)


def format_history(history: PromptHistory | None) -> str:
    """A prompt's stored history (`storage.history`), as `replay group ROW` prints it."""
    if history is None:
        return "history: none stored (no group of this prompt finished with its rewards)"
    length = predicted_length(history)
    recent = "; ".join(
        f"e{o.epoch} v{o.version} reward {o.reward_mean:.3f}{' (all equal)' if o.zero_std else ''} "
        f"len {o.length_mean:.1f} (max {o.length_max})"
        for o in history.recent
    )
    return (
        f"history: {history.groups} groups finished, zero-variance streak {history.zero_std_streak}, "
        f"predicted length {'-' if length is None else f'{length:.1f}'}; latest: {recent}"
    )


def _histogram(counts: Mapping[int, int], prefix: str) -> str:
    return "  ".join(f"{prefix}{k}: {n}" for k, n in counts.items()) or "-"


def _weighted_mean(counts: Mapping[int, int]) -> float:
    n = sum(counts.values())
    return sum(k * v for k, v in counts.items()) / n if n else 0.0
