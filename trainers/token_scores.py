"""Log-probs, entropy and sampler-head log-probs of response tokens, without a [N, V] fp32 tensor kept.

The plain way (`log_softmax(logits.float() / T)`, then gather and `-(p * log p).sum()`) keeps every
intermediate alive for the backward: at a real vocabulary that is the trainer's memory. A 0.6B
Qwen3 (V = 151,936) scoring 64 samples x 256 response tokens holds about 10 GB per fp32 [N, V]
tensor, and autograd saves four of them (the upcast, the log-softmax, its exp, the product), which
ran an H200 out of memory beside its engine (BENCHMARKS.md section 10b).

Here the forward walks the rows in chunks and keeps only the [N] results; the backward recomputes
each chunk's softmax from the logits (saved in their own dtype, bf16 under autocast) and writes
the gradient in closed form:

    d log p_t / dz = (onehot_t - p) / T
    d H / dz       = -p * (log p + H) / T          (H = -sum p log p)

so the peak is the logits, their gradient and one chunk in fp32. The values equal the plain way's
(the same fp32 log-softmax, row by row); a test holds values and gradients to it.
"""

from __future__ import annotations

from typing import Any

import torch

# Elements of one fp32 chunk: 2**25 is 128 MiB, about 220 rows of a 150k vocabulary.
CHUNK_ELEMENTS = 1 << 25


def _chunks(n: int, vocab: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(1, vocab))
    return [(s, min(n, s + step)) for s in range(0, n, step)]


class _TokenScores(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, heads: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, vocab = logits.shape
        logp = logits.new_empty(n, dtype=torch.float32)
        entropy = logits.new_empty(n, dtype=torch.float32)
        head = logits.new_empty(n, heads.shape[1], dtype=torch.float32)
        for s, e in _chunks(n, vocab):
            full = torch.log_softmax(logits[s:e].float() / temperature, dim=-1)
            logp[s:e] = full.gather(-1, targets[s:e, None])[:, 0]
            entropy[s:e] = -(full.exp() * full).sum(dim=-1)
            head[s:e] = full.gather(-1, heads[s:e])
        ctx.save_for_backward(logits, targets, heads, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # an output the loss does not use adds no work to the backward
        return logp, entropy, head

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None, g_head: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None]:
        logits, targets, heads, entropy = ctx.saved_tensors
        t = ctx.temperature
        n, vocab = logits.shape
        grad = torch.empty_like(logits)
        for s, e in _chunks(n, vocab):
            full = torch.log_softmax(logits[s:e].float() / t, dim=-1)
            p = full.exp()
            # Each picked log-prob pulls its own id up and every id down by p: sum the pulls first.
            pull = torch.zeros(e - s, device=full.device)
            if g_logp is not None:
                pull += g_logp[s:e].float()
            if g_head is not None and heads.shape[1]:
                pull += g_head[s:e].float().sum(dim=-1)
            g = p * -pull[:, None]
            if g_logp is not None:
                g.scatter_add_(-1, targets[s:e, None], g_logp[s:e, None].float())
            if g_head is not None and heads.shape[1]:
                g.scatter_add_(-1, heads[s:e], g_head[s:e].float())
            if g_entropy is not None:
                g -= g_entropy[s:e].float()[:, None] * p * (full + entropy[s:e, None])
            grad[s:e] = (g / t).to(grad.dtype)
        return grad, None, None, None


def token_scores(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, heads: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[..., V] logits, [...] target ids -> fp32 ([...] log-probs, [...] entropy, [..., k] head log-probs).

    `heads` ([..., k] ids, SC's sampler heads) is optional; the head log-probs are None without it.
    Gradients flow to `logits` from whichever outputs the loss uses; detach the entropy for a loss
    without an entropy term.
    """
    lead = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    ids = heads.reshape(-1, heads.shape[-1]) if heads is not None else targets.new_zeros(flat.shape[0], 0)
    scores = _TokenScores.apply(flat, targets.reshape(-1), ids, float(temperature))  # type: ignore[no-untyped-call]
    logp, entropy, head = scores
    picked = head.reshape(*lead, heads.shape[-1]) if heads is not None else None
    return logp.reshape(lead), entropy.reshape(lead), picked
