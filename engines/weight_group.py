"""The built-in engine's side of SGLang's weight publish over torch.distributed (protocol 3.2).

    /init_weights_update_group       join the trainer's group at `rank_offset` (one rank: no TP)
    /update_weights_from_distributed receive a bucket (names, dtypes, shapes) by broadcast from rank 0
    /destroy_weights_update_group    leave it

Received tensors go into a staging dict, never into the live weights, while the engine keeps
decoding (the receive runs on a worker thread). Buckets accumulate until every weight of the model
arrived; only then are they copied into the live parameters between two decode steps and the
`weight_version` of that last call set, so a publish broken mid-transfer (a lost peer, a timeout,
a tensor that does not fit) leaves the old weights and the old version serving, and drops what was
staged. The group itself comes from `stages.sglang_client.publish_distributed.open_group`, the trainer's code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from core.weight_group import open_group, parse_dtype
from engines.occupation import MemoryOccupation, OccupationError
from engines.scheduler import EngineCore
from engines.torch_model import ModelRunner

__all__ = ["WeightGroupError", "WeightGroupReceiver"]

log = logging.getLogger(__name__)


class WeightGroupError(Exception):
    """A weight-group call that failed; its message is the HTTP answer's."""


@dataclass(frozen=True, slots=True)
class _Bucket:
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]


class WeightGroupReceiver:
    """One engine's membership of a weight-update group and what it staged so far."""

    def __init__(
        self,
        runner: ModelRunner,
        core: EngineCore,
        *,
        timeout: float = 300.0,
        occupation: MemoryOccupation | None = None,
    ) -> None:
        self._runner = runner
        self._core = core
        self._occupation = occupation  # released weights refuse an update; a swap gives them values
        self._timeout = timeout
        self._group: Any = None  # a torch process group (see publish_distributed.Group)
        self._group_name = ""
        self._staged: dict[str, torch.Tensor] = {}
        self._lock = anyio.Lock()

    async def init_group(self, body: dict[str, Any]) -> str:
        problems = _check_init(body)
        if problems:
            raise WeightGroupError("; ".join(problems))
        if self._group is not None:
            raise WeightGroupError(f"already in weight update group {self._group_name!r}; destroy it first")
        backend = str(body.get("backend") or "gloo")
        if backend == "nccl" and self._runner.device.type != "cuda":
            raise WeightGroupError(f"backend 'nccl' needs the engine on a GPU, it runs on {self._runner.device}")
        timeout = float(body.get("timeout_s") or self._timeout)  # our extension; SGLang has none
        try:
            self._group = await anyio.to_thread.run_sync(
                lambda: open_group(
                    master_address=body["master_address"],
                    master_port=int(body["master_port"]),
                    rank=int(body["rank_offset"]),
                    world_size=int(body["world_size"]),
                    group_name=str(body["group_name"]),
                    backend=backend,
                    timeout=timeout,
                ),
                abandon_on_cancel=True,
            )
        except (RuntimeError, ValueError) as exc:
            raise WeightGroupError(f"cannot join weight update group {body['group_name']!r}: {exc}") from exc
        self._group_name = str(body["group_name"])
        return f"Initialized weight update group {self._group_name!r} at rank {body['rank_offset']}."

    async def update(self, body: dict[str, Any]) -> str:
        """Receive one bucket; swap once every weight arrived. Raises WeightGroupError (old weights serve)."""
        group = self._group
        if group is None:
            raise WeightGroupError("no weight update group: call /init_weights_update_group first")
        if self._occupation is not None:
            try:
                self._occupation.refuse_weights_update("/update_weights_from_distributed")
            except OccupationError as exc:
                raise WeightGroupError(str(exc)) from exc
        try:
            bucket = _parse_bucket(body)
        except WeightGroupError:
            self._staged.clear()
            self._drop_group()  # the trainer is broadcasting what we will never receive
            raise
        version = body.get("weight_version")
        async with self._lock:
            try:
                received = await anyio.to_thread.run_sync(self._receive, group, bucket, abandon_on_cancel=True)
                self._check_fit(received)
            except (RuntimeError, WeightGroupError) as exc:
                self._staged.clear()  # a broken transfer: nothing of this publish may go live
                self._drop_group()  # out of step with the trainer's, which drops its own too
                raise WeightGroupError(f"update_weights_from_distributed failed, old weights kept: {exc}") from exc
            self._staged.update(received)
            missing = self._missing()
            if missing:
                return f"Staged {len(self._staged)} tensors; waiting for {len(missing)} more."
            staged, self._staged = self._staged, {}
            await self._core.apply_staged(staged, weight_version=None if version is None else str(version))
            if self._occupation is not None:
                self._occupation.written(None)  # a complete set
        return "Succeeded to update parameter online."

    async def destroy(self, body: dict[str, Any]) -> str:
        self._staged.clear()
        if self._group is None:
            raise WeightGroupError(f"no weight update group {body.get('group_name')!r} to destroy")
        self._drop_group()
        return "Succeeded to destroy custom process group."

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            try:
                group.shutdown()
            except (RuntimeError, AttributeError):  # already broken by the failure that got us here
                pass

    def weights_by_name(self, body: dict[str, Any]) -> list[float]:
        """The first `truncate_size` values of a live tensor, flattened (SGLang's `/get_weights_by_name`)."""
        name, size = body.get("name"), body.get("truncate_size", 100)
        live = self._runner.live_weights()
        if not isinstance(name, str) or name not in live:
            raise WeightGroupError(f"no weight named {name!r}")
        if not isinstance(size, int) or size < 1:
            raise WeightGroupError(f"truncate_size must be a positive integer, got {size!r}")
        values: list[float] = live[name].detach().flatten()[:size].float().cpu().tolist()
        return values

    def _receive(self, group: Any, bucket: _Bucket) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        device = self._runner.device
        for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True):
            t = torch.empty(shape, dtype=dtype, device=device)
            group.broadcast(t, 0).wait()
            out[name] = t
        return out

    def _check_fit(self, received: dict[str, torch.Tensor]) -> None:
        live = self._runner.live_weights()
        problems = []
        for name, t in received.items():
            if name not in live:
                problems.append(f"unexpected tensor {name!r}")
            elif tuple(t.shape) != tuple(live[name].shape):
                problems.append(f"{name!r} has shape {tuple(t.shape)}, the model has {tuple(live[name].shape)}")
        if problems:
            raise WeightGroupError("; ".join(problems))

    def _missing(self) -> list[str]:
        return [g[0] for g in self._runner.tied_groups() if not any(n in self._staged for n in g)]


