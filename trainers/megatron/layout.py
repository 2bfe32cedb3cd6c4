"""Where a rank sits among the megatron ranks (`Layout`), and the collectives the trainer runs
across them: the step's totals summed over data parallel, and what the last pipeline stage holds
(the loss's totals, the log-probs) broadcast to the other stages.

Tensor, pipeline and expert parallel come from megatron-core's `parallel_state`; data parallel is
world / (TP x PP). Expert parallel (EP) splits each MoE layer's experts over EP of the data-parallel
ranks; an expert's replicas are on the expert-data-parallel ranks, world / (TP x PP x EP) of them.
Gloo ranks (CPU) exchange on the CPU, NCCL ranks on their GPU (`comm_device`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainers.megatron.rows import TOTALS

__all__ = ["Layout", "comm_device", "dp_group", "from_last_stage", "sum_over_dp", "tensor_from_last_stage"]


@dataclass(frozen=True, slots=True)
class Layout:
    rank: int
    world: int
    tp: int
    tp_rank: int
    dp: int
    dp_rank: int
    pp: int
    ep: int = 1
    ep_rank: int = 0

    @classmethod
    def current(cls) -> Layout:
        """This rank's place, from torch.distributed and megatron's model parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            tp=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            dp=ps.get_data_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
        )

    def as_dict(self) -> dict[str, int]:
        """What an optimizer shard records: a shard loads only into the same layout (`checkpoint.py`)."""
        return {"rank": self.rank, "world": self.world, "tp": self.tp, "pp": self.pp, "ep": self.ep}


def comm_device(device: torch.device) -> torch.device:
    """Where collectives' tensors live: the CPU for gloo, the rank's device for NCCL."""
    return torch.device("cpu") if dist.get_backend() == "gloo" else device


def dp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def sum_over_dp(totals: defaultdict[str, float], layout: Layout, device: torch.device) -> defaultdict[str, float]:
    """The step's totals summed over the data-parallel ranks (`weight_max`: their largest)."""
    if layout.dp == 1:
        return totals
    sums = torch.tensor([totals[k] for k in TOTALS], dtype=torch.float64, device=comm_device(device))
    dist.all_reduce(sums, group=dp_group())
    peak = torch.tensor([totals["weight_max"]], dtype=torch.float64, device=comm_device(device))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=dp_group())
    out: defaultdict[str, float] = defaultdict(float, zip(TOTALS, map(float, sums.tolist()), strict=True))
    out["weight_max"] = float(peak[0])
    return out


def from_last_stage(totals: defaultdict[str, float], layout: Layout, device: torch.device) -> defaultdict[str, float]:
    """The last stage's totals (where the loss is), on every stage of the pipeline."""
    if layout.pp == 1:
        return totals
    keys = (*TOTALS, "weight_max")
    values = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=comm_device(device))
    values = tensor_from_last_stage(values)
    return defaultdict(float, zip(keys, map(float, values.tolist()), strict=True))


def tensor_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """`values` as the last pipeline stage holds them, on every stage (same shape everywhere)."""
    from megatron.core import parallel_state as ps

    last, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
    dist.broadcast(values, src=last, group=group)
    return values
