"""What `/update_weights_from_tensor` carries, read without trusting it: a restricted unpickler for
SGLang's serialized named tensors, and the flattened bucket they hold.

On the wire (SGLang 3.3, what slime sends colocated) each entry of `serialized_named_tensors` is
base64 of `MultiprocessingSerializer.serialize({"flattened_tensor": T, "metadata": [m, ...]})`: a
pickle in which T is a CUDA tensor reduced by torch's `reduce_tensor` (its storage travels as a
CUDA IPC handle: `rebuild_cuda_tensor(...)` opens it in the receiving process) and each m names a
slice of T (`FlattenedTensorMetadata`: name, shape, dtype, start_idx, end_idx, numel).

Unpickling runs whatever callables the stream names, so pickle on an HTTP endpoint is remote code
execution. `load_bucket` admits only what that payload needs: torch's CUDA rebuild function (and
SGLang's patched twin, which takes the device by UUID), the tensor and storage classes it passes,
`torch.Size`, torch's dtypes, and the metadata classes (SGLang's dataclass, or a
`types.SimpleNamespace`), each mapped to a local stand-in that checks its arguments. Any other name
is refused before anything runs (`WireError`, HTTP 400, naming it). That bounds what a request can
make the engine do to opening a CUDA IPC handle; the engine still binds to loopback and takes
`--api-key` (guards.py), because a handle opens memory of another process on the machine.

A bucket comes in two layouts: SGLang's current one (T is bytes, uint8, and `start_idx`/`end_idx`
are byte offsets, any dtype per entry) and the older one (T has the entries' one dtype, offsets in
elements). `unflatten` gives views into T; nothing is copied until the weights are written.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Bucket", "BucketEntry", "WireError", "load_bucket", "unflatten"]

# An entry is handles and metadata, a few hundred bytes a tensor: 8 MiB is far beyond any model.
MAX_ENTRY_BYTES = 8 * 1024 * 1024


class WireError(Exception):
    """A serialized bucket refused; the message is the HTTP answer's."""


class BucketEntry:
    """One tensor's place in a flattened bucket (SGLang's `FlattenedTensorMetadata`). Built by the
    unpickler from either metadata class; `check` says whether its fields make sense."""

    name: Any
    shape: Any
    dtype: Any
    start_idx: Any
    end_idx: Any
    numel: Any

    def __init__(self, *args: object, **kwargs: object) -> None:
        if args:  # only pickle's own calls construct these: REDUCE with (), NEWOBJ, then BUILD
            raise WireError("metadata objects are built from their state, not from arguments")

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:  # a dataclass with slots
            state = state[1]
        if not isinstance(state, dict):
            raise WireError(f"metadata state must be a dict, got {type(state).__name__}")
        for key in ("name", "shape", "dtype", "start_idx", "end_idx", "numel"):
            setattr(self, key, state.get(key))

    def check(self) -> str | None:
        if not isinstance(self.name, str) or not self.name:
            return f"a metadata name must be a non-empty string, got {self.name!r}"
        if not isinstance(self.shape, (tuple, list)) or not all(_is_int(d) and d >= 0 for d in self.shape):
            return f"{self.name!r}: shape must be non-negative integers, got {self.shape!r}"
        if not isinstance(self.dtype, torch.dtype):
            return f"{self.name!r}: dtype must be a torch dtype, got {self.dtype!r}"
        if not (_is_int(self.start_idx) and _is_int(self.end_idx) and 0 <= self.start_idx <= self.end_idx):
            got = f"{self.start_idx!r}, {self.end_idx!r}"
            return f"{self.name!r}: start_idx/end_idx must be integers 0 <= start <= end, got {got}"
        return None


