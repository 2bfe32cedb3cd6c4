"""The trainer's forward without padding: a batch's samples laid end to end in one row.

Why: a right-padded [B, L] batch of long-tailed samples is mostly padding (on the H200 the 0.6B
step computed 49,152 positions for 26,321 real tokens), and everything a transformer does outside
attention (the projections, the MLP, RMSNorm, rotary, autocast's casts) costs in proportion to the
positions it is given: padding multiplied all of it (docs/benchmarks/16-time-to-target.md). Packed,
the model sees [1, T] with T the real tokens and position ids that restart at 0 for each sample
(rotary encodes each sample's own positions), and only attention, the one place where samples
must not see each other, is laid out per sample. On a GPU in bf16 or fp16 it is one call of
torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`: the samples'
boundaries as cumulative lengths, nothing padded or copied). Elsewhere (a CPU, fp32, a torch
without it) q, k and v are scattered into right-padded [B, L] blocks, attended with SDPA's causal
kernel, and gathered back; the samples go into blocks of like length (`PackedLayout.of`: a block's
attention at most twice its samples' own), so attention pads less than one [B, L] block would.
Either way the rest of the model costs only the real tokens, and the log-probs are the padded
forward's (tests/test_packed_attention.py).

How: transformers' models call attention through a registry keyed by
`config._attn_implementation`. `packed(net, layout)` switches the model to this module's entry for
one forward and restores it after; outside a packed forward the entry is SDPA's, unchanged. It
yields the forward's keyword arguments: the position ids, and where the kernel serves (tried once
per device, dtype and head shape, forward and backward, before a forward relies on it) the
samples' boundaries as tensors and ints that the model hands down to its attention. So the
kernel's call is plain tensor code that `--trainer-compile`'s layer graphs take in whole
(`trainers.layer_compile`); the blocks, which read the layout from a context variable and loop in
Python, run eagerly between two graphs of each layer. A model that does not call attention
through the registry would attend across samples without a word, so the forward notes the calls
and refuses one that made none. Models with sliding-window layers
or soft-capped attention logits are left padded (`packs`): the causal kernel alone is not their
attention; so is a model under gradient checkpointing, whose backward would run attention again
outside the packed forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PACKED_ATTENTION", "PackedLayout", "packed", "packs", "positions_within"]

log = logging.getLogger(__name__)
_refused: list[str] = []  # why the variable-length kernel failed, once a process

PACKED_ATTENTION = "rl_packed"


@dataclass(frozen=True)
class PackedLayout:
    """A packed row of T tokens, samples of `lengths` end to end: each token's position within its
    sample (`position_ids`, [1, T]), where each sample starts (`starts`, [B + 1] int32, the
    variable-length kernel's cumulative lengths) and its place in attention's padded blocks
    (`scatter`, [T], flat over the blocks one after another). `blocks` holds each block's
    (samples, width)."""

    lengths: tuple[int, ...]
    scatter: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [1, T] long
    blocks: tuple[tuple[int, int], ...]
    starts: torch.Tensor  # [B + 1] int32: 0, then each sample's end

    SLACK = 2  # a block's attention (samples x width^2) at most this many times its samples' own

    @classmethod
    def of(cls, lengths: Sequence[int]) -> PackedLayout:
        """The layout of samples of `lengths` tokens each, in that order. Blocks are runs of
        consecutive samples (sorted samples make the fewest), each cut before a sample that would
        take its causal attention's work (samples x width^2, what the kernel computes on the padded
        block) past `SLACK` x its samples' own (the sum of their lengths squared). Sorted lengths
        then span about a factor 2.7 a block: 1 to 1,280 tokens in 7 or 8 blocks."""
        blocks: list[list[int]] = []
        own = widest = 0  # the last block's sum of squared lengths, and its longest
        for n in lengths:
            if blocks and (len(blocks[-1]) + 1) * max(widest, n) ** 2 <= cls.SLACK * (own + n * n):
                blocks[-1].append(n)
                own, widest = own + n * n, max(widest, n)
            else:
                blocks.append([n])
                own, widest = n * n, n
        first: list[int] = []  # each sample's first place in the blocks, flat one after another
        offset = 0
        for block in blocks:
            width = max(block)
            first.extend(offset + b * width for b in range(len(block)))
            offset += len(block) * width
        # Whole-row tensor ops, not a few small ones per sample: each forward lays out its batch.
        sizes = torch.tensor(lengths, dtype=torch.long)
        within = positions_within(sizes)
        scatter = torch.repeat_interleave(torch.tensor(first, dtype=torch.long), sizes) + within
        shape = tuple((len(block), max(block)) for block in blocks)
        starts = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return cls(tuple(lengths), scatter, within[None], shape, starts)

    def padded_rows(self) -> torch.Tensor:
        """[T]: each token's flat place b * L + l in one right-padded [B, L] batch of these samples."""
        sizes = torch.tensor(self.lengths, dtype=torch.long)
        return torch.repeat_interleave(torch.arange(len(sizes)) * int(sizes.max()), sizes) + positions_within(sizes)

    def to(self, device: torch.device) -> PackedLayout:
        return dataclasses.replace(
            self,
            scatter=self.scatter.to(device),
            position_ids=self.position_ids.to(device),
            starts=self.starts.to(device),
        )


