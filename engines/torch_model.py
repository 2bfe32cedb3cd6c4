"""The torch side of the built-in engine: one batched forward pass plus sampling, and weight loading.

`ModelRunner` is synchronous and runs on the engine's single compute thread; `TorchForward` is its
`ModelForward` face for the scheduler (seam.py), moving each call onto that thread.

Sampling is a pure function of (logits, sampling params, seed, position), so a request's tokens do
not depend on what else shares its batch, and a request that is aborted after k tokens and resent as
`prompt + those k tokens` continues exactly as it would have. The random draw for the token at
absolute sequence position `p` is a uniform number derived by hashing `(sampling_seed, p)`, which plays
the role of a `torch.Generator` seeded from that pair without the cost of building one per token.
Sampling is by inverse CDF over the vocabulary in index order.

The log-prob reported for each token is its log-prob under the distribution it was actually drawn
from: logits / temperature, then top-k, top-p and min-p truncation, renormalised. With the default
top_p=1, top_k=-1, min_p=0 that is log_softmax(logits / temperature). Greedy decoding (temperature 0)
reports log_softmax(logits), i.e. temperature 1, since the point mass it draws from says nothing.

Batched forwards are left-padded with an attention mask and explicit position ids; the whole
sequence is recomputed every step (no KV cache). That costs compute but keeps every step a plain
function of the token ids, which is what makes continuation exact. Floating-point results still move
in the last bits with the batch shape (~1e-7 on logits), so a sampled token can differ only when its
uniform draw lands within that distance of a CDF boundary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from core.errors import ConfigError
from engines.memory_saver import WEIGHTS, MemorySaver, NoMemorySaver
from engines.moe_routes import RouteRecorder, fuse_expert_tensors, wants_routes, with_routes
from engines.seam import Draw, Row, SamplingParams, WeightLoadError

__all__ = [
    "ENGINE_VERSION",
    "Draw",
    "ModelRunner",
    "Row",
    "SamplingParams",
    "TorchForward",
    "WeightLoadError",
    "draw_tokens",
    "uniform_draw",
]

ENGINE_VERSION = "0.5.0-builtin"  # reported as `version`; says which engine this is

log = logging.getLogger(__name__)


def uniform_draw(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    digest = hashlib.blake2b(struct.pack("<qq", seed, position), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


@dataclass(slots=True)
class _Weights:
    """Name -> parameter of the live model, and which names share storage (tied embeddings)."""

    params: dict[str, torch.Tensor]
    tied_groups: list[list[str]] = field(default_factory=list)


class ModelRunner:
    """A Hugging Face causal LM on one device, stepped one batched forward at a time."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        context_length: int | None = None,
        memory: MemorySaver | None = None,
    ) -> None:
        """`memory`: where the weights are allocated, so that a colocated engine can give their GPU
        memory back (`memory_saver.py`); None allocates them plainly."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model_path = str(model_path)
        if not Path(model_path).is_dir():  # local folders only: the built-in engine never downloads
            raise WeightLoadError(str(model_path), "the folder does not exist")
        try:
            config = AutoConfig.from_pretrained(model_path)
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError) as exc:
            raise WeightLoadError(str(model_path), str(exc)) from exc
        self.memory = memory or NoMemorySaver()
        try:
            self.device = torch.device(device)
            # Buffers (the rotary tables) outside the weights' region: no update rewrites them, so
            # a release must not take them. Then the parameters, inside it.
            _move_buffers(self.model, self.device)
            with self.memory.region(WEIGHTS):
                self.model.to(self.device)  # type: ignore[arg-type]  # transformers types `to` by its own
        except (RuntimeError, AssertionError) as exc:  # a bad string, or a build without that backend
            raise ConfigError([f"device {device!r} is not usable here: {exc}"]) from exc
        self.model.eval()
        self.config = config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 2048)
        if context_length is not None:  # a smaller window bounds a KV cache's memory
            self.context_length = min(self.context_length, context_length)
        self.eos_token_ids = frozenset(_eos_ids(model_path, config))
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        self._weights = _live_weights(self.model)
        self.routes = RouteRecorder.attach(self.model)  # None for a dense model (R3: moe_routes.py)

    # ---- one decode step -------------------------------------------------------------------------

    def step(self, rows: Sequence[Row]) -> list[Draw]:
        """Run one forward pass over all rows and draw one token for each."""
        if self.routes is None or not wants_routes(self.routes, rows):
            return draw_tokens(self._last_logits(rows), rows)
        with self.routes.recording():
            logits = self._last_logits(rows)
        width = max(len(r.token_ids) for r in rows)
        routed = self.routes.take().reshape(len(rows), width, self.routes.layers, self.routes.top_k)
        # Left-padded: row i's positions [0, n) are its last n columns.
        own = [routed[i, width - len(r.token_ids) :] for i, r in enumerate(rows)]
        return with_routes(draw_tokens(logits, rows), rows, own)

    def _last_logits(self, rows: Sequence[Row]) -> torch.Tensor:
        width = max(len(r.token_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            ids[i, width - n :] = torch.tensor(row.token_ids, dtype=torch.long)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=False,
                logits_to_keep=1,
            )
        # Sampling in float64 keeps the top-p/CDF arithmetic from adding noise of its own.
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits.to(torch.float64)

    # ---- weights -----------------------------------------------------------------------------------

    def read_weights(self, folder: str | Path) -> dict[str, torch.Tensor]:
        """Read and check a folder's safetensors weights against the live model. Touches nothing live.

        Raises WeightLoadError naming every problem found.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        files = _safetensors_files(folder)
        tensors: dict[str, torch.Tensor] = {}
        try:
            for f in files:
                tensors.update(load_file(f))
        except (OSError, SafetensorError) as exc:
            raise WeightLoadError(str(folder), f"{type(exc).__name__}: {exc}") from exc
        if self.routes is not None:  # MoE: the file's per-expert tensors are the model's fused ones
            try:
                tensors = fuse_expert_tensors(tensors)
            except ValueError as exc:
                raise WeightLoadError(str(folder), str(exc)) from exc
        problems: list[str] = []
        live = self._weights.params
        for name, t in tensors.items():
            if name not in live:
                problems.append(f"unexpected tensor {name!r}")
            elif tuple(t.shape) != tuple(live[name].shape):
                problems.append(f"{name!r} has shape {tuple(t.shape)}, the model has {tuple(live[name].shape)}")
        for group in self._weights.tied_groups:
            if not any(name in tensors for name in group):
                problems.append(f"missing tensor {group[0]!r}")
        if problems:
            raise WeightLoadError(str(folder), "; ".join(problems))
        return tensors

    def refresh_live_weights(self) -> None:
        """Re-read the live tensors after the model's parameters were replaced (fused into views)."""
        self._weights = _live_weights(self.model)

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        """Name -> live tensor (what received weights are checked against)."""
        return self._weights.params

    def tied_groups(self) -> list[list[str]]:
        """Names sharing one storage: a complete set of weights has one name of each group."""
        return self._weights.tied_groups

    def apply_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checked tensors into the live parameters (in place, so nothing else holds stale ones)."""
        live = self._weights.params
        with torch.no_grad():
            for name, t in tensors.items():
                live[name].copy_(t)

    def weight_bytes(self) -> int:
        """Bytes of the live weights (each tied group counted once)."""
        live = self._weights.params
        return sum(live[g[0]].numel() * live[g[0]].element_size() for g in self._weights.tied_groups)


def _move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.to(device)


def draw_tokens(logits: torch.Tensor, rows: Sequence[Row]) -> list[Draw]:
    """Draw one token per row from its last-position logits [B, V] (float64), after masking the
    row's banned tokens and adding its logit bias."""
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, list(row.banned)] = -math.inf
        for token_id, bias in row.params.logit_bias:
            logits[i, token_id] += bias
    return _sample(logits, rows)


