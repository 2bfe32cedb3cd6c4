"""Micro-batches through pipeline stages: every forward, then every backward (GPipe's order).

Each pipeline stage holds a slice of the layers (`qwen3.build_gpt_model`): the first also the
embedding, the last also the final norm and the output layer. A micro-batch's hidden states
[S, 1, H] go from stage to stage with a blocking `send` and `recv` between the stages' ranks of
the same TP position (`parallel_state`'s previous/next pipeline ranks); in the backward its
gradient goes the other way. Every rank holds every row (rank 0 broadcasts them), so each stage
knows each packed sequence's length and no shapes travel. Every stage runs its micro-batches in
the same order, forwards first and backwards after, in reverse, so each send meets its receive.

Why our own and not megatron-core's `get_forward_backward_func`: its pipelined schedule
allocates on CUDA in its own body (megatron-core 0.16.1 creates its token count with
`torch.zeros(..., device="cuda")` inside `forward_backward_pipelining_without_interleaving`, and
its P2P shape exchange on `torch.cuda.current_device()`), which no patch outside that function
can redirect on the CPU (gloo) ranks that CI runs; one schedule for CPU and GPU keeps the two
paths the same code. The cost: a stage keeps the activations of all its micro-batches of a
minibatch until the backwards start (1F1B would keep at most `pp`), and stages idle while the
pipeline fills and drains, as in megatron's schedule.

The loss is computed on the last stage only (the caller's `loss` function sees the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainers.megatron.packing import Packed

__all__ = ["InFlight", "Stage", "backward", "forward"]


@dataclass(frozen=True, slots=True)
class Stage:
    """This rank's place in its pipeline: stage `rank` of `pp`, and the global ranks either side."""

    pp: int
    rank: int
    prev: int | None  # the previous stage's rank (None on the first stage)
    next: int | None  # the next stage's rank (None on the last stage)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.pp - 1

    @classmethod
    def current(cls) -> Stage:
        """From megatron's parallel state (`initialize_model_parallel` has run)."""
        from megatron.core import parallel_state as ps

        pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        return cls(
            pp=pp,
            rank=rank,
            prev=ps.get_pipeline_model_parallel_prev_rank() if rank > 0 else None,
            next=ps.get_pipeline_model_parallel_next_rank() if rank < pp - 1 else None,
        )


@dataclass(slots=True)
class InFlight:
    """A micro-batch between its forward and its backward on this stage."""

    received: torch.Tensor | None  # the previous stage's hidden states (None on the first stage)
    output: torch.Tensor  # this stage's: hidden states, or the logits on the last stage
    loss: torch.Tensor | None  # on the last stage, when training


def forward(
    model: Any, stage: Stage, packed: Packed, *, hidden: tuple[int, torch.dtype], train: bool, split: int = 1
) -> InFlight:
    """This stage's forward of one micro-batch: receive the hidden states, run the layers, send ours on.

    `hidden` is the model's hidden size and the dtype its stages exchange. When `train`, the
    received hidden states require grad, so that the backward can send their gradient back.
    `split`: under sequence parallel a stage holds 1 / TP of the positions (TP = `split`)."""
    received = None
    if not stage.first:
        size, dtype = hidden
        received = torch.empty((packed.length // split, 1, size), dtype=dtype, device=packed.tokens.device)
        dist.recv(received, src=stage.prev)
        received.requires_grad_(train)
        model.set_input_tensor(received)
    output = model(packed.tokens, packed.position, attention_mask=packed.mask)
    if not stage.last:
        dist.send(output.detach().contiguous(), dst=stage.next)
    return InFlight(received, output, None)


def backward(stage: Stage, flight: InFlight) -> None:
    """This stage's backward of one micro-batch: from the loss on the last stage, else from the
    gradient the next stage sends back; then the gradient of the received hidden states goes back."""
    if stage.last:
        if flight.loss is None:
            raise ValueError("the last pipeline stage's backward needs the micro-batch's loss")
        flight.loss.backward()
    else:
        grad = torch.empty_like(flight.output)
        dist.recv(grad, src=stage.next)
        torch.autograd.backward(flight.output, grad)
    if flight.received is not None:
        sent = flight.received.grad
        dist.send(torch.zeros_like(flight.received) if sent is None else sent.contiguous(), dst=stage.prev)
