"""The built-in GRPO trainer: decoupled PPO on a Hugging Face causal LM, in torch.

One module, over 600 lines: `train_step` is meant to read top to bottom in one place; the loss, the
step-KL bound, token scores and checkpoints already live in modules of their own.

It is the trainer for laptops, CI and the quick start (the tiny model on CPU); on GPU clusters the
Megatron trainer takes its place behind the same bridge. The math lives in `trainers.loss`
(shared by every backend); this module feeds it tensors. One `train_step` reads top to bottom:

    rewards (+ overlong penalty)  ->  group advantages  ->  token masks (loss mask, off-policy,
    stale, truncated)  ->  proximal log-probs, once  ->  reference log-probs, once (--use-kl-loss)
    ->  for each minibatch of --global-batch-size samples: forward, `loss.policy_loss` (PPO clip
    against the proximal policy, importance weight proximal/behaviour, OPSM, reference KL, entropy,
    aggregation), one AdamW step (skipped when the minibatch carries no signal), halved while it
    moves the policy more than `max_step_kl` nats per token on the minibatch (`trainers.step_kl`)

The reference model (`--use-kl-loss`) is a frozen second copy of the model on the trainer's device,
loaded from `ref_path` (the launcher passes the run's initial weights, or `--ref-load`; a resumed
run rebuilds it from there, it is never saved with a checkpoint). Its log-probs cost one forward
without gradient per batch; `ref_log_probs_time` reports the seconds.

A partial-rollout sample may carry tokens from several policy versions (`Sample.spans`); each
token's behaviour log-prob (`Sample.logprobs`) is the one the engine reported for the version that
produced it, so the importance weight is computed token by token, never with one sampler for the
whole mixed response.

A checkpoint is the model folder plus the AdamW state in its `optimizer/` subfolder
(`trainers.checkpoint`). `GRPOTrainer(folder)` restores the optimizer when the folder has
one, so a resumed run continues the same optimizer instead of restarting Adam's moments.

Which samples train: a FAILED sample (the engine or the reward gave up on it) has no reward worth
learning from, so it is left out of its group's mean and std and contributes no loss. The batch
still counts its response tokens as masked in `mask_ratio`, so failures show up in the metrics.

The step, the trainer's log-probs and the weight save belong together; the loss math lives in
`loss.py`, the shape of the forward (response rows, micro-batches) in `response_rows.py` and the
optimizer checkpoint in `checkpoint.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from core.types import Batch, Sample, SampleStatus
from trainers import loss as L
from trainers.checkpoint import (
    OPTIMIZER_DIR,
    has_optimizer,
    load_optimizer,
    load_rng_state,
    model_folder_files,
    optimizer_param_names,
    save_optimizer,
    save_rng_state,
    write_folder_atomically,
)
from trainers.columns import column_tensor
from trainers.layer_compile import compile_decoder_layers
from trainers.loss import ImportanceCorrection, LossAggregation, LossSettings, group_advantages
from trainers.metrics import step_metrics, tally_minibatch
from trainers.packed_attention import packs
from trainers.response_rows import ResponseBatch, micro_batches, response_logits, sample_tokens
from trainers.routing_replay import RoutingReplay, replay_plan
from trainers.sampler_heads import sampler_heads
from trainers.step_kl import bounded_step, mean_k3
from trainers.step_settings import StepSettings
from trainers.token_scores import token_scores
from trainers.weights_file import WeightsFileWriter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = structlog.get_logger("trainer")

__all__ = ["GRPOTrainer", "group_advantages"]

_UNSET = object()  # a keyword left out, as opposed to one given as None


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


@dataclass(frozen=True, slots=True)
class _Tensors:
    """The batch laid out [sample, response position], on the trainer's device."""

    behaviour: torch.Tensor  # float, the engine's log-probs
    versions: torch.Tensor  # long, each token's policy version
    valid: torch.Tensor  # bool, a real response token (not padding)
    mask: torch.Tensor  # bool, the token trains (every mask applied)
    advantages: torch.Tensor  # float [B], one per sample


