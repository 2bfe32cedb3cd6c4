"""CUDA graphs for the KV forward's decode step: one graph per (batch bucket, KV-length bucket).

Why: an eager decode step of a 28-layer model launches some 1,700 small kernels, one Python call
each; on an H200 the 0.6B Qwen3 step was flat at 30-40 ms from 1 to 128 running requests
(BENCHMARKS.md section 7), the CPU launching while the GPU waited. A CUDA graph replays the whole
step with one launch. `torch.cuda.CUDAGraph` is plain torch (ROCm builds map it to HIP graphs),
so this stays vendor-neutral; CPUs never take this path.

Shapes are fixed inside a graph, so the decode is padded to a bucket:
- batch buckets 1, 2, 4, ... up to the largest batch graphed (`--cuda-graph-max-bs`, by default
  `--max-running-requests`, itself the last bucket); a larger batch runs eager;
- the attention reads K/V positions [0, kv) of each row's slot and SDPA needs `kv` fixed, so it is
  rounded up to a power of two (at least `MIN_KV_BUCKET`), capped at the context length. Each row's
  mask stops at its own position (the mask is computed inside the graph from the positions), so
  reading further changes nothing but the cost of the padding;
- rows are slots (row j reads slot j in place, `slot_attention.py`); padding rows, like the idle
  rows of slots not decoding, decode the pad token at position 0 and write into the spare slot
  one past the real ones; what they produce is dropped.

Inputs live in one static [3, max_bucket] buffer (token ids, positions, slots written) filled by one
host-to-device copy per step; the graph's last op copies the final hidden states into a static
buffer. The LM head and sampling stay eager: two launches, and sampling is per request anyway.
The cache update inside the graph is the slot cache's index assignment (`index_put_`), which needs
no host synchronisation. Graphs are captured lazily, the first time a shape is seen (a warm-up
forward then the capture, on a side stream), into one memory pool that all of them share.

Weights: a graph holds the addresses of the parameters it read. The engine loads weights by
`copy_` into the live tensors (`ModelRunner.apply_weights`, from disk or over torch.distributed),
so a publish takes effect at the next replay with no recapture. The cache is allocated once too.

What was tried: `torch.compile` was not adopted: transformers' compiled static-cache decode took
41 s to compile for one shape on the H200 (reference/gpu-machine.md) and recompiles per shape,
while a capture here costs about two eager forwards. With `capture=False` the same padded
static-shape step runs eagerly: that is how the CPU tests check the bucketing and padding.

What it bought (BENCHMARKS.md section 7, 0.6B Qwen3 in bf16 on one H200, T=256): a step at 1-16
running requests fell from 26-28 ms to 6-9 ms; at 128, 28 -> 25 ms (1.7x transformers' compiled
`generate`, the target being 2x): from there the step is GPU-bound, and a profile puts most of it
in memory copies around the attention (transformers' `repeat_kv` for GQA with a mask, 8.9 ms; the
slot gather, 6.0 ms; the kernel itself 3.9 ms). Both copies are gone since: the query heads of a
KV head are folded into the query axis and the attention reads the slots in place
(`slot_attention.py`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

__all__ = ["MIN_KV_BUCKET", "DecodeGraphs", "GraphStatistics", "batch_buckets", "bucket_for", "kv_buckets"]

log = logging.getLogger(__name__)

MIN_KV_BUCKET = 64  # below this the attention is a small part of a step; fewer graphs to capture

# (token ids [b], positions [b], slots written [b], kv) -> final hidden states [b, H]; row j reads slot j
DecoderCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below `max_batch`, then `max_batch` itself: 1, 2, 4, ..., max_batch."""
    if max_batch < 1:
        raise ValueError(f"the largest graphed batch must be >= 1, got {max_batch}")
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return (*sizes, max_batch)


