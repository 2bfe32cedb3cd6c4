"""A bound on how far one optimizer step moves the policy (`--max-step-kl`): backtracking on the KL.

Why: PPO's clip cannot bound the first optimizer step of a batch. The ratio pi / pi_prox is exactly
1 there (pi_prox is the weights the step starts from), so that step is as large as the learning
rate and Adam make it, and the clip only acts on the batch's later steps, and only on tokens that
were sampled. What the learning benchmark's collapses showed (BENCHMARKS.md section 12): one Adam
step on a batch of mostly one-character answers moved the end token's logit everywhere, past
those answers to the empty one no sample had tried (reward 0): the mean reward went from 0.45 to
0.02 in one step.
The same overshoot the other way loses the end token (every sample at the length cap, reward 0,
advantages 0: no signal to come back). No sampled token's ratio sees it coming, but the policy's
distance moved does: on the tokens the batch sampled (drawn from the old policy, so the estimate
is unbiased) Schulman's k3 of KL(pi_old || pi_new) was 0.01-0.1 nats per token for ordinary steps and
above 1 for those.

So after each optimizer step the trainer scores the minibatch again (one forward without
gradient) and, while the mean k3 over its trained tokens exceeds `max_kl`, halves the step
(theta = theta_old + (theta - theta_old) / 2), at most `max_halvings` times; past that the
weights go back to theta_old. This is TRPO's backtracking line search on the step the optimizer
proposed; the optimizer's moments keep the full step's update (they describe the gradients seen,
not the distance taken). Cost: one extra forward per optimizer step (plus one per halving, rare)
and a copy of the trained parameters while the step is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["StepCheck", "bounded_step", "mean_k3"]


def mean_k3(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over `mask` of k3 = r - 1 - log r, r = pi_new / pi_old, from token log-probs: an unbiased
    estimate of KL(pi_old || pi_new) per token when the tokens were sampled from pi_old."""
    log_r = (new - old).masked_fill(~mask, 0.0)
    k3 = torch.expm1(log_r) - log_r
    return float((k3 * mask).sum() / mask.sum().clamp(min=1))


@dataclass(frozen=True, slots=True)
class StepCheck:
    """What the check did to one optimizer step."""

    kl: float  # the step's KL as finally taken (0 when it was undone)
    proposed_kl: float  # the KL of the step the optimizer proposed
    halvings: int  # how many times it was halved (max_halvings + 1: undone)
    undone: bool = False  # no halving brought it under the bound: the weights are as before it


def bounded_step(
    params: list[torch.nn.Parameter],
    step: Callable[[], None],
    kl_after: Callable[[], float],
    *,
    max_kl: float,
    max_halvings: int = 6,
) -> StepCheck:
    """Take the optimizer's `step()`, then halve it while `kl_after()` (the KL from the weights
    before the step) exceeds `max_kl`; undo it if `max_halvings` halvings are not enough."""
    if max_kl <= 0:
        raise ValueError(f"max_kl must be > 0, got {max_kl}")
    with torch.no_grad():
        before = [p.detach().clone() for p in params]
    step()
    kl = proposed = kl_after()
    halvings = 0
    with torch.no_grad():
        while kl > max_kl and halvings < max_halvings:
            for p, b in zip(params, before, strict=True):
                p.add_(b - p, alpha=0.5)  # p = b + (p - b) / 2
            halvings += 1
            kl = kl_after()
        if kl > max_kl:
            for p, b in zip(params, before, strict=True):
                p.copy_(b)
            return StepCheck(0.0, proposed, max_halvings + 1, undone=True)
    return StepCheck(kl, proposed, halvings)
