"""The built-in GRPO trainer: one PPO-clip step per batch on a Hugging Face causal LM, in torch.

It is the trainer for laptops, CI and the quick start (the tiny model on CPU); on GPU clusters the
Megatron trainer takes its place behind the same bridge. One `train_step` reads top to bottom:

    group-normalised advantages  ->  one forward over prompt+response  ->  PPO-clip ratio against
    the recomputed old log-probs  ->  per-token TIS weight against the behaviour log-probs  ->
    masked token-mean loss  ->  clip gradients  ->  one AdamW step

Off-policy correctness lives in the TIS weight. A partial-rollout sample may carry tokens from
several policy versions (`Sample.spans`); each token's behaviour log-prob (`Sample.logprobs`) is
the one the engine reported for the version that produced it, so the weight
`w_t = min(exp(old_lp_t - behaviour_lp_t), tis_cap)` is computed token by token, never with one
sampler for the whole mixed response.

A checkpoint is the model folder plus the AdamW state in its `optimizer/` subfolder (tensors in
safetensors, step counts and hyperparameters in JSON; never pickle). A subfolder, because engines
load every `*.safetensors` at a folder's top level. `GRPOTrainer(folder)` restores the optimizer when
the folder has one, so a resumed run continues the same optimizer instead of restarting Adam's moments.

Which samples train: a FAILED sample (the engine or the reward gave up on it) has no reward worth
learning from, so it is left out of its group's mean and std and contributes no loss. The batch
still counts its response tokens as masked in `mask_ratio`, so failures show up in the metrics.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from pipeline.types import Batch, Sample, SampleStatus
from stages.trainer.checkpoint import (
    OPTIMIZER_DIR,
    has_optimizer,
    load_optimizer,
    optimizer_param_names,
    save_optimizer,
    write_folder_atomically,
)

__all__ = ["GRPOTrainer", "group_advantages"]

def group_advantages(rewards: Sequence[float | None]) -> list[float]:
    """GRPO advantages of one group: `(r - mean) / (std + 1e-6)` over the rewards that are not None.

    None marks a sample that does not train (failed); it gets advantage 0 and is left out of the
    statistics. The std is the unbiased one (as slime computes it); with fewer than two rewards
    there is nothing to compare against, so every advantage is 0.
    """
    present = [float(r) for r in rewards if r is not None]
    if len(present) < 2:
        return [0.0] * len(rewards)
    mean = sum(present) / len(present)
    std = math.sqrt(sum((r - mean) ** 2 for r in present) / (len(present) - 1))
    return [0.0 if r is None else (float(r) - mean) / (std + 1e-6) for r in rewards]


def _trains(sample: Sample) -> bool:
    """Whether a sample of a ready group takes part in the loss (see the module docstring)."""
    if sample.status is SampleStatus.FAILED:
        return False
    if not sample.status.finished:
        raise ValueError(
            f"sample {sample.index} is {sample.status.value}: a batch holds only finished or failed samples"
        )
    if sample.reward is None:
        raise ValueError(f"sample {sample.index} is {sample.status.value} but has no reward")
    return True


class GRPOTrainer:
    """Trains the causal LM in `model_path` with GRPO, one optimizer step per `Batch`.

    `temperature` must be the rollout temperature: the engine samples from softmax(logits / T) and
    reports those log-probs, so the trainer scores tokens the same way or every TIS weight is off.
    `eps_clip_high` defaults to `eps_clip` (set it higher for DAPO's clip-higher). `tis_cap=None`
    turns truncated importance sampling off (every weight 1). `mask_offpolicy_in_partial_rollout`
    drops the loss of the prefix that existed before a sample's first continuation.

    CPU threads: `num_threads` is passed to `torch.set_num_threads`, which is process-wide; None
    leaves torch's setting alone. The default is 1 on purpose: the tiny model's matmuls are too
    small to split, and on a 2-core box shared with the engine a second intra-op thread mostly
    spin-waits for a busy core. Measured here under load: the learning test runs in 3.9 s with 1
    thread and 9.4 s with 2; 128 x 128-token sampling takes 0.6 s vs 4.5 s. Raise it for big models.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        lr: float = 5e-3,  # toy task, measured: 1e-3 learns slowly, 1e-2 collapses groups to one answer
        eps_clip: float = 0.2,
        eps_clip_high: float | None = None,
        tis_cap: float | None = 2.0,
        mask_offpolicy_in_partial_rollout: bool = False,
        temperature: float = 1.0,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        device: str = "cpu",
        num_threads: int | None = 1,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy sampling has no log-probs to train on), got {temperature}")
        if tis_cap is not None and tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 or None, got {tis_cap}")
        if num_threads is not None and device == "cpu":
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)  # only matters if the model config enables dropout

        self.model_path = Path(model_path)
        self.eps_clip = eps_clip
        self.eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
        self.tis_cap = tis_cap
        self.mask_offpolicy_in_partial_rollout = mask_offpolicy_in_partial_rollout
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.device = torch.device(device)
        # fp32 master weights: the tiny model trains on CPU, where bf16 buys nothing.
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device)
        self.model.train()  # no dropout in Qwen3 by default, so train/eval give the same log-probs
        self.pad_id = self.model.config.pad_token_id or 0
        # weight_decay defaults to 0 so a batch without signal (all advantages 0) leaves weights alone.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.steps = 0
        if has_optimizer(self.model_path):
            names = optimizer_param_names(self.model, self.optimizer)
            self.steps = load_optimizer(
                self.optimizer, names, self.model_path / OPTIMIZER_DIR, self.device, owner=self.model_path
            )

    # ---- the training step -------------------------------------------------------------------

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One GRPO update on `batch`; returns the step's metrics. Blocking: run it off the event loop."""
        samples = batch.samples
        if not samples:
            raise ValueError(f"batch {batch.step} has no samples")

        # 1. Advantages per group, from raw rewards; one scalar per sample, broadcast to its tokens.
        #    None stands for a sample that does not train (failed).
        trains: list[bool] = []
        advantages: list[float] = []
        for group in batch.groups:
            rewards = [s.reward if _trains(s) else None for s in group.samples]
            trains += [r is not None for r in rewards]
            advantages += group_advantages(rewards)

        # 2. Per-token tensors, laid out [sample, response position]: behaviour log-probs and the mask.
        behaviour, mask, valid = self._response_tensors(samples, trains)
        adv = torch.tensor(advantages, dtype=torch.float32, device=self.device)[:, None]

        # 3. Current log-probs (with grad). Old = the same, detached: with one optimizer step per
        #    batch, the proximal policy is the current one, so the PPO ratio starts at exactly 1 and
        #    the clip only matters if someone adds more steps per batch. It still gives PPO's gradient.
        self.model.train()
        logp = self._response_logprobs(samples)
        old_logp = logp.detach()

        ratio = torch.exp(logp - old_logp)
        pg_unclipped = -adv * ratio
        pg_clipped = -adv * ratio.clamp(1.0 - self.eps_clip, 1.0 + self.eps_clip_high)
        pg_loss = torch.maximum(pg_unclipped, pg_clipped)

        # 4. Truncated importance sampling: proximal (old) over behaviour, token by token. A token's
        #    behaviour log-prob belongs to the version that produced it (see the module docstring).
        tis, tis_raw = self._tis_weights(old_logp, behaviour, valid)
        pg_loss = pg_loss * tis

        # 5. Token mean over the tokens that train. No trainable token (all failed, all masked): a
        #    zero loss that still has a graph, so the step below runs the same code and changes nothing.
        n_tokens = mask.sum()
        loss = (pg_loss * mask).sum() / n_tokens.clamp(min=1.0)

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.steps += 1

        # 6. Metrics, over the tokens that trained unless said otherwise.
        with torch.no_grad():
            denom = max(float(n_tokens), 1.0)
            clipped = (pg_clipped > pg_unclipped).float()
            tis_over = (tis_raw > self.tis_cap).float() if self.tis_cap is not None else torch.zeros_like(mask)
            trained = [s for s, t in zip(samples, trains, strict=True) if t]
            trained_adv = [a for a, t in zip(advantages, trains, strict=True) if t]
            total_response = float(valid.sum())
            return {
                "loss": float(loss),
                "pg_clipfrac": float((clipped * mask).sum()) / denom,
                "tis_clip_ratio": float((tis_over * mask).sum()) / denom,
                "tis_mean": float((tis * mask).sum()) / denom,
                "train_rollout_logprob_abs_diff": float(((old_logp - behaviour).abs() * mask).sum()) / denom,
                "reward_mean": _mean([float(s.reward) for s in trained]),  # type: ignore[arg-type]
                "response_len_mean": _mean([float(s.response_len) for s in trained]),
                "mask_ratio": float(n_tokens) / total_response if total_response else 0.0,
                "advantage_std": _std(trained_adv),
                "grad_norm": float(grad_norm),
                "tokens": float(n_tokens),  # response tokens that trained this step
            }

    # ---- the trainer's view of log-probs -----------------------------------------------------

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Log-prob of every response token under the current weights, at the trainer's temperature."""
        if not samples:
            return []
        logp = self._response_logprobs(samples)
        return [logp[i, : s.response_len].tolist() for i, s in enumerate(samples)]

    @torch.no_grad()
    def importance_weights(self, samples: Sequence[Sample]) -> list[list[float]]:
        """The TIS weight of every response token against the current weights (capped, as trained)."""
        if not samples:
            return []
        behaviour, _, valid = self._response_tensors(samples, [False] * len(samples))
        tis, _ = self._tis_weights(self._response_logprobs(samples), behaviour, valid)
        return [tis[i, : s.response_len].tolist() for i, s in enumerate(samples)]

    def _tis_weights(
        self, old_logp: torch.Tensor, behaviour: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(capped, raw) per-token weights `exp(old - behaviour)`; 1 at padding. Without a cap, equal."""
        tis_raw = torch.exp((old_logp - behaviour).masked_fill(~valid, 0.0))
        tis = tis_raw if self.tis_cap is None else tis_raw.clamp(max=self.tis_cap)
        return tis, tis_raw

    def _response_logprobs(self, samples: Sequence[Sample]) -> torch.Tensor:
        """[B, R] log-probs of each response token (R = longest response); 0 past a response's end.

        One right-padded forward over prompt+response. Causal attention means right padding never
        changes a real token's logits. Only the R rows that predict response tokens go through the
        softmax: with a real vocabulary (150k), the full [B, L, V] log-softmax is where memory goes.
        """
        n_resp = max(s.response_len for s in samples)
        n_seq = max(len(s.prompt_ids) + s.response_len for s in samples)
        ids = torch.full((len(samples), n_seq), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(samples), n_seq), dtype=torch.long)
        rows = torch.zeros((len(samples), n_resp), dtype=torch.long)  # which position predicts token j
        targets = torch.full((len(samples), n_resp), self.pad_id, dtype=torch.long)
        for i, s in enumerate(samples):
            if not s.prompt_ids:
                raise ValueError(f"sample {s.index} has an empty prompt: nothing predicts its first token")
            p, r = len(s.prompt_ids), s.response_len
            ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
            attention[i, : p + r] = 1
            rows[i, :r] = torch.arange(p - 1, p - 1 + r)
            targets[i, :r] = torch.tensor(s.response_ids, dtype=torch.long)
        ids, attention, rows, targets = (t.to(self.device) for t in (ids, attention, rows, targets))

        logits = self.model(input_ids=ids, attention_mask=attention).logits  # [B, L, V]
        logits = logits.gather(1, rows[..., None].expand(-1, -1, logits.shape[-1]))  # [B, R, V]
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        logp = logp.gather(-1, targets[..., None]).squeeze(-1)
        valid = torch.arange(n_resp, device=self.device)[None, :] < torch.tensor(
            [s.response_len for s in samples], device=self.device
        )[:, None]
        return logp.masked_fill(~valid, 0.0)

    def _response_tensors(
        self, samples: Sequence[Sample], trains: Sequence[bool]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, R] behaviour log-probs, loss mask (float) and validity (bool) for the response tokens."""
        n_resp = max((s.response_len for s in samples), default=0)
        behaviour = torch.zeros((len(samples), n_resp), dtype=torch.float32)
        mask = torch.zeros((len(samples), n_resp), dtype=torch.float32)
        valid = torch.zeros((len(samples), n_resp), dtype=torch.bool)
        for i, (s, t) in enumerate(zip(samples, trains, strict=True)):
            r = s.response_len
            valid[i, :r] = True
            behaviour[i, :r] = torch.tensor(s.logprobs, dtype=torch.float32)
            if t:
                mask[i, :r] = torch.tensor(self.loss_mask(s), dtype=torch.float32)
        return behaviour.to(self.device), mask.to(self.device), valid.to(self.device)

    def loss_mask(self, sample: Sample) -> list[int]:
        """The sample's loss mask, with the pre-continuation prefix zeroed when the flag asks for it.

        Only samples that were actually continued (`resumed_at` non-empty) lose a prefix, and only
        `[0, resumed_at[0])`: the tokens generated before the first abort, under an older policy.
        """
        mask = list(sample.loss_mask)
        if self.mask_offpolicy_in_partial_rollout and sample.resumed_at:
            cut = min(sample.resumed_at[0], len(mask))
            mask[:cut] = [0] * cut
        return mask

    # ---- publishing weights ------------------------------------------------------------------

    def save_weights(self, path: str | os.PathLike[str]) -> Path:
        """Write the checkpoint at `path` (replacing one that is there); return it.

        The model as a Hugging Face folder, plus the optimizer state in `path/optimizer/`, written
        whole or not at all (`stages.trainer.checkpoint`).
        """

        def fill(folder: Path) -> None:
            self.model.save_pretrained(folder)
            save_optimizer(self.optimizer, optimizer_param_names(self.model, self.optimizer), self.steps,
                           folder / OPTIMIZER_DIR)

        return write_folder_atomically(Path(path), self.model_path, fill)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