def _check_init(body: dict[str, Any]) -> list[str]:
    problems = []
    if not isinstance(body.get("master_address"), str) or not body["master_address"]:
        problems.append(f"master_address must be a non-empty string, got {body.get('master_address')!r}")
    for key, low in (("master_port", 1), ("world_size", 2), ("rank_offset", 1)):
        value = body.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            problems.append(f"{key} must be an integer >= {low}, got {value!r}")
    if not problems and body["rank_offset"] >= body["world_size"]:
        problems.append(f"rank_offset {body['rank_offset']} must be below world_size {body['world_size']}")
    if body.get("backend") not in (None, "gloo", "nccl"):
        problems.append(f"backend must be 'gloo' or 'nccl', got {body.get('backend')!r}")
    if not isinstance(body.get("group_name"), str) or not body["group_name"]:
        problems.append(f"group_name must be a non-empty string, got {body.get('group_name')!r}")
    return problems


def _parse_bucket(body: dict[str, Any]) -> _Bucket:
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if names is None and "name" in body:  # SGLang <= v0.4.x sent one tensor, singular fields
        names, dtypes, shapes = [body["name"]], [body.get("dtype")], [body.get("shape")]
    if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
        raise WeightGroupError("names, dtypes and shapes must be lists")
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise WeightGroupError(
            f"names, dtypes and shapes must be non-empty and of one length, got {len(names)}, {len(dtypes)}, "
            f"{len(shapes)}"
        )
    try:
        parsed = [parse_dtype(d) for d in dtypes]
    except ValueError as exc:
        raise WeightGroupError(str(exc)) from exc
    for s in shapes:
        if not isinstance(s, list) or not all(isinstance(d, int) and d >= 0 for d in s):
            raise WeightGroupError(f"a shape must be a list of non-negative integers, got {s!r}")
    return _Bucket([str(n) for n in names], parsed, [tuple(s) for s in shapes])
