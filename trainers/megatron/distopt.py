"""megatron-core's own DDP wrapper and distributed optimizer, for GPU ranks (`--use-distributed-optimizer`).

What megatron-core does at scale (slime's and NeMo's default): gradients accumulate into one flat
fp32 buffer per dtype (`DistributedDataParallel`), are reduce-scattered over the data-parallel
group, and each DP rank keeps the fp32 master weights and Adam moments of its 1/DP slice of that
buffer only (ZeRO-1), then all-gathers the updated weights. Optimizer memory falls by DP, and the
collectives are bucketed. The step is the one the hand-rolled path computes (`master.py`,
`grads.py`): gradients summed over DP (`calculate_per_token_loss`: our loss is already divided by
the minibatch's token count, so megatron must not average again), the q/k norms' gradients summed
over TP, one clip by the whole model's norm, AdamW.

Where it runs: megatron-core 0.16.1 (the CPU ranks CI runs) allocates these buffers on CUDA, so
this path is for GPU ranks (0.19.x on the H200 machine); `--use-distributed-optimizer` with a CPU
trainer is refused at config load. Differences from the hand-rolled path, both megatron's own
behaviour: in bf16 the fp32 masters start from the bf16 model weights (megatron builds them from
the model), and megatron's default parameter groups exempt norms from weight decay.

Checkpoint, per rank, never pickle (megatron's own `save_parameter_state` is torch.save): for
every model parameter whose slice this rank owns, the slice's range in the parameter and its
master weights and optimizer state over that range, in `optimizer/rank<r>.safetensors`, keyed
`<megatron name>.<state>`, with the ranges and the layout in `rank<r>.json`. A shard loads only into
the same layout and the same slicing, checked parameter by parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import torch

from core.errors import PipelineError

__all__ = ["DistributedOptimizer"]

FORMAT = 1
KIND = "megatron-distributed-optimizer"


class DistributedOptimizer:
    """The model wrapped in megatron's DDP, and megatron's distributed AdamW over it."""

    def __init__(
        self, model: torch.nn.Module, *, lr: float, weight_decay: float, max_grad_norm: float, bf16: bool
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config: Any = model.config  # megatron's TransformerConfig
        # Our loss is normalised by the minibatch's token count over every DP rank: sum, never average.
        config.calculate_per_token_loss = True
        self.inner = model
        self.module = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
            ),
            module=model,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                weight_decay=weight_decay,
                adam_beta1=0.9,  # torch AdamW's defaults, which the hand-rolled path uses
                adam_beta2=0.999,
                adam_eps=1e-8,
                clip_grad=max_grad_norm,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=True,
            ),
            [self.module],
        )
        self._parts: list[Any] = list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))
        self._names = {p: n for n, p in model.named_parameters()}

    def use(self, *, lr: float, max_grad_norm: float) -> None:
        """The learning rate and gradient clip of the next steps (no scheduler here: the param
        groups' `lr` is what Adam steps with); the optimizer state is untouched."""
        for part in self._parts:
            for group in part.param_groups:
                group["lr"] = lr
            part.config.clip_grad = max_grad_norm
        if (chain := getattr(self.optimizer, "config", None)) is not None:  # a ChainedOptimizer's own copy
            chain.clip_grad = max_grad_norm

    def zero_grad(self) -> None:
        self.module.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        """Reduce the gradients (DP reduce-scatter, TP norms), clip, step, gather; return the norm."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.module])
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # only a loss scaler (fp16) skips steps; bf16 and fp32 have none
            raise PipelineError("megatron's optimizer skipped a step (inf/NaN gradients)")
        return float(grad_norm or 0.0)

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(megatron name, parameter) of the model: what a publish or a saved folder reads."""
        return list(self.inner.named_parameters())

    # ---- checkpoint --------------------------------------------------------------------------

    def _owned(self) -> list[tuple[str, Any, torch.nn.Parameter, tuple[int, int]]]:
        """(name, optimizer part, model parameter, its range this rank owns), in a fixed order."""
        owned = []
        for part in self._parts:
            for param in part.model_param_group_index_map:
                span = part._get_model_param_range_map(param)["param"]
                owned.append((self._names[param], part, param, (int(span.start), int(span.end))))
        return sorted(owned, key=lambda o: o[0])

    def save(self, folder: Path, *, layout: dict[str, int], steps: int) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        ranges: dict[str, list[int]] = {}
        for name, part, param, span in self._owned():
            ranges[name] = list(span)
            for key, value in part._get_main_param_and_optimizer_states(param).items():
                tensors[f"{name}.{key}"] = value.detach().cpu().contiguous()
        rank = layout["rank"]
        save_file(tensors, str(folder / f"rank{rank}.safetensors"))
        meta = {"format": FORMAT, "backend": KIND, **layout, "trainer_steps": steps, "ranges": ranges}
        (folder / f"rank{rank}.json").write_bytes(orjson.dumps(meta))

    @torch.no_grad()  # the masters are leaves that require grad: copied into in place
    def load(self, folder: Path, *, layout: dict[str, int]) -> int:
        """Restore this rank's slice of the master weights and optimizer state; return the steps taken."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        rank = layout["rank"]
        try:
            meta = orjson.loads((folder / f"rank{rank}.json").read_bytes())
            tensors = load_file(str(folder / f"rank{rank}.safetensors"))
        except (OSError, orjson.JSONDecodeError, SafetensorError) as exc:
            raise PipelineError(f"optimizer checkpoint {folder} is unreadable for rank {rank}: {exc}") from exc
        expected = {"format": FORMAT, "backend": KIND, **layout}
        meta.setdefault("pp", 1)  # saved before pipeline parallelism: one stage
        meta.setdefault("ep", 1)  # saved before expert parallelism: every rank held every expert
        if {k: meta.get(k) for k in expected} != expected:
            raise PipelineError(
                f"optimizer checkpoint {folder} was saved as "
                f"{ {k: meta.get(k) for k in expected} }; this run is {expected}"
            )
        owned = self._owned()
        mine = {name: list(span) for name, _, _, span in owned}
        if meta["ranges"] != mine:
            raise PipelineError(
                f"optimizer checkpoint {folder}: rank {rank} owned other slices of the parameters "
                "(a different bucket layout or megatron-core version); it cannot be loaded here"
            )
        for part in self._parts:  # create Adam's state so that it can be copied into
            part._init_optimizer_states_with_dummy_values()
        for name, part, param, _ in owned:
            state = part._get_main_param_and_optimizer_states(param)
            missing = [k for k in state if f"{name}.{k}" not in tensors]
            if missing:
                raise PipelineError(f"optimizer checkpoint {folder}: {name} has no {missing} for rank {rank}")
            part._set_main_param_and_optimizer_states(param, {k: tensors[f"{name}.{k}"] for k in state})
        for part in self._parts:  # the model's weights from the restored masters, gathered over DP
            part._copy_main_params_to_model_params()
            part.start_param_sync_for_bucket_group_subset()
        return int(meta["trainer_steps"])
