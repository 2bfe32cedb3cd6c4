"""A batch as flat rows for the megatron ranks, and the shared loss (`trainers.loss`) on them.

Rank 0 turns a `Batch` into `Row`s (one per sample: tokens, behaviour log-probs, the token mask
after every rule, the advantage) with the shared functions: advantages with the overlong penalty,
the loss mask, truncated samples, the newest-version and staleness masks. Followers receive only
rows (orjson). On every rank, `micro_batch_loss` lays a packed micro-batch out [sample, position]
and runs exactly the torch trainer's minibatch body (`trainers.grpo`): importance weights,
OPSM, PPO clip, aggregation. Aggregation over micro-batches and data-parallel ranks is composed
exactly: each micro-batch's `aggregate` is scaled by its share of its minibatch's tokens
(token-mean) or samples (the two per-sequence modes); a minibatch is the samples of one optimizer
step (`--global-batch-size`; the trainer's own default, None, is the whole rollout batch).
"""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.types import Batch, Sample, SampleStatus
from trainers import loss as L
from trainers.columns import column_tensor
from trainers.loss import LossAggregation, LossSettings
from trainers.metrics import tally_minibatch

__all__ = ["Heads", "Row", "batch_rows", "micro_batch_heads", "micro_batch_loss", "step_metrics"]

TOTALS = (
    "loss",
    "pg_loss",
    "kl_loss",
    "entropy_loss",
    "trained_tokens",
    "masked_tokens",
    "clipped",
    "entropy",
    "kl_k3",
    "abs_diff",
    "weight_sum",
    "tis_clipped",
    "is_dropped",
    "applied_weight",
    "opsm_dropped",
    "signal",
)


@dataclass(frozen=True, slots=True)
class Row:
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour: list[float]
    mask: list[bool]  # the token trains (every mask applied); all False for a sample that does not train
    advantage: float
    # R3: the response tokens' routes as stored, [item code, base64 of the packed little-endian
    # [tokens, layers, top_k] ids] (`core.columns.TokenRoutes`; JSON carries it to the ranks, a
    # quarter of int32's bytes for <= 255 experts); None when the trainer does not replay routes
    # or the sample has none.
    routes: list[str] | None = None
    # SC: the sampler's top-k head of each response token: [k, ids (<i4), log-probs (<f8)], the
    # bytes in base64; None when the loss does not center scores or the sample has no heads.
    heads: list[Any] | None = None

    @classmethod
    def of(
        cls,
        s: Sample,
        mask: Sequence[bool] | None = None,
        advantage: float = 0.0,
        *,
        route_shape: tuple[int, int] | None = None,
        heads: bool = False,
    ) -> Row:
        """`route_shape` (layers, top k of the trained model): carry the sample's routes (R3);
        `heads`: carry its sampler heads (SC)."""
        if not s.prompt_ids:
            raise ValueError(f"sample {s.index} has an empty prompt: nothing predicts its first token")
        return cls(
            list(s.prompt_ids),
            s.response_ids.tolist(),
            s.logprobs.tolist(),
            list(mask) if mask is not None else [False] * s.response_len,
            advantage,
            _routes(s, route_shape),
            _heads(s) if heads else None,
        )

    def to_json(self) -> list[Any]:
        return [self.prompt_ids, self.response_ids, self.behaviour, self.mask, self.advantage, self.routes, self.heads]

    @classmethod
    def from_json(cls, raw: list[Any]) -> Row:
        return cls(*raw)


def _routes(s: Sample, shape: tuple[int, int] | None) -> list[str] | None:
    """The sample's routes for a row ([code, base64]), checked against the trained model's `shape`."""
    routes = s.routes
    if shape is None or routes is None or not len(routes):
        return None
    if (routes.layers, routes.top_k) != shape:
        raise ValueError(
            f"sample {s.index}: its routes are {routes.layers} layers x top-{routes.top_k}, the trained model "
            f"routes {shape[0]} layers x top-{shape[1]} (rollout and trainer models differ?)"
        )
    if len(routes) > s.response_len:
        raise ValueError(f"sample {s.index}: {len(routes)} route rows for {s.response_len} response tokens")
    return [routes.code, base64.b64encode(routes.data).decode("ascii")]


def _heads(s: Sample) -> list[Any] | None:
    h = s.heads
    if h is None or not len(h):
        return None
    if len(h) > s.response_len:
        raise ValueError(f"sample {s.index}: {len(h)} sampler-head rows for {s.response_len} response tokens")
    return [h.k, base64.b64encode(h.token_ids_data).decode("ascii"), base64.b64encode(h.logprobs_data).decode("ascii")]


