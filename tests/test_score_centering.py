"""SC: the score-centering correction (trainers/score_centering.py) against the objective it stands
for, written out over the whole vocabulary; its place in `policy_loss` and the trainer; the
refused combinations at config load (issue 32)."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from core.columns import SamplerHeads
from core.errors import ConfigError
from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
from pipeline.config import load_config
from pipeline.tasks.tiny_model import make_model_folder
from trainers import loss as L
from trainers.grpo import GRPOTrainer
from trainers.score_centering import head_weight_fn, score_centering_correction

MODES = [("none", 0.0, 2.0), ("truncate", 0.5, 1.5), ("icepop", 0.5, 1.5)]


def expected_gradient(logits: torch.Tensor, q: torch.Tensor, advantage: float, f, head: torch.Tensor) -> torch.Tensor:
    """d/dlogits of E_{y~q}[ -A f(p_y/q_y) log p_y ] + A * correction, enumerated over every y."""
    log_p = torch.log_softmax(logits, dim=-1)
    w = f((log_p.detach() - q.log()).exp())
    sampled = -(q * w * log_p).sum() * advantage
    correction, _, _ = score_centering_correction(log_p[head], q.log()[head], f)
    return torch.autograd.grad(sampled + advantage * correction, logits)[0]


@pytest.mark.parametrize(("mode", "low", "high"), MODES)
def test_with_the_whole_vocabulary_as_head_a_constant_reward_has_zero_expected_gradient(mode, low, high):
    """Eq. 12/14's point: the centering term cancels what a constant advantage would push."""
    torch.manual_seed(0)
    f = head_weight_fn(mode, low=low, high=high)
    q = torch.softmax(torch.randn(9, dtype=torch.float64), dim=-1)
    for advantage in (-1.3, 2.0):
        logits = torch.randn(9, dtype=torch.float64, requires_grad=True)
        grad = expected_gradient(logits, q, advantage, f, torch.arange(9))
        torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-9, rtol=0)


@pytest.mark.parametrize(("mode", "low", "high"), MODES)
def test_a_top_k_head_gives_the_full_term_when_the_samplers_tail_is_the_trainers_rescaled(mode, low, high):
    """The tail model: with q's tail = rho x p's tail (what alpha assumes), the top-k correction's
    gradient is the whole-vocabulary one's."""
    torch.manual_seed(1)
    f = head_weight_fn(mode, low=low, high=high)
    logits = torch.randn(12, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(logits.detach(), dim=-1)
    head = torch.tensor([0, 3, 7])
    q = p.clone()
    q[head] = torch.tensor([0.30, 0.25, 0.15], dtype=torch.float64)
    tail = torch.ones(12, dtype=torch.bool)
    tail[head] = False
    q[tail] = p[tail] * (1 - q[head].sum()) / p[tail].sum()  # the tail rescaled by rho
    log_p = torch.log_softmax(logits, dim=-1)
    top, _, _ = score_centering_correction(log_p[head], q.log()[head], f)
    whole, _, _ = score_centering_correction(log_p, q.log(), f)
    g_top = torch.autograd.grad(top, logits, retain_graph=True)[0]
    g_whole = torch.autograd.grad(whole, logits)[0]
    torch.testing.assert_close(g_top, g_whole, atol=1e-9, rtol=0)
    # And it is no zero: the sampler is off the trainer's policy.
    assert g_top.abs().max() > 1e-3


def test_on_policy_the_correction_is_zero():
    torch.manual_seed(2)
    log_p = torch.log_softmax(torch.randn(4, 10), dim=-1)
    head = log_p.topk(3, dim=-1).values
    correction, q_mass, p_mass = score_centering_correction(head, head, head_weight_fn("truncate", low=0, high=2))
    torch.testing.assert_close(correction, torch.zeros(4), atol=1e-6, rtol=0)
    torch.testing.assert_close(q_mass, p_mass)


def test_policy_loss_adds_the_advantage_weighted_term_on_trained_tokens_with_heads():
    torch.manual_seed(3)
    b, r, k = 2, 3, 2
    current = torch.randn(b, r).clamp(max=-0.1).requires_grad_()
    train_head = torch.log_softmax(torch.randn(b, r, 5), dim=-1)[..., :k].requires_grad_()
    sampler_head = torch.log_softmax(torch.randn(b, r, 5), dim=-1)[..., :k]
    mask = torch.tensor([[True, True, False], [True, True, True]])
    valid = torch.tensor([[True, False, True], [True, True, True]])  # a tool token has no head
    adv = torch.tensor([1.0, -0.5])
    s = L.LossSettings(score_centering=True)
    kw = dict(current=current, entropy=torch.zeros(b, r), proximal=current.detach(), behaviour=current.detach())
    base = L.policy_loss(dataclasses.replace(s, score_centering=False), mask=mask, advantages=adv, **kw)
    sc = L.policy_loss(
        s, mask=mask, advantages=adv, train_head=train_head, sampler_head=sampler_head, head_valid=valid, **kw
    )
    f = head_weight_fn("truncate", low=s.tis_clip_low, high=s.tis_clip)
    corr, _, _ = score_centering_correction(train_head, sampler_head, f)
    term = (adv[:, None] * corr).masked_fill(~(mask & valid), 0.0)
    expected = base.loss + term.sum() / mask.sum()
    torch.testing.assert_close(sc.loss, expected)
    assert sc.sc_correction is not None and abs(float(sc.sc_correction)) > 0
    with pytest.raises(ValueError, match="train_head"):
        L.policy_loss(s, mask=mask, advantages=adv, **kw)


def test_loss_settings_refuse_score_centering_with_opsm_or_a_sequence_mask():
    with pytest.raises(ValueError, match="score centering composes"):
        L.LossSettings(score_centering=True, use_opsm=True)
    with pytest.raises(ValueError, match="score centering composes"):
        L.LossSettings(score_centering=True, correction=L.ImportanceCorrection.SEQ_MASK)


SC = ["--use-score-centering", "--score-centering-top-k", "4"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        ([*SC, "--use-opsm"], "--use-opsm=True"),
        ([*SC, "--tis-mode", "seq-mask"], "--tis-mode='seq-mask'"),
    ],
)
def test_refused_score_centering_combinations_are_named_at_config_load(argv, named):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    assert named in str(err.value)


