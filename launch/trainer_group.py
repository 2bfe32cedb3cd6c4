"""How the megatron ranks meet: a handshake over rank 0's TCPStore, then the process group.

Rank 0 (the controller's process) hosts a `torch.distributed.TCPStore` at MASTER_ADDR:MASTER_PORT
and publishes its trainer spec (world size, TP, PP, device, seed, the trainer's settings), the
model folder to start from and that folder's fingerprint. Every other rank, on this node or
another, connects, compares the spec it derived from its own config with rank 0's, fingerprints
the model folder as its own filesystem shows it, and answers `ok` or why it refuses. Rank 0 waits
for every answer, then tells everyone to go (or why it gave up), and only then do all ranks
create the process group over the same store. So a node started with other flags, another model,
or never started at all stops the run with a message naming what differs or which ranks are
missing, within `--trainer-join-timeout`, instead of hanging in `init_process_group` (whose own
timeout, 30 minutes here, is the one collectives run under afterwards).

Keys under `trainer/`: `spec` (rank 0's offer), `claim/<r>` (a counter: a second claimant of
rank r is a node started twice with the same `--node-rank`), `answer/<r>`, `go`.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson

from core.errors import ConfigError, PipelineError

__all__ = ["fingerprint", "host_group", "join_group", "model_fingerprint"]

_OK = "ok"


def fingerprint(spec: dict[str, Any]) -> str:
    """A short hash of a spec's JSON (sorted keys), to name in messages."""
    return hashlib.sha256(orjson.dumps(spec, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def model_fingerprint(folder: Path) -> str:
    """`config.json`'s bytes and every file's relative path and size: the same weights on every node
    give the same value, without reading gigabytes of safetensors."""
    h = hashlib.sha256()
    config = folder / "config.json"
    h.update(config.read_bytes() if config.exists() else b"<no config.json>")
    if folder.is_dir():
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            h.update(f"{path.relative_to(folder)}:{path.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def host_group(
    *, addr: str, port: int, world: int, per_node: int, spec: dict[str, Any], model_path: Path, timeout: float
) -> Any:
    """Rank 0: offer the spec, wait for every other rank's answer; return the store for the group."""
    from torch.distributed import DistStoreError, TCPStore  # type: ignore[attr-defined]  # public, re-exported from C

    try:
        store = TCPStore(addr, port, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise PipelineError(f"megatron rank 0 cannot listen for the trainer group on {addr}:{port}: {exc}") from exc
    offer = {"spec": spec, "model_path": str(model_path), "model": model_fingerprint(model_path)}
    store.set("trainer/spec", orjson.dumps(offer).decode())
    store.add("trainer/claim/0", 1)
    deadline = time.monotonic() + timeout
    for rank in range(1, world):
        key = f"trainer/answer/{rank}"
        try:
            store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except DistStoreError:
            missing = [r for r in range(1, world) if not store.check([f"trainer/answer/{r}"])]
            nodes = sorted({r // per_node for r in missing})
            reason = (
                f"the trainer group did not form within {timeout:g} s (--trainer-join-timeout) at {addr}:{port}, "
                f"world size {world}: ranks {missing} never joined (nodes {nodes}; start "
                "`python -m pipeline.launch --node-rank K <the controller's flags>` on each, "
                "and check that they reach this address)"
            )
            store.set("trainer/go", reason)
            raise PipelineError(reason) from None
        answer = store.get(key).decode()
        if answer != _OK:
            reason = f"megatron rank {rank} (node {rank // per_node}) refused to join: {answer}"
            store.set("trainer/go", reason)
            raise ConfigError([reason])
    store.set("trainer/go", _OK)
    return store


def join_group(*, addr: str, port: int, rank: int, spec: dict[str, Any], timeout: float) -> tuple[Any, Path]:
    """Rank > 0: check this rank's spec and model folder against rank 0's; return the store and the
    model folder to start from (rank 0's path, read from this node's filesystem)."""
    from torch.distributed import DistStoreError, TCPStore  # type: ignore[attr-defined]  # public, re-exported from C

    where = f"megatron rank 0 at {addr}:{port}"
    try:
        store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
        offer = orjson.loads(store.get("trainer/spec"))
    except (DistStoreError, RuntimeError) as exc:
        raise PipelineError(
            f"megatron rank {rank}: could not reach {where} within {timeout:g} s (--trainer-join-timeout): {exc}"
        ) from exc
    if store.add(f"trainer/claim/{rank}", 1) > 1:
        raise ConfigError(
            [f"megatron rank {rank} is already taken: is another node running with the same --node-rank?"]
        )
    model_path = Path(offer["model_path"])
    # The KL term's reference folder is rank 0's to name, as the model folder is: by default it is
    # the controller's run folder (`<output-dir>/model`), which a node started without
    # `--output-dir` cannot derive. Every rank loads it from the path rank 0 names.
    ours, theirs = spec.get("trainer"), offer["spec"].get("trainer")
    if isinstance(ours, dict) and isinstance(theirs, dict) and "ref_path" in theirs:
        ours["ref_path"] = theirs["ref_path"]
    problems = _differences(offer["spec"], spec)
    if not problems and (mine := model_fingerprint(model_path)) != offer["model"]:
        problems.append(
            f"the model folder {model_path} differs on this node (fingerprint {mine}, rank 0's {offer['model']}: "
            "config.json or the file sizes); every node needs the same weights at the same path"
        )
    if problems:
        reason = (
            f"its trainer spec {fingerprint(spec)} differs from rank 0's {fingerprint(offer['spec'])} "
            f"(start every node with the controller's flags): {'; '.join(problems)}"
        )
        store.set(f"trainer/answer/{rank}", reason)
        raise ConfigError([f"megatron rank {rank}: {reason}"])
    store.set(f"trainer/answer/{rank}", _OK)
    try:
        store.wait(["trainer/go"])
        go = store.get("trainer/go").decode()
    except (DistStoreError, RuntimeError) as exc:  # RuntimeError: rank 0's store went away
        raise PipelineError(f"megatron rank {rank}: {where} never said go within {timeout:g} s: {exc}") from exc
    if go != _OK:
        raise PipelineError(f"megatron rank {rank}: rank 0 gave up: {go}")
    return store, model_path


def _differences(theirs: dict[str, Any], mine: dict[str, Any], prefix: str = "") -> list[str]:
    """Each setting that differs, as `name: rank 0 has X, this rank has Y`."""
    out = []
    for key in sorted(set(theirs) | set(mine)):
        a, b = theirs.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: rank 0 has {a!r}, this rank has {b!r}")
    return out
