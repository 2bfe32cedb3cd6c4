"""Colocated weight sync, as slime does it with `--colocate`: the trainer and the engines share the
GPU, the engines give their memory back while the trainer trains, and the new weights go over as
CUDA IPC handles (`/update_weights_from_tensor`), with no copy through disk or NCCL.

    after the round   flush_cache -> release_memory_occupation (every tag)      `release()`
    the publish       resume_memory_occupation ["weights"]                      `send()`
                      -> update_weights_from_tensor, bucket by bucket
                      -> resume_memory_occupation ["kv_cache", "cuda_graph"]

`send` runs inside the publisher's sequence (pause, flush, update, version, continue: the version
clock gates it as any publish). Only the tags this object released are resumed: SGLang's memory
saver exits the server on a resume of memory that is not released, so the client must not guess.

A bucket is SGLang's `FlattenedTensorBucket` layout, built here without SGLang: tensors of one dtype
(the engine's, with `send_dtype`), up to `bucket_bytes`, copied into one flat buffer of that dtype on
the trainer's GPU, offsets in elements, and `{"flattened_tensor": buffer, "metadata": [...]}`
pickled the way `MultiprocessingSerializer` does (torch's CUDA reduction: the buffer travels as an
IPC handle, its device as the GPU's UUID, as SGLang's patched reduction sends it): SGLang's wire
format for this endpoint, a message between two live processes, never stored. One dtype per
bucket is the layout every SGLang reads: the older one slices elements, the newer one (bytes, any
dtype) views a slice in the entry's dtype, which for a buffer of that dtype is the same slice.
The metadata entries are plain `types.SimpleNamespace`s with SGLang's field names: SGLang reads
them by attribute, and the built-in engine maps them onto its own class. The buffer lives until
every engine answered for it (an engine answers once it copied the bucket), then it is freed and
torch's IPC bookkeeping collected: the trainer's extra memory is one bucket.
"""

from __future__ import annotations

import base64
import io
import pickle
import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import structlog
import torch

from core.errors import EngineError
from stages.sglang_client.publish_distributed import DEFAULT_BUCKET_BYTES

__all__ = [
    "ALL_TAGS",
    "ColocatedTarget",
    "ColocatedWeights",
    "FlatBucket",
    "flatten_bucket",
    "plan_buckets",
    "serialize_bucket",
]

log = structlog.get_logger("publisher")

# SGLang's memory tags (`sglang.srt.constants.GPU_MEMORY_TYPE_*`).
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
ALL_TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