def test_score_centering_settings_that_compose_load():
    config = load_config([*SC, "--rollout-mode", "async", "--tis-mode", "icepop"])
    assert config.trainer.use_opsm is False  # not derived on for async when SC is on
    # The megatron backend runs the same loss (tests/test_megatron.py's tp2-kl-entropy case).
    assert load_config([*SC, "--train-backend", "megatron"]).rollout.use_score_centering is True


def _heads(rows: list[list[tuple[int, float]]]) -> SamplerHeads:
    ids = [t for row in rows for t, _ in row]
    lps = [lp for row in rows for _, lp in row]
    return SamplerHeads(struct.pack(f"<{len(ids)}i", *ids), struct.pack(f"<{len(lps)}d", *lps), k=len(rows[0]))


def test_the_trainer_scores_the_heads_and_the_term_moves_the_weights(tmp_path):
    """The trainer reads each token's head from the sample, scores it under its own weights and
    adds the term: the update differs from the same step without SC."""
    model = make_model_folder(tmp_path / "m", hidden_size=32, num_layers=2, seed=0)
    task = PromptTask(index=0, prompt_ids=(5, 6, 7))
    samples = []
    for i, tokens in enumerate([(8, 9), (10, 1)]):
        head = _heads([[(tokens[0], -1.0), (11, -2.0)], [(tokens[1], -0.5), (12, -3.0)]])
        seg = Segment(tokens, (-1.0, -0.5), FinishReason.LENGTH, version=0, heads=head)
        samples.append(
            dataclasses.replace(
                Sample(index=i, prompt_ids=task.prompt_ids).extended(seg, max_response_len=2), reward=float(i)
            )
        )
    group = Group.fresh(task, epoch=0, n_samples=2, version=0, seq=0).with_samples(samples)
    weights = []
    for sc in (False, True):
        trainer = GRPOTrainer(model, loss=L.LossSettings(score_centering=sc))
        trainer.train_step(Batch(0, (group,)))
        weights.append(trainer.model.lm_head.weight.detach().clone())
    assert not torch.equal(weights[0], weights[1])


# ---- the built-in engine answers top_logprobs_num, and the heads reach the trainer ----------------


async def _heads_rollout(model, k: int) -> list[Group]:
    from pipeline.tasks.toy import toy_dataset
    from stages.sglang_client.payloads import TokenPayloads
    from tests.engine_rollout import engine_rollout, toy_rewarded

    payloads = TokenPayloads(sampler_top_k=k)
    tasks = toy_dataset(4, seed=0)
    return toy_rewarded(
        await engine_rollout(model, tasks, n_samples=2, payloads=payloads, max_response_len=8, slots=8, deadline=60)
    )


@pytest.mark.anyio
async def test_the_engines_heads_are_its_sampling_distributions_top_k_and_center_to_zero_on_policy(tmp_path):
    from transformers import AutoModelForCausalLM

    k = 3
    model = make_model_folder(tmp_path / "m", hidden_size=32, num_layers=2, seed=0)
    groups = await _heads_rollout(model, k)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for s in (s for g in groups for s in g.samples):
        assert s.heads is not None and s.heads.k == k and len(s.heads) == s.response_len
        ids = list(s.prompt_ids) + list(s.response_ids)
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=torch.tensor([ids[:-1]])).logits[0].double(), dim=-1)
        for t in range(s.response_len):
            want = logp[len(s.prompt_ids) - 1 + t].topk(k)
            got = s.heads.row(t)
            assert [tid for tid, _ in got] == want.indices.tolist()
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in got], dtype=torch.float64), want.values, atol=1e-5, rtol=0
            )
    # At the weights that sampled, q == p on every head: the centering term adds nothing.
    after = []
    for sc in (False, True):
        trainer = GRPOTrainer(model, loss=L.LossSettings(score_centering=sc))
        trainer.train_step(Batch(0, tuple(groups)))
        after.append(trainer.model.lm_head.weight.detach().clone())
    torch.testing.assert_close(after[0], after[1], atol=1e-6, rtol=0)
