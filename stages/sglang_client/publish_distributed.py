"""Weight publish over torch.distributed, as SGLang does it (`--update-weight-transport distributed`).

The trainer process is rank 0 of a group it shares with every engine: engine i joins at rank
`i + 1` (one rank per engine; the built-in engine has one). The trainer opens the group's store,
tells each engine `/init_weights_update_group` while it joins itself (the engines' calls block until
the rendezvous completes, so both must be in flight at once), and publishes by firing
`/update_weights_from_distributed` for a bucket of tensors and broadcasting those tensors while the
calls are pending. An engine stages what it receives and swaps only once every tensor arrived, so a
publish that fails mid-transfer leaves the old weights and the old version serving.

The group is built from torch's public process-group classes on its own store rather than
`init_process_group`, so it never touches the process's default group: a trainer that already uses
one (DDP) keeps it, and tests can hold several groups in one process. Gloo on CPU, NCCL on a GPU
(the backend follows the device unless given).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import torch
from torch._C._distributed_c10d import Store, TCPStore  # torch.distributed's own names

from core.errors import EngineError
from core.weight_group import GROUP_NAME, Group, backend_for, dtype_name, open_group

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DistributedWeightSender",
    "TensorSpec",
    "WeightGroupTarget",
]

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024  # slime's default update-weight buffer size


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a bucket, as `/update_weights_from_distributed` announces it."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class WeightGroupTarget(Protocol):
    """The engine-side calls a distributed publish needs (an `EngineFleet`)."""

    @property
    def worker_urls(self) -> Sequence[str]: ...

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str
    ) -> None: ...

    async def update_weights_from_distributed(
        self, specs: Sequence[TensorSpec], *, group_name: str, weight_version: str | None, flush_cache: bool
    ) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...


class DistributedWeightSender:
    """Rank 0 of the weight-update group: broadcasts a torch module's parameters to the engines.

    `parameters` is called at each publish (e.g. `model.named_parameters`), so it always sends the
    trained values; `send_dtype` converts on the way (bf16 engines of an fp32 trainer), None keeps
    each parameter's dtype. `connect` once, `send` per publish, `close` at the end.
    """

    def __init__(
        self,
        parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        engines: WeightGroupTarget,
        *,
        device: torch.device | str = "cpu",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str | None = None,
        send_dtype: torch.dtype | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group_name: str = GROUP_NAME,
        timeout: float = 300.0,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self._parameters = parameters
        self._engines = engines
        self.device = torch.device(device)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend or backend_for(self.device)
        self.send_dtype = send_dtype
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.timeout = timeout
        self._group: Group | None = None
        self._store: Store | None = None
        self._prepared: list[list[tuple[str, torch.Tensor]]] | None = None  # built by `prepare`

    @property
    def connected(self) -> bool:
        return self._group is not None

    async def connect(self) -> None:
        """Open the store, then join the group while every engine joins it (one rendezvous)."""
        world_size = len(self._engines.worker_urls) + 1
        store = await anyio.to_thread.run_sync(self._open_store, world_size)
        self._store = store
        port = int(store.port)
        joined: list[Group] = []

        async def join() -> None:
            joined.append(await anyio.to_thread.run_sync(self._join, store, world_size, abandon_on_cancel=True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(join)
            await self._engines.init_weights_update_group(
                master_address=self.master_address,
                master_port=port,
                world_size=world_size,
                group_name=self.group_name,
                backend=self.backend,
            )
        self._group = joined[0]

    def _open_store(self, world_size: int) -> TCPStore:
        return TCPStore(
            self.master_address,
            self.master_port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=self.timeout),
            wait_for_workers=False,
        )

    def _join(self, store: Store, world_size: int) -> Group:
        return open_group(
            master_address=self.master_address,
            master_port=0,
            rank=0,
            world_size=world_size,
            group_name=self.group_name,
            backend=self.backend,
            timeout=self.timeout,
            store=store,
        )

    def buckets(self) -> list[list[tuple[str, torch.Tensor]]]:
        """The parameters in order, cut into buckets of about `bucket_bytes` (one tensor at least)."""
        out: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, param in self._parameters():
            t = param.detach()
            if self.send_dtype is not None:
                t = t.to(self.send_dtype)
            nbytes = t.numel() * t.element_size()
            if out[-1] and size + nbytes > self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append((name, t.to(self.device).contiguous()))
            size += nbytes
        return [b for b in out if b]

    async def prepare(self) -> None:
        """Before the gate closes: read the weights into their buckets while the engines still
        generate (the same memory `send` would take: it holds every bucket at once too)."""
        self._prepared = await anyio.to_thread.run_sync(self.buckets)

    def discard(self) -> None:
        self._prepared = None

    async def send(self, weight_version: str, *, flush_cache: bool = True) -> None:
        """Publish every parameter (joining the group first if not in it); each engine swaps to
        `weight_version` once the last bucket arrived.

        Only the last bucket carries `weight_version` and `flush_cache`: SGLang loads each bucket
        as it arrives and stamps (and starts a version span at) any call that carries a version,
        so tokens decoded mid-transfer (an overlapped publish) keep the older version, the
        conservative bound; and it flushes after every call asked to, asserting that it could.

        Raises EngineError (naming the engines) if any engine refused or the transfer broke; the
        engines then keep their old weights and version."""
        if self._group is None:  # the first publish, or the one after a broken transfer
            await self.connect()
        group = self._group
        assert group is not None
        # Off the event loop: reading the weights copies them, and a megatron trainer gathers its
        # tensor-parallel shards from the other ranks first. `prepare` did it before the gate.
        buckets, self._prepared = self._prepared, None
        if buckets is None:
            buckets = await anyio.to_thread.run_sync(self.buckets)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in bucket]
            broken: list[BaseException] = []
            failure: EngineError | None = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(_broadcast_bucket, group, [t for _, t in bucket], broken)
                try:
                    await self._engines.update_weights_from_distributed(
                        specs,
                        group_name=self.group_name,
                        weight_version=weight_version if last else None,
                        flush_cache=flush_cache and last,
                    )
                except EngineError as exc:
                    # The group is out of step now (an engine stopped receiving): drop it, which
                    # also ends our pending broadcast; the next publish must connect again.
                    failure = exc
                    _shutdown(group)
                    tg.cancel_scope.cancel()
            if failure is not None or broken:
                self._group = None
                _shutdown(group)
                raise failure or EngineError("weight_update_group", f"broadcast failed: {broken[0]}")

    async def close(self) -> None:
        """Tell the engines to leave the group, then drop it here."""
        group, self._group, self._store = self._group, None, None
        if group is None:
            return
        try:
            await self._engines.destroy_weights_update_group(self.group_name)
        finally:
            _shutdown(group)


async def _broadcast_bucket(group: Group, tensors: Sequence[torch.Tensor], broken: list[BaseException]) -> None:
    try:
        await anyio.to_thread.run_sync(_broadcast, group, tensors, abandon_on_cancel=True)
    except RuntimeError as exc:  # gloo/NCCL report a lost peer or a timeout as RuntimeError
        broken.append(exc)


def _broadcast(group: Group, tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        group.broadcast(t, 0).wait()


def _shutdown(group: Any) -> None:
    try:
        group.shutdown()
    except (RuntimeError, AttributeError):  # older builds, or a group already broken by a failure
        pass
