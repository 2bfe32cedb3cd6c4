"""The step-KL bound (`--max-step-kl`, `trainers.step_kl`): the backtracking on hand-made steps, the
torch trainer's steps kept under the bound where an unchecked step leaves it, and the flag's
defaults per backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.errors import ConfigError
from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
from pipeline.config import load_config
from pipeline.config.rules import DEFAULT_MAX_STEP_KL
from pipeline.tasks.toy import encode
from pipeline.trainer_settings import build_trainer
from trainers import GRPOTrainer
from trainers.step_kl import bounded_step, mean_k3

PROMPT = encode("say a x2:")
TASK = PromptTask(index=0, prompt_ids=PROMPT, label={"char": "a", "count": 2})


pytestmark = pytest.mark.usefixtures("restore_torch_threads")


# ---- the backtracking ------------------------------------------------------------------------------


def test_a_step_over_the_bound_is_halved_until_it_is_under():
    p = torch.nn.Parameter(torch.tensor([1.0]))

    def step() -> None:
        with torch.no_grad():
            p.add_(4.0)

    check = bounded_step([p], step, lambda: float((p.detach() - 1.0) ** 2), max_kl=1.0)
    # (4 / 2^h)^2 <= 1 first at h = 2: the step taken is 1, a quarter of the proposed one.
    assert (check.halvings, check.proposed_kl, check.kl) == (2, 16.0, 1.0)
    assert p.item() == 2.0


def test_a_step_under_the_bound_is_taken_whole_and_one_never_under_it_is_undone():
    p = torch.nn.Parameter(torch.tensor([0.0]))
    check = bounded_step([p], lambda: p.data.add_(0.5), lambda: 0.01, max_kl=0.1)
    assert (check.halvings, check.kl, p.item(), check.undone) == (0, 0.01, 0.5, False)
    check = bounded_step([p], lambda: p.data.add_(3.0), lambda: 5.0, max_kl=0.1, max_halvings=3)
    assert (check.halvings, check.kl, p.item(), check.undone) == (4, 0.0, 0.5, True)  # back where it was
    with pytest.raises(ValueError, match="max_kl"):
        bounded_step([p], lambda: None, lambda: 0.0, max_kl=0.0)


def test_mean_k3_is_zero_for_equal_log_probs_and_ignores_masked_tokens():
    old = torch.tensor([[-1.0, -2.0, -50.0]])
    new = torch.tensor([[-1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    assert mean_k3(old, old, mask) == 0.0
    r = torch.exp(torch.tensor(1.0))
    assert mean_k3(old, new, mask) == pytest.approx(float(r - 1 - 1) / 2)


# ---- in the trainer ---------------------------------------------------------------------------------


def _batch(step: int = 0) -> Batch:
    """One group whose one good sample is the shortest: every signal says "stop earlier"."""
    texts = ["aa", "aab", "aabb", "abab", "aaab", "bbbb", "abba", "baab"]
    samples = []
    for i, text in enumerate(texts):
        ids = (*encode(text), 1)  # 1: the end token
        s = Sample(index=i, prompt_ids=PROMPT).extended(
            Segment(ids, (-3.0,) * len(ids), FinishReason.STOP, 0), max_response_len=16
        )
        samples.append(dataclasses.replace(s, reward=1.0 if i == 0 else 0.0))
    group = Group.fresh(TASK, epoch=0, n_samples=len(samples), version=0, seq=0).with_samples(samples)
    return Batch(step, (group,))


def _moved(tiny_model_dir, max_step_kl: float | None) -> tuple[float, dict[str, float]]:
    """The KL per token one train_step moved the policy on its own batch, measured afresh, and the metrics."""
    batch = _batch()
    trainer = GRPOTrainer(tiny_model_dir, lr=0.1, max_step_kl=max_step_kl)  # lr 0.1: a step far too large
    before = torch.tensor([x for row in trainer.logprobs(batch.samples) for x in row])
    metrics = trainer.train_step(batch)
    after = torch.tensor([x for row in trainer.logprobs(batch.samples) for x in row])
    return mean_k3(before, after, torch.ones_like(before, dtype=torch.bool)), metrics


def test_the_trainer_keeps_each_step_under_the_bound_where_an_unchecked_step_leaves_it(tiny_model_dir):
    unchecked, plain = _moved(tiny_model_dir, None)
    assert unchecked > 1.0  # the step the optimizer proposes moves the policy by nats per token
    assert "step_kl_max" not in plain
    bounded, metrics = _moved(tiny_model_dir, 0.2)
    assert bounded <= 0.2 + 1e-6
    assert metrics["step_kl_halvings"] >= 1 and metrics["step_kl_proposed_max"] > 1.0
    assert metrics["step_kl_max"] <= 0.2 and metrics["optimizer_steps"] == 1
    with pytest.raises(ValueError, match="max_step_kl"):
        GRPOTrainer(tiny_model_dir, max_step_kl=0.0)


# ---- the flag -----------------------------------------------------------------------------------------


def test_the_bound_is_on_by_default_with_torch_and_off_with_megatron(tiny_model_dir):
    assert load_config([]).trainer.max_step_kl == DEFAULT_MAX_STEP_KL
    assert load_config(["--max-step-kl", "0"]).trainer.max_step_kl == 0.0
    assert load_config(["--train-backend", "megatron"]).trainer.max_step_kl == 0.0
    with pytest.raises(ConfigError, match="max-step-kl"):
        load_config(["--train-backend", "megatron", "--max-step-kl", "0.3"])
    assert build_trainer(tiny_model_dir, {"trainer": {"max_step_kl": 0.3}, "rollout": {}}).max_step_kl == 0.3
    assert build_trainer(tiny_model_dir, {"trainer": {"max_step_kl": 0.0}, "rollout": {}}).max_step_kl is None


def test_a_step_no_halving_brings_under_the_bound_is_undone_counted_and_said(tiny_model_dir):
    """A bound below what 6 halvings of an lr-0.1 step reach: the weights stay as they were, the
    metrics count the undone step, and the log says so with the learning rate (a run whose every
    step is undone trains nothing while its rewards still move)."""
    from structlog.testing import capture_logs

    batch = _batch()
    trainer = GRPOTrainer(tiny_model_dir, lr=0.1, max_step_kl=1e-9)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with capture_logs() as logs:
        metrics = trainer.train_step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert metrics["step_kl_undone"] == 1 and metrics["step_kl_max"] == 0.0
    said = [e for e in logs if e["log_level"] == "warning" and "undone" in e["event"]]
    assert len(said) == 1 and said[0]["lr"] == 0.1 and said[0]["undone"] == 1
    quiet = GRPOTrainer(tiny_model_dir, lr=0.1, max_step_kl=0.2)
    with capture_logs() as logs:
        assert quiet.train_step(batch)["step_kl_undone"] == 0
    assert not [e for e in logs if "undone" in e["event"]]


def test_a_step_without_an_optimizer_step_reports_the_same_step_kl_keys(tiny_model_dir):
    # Before: the keys were written only when an optimizer step was checked, so a batch with no
    # signal (every reward equal: advantages 0, no step) left them out of its record, and the
    # record's key set changed from step to step. A step that takes no optimizer step moves the
    # policy by exactly 0: that is what the keys say, with train/optimizer_steps 0 saying why.
    trainer = GRPOTrainer(tiny_model_dir, lr=0.1, max_step_kl=0.2)
    flat = _batch()
    flat = Batch(0, (flat.groups[0].with_samples([dataclasses.replace(s, reward=1.0) for s in flat.samples]),))
    still = trainer.train_step(flat)
    moved = trainer.train_step(_batch(1))
    assert still["optimizer_steps"] == 0 and moved["optimizer_steps"] == 1
    keys = {k for k in moved if k.startswith("step_kl_")}
    assert keys == {"step_kl_max", "step_kl_proposed_max", "step_kl_halvings", "step_kl_undone"}
    assert {k: still[k] for k in keys} == dict.fromkeys(keys, 0.0)
