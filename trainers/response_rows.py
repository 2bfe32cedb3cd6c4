"""The trainer's forward, shaped for RL: logits only at the rows that predict response tokens, and
micro-batches of samples of like length.

Why: a causal LM computes logits at every position, and the trainer reads only the response's.
With a real vocabulary (Qwen3: 151,936) the LM head is a large share of a small model's work, and a
right-padded batch of long-tailed responses is mostly prompt and padding: 64 samples padded to 1,152
positions hold about 74k rows where 5-10k predict a response token. A pre-hook on the model's
output embedding keeps only the response rows ([N, H] -> [N, V]); whatever the model applies to
the logits after its head (a scale, a soft cap) is elementwise and still applies. A model whose
forward does not call its output-embedding module (or has none) gets the full logits and the rows
gathered from them: the same values, the old cost.

Micro-batches: sorted by length before they are cut, so each pads to a length near its own, and
cut where a token budget (rows x longest, the padded positions the forward computes) would be
exceeded, slime's `--max-tokens-per-gpu`. Packed (`trainers.packed_attention`), only attention
still works at the padded layout, so the budget keeps counting it: it bounds attention's memory.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from core.types import Sample
from trainers.packed_attention import PackedLayout, packed, positions_within


@dataclass(frozen=True)
class ResponseBatch:
    """Samples laid out for one forward, and for each of the N response tokens (row-major), its
    sample, its position in the response, the flat row of `ids` whose logits predict it, and its id.

    Right-padded: `ids` and `attention` [B, L], `layout` None. Packed (`trainers.packed_attention`):
    `ids` [1, T] with the samples end to end, `attention` all ones, `layout` saying where each
    token sits in the padded layout and its position within its sample."""

    ids: torch.Tensor  # [B, L] or [1, T]
    attention: torch.Tensor  # like ids
    sample: torch.Tensor  # [N]
    position: torch.Tensor  # [N]
    rows: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    layout: PackedLayout | None = None

    @classmethod
    def of(cls, samples: Sequence[Sample], pad_id: int, *, packed: bool = False) -> ResponseBatch:
        """Built on the CPU (the device never waits on a nonzero); `.to(device)` moves it.

        The tokens go into one buffer and every index is computed for the whole batch at once: a
        step lays out each micro-batch for several forwards (the proximal log-probs, the trained
        one, the step-KL check's), and a loop of small tensor ops per sample was about 6 ms of
        host time each for 64 samples, time the device waits through."""
        for s in samples:
            if not s.prompt_ids:
                raise ValueError(f"sample {s.index} has an empty prompt: nothing predicts its first token")
        tokens = array("i")
        for s in samples:
            tokens.extend(s.prompt_ids)
            tokens.extend(s.response_ids)
        flat_tokens = (
            torch.frombuffer(tokens, dtype=torch.int32).to(torch.long) if tokens else torch.empty(0, dtype=torch.long)
        )
        prompt = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
        response = torch.tensor([s.response_len for s in samples], dtype=torch.long)
        lengths = prompt + response
        n_seq = int(lengths.sum()) if packed else int(lengths.max())
        # Where sample i's first token sits: in the concatenated tokens, and in the flat [B * L] or [T].
        source = torch.cumsum(lengths, 0) - lengths
        start = source if packed else torch.arange(len(samples)) * n_seq
        ids = torch.full((1 if packed else len(samples), n_seq), pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        at = torch.repeat_interleave(start, lengths) + positions_within(lengths)
        ids.view(-1)[at] = flat_tokens
        attention.view(-1)[at] = 1
        # Each response token: its sample, its position in the response, the row before it
        # (position p - 1 predicts response token 0), and its id.
        sample = torch.repeat_interleave(torch.arange(len(samples)), response)
        position = positions_within(response)
        rows = torch.repeat_interleave(start + prompt - 1, response) + position
        targets = flat_tokens[torch.repeat_interleave(source + prompt, response) + position]
        layout = PackedLayout.of(lengths.tolist()) if packed else None
        return cls(ids, attention, sample, position, rows, targets, layout)

    def to(self, device: torch.device) -> ResponseBatch:
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "layout"}
        return ResponseBatch(**moved, layout=None if self.layout is None else self.layout.to(device))


def sample_tokens(sample: Sample) -> int:
    """Positions one sample takes in a right-padded forward: its prompt and its response."""
    return len(sample.prompt_ids) + sample.response_len


def micro_batches(
    samples: Sequence[Sample], indices: Sequence[int], *, max_samples: int | None, max_tokens: int | None
) -> list[list[int]]:
    """`indices` (into `samples`) cut into micro-batches: shortest first, at most `max_samples` each
    and at most `max_tokens` padded positions (rows x the longest) each. A sample longer than the
    token budget gets a micro-batch of its own (it cannot be split)."""
    order = sorted(indices, key=lambda i: (sample_tokens(samples[i]), i))
    out: list[list[int]] = []
    for i in order:
        longest = sample_tokens(samples[i])  # ascending: the newcomer is the longest
        if out:
            last = out[-1]
            fits_count = max_samples is None or len(last) < max_samples
            fits_tokens = max_tokens is None or (len(last) + 1) * longest <= max_tokens
            if fits_count and fits_tokens:
                last.append(i)
                continue
        out.append([i])
    return out


@contextlib.contextmanager
def _head_rows(head: torch.nn.Module, positions: torch.Tensor, fired: list[bool]) -> Iterator[None]:
    """While open, `head` sees only the hidden states at `positions` (flat over [B, L]) as [1, N, H]."""

    def pick(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        fired.append(True)
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)[None], *args[1:])

    handle = head.register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


def response_logits(
    net: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor | None,
    positions: torch.Tensor,
    layout: PackedLayout | None = None,
) -> torch.Tensor:
    """[N, V] logits of `net` over `ids` at the flat positions `positions` (b * L + l, or t when
    packed); `attention` None for a right-padded batch, where the causal mask alone keeps pads
    unseen. With `layout`, `ids` is [1, T] packed as it says (`trainers.packed_attention`)."""
    find = getattr(net, "get_output_embeddings", None)
    head = find() if callable(find) else None
    fired: list[bool] = []
    packing: contextlib.AbstractContextManager[dict[str, Any]] = (
        packed(net, layout) if layout is not None else contextlib.nullcontext({})
    )
    with (
        _head_rows(head, positions, fired) if isinstance(head, torch.nn.Module) else contextlib.nullcontext(),
        packing as arguments,
    ):
        extra: dict[str, Any] = dict(arguments)  # packed: the position ids, and the kernel's boundaries
        # No KV cache: a transformers model in train mode still builds one unless told not to, and
        # copies every layer's K and V into it (a `cat` each). Its per-layer slots also made
        # `--trainer-compile` compile each decoder layer anew, so past torch's recompile limit (8)
        # the rest ran eagerly (a 28-layer model: 20 of its layers).
        if getattr(getattr(net, "config", None), "use_cache", None) is not None:
            extra["use_cache"] = False
        logits: torch.Tensor = net(input_ids=ids, attention_mask=attention, **extra).logits
    if len(fired) == 1 and logits.shape[:-1] == (1, positions.numel()):
        return logits[0]
    if fired:
        raise RuntimeError(
            f"{type(net).__name__}'s output embedding ran {len(fired)} time(s) and its logits came back "
            f"shaped {tuple(logits.shape)}, not (1, {positions.numel()}, V): the response rows cannot be "
            "picked before its head"
        )
    return logits.reshape(-1, logits.shape[-1]).index_select(0, positions)