def positions_within(lengths: torch.Tensor) -> torch.Tensor:
    """[sum(lengths)]: each item's place within its run, for runs of `lengths` (long) end to end:
    0, 1, ..., n0 - 1, 0, 1, ..., n1 - 1, ..."""
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)


@dataclass
class _Active:
    layout: PackedLayout
    calls: int = 0


_active: ContextVar[_Active | None] = ContextVar("packed_layout", default=None)

_KERNEL = "rl_packed_kernel"  # the forward's keyword arguments that reach the kernel's path
_STARTS = "rl_packed_starts"
_LONGEST = "rl_packed_longest"


@dataclass(eq=False)
class _Kernel:
    """What the kernel's path reads besides tensors: the kernel and the dtype it computes in
    (fixed for a trainer, so a compiled graph guards on them once); `called` is set, never read,
    by each call (a compiled graph replays the store after it runs, and does not recompile for
    it: a count read and written would be guarded on and recompile every forward)."""

    kernel: Callable[..., Any]
    dtype: torch.dtype
    called: bool = False


def packs(net: torch.nn.Module) -> bool:
    """Whether `net`'s forward can run packed: its attention goes through transformers' registry,
    every layer's attention is plain causal (no sliding window, no soft cap), and no layer runs its
    forward again in the backward (gradient checkpointing would, after `packed` has closed)."""
    config = getattr(net, "config", None)
    if config is None or not getattr(net, "_supports_attention_backend", False):
        return False
    if any(getattr(m, "gradient_checkpointing", False) is True for m in net.modules()):
        return False  # transformers' own test, in every 5.x (its property's name changed)
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return False
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return False
    return getattr(config, "attn_logit_softcapping", None) is None


@contextlib.contextmanager
def packed(net: torch.nn.Module, layout: PackedLayout) -> Iterator[dict[str, Any]]:
    """While open, `net`'s attention treats its [1, T] input as the samples of `layout`. Yields
    the keyword arguments to call `net` with: the position ids, and where the variable-length
    kernel serves, the samples' boundaries for it (a forward without them attends in blocks)."""
    _register()
    config: Any = getattr(net, "config")  # noqa: B009 (a Module attribute mypy cannot see)
    before = config._attn_implementation
    state = _Active(layout)
    arguments: dict[str, Any] = {"position_ids": layout.position_ids}
    kernel = _kernel_for(net, layout)
    if kernel is not None:
        arguments |= {_KERNEL: kernel, _STARTS: layout.starts, _LONGEST: max(layout.lengths)}
    token = _active.set(state)
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield arguments
    finally:
        config._attn_implementation = before
        _active.reset(token)
    if state.calls == 0 and not (kernel is not None and kernel.called):
        raise RuntimeError(
            f"{type(net).__name__} ran a packed forward without calling attention through transformers' "
            "registry: its samples could have attended to each other (pass pack=False to the trainer)"
        )


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [1, Hq, T, D], k and v [1, Hkv, T, D]; returns
    [1, T, Hq, D]. The mask is ignored when packed: the causal kernel over the samples'
    boundaries (or over the padded blocks) is the whole of the mask. Traced whole by a compiled
    layer where the forward brought the kernel's arguments; the rest goes to `_outside_graphs`."""
    kernel: _Kernel | None = kwargs.get(_KERNEL)
    if kernel is None or kwargs.get("dropout"):  # the flash kernel takes no dropout: the blocks do
        blocks: tuple[torch.Tensor, None] = _outside_graphs(module, query, key, value, attention_mask, **kwargs)
        return blocks
    _refuse_unpackable(module, kwargs)
    kernel.called = True
    # [T, H, D] each, the samples' boundaries in `starts`: no padding, no scatter or gather. Under
    # autocast q and k can come out of a model's fp32 norm weights (Qwen3's q_norm and k_norm)
    # while v is bf16: SDPA, on autocast's list, casts all three; so does this.
    q, k, v = (x[0].transpose(0, 1).to(kernel.dtype) for x in (query, key, value))
    starts, longest = kwargs[_STARTS], kwargs[_LONGEST]
    out = kernel.kernel(q, k, v, starts, starts, longest, longest, scale=kwargs.get("scaling"))
    return out[None], None


