"""GPU memory an engine can give back and take again: SGLang's `--enable-memory-saver`, on
`torch_memory_saver` (the library SGLang uses).

Colocated on one GPU (slime's `--colocate`), the trainer needs the memory the engine holds while it
trains. The engine allocates each kind of memory inside a tagged region, SGLang's tags:

    weights      the model's parameters (buffers such as the rotary tables are kept: small, and
                 no update would bring them back)
    kv_cache     the slot cache
    cuda_graph   the decode graphs' memory pool

`pause(tag)` unmaps the physical memory of every allocation of that tag and keeps its virtual
addresses; `resume(tag)` maps fresh physical memory at the same addresses. Captured CUDA graphs read
those addresses, so they replay unchanged after a resume (the library's cuda_graph and rl examples
check exactly this). What a resumed allocation holds is undefined unless it was backed up on the
CPU: the engine's weights are rewritten by the publish that follows (SGLang's semantics), the KV
cache is zeroed, the graphs' scratch is rewritten by every replay.

How the library hooks allocations: `LD_PRELOAD` of its hook library (`hook_mode="preload"`, the
default and the only mode that can make CUDA graph pools releasable), so the engine process must
start with it; `engines.builtin` re-executes itself with it when `--enable-memory-saver` is given
(`preload_environment`). Through torch's `cuda` API it drives NVIDIA and AMD ROCm builds alike
(the library ships HIP builds of its hooks). Two rules of the library are kept by `MemoryOccupation`
(`occupation.py`), not here: a tag is paused only while active and resumed only while paused (it
exits the process otherwise), and nothing is allocated in a region while its tag is paused.

On a CPU (or without the flag) `NoMemorySaver` stands in: regions are plain allocations and a
release is refused with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError

if TYPE_CHECKING:  # torch only where an engine uses a GPU: the HTTP surface imports this module
    import torch

__all__ = [
    "ALL_TAGS",
    "CUDA_GRAPH",
    "KV_CACHE",
    "WEIGHTS",
    "MemorySaver",
    "NoMemorySaver",
    "TorchMemorySaver",
    "open_memory_saver",
    "preload_environment",
]

# SGLang's constants (`sglang.srt.constants.GPU_MEMORY_TYPE_*`); a release without tags means all.
WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"
ALL_TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)

_PACKAGE = "torch_memory_saver"
_HOOK = "torch_memory_saver_hook_mode_preload"


class MemorySaver:
    """Where an engine allocates what it may release. This base is the stand-in (`NoMemorySaver`):
    plain allocations, nothing to release."""

    enabled = False
    weights_backed_up = False  # resumed weights keep their contents (a CPU copy, `--enable-weights-cpu-backup`)

    def __init__(self, why_not: str = "") -> None:
        self.why_not = why_not  # why a release is refused, for the HTTP answer

    def region(self, tag: str) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def cuda_graph(
        self, graph: torch.cuda.CUDAGraph, *, pool: Any, stream: Any, capture_error_mode: str
    ) -> AbstractContextManager[object]:
        import torch

        return torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)

    def pause(self, tag: str) -> None:
        raise RuntimeError(self.why_not)

    def resume(self, tag: str) -> None:
        raise RuntimeError(self.why_not)


class NoMemorySaver(MemorySaver):
    """An engine that cannot release its memory, and why."""


class TorchMemorySaver(MemorySaver):
    """`torch_memory_saver`'s regions, graph capture, pause and resume (the process-wide singleton)."""

    enabled = True

    def __init__(self, device: torch.device, *, weights_cpu_backup: bool = False) -> None:
        super().__init__()
        from torch_memory_saver import torch_memory_saver

        self._saver = torch_memory_saver
        self._device = device
        self.weights_backed_up = weights_cpu_backup

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        import torch

        backup = tag == WEIGHTS and self.weights_backed_up
        # The library keys its pools by the current device, and its region config is per thread:
        # entered on the allocating thread, with the engine's device current.
        with torch.cuda.device(self._device), self._saver.region(tag=tag, enable_cpu_backup=backup):
            yield

    def cuda_graph(
        self, graph: torch.cuda.CUDAGraph, *, pool: Any, stream: Any, capture_error_mode: str
    ) -> AbstractContextManager[object]:
        return self._saver.cuda_graph(  # type: ignore[no-any-return]
            graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode, tag=CUDA_GRAPH
        )

    def pause(self, tag: str) -> None:
        self._saver.pause(tag)

    def resume(self, tag: str) -> None:
        self._saver.resume(tag)