@dataclass(frozen=True, slots=True)
class Bucket:
    flat: torch.Tensor
    entries: list[BucketEntry]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor`, its arguments checked first; the device may be an index or a
    device UUID (SGLang's patched reducer sends UUIDs, so that processes that number the GPUs
    differently, through CUDA_VISIBLE_DEVICES, agree)."""
    from torch.multiprocessing import reductions

    if len(args) != 15:
        raise WireError(f"rebuild_cuda_tensor takes 15 arguments, got {len(args)}")
    tensor_cls, size, stride, offset, storage_cls, dtype, device = args[:7]
    if tensor_cls is not torch.Tensor:
        raise WireError(f"a bucket's tensor must be a plain torch.Tensor, got {tensor_cls!r}")
    if storage_cls not in (torch.storage.TypedStorage, torch.UntypedStorage):
        raise WireError(f"a tensor's storage must be a torch storage class, got {storage_cls!r}")
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"a tensor's dtype must be a torch dtype, got {dtype!r}")
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and _is_int(offset)):
        raise WireError("a tensor's size, stride and offset must be tuples and an integer")
    if not isinstance(args[7], (bytes, type(None))) or not isinstance(args[11], (bytes, type(None))):
        raise WireError("CUDA IPC handles must be bytes")
    if not torch.cuda.is_available():
        raise WireError("the payload carries CUDA IPC handles and this process has no GPU")
    index = _device_index(device)
    try:
        rebuilt: torch.Tensor = reductions.rebuild_cuda_tensor(*args[:6], index, *args[7:])  # type: ignore[call-arg,no-untyped-call]
        return rebuilt
    except RuntimeError as exc:  # a handle of a process that is gone, or of memory it freed
        raise WireError(
            f"cannot open the CUDA IPC handle of a {tuple(size)} tensor: {exc}; the sender must keep the "
            "tensor alive until this call answers (a trainer that died or freed it first)"
        ) from exc


def _device_index(device: object) -> int:
    if _is_int(device):
        assert isinstance(device, int)
        if not 0 <= device < torch.cuda.device_count():
            raise WireError(f"CUDA device {device} is not visible here ({torch.cuda.device_count()} devices)")
        return device
    if isinstance(device, str):
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == device:
                return i
        raise WireError(f"no GPU visible here has the UUID {device!r}: trainer and engine must share the GPU")
    raise WireError(f"a tensor's device must be an index or a UUID, got {device!r}")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise WireError(f"refused torch.{name}: not a dtype")
    return value


# module -> name -> what the stream gets for it. Everything else is refused.
_ADMITTED: dict[str, dict[str, Any]] = {
    "torch.multiprocessing.reductions": {"rebuild_cuda_tensor": _rebuild_cuda_tensor},
    "sglang.srt.utils.patch_torch": {"_rebuild_cuda_tensor_modified": _rebuild_cuda_tensor},
    "sglang.srt.patch_torch": {"_rebuild_cuda_tensor_modified": _rebuild_cuda_tensor},
    "torch": {"Tensor": torch.Tensor, "Size": torch.Size, "UntypedStorage": torch.UntypedStorage},
    "torch.storage": {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage},
    "types": {"SimpleNamespace": BucketEntry},
    "sglang.srt.weight_sync.tensor_bucket": {"FlattenedTensorMetadata": BucketEntry},
    "sglang.srt.model_executor.model_runner": {"FlattenedTensorMetadata": BucketEntry},
}


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ADMITTED.get(module, {}).get(name)
        if found is not None:
            return found
        if module == "torch" and not name.startswith("_"):
            return _dtype(name)
        raise WireError(
            f"refused {module}.{name}: a serialized bucket may name only torch's CUDA tensor rebuild, "
            "tensor, storage, Size and dtype, and the bucket metadata class"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise WireError("refused a persistent id: a serialized bucket has none")


def load_bucket(serialized: object) -> Bucket:
    """One entry of `serialized_named_tensors` (base64 text, as over HTTP) -> the bucket it holds.
    Raises WireError, having run nothing but the admitted constructors."""
    if not isinstance(serialized, str):
        raise WireError(f"a serialized entry must be a base64 string, got {type(serialized).__name__}")
    if len(serialized) > MAX_ENTRY_BYTES * 4 // 3 + 4:
        raise WireError(f"a serialized entry of {len(serialized)} characters: handles and metadata fit in far less")
    try:
        raw = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"a serialized entry is not base64: {exc}") from exc
    try:
        obj = _Restricted(io.BytesIO(raw)).load()
    except WireError:
        raise
    except Exception as exc:  # a truncated or malformed stream: pickle's own errors
        raise WireError(f"a serialized entry is not a readable pickle: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= obj.keys():
        kind = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise WireError(f"load_format flattened_bucket: expected {{'flattened_tensor', 'metadata'}}, got {kind}")
    flat, entries = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor):
        raise WireError(f"flattened_tensor must be a tensor, got {type(flat).__name__}")
    if not isinstance(entries, list) or not all(isinstance(e, BucketEntry) for e in entries):
        raise WireError("metadata must be a list of FlattenedTensorMetadata")
    return Bucket(flat, entries)


def unflatten(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a bucket, as views into its flat tensor. Raises WireError."""
    flat = bucket.flat
    if flat.dim() != 1:
        raise WireError(f"flattened_tensor must be one-dimensional, got shape {tuple(flat.shape)}")
    out: list[tuple[str, torch.Tensor]] = []
    for e in bucket.entries:
        if problem := e.check():
            raise WireError(problem)
        count = math.prod(e.shape)
        if e.end_idx > flat.numel():
            raise WireError(f"{e.name!r}: end_idx {e.end_idx} is past the bucket's {flat.numel()} elements")
        if flat.dtype == e.dtype:  # one dtype, offsets in elements (and uint8 entries of either layout)
            piece = flat[e.start_idx : e.end_idx]
        elif flat.dtype == torch.uint8:  # SGLang's layout for mixed dtypes: offsets in bytes
            size = e.dtype.itemsize
            if (flat.storage_offset() + e.start_idx) % size:
                raise WireError(f"{e.name!r}: byte offset {e.start_idx} is not aligned to {e.dtype}'s {size} bytes")
            if (e.end_idx - e.start_idx) != count * size:
                raise WireError(f"{e.name!r}: {e.end_idx - e.start_idx} bytes for {count} values of {e.dtype}")
            piece = flat[e.start_idx : e.end_idx].view(e.dtype)
        else:
            raise WireError(f"{e.name!r}: a {flat.dtype} bucket cannot hold a {e.dtype} tensor")
        if piece.numel() != count:
            raise WireError(f"{e.name!r}: {piece.numel()} values for shape {tuple(e.shape)}")
        out.append((e.name, piece.reshape(tuple(e.shape))))
    return out