def _refuse_unpackable(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Both paths' rule: the causal kernel over the samples' boundaries is not the attention of a
    sliding window or of soft-capped logits (`packs` keeps such models padded)."""
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or kwargs.get("softcap"):
        raise ValueError(f"{type(module).__name__}: a sliding window or soft cap cannot run packed")


def _blocks(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention in right-padded blocks of like length (`_attention`'s shapes), or SDPA's outside a
    packed forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = _active.get()
    if state is None:  # a forward outside `packed` (none should reach here, but SDPA is the default)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    _refuse_unpackable(module, kwargs)
    state.calls += 1
    layout = state.layout
    blocks = _unpack(query, layout), _unpack(key, layout), _unpack(value, layout)
    outs = []
    for q, k, v in zip(*blocks, strict=True):
        out, _ = sdpa_attention_forward(
            module, q, k, v, None, dropout=kwargs.get("dropout", 0.0), scaling=kwargs.get("scaling"), is_causal=True
        )  # [B, L, Hq, D]
        outs.append(out.reshape(-1, *out.shape[2:]))
    return torch.cat(outs).index_select(0, layout.scatter)[None], None


# A compiled layer runs the blocks eagerly between its graphs: they read a context variable and
# loop over the layout's blocks in Python.
_outside_graphs = torch.compiler.disable(_blocks)  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def _kernel_for(net: torch.nn.Module, layout: PackedLayout) -> _Kernel | None:
    """The variable-length kernel for `net`'s packed forward, or None where the blocks serve: off
    a GPU, in fp32 (the kernel is flash attention's, half precision only), on a torch without it,
    or where it failed its trial (once a process, said once)."""
    if layout.starts.device.type != "cuda":
        return None
    dtype = _compute_dtype(net, layout.starts.device)
    kernel = _varlen_kernel()
    if kernel is None or dtype not in (torch.float16, torch.bfloat16):
        return None
    config: Any = getattr(net, "config")  # noqa: B009 (a Module attribute mypy cannot see)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if not _tried(kernel, layout.starts.device, dtype, heads, kv_heads, head_dim):
        return None
    return _Kernel(kernel, dtype)


def _compute_dtype(net: torch.nn.Module, device: torch.device) -> torch.dtype | None:
    """The dtype attention computes in: autocast's where it is on, else the weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    weight = next((p for p in net.parameters() if p.is_floating_point()), None)
    return None if weight is None else weight.dtype


_trials: dict[tuple[Any, ...], bool] = {}


def _tried(
    kernel: Callable[..., Any], device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether the kernel runs forward and backward at these heads on `device`: a backend may lack
    it (torch picks cuDNN's on some cards) or take other keywords than `_varlen_partial` knows.
    Tried once, eagerly, since inside a compiled graph a refusal could not fall back."""
    trial = (kernel, device, dtype, heads, kv_heads, head_dim)
    if trial not in _trials:
        try:
            with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
                # Ones, not random numbers: a trial must not move the device's random state (the
                # base model's build is deterministic, and a run's sampling too).
                q = torch.ones(7, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
                k, v = (torch.ones(7, kv_heads, head_dim, device=device, dtype=dtype) for _ in "kv")
                starts = torch.tensor([0, 3, 7], device=device, dtype=torch.int32)
                kernel(q, k, v, starts, starts, 4, 4, scale=None).float().sum().backward()
            _trials[trial] = True
        except (RuntimeError, ValueError, TypeError) as exc:
            _refused.append(f"{type(exc).__name__}: {exc}")
            log.warning("variable-length attention refused (%s); the trainer attends in padded blocks", exc)
            _trials[trial] = False
    return _trials[trial]


def _varlen_kernel() -> Callable[..., Any] | None:
    """torch's causal variable-length flash attention with grouped-query heads, or None where this
    torch has none, or where it failed once in this process."""
    return None if _refused else _varlen_partial()


@functools.cache
def _varlen_partial() -> Callable[..., Any] | None:
    """Its keywords moved between releases: 2.10 took `is_causal`, later ones take a window
    (`(-1, 0)`: all earlier tokens, none later) and refuse fewer K/V heads than query heads unless
    `enable_gqa` (the flash kernel shares each K/V head among its group either way)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    takes = inspect.signature(varlen_attn).parameters
    fixed: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
    if "enable_gqa" in takes:
        fixed["enable_gqa"] = True
    return functools.partial(varlen_attn, **fixed)


def _unpack(x: torch.Tensor, layout: PackedLayout) -> list[torch.Tensor]:
    """[1, H, T, D] packed -> one [B, H, L, D] right-padded block per `layout.blocks`, zeros at the
    pads (they sit after each sample's last token, where the causal mask keeps real queries away)."""
    tokens = x[0].transpose(0, 1)  # [T, H, D]
    area = sum(b * w for b, w in layout.blocks)
    padded = tokens.new_zeros(area, *tokens.shape[1:]).index_copy(0, layout.scatter, tokens)
    parts = padded.split([b * w for b, w in layout.blocks])
    return [
        part.view(b, w, *tokens.shape[1:]).transpose(1, 2) for part, (b, w) in zip(parts, layout.blocks, strict=True)
    ]


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask when packed (the attention above needs none); SDPA's otherwise."""
    if _active.get() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


@functools.cache  # once a process
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _mask)
