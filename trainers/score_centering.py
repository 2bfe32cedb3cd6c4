"""SC: the score-centering correction (`--use-score-centering --score-centering-top-k k`, slime's flags;
arXiv 2609.20807, eqs. 12 and 14), from the sampler heads the engines return with each token.

The policy gradient of a sampled token y, `-A f(r_y) grad log p_y` (r = p / q, p the trainer's
distribution, q the sampler's, f the importance weight: 1 without a correction, TIS's truncation,
IcePop's band), has expectation `-A sum_v q_v f(r_v) grad log p_v` under y ~ q. Score centering adds
a term whose gradient cancels what a constant reward would contribute, leaving a lower-variance
estimate of the same direction:

    correction_t = sum_{v in H} sg[ q_v f(r_v) - alpha p_v ] log p_v          (per token t)
    loss_t      += A * correction_t

over the sampler's top-k head H of that step (`Sample.heads`: ids and the sampler's log-probs,
normalised over the whole vocabulary). The sampler's tail outside H is not known; it is modelled
as the trainer's tail rescaled: `rho = (1 - sum_H q) / (1 - sum_H p)` (both floored at `eps`) and
`alpha = rho f(1 / rho)`. When H is the whole vocabulary this is eq. 12 exactly; when the sampler's
tail is the trainer's times rho it equals the full-vocabulary term.

Only `log p_v` carries a gradient; the weights are computed from the trainer's detached head
log-probs (with one optimizer step per batch these are the proximal policy's). Tokens whose head
row is a "no sampler" row (id -1: environment tokens) get no correction.

Which settings compose (slime's rules, checked when the config loads, `pipeline/config/payloads.py`):
the importance correction must be none, truncate (TIS) or icepop, token by token (seq-mask is a
sequence-level rule a head cannot carry); OPSM is refused; sampling must be plain temperature
sampling (the heads are read as the distribution each token was drawn from).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["head_weight_fn", "score_centering_correction"]


def head_weight_fn(correction: str, *, low: float, high: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """f(r) of `--tis-mode` as a function of a ratio tensor: none -> 1, truncate -> clamp to
    [low, high], icepop -> r inside [low, high], else 0."""
    if correction == "none":
        return torch.ones_like
    if correction == "truncate":
        return lambda r: r.clamp(min=low, max=high)
    if correction == "icepop":
        return lambda r: torch.where((r >= low) & (r <= high), r, torch.zeros_like(r))
    raise ValueError(
        f"score centering composes with the token-level corrections none/truncate/icepop, not {correction!r}"
    )


def score_centering_correction(
    train_head: torch.Tensor,
    sampler_head: torch.Tensor,
    weight: Callable[[torch.Tensor], torch.Tensor],
    *,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token `sum_H sg[q f(p/q) - alpha p] log p` (module docstring) and the detached head
    masses of the sampler and the trainer.

    `train_head` [..., k]: the trainer's log-probs at the head ids, normalised over the vocabulary,
    with gradient; `sampler_head` [..., k]: the sampler's, constants."""
    with torch.no_grad():
        log_p = train_head.detach().double()
        log_q = sampler_head.detach().double()
        p, q = log_p.exp(), log_q.exp()
        p_mass, q_mass = p.sum(-1), q.sum(-1)
        rho = (1 - q_mass).clamp_min(eps) / (1 - p_mass).clamp_min(eps)
        alpha = rho * weight(rho.reciprocal())
        coefficient = q * weight((log_p - log_q).exp()) - alpha.unsqueeze(-1) * p
    correction = (coefficient.to(train_head.dtype) * train_head).sum(-1)
    return correction, q_mass.to(train_head.dtype), p_mass.to(train_head.dtype)
