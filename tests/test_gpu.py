"""Opt-in GPU checks: `pytest -m gpu` on a machine with a CUDA or ROCm build of torch.

The default run skips them (tests/conftest.py); CI has no GPU.
"""

from __future__ import annotations

import dataclasses

import pytest

from core.types import Batch, FinishReason, Group, Sample, Segment
from pipeline.tasks.tiny_model import EOS_ID, make_model_folder
from pipeline.tasks.toy import encode, toy_dataset

pytestmark = pytest.mark.gpu


def one_step(model, device: str) -> dict[str, float]:
    """One GRPO step on a fixed batch whose behaviour log-probs are the CPU trainer's own."""
    from trainers import GRPOTrainer

    reference, trainer = GRPOTrainer(model, device="cpu"), GRPOTrainer(model, device=device)
    groups = []
    for g, task in enumerate(toy_dataset(2, seed=0)):
        tokens = [(*encode(a), EOS_ID) for a in ("b", "bb", "xyz", "")]
        blank = [Sample(index=i, prompt_ids=task.prompt_ids) for i in range(len(tokens))]
        drafts = [
            s.extended(Segment(t, (0.0,) * len(t), FinishReason.STOP, 0), max_response_len=16)
            for s, t in zip(blank, tokens, strict=True)
        ]
        behaviour = reference.logprobs(drafts)
        samples = [
            dataclasses.replace(
                s.extended(Segment(t, tuple(lp), FinishReason.STOP, 0), max_response_len=16), reward=float(i)
            )
            for i, (s, t, lp) in enumerate(zip(blank, tokens, behaviour, strict=True))
        ]
        groups.append(Group.fresh(task, epoch=0, n_samples=4, version=0, seq=g).with_samples(samples))
    return dict(trainer.train_step(Batch(0, tuple(groups))))


def test_a_training_step_on_the_gpu_matches_the_cpu(tmp_path):
    import torch

    assert torch.cuda.is_available(), "torch sees no GPU"
    model = make_model_folder(tmp_path / "m")
    on_cpu, on_gpu = one_step(model, "cpu"), one_step(model, "cuda")
    assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], abs=1e-4)
    assert on_gpu["grad_norm"] == pytest.approx(on_cpu["grad_norm"], rel=1e-3)
    assert on_gpu["train_rollout_logprob_abs_diff"] < 1e-4


def test_the_weights_file_from_the_gpu_reads_back_exactly(tmp_path):
    """The publish writer queues every device-to-host copy into page-locked memory and syncs once:
    what it writes is the device's tensors, bit for bit, also through chunks of several tensors."""
    import torch
    from safetensors.torch import load_file

    from trainers.weights_file import WeightsFileWriter

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {f"w{i}": torch.randn(64 + i, 33, device="cuda", generator=g).to(torch.bfloat16) for i in range(9)}
    tensors["fp32"] = torch.randn(5, device="cuda", generator=g)
    writer = WeightsFileWriter(chunk_bytes=3 * 64 * 33 * 2)
    writer.write(tmp_path / "model.safetensors", tensors)
    assert writer._buffer is not None and writer._buffer.is_pinned()
    back = load_file(str(tmp_path / "model.safetensors"))
    for name, t in tensors.items():
        assert torch.equal(back[name], t.cpu()), name