class ColocatedTarget(Protocol):
    """The engine calls a colocated weight sync makes (an `EngineFleet`)."""

    async def flush_cache(self, deadline: float) -> None: ...
    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...
    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...
    async def tp_sizes(self) -> dict[str, int]: ...
    async def update_weights_from_tensor(
        self, entry: str, *, tp_sizes: Mapping[str, int], weight_version: str | None, flush_cache: bool
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class FlatBucket:
    """One bucket ready to send: the buffer the handle points to, and its metadata."""

    flat: torch.Tensor  # one dtype, on the trainer's GPU
    metadata: list[types.SimpleNamespace]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, dtype: torch.dtype | None
) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors in order, cut into buckets of one dtype (`dtype`, or each tensor's) and at most
    `bucket_bytes` (a larger tensor alone). Nothing is copied: the entries are the trainer's own
    tensors, detached."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        kind = dtype or t.dtype
        nbytes = t.numel() * kind.itemsize
        if out[-1] and (size + nbytes > bucket_bytes or (dtype or out[-1][0][1].dtype) != kind):
            out.append([])
            size = 0
        out[-1].append((name, t.detach()))
        size += nbytes
    return [b for b in out if b]


def flatten_bucket(
    named: Sequence[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None, device: torch.device
) -> FlatBucket:
    """Copy `named` (converted to `dtype`; None: their own, which must be one) into one new flat
    buffer of that dtype on `device`."""
    kinds = {dtype or t.dtype for _, t in named}
    if len(kinds) != 1:
        raise ValueError(f"a bucket holds one dtype, got {sorted(map(str, kinds))}: cut it with plan_buckets")
    (kind,) = kinds
    flat = torch.empty(sum(t.numel() for _, t in named), dtype=kind, device=device)
    metadata = []
    start = 0
    with torch.no_grad():
        for name, t in named:
            end = start + t.numel()
            flat[start:end].view(t.shape).copy_(t)
            metadata.append(
                types.SimpleNamespace(
                    name=name, shape=torch.Size(t.shape), dtype=kind, start_idx=start, end_idx=end, numel=t.numel()
                )
            )
            start = end
    if flat.is_cuda:
        torch.cuda.synchronize(flat.device)  # the copies are done before any handle to them exists
    return FlatBucket(flat, metadata)


def serialize_bucket(bucket: FlatBucket) -> str:
    """`MultiprocessingSerializer.serialize({"flattened_tensor", "metadata"}, output_str=True)`:
    base64 of a pickle whose tensor travels as a CUDA IPC handle."""
    if not bucket.flat.is_cuda:
        raise ValueError(f"CUDA IPC hands over GPU tensors only; this bucket is on {bucket.flat.device}")
    buf = io.BytesIO()
    _IpcPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(
        {"flattened_tensor": bucket.flat, "metadata": bucket.metadata}
    )
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _IpcPickler(pickle.Pickler):
    """torch's CUDA reduction (what `ForkingPickler` registers for tensors), with the device given by
    UUID as SGLang's patched reduction gives it: the receiver may number the GPUs differently."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        from torch.multiprocessing import reductions

        rebuild, args = reductions.reduce_tensor(obj)  # type: ignore[no-untyped-call]
        return rebuild, (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])


class ColocatedWeights:
    """The trainer's side of the colocated sync: `release()` after a round, `send()` as the publish's
    weight transfer (`stages.publisher.WeightTransfer`).

    `parameters` is called at each publish (e.g. `model.named_parameters`); `send_dtype` converts
    on the way (bf16 engines of an fp32-master trainer), None keeps each tensor's dtype.
    """

    def __init__(
        self,
        parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        engines: ColocatedTarget,
        *,
        device: torch.device | str,
        send_dtype: torch.dtype | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flush_deadline: float = 60.0,
        serialize: Callable[[FlatBucket], str] = serialize_bucket,
    ) -> None:
        """`serialize` turns a bucket into the wire entry (CUDA IPC; a CPU test gives its own)."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self._parameters = parameters
        self._engines = engines
        self.device = torch.device(device)
        self.send_dtype = send_dtype
        self.bucket_bytes = bucket_bytes
        self.flush_deadline = flush_deadline
        self._serialize = serialize
        self.released: set[str] = set()  # what this object released and has not resumed
        self._tp_sizes: dict[str, int] | None = None
        self.buckets_sent = 0
        self._prepared: list[tuple[FlatBucket, str]] | None = None  # built by `prepare`, sent by `send`
        # The last publish's parts, in seconds: building ahead (prepare), resuming the weights, the
        # buckets (of which: building them, the engines' answers), resuming the rest.
        self.timings: dict[str, float] = {}

    async def release(self) -> None:
        """After a round: flush the engines' cache and give all their GPU memory to the trainer."""
        await self._engines.flush_cache(self.flush_deadline)
        # Raises (the run stops) when an engine refused or did not answer; a refused release
        # released nothing, and nothing is marked to resume.
        await self._engines.release_memory_occupation(None)
        self.released.update(ALL_TAGS)

    async def prepare(self) -> None:
        """Before the gate closes: build and serialize the buckets while the engines still generate,
        so that the publish's stall is the engines' copies alone. Only while the engines hold their
        memory (async on one GPU): the trainer then holds one more copy of the weights in the send
        dtype until the engines answered. Built ahead, a bucket takes every tensor of its dtype
        (`bucket_bytes` would save no memory: all are held at once), so the stall has one round
        trip a dtype; on the H200, 0.6B in bf16: 17.6 ms, against 25.5 in 512 MiB buckets. After a
        release (sync, colocated) nothing is built ahead: the engines are idle, and the memory
        goes to the trainer's step and then back to them, one `bucket_bytes` bucket at a time."""
        self.discard()
        if self.released:
            return
        t0 = time.perf_counter()
        self._prepared = await anyio.to_thread.run_sync(self._build_all)
        self.timings = {"prepare": time.perf_counter() - t0}

    def discard(self) -> None:
        """Drop buckets a `prepare` built and no `send` took (a publish that failed before it)."""
        held, self._prepared = self._prepared, None
        if held is not None:
            del held
            _collect_ipc(self.device)

    def _build_all(self) -> list[tuple[FlatBucket, str]]:
        built = []
        every = plan_buckets(self._parameters(), bucket_bytes=sys.maxsize, dtype=self.send_dtype)
        for named in every:
            bucket = flatten_bucket(named, dtype=self.send_dtype, device=self.device)
            built.append((bucket, self._serialize(bucket)))
        return built

    async def send(self, weight_version: str, *, flush_cache: bool = True) -> None:
        """Resume the weights' memory, hand every tensor over bucket by bucket (those `prepare`
        built, or each built in turn), resume the rest.

        Only the last bucket carries `weight_version` and `flush_cache` (the engines are paused
        throughout: nothing decodes between buckets). Raises EngineError naming the engine."""
        if self._tp_sizes is None:
            self._tp_sizes = await self._engines.tp_sizes()
        if self.released:  # what training left cached goes back first: the engines map theirs again
            await anyio.to_thread.run_sync(_give_back_cache, self.device)
        prepared, self._prepared = self._prepared, None
        failed = True
        if prepared is None:  # else the timings `prepare` started
            self.timings = {}
        self.timings.update(build=0.0, engines=0.0)
        try:
            t0 = time.perf_counter()
            await self._resume([WEIGHTS])
            t1 = time.perf_counter()
            if prepared is not None:
                while prepared:  # popped as sent: nothing here holds a bucket the engines answered for
                    last = len(prepared) == 1
                    await self._send_entry(*prepared.pop(0), weight_version if last else None, flush_cache and last)
            else:
                plan = await anyio.to_thread.run_sync(self._plan)
                for i, named in enumerate(plan):
                    last = i == len(plan) - 1
                    await self._send_bucket(named, weight_version if last else None, flush_cache and last)
            self.timings.update(resume_weights=t1 - t0, buckets=time.perf_counter() - t1)
            failed = False
        finally:
            with anyio.CancelScope(shield=True):
                if self.released:  # the buckets' blocks go back before the KV cache is mapped again
                    await anyio.to_thread.run_sync(_give_back_cache, self.device)
                t2 = time.perf_counter()
                await self._resume_rest(quiet=failed)
                self.timings["resume_rest"] = time.perf_counter() - t2

    def _plan(self) -> list[list[tuple[str, torch.Tensor]]]:
        return plan_buckets(self._parameters(), bucket_bytes=self.bucket_bytes, dtype=self.send_dtype)

    async def _send_bucket(
        self, named: list[tuple[str, torch.Tensor]], weight_version: str | None, flush_cache: bool
    ) -> None:
        held: list[FlatBucket] = []

        def build() -> str:  # one worker-thread hop: the copies, then the handle to them
            held.append(flatten_bucket(named, dtype=self.send_dtype, device=self.device))
            return self._serialize(held[0])

        t0 = time.perf_counter()
        entry = await anyio.to_thread.run_sync(build)
        self.timings["build"] += time.perf_counter() - t0
        await self._send_entry(held.pop(), entry, weight_version, flush_cache)

    async def _send_entry(self, bucket: FlatBucket, entry: str, weight_version: str | None, flush_cache: bool) -> None:
        """Post one bucket's entry; `bucket` (its buffer) stays alive until every engine answered,
        each having copied it by then."""
        assert self._tp_sizes is not None
        t0 = time.perf_counter()
        try:
            await self._engines.update_weights_from_tensor(
                entry, tp_sizes=self._tp_sizes, weight_version=weight_version, flush_cache=flush_cache
            )
            self.buckets_sent += 1
        finally:
            del bucket
            self.timings["engines"] += time.perf_counter() - t0
            # The engines closed their handles before answering: the block is free for the next
            # bucket (kept cached: the next one reuses it rather than allocating anew).
            await anyio.to_thread.run_sync(_collect_ipc, self.device)

    async def _resume(self, tags: Sequence[str]) -> None:
        wanted = [t for t in tags if t in self.released]
        if not wanted:
            return
        try:
            await self._engines.resume_memory_occupation(wanted)
        except EngineError as exc:
            # The engine gave its memory to the trainer after the round and does not take it
            # back: it died (or was restarted) while the trainer trained. Said with what is kept.
            kind = type(exc)
            raise kind(
                exc.url,
                f"{str(exc).removeprefix(exc.url).lstrip(': ')}; colocated, the engine released its GPU memory "
                "for training and did not take it back (did it die while the trainer trained?); the trained "
                "step is committed, the store and the checkpoints are intact",
                status=exc.status,
            ) from exc
        self.released.difference_update(wanted)

    async def _resume_rest(self, *, quiet: bool) -> None:
        try:
            await self._resume([KV_CACHE, CUDA_GRAPH])
        except EngineError as exc:
            if not quiet:
                raise
            # The publish failed already and says why; this one would hide it.
            log.warning("resuming the engines' KV cache after a failed publish failed too", error=str(exc))


def _collect_ipc(device: torch.device) -> None:
    """Release the CUDA IPC bookkeeping of buckets the engines closed."""
    if device.type == "cuda":
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


def _give_back_cache(device: torch.device) -> None:
    """Blocks this process keeps cached go back to the device, for the engines to map theirs."""
    if device.type == "cuda":
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()
