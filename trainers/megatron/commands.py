"""Rank 0's commands to the follower ranks, over the world process group.

A command is a header tensor `[command, length]` broadcast from rank 0, then its payload as
orjson bytes (never pickle); every rank then runs the same code, so their collectives meet.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import orjson
import torch
import torch.distributed as dist

__all__ = ["Command", "broadcast_command", "receive_command"]


class Command(IntEnum):
    STOP = 0
    TRAIN = 1  # payload: the batch's rows
    SAVE = 2  # payload: the folder being written
    LOGPROBS = 3  # payload: rows
    GATHER = 4  # the full HF weights to rank 0, for a distributed publish
    SETTINGS = 5  # payload: the StepSettings the next steps run with (a replayed step's)


def broadcast_command(command: Command, payload: Any, device: torch.device) -> None:
    """Send `command` and its JSON payload from rank 0 to every rank."""
    data = orjson.dumps(payload)  # never empty: `null` at least
    header = torch.tensor([int(command), len(data)], dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    dist.broadcast(body, src=0)


def receive_command(device: torch.device) -> tuple[Command, Any]:
    """The next command from rank 0 (ranks > 0), with its payload decoded."""
    header = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    command, length = Command(int(header[0])), int(header[1])
    body = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(body, src=0)
    return command, orjson.loads(body.cpu().numpy().tobytes())