def open_memory_saver(device: torch.device, *, enabled: bool, weights_cpu_backup: bool = False) -> MemorySaver:
    """The saver for an engine on `device`: the library's with `enabled` (`--enable-memory-saver`),
    else the stand-in that says why a release is refused. Raises ConfigError when the flag cannot
    be honoured here (a CPU device, the library missing, the process started without its hook)."""
    if not enabled:
        reason = (
            f"this engine runs on {device}: releasing memory needs a GPU engine started with --enable-memory-saver"
            if device.type != "cuda"
            else "this engine was started without --enable-memory-saver (SGLang's flag): it cannot release its memory"
        )
        return NoMemorySaver(reason)
    problems = []
    if device.type != "cuda":
        problems.append(f"--enable-memory-saver needs a GPU engine (--device cuda); this one runs on {device}")
    elif importlib.util.find_spec(_PACKAGE) is None:
        problems.append("--enable-memory-saver needs the torch-memory-saver package: pip install torch-memory-saver")
    elif not _hook_preloaded():
        problems.append(
            "--enable-memory-saver: the process was started without torch_memory_saver's hook in LD_PRELOAD; "
            "start it with python -m engines.builtin, which sets it (or set LD_PRELOAD to "
            f"{_hook_library() or 'the hook library'})"
        )
    elif not _hook_active():
        problems.append(
            "--enable-memory-saver: torch_memory_saver's hook is in LD_PRELOAD but does not serve cudaMalloc "
            "(the loader could not preload it: is the CUDA runtime it needs on LD_LIBRARY_PATH? the process "
            "log's first lines say); nothing could be released"
        )
    if problems:
        raise ConfigError(problems)
    return TorchMemorySaver(device, weights_cpu_backup=weights_cpu_backup)


def preload_environment() -> dict[str, str] | None:
    """This process's environment with the library's hook added to LD_PRELOAD, or None when it is
    there already (or the library is missing: `open_memory_saver` then says so)."""
    if _hook_preloaded():
        return None
    library = _hook_library()
    if library is None:
        return None
    current = os.environ.get("LD_PRELOAD", "")
    env = {**os.environ, "LD_PRELOAD": f"{library}:{current}" if current else library}
    # The hook needs the CUDA runtime when the process starts, before torch is imported: the one
    # torch loads may sit in its wheels' folder (nvidia/.../lib), which only torch's own RPATH names.
    runtime = _cuda_runtime_dir()
    if runtime is not None:
        paths = [runtime, *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
        env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(paths))
    return env


def _cuda_runtime_dir() -> str | None:
    """The folder of the CUDA (or HIP) runtime library this process loaded with torch."""
    import torch  # noqa: F401  (loads the runtime on GPU builds)

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "/libcudart.so" in path or "/libamdhip64.so" in path:
                    return os.path.dirname(path)
    except OSError:  # not Linux
        pass
    return None


def _hook_preloaded() -> bool:
    return any(_HOOK in part for part in os.environ.get("LD_PRELOAD", "").split(":"))


def _hook_active() -> bool:
    """Whether the process's cudaMalloc is the preloaded hook's (the loader skips a preload it
    cannot load, with one line on stderr, and the regions would then release nothing)."""
    import ctypes

    library = next((p for p in os.environ.get("LD_PRELOAD", "").split(":") if _HOOK in p), None)
    if library is None:
        return False
    try:
        hook = ctypes.cast(ctypes.CDLL(library).cudaMalloc, ctypes.c_void_p).value
        served = ctypes.cast(ctypes.CDLL(None).cudaMalloc, ctypes.c_void_p).value
    except (OSError, AttributeError):  # not loadable, or no cudaMalloc in the process's global scope
        return False
    return hook is not None and hook == served


def _hook_library() -> str | None:
    """The hook library built for this torch's GPU runtime (the library picks CUDA 12, 13 or HIP)."""
    if importlib.util.find_spec(_PACKAGE) is None:
        return None
    from torch_memory_saver.utils import get_binary_path_from_package

    with contextlib.suppress(RuntimeError):  # a wheel without a build for this runtime
        return str(get_binary_path_from_package(_HOOK))
    return None
