"""The built-in engine's KV-cache forward: continuous batching over static cache slots.

Each running request owns one slot of a cache allocated once at start:
per layer, keys and values of shape [max_running_requests, kv_heads, context_length, head_dim].
A forward serves every running request:

- requests without a slot (new, resumed after an abort, or retracted by a pause) get one and are
  prefilled together: their whole sequence (prompt + tokens already generated), right-padded, in one
  batched pass that writes their K/V and gives each its next token;
- requests with a slot decode together: one token each, written at their own position, attending
  to their own slot only (a boolean 4-D mask per row; SDPA runs the attention);
- a request that leaves the batch (finished, aborted, retracted) frees its slot before the next
  forward, so the scheduler refills it between steps.

Why static slots rather than paged blocks: the scheduler already bounds running requests and the
context length bounds each one, so `slots x context` is the exact worst case and is allocated up
front: memory is known at start, a forward can never run out of it (a request that cannot fit is an
HTTP 400 at submit, from the context-length check), and there is no block table to keep. Paged
blocks would let short requests share memory, but they need a paged-attention kernel that is not
in portable torch; SDPA over a slice of the slots is. The cost is memory for the worst case:
size `--context-length` and `--max-running-requests` to the device.

What was tried: transformers' DynamicCache/StaticCache assume one shared position per batch, so
rows at different lengths need left padding that moves as requests come and go; a custom `Cache`
whose `update` writes each row at its own position, plus an explicit 4-D mask, keeps rows
independent. The model itself is the Hugging Face module (any causal LM whose attention calls
`cache.update` and takes a 4-D mask), so the same weights serve both forwards.

Sampling is the recompute forward's (`torch_model.draw_tokens`): a pure function of logits, seed
and position, so at fp32 the cached path gives the recompute path's tokens, and a request resumed
as prompt + its k tokens continues exactly. A weight update keeps the cache of requests held in
place (SGLang does the same): their later tokens attend to K/V computed by the old weights.

On a GPU the decode step is replayed from CUDA graphs (`decode_graphs.py`: padded to batch and
KV-length buckets, one dummy slot past the real ones for the padding rows); `DecodeMode.EAGER`
(`--disable-cuda-graph`) turns that off, and on a CPU the step is always eager. Prefill stays eager.
"""

from __future__ import annotations

import enum
import functools
import inspect
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from transformers.cache_utils import Cache

from launch.engines.decode_graphs import DecodeGraphs, GraphStatistics
from launch.engines.seam import Draw, Row
from launch.engines.torch_model import ModelRunner, TorchForward, draw_tokens
from pipeline.errors import ConfigError

__all__ = ["DecodeMode", "KVCacheForward", "SlotCache", "SlotStatistics"]


class DecodeMode(enum.Enum):
    """How the KV forward runs its decode step."""

    EAGER = "eager"  # one eager forward over the batch (CPUs, `--disable-cuda-graph`)
    GRAPHS = "graphs"  # CUDA graphs, one per padded (batch, KV length) bucket: cuda devices only
    PADDED = "padded"  # the graphs' padded fixed-shape step run eagerly: tests the padding on any device


@dataclass(frozen=True, slots=True)
class SlotStatistics:
    slots: int
    slots_in_use: int
    max_slots_in_use: int
    cache_bytes: int  # keys and values of every layer, allocated at start
    prefills: int
    prefill_tokens: int
    decode_steps: int
    graphs: GraphStatistics | None = None  # None: decode is eager


