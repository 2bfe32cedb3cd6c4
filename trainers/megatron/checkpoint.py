"""The megatron backend's checkpoint: HF weights in, HF weights out, one AdamW shard per rank.

A checkpoint folder is what the torch backend writes (`trainers.checkpoint`: a Hugging Face
folder, written whole or not at all), except that `optimizer/` holds `rank<r>.safetensors` (the
AdamW state of rank r's parameter shards, keyed `<megatron name>.<state>`) and `rank<r>.json`
(format, layout, trainer steps). A shard is only loaded into the same layout (world size, TP,
PP, EP); anything else is refused with both layouts named. Never pickle.

Pipeline stages: each loads only its own parameters (`qwen3.global_names` says which full-model
tensor each is); a save joins each stage's tensors over TP, then sends them to the first stage
(`gather_stages`), so rank 0 writes the same HF folder as a run without PP.

Expert parallel: a rank holds `num_experts / EP` consecutive experts of each MoE layer (megatron's
`local_expert_indices`, which `qwen3.global_names` reads), so it loads only those; a save first
joins each expert parameter over the EP group (`gather_experts`), so every expert reaches rank 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson
import torch
import torch.distributed as dist

from core.errors import PipelineError
from trainers.megatron.qwen3 import Qwen3Shape, global_names, hf_to_megatron, megatron_to_hf, shard, unshard

__all__ = [
    "config_files",
    "gather_experts",
    "gather_full_state",
    "gather_stages",
    "load_hf_weights",
    "load_optimizer_shard",
    "save_optimizer_shard",
    "write_hf_weights",
]

FORMAT = 1
Named = Sequence[tuple[str, torch.nn.Parameter]]  # megatron name, the parameter the optimizer steps


def load_hf_weights(
    model: torch.nn.Module, folder: Path, shape: Qwen3Shape, *, tp_rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """Copy this rank's shard of the HF weights in `folder` (every top-level *.safetensors) into
    `model` (this pipeline stage's parameters only).

    Returns the shards as read (fp32 for the folders this backend writes), by megatron name: a bf16
    model's master weights start from them, not from their rounding."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{folder} has no *.safetensors weights for the megatron backend to convert")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            hf.update({k: fh.get_tensor(k) for k in fh.keys()})
    full = hf_to_megatron(hf, shape)
    names = global_names(model, shape)
    shards: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if names[name] not in full:
                raise PipelineError(f"{folder}: no weight converts to megatron parameter {names[name]!r}")
            shards[name] = shard(name, full[names[name]], tp_rank, tp).float()
            param.copy_(shards[name].to(param.dtype))
    return shards


def gather_full_state(named: Named, *, tp: int, group: object) -> dict[str, torch.Tensor]:
    """Every parameter joined over the TP `group` (a collective: every TP rank calls it), on CPU."""
    out: dict[str, torch.Tensor] = {}
    for name, param in named:
        local = param.detach().contiguous()
        parts = [local]
        if tp > 1:
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local, group=group)
        out[name] = unshard(name, [p.cpu() for p in parts])
    return out


_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def gather_experts(
    state: dict[str, torch.Tensor], *, ep: int, ep_rank: int, group: object, device: torch.device
) -> dict[str, torch.Tensor]:
    """`state` (by full-model name) with every EP rank's experts added (a collective of the EP group).

    EP rank r holds the experts `r * n .. r * n + n - 1` of each layer (n = num_experts / EP, in
    megatron's order), all of one shape, so each local expert's tensor is all-gathered over the
    group and the r-th part is expert `r * n + (e - ep_rank * n)`. Every rank gets them all, on CPU
    (`device`: where the collective runs, the CPU for gloo, the rank's GPU for NCCL)."""
    if ep == 1:
        return state
    n = len({m.group(2) for m in map(_EXPERT.match, state) if m})  # experts held per layer
    out = dict(state)
    for name, local in state.items():
        m = _EXPERT.match(name)
        if m is None:
            continue
        sent = local.detach().to(device).contiguous()
        parts = [torch.empty_like(sent) for _ in range(ep)]
        dist.all_gather(parts, sent, group=group)
        offset = int(m.group(2)) - ep_rank * n
        for r, part in enumerate(parts):
            out[f"{m.group(1)}{r * n + offset}{m.group(3)}"] = part.cpu()
    return out


