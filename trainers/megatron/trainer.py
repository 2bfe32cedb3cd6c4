"""The megatron-core GRPO trainer: the torch trainer's step, on megatron ranks.

One module, over 600 lines: every rank runs the same code in the same order so that collectives
meet, and keeping that code in one file keeps the order visible; commands, checkpoints, the
layout and the fp32 masters are modules beside it.

Same protocol as `trainers.GRPOTrainer` (`train_step(batch) -> metrics`,
`save_weights(path) -> path`, `logprobs(samples)`), same loss, same checkpoint promise: a folder
that engines load with `update_weights_from_disk`, written whole or not at all, plus the
optimizer state, saved before the controller commits the step. For `--update-weight-transport
distributed`, `hf_weights()` hands the publisher the same HF tensors, gathered over TP.

Ranks. Every rank is one process with this object in it. Rank 0 lives in the controller's
process; the others run `follow()` (started by `launch.megatron_ranks`). Rank 0 turns each
request into a command and broadcasts it over the world group (`commands.py`: orjson, never
pickle); then every rank runs the same code, so their collectives meet. Rank 0 alone does what
needs the Batch (advantages, masks, reward metrics), so followers receive plain rows of numbers.

The loss is `trainers.loss`, run on each micro-batch by `rows.micro_batch_loss` exactly as
the torch trainer runs it on a minibatch. A rollout batch takes one optimizer step per
`global_batch_size` samples (`--global-batch-size`, half the batch by default, as for the torch
trainer); with several, the proximal log-probs are recomputed once before the first, and the PPO
clip of the later steps acts against them.

Parallelism: tensor and pipeline parallel from megatron-core's `parallel_state`, data parallel =
world / (TP x PP) (`layout.py`, with the collectives over them). Each DP rank takes every DP-th row
of each minibatch; the loss is normalised by the minibatch's token count, and gradients are summed
over the DP group (`grads.py`), so each step equals the single-process step. Micro-batches of
`micro_batch_size` rows (and at most `max_tokens_per_gpu` tokens) are packed into one sequence
(`packing.py`). Pipeline parallel
(`--pipeline-model-parallel-size`): each stage holds `num_layers / pp` layers (`qwen3.py`); a
minibatch's micro-batches go through the stages forward, then backward (`schedule.py`: our own
schedule, since megatron-core's allocates on CUDA; the docstring says where). The loss, the
log-probs and the step's totals exist on the last stage; the totals and log-probs are broadcast from
it over the pipeline group, so rank 0 (first stage, the controller's process) reports them and every
stage makes the same step-or-skip decision. The gradient norm is summed over TP and PP ranks. A save
joins the stages on rank 0 (`checkpoint.py`), so the HF folder is the one a run without PP writes. A
tied embedding is kept as two equal copies on the first and last stage (their gradients summed,
`grads.py`).

Precision (`dtype`, `--trainer-dtype`): float32, or bfloat16 parameters with fp32 master weights,
fp32 gradient accumulation and fp32 AdamW state (`master.py`), megatron's mixed-precision recipe.
Optimizer: by default torch AdamW on each rank's shard, with the gradient collectives of
`grads.py`. With `distributed_optimizer` (`--use-distributed-optimizer`, GPU ranks only: under
0.16.1, the CPU ranks CI runs, megatron allocates these buffers on CUDA) the model is wrapped in
megatron-core's DDP and stepped by its distributed optimizer (`distopt.py`): the same step, with
the optimizer state sharded over data parallel. Not with pipeline parallel (refused at config load:
it would need megatron's schedule hooks and its `finalize_model_grads` across stages).

MoE (a qwen3_moe folder, `moe.py`), with expert parallel (`--expert-model-parallel-size`: each
rank holds num_experts / EP experts per layer; every forward is then a collective of the EP group,
so its ranks run as many micro-batches, padded to equal lengths). Under TP an MoE model runs
megatron's sequence parallel (`qwen3.sequence_parallel`): packed sequences are padded to a multiple
of TP, each TP rank's layers between the attention and MLP blocks see 1 / TP of the positions (and
its routers, so R3's plan is cut the same way), and the replicated parameters' gradients are
summed over TP (`grads.py`). R3 (`routing_replay`,
`--use-rollout-routing-replay`): rows' routes are replayed through megatron-core's RouterReplay
(`router_replay.py`). SC: the loss scores the rows' sampler heads over the TP-split vocabulary
(`packing.sampler_head_logprobs`).

Reference model (`--use-kl-loss`): a second GPTModel with the same TP/PP layout, frozen, loaded
from `ref_path` (the run's initial weights, or `--ref-load`); each rank holds its own shard and
runs one forward without gradient per micro-batch per rollout batch, before the first optimizer
step. Its log-probs live on the last stage, where the loss is. It is rebuilt from `ref_path` on
a restart, never saved.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from core.types import Batch, Sample
from trainers.checkpoint import OPTIMIZER_DIR, model_folder_files, write_folder_atomically
from trainers.loss import ImportanceCorrection, LossAggregation, LossSettings
from trainers.megatron.checkpoint import (
    config_files,
    gather_experts,
    gather_full_state,
    gather_stages,
    load_hf_weights,
    load_optimizer_shard,
    save_optimizer_shard,
    write_hf_weights,
)
from trainers.megatron.commands import Command as _Command
from trainers.megatron.commands import broadcast_command, receive_command
from trainers.megatron.distopt import DistributedOptimizer
from trainers.megatron.grads import clip_gradients, reduce_gradients
from trainers.megatron.layout import (
    Layout,
    comm_device,
    dp_group,
    from_last_stage,
    sum_over_dp,
    tensor_from_last_stage,
)
from trainers.megatron.master import MasterWeights
from trainers.megatron.packing import Packed, head_logprobs, pack, packs, sampler_head_logprobs
from trainers.megatron.qwen3 import Qwen3Shape, build_gpt_model, global_names, megatron_to_hf, sequence_parallel
from trainers.megatron.router_replay import ReplayedRouters, plan
from trainers.megatron.rows import (
    Row,
    batch_rows,
    micro_batch_heads,
    micro_batch_loss,
    step_metrics,
    trained_token_count,
)
from trainers.megatron.schedule import InFlight, Stage, backward, forward
from trainers.step_settings import StepSettings

__all__ = ["OPTIMIZER_DIR", "MegatronTrainer"]

# `--trainer-dtype`: what the model computes in; the optimizer always steps fp32 weights (master.py).
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class _StepTotals:
    """What one `train_step` adds up over its minibatches (the same on every rank)."""

    totals: defaultdict[str, float]
    grad_norm_sum: float
    optimizer_steps: int
    minibatches: int


def _check_arguments(
    *,
    temperature: float,
    dtype: str,
    micro_batch_size: int,
    max_tokens_per_gpu: int | None,
    global_batch_size: int | None,
    distributed_optimizer: bool,
    device: str,
) -> None:
    """Refuse the constructor's arguments that no model folder could make right."""
    from megatron.core import parallel_state as ps

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens_per_gpu is not None and max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu must be >= 1 tokens or None (no budget), got {max_tokens_per_gpu}")
    if global_batch_size is not None and global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1 samples or None, got {global_batch_size}")
    if distributed_optimizer and ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "distributed_optimizer with pipeline parallel is not supported: the pipeline runs "
            "its own schedule, without megatron's DDP hooks across stages; use one of the two"
        )
    if distributed_optimizer and torch.device(device).type == "cpu":
        raise ValueError(
            "distributed_optimizer needs GPU ranks (device='cuda'): megatron-core allocates its "
            f"DDP buffers on the GPU; got device={device!r}"
        )