def kv_buckets(context: int) -> tuple[int, ...]:
    """KV lengths a graph is captured for: powers of two from MIN_KV_BUCKET, the context last."""
    sizes = [n for n in (MIN_KV_BUCKET << i for i in range(max(context.bit_length(), 1))) if n < context]
    return (*sizes, context)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `n`."""
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True, slots=True)
class GraphStatistics:
    graphs: int  # captured so far
    replays: int  # decode steps served by a graph (or by the padded eager step when not capturing)
    capturing: bool  # False: the padded step runs eagerly (CPU tests), or capture failed and was given up


class DecodeGraphs:
    """Padded, fixed-shape decode steps over a slot cache, replayed from CUDA graphs when `capture`."""

    def __init__(
        self,
        decoder: DecoderCall,
        *,
        max_batch: int,
        context: int,
        dummy_slot: int,
        pad_token_id: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        capture: bool,
        capture_region: Callable[..., AbstractContextManager[object]] | None = None,
    ) -> None:
        """`capture_region(graph, pool=, stream=, capture_error_mode=)` captures in place of
        `torch.cuda.graph` (a memory saver's, so that the graphs' pool can be given back)."""
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cuda device, got {device}")
        self.batch_buckets = batch_buckets(max_batch)
        self.kv_buckets = kv_buckets(context)
        self._decoder = decoder
        self._dummy_slot = dummy_slot
        self._pad = pad_token_id
        self._device = device
        top = self.batch_buckets[-1]
        self._inputs = torch.zeros((3, top), dtype=torch.long, device=device)  # ids, positions, slots
        self._hidden = torch.zeros((top, hidden_size), dtype=dtype, device=device)
        self._capture = capture
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._capture_region = capture_region
        self._replays = 0

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def decode(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        """Decode one token for each row j (its last token `ids[j]` at `positions[j]`, attending to
        positions [0, positions[j]] of slot j, its K/V written to slot `slots[j]`); the final hidden
        states [n, H], valid until the next call (a view of the static output)."""
        n = len(ids)
        batch = bucket_for(n, self.batch_buckets)
        kv = bucket_for(max(positions) + 1, self.kv_buckets)
        pad = batch - n
        host = torch.tensor(
            [[*ids, *[self._pad] * pad], [*positions, *[0] * pad], [*slots, *[self._dummy_slot] * pad]],
            dtype=torch.long,
        )
        with _on(self._device):
            graph = self._graph(batch, kv) if self._capture else None
            self._inputs[:, :batch].copy_(host, non_blocking=True)  # after a capture: its warm-up wrote the dummy rows
            if graph is not None:
                graph.replay()
            else:
                self._step(batch, kv)
        self._replays += 1
        return self._hidden[:n]

    def prepare(self, batch: int, max_kv: int, min_kv: int = 1) -> None:
        """Capture ahead the graphs that decoding `batch` rows at KV lengths [min_kv, max_kv] uses,
        so the first steps at those shapes do not pay for it (benchmarks, server warm-up)."""
        if not self._capture or not self.fits(batch):
            return
        b = bucket_for(batch, self.batch_buckets)
        with _on(self._device):
            for kv in {bucket_for(k, self.kv_buckets) for k in range(min_kv, max_kv + 1)}:
                self._graph(b, kv)

    def statistics(self) -> GraphStatistics:
        return GraphStatistics(graphs=len(self._graphs), replays=self._replays, capturing=self._capture)

    # ---- the fixed-shape step and its capture ------------------------------------------------------

    def _step(self, batch: int, kv: int) -> None:
        """The body a graph holds: everything from the static inputs to the static hidden output."""
        ids, positions, slots = self._inputs[0, :batch], self._inputs[1, :batch], self._inputs[2, :batch]
        self._hidden[:batch].copy_(self._decoder(ids, positions, slots, kv))

    def _graph(self, batch: int, kv: int) -> torch.cuda.CUDAGraph | None:
        graph = self._graphs.get((batch, kv))
        if graph is None and self._capture:
            try:
                graph = self._graphs[(batch, kv)] = self._record(batch, kv)
            except RuntimeError:  # an op that cannot be captured: serve on, eagerly, and say so
                log.exception("capturing the decode graph failed; decoding without CUDA graphs from now on")
                self._capture = False
        return graph

    def _record(self, batch: int, kv: int) -> torch.cuda.CUDAGraph:
        # Warm-up and capture both run the step: point every row at the dummy slot so that neither
        # writes K/V into a slot a request holds.
        self._inputs[0].fill_(self._pad)
        self._inputs[1].zero_()
        self._inputs[2].fill_(self._dummy_slot)
        side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS workspaces, ...) must not be captured
            self._step(batch, kv)
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the event loop's thread may use the device meanwhile (weights received over NCCL).
        if self._capture_region is not None:
            region = self._capture_region(graph, pool=self._pool, stream=side, capture_error_mode="thread_local")
        else:
            region = torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local")
        with region:
            self._step(batch, kv)
        log.debug("captured the decode graph for batch %d, kv %d", batch, kv)
        return graph


def _on(device: torch.device) -> AbstractContextManager[object]:
    """The forward runs on a worker thread whose current device need not be the engine's."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