def gather_stages(
    state: dict[str, torch.Tensor], *, ranks: Sequence[int], rank: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every pipeline stage's full tensors (by full-model name) joined on the first stage's rank.

    A collective over `ranks` (one pipeline's ranks, first stage first; `rank` is this one's):
    each later stage sends a JSON header of names and shapes (never pickle), then its tensors as
    one flat fp32 tensor. Returns the whole model's tensors, fp32 on CPU, on `ranks[0]`; {} elsewhere.
    """
    if len(ranks) == 1:
        return state
    if rank != ranks[0]:
        header = orjson.dumps([[name, list(t.shape)] for name, t in state.items()])
        dist.send(torch.tensor([len(header)], dtype=torch.int64, device=device), dst=ranks[0])
        dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), dst=ranks[0])
        flat = torch.cat([t.detach().float().reshape(-1) for t in state.values()]) if state else torch.zeros(0)
        dist.send(flat.to(device), dst=ranks[0])
        return {}
    out = {name: t.float() for name, t in state.items()}
    for src in ranks[1:]:
        length = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(length, src=src)
        body = torch.empty(int(length[0]), dtype=torch.uint8, device=device)
        dist.recv(body, src=src)
        shapes = orjson.loads(body.cpu().numpy().tobytes())
        flat = torch.empty(sum(torch.Size(s).numel() for _, s in shapes), dtype=torch.float32, device=device)
        dist.recv(flat, src=src)
        parts = flat.cpu().split([torch.Size(s).numel() for _, s in shapes])
        for (name, s), part in zip(shapes, parts, strict=True):
            out[name] = part.view(s)
    return out


def write_hf_weights(
    folder: Path, full: dict[str, torch.Tensor], shape: Qwen3Shape, original: Path | Mapping[str, bytes]
) -> None:
    """The HF weights (fp32 safetensors) and the original config files (a folder, or `config_files`
    read from it), into the folder being written."""
    from safetensors.torch import save_file

    configs = config_files(original) if isinstance(original, Path) else original
    for name, data in configs.items():  # the architecture does not change
        (folder / name).write_bytes(data)
    hf = megatron_to_hf(full, shape)
    save_file(
        {k: v.float().contiguous() for k, v in hf.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )


def config_files(original: Path) -> dict[str, bytes]:
    """The config files of a model folder, read now (the folder may be a checkpoint that retention
    deletes before the trainer's next save)."""
    return {
        n: (original / n).read_bytes() for n in ("config.json", "generation_config.json") if (original / n).exists()
    }


def save_optimizer_shard(
    optimizer: torch.optim.Optimizer, named: Named, folder: Path, *, layout: dict[str, int], steps: int
) -> None:
    from safetensors.torch import save_file

    names = {id(p): n for n, p in named}
    tensors: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            tensors[f"{names[id(param)]}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    rank = layout["rank"]
    save_file(tensors, str(folder / f"rank{rank}.safetensors"))
    meta = {"format": FORMAT, "backend": "megatron", **_recorded(layout), "trainer_steps": steps}
    (folder / f"rank{rank}.json").write_bytes(orjson.dumps(meta))


def _recorded(layout: dict[str, int]) -> dict[str, int]:
    """The layout a shard records and must be loaded into: world size, TP, PP and EP."""
    return {k: layout.get(k, 1) for k in ("world", "tp", "pp", "ep")}


def load_optimizer_shard(
    optimizer: torch.optim.Optimizer, named: Named, folder: Path, *, layout: dict[str, int]
) -> int:
    """Restore this rank's AdamW shard; return the trainer steps it had taken."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    rank = layout["rank"]
    meta_path = folder / f"rank{rank}.json"
    if not meta_path.exists():
        raise PipelineError(
            f"optimizer checkpoint {folder} has no shard for megatron rank {rank}: it was "
            "saved by the torch backend or with fewer ranks"
        )
    try:
        meta = orjson.loads(meta_path.read_bytes())
        tensors = load_file(str(folder / f"rank{rank}.safetensors"))
    except (OSError, orjson.JSONDecodeError, SafetensorError) as exc:
        raise PipelineError(f"optimizer checkpoint {folder} is unreadable for rank {rank}: {exc}") from exc
    expected = {"format": FORMAT, "backend": "megatron", **_recorded(layout)}
    meta.setdefault("pp", 1)  # saved before pipeline parallelism: one stage
    meta.setdefault("ep", 1)  # saved before expert parallelism: every rank held every expert
    if {k: meta.get(k) for k in expected} != expected:
        raise PipelineError(f"optimizer checkpoint {folder} was saved as {meta}; this run is {expected}")
    for name, param in named:
        # AdamW keeps `step` on the CPU (non-capturable); the moments live beside the parameter.
        state = {
            key.rsplit(".", 1)[1]: t if key.endswith(".step") else t.to(param.device)
            for key, t in tensors.items()
            if key.rsplit(".", 1)[0] == name
        }
        if state:
            optimizer.state[param] = state
    return int(meta["trainer_steps"])