def _read_shape(model_path: Path, layout: Layout, *, routing_replay: bool) -> Qwen3Shape:
    """The model folder's shape, checked against this rank's parallel layout (and R3's routers)."""
    from transformers import AutoConfig

    shape = Qwen3Shape.from_hf(AutoConfig.from_pretrained(model_path))
    shape.check_tensor_parallel(layout.tp)
    if routing_replay and not shape.moe:
        raise ValueError("--use-rollout-routing-replay: the model has no MoE layers (no routers) to replay routes in")
    shape.check_pipeline_parallel(layout.pp)
    shape.check_expert_parallel(layout.ep)
    return shape


class _BuiltOptimizer(NamedTuple):
    """What `_build_optimizer` makes: the model to run forward and backward through, and either
    megatron's distributed optimizer or the hand-rolled master weights with their AdamW."""

    model: torch.nn.Module
    distopt: DistributedOptimizer | None
    master: MasterWeights | None
    optimizer: torch.optim.AdamW | None


def _build_optimizer(
    model: torch.nn.Module,
    fp32: dict[str, torch.Tensor],
    *,
    distributed: bool,
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
    bf16: bool,
) -> _BuiltOptimizer:
    """The optimizer over `model`, whose weights were just loaded; `fp32` is their fp32 copy as read."""
    if distributed:
        fp32.clear()  # megatron builds its fp32 masters from the model's weights: free ours first
        distopt = DistributedOptimizer(model, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm, bf16=bf16)
        # Forward and backward through megatron's DDP wrapper.
        return _BuiltOptimizer(distopt.module, distopt, None, None)
    # What the optimizer steps: the parameters themselves in fp32, their fp32 masters in bf16.
    master = MasterWeights(model, fp32)
    optimizer = torch.optim.AdamW([p for _, p in master.named()], lr=lr, weight_decay=weight_decay)
    return _BuiltOptimizer(model, None, master, optimizer)


