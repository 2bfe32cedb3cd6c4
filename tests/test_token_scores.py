"""The chunked token scorer equals the plain log-softmax path, in values and in gradients."""

from __future__ import annotations

import pytest
import torch

from trainers import token_scores as ts


def _plain(
    logits: torch.Tensor, targets: torch.Tensor, t: float, heads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    full = torch.log_softmax(logits.float() / t, dim=-1)
    logp = full.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(full.exp() * full).sum(dim=-1)
    return logp, entropy, full.gather(-1, heads)


@pytest.mark.parametrize(
    ("dtype", "use", "compiled"),
    [(dtype, use, False) for dtype in (torch.float32, torch.bfloat16) for use in ("logp", "logp+entropy", "all")]
    # Compiled (--trainer-compile): each graph is seconds of compile on a CPU, so two of the cases.
    + [(torch.bfloat16, "logp", True), (torch.bfloat16, "all", True)],
)
def test_values_and_gradients_equal_the_plain_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, use: str, compiled: bool
) -> None:
    # 3 rows a chunk (5 compiled): 24 rows make 8 chunks (5, the last of 4 rows: a second shape)
    monkeypatch.setattr(ts, "CHUNK_ELEMENTS", 3 * 50)
    monkeypatch.setattr(ts, "COMPILED_CHUNK_ELEMENTS", 5 * 50)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(4, 6, 50, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 50, (4, 6), generator=g)
    heads = torch.randint(0, 50, (4, 6, 3), generator=g)
    weights = [torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(4, 6, 3, generator=g)]
    results = []
    for fn in (_plain, lambda x, y, t, h: ts.token_scores(x, y, t, h, compiled=compiled)):
        logits = base.clone().requires_grad_(True)
        logp, entropy, head = fn(logits, targets, 0.7, heads)
        assert head is not None
        loss = (logp * weights[0]).sum()
        if use != "logp":
            loss = loss + (entropy * weights[1]).sum()
        if use == "all":
            loss = loss + (head * weights[2]).sum()
        loss.backward()
        assert logits.grad is not None
        results.append((logp.detach(), entropy.detach(), head.detach(), logits.grad.float()))
    for ours, plain in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_without_heads_there_are_no_head_log_probs() -> None:
    logits = torch.randn(2, 5, 7)
    logp, entropy, head = ts.token_scores(logits, torch.zeros(2, 5, dtype=torch.long), 1.0)
    assert head is None and logp.shape == entropy.shape == (2, 5)
    assert bool((entropy > 0).all()) and bool((logp < 0).all())


@pytest.mark.gpu
def test_on_a_gpu_the_compiled_scorer_equals_the_eager_one_at_a_real_vocabulary() -> None:
    """bf16 logits at Qwen3's vocabulary (151,936), rows over several compiled chunks (CUDA or
    ROCm: triton compiles the kernels): values and gradients within bf16's rounding of the eager
    scorer's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 1500, 151_936
    base = (torch.randn(rows, vocab, generator=g, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    weights = torch.randn(rows, generator=g, device="cuda"), torch.randn(rows, generator=g, device="cuda")
    results = []
    for compiled in (False, True):
        logits = base.clone().requires_grad_(True)
        logp, entropy, _ = ts.token_scores(logits, targets, 0.8, compiled=compiled)
        ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        assert logits.grad is not None
        results.append((logp.detach(), entropy.detach(), logits.grad.float()))
    for ours, eager in zip(results[1][:2], results[0][:2], strict=True):
        torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-3)
    # The gradient is rounded to bf16 from fp32 sums taken in another order: a last bit may differ.
    torch.testing.assert_close(results[1][2], results[0][2], rtol=1e-2, atol=1e-5)
