"""One matmul where a layer makes several on the same input: the q/k/v projections, the MLP's gate/up.

At batch 1 a decode step is bound by its kernels, and on an H200 the matmuls were most of it: a
Qwen3-0.6B step ran seven small matrix-vector products a layer (q, k, v, o, gate, up, down), 1.3
of its 2.2 ms of graph replay, each at a sixth of the memory bandwidth or less (BENCHMARKS.md
section 7). One product over the concatenated weights of the projections that read the same input
reads the same bytes in fewer, larger launches: five a layer instead of seven.

How, without touching the model's code: the weights of a group (q_proj, k_proj, v_proj) are copied
once into one tensor, and each module's `weight` becomes a view of its rows (so a publish, which
copies into the live tensors, updates the fused tensor: the engine re-reads its live weights after
fusing, `ModelRunner.refresh_live_weights`). The first module of the group, called with input x,
computes the fused product and keeps the other modules' slices; a later module called with the
same tensor object x returns its slice, and called with anything else computes its own product,
so a model that calls them in another order or on different inputs gets the same values, only
without the gain. Plain torch (`torch.nn.functional.linear`): every device and dtype.

Opt-in with the engine's `--fuse-ops` (which also compiles the norms and the rotary embedding,
`fused_ops.py`). The fused weights are views of one tensor each, so memory does not grow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["GROUPS", "fuse_projections"]

# Sibling projections read the same input, in the order the layers of the Llama family call them.
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """The fused weight of a group of projections and the slices its first call left for the others."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]) -> None:
        self.weight = weight
        self.bias = bias
        self.sizes = list(sizes)
        self.input: torch.Tensor | None = None
        self.pending: dict[int, torch.Tensor] = {}

    def forward(self, index: int, own: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            if index == 0:
                parts: tuple[torch.Tensor, ...] = torch.nn.functional.linear(x, self.weight, self.bias).split(
                    self.sizes, dim=-1
                )
                self.input, self.pending = x, dict(enumerate(parts[1:], start=1))
                return parts[0]
            if self.input is x and index in self.pending:
                out = self.pending.pop(index)
                if not self.pending:  # every slice handed out: let go of the input
                    self.input = None
                return out
            # Another order or another input: this projection alone.
            return torch.nn.functional.linear(x, own.weight, own.bias)

        return run


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse each group of `GROUPS` found on one module (all `nn.Linear`, same input size, dtype and
    device, all with a bias or none): the number of groups fused. Idempotent."""
    count = 0
    for parent in model.modules():
        for names in GROUPS:
            mods = [getattr(parent, n, None) for n in names]
            if not _fusable(mods):
                continue
            linears: list[torch.nn.Linear] = mods  # type: ignore[assignment]
            with torch.no_grad():
                weight = torch.cat([m.weight for m in linears])
                bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
            sizes = [m.out_features for m in linears]
            group = _Group(weight, bias, sizes)
            start = 0
            for i, m in enumerate(linears):
                m.weight = torch.nn.Parameter(weight[start : start + sizes[i]], requires_grad=m.weight.requires_grad)
                if bias is not None:
                    m.bias = torch.nn.Parameter(bias[start : start + sizes[i]], requires_grad=m.bias.requires_grad)
                start += sizes[i]
                m.forward = group.forward(i, m)  # type: ignore[method-assign,assignment]
                m._fused_group = group  # type: ignore[assignment]  # marks it fused
            count += 1
    return count


def _fusable(mods: Sequence[Any]) -> bool:
    if not all(isinstance(m, torch.nn.Linear) for m in mods):
        return False
    if any(hasattr(m, "_fused_group") for m in mods):  # already fused (a second forward on the model)
        return False
    first = mods[0].weight
    return all(
        m.in_features == mods[0].in_features
        and m.weight.dtype == first.dtype
        and m.weight.device == first.device
        and (m.bias is None) == (mods[0].bias is None)
        for m in mods
    )
