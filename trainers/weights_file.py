"""The publish folder's weights, written as one safetensors file through a reused host buffer.

`save_pretrained` moves each tensor to the host on its own (a blocking copy and a sync per
tensor), builds the file's bytes in memory and then writes them: 1.0-1.7 s a publish for the
0.6B shape in bf16 on the H200 machine, a third of the async training step
(`benchmarks/trainer_step.py`). Here every tensor is copied into one page-locked buffer without
waiting, the device is synced once, and the buffer goes to the file in one write. The buffer is
kept for the next publish; a model larger than `chunk_bytes` goes through it a chunk at a time, so
host memory stays bounded.

The format is safetensors' own: an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes. Any safetensors reader (SGLang, transformers,
the built-in engine) loads it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["WeightsFileWriter"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
CHUNK_BYTES = 1 << 30


class WeightsFileWriter:
    def __init__(self, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be >= 1")
        self._chunk = chunk_bytes
        self._buffer: torch.Tensor | None = None

    def write(self, path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write `tensors` (on any device; tied names must already be dropped: safetensors holds
        each tensor once) to the safetensors file `path`."""
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        parts: list[tuple[torch.Tensor, int]] = []
        offset = 0
        for name, t in tensors.items():
            if t.dtype not in _DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {t.dtype}: safetensors has no such dtype")
            size = t.numel() * t.element_size()
            header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
            parts.append((t, size))
            offset += size
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with path.open("wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for chunk in self._chunks(parts):
                f.write(self._stage(chunk))

    def _chunks(self, parts: list[tuple[torch.Tensor, int]]) -> list[list[tuple[torch.Tensor, int]]]:
        """Consecutive runs of tensors of at most `chunk_bytes` (a larger tensor alone)."""
        chunks: list[list[tuple[torch.Tensor, int]]] = [[]]
        filled = 0
        for t, size in parts:
            if chunks[-1] and filled + size > self._chunk:
                chunks.append([])
                filled = 0
            chunks[-1].append((t, size))
            filled += size
        return [c for c in chunks if c]

    def _stage(self, chunk: list[tuple[torch.Tensor, int]]) -> memoryview:
        """The chunk's bytes in the host buffer: every copy queued, one sync."""
        total = sum(size for _, size in chunk)
        # Copies from a GPU are queued (into page-locked memory) and waited for once; torch's cuda
        # API also drives ROCm. Any other device copies the plain, blocking way.
        gpus = {t.device for t, _ in chunk if t.device.type == "cuda"}
        buffer = self._host(total, pinned=bool(gpus))
        at = 0
        for t, size in chunk:
            if size:
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                buffer[at : at + size].copy_(flat, non_blocking=t.device.type == "cuda")
            at += size
        for device in gpus:
            torch.cuda.synchronize(device)
        return buffer[:total].numpy().data  # one-dimensional uint8: a memoryview of bytes

    def _host(self, size: int, *, pinned: bool) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.numel() < size or (pinned and not buffer.is_pinned()):
            buffer = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pinned)
            self._buffer = buffer
        return buffer
