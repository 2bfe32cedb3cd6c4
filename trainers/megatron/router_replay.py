"""R3 in the megatron trainer: its MoE layers route each response token to the experts the engine chose.

`--use-rollout-routing-replay`, the megatron side of `trainers/routing_replay.py` (which says
what is replayed and why). It goes through megatron-core's `RouterReplay`: every `TopKRouter`
asks its `router_replay` for the top k (`topk_routing_with_score_function`), and under the
`REPLAY_FORWARD` action the replay hands back stored indices with the router's current scores
at them, so the gate weights keep their gradient. Stock 0.16.1 replays a whole forward's indices,
one row per token; a rollout has routes only for the positions that sampled response tokens (the
prompt's, the last token's and environment tokens' positions have none). `PartialRouterReplay`
is that `RouterReplay` with one change: a position whose stored row is -1 keeps the router's own
top k, as the torch trainer's hook does. Its recording (`RECORD`) and the backward replay
(`REPLAY_BACKWARD`, for activation recomputation, which this trainer does not use) are stock.

Each model (the policy, the reference) has its own instances, one per MoE layer, not
megatron's process-wide list (`RouterReplay.global_router_replay_instances`), which would mix
the two models' layers. A packed micro-batch's plan is `[S, layers, top_k]` over its packed
positions (`plan`), and each router reads its global layer's column (pipeline stages hold a slice
of the layers). The policy forward of a step, the proximal and the reference log-probs all run
under the same plan. Under expert parallel nothing changes: each rank's routers route its own
tokens before the token dispatcher moves them, and a route is a global expert id on every rank.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from core.columns import TokenRoutes
from trainers.megatron.rows import Row

__all__ = ["PartialRouterReplay", "ReplayedRouters", "plan"]


class PartialRouterReplay(RouterReplay):  # type: ignore[misc]  # megatron-core is untyped
    """megatron's `RouterReplay` for one layer, where a stored row of -1 keeps the router's choice."""

    def __init__(self) -> None:
        # Not super().__init__(): that registers the instance in the process-wide list (module docstring).
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx: torch.Tensor | None = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list: list[torch.Tensor] = []

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.router_replay_action is not RouterReplayAction.REPLAY_FORWARD or self.target_topk_idx is None:
            stock: tuple[torch.Tensor, torch.Tensor] = super().get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
            return stock
        assert default_compute_topk is not None  # megatron's caller always passes its own top k
        stored = self.target_topk_idx.to(scores.device)
        if stored.shape != (scores.shape[0], topk):
            raise ValueError(
                f"routing replay: {tuple(stored.shape)} stored routes for a router that routes "
                f"{(scores.shape[0], topk)} (tokens, top k)"
            )
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        indices = torch.where((stored >= 0).all(dim=-1, keepdim=True), stored, own)
        return scores.gather(1, indices), indices


class ReplayedRouters:
    """The `PartialRouterReplay` of every MoE layer of one megatron model (this stage's layers)."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner: Any = getattr(model, "module", model)
        layers: Any = inner.decoder.layers
        self._by_layer: list[tuple[int, PartialRouterReplay]] = []
        for layer in layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            if not hasattr(router, "router_replay"):  # megatron-core before RouterReplay (0.16)
                raise ValueError(
                    "--use-rollout-routing-replay: this megatron-core's TopKRouter has no router_replay "
                    "(RouterReplay came with megatron-core 0.16)"
                )
            # Set here, not with `moe_enable_routing_replay`, which would also register it process-wide.
            router.router_replay = PartialRouterReplay()
            self._by_layer.append((layer.layer_number - 1, router.router_replay))
        if not self._by_layer:
            raise ValueError(
                "--use-rollout-routing-replay: the model has no MoE layers (no routers) to replay routes in"
            )

    @contextmanager
    def replaying(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Forwards inside route packed position n of global layer l to `routes[n, l]` (-1: the
        router's own choice); None replays nothing."""
        if routes is None:
            yield
            return
        for layer, replay in self._by_layer:
            replay.target_topk_idx = routes[:, layer]  # not set_target_indices: no backward list kept
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for _, replay in self._by_layer:
                replay.clear_router_replay_action()
                replay.clear_indices()


def plan(
    rows: Sequence[Row], *, layers: int, top_k: int, device: torch.device, length: int | None = None
) -> torch.Tensor | None:
    """The routes of one packed micro-batch (`packing.pack`'s order): [S, layers, top_k] long, -1
    where the router's own choice stands; None when no row carries routes. `length`: the packed
    sequence's, when `pack` padded it (the padding keeps the router's own choice).

    Response token t of a row whose prompt has p tokens, packed from offset o, sits at o + p + t
    and was sampled by the forward that read o + p - 1 + t: its row goes there."""
    if all(r.routes is None for r in rows):
        return None
    total = max(sum(len(r.prompt_ids) + len(r.response_ids) for r in rows), length or 0)
    out = torch.full((total, layers, top_k), -1, dtype=torch.long)
    at = 0
    for r in rows:
        p = len(r.prompt_ids)
        if r.routes is not None:
            code, packed = r.routes
            stored = TokenRoutes(base64.b64decode(packed), layers=layers, top_k=top_k, code=code)
            # The one copy: the packed ids widened to the long ids megatron's replay indexes with.
            routes = torch.from_numpy(stored.as_ids())
            out[at + p - 1 : at + p - 1 + len(routes)] = routes
        at += p + len(r.response_ids)
    return out.to(device)