class SlotCache(Cache):
    """Keys and values for `slots` sequences of up to `context` tokens, in place for the whole run.

    Before each model call `plan` says which slot each batch row uses, at which positions its new
    tokens go, and how many positions the attention reads; `update` (called by every attention
    layer) writes the new K/V there and returns the batch's K/V for positions [0, kv_len)."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        kv_heads: int,
        context: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(layers=[])
        shape = (slots, kv_heads, context, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.keys + self.values)
        self._slots = torch.zeros(0, dtype=torch.long, device=device)
        self._positions = torch.zeros((0, 0), dtype=torch.long, device=device)
        self._kv_len = 0

    def plan(self, slots: torch.Tensor, positions: torch.Tensor, kv_len: int) -> None:
        self._slots, self._positions, self._kv_len = slots, positions, kv_len

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._slots[:, None].expand_as(self._positions)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # [B, H, q, D] -> [B, q, H, D], the layout advanced indexing on (slot, position) expects.
        keys[rows, :, self._positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows, :, self._positions] = value_states.transpose(1, 2).to(values.dtype)
        n = self._kv_len
        return keys[:, :, :n].index_select(0, self._slots), values[:, :, :n].index_select(0, self._slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len


class KVCacheForward(TorchForward):
    """The torch forward with a slot cache: prefill once, then one token per step (weights, identity
    and device come from `TorchForward`; what differs is the forward and what a release frees)."""

    keeps_kv_cache = True

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running_requests: int,
        decode: DecodeMode | None = None,
        graph_max_batch: int | None = None,
    ) -> None:
        """`decode` defaults to GRAPHS on a cuda device and EAGER elsewhere; `graph_max_batch`
        (SGLang's `--cuda-graph-max-bs`, default `max_running_requests`) is the largest batch a graph
        serves: larger batches decode eagerly."""
        super().__init__(runner)
        device = runner.device
        decode = decode or (DecodeMode.GRAPHS if device.type == "cuda" else DecodeMode.EAGER)
        if decode is DecodeMode.GRAPHS and device.type != "cuda":
            raise ConfigError([f"CUDA graphs need a cuda device; this engine runs on {device}"])
        config = runner.config
        text = getattr(config, "get_text_config", lambda: config)()
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        padded = decode is not DecodeMode.EAGER
        self.cache = SlotCache(
            layers=int(text.num_hidden_layers),
            slots=max_running_requests + padded,  # the padding rows' dummy slot is the last
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            context=self.context_length,
            head_dim=head_dim,
            dtype=runner.model.dtype,
            device=device,
        )
        # transformers renamed the decoder's `past_key_values` argument to `cache` (5.2x).
        params = inspect.signature(runner.model.base_model.forward).parameters
        # Not a bound method: the graphs hold this, and a cycle through them would leave a dropped
        # forward's CUDA graphs to the garbage collector, which may run during another capture.
        self._decoder = functools.partial(
            _run_decoder, runner.model.base_model, self.cache, "cache" if "cache" in params else "past_key_values"
        )
        self._slots = max_running_requests
        self._free = list(range(max_running_requests - 1, -1, -1))
        self._slot: dict[int, int] = {}  # request key -> slot, for requests whose K/V the cache holds
        self._cached: dict[int, int] = {}  # request key -> positions of K/V held (all tokens but the last)
        self._released: list[int] = []  # keys freed on the event loop, applied at the next forward
        self._released_lock = threading.Lock()
        self._max_in_use = self._prefills = self._prefill_tokens = self._decode_steps = 0
        self.graphs = self._decode_graphs(decode, graph_max_batch, hidden_size=int(text.hidden_size))

    def _decode_graphs(
        self, decode: DecodeMode, graph_max_batch: int | None, *, hidden_size: int
    ) -> DecodeGraphs | None:
        if decode is DecodeMode.EAGER:
            return None
        return DecodeGraphs(
            self._decoder,
            max_batch=min(graph_max_batch or self._slots, self._slots),
            context=self.context_length,
            dummy_slot=self._slots,
            pad_token_id=self.runner.pad_token_id,
            hidden_size=hidden_size,
            dtype=self.runner.model.dtype,
            device=self.runner.device,
            capture=decode is DecodeMode.GRAPHS,
        )

    # ---- the forward -------------------------------------------------------------------------------

    async def forward(self, rows: Sequence[Row]) -> Sequence[Draw | None]:
        return await anyio.to_thread.run_sync(self.step, rows)

    def step(self, rows: Sequence[Row]) -> list[Draw | None]:
        """Prefill the rows without cache, decode the others; one token for every row still running."""
        # A row released after the scheduler built this batch left it: it gets no slot and no token.
        gone = self._apply_releases()
        live = [r for r in rows if r.key not in gone]
        if not live:
            return [None] * len(rows)
        draws = iter(self._step(live))
        return [None if r.key in gone else next(draws) for r in rows]

    def _step(self, rows: Sequence[Row]) -> list[Draw]:
        fresh = [i for i, r in enumerate(rows) if self._cached.get(r.key) != r.position - 1]
        held = [i for i, r in enumerate(rows) if self._cached.get(r.key) == r.position - 1]
        with torch.inference_mode():
            if not fresh:  # the usual decode step: its logits are the batch's, no scatter
                logits = self._decode(rows)
            else:
                logits = torch.empty((len(rows), self.vocab_size), dtype=torch.float64, device=self.runner.device)
                logits[fresh] = self._prefill([rows[i] for i in fresh])
                if held:
                    logits[held] = self._decode([rows[i] for i in held])
            self._max_in_use = max(self._max_in_use, len(self._slot))
            return draw_tokens(logits, rows)  # in inference mode too: it edits the logits in place

    def _prefill(self, rows: Sequence[Row]) -> torch.Tensor:
        for row in rows:
            self._free_slot(row.key)  # a stale slot: start over
            if not self._free:  # the scheduler admits at most one request per slot: a bug, not load
                raise RuntimeError(f"no free KV slot for {row.rid!r}: {len(self._slot)} slots held")
            self._slot[row.key] = self._free.pop()
        lengths = [len(r.prompt_ids) + len(r.output_ids) for r in rows]
        width = max(lengths)
        dev = self.runner.device
        ids = torch.full((len(rows), width), self.runner.pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : lengths[i]] = torch.tensor(row.token_ids, dtype=torch.long)
        n = torch.tensor(lengths, device=dev)
        positions = torch.arange(width, device=dev).expand(len(rows), width)
        # Causal within the row, and nothing past its own length (right padding).
        mask = (positions[:, None, :] <= positions[:, :, None]) & (positions[:, None, :] < n[:, None, None])
        slots = torch.tensor([self._slot[r.key] for r in rows], device=dev)
        hidden = self._run(ids.to(dev), positions, mask[:, None], slots, width)
        for row, length in zip(rows, lengths, strict=True):
            self._cached[row.key] = length
        self._prefills += 1
        self._prefill_tokens += sum(lengths)
        return self._logits(hidden[torch.arange(len(rows), device=dev), n - 1])

    def _decode(self, rows: Sequence[Row]) -> torch.Tensor:
        dev = self.runner.device
        cached = [self._cached[r.key] for r in rows]  # the position each row's new token takes
        last = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in rows]
        slots = [self._slot[r.key] for r in rows]
        if self.graphs is not None and self.graphs.fits(len(rows)):
            hidden = self.graphs.decode(last, cached, slots)
        else:
            kv_len = max(cached) + 1  # from the host's numbers: no device read back
            positions = torch.tensor(cached, device=dev)[:, None]
            mask = torch.arange(kv_len, device=dev)[None, :] <= positions
            slot_ids = torch.tensor(slots, device=dev)
            hidden = self._run(
                torch.tensor(last, device=dev)[:, None], positions, mask[:, None, None, :], slot_ids, kv_len
            )
            hidden = hidden[:, -1]
        for row in rows:
            self._cached[row.key] += 1
        self._decode_steps += 1
        return self._logits(hidden)

    def _run(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """The decoder over `ids` at `positions`, K/V read and written in `slots`; hidden states."""
        return self._decoder(ids, positions, mask, slots, kv_len)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Sampling in float64 keeps the top-p/CDF arithmetic from adding noise of its own.
        return self.runner.model.get_output_embeddings()(hidden).to(torch.float64)

    # ---- slots -------------------------------------------------------------------------------------

    def release(self, row: Row) -> None:
        """Called on the event loop, perhaps while a forward runs: the slot is freed at the next one."""
        with self._released_lock:
            self._released.append(row.key)

    def _apply_releases(self) -> set[int]:
        with self._released_lock:
            released, self._released = self._released, []
        for key in released:
            self._free_slot(key)
        return set(released)

    def _free_slot(self, key: int) -> None:
        slot = self._slot.pop(key, None)
        self._cached.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(
            slots=self._slots,
            slots_in_use=len(self._slot),
            max_slots_in_use=self._max_in_use,
            cache_bytes=self.cache.nbytes,
            prefills=self._prefills,
            prefill_tokens=self._prefill_tokens,
            decode_steps=self._decode_steps,
            graphs=None if self.graphs is None else self.graphs.statistics(),
        )

    # ---- what differs from the cacheless forward in the rest of the seam ----------------------------

    def server_details(self) -> dict[str, Any]:
        return {
            **super().server_details(),
            "kv_cache": "static-slots",
            "kv_cache_bytes": self.cache.nbytes,
            "disable_cuda_graph": self.graphs is None or not self.graphs.statistics().capturing,
            "cuda_graph_max_bs": None if self.graphs is None else self.graphs.max_batch,
        }


def _run_decoder(
    decoder: torch.nn.Module,
    cache: SlotCache,
    cache_kwarg: str,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    kv_len: int,
) -> torch.Tensor:
    """The decoder over `ids` at `positions`, K/V read and written in `slots`; hidden states."""
    cache.plan(slots, positions, kv_len)
    kwargs = {cache_kwarg: cache}
    out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
    return out.last_hidden_state  # type: ignore[no-any-return]
