"""The built-in engine's side of `/update_weights_from_tensor` (SGLang 3.3): weights handed over by a
process on the same GPU as CUDA IPC handles, with no copy through disk or NCCL.

    body: {"serialized_named_tensors": [entry per TP rank], "load_format": "flattened_bucket",
           "flush_cache": true, "abort_all_requests": false, "weight_version": "3"}

The engine has one TP rank, so it reads the first entry (SGLang's rank 0 does the same). The entry
is read by `tensor_wire.load_bucket` (a restricted unpickler: nothing but torch's CUDA rebuild and
the bucket's metadata may run), its tensors are checked against the live weights (names, shapes)
and copied into them between two decode steps, straight from the sender's memory: colocated, a
staging copy would cost the memory the colocation is for. The copy is synchronized before the
answer, so the sender may free the bucket as soon as it has it (slime's sender frees on the
answer). The IPC views are dropped before answering too, closing the handles.

A bucket that is refused (a name the model lacks, a shape that differs, a handle that cannot be
opened because its sender died) changes nothing; one that fails midway through the copies leaves
the weights partly written, and says so. `weight_version` is set by every call that carries it and
succeeds (SGLang's rule); slime sends it with each bucket, our sender with the last.

Only a GPU engine takes this call (CUDA IPC); a CPU engine refuses it before reading the body's
payload. While the weights' memory is released the call is refused with the resume that fixes it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import torch

from engines.occupation import MemoryOccupation, OccupationError
from engines.scheduler import EngineCore
from engines.tensor_wire import WireError, load_bucket, unflatten
from engines.torch_model import ModelRunner

__all__ = ["TensorUpdateError", "TensorWeightReceiver"]

log = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"


class TensorUpdateError(Exception):
    """An update refused or failed; its message is the HTTP answer's."""


class TensorWeightReceiver:
    """Reads `/update_weights_from_tensor` bodies and writes their tensors into the live weights."""

    def __init__(self, runner: ModelRunner, core: EngineCore, occupation: MemoryOccupation | None = None) -> None:
        self._runner = runner
        self._core = core
        self._occupation = occupation
        self._lock = anyio.Lock()
        self.updates = 0
        # The last update's parts, in seconds (in /server_info): opening the handles and reading the
        # bucket, the copies into the weights (synchronized), closing the handles.
        self.last_timings: dict[str, float] = {}

    async def update(self, body: dict[str, Any]) -> str:
        device = self._runner.device
        if device.type != "cuda":
            raise TensorUpdateError(
                f"/update_weights_from_tensor takes CUDA IPC handles and this engine runs on {device}; "
                "publish through /update_weights_from_disk (or _from_distributed) instead"
            )
        if self._occupation is not None:
            try:
                self._occupation.refuse_weights_update("/update_weights_from_tensor")
            except OccupationError as exc:
                raise TensorUpdateError(str(exc)) from exc
        entry = _parse(body)
        version = body.get("weight_version")
        async with self._lock:
            t0 = time.perf_counter()
            try:
                named = await anyio.to_thread.run_sync(_open_bucket, entry, device)
                t1 = time.perf_counter()
                self._check_fit(named)
                await self._core.apply_staged(dict(named), weight_version=None if version is None else str(version))
                # The sender frees the bucket once it has the answer: the copies must be done by then.
                await anyio.to_thread.run_sync(torch.cuda.synchronize, device)
            except (WireError, RuntimeError) as exc:
                raise TensorUpdateError(f"update_weights_from_tensor failed: {exc}") from exc
            t2 = time.perf_counter()
            names = [n for n, _ in named]
            del named  # the IPC views: their handles close with them
            self.last_timings = {"open": t1 - t0, "copy": t2 - t1, "close": time.perf_counter() - t2}
            if self._occupation is not None:
                self._occupation.written(names)
            self.updates += 1
        return f"Succeeded to update parameter online ({len(names)} tensors)."

    def _check_fit(self, named: list[tuple[str, torch.Tensor]]) -> None:
        live = self._runner.live_weights()
        problems = []
        for name, t in named:
            if name not in live:
                problems.append(f"unexpected tensor {name!r}")
            elif tuple(t.shape) != tuple(live[name].shape):
                problems.append(f"{name!r} has shape {tuple(t.shape)}, the model has {tuple(live[name].shape)}")
            elif not t.dtype.is_floating_point and live[name].dtype.is_floating_point:
                problems.append(f"{name!r} is {t.dtype}, the model's is {live[name].dtype}")
        if problems:
            raise WireError("; ".join(problems) + " (nothing of this bucket was written)")


def _parse(body: dict[str, Any]) -> str:
    entries = body.get("serialized_named_tensors")
    if not isinstance(entries, list) or not entries:
        raise TensorUpdateError(
            f"serialized_named_tensors must be a non-empty list (one entry per TP rank), got {type(entries).__name__}"
        )
    load_format = body.get("load_format")
    if load_format != FLATTENED_BUCKET:
        raise TensorUpdateError(
            f"load_format {load_format!r} is not supported by the built-in engine: send flattened buckets "
            f"(load_format {FLATTENED_BUCKET!r}, SGLang's FlattenedTensorBucket, as slime does)"
        )
    entry = entries[0]  # this engine is TP rank 0 of 1
    if not isinstance(entry, str):
        raise TensorUpdateError(f"a serialized entry must be a base64 string, got {type(entry).__name__}")
    return entry


def _open_bucket(entry: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    with torch.cuda.device(device):  # a worker thread's current device need not be the engine's
        return unflatten(load_bucket(entry))