@dataclass(frozen=True, slots=True)
class Heads:
    """The sampler heads of a micro-batch's response tokens, back to back as `packing` lays them out."""

    ids: torch.Tensor  # [N, k] long; 0 where a token has no head (see `valid`)
    logprobs: torch.Tensor  # [N, k] the sampler's log-probs at `ids`
    valid: torch.Tensor  # [N] bool: the token has a head from a sampler


def micro_batch_heads(rows: Sequence[Row], device: torch.device) -> Heads:
    """The rows' heads as tensors (the torch trainer's `sampler_heads`, flat): a row without heads,
    or a head row of id -1 (environment tokens), has none there."""
    import numpy as np

    k = next((int(r.heads[0]) for r in rows if r.heads is not None), 1)
    n = sum(len(r.response_ids) for r in rows)
    ids = torch.zeros((n, k), dtype=torch.long)
    logprobs = torch.zeros((n, k), dtype=torch.float32)
    valid = torch.zeros(n, dtype=torch.bool)
    at = 0
    for r in rows:
        if r.heads is not None:
            if int(r.heads[0]) != k:
                raise ValueError(f"sampler heads of top-{r.heads[0]} in a micro-batch of top-{k} heads")
            got = np.frombuffer(base64.b64decode(r.heads[1]), dtype="<i4").astype(np.int64).reshape(-1, k)
            lps = np.frombuffer(base64.b64decode(r.heads[2]), dtype="<f8").astype(np.float32).reshape(-1, k)
            m = len(got)
            ids[at : at + m] = torch.from_numpy(got).clamp(min=0)
            logprobs[at : at + m] = torch.from_numpy(lps)
            valid[at : at + m] = torch.from_numpy((got >= 0).all(axis=-1))
        at += len(r.response_ids)
    return Heads(ids.to(device), logprobs.to(device), valid.to(device))


def _trains(s: Sample) -> bool:
    if s.status is SampleStatus.FAILED:
        return False
    if not s.status.finished or s.reward is None:
        raise ValueError(
            f"sample {s.index} is {s.status.value} with reward {s.reward}: a batch holds only "
            "finished samples with rewards, or failed ones"
        )
    return True


def batch_rows(
    batch: Batch, settings: LossSettings, *, route_shape: tuple[int, int] | None = None
) -> tuple[list[Row], list[bool], list[list[int]]]:
    """Rows, whether each sample trains, and each sample's token versions (for the metrics).
    `route_shape`: the rows carry the samples' routes (R3, `Row.of`)."""
    s = settings
    train_version = (
        batch.train_version
        if batch.train_version is not None
        else max((sp.version for x in batch.samples for sp in x.spans), default=0)
    )
    rows: list[Row] = []
    trains: list[bool] = []
    versions: list[list[int]] = []
    for group in batch.groups:
        rewards: list[float | None] = []
        for x in group.samples:
            penalty = 0.0
            if _trains(x) and s.overlong_buffer_len and s.max_response_len is not None:
                penalty = L.overlong_penalty(
                    x.response_len,
                    max_response_len=s.max_response_len,
                    buffer_len=s.overlong_buffer_len,
                    factor=s.overlong_penalty_factor,
                )
            rewards.append(float(x.reward) + penalty if _trains(x) else None)  # type: ignore[arg-type]
        advantages = L.group_advantages(rewards, std_normalization=s.std_normalization)
        for x, reward, adv in zip(group.samples, rewards, advantages, strict=True):
            v = torch.tensor([x.token_versions()], dtype=torch.long).reshape(1, x.response_len)
            valid = torch.ones_like(v, dtype=torch.bool)
            mask = column_tensor(x.loss_mask, torch.bool).reshape(1, x.response_len) & valid
            if reward is None or (s.mask_truncated_samples and x.status is SampleStatus.TRUNCATED):
                mask &= False
            if s.mask_offpolicy_in_partial_rollout:
                mask &= L.newest_version_mask(v, valid)
            if s.mask_stale_tokens is not None:
                mask &= L.stale_token_mask(v, valid, train_version=train_version, max_lag=s.mask_stale_tokens)
            rows.append(Row.of(x, mask[0].tolist(), adv, route_shape=route_shape, heads=s.score_centering))
            trains.append(reward is not None)
            versions.append(x.token_versions())
    return rows, trains, versions


def _padded(rows: Sequence[Row], flat: torch.Tensor) -> torch.Tensor:
    """[B, R, ...] from the rows' response tokens back to back [N, ...] (0 past each row's end)."""
    width = max((len(r.response_ids) for r in rows), default=0)
    out = flat.new_zeros((len(rows), width, *flat.shape[1:]))
    at = 0
    for i, r in enumerate(rows):
        n = len(r.response_ids)
        out[i, :n] = flat[at : at + n]
        at += n
    return out