class MegatronTrainer:
    """GRPO on a megatron-core GPTModel built from the Qwen3 folder `model_path`.

    torch.distributed must be initialised (gloo on CPU, NCCL on GPU) and megatron's model
    parallel state set up (`launch.megatron_ranks.init_rank` does both) before construction, on
    every rank, with the same arguments.
    """

    # No torch autocast: the engines are sent the weights as `hf_weights` gives them.
    autocast = False

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        loss: LossSettings | None = None,
        global_batch_size: int | None = None,
        lr: float = 5e-3,
        temperature: float = 1.0,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        micro_batch_size: int = 8,
        max_tokens_per_gpu: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        num_threads: int | None = 1,
        distributed_optimizer: bool = False,
        ref_path: str | os.PathLike[str] | None = None,
        routing_replay: bool = False,
    ) -> None:
        _check_arguments(
            temperature=temperature,
            dtype=dtype,
            micro_batch_size=micro_batch_size,
            max_tokens_per_gpu=max_tokens_per_gpu,
            global_batch_size=global_batch_size,
            distributed_optimizer=distributed_optimizer,
            device=device,
        )
        if num_threads is not None and device == "cpu":
            torch.set_num_threads(num_threads)
        self.model_path = Path(model_path)
        # Read now: the folder may be a checkpoint that retention deletes before the next save.
        self._folder_files = model_folder_files(self.model_path)
        self._config_files = config_files(self.model_path)
        self.loss = loss or LossSettings()
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.global_batch_size = global_batch_size
        self.device = torch.device(device)
        self.layout = Layout.current()
        self.stage = Stage.current()
        self.shape = _read_shape(self.model_path, self.layout, routing_replay=routing_replay)
        # megatron-core's MoE layers need sequence parallel under TP (qwen3.sequence_parallel).
        self._sequence_parallel = sequence_parallel(self.shape, self.layout.tp)
        # R3: (layers, top k) of the routes rows carry; None when routes are not replayed.
        self._route_shape = (self.shape.num_layers, self.shape.moe_top_k) if routing_replay else None
        self.dtype = _DTYPES[dtype]
        self.model = self._build_model()
        # This stage's parameter names -> the full model's; the last stage's copy of a tied
        # embedding (PP > 1) is neither saved nor counted twice in the gradient norm.
        self._names = global_names(self.model, self.shape)
        self._tied_copy = frozenset(n for n, full in self._names.items() if n == "output_layer.weight" and full != n)
        fp32 = load_hf_weights(self.model, self.model_path, self.shape, tp_rank=self.layout.tp_rank, tp=self.layout.tp)
        self.lr = lr
        # R3: the policy's and the reference's routers replay the same routes (router_replay.py).
        self._replays = {"policy": ReplayedRouters(self.model)} if routing_replay else {}
        # The KL term's frozen reference: loaded now if the loss needs it, or when a later step's
        # settings do (`use_settings`).
        self.reference: torch.nn.Module | None = None
        self._ref_source = Path(ref_path) if ref_path is not None else self.model_path
        if self.loss.needs_reference:
            self._load_reference()
        # Exactly one optimizer: megatron's distributed one (`distopt`, the model then being its
        # DDP wrapper), or the hand-rolled fp32 `master` weights and the AdamW (`optimizer`) over them.
        built = _build_optimizer(
            self.model,
            fp32,
            distributed=distributed_optimizer,
            lr=lr,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            bf16=self.dtype != torch.float32,
        )
        del fp32
        self.model = built.model
        self.distopt: DistributedOptimizer | None = built.distopt
        self.master: MasterWeights | None = built.master
        self.optimizer: torch.optim.AdamW | None = built.optimizer
        self.steps = self._resume()

    def _resume(self) -> int:
        """Load the optimizer state saved in `model_path` (a checkpoint of this trainer) and return
        the step count it was saved at; 0 for a folder without one (a run's initial weights)."""
        resume = self.model_path / OPTIMIZER_DIR
        if not resume.is_dir():
            return 0
        if self.distopt is not None:
            return self.distopt.load(resume, layout=self.layout.as_dict())
        master, optimizer = self._hand_rolled()
        return load_optimizer_shard(optimizer, master.named(), resume, layout=self.layout.as_dict())

    def _hand_rolled(self) -> tuple[MasterWeights, torch.optim.AdamW]:
        """The fp32 master weights and the AdamW over them: set whenever `distopt` is None."""
        if self.master is None or self.optimizer is None:
            raise RuntimeError("this trainer steps with megatron's distributed optimizer: it has no master weights")
        return self.master, self.optimizer

    def _build_model(self) -> torch.nn.Module:
        lay = self.layout
        return build_gpt_model(
            self.shape, tp=lay.tp, pp=lay.pp, ep=lay.ep, dtype=self.dtype, on_cpu=self.device.type == "cpu"
        )

    def _load_reference(self) -> None:
        """This rank's shard of the reference model (every rank loads its own)."""
        reference = self._build_model()
        load_hf_weights(reference, self._ref_source, self.shape, tp_rank=self.layout.tp_rank, tp=self.layout.tp)
        reference.requires_grad_(False)
        self.reference = reference
        if self._replays:
            self._replays["reference"] = ReplayedRouters(reference)

    # ---- the settings a step runs with (trainers.step_settings) ------------------------------

    @property
    def step_settings(self) -> StepSettings:
        """The settings the next step runs with (max_step_kl: the torch trainer's alone)."""
        return StepSettings(
            lr=self.lr,
            loss=self.loss,
            temperature=self.temperature,
            max_grad_norm=self.max_grad_norm,
            micro_batch_size=self.micro_batch_size,
            max_tokens_per_gpu=self.max_tokens_per_gpu,
        )

    def use_settings(self, settings: StepSettings) -> None:
        """Run the next steps with `settings`, on every rank: a resumed run replays a stored step
        with the settings it first ran with (`pipeline.checkpoints`). The optimizer's moments are
        untouched; a reference model is loaded if this loss needs one and none is. Blocking."""
        self._broadcast(_Command.SETTINGS, settings.to_json())
        self._use_settings(settings)

    def _use_settings(self, settings: StepSettings) -> None:
        self.lr = settings.lr
        if self.distopt is not None:
            self.distopt.use(lr=settings.lr, max_grad_norm=settings.max_grad_norm)
        else:
            for group in self._hand_rolled()[1].param_groups:
                group["lr"] = settings.lr
        self.loss = settings.loss
        self.temperature = settings.temperature
        self.max_grad_norm = settings.max_grad_norm
        if settings.micro_batch_size is not None:
            self.micro_batch_size = settings.micro_batch_size
        self.max_tokens_per_gpu = settings.max_tokens_per_gpu
        if self.loss.needs_reference and self.reference is None:
            self._load_reference()

    # ---- rank 0's API (the controller's Trainer protocol) --------------------------------------

    def train_step(self, batch: Batch, *, minibatch_samples: int | None = None) -> dict[str, float]:
        """One GRPO update on `batch`, on every rank; returns the step's metrics (rank 0).

        `minibatch_samples` overrides `global_batch_size` for this step (every rank gets it): a
        resumed run replays a stored batch with its recorded split (`pipeline.checkpoints`)."""
        if not batch.samples:
            raise ValueError(f"batch {batch.step} has no samples")
        rows, trains, versions = batch_rows(batch, self.loss, route_shape=self._route_shape)
        size = minibatch_samples or self.global_batch_size or len(rows)
        self._broadcast(_Command.TRAIN, {"rows": [r.to_json() for r in rows], "minibatch_samples": size})
        step = self._train(rows, size)
        metrics = step_metrics(
            batch, rows, trains, versions, step.totals, step.grad_norm_sum, step.optimizer_steps, step.minibatches
        )
        metrics["minibatch_samples"] = float(min(size, len(rows)))  # the split, recorded for a replay
        return metrics

    def save_weights(self, path: str | os.PathLike[str]) -> Path:
        """Write the HF folder (and every rank's optimizer shard) at `path`, atomically; return it."""

        def fill(folder: Path) -> None:
            self._broadcast(_Command.SAVE, str(folder))
            self._save(folder)

        return write_folder_atomically(Path(path), self._folder_files, fill)

    def save_model(self, path: str | os.PathLike[str]) -> Path:
        """Write the weights only (the HF folder an engine loads, no optimizer shards) at `path`,
        atomically; return it. What the launcher publishes between checkpoints (`--save-interval`):
        the master weights are gathered to rank 0 (every rank joins) and only rank 0 writes."""

        def fill(folder: Path) -> None:
            self._broadcast(_Command.GATHER, None)  # the followers join the same gather
            write_hf_weights(folder, self._gather_full(), self.shape, self._config_files)

        return write_folder_atomically(Path(path), self._folder_files, fill)

    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Log-prob of every response token under the current weights (rank 0; all ranks compute)."""
        rows = [Row.of(s, route_shape=self._route_shape) for s in samples]
        self._broadcast(_Command.LOGPROBS, [r.to_json() for r in rows])
        return self._logprobs(rows)

    def hf_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The whole model under Hugging Face names and shapes, fp32, on CPU (rank 0; all ranks take part).

        What the distributed publish sends (`stages.sglang_client.publish_distributed`, `--update-weight-transport
        distributed`): the TP shards of the master weights gathered to rank 0 and converted exactly
        as for a saved folder, so an engine holds the same tensors either way.
        """
        self._broadcast(_Command.GATHER, None)
        return list(self._gather_hf().items())

    def close(self) -> None:
        """Release the followers (rank 0); they leave `follow()`."""
        if self.layout.rank == 0 and self.layout.world > 1:
            self._broadcast(_Command.STOP, None)

    # ---- the followers' loop ------------------------------------------------------------------

    def follow(self) -> None:
        """Run rank 0's commands until it says stop (ranks > 0)."""
        while True:
            command, payload = receive_command(self._comm_device)
            if command is _Command.STOP:
                return
            if command is _Command.TRAIN:
                self._train([Row.from_json(r) for r in payload["rows"]], payload["minibatch_samples"])
            elif command is _Command.SAVE:
                self._save(Path(payload))
            elif command is _Command.LOGPROBS:
                self._logprobs([Row.from_json(r) for r in payload])
            elif command is _Command.GATHER:
                self._gather_hf()
            elif command is _Command.SETTINGS:
                self._use_settings(StepSettings.from_json(payload))

    def _broadcast(self, command: _Command, payload: Any) -> None:
        if self.layout.world > 1:
            broadcast_command(command, payload, self._comm_device)

    @property
    def _comm_device(self) -> torch.device:
        return comm_device(self.device)

    # ---- the step, on every rank --------------------------------------------------------------

    def _train(self, rows: list[Row], size: int) -> _StepTotals:
        """The batch's optimizer steps: one per minibatch of `size` rows, in order.

        With several, the proximal log-probs are computed once first, under the weights the batch
        was given to (the torch trainer's decoupled objective): the PPO clip of the later steps acts
        against them. Each rank computes them for its own micro-batches only.
        """
        minibatches = [rows[i : i + size] for i in range(0, len(rows), size)]
        plans = [self._micro_batches(mb) for mb in minibatches]
        self.model.train()
        proximal: list[list[torch.Tensor]] | None = None
        if len(minibatches) > 1:
            with torch.no_grad():
                proximal = [[self._forward_logprobs(c)[0] for c in chunks] for chunks in plans]
        step = _StepTotals(defaultdict(float), 0.0, 0, len(minibatches))
        reference: list[list[torch.Tensor]] | None = None
        if self.reference is not None:
            started = time.perf_counter()
            reference = [[self._forward_logprobs(c, model=self.reference)[0] for c in chunks] for chunks in plans]
            step.totals["ref_log_probs_time"] = time.perf_counter() - started
        for i, (mb, chunks) in enumerate(zip(minibatches, plans, strict=True)):
            totals, grad_norm, stepped = self._minibatch_step(
                mb, chunks, None if proximal is None else proximal[i], None if reference is None else reference[i]
            )
            for key, value in totals.items():
                step.totals[key] = max(step.totals[key], value) if key == "weight_max" else step.totals[key] + value
            if stepped:
                step.grad_norm_sum += grad_norm
                step.optimizer_steps += 1
        self.steps += 1
        step.totals["lr"] = self.lr
        return step

    def _micro_batches(self, minibatch: list[Row]) -> list[list[Row]]:
        """This rank's rows of `minibatch` (every DP-th), in micro-batches of `micro_batch_size` rows
        and `max_tokens_per_gpu` packed tokens (`packing.packs`).

        Under expert parallel every forward is a collective of the EP group (the token
        dispatcher), so every rank runs as many as the DP rank with the most rows: the others'
        last micro-batches are empty (a padding-only sequence, `_forward`, that trains nothing)."""
        lay = self.layout
        chunks = self._packs(minibatch[lay.dp_rank :: lay.dp])
        if lay.ep > 1:  # each rank cuts every DP rank's rows the same way, so all agree on the most
            most = max(len(self._packs(minibatch[rank :: lay.dp])) for rank in range(lay.dp))
            chunks += [[] for _ in range(most - len(chunks))]
        return chunks

    def _packs(self, rows: list[Row]) -> list[list[Row]]:
        return packs(rows, max_rows=self.micro_batch_size, max_tokens=self.max_tokens_per_gpu)

    def _minibatch_step(
        self,
        minibatch: list[Row],
        chunks: list[list[Row]],
        proximal: list[torch.Tensor] | None,
        reference: list[torch.Tensor] | None = None,
    ) -> tuple[defaultdict[str, float], float, bool]:
        """Forward and backward every micro-batch of this rank's rows, then one optimizer step.

        Returns the totals summed over DP ranks, the gradient norm, and whether the step was taken:
        a minibatch with no signal (no token trains, or every advantage is 0) takes none, as in the
        torch trainer, since AdamW's momentum would move the weights anyway. Every rank reaches the
        same decision, from the DP-summed totals of the last stage.

        Without PP each micro-batch's backward follows its forward at once (its activations are
        freed before the next); with PP every forward runs first, then the backwards in reverse
        (`schedule.py`).
        """
        batch_tokens = self._batch_tokens(minibatch, chunks, proximal)
        if self.distopt is not None:
            self.distopt.zero_grad()
        else:
            self._hand_rolled()[1].zero_grad(set_to_none=False)
        totals: defaultdict[str, float] = defaultdict(float)
        pending: list[InFlight] = []
        for j, chunk in enumerate(chunks):
            packed, flight = self._forward(chunk, train=True)
            if self.stage.last and not chunk:  # EP padding: its backward still joins the dispatcher's
                flight.loss = flight.output.sum() * 0.0
            elif self.stage.last:  # the loss, on the logits
                logp, entropy = self._head(flight.output, packed)
                heads = micro_batch_heads(chunk, self.device) if self.loss.score_centering else None
                flight.loss = micro_batch_loss(
                    self.loss,
                    chunk,
                    logp,
                    entropy,
                    batch_tokens=batch_tokens,
                    batch_samples=len(minibatch),
                    totals=totals,
                    proximal_flat=None if proximal is None else proximal[j],
                    reference_flat=None if reference is None else reference[j],
                    train_head_flat=None
                    if heads is None
                    else sampler_head_logprobs(flight.output, packed, heads.ids, temperature=self.temperature),
                    heads=heads,
                )
            pending.append(flight)
            if self.stage.pp == 1:
                self._backward(pending.pop())
        for flight in reversed(pending):
            self._backward(flight)
        if not chunks:  # more DP ranks than rows: this rank adds nothing but still meets the collectives
            # A model has parameters, so the sum is a tensor (its `0` start only types an empty one).
            cast(torch.Tensor, sum(p.sum() * 0.0 for p in self.model.parameters())).backward()
            self._accumulate_grads()
        totals = from_last_stage(sum_over_dp(totals, self.layout, self.device), self.layout, self.device)
        if totals["signal"] <= 0:
            return totals, 0.0, False
        if self.distopt is not None:
            return totals, self.distopt.step(), True
        from megatron.core import parallel_state as ps

        master, optimizer = self._hand_rolled()
        tp_group, lay, named = ps.get_tensor_model_parallel_group(), self.layout, master.named()
        # A tied embedding under PP: its two copies, on the first and the last stage.
        tied = self.shape.tied and lay.pp > 1 and (self.stage.first or self.stage.last)
        reduce_gradients(
            named,
            tp=lay.tp,
            dp=lay.dp,
            tp_group=tp_group,
            dp_group=dp_group(),
            embedding_group=ps.get_embedding_group() if tied else None,
            # Experts (MoE): over their replicas, which are the DP group's without expert parallel.
            expert_dp=ps.get_expert_data_parallel_world_size() if self.shape.moe else None,
            expert_dp_group=ps.get_expert_data_parallel_group() if self.shape.moe else None,
            sequence_parallel=self._sequence_parallel,
        )
        grad_norm = clip_gradients(
            named,
            self.max_grad_norm,
            tp=lay.tp,
            tp_rank=lay.tp_rank,
            tp_group=tp_group,
            pp=lay.pp,
            pp_group=ps.get_pipeline_model_parallel_group(),
            ep=lay.ep,
            ep_group=ps.get_expert_model_parallel_group() if lay.ep > 1 else None,
            not_counted=self._tied_copy,
        )
        optimizer.step()
        master.copy_to_model()
        return totals, grad_norm, True

    def _forward(
        self, rows: Sequence[Row], *, train: bool, model: torch.nn.Module | None = None
    ) -> tuple[Packed, InFlight]:
        """This stage's forward of one packed micro-batch (the output is the logits on the last stage).

        The micro-batch is padded (`_padded_length`) where megatron needs equal or divisible lengths."""
        length = self._padded_length(rows)
        packed = pack(rows, self.device, length=length)
        module = self.model if model is None else model
        replay = self._replays.get("policy" if model is None else "reference")
        hidden = (self.shape.hidden_size, self.dtype)
        split = self.layout.tp if self._sequence_parallel else 1
        if replay is None:
            return packed, forward(module, self.stage, packed, hidden=hidden, train=train, split=split)
        routes = plan(rows, layers=self.shape.num_layers, top_k=self.shape.moe_top_k, device=self.device, length=length)
        if routes is not None and split > 1:  # sequence parallel: the routers see this TP rank's positions
            routes = routes.chunk(split)[self.layout.tp_rank]
        with replay.replaying(routes):
            flight = forward(module, self.stage, packed, hidden=hidden, train=train, split=split)
        return packed, flight

    def _padded_length(self, rows: Sequence[Row]) -> int | None:
        """The length to pad this micro-batch's packed sequence to (None: its own).

        Under expert parallel, the longest of the EP group's: the all-gather dispatcher gathers
        equal-length sequences (`moe.py` says why that one). Under sequence parallel, a multiple
        of TP: each TP rank holds 1 / TP of the positions."""
        lay = self.layout
        if lay.ep == 1 and not self._sequence_parallel:
            return None
        length = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)
        if lay.ep > 1:
            from megatron.core import parallel_state as ps

            longest = torch.tensor([length], device=self._comm_device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
            length = int(longest[0])
        if self._sequence_parallel:
            length = -(-length // lay.tp) * lay.tp
        return length

    def _backward(self, flight: InFlight) -> None:
        backward(self.stage, flight)
        self._accumulate_grads()

    def _head(self, logits: torch.Tensor, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the response tokens, from the last stage's logits."""
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        return head_logprobs(
            logits,
            packed,
            temperature=self.temperature,
            tp_group=group,
            tp=self.layout.tp,
            entropy_grad=self.loss.entropy_coef != 0 and torch.is_grad_enabled(),
        )

    def _forward_logprobs(
        self, rows: Sequence[Row], *, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the response tokens of `rows` through every stage (of `model`,
        the policy unless given), no grad: on the last stage; other stages return empty tensors
        (they only pass hidden states on)."""
        with torch.no_grad():
            packed, flight = self._forward(rows, train=False, model=model)
            if self.stage.last:
                return self._head(flight.output, packed)
        empty = torch.empty(0, device=self.device)
        return empty, empty

    def _accumulate_grads(self) -> None:
        """bf16, hand-rolled path: into the fp32 masters after every micro-batch (megatron's DDP
        accumulates into its fp32 buffer in its own backward hooks)."""
        if self.master is not None:
            self.master.accumulate_grads()

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The weights a publish or a saved folder reads, by megatron name (fp32 masters, or the
        distributed optimizer's model weights)."""
        return self.distopt.named() if self.distopt is not None else self._hand_rolled()[0].named()

    def _batch_tokens(self, rows: list[Row], chunks: list[list[Row]], proximal: list[torch.Tensor] | None) -> float:
        """The token-mean denominator: the minibatch's trainable tokens, after log-prob-dependent drops."""
        s = self.loss
        drops = s.use_opsm or s.correction in (ImportanceCorrection.ICEPOP, ImportanceCorrection.SEQ_MASK)
        if s.aggregation is not LossAggregation.TOKEN_MEAN or not drops:
            return float(sum(sum(r.mask) for r in rows))
        count = 0.0
        with torch.no_grad():
            for j, c in enumerate(chunks):
                prox = None if proximal is None else proximal[j]
                # IcePop and seq-mask drop by the proximal log-probs; only OPSM needs the current ones.
                # Every stage runs the same forwards; the loss, and so this count, is the last's.
                logp = self._forward_logprobs(c)[0] if prox is None or s.use_opsm else prox
                if self.stage.last and c:
                    count += trained_token_count(s, c, logp, prox)
        total = torch.tensor([count], dtype=torch.float64, device=self._comm_device)
        if self.layout.dp > 1:
            dist.all_reduce(total, group=dp_group())
        return float(total[0])

    @torch.no_grad()
    def _logprobs(self, rows: list[Row]) -> list[list[float]]:
        """Every row's response log-probs, computed on the last stage and broadcast over the pipeline."""
        parts = [self._forward_logprobs(chunk)[0] for chunk in self._packs(rows)]
        flat = torch.cat(parts) if parts else torch.empty(0, device=self.device)
        if self.layout.pp > 1:
            if not self.stage.last:
                flat = torch.empty(sum(len(r.response_ids) for r in rows), device=self.device)
            flat = tensor_from_last_stage(flat.float().to(self._comm_device))
        values = flat.tolist()
        out: list[list[float]] = []
        at = 0
        for r in rows:
            out.append(values[at : at + len(r.response_ids)])
            at += len(r.response_ids)
        return out

    # ---- weights and optimizer (trainers.megatron.checkpoint) ---------------------------

    def _gather_hf(self) -> dict[str, torch.Tensor]:
        """Every rank joins the gather; rank 0 converts to HF names (the others return nothing)."""
        full = self._gather_full()
        return megatron_to_hf(full, self.shape) if self.layout.rank == 0 else {}

    def _gather_full(self) -> dict[str, torch.Tensor]:
        """The whole model's full tensors by full-model name, on rank 0 (a collective of every rank).

        Each stage joins its parameters over TP; then the stages of rank 0's pipeline (TP rank 0,
        DP rank 0) send theirs to it. Other ranks return what they hold, which nobody reads."""
        from megatron.core import parallel_state as ps

        lay = self.layout
        joined = gather_full_state(self._named(), tp=lay.tp, group=ps.get_tensor_model_parallel_group())
        full = {self._names[n]: t for n, t in joined.items() if n not in self._tied_copy}
        if lay.ep > 1:  # every EP rank's experts (each rank holds num_experts / EP of them)
            group = ps.get_expert_model_parallel_group()
            full = gather_experts(full, ep=lay.ep, ep_rank=lay.ep_rank, group=group, device=self._comm_device)
        if lay.pp == 1 or lay.tp_rank != 0 or lay.dp_rank != 0:
            return full
        first = ps.get_pipeline_model_parallel_first_rank()
        others = [r for r in dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) if r != first]
        return gather_stages(full, ranks=[first, *others], rank=lay.rank, device=self._comm_device)

    def _save(self, folder: Path) -> None:
        """Rank 0 writes the HF weights; every rank writes its optimizer shard; all meet at the end."""
        full = self._gather_full()
        if self.layout.rank == 0:
            write_hf_weights(folder, full, self.shape, self._config_files)
            (folder / OPTIMIZER_DIR).mkdir(exist_ok=True)
        if self.layout.world > 1:
            dist.barrier()  # the optimizer folder exists
        if self.distopt is not None:
            self.distopt.save(folder / OPTIMIZER_DIR, layout=self.layout.as_dict(), steps=self.steps)
        else:
            master, optimizer = self._hand_rolled()
            save_optimizer_shard(
                optimizer,
                master.named(),
                folder / OPTIMIZER_DIR,
                layout=self.layout.as_dict(),
                steps=self.steps,
            )
        if self.layout.world > 1:
            dist.barrier()  # every shard is on disk before rank 0 renames the folder into place