@dataclass(frozen=True, slots=True)
class _Scored:
    """What one forward says about the response tokens (`_response_logprobs`)."""

    logp: torch.Tensor  # [B, R]
    entropy: torch.Tensor  # [B, R]
    head: torch.Tensor | None = None  # [B, R, k] log-probs at the sampler's head ids (SC)


class GRPOTrainer:
    """Trains the causal LM in `model_path` with GRPO; one `train_step` per rollout `Batch`.

    `temperature` must be the rollout temperature: the engine samples from softmax(logits / T) and
    reports those log-probs, so the trainer scores tokens the same way or every importance weight
    is off. `loss` holds every knob of the objective (`trainers.loss.LossSettings`); the
    keywords `eps_clip`, `eps_clip_high`, `tis_cap` (None = no correction) and
    `mask_offpolicy_in_partial_rollout` still work and override it. `global_batch_size` is the
    number of samples per optimizer step (None = the whole batch, one step), `micro_batch_size` the
    most samples per forward and backward inside one and `max_tokens_per_gpu` the most padded
    positions (samples x the longest's prompt + response) per forward (None = no limit; gradients
    accumulate, and the step equals the unsplit one: each micro-batch's loss carries its share of
    the minibatch's tokens or samples). Micro-batches are cut from the minibatch sorted by length,
    so each pads to a length near its own (`trainers.response_rows`). `max_step_kl` bounds
    each optimizer step's move (None = no bound; the launcher passes `--max-step-kl`, 0.2 by default).
    `pack` lays each micro-batch's samples end to end without padding where the model allows it
    (`trainers.packed_attention`): the same log-probs, the real tokens' cost; False keeps every
    forward right-padded. `compile_layers` compiles the policy's decoder layers and the token scorer
    with `torch.compile` (`trainers.layer_compile`, `trainers.token_scores`: the elementwise work
    fused; the first steps pay the compile) and, on a GPU, takes AdamW's fused kernel.

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
        loss: LossSettings | None = None,
        global_batch_size: int | None = None,
        lr: float = 5e-3,  # toy task, measured: 1e-3 learns slowly, 1e-2 collapses groups to one answer
        eps_clip: object = _UNSET,
        eps_clip_high: object = _UNSET,
        tis_cap: object = _UNSET,
        mask_offpolicy_in_partial_rollout: object = _UNSET,
        temperature: float = 1.0,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        num_threads: int | None = 1,
        ref_path: str | os.PathLike[str] | None = None,
        max_step_kl: float | None = None,
        routing_replay: bool = False,
        micro_batch_size: int | None = None,
        max_tokens_per_gpu: int | None = None,
        pack: bool = True,
        compile_layers: bool = False,
    ) -> None:
        _check_arguments(
            dtype=dtype,
            temperature=temperature,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            max_tokens_per_gpu=max_tokens_per_gpu,
            max_step_kl=max_step_kl,
        )
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.pack = pack
        self.max_step_kl = max_step_kl
        self.loss = _with_legacy_keywords(
            loss or LossSettings(), eps_clip, eps_clip_high, tis_cap, mask_offpolicy_in_partial_rollout
        )
        if num_threads is not None and device == "cpu":
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)  # only matters if the model config enables dropout

        self.model_path = Path(model_path)
        self._folder_files = model_folder_files(self.model_path)  # tokenizer etc., for every save
        self._weights_file = WeightsFileWriter()  # its host buffer is reused by every publish
        self.global_batch_size = global_batch_size
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.device = torch.device(device)
        if self.device.type == "cuda":
            # cuDNN's SDPA builds a graph for every new sequence length, and every micro-batch of a
            # long-tailed batch brings one (the built-in engine turns it off for the same reason).
            torch.backends.cuda.enable_cudnn_sdp(False)
        # bf16 computes the forward and backward under torch.autocast; the weights, their gradients
        # and AdamW's state stay fp32 (master weights), whichever dtype.
        self.autocast = dtype == "bfloat16"
        self.model = _load_policy(self.model_path, self.device)
        # --trainer-compile: the decoder layers and the token scorer compiled (trainers.layer_compile,
        # trainers.token_scores), and on a GPU AdamW's fused kernel (one launch for every parameter
        # in place of a few per tensor). Under the one flag so that a GPU run's trainer changes only
        # when asked: the fused kernel's rounding is not foreach's.
        self.compiled_scores = compile_layers
        if compile_layers:
            compile_decoder_layers(self.model)
        self.pad_id = self.model.config.pad_token_id or 0
        self.lr = lr
        fused = compile_layers and self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused or None
        )
        # R3 (--use-rollout-routing-replay): the MoE layers of the policy and the reference route
        # each response token as the engine did (trainers/routing_replay.py).
        self.routing_replay: dict[int, RoutingReplay] = {}
        self._replays_routes = routing_replay
        if routing_replay:
            self.routing_replay[id(self.model)] = RoutingReplay(self.model)
        # The frozen reference policy of the KL term: `ref_path`, else the weights this trainer
        # starts from; loaded now if the loss needs it, or when a later step's settings do.
        self.reference: torch.nn.Module | None = None
        self.ref_path: Path | None = None
        self._ref_source = Path(ref_path) if ref_path is not None else self.model_path
        if self.loss.needs_reference:
            self._load_reference()
        self.steps = self._resume()  # train_step calls, across restarts

    def _resume(self) -> int:
        """Load the optimizer and RNG state saved in `model_path` (a checkpoint of this trainer) and
        return the step count it was saved at; 0 for a folder without one (a run's initial weights)."""
        if not has_optimizer(self.model_path):
            return 0
        names = optimizer_param_names(self.model, self.optimizer)
        steps = load_optimizer(
            self.optimizer, names, self.model_path / OPTIMIZER_DIR, self.device, owner=self.model_path
        )
        load_rng_state(self.model_path / OPTIMIZER_DIR)
        return steps

    def _load_reference(self) -> None:
        from transformers import AutoModelForCausalLM

        self.ref_path = self._ref_source
        reference: torch.nn.Module = AutoModelForCausalLM.from_pretrained(self.ref_path, dtype=torch.float32)
        reference.to(self.device)
        reference.train()  # the same mode as the policy, so equal weights give equal log-probs
        reference.requires_grad_(False)
        self.reference = reference
        if self._replays_routes:
            self.routing_replay[id(reference)] = RoutingReplay(reference)

    # ---- the settings a step runs with (trainers.step_settings) ------------------------------

    @property
    def step_settings(self) -> StepSettings:
        """The settings the next step runs with."""
        return StepSettings(
            lr=self.lr,
            loss=self.loss,
            temperature=self.temperature,
            max_grad_norm=self.max_grad_norm,
            max_step_kl=self.max_step_kl,
            micro_batch_size=self.micro_batch_size,
            max_tokens_per_gpu=self.max_tokens_per_gpu,
        )

    def use_settings(self, settings: StepSettings) -> None:
        """Run the next steps with `settings`: a resumed run replays a stored step with the settings
        it first ran with (`pipeline.checkpoints`). AdamW's moments and step counts are untouched;
        a reference model is loaded if this loss needs one and none is. Blocking."""
        self.lr = settings.lr
        for group in self.optimizer.param_groups:
            group["lr"] = settings.lr
        self.loss = settings.loss
        self.temperature = settings.temperature
        self.max_grad_norm = settings.max_grad_norm
        self.max_step_kl = settings.max_step_kl
        self.micro_batch_size = settings.micro_batch_size
        self.max_tokens_per_gpu = settings.max_tokens_per_gpu
        if self.loss.needs_reference and self.reference is None:
            self._load_reference()

    # ---- the training step -------------------------------------------------------------------

    def train_step(self, batch: Batch, *, minibatch_samples: int | None = None) -> dict[str, float]:
        """One GRPO update on `batch`; returns the step's metrics. Blocking: run it off the event loop.

        `minibatch_samples` overrides `global_batch_size` for this step: a resumed run replays a
        stored batch with the split it was trained with (`pipeline.checkpoints`), whatever the flag
        says now. The metrics carry the split used (`minibatch_samples`) for that record.
        """
        samples = batch.samples
        if not samples:
            raise ValueError(f"batch {batch.step} has no samples")
        trains, advantages = self._advantages(batch)
        t = self._tensors(samples, trains, advantages, self._train_version(batch))
        self.model.train()

        # The proximal policy: the weights before this batch's first optimizer step. With a single
        # step it equals the step's own (detached) log-probs, so the extra forward is skipped.
        minibatches = self._minibatches(len(samples), minibatch_samples)
        width = t.valid.shape[1]
        proximal: torch.Tensor | None = None
        if len(minibatches) > 1:
            proximal = torch.cat([self._logprobs_no_grad([samples[i] for i in mb], width) for mb in minibatches])
        totals: defaultdict[str, float] = defaultdict(float)
        if self.max_step_kl is not None:
            totals["step_kl_bound"] = self.max_step_kl  # the step_kl_* keys, every step (trainers.metrics)
        reference: torch.Tensor | None = None
        if self.reference is not None:
            started = time.perf_counter()
            reference = torch.cat(
                [self._logprobs_no_grad([samples[i] for i in mb], width, model=self.reference) for mb in minibatches]
            )
            totals["ref_log_probs_time"] = time.perf_counter() - started
        for mb in minibatches:
            self._minibatch_step(samples, mb, t, proximal, reference, totals)
        # The gradients are spent: freed now rather than at the next step's zero_grad, they do not
        # sit in GPU memory (the size of the parameters) while the engines generate, which a
        # colocated engine's KV cache shares (--colocate).
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        totals["lr"] = self.optimizer.param_groups[0]["lr"]
        if totals["step_kl_undone"]:
            # Said, not only counted: a run whose every step is undone trains nothing while its
            # loss and rewards look alive (the toy's --lr 5e-3 on a 0.6B model: 7-400 nats a step).
            log.warning(
                "optimizer steps undone by the step-KL bound: nothing of them trained",
                undone=int(totals["step_kl_undone"]),
                of=int(totals["step_kl_checked"]),
                proposed_kl=round(totals["step_kl_proposed"], 3),
                max_step_kl=self.max_step_kl,
                lr=totals["lr"],
                hint="steps this far are rare; when most are undone, lower --lr (or raise --max-step-kl)",
            )
        metrics = step_metrics(batch, trains, advantages, t.valid, t.mask, t.versions, totals, len(minibatches))
        metrics["minibatch_samples"] = float(len(minibatches[0]))  # the split, recorded for a replay
        return metrics

    def _minibatch_step(
        self,
        samples: list[Sample],
        mb: list[int],
        t: _Tensors,
        proximal: torch.Tensor | None,
        reference: torch.Tensor | None,
        totals: defaultdict[str, float],
    ) -> None:
        """Forward, loss and backward on the samples `mb`, a micro-batch at a time (gradients add
        up), then (when there is signal) one optimizer step."""
        s = self.loss
        width = t.valid.shape[1]
        micros = self._micro_batches(samples, mb)
        mb = [i for micro in micros for i in micro]  # their order, for the step check's tensors
        # Token-mean over micro-batches: each one's mean is weighted by its share of the trained
        # tokens of the whole minibatch, counted before the first backward.
        tokens = None
        if len(micros) > 1 and s.aggregation is LossAggregation.TOKEN_MEAN:
            tokens = self._trained_tokens(samples, mb, t, proximal)
        self.optimizer.zero_grad(set_to_none=True)
        has_signal = False
        before = []
        for micro in micros:
            index = torch.tensor(micro, device=self.device)
            behaviour, mask, adv = t.behaviour[index], t.mask[index], t.advantages[index]
            chosen = [samples[i] for i in micro]
            heads = sampler_heads(chosen, width, self.device) if s.score_centering else None
            out = self._response_logprobs(
                chosen, width, entropy_grad=s.entropy_coef != 0, head_ids=None if heads is None else heads.ids
            )
            logp, entropy = out.logp, out.entropy
            prox = logp.detach() if proximal is None else proximal[index]
            pl = L.policy_loss(
                s,
                current=logp,
                entropy=entropy,
                proximal=prox,
                behaviour=behaviour,
                mask=mask,
                advantages=adv,
                reference=None if reference is None else reference[index],
                train_head=out.head,
                sampler_head=None if heads is None else heads.logprobs,
                head_valid=None if heads is None else heads.valid,
            )
            share = 1.0
            if tokens is not None:
                share = float(pl.train.sum()) / max(tokens, 1.0)
            elif len(micros) > 1:
                share = len(micro) / len(mb)
            # A minibatch without signal (no token trains, or every advantage is 0 and no KL or
            # entropy term) takes no optimizer step: AdamW's momentum would otherwise move the
            # weights anyway. A micro-batch without signal adds no gradient, so it needs no backward.
            signal = bool((pl.train & (adv[:, None] != 0)).any()) or (s.regularised and bool(pl.train.any()))
            if signal:
                (pl.loss * share).backward()
            has_signal |= signal
            before.append(logp.detach())
            tally_minibatch(totals, pl, proximal=prox, behaviour=behaviour, mask=mask, entropy=entropy, scale=share)
        grad_norm = 0.0
        if has_signal:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
            if self.max_step_kl is None:
                self.optimizer.step()
            else:
                index = torch.tensor(mb, device=self.device)
                self._bounded_step([samples[i] for i in mb], torch.cat(before), t.mask[index], width, totals)
            totals["optimizer_steps"] += 1
        totals["grad_norm"] += grad_norm

    def _trained_tokens(
        self, samples: list[Sample], mb: list[int], t: _Tensors, proximal: torch.Tensor | None
    ) -> float:
        """How many tokens of the minibatch `mb` the loss trains (`loss.trained_mask`): one forward
        without gradient where the drops read the current log-probs."""
        s = self.loss
        index = torch.tensor(mb, device=self.device)
        drops = s.correction in (ImportanceCorrection.ICEPOP, ImportanceCorrection.SEQ_MASK)
        current = None
        opsm_reads_current = s.use_opsm and (s.opsm_against == "current" or proximal is None)
        if opsm_reads_current or (drops and proximal is None):
            current = self._logprobs_no_grad([samples[i] for i in mb], t.valid.shape[1])
        train = L.trained_mask(
            s,
            current=current,
            proximal=proximal[index] if proximal is not None else current,
            behaviour=t.behaviour[index],
            mask=t.mask[index],
            advantages=t.advantages[index],
        )
        return float(train.sum())

    def _bounded_step(
        self,
        mb_samples: list[Sample],
        before: torch.Tensor,
        mask: torch.Tensor,
        width: int,
        totals: defaultdict[str, float],
    ) -> None:
        """The optimizer step, halved while it moves the policy more than `max_step_kl` nats per
        token on this minibatch's trained tokens (`trainers.step_kl`)."""
        assert self.max_step_kl is not None

        def kl_after() -> float:
            return mean_k3(before, self._logprobs_no_grad(mb_samples, width), mask)

        params = [p for p in self.model.parameters() if p.requires_grad]
        check = bounded_step(params, self.optimizer.step, kl_after, max_kl=self.max_step_kl)
        totals["step_kl"] = max(totals["step_kl"], check.kl)
        totals["step_kl_proposed"] = max(totals["step_kl_proposed"], check.proposed_kl)
        totals["step_kl_halvings"] += check.halvings
        totals["step_kl_undone"] += check.undone
        totals["step_kl_checked"] += 1

    # ---- what trains, and with which advantage ------------------------------------------------

    def _advantages(self, batch: Batch) -> tuple[list[bool], list[float]]:
        """Per sample: whether it trains, and its group-normalised advantage (0 if it does not)."""
        s = self.loss
        trains: list[bool] = []
        advantages: list[float] = []
        for group in batch.groups:
            rewards: list[float | None] = []
            for sample in group.samples:
                if not _trains(sample):
                    rewards.append(None)
                    continue
                assert sample.reward is not None  # _trains checked it
                penalty = 0.0
                if s.overlong_buffer_len and s.max_response_len is not None:
                    penalty = L.overlong_penalty(
                        sample.response_len,
                        max_response_len=s.max_response_len,
                        buffer_len=s.overlong_buffer_len,
                        factor=s.overlong_penalty_factor,
                    )
                rewards.append(float(sample.reward) + penalty)
            trains += [r is not None for r in rewards]
            advantages += group_advantages(rewards, std_normalization=s.std_normalization)
        return trains, advantages

    def _train_version(self, batch: Batch) -> int:
        """The version being trained: the batch's, else the newest token version in it."""
        if batch.train_version is not None:
            return batch.train_version
        return max((sp.version for s in batch.samples for sp in s.spans), default=0)

    def _tensors(
        self, samples: Sequence[Sample], trains: Sequence[bool], advantages: Sequence[float], train_version: int
    ) -> _Tensors:
        n_resp = max((s.response_len for s in samples), default=0)
        behaviour = torch.zeros((len(samples), n_resp), dtype=torch.float32)
        versions = torch.zeros((len(samples), n_resp), dtype=torch.long)
        loss_mask = torch.zeros((len(samples), n_resp), dtype=torch.bool)
        valid = torch.zeros((len(samples), n_resp), dtype=torch.bool)
        for i, (s, t) in enumerate(zip(samples, trains, strict=True)):
            r = s.response_len
            valid[i, :r] = True
            behaviour[i, :r] = column_tensor(s.logprobs, torch.float32)
            versions[i, :r] = torch.tensor(s.token_versions(), dtype=torch.long)
            truncated_out = self.loss.mask_truncated_samples and s.status is SampleStatus.TRUNCATED
            if t and not truncated_out:
                loss_mask[i, :r] = column_tensor(s.loss_mask, torch.bool)
        mask = self.token_mask(versions, valid, loss_mask, train_version)
        adv = torch.tensor(advantages, dtype=torch.float32)
        return _Tensors(*(x.to(self.device) for x in (behaviour, versions, valid, mask, adv)))

    def token_mask(
        self, versions: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor, train_version: int
    ) -> torch.Tensor:
        """The loss mask with the version masks applied (see `trainers.loss`)."""
        mask = valid & loss_mask
        if self.loss.mask_offpolicy_in_partial_rollout:
            mask &= L.newest_version_mask(versions, valid)
        if self.loss.mask_stale_tokens is not None:
            mask &= L.stale_token_mask(
                versions, valid, train_version=train_version, max_lag=self.loss.mask_stale_tokens
            )
        return mask

    def loss_mask(self, sample: Sample, *, train_version: int | None = None) -> list[int]:
        """One sample's effective loss mask (the loss mask and the version masks), for inspection."""
        r = sample.response_len
        versions = torch.tensor([sample.token_versions()], dtype=torch.long).reshape(1, r)
        valid = torch.ones((1, r), dtype=torch.bool)
        loss_mask = column_tensor(sample.loss_mask, torch.bool).reshape(1, r)
        newest = max((sp.version for sp in sample.spans), default=0)
        mask = self.token_mask(versions, valid, loss_mask, newest if train_version is None else train_version)
        return [int(x) for x in mask[0].tolist()]

    def _minibatches(self, n: int, size: int | None = None) -> list[list[int]]:
        size = size or self.global_batch_size or n
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]

    # ---- the trainer's view of log-probs -----------------------------------------------------

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Log-prob of every response token under the current weights, at the trainer's temperature."""
        if not samples:
            return []
        logp = self._logprobs_no_grad(list(samples), max(s.response_len for s in samples))
        return [logp[i, : s.response_len].tolist() for i, s in enumerate(samples)]

    @torch.no_grad()
    def importance_weights(self, samples: Sequence[Sample]) -> list[list[float]]:
        """The importance weight of every response token against the current weights, as trained."""
        if not samples:
            return []
        t = self._tensors(samples, [True] * len(samples), [0.0] * len(samples), 0)
        logp = self._response_logprobs(samples).logp
        every = dataclasses.replace(self.loss, mask_offpolicy_in_partial_rollout=False, mask_stale_tokens=None)
        iw = L.importance_weights(logp, t.behaviour, t.valid, every)
        return [iw.weight[i, : s.response_len].tolist() for i, s in enumerate(samples)]

    @torch.no_grad()
    def _logprobs_no_grad(
        self, samples: list[Sample], width: int, *, model: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """[B, width] log-probs of `samples` without gradient, a micro-batch at a time."""
        micros = self._micro_batches(samples, range(len(samples)))
        parts = [self._response_logprobs([samples[i] for i in micro], width, model=model).logp for micro in micros]
        order = torch.tensor([i for micro in micros for i in micro], device=self.device)
        return torch.cat(parts).index_select(0, torch.argsort(order))  # back in the samples' order

    def _micro_batches(self, samples: Sequence[Sample], indices: Sequence[int]) -> list[list[int]]:
        return micro_batches(samples, indices, max_samples=self.micro_batch_size, max_tokens=self.max_tokens_per_gpu)

    def _response_logprobs(
        self,
        samples: Sequence[Sample],
        width: int | None = None,
        *,
        model: torch.nn.Module | None = None,
        entropy_grad: bool = False,
        head_ids: torch.Tensor | None = None,
    ) -> _Scored:
        """[B, R] log-probs of each response token and the entropy at each position; 0 past the end.

        One forward over prompt+response: packed without padding where the model allows it
        (`trainers.packed_attention`), else right-padded, where causal attention means padding never
        changes a real token's logits. Only the rows that predict response tokens reach the LM head
        and the softmax (`trainers.response_rows`): with a real vocabulary (150k), logits at every
        position of a padded batch are where time and memory go.
        `width` pads R to the whole batch's, so minibatches line up with the batch's tensors.
        `model` is the policy unless given (the reference model); the entropy carries a gradient
        only with `entropy_grad` (an entropy term in the loss). `head_ids` [B, R, k] (SC): the
        log-probs at those ids too, with gradient.
        """
        n_resp = max(s.response_len for s in samples) if width is None else width
        net = model or self.model
        laid = ResponseBatch.of(samples, self.pad_id, packed=self.pack and packs(net))
        b = laid.to(self.device)
        at = (b.sample, b.position)  # where each scored token goes in the [B, R] results

        replay = self.routing_replay.get(id(net))
        plan = None
        if replay is not None:  # the routes of the padded layout, picked at the packed tokens' places
            plan = replay_plan(samples, max(map(sample_tokens, samples)), layers=replay.layers, top_k=replay.top_k)
            if laid.layout is not None:
                plan = plan.index_select(0, laid.layout.padded_rows())
            plan = plan.to(self.device)
        with (
            torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast),
            replay.replaying(plan) if replay is not None else contextlib.nullcontext(),
        ):
            # [N, V]: only the N rows that predict a response token reach the LM head. No padding
            # mask: the batch is right-padded, so under the causal mask no real token attends to a
            # pad. Passed one, SDPA gets an explicit [B, 1, L, L] mask instead of `is_causal`: no
            # flash kernel, K and V copied for every query head (GQA's `repeat_kv`), and, on an H100 or
            # H200, cuDNN's attention, which builds a graph for each new length (a long-tailed batch's
            # micro-batches each have one).
            logits = response_logits(net, b.ids, None, b.rows, b.layout)
        # Chunked, with the gradient in closed form: no fp32 [N, V] is kept (trainers.token_scores).
        picked = None if head_ids is None else head_ids[at]
        logp, entropy, head = token_scores(logits, b.targets, self.temperature, picked, compiled=self.compiled_scores)
        if not entropy_grad:
            entropy = entropy.detach()
        shape = (len(samples), n_resp)
        return _Scored(
            logp.new_zeros(shape).index_put(at, logp),
            entropy.new_zeros(shape).index_put(at, entropy),
            None if head is None else head.new_zeros((*shape, head.shape[-1])).index_put(at, head),
        )

    # ---- publishing weights ------------------------------------------------------------------

    def save_weights(self, path: str | os.PathLike[str]) -> Path:
        """Write the full checkpoint at `path` (replacing one that is there); return it.

        The model as a Hugging Face folder, plus the optimizer state and the random state in
        `path/optimizer/`, written whole or not at all (`trainers.checkpoint`).
        """

        def fill(folder: Path) -> None:
            self.model.save_pretrained(folder)
            save_optimizer(
                self.optimizer, optimizer_param_names(self.model, self.optimizer), self.steps, folder / OPTIMIZER_DIR
            )
            save_rng_state(folder / OPTIMIZER_DIR)

        return write_folder_atomically(Path(path), self._folder_files, fill)

    def save_model(self, path: str | os.PathLike[str]) -> Path:
        """Write the weights only (what an engine loads; no optimizer state) at `path`, atomically.

        A third of a full checkpoint's bytes with AdamW (weights, two moments): what the launcher
        publishes between checkpoints (`--save-interval`). A trainer computing under bf16 autocast
        writes them in bf16 (`config.json` says so): its matmuls already see the weights rounded
        so, an engine serving bf16 rounds them the same way, and it is half the bytes to write and
        read (1.2 GB against 2.4 for a 0.6B model). The full checkpoint keeps the fp32 masters.
        One safetensors file through a reused host buffer (`weights_file.py`): the write is on the
        async training step's critical path."""
        dtype = torch.bfloat16 if self.autocast else None

        def fill(folder: Path) -> None:
            state: dict[str, torch.Tensor] = {}
            seen: set[tuple[int, torch.Size, torch.dtype]] = set()
            for name, t in self.model.state_dict().items():
                tied = (t.data_ptr(), t.shape, t.dtype)
                if tied in seen:  # a tied weight (the LM head): the file holds it once, as HF's do
                    continue
                seen.add(tied)
                state[name] = t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()
            self._weights_file.write(folder / "model.safetensors", state)
            self.model.config.save_pretrained(folder)
            if getattr(self.model, "generation_config", None) is not None and self.model.can_generate():
                self.model.generation_config.save_pretrained(folder)
            if dtype is not None:
                config = json.loads((folder / "config.json").read_text())
                config["dtype" if "dtype" in config else "torch_dtype"] = "bfloat16"
                (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

        return write_folder_atomically(Path(path), self._folder_files, fill)

    def hf_weights(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameters, under Hugging Face names already: what a distributed publish
        sends (`stages.sglang_client.publish_distributed`), read afresh at each publish."""
        return self.model.named_parameters()

    def close(self) -> None:
        """Nothing to release: one process, no ranks (the launcher closes every trainer it built)."""


def _check_arguments(
    *,
    dtype: str,
    temperature: float,
    global_batch_size: int | None,
    micro_batch_size: int | None,
    max_tokens_per_gpu: int | None,
    max_step_kl: float | None,
) -> None:
    """Refuse the constructor's arguments that no model folder could make right."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (greedy sampling has no log-probs to train on), got {temperature}")
    if global_batch_size is not None and global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1 samples or None, got {global_batch_size}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 samples or None (the whole minibatch), got {micro_batch_size}")
    if max_tokens_per_gpu is not None and max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu must be >= 1 positions or None (no budget), got {max_tokens_per_gpu}")
    if max_step_kl is not None and max_step_kl <= 0:
        raise ValueError(f"max_step_kl must be > 0 nats or None (no bound), got {max_step_kl}")


def _load_policy(model_path: Path, device: torch.device) -> PreTrainedModel:
    """The policy to train, from the HF folder `model_path`, on `device` in train mode."""
    from transformers import AutoModelForCausalLM

    # fp32 master weights: the tiny model trains on CPU, where bf16 buys nothing.
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    # `PreTrainedModel.to` is a `functools.wraps` wrapper that mypy cannot bind to its instance;
    # typed as a Module the same method runs, moving the parameters in place.
    module: torch.nn.Module = model
    module.to(device)
    model.train()  # no dropout in Qwen3 by default, so train/eval give the same log-probs
    return model


def _with_legacy_keywords(
    loss: LossSettings, eps_clip: object, eps_clip_high: object, tis_cap: object, mask_offpolicy: object
) -> LossSettings:
    """`loss` with the keywords the trainer took before `LossSettings` existed applied over it."""
    changes: dict[str, object] = {}
    if eps_clip is not _UNSET:
        changes["eps_clip"] = eps_clip
    if eps_clip_high is not _UNSET:
        changes["eps_clip_high"] = eps_clip_high
    if tis_cap is not _UNSET:
        if tis_cap is None:
            changes["correction"] = ImportanceCorrection.NONE
        elif not isinstance(tis_cap, int | float) or tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 or None, got {tis_cap}")
        else:
            changes["tis_clip"] = float(tis_cap)
    if mask_offpolicy is not _UNSET:
        changes["mask_offpolicy_in_partial_rollout"] = bool(mask_offpolicy)
    return dataclasses.replace(loss, **changes) if changes else loss  # type: ignore[arg-type]
