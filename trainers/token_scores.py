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

`compiled=True` (`--trainer-compile`) runs each chunk's arithmetic as one `torch.compile` graph:
eagerly, a chunk's scores are about ten passes over an fp32 [rows, V] (the upcast, the
log-softmax's, the exp, the product, the sum) and its gradient as many again; compiled, the
reductions read the bf16 logits a few times and nothing fp32 of the forward is written. With no
fp32 chunk kept in the forward, its chunks are larger (fewer calls, each a guard check on the
host). On the H100 the eager scorer's passes were most of the compiled step's elementwise time
(docs/benchmarks/16-time-to-target.md).
"""

from __future__ import annotations

from typing import Any

import torch

# Elements of one fp32 chunk: 2**25 is 128 MiB, about 220 rows of a 150k vocabulary. Compiled,
# the forward writes no fp32 chunk and the backward one, so four times as many rows go at once.
CHUNK_ELEMENTS = 1 << 25
COMPILED_CHUNK_ELEMENTS = 1 << 27


def _chunks(n: int, vocab: int, elements: int) -> list[tuple[int, int]]:
    step = max(1, elements // max(1, vocab))
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _scores(
    logits: torch.Tensor, targets: torch.Tensor, heads: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's fp32 log-probs at `targets`, entropy, and log-probs at `heads` ([rows, k])."""
    full = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(full.exp() * full).sum(dim=-1)
    return full.gather(-1, targets[:, None])[:, 0], entropy, full.gather(-1, heads)


def _gradient(
    logits: torch.Tensor,
    targets: torch.Tensor,
    heads: torch.Tensor,
    entropy: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    g_head: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """One chunk's gradient with respect to its logits, in their dtype (the closed forms above)."""
    full = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = full.exp()
    # Each picked log-prob pulls its own id up and every id down by p: sum the pulls first.
    pull = torch.zeros(logits.shape[0], device=logits.device)
    if g_logp is not None:
        pull += g_logp.float()
    if g_head is not None and heads.shape[1]:
        pull += g_head.float().sum(dim=-1)
    g = p * -pull[:, None]
    if g_logp is not None:
        g.scatter_add_(-1, targets[:, None], g_logp[:, None].float())
    if g_head is not None and heads.shape[1]:
        g.scatter_add_(-1, heads, g_head.float())
    if g_entropy is not None:
        g -= g_entropy.float()[:, None] * p * (full + entropy[:, None])
    return (g / temperature).to(logits.dtype)


_compiled: dict[str, Any] = {}


def _kernels(compiled: bool) -> tuple[Any, Any, int]:
    """The chunk functions (compiled once per process when asked) and the chunk size to use."""
    if not compiled:
        return _scores, _gradient, CHUNK_ELEMENTS
    if not _compiled:
        # Dynamic: every micro-batch's last chunk has its own row count.
        _compiled["scores"] = torch.compile(_scores, dynamic=True, fullgraph=True)
        _compiled["gradient"] = torch.compile(_gradient, dynamic=True, fullgraph=True)
    return _compiled["scores"], _compiled["gradient"], COMPILED_CHUNK_ELEMENTS


class _TokenScores(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        heads: torch.Tensor,
        temperature: float,
        compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, vocab = logits.shape
        scores, _, elements = _kernels(compiled)
        source = logits.detach()  # a graph of its own reads no autograd state (a view's base has some)
        logp = logits.new_empty(n, dtype=torch.float32)
        entropy = logits.new_empty(n, dtype=torch.float32)
        head = logits.new_empty(n, heads.shape[1], dtype=torch.float32)
        for s, e in _chunks(n, vocab, elements):
            logp[s:e], entropy[s:e], head[s:e] = scores(source[s:e], targets[s:e], heads[s:e], temperature)
        ctx.save_for_backward(logits, targets, heads, entropy)
        ctx.temperature = temperature
        ctx.compiled = compiled
        ctx.set_materialize_grads(False)  # an output the loss does not use adds no work to the backward
        return logp, entropy, head

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None, g_head: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None]:
        logits, targets, heads, entropy = (t.detach() for t in ctx.saved_tensors)  # plain tensors, as above
        n, vocab = logits.shape
        _, gradient, elements = _kernels(ctx.compiled)
        grad = torch.empty_like(logits)
        for s, e in _chunks(n, vocab, elements):
            grad[s:e] = gradient(
                logits[s:e],
                targets[s:e],
                heads[s:e],
                entropy[s:e],
                None if g_logp is None else g_logp[s:e],
                None if g_entropy is None else g_entropy[s:e],
                None if g_head is None else g_head[s:e],
                ctx.temperature,
            )
        return grad, None, None, None, None


def token_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    heads: torch.Tensor | None = None,
    *,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[..., V] logits, [...] target ids -> fp32 ([...] log-probs, [...] entropy, [..., k] head log-probs).

    `heads` ([..., k] ids, SC's sampler heads) is optional; the head log-probs are None without it.
    Gradients flow to `logits` from whichever outputs the loss uses; detach the entropy for a loss
    without an entropy term. `compiled`: each chunk's arithmetic as a `torch.compile` graph (the
    first calls pay the compile; equal results within float rounding).
    """
    lead = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    ids = heads.reshape(-1, heads.shape[-1]) if heads is not None else targets.new_zeros(flat.shape[0], 0)
    scores = _TokenScores.apply(flat, targets.reshape(-1), ids, float(temperature), compiled)  # type: ignore[no-untyped-call]
    logp, entropy, head = scores
    picked = head.reshape(*lead, heads.shape[-1]) if heads is not None else None
    return logp.reshape(lead), entropy.reshape(lead), picked
