"""The process group a distributed weight publish runs over, shared by both of its ends: the
trainer side (`stages/sglang_client/publish_distributed.py`, the megatron trainer) and the built-in
engine's side (`engines/weight_group.py`). One definition, so both join the same way.

The group is built from torch's public process-group classes on its own store rather than
`init_process_group`, so it never touches the process's default group: a trainer that already uses
one (DDP) keeps it, and tests can hold several groups in one process. Gloo on CPU, NCCL on a GPU.
"""

from __future__ import annotations

import datetime
import ipaddress
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (  # torch.distributed's own names
    PrefixStore,
    Store,
    TCPStore,
)

# torch's stubs type the backend classes (ProcessGroupGloo, ProcessGroupNCCL) apart from
# ProcessGroup although they are used the same way here (`broadcast(tensor, root).wait()`).
Group = Any

__all__ = ["GROUP_NAME", "Group", "backend_for", "dtype_name", "open_group", "parse_dtype"]

GROUP_NAME = "weight_update_group"  # SGLang's and slime's default
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype spelling (`torch.bfloat16` -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object) -> torch.dtype:
    """A dtype from SGLang's spelling ("bfloat16" or "torch.bfloat16"); ValueError names the value."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def backend_for(device: torch.device | str) -> str:
    """NCCL for tensors on a GPU (ROCm builds say cuda too, and map NCCL to RCCL), gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def open_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = GROUP_NAME,
    backend: str = "gloo",
    timeout: float = 300.0,
    store: Store | None = None,
) -> Group:
    """Join the group at `rank` (blocks until every rank joined). Rank 0 hosts the store unless
    `store` is given (the sender creates it first, to learn its port before telling the engines)."""
    wait = datetime.timedelta(seconds=timeout)
    if store is None:
        store = TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=wait, wait_for_workers=False
        )
    prefixed = PrefixStore(group_name, store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = wait
        # A loopback master means a one-host group: bind gloo to loopback too, whatever the hostname says.
        if _is_loopback(master_address):
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise ValueError("backend 'nccl' needs a torch build with NCCL (a CUDA or ROCm build)")
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = wait
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_options)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
