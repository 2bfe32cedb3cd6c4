"""R3 in the torch trainer: its MoE layers route each response token to the experts the engine chose.

`--use-rollout-routing-replay` (slime's flag; arXiv 2510.11370). Each sample carries, per response
token, the top-k expert ids every MoE layer picked in the forward that sampled it
(`Sample.routes`, core/columns.TokenRoutes). In the trainer's forward the router still computes
its logits from the current weights, but its top-k is replaced by those stored ids; the gate
weights are the current softmax at the stored experts (renormalised when the model normalises its
top-k), so the router keeps its gradient, as megatron-core's `RouterReplay` and slime do. The
policy forward, the proximal and the reference log-probs all run under the same routes.

Why it matters: a route is a discrete choice. Under newer weights, or other numerics near a tie,
the trainer's router may pick another expert for a token than the engine did, and that token's
log-prob then belongs to another function altogether; replaying the routes leaves only the
weights' change in the ratio.

What falls through to the router's own top-k: positions without a stored route. Those are the
prompt positions (the store keeps rows of response tokens only: stages/sglang_client/payloads.py says
why), environment tokens and tokens generated before routes were asked for (`NO_ROUTE` rows), and
the last response token's position (never read to sample anything, so it affects no trained
log-prob). The prompt's rows matter to a response token only through attention; under the
weights that sampled it they are the engine's too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from core.moe_layout import router_modules
from core.types import Sample

__all__ = ["RoutingReplay", "replay_plan"]


class RoutingReplay:
    """Hooks on a model's routers that, inside `replaying(plan)`, route as `plan` says."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = router_modules(model)
        if not routers:
            raise ValueError(
                "--use-rollout-routing-replay: the model has no MoE layers (no router modules) to replay routes in"
            )
        self.layers = len(routers)
        self.top_k = int(getattr(routers[0], "top_k", 0))
        self._layer = {id(r): i for i, r in enumerate(routers)}
        self._plan: torch.Tensor | None = None
        for router in routers:
            router.register_forward_hook(self._hook)

    @contextmanager
    def replaying(self, plan: torch.Tensor | None) -> Iterator[None]:
        """Forwards inside route position n of layer l to `plan[n, l]` ([tokens, layers, top_k]
        long, the forward's positions flattened batch-major; a row holding -1 falls through)."""
        self._plan = plan
        try:
            yield
        finally:
            self._plan = None

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        plan = self._plan
        if plan is None:
            return None
        logits, _, computed = output
        stored = plan[:, self._layer[id(module)]]
        if stored.shape != computed.shape:
            raise ValueError(
                f"routing replay: {tuple(stored.shape)} stored routes for a router that routed {tuple(computed.shape)}"
            )
        replayed = torch.where((stored >= 0).all(dim=-1, keepdim=True), stored, computed)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(-1, replayed)
        if getattr(module, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), replayed


def replay_plan(samples: Sequence[Sample], width: int, *, layers: int, top_k: int) -> torch.Tensor:
    """The routes of a right-padded forward over `samples` (prompt + response, `width` columns):
    [B * width, layers, top_k] long, -1 where the router's own choice stands (see the module
    docstring). Response token t of a sample whose prompt has p tokens sits at position p + t and
    was sampled by the forward that read position p - 1 + t: its row goes there."""
    plan = torch.full((len(samples), width, layers, top_k), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        routes = s.routes
        if routes is None or not len(routes):
            continue
        if (routes.layers, routes.top_k) != (layers, top_k):
            raise ValueError(
                f"sample {s.index}: its routes are {routes.layers} layers x top-{routes.top_k}, the trained model "
                f"routes {layers} layers x top-{top_k} (rollout and trainer models differ?)"
            )
        p = len(s.prompt_ids)
        # The one copy between the store's bytes and the forward: the packed ids (a view of the
        # record's bytes, uint8 for <= 255 experts) widened to the long ids `gather` takes.
        plan[i, p - 1 : p - 1 + len(routes)] = torch.from_numpy(routes.as_ids())
    return plan.reshape(len(samples) * width, layers, top_k)