def _row_tensors(
    rows: Sequence[Row], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Behaviour log-probs and the token mask [B, width], and the advantages [B]."""
    behaviour = torch.tensor([r.behaviour + [0.0] * (width - len(r.behaviour)) for r in rows], device=device)
    mask = torch.tensor([r.mask + [False] * (width - len(r.mask)) for r in rows], dtype=torch.bool, device=device)
    adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device)
    return behaviour, mask, adv


def micro_batch_loss(
    settings: LossSettings,
    rows: Sequence[Row],
    logp_flat: torch.Tensor,
    entropy_flat: torch.Tensor,
    *,
    batch_tokens: float,
    batch_samples: int,
    totals: defaultdict[str, float],
    proximal_flat: torch.Tensor | None = None,
    reference_flat: torch.Tensor | None = None,
    train_head_flat: torch.Tensor | None = None,
    heads: Heads | None = None,
) -> torch.Tensor:
    """This micro-batch's part of its minibatch's loss (backward it), adding its sums to `totals`.

    `batch_tokens` and `batch_samples` are the minibatch's (one optimizer step's) token count and
    sample count. `proximal_flat`: the log-probs recomputed before the rollout batch's first
    optimizer step (several steps per batch); None means one step, where the proximal policy is
    the current one. `reference_flat`: the reference model's log-probs (`--use-kl-loss`).
    `train_head_flat` [N, k] (with gradient) and `heads`: SC's trainer and sampler heads.
    """
    s, device = settings, logp_flat.device
    logp, entropy = _padded(rows, logp_flat), _padded(rows, entropy_flat)
    behaviour, mask, adv = _row_tensors(rows, logp.shape[1], device)
    prox = logp.detach() if proximal_flat is None else _padded(rows, proximal_flat)
    pl = L.policy_loss(
        s,
        current=logp,
        entropy=entropy,
        proximal=prox,
        behaviour=behaviour,
        mask=mask,
        advantages=adv,
        reference=None if reference_flat is None else _padded(rows, reference_flat),
        train_head=None if train_head_flat is None else _padded(rows, train_head_flat),
        sampler_head=None if heads is None else _padded(rows, heads.logprobs),
        head_valid=None if heads is None else _padded(rows, heads.valid),
    )
    share = (
        float(pl.train.float().sum()) / max(batch_tokens, 1.0)
        if s.aggregation is LossAggregation.TOKEN_MEAN
        else len(rows) / batch_samples
    )
    signal = pl.train & (adv[:, None] != 0)
    totals["signal"] += float((pl.train if s.regularised else signal).sum())
    tally_minibatch(totals, pl, proximal=prox, behaviour=behaviour, mask=mask, entropy=entropy, scale=share)
    return pl.loss * share


def step_metrics(
    batch: Batch,
    rows: Sequence[Row],
    trains: Sequence[bool],
    versions: Sequence[Sequence[int]],
    totals: defaultdict[str, float],
    grad_norm_sum: float,
    optimizer_steps: int,
    n_minibatches: int,
) -> dict[str, float]:
    """The torch trainer's metrics (`trainers.metrics`) from the ranks' summed totals.

    `grad_norm_sum` adds the norm of every optimizer step taken (`optimizer_steps` of them) over the
    batch's `n_minibatches`, as the torch trainer counts them."""
    from trainers.metrics import step_metrics as shared

    width = max((len(r.response_ids) for r in rows), default=0)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    token_versions = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, v) in enumerate(zip(rows, versions, strict=True)):
        n = len(r.response_ids)
        valid[i, :n] = True
        mask[i, :n] = torch.tensor(r.mask, dtype=torch.bool)
        token_versions[i, :n] = torch.tensor(list(v), dtype=torch.long)
    summed: defaultdict[str, float] = defaultdict(float, totals)
    summed["grad_norm"] = grad_norm_sum
    summed["optimizer_steps"] = float(optimizer_steps)
    return shared(batch, trains, [r.advantage for r in rows], valid, mask, token_versions, summed, n_minibatches)


def trained_token_count(
    settings: LossSettings, rows: Sequence[Row], logp_flat: torch.Tensor, proximal_flat: torch.Tensor | None = None
) -> float:
    """How many tokens of these rows the loss keeps once IcePop, seq-mask and OPSM have dropped theirs.

    The token-mean denominator when those drops are on: they depend on the log-probs (IcePop and
    seq-mask on the proximal ones, OPSM on the current ones), so the ranks count in a forward pass
    before the one that trains.
    """
    s, device = settings, logp_flat.device
    logp = _padded(rows, logp_flat)
    prox = logp if proximal_flat is None else _padded(rows, proximal_flat)
    behaviour, mask, adv = _row_tensors(rows, logp.shape[1], device)
    train = L.trained_mask(s, current=logp, proximal=prox, behaviour=behaviour, mask=mask, advantages=adv)
    return float(train.sum())