def _sample(logits: torch.Tensor, rows: Sequence[Row]) -> list[Draw]:
    """Draw one token per row from `logits` [B, V] (float64); see the module docstring.

    Rows are read back in one device-to-host copy per kind (greedy, sampled): on a GPU a copy per
    row costs a synchronisation each, which at 128 rows took longer than the forward itself."""
    draws: list[Draw | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        lp = torch.log_softmax(logits[greedy], dim=-1)
        _fill(draws, greedy, _ends(lp.argmax(dim=-1), greedy, rows), lp, rows)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        logprobs = _sampling_logprobs(logits[sampled], [rows[i].params for i in sampled])
        cdf = logprobs.exp().cumsum(dim=-1)
        u = to_device([uniform_draw(rows[i].seed, rows[i].position) for i in sampled], torch.float64, logits.device)
        # First index whose CDF exceeds u * total: zero-probability tokens (flat CDF) are never chosen.
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        tokens = tokens.clamp(max=logits.shape[1] - 1)
        # u*total rounded onto the last step lands on a token of zero probability: take the mode.
        landed = logprobs.gather(1, tokens[:, None]).squeeze(1)
        tokens = torch.where(torch.isfinite(landed), tokens, logprobs.argmax(dim=-1))
        _fill(draws, sampled, _ends(tokens, sampled, rows), logprobs, rows)
    return [d for d in draws if d is not None]


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for the device: a blocking copy would
    synchronise with the queued forward, and the sampler's launches would then start only after it
    instead of being queued behind it (at batch 1 that wait was most of the step's host time)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _ends(tokens: torch.Tensor, at: Sequence[int], rows: Sequence[Row]) -> torch.Tensor:
    """`tokens` of rows `at`, with each row that a length tail ends here given its end token."""
    ends = [(j, rows[i].end_token) for j, i in enumerate(at) if _ends_here(rows[i])]
    if not ends:
        return tokens
    tokens = tokens.clone()
    tokens[[j for j, _ in ends]] = to_device([t for _, t in ends], tokens.dtype, tokens.device)
    return tokens


def _ends_here(row: Row) -> bool:
    return row.end_at is not None and row.position >= row.end_at


def _sampling_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Log-probs [B, V] of the distribution each row draws from: logits / temperature, truncated by
    top-k, top-p and min-p (a sort per row) for the rows that ask for any, renormalised."""
    vocab = logits.shape[1]
    dev = logits.device
    temperature = to_device([p.temperature for p in params], torch.float64, dev)
    scaled = logits / temperature[:, None]
    # Rows that truncate nothing skip the sort, the costliest kernel of a step on a GPU (at top_p=1
    # the sorted cumulative sum could also round to 1 before the tail and drop a possible token).
    cut = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0]
    if len(cut) < len(params):
        logprobs = torch.log_softmax(scaled, dim=-1)
    if not cut:
        return logprobs
    picked = [params[j] for j in cut]
    top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in picked], torch.long, dev)
    top_p = to_device([p.top_p for p in picked], torch.float64, dev)
    min_p = to_device([p.min_p for p in picked], torch.float64, dev)
    sorted_logits, order = scaled[cut].sort(dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(vocab, device=dev)
    keep = rank[None, :] < top_k[:, None]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < top_p[:, None]  # the smallest prefix holding top_p; rank 0 always kept
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    truncated = torch.full_like(sorted_logits, -math.inf)
    truncated.scatter_(1, order, torch.where(keep, sorted_logits, -math.inf))
    if len(cut) == len(params):
        return torch.log_softmax(truncated, dim=-1)
    logprobs[cut] = torch.log_softmax(truncated, dim=-1)
    return logprobs


def _fill(
    draws: list[Draw | None], at: Sequence[int], tokens: torch.Tensor, logprobs: torch.Tensor, rows: Sequence[Row]
) -> None:
    """Put the draws of rows `at` (their tokens [n] and log-prob rows [n, V]) into `draws`, with
    the top log-probs of the rows that ask for them (SC)."""
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    for i, t, lp in zip(at, tokens.tolist(), chosen.tolist(), strict=True):
        draws[i] = Draw(int(t), float(lp))
    k = max(rows[i].top_logprobs for i in at)
    if k:  # one top-k over the rows, read back once; each row keeps its own count
        values, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        for i, lps, tids in zip(at, values.tolist(), ids.tolist(), strict=True):
            n = rows[i].top_logprobs
            draw = draws[i]
            if n and draw is not None:
                draws[i] = Draw(draw.token_id, draw.logprob, top=tuple(zip(tids[:n], lps[:n], strict=True)))


def _live_weights(model: torch.nn.Module) -> _Weights:
    params = dict(model.state_dict(keep_vars=False))
    # Tied names are one tensor: same address, shape and strides. Not "same storage": fused
    # projections (`fused_projections.py`) are distinct views of one storage.
    by_tensor: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for name, t in params.items():
        by_tensor.setdefault((t.data_ptr(), tuple(t.shape), t.stride()), []).append(name)
    return _Weights(params=params, tied_groups=list(by_tensor.values()))


def _safetensors_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as exc:
            raise WeightLoadError(str(folder), f"bad {index.name}: {exc}") from exc
        return [folder / s for s in shards]
    if not folder.exists():
        raise WeightLoadError(str(folder), "the folder does not exist")
    raise WeightLoadError(str(folder), "no model.safetensors (or model.safetensors.index.json) in it")


def _eos_ids(model_path: str | Path, config: object) -> set[int]:
    """EOS ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: set[int] = set()

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(config, "eos_token_id", None))
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            log.warning("ignoring unreadable %s", gen)
    return ids


class TorchForward:
    """`ModelForward` over a `ModelRunner` that recomputes every sequence each step (no KV cache)."""

    engine_version = ENGINE_VERSION
    keeps_kv_cache = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model_path = runner.model_path
        self.vocab_size = runner.vocab_size
        self.context_length = runner.context_length
        self.eos_token_ids = runner.eos_token_ids

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    async def forward(self, rows: Sequence[Row]) -> Sequence[Draw | None]:
        return await anyio.to_thread.run_sync(self.runner.step, rows)

    def release(self, row: Row) -> None:
        pass  # nothing is cached between steps

    def idle(self) -> None:
        pass

    async def read_weights(self, folder: str) -> object:
        return await anyio.to_thread.run_sync(self.runner.read_weights, folder)

    async def apply_weights(self, staged: object) -> None:
        assert isinstance(staged, dict)
        await anyio.to_thread.run_sync(self.runner.apply_weights, staged)

    def flush_cache(self) -> None:
        pass

    def identity(self) -> dict[str, Any]:
        return model_identity(self.runner.config)

    def server_details(self) -> dict[str, Any]:
        return runner_details(self.runner)

    def accelerator(self) -> tuple[str, int]:
        return runner_accelerator(self.runner)


def model_identity(config: object) -> dict[str, Any]:
    """`model_type` and `architectures` of a transformers config, as /model_info reports them."""
    return {
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    }


def runner_details(runner: ModelRunner) -> dict[str, Any]:
    """/server_info's device fields for a forward over `runner` (no engine here has a prefix cache)."""
    dtype = str(runner.model.dtype).removeprefix("torch.")
    return {"device": str(runner.device), "dtype": dtype, "disable_radix_cache": True}


def runner_accelerator(runner: ModelRunner) -> tuple[str, int]:
    return ("cpu", 0) if runner.device.type == "cpu" else (runner.device.type, 1)
