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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use", ["logp", "logp+entropy", "all"])
def test_values_and_gradients_equal_the_plain_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, use: str
) -> None:
    monkeypatch.setattr(ts, "CHUNK_ELEMENTS", 3 * 50)  # 3 rows a chunk: 24 rows make 8 chunks
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(4, 6, 50, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 50, (4, 6), generator=g)
    heads = torch.randint(0, 50, (4, 6, 3), generator=g)
    weights = [torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(4, 6, 3, generator=g)]
    results = []
    for fn in (_plain, lambda x, y, t, h: ts.token_scores(x, y, t, h)):
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
