"""Reference KL and entropy (issue 31): the estimators on hand values, the terms composed in
`loss.policy_loss`, the flags, and the torch trainer's frozen reference model (the initial weights,
rebuilt on resume, never the checkpoint it resumes from). Parity with megatron: tests/test_megatron.py
(variants kl-entropy and kl-k1-seqmean)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from core.errors import ConfigError
from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
from pipeline.config import config_to_dict, load_config
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import encode
from pipeline.trainer_settings import build_trainer, loss_settings
from trainers import GRPOTrainer
from trainers.loss import KLType, LossSettings, policy_loss, reference_kl

LN2 = math.log(2.0)
PROMPT = encode("say a x2:")
TASK = PromptTask(index=0, prompt_ids=PROMPT, label={"char": "a", "count": 2})


pytestmark = pytest.mark.usefixtures("restore_torch_threads")


# ---- the estimators ------------------------------------------------------------------------------


def test_kl_estimators_match_their_formulas():
    current, reference = torch.tensor([[LN2, 0.0]]), torch.zeros(1, 2)
    mask = torch.tensor([[True, False]])
    expect = {
        KLType.K1: LN2,
        KLType.K2: LN2**2 / 2,
        KLType.K3: 0.5 - 1 + LN2,  # exp(-d) - 1 + d
        KLType.LOW_VAR_KL: 0.5 - 1 + LN2,
    }
    for kind, value in expect.items():
        kl = reference_kl(current, reference, mask, kind)
        assert kl[0].tolist() == pytest.approx([value, 0.0]), kind


def test_low_var_kl_is_bounded_where_k3_overflows_and_padding_never_makes_nan():
    current = torch.tensor([[-200.0, 0.0]])  # d = -200: exp(200) overflows float32
    reference = torch.tensor([[0.0, -float("inf")]])  # masked position, would be inf
    mask = torch.tensor([[True, False]])
    low = reference_kl(current, reference, mask, KLType.LOW_VAR_KL)
    assert low[0].tolist() == [10.0, 0.0]
    assert torch.isinf(reference_kl(current, reference, mask, KLType.K3)[0, 0])  # slime's clamp-after-exp would be too
    for kind in KLType:
        assert not torch.isnan(reference_kl(current, reference, mask, kind)).any(), kind


def _terms(settings: LossSettings, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    current = (-torch.rand(3, 4, generator=g) * 2).requires_grad_()
    entropy = (torch.rand(3, 4, generator=g) + 0.5).requires_grad_()
    reference = -torch.rand(3, 4, generator=g) * 2
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 0.0])
    pl = policy_loss(
        settings,
        current=current,
        entropy=entropy,
        proximal=current.detach(),
        behaviour=current.detach() - 0.1,
        mask=mask,
        advantages=adv,
        reference=reference,
    )
    return pl, current, entropy


def test_the_loss_is_pg_plus_beta_kl_minus_e_entropy_each_aggregated_alike():
    s = LossSettings(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type=KLType.K2, entropy_coef=0.2)
    pl, current, entropy = _terms(s)
    assert pl.loss.item() == pytest.approx(float(pl.pg_loss) + 0.3 * float(pl.kl_loss) - 0.2 * float(pl.entropy_loss))
    assert float(pl.kl_loss) > 0 and float(pl.entropy_loss) > 0
    pl.loss.backward()
    assert entropy.grad is not None and float(entropy.grad.abs().sum()) > 0  # the bonus has a gradient
    assert current.grad is not None and float(current.grad[2].abs().sum()) > 0  # A = 0: the KL's alone
    # Without the terms the loss is the policy gradient alone, and the entropy gets no gradient.
    plain, _, entropy0 = _terms(LossSettings())
    assert plain.loss.item() == pytest.approx(float(plain.pg_loss)) and float(plain.kl_loss) == 0.0
    plain.loss.backward()
    assert entropy0.grad is None


def test_kl_without_its_reference_or_its_switch_is_refused():
    s = LossSettings(use_kl_loss=True, kl_loss_coef=0.1)
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(
            s,
            current=x,
            entropy=x,
            proximal=x,
            behaviour=x,
            mask=x.bool(),
            advantages=torch.zeros(1),
        )
    with pytest.raises(ValueError, match="kl_loss_coef=0.1 without use_kl_loss"):
        LossSettings(kl_loss_coef=0.1)


# ---- flags ---------------------------------------------------------------------------------------


def test_slime_flags_reach_the_loss_settings():
    config = load_config(
        ["--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.001"]
    )
    s = loss_settings(config_to_dict(config))
    assert (s.use_kl_loss, s.kl_loss_coef, s.kl_loss_type, s.entropy_coef) == (True, 0.01, KLType.LOW_VAR_KL, 0.001)
    assert not loss_settings(config_to_dict(load_config([]))).use_kl_loss


def test_kl_flags_without_use_kl_loss_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(["--kl-loss-coef", "0.1", "--ref-load", str(tmp_path)])
    text = str(err.value)
    assert "--kl-loss-coef=0.1 without --use-kl-loss" in text
    assert "--ref-load=" in text and "nothing uses the reference model" in text
    with pytest.raises(ConfigError, match="--kl-loss-type='k4': must be one of k1, k2, k3, low_var_kl"):
        load_config(["--use-kl-loss", "--kl-loss-type", "k4"])


# ---- the torch trainer's reference model ---------------------------------------------------------


def _batch(rewards: list[float], step: int = 0) -> Batch:
    texts = ["aa", "ab", "a", "bab"]
    samples = []
    for i, r in enumerate(rewards):
        ids = (*encode(texts[i % len(texts)]),)
        s = Sample(index=i, prompt_ids=PROMPT).extended(
            Segment(ids, (-1.5,) * len(ids), FinishReason.STOP, 0), max_response_len=16
        )
        samples.append(dataclasses.replace(s, reward=r))
    group = Group.fresh(TASK, epoch=0, n_samples=len(samples), version=0, seq=0).with_samples(samples)
    return Batch(step, (group,))


KL = LossSettings(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type=KLType.K3)


def test_the_reference_is_the_starting_weights_and_the_kl_grows_as_the_policy_moves(tiny_model_dir):
    trainer = GRPOTrainer(tiny_model_dir, loss=KL, lr=0.05)
    first = trainer.train_step(_batch([1.0, 0.0, 1.0, 0.0]))
    assert first["kl_loss"] == 0.0  # the same weights score the same tokens the same
    assert first["ref_log_probs_time"] > 0
    second = trainer.train_step(_batch([1.0, 0.0, 1.0, 0.0]))
    assert second["kl_loss"] > 1e-4
    assert second["loss"] == pytest.approx(second["pg_loss"] + second["kl_loss"], rel=1e-5)


def test_a_resumed_trainer_rebuilds_the_reference_from_the_initial_weights(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(tiny_model_dir, loss=KL, lr=0.05)
    trainer.train_step(_batch([1.0, 0.0, 1.0, 0.0]))
    checkpoint = trainer.save_weights(tmp_path / "v1")
    assert not any(p.name.startswith("ref") for p in checkpoint.iterdir())  # the reference is not saved
    # The launcher's path: the checkpoint to resume from, the run's initial weights as the reference.
    config = {"trainer": {"use_kl_loss": True, "kl_loss_coef": 1.0, "kl_loss_type": "k3"}, "rollout": {}}
    resumed = build_trainer(checkpoint, config, initial_model=tiny_model_dir)
    assert resumed.ref_path == tiny_model_dir
    assert resumed.train_step(_batch([1.0, 0.0, 1.0, 0.0]))["kl_loss"] > 1e-4
    # Without it the checkpoint would be its own reference: the KL would restart at 0.
    assert build_trainer(checkpoint, config).train_step(_batch([1.0, 0.0, 1.0, 0.0]))["kl_loss"] == 0.0


def test_ref_load_names_another_reference(tiny_model_dir, tmp_path):
    other = make_model_folder(tmp_path / "other", seed=5)
    config = {"trainer": {"use_kl_loss": True, "kl_loss_coef": 1.0, "ref_load": str(other)}, "rollout": {}}
    trainer = build_trainer(tiny_model_dir, config, initial_model=tiny_model_dir)
    assert trainer.ref_path == other
    assert trainer.train_step(_batch([1.0, 0.0, 1.0, 0.0]))["kl_loss"] != 0.0


def _drift(trainer: GRPOTrainer, start: list[list[float]], batch: Batch) -> float:
    now = trainer.logprobs(batch.samples)
    return sum(abs(a - b) for p, q in zip(now, start, strict=True) for a, b in zip(p, q, strict=True))


def test_the_kl_term_holds_the_policy_closer_to_the_reference(tiny_model_dir):
    batch = _batch([1.0, 0.0, 1.0, 0.0])
    start = GRPOTrainer(tiny_model_dir).logprobs(batch.samples)
    drifts = {}
    for coef in (0.0, 5.0):
        s = LossSettings(use_kl_loss=True, kl_loss_coef=coef, kl_loss_type=KLType.K3)
        trainer = GRPOTrainer(tiny_model_dir, loss=s, lr=0.02)
        for step in range(6):
            trainer.train_step(dataclasses.replace(batch, step=step))
        drifts[coef] = _drift(trainer, start, batch)
    assert drifts[5.0] < 0.7 * drifts[0.0]


def test_an_entropy_bonus_trains_a_zero_advantage_batch_and_raises_entropy(tiny_model_dir):
    batch = _batch([0.5, 0.5, 0.5, 0.5])  # every advantage 0: no policy-gradient signal
    plain = GRPOTrainer(tiny_model_dir).train_step(batch)
    assert plain["optimizer_steps"] == 0
    entropies = {}
    for coef in (1.0, -1.0):  # a bonus, and a penalty (entropy minimisation)
        trainer = GRPOTrainer(tiny_model_dir, loss=LossSettings(entropy_coef=coef), lr=0.005)
        steps = [trainer.train_step(dataclasses.replace(batch, step=step)) for step in range(4)]
        assert all(m["optimizer_steps"] == 1 for m in steps)
        entropies[coef] = [m["entropy"] for m in steps]  # measured before each step's update
    assert entropies[1.0][-1] > entropies[1.0][0] > entropies[-1.0][-1]
