"""R3 in the built-in engine: the experts each MoE layer's router chose, per position, per forward.

A Hugging Face MoE model (Qwen3-MoE, and the other transformers 5 MoE blocks built the same way)
routes through one router module per sparse layer, `<layer>.mlp.gate`, whose forward returns
`(router_logits, routing_weights, selected_experts)` with `selected_experts` the top-k expert ids
`[tokens, top_k]` of every position the forward read, flattened batch-major. `RouteRecorder` hooks
those modules: while `recording()` is open each router's top-k is kept, and `take()` gives them
stacked as `[tokens, layers, top_k]` int32, the row layout of SGLang's `routed_experts`.

What the engine answers (sglang-protocol.md 1.3): one row per forward position in
`[routed_experts_start_len, prompt_len + completion_len - 1)`. Position p's row is the routing of
the forward that read token p and sampled token p + 1; the request keeps the rows of the forwards
that first read each position (the prefill for the prompt, then one decode step each) and a
re-prefill after a retract adds only the rows it had not (the routes of a token are those of the
forward that sampled it, never a recomputation's). A request resent as `prompt + prefix` after an
abort is a new request: its prefill's rows for the prefix positions are that re-prefill's, which
is why the client keeps its own rows for the prefix (stages/sglang_client/payloads.py).

The hook costs nothing when no request asks (it returns at once), and on a dense model there is
no recorder at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from core.moe_layout import router_modules
from engines.seam import Draw, Row

__all__ = ["RouteRecorder", "fuse_expert_tensors", "rows_bytes", "wants_routes", "with_routes"]


class RouteRecorder:
    """Keeps the top-k expert ids every router of a model chose during the forwards it records."""

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        self.layers = len(routers)
        top_ks = {int(getattr(r, "top_k", 0)) for r in routers}
        if len(top_ks) != 1:
            raise ValueError(f"the MoE layers route to different numbers of experts per token: {sorted(top_ks)}")
        self.top_k = top_ks.pop()
        self._on = False
        self._got: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_hook(self._hook)

    @classmethod
    def attach(cls, model: torch.nn.Module) -> RouteRecorder | None:
        """A recorder on `model`'s routers, or None for a model without MoE layers."""
        routers = router_modules(model)
        return cls(routers) if routers else None

    @property
    def row_bytes(self) -> int:
        return self.layers * self.top_k * 4

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._on:
            self._got.append(output[-1])

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep the routers' choices of the forwards run inside (one forward each time)."""
        self._got, self._on = [], True
        try:
            yield
        finally:
            self._on = False

    def take(self) -> torch.Tensor:
        """The recorded forward's routes, `[tokens, layers, top_k]` int32 on the host."""
        got, self._got = self._got, []
        if len(got) != self.layers:
            raise RuntimeError(f"recorded {len(got)} router calls for a model of {self.layers} MoE layers")
        return torch.stack(got, dim=1).to(device="cpu", dtype=torch.int32)


def rows_bytes(routes: torch.Tensor) -> bytes:
    """`[positions, layers, top_k]` int32 routes as the little-endian bytes of the wire."""
    data: bytes = routes.contiguous().numpy().astype("<i4", copy=False).tobytes()
    return data


def wants_routes(recorder: RouteRecorder | None, rows: Sequence[Row]) -> bool:
    return recorder is not None and any(r.routes_from is not None for r in rows)


def with_routes(draws: Sequence[Draw], rows: Sequence[Row], positions: Sequence[torch.Tensor]) -> list[Draw]:
    """`draws` with each asking row's routes attached: `positions[i]` holds row i's routes of
    positions [0, n) of what the forward read (n = its length, or from where a decode step read)."""
    out = []
    for draw, row, routes in zip(draws, rows, positions, strict=True):
        if row.routes_from is None:
            out.append(draw)
        else:
            # A decode step's routes start at the last position; a prefill's at 0.
            first = len(row.token_ids) - len(routes)
            out.append(replace(draw, routes=rows_bytes(routes[max(0, row.routes_from - first) :])))
    return out


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert MoE weights as the live model's fused ones (transformers 5).

    `save_pretrained` writes `<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight` (the format
    SGLang and the Hub read) while the loaded model holds `experts.gate_up_proj` [E, 2I, H]
    (each expert's gate rows, then its up rows) and `experts.down_proj` [E, H, I]: what
    transformers' own loading converts (`conversion_mapping`, "qwen2_moe"). Other tensors pass
    through; a folder already in the fused form is returned as it is."""
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            per_expert.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
    for prefix, kinds in per_expert.items():

        def stacked(kind: str, prefix: str = prefix, kinds: dict[str, dict[int, torch.Tensor]] = kinds) -> torch.Tensor:
            got = kinds.get(kind, {})
            if sorted(got) != list(range(len(got))) or not got:
                raise ValueError(f"{prefix}: the experts' {kind} tensors are not numbered 0..n-1: {sorted(got)}")
            return torch.stack([got[e] for e in range(len(got))])

        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1)
        out[f"{prefix}.down_proj"] = stacked("down_proj")
    return out
