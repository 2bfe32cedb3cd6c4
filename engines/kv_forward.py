"""The built-in engine's KV-cache forward: continuous batching over static cache slots.

Each running request owns one slot of a cache allocated once at start: keys and values of shape
[layers, max_running_requests + 1, kv_heads, context_length, head_dim] (`slot_attention.SlotCache`;
the extra slot takes what idle rows write).
A forward serves every running request:

- requests without a slot (new, resumed after an abort, or retracted by a pause) get one and are
  prefilled together: their whole sequence (prompt + tokens already generated), right-padded, in one
  batched pass that writes their K/V and gives each its next token;
- requests with a slot decode together: one token each, written at their own position; the step
  runs over the slots in order (row j is slot j) so the attention reads the cache in place, with
  the query heads of each KV head folded together (`slot_attention.py`: no gather, no repeat_kv);
- a request that leaves the batch (finished, aborted, retracted) frees its slot before the next
  forward, and the request in the highest slot moves down into the hole (its K/V copied, a few
  microseconds on a GPU), so the slots in use stay 0..n-1 and a decode step spans n rows, not the
  highest slot ever used.

Why static slots rather than paged blocks: the scheduler already bounds running requests and the
context length bounds each one, so `slots x context` is the exact worst case and is allocated up
front: memory is known at start, a forward can never run out of it (a request that cannot fit is an
HTTP 400 at submit, from the context-length check), and there is no block table to keep. Paged
blocks would let short requests share memory, but they need a paged-attention kernel that is not
in portable torch; SDPA over a slice of the slots is. The cost is memory for the worst case:
size `--context-length` and `--max-running-requests` to the device.

What was tried: transformers' DynamicCache/StaticCache assume one shared position per batch, so
rows at different lengths need left padding that moves as requests come and go; a custom `Cache`
whose `update` writes each row at its own position keeps rows independent. The model itself is the
Hugging Face module (any causal LM whose attention calls `cache.update` and dispatches through
transformers' attention interface), so the same weights serve both forwards. The first version
gathered each row's K/V out of its slot every step and let transformers repeat them per query
head: at batch 128 those copies were 15 of a step's 24 ms on an H200 (BENCHMARKS.md section 7).

Sampling is the recompute forward's (`torch_model.draw_tokens`): a pure function of logits, seed
and position, so at fp32 the cached path gives the recompute path's tokens, and a request resumed
as prompt + its k tokens continues exactly. A weight update keeps the cache of requests held in
place (SGLang does the same): their later tokens attend to K/V computed by the old weights.

On a GPU the decode step is replayed from CUDA graphs (`decode_graphs.py`: padded to batch and
KV-length buckets; padding rows are idle rows); `DecodeMode.EAGER`
(`--disable-cuda-graph`) turns that off, and on a CPU the step is always eager. Prefill stays eager.
"""

from __future__ import annotations

import enum
import functools
import heapq
import inspect
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import anyio
import torch

from core.errors import ConfigError
from engines.decode_graphs import DecodeGraphs, GraphStatistics
from engines.memory_saver import KV_CACHE, WEIGHTS
from engines.moe_routes import wants_routes, with_routes
from engines.seam import Draw, Row
from engines.slot_attention import SlotCache, SlotPlan, use_slot_attention
from engines.torch_model import ModelRunner, TorchForward, draw_tokens, to_device

log = logging.getLogger(__name__)

__all__ = ["DecodeMode", "KVCacheForward", "SlotCache", "SlotStatistics", "kv_bytes_per_position"]


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
    moves: int = 0  # requests moved down a slot to keep the slots in use dense
    # The steps that only decoded (no prefill in them), timed: their count, rows and wall seconds.
    decode_timed_steps: int = 0
    decode_rows: int = 0
    decode_seconds: float = 0.0  # sampling included
    prefill_seconds: float = 0.0  # wall time of the prefills, sampling included
    # For a fit of step time against rows (what the simulated engine's time model needs):
    decode_rows_squared: int = 0  # sum of rows^2 over decode steps
    decode_rows_seconds: float = 0.0  # sum of rows x seconds over decode steps
    # ... and against the context the step attends over (c: the rows' positions summed), which
    # grows with long responses: sums of c, c^2, rows x c and c x seconds over decode steps.
    decode_context: int = 0
    decode_context_squared: int = 0
    decode_rows_context: int = 0
    decode_context_seconds: float = 0.0
    # A step with a prefill also decodes the requests already held (one forward each, one step):
    # its seconds are both. Sums over those steps, so that a fit can take the decode part out
    # (`benchmarks/modes_builtin.py`): prefill tokens t, rows decoded beside them h, seconds s.
    prefill_steps_decoding: int = 0  # steps with h > 0
    prefill_step_tokens_squared: int = 0  # sum of t^2
    prefill_step_tokens_seconds: float = 0.0  # sum of t x s
    prefill_step_held_rows: int = 0  # sum of h
    prefill_step_tokens_held: int = 0  # sum of t x h
    prefill_step_tokens_decoding: int = 0  # sum of t over the steps with h > 0
    prefill_step_held_context: int = 0  # sum of the held rows' context c_h
    prefill_step_tokens_held_context: int = 0  # sum of t x c_h


_MIXED_COUNTS = tuple(
    f.name for f in fields(SlotStatistics) if f.name.startswith(("prefill_step_", "prefill_steps_")) and f.type == "int"
)


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
        fuse_ops: bool = False,
    ) -> None:
        """`decode` defaults to GRAPHS on a cuda device and EAGER elsewhere; `graph_max_batch`
        (SGLang's `--cuda-graph-max-bs`, default `max_running_requests`) is the largest batch a graph
        serves: larger batches decode eagerly; `fuse_ops` compiles the model's RMSNorms and
        rotary embedding (`fused_ops.py`) and fuses the q/k/v and gate/up projections into one
        matmul each (`fused_projections.py`)."""
        super().__init__(runner)
        device = runner.device
        decode = decode or (DecodeMode.GRAPHS if device.type == "cuda" else DecodeMode.EAGER)
        if decode is DecodeMode.GRAPHS and device.type != "cuda":
            raise ConfigError([f"CUDA graphs need a cuda device; this engine runs on {device}"])
        config = runner.config
        text = getattr(config, "get_text_config", lambda: config)()
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        # The cache, the fused weights and the graphs' pool each in their region of the runner's
        # memory saver, so a colocated engine can give each back (`memory_saver.py`).
        with runner.memory.region(KV_CACHE):
            self.cache = SlotCache(
                layers=int(text.num_hidden_layers),
                slots=max_running_requests,
                kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                context=self.context_length,
                head_dim=head_dim,
                dtype=runner.model.dtype,
                device=device,
            )
        use_slot_attention(runner.model)
        if fuse_ops:
            _fuse_ops(runner)
        # transformers renamed the decoder's `past_key_values` argument to `cache` (5.2x).
        params = inspect.signature(runner.model.base_model.forward).parameters
        # Not a bound method: the graphs hold this, and a cycle through them would leave a dropped
        # forward's CUDA graphs to the garbage collector, which may run during another capture.
        self._decoder = functools.partial(
            _run_decoder, runner.model.base_model, self.cache, "cache" if "cache" in params else "past_key_values"
        )
        self._slots = max_running_requests
        self._free = list(range(max_running_requests))  # a heap: the lowest free slot is taken first
        self._slot: dict[int, int] = {}  # request key -> slot, for requests whose K/V the cache holds
        self._cached: dict[int, int] = {}  # request key -> positions of K/V held (all tokens but the last)
        self._released: list[int] = []  # keys freed on the event loop, applied at the next forward
        self._released_lock = threading.Lock()
        self._max_in_use = self._prefills = self._prefill_tokens = self._decode_steps = 0
        self._moves = self._decode_rows = 0
        self._decode_seconds = self._prefill_seconds = self._rows_seconds = 0.0
        self._rows_squared = self._timed_steps = 0
        self._mixed = dict.fromkeys(_MIXED_COUNTS, 0)
        self._mixed_tokens_seconds = 0.0
        self._context_sums = dict.fromkeys(("decode_context", "decode_context_squared", "decode_rows_context"), 0)
        self._context_seconds = 0.0
        self._step_prefill_tokens = 0  # the last prefill's tokens, read by `_timed`
        self.graphs = self._decode_graphs(decode, graph_max_batch, hidden_size=int(text.hidden_size))

    def _decode_graphs(
        self, decode: DecodeMode, graph_max_batch: int | None, *, hidden_size: int
    ) -> DecodeGraphs | None:
        if decode is DecodeMode.EAGER:
            return None
        return DecodeGraphs(
            functools.partial(_decode_rows, self._decoder),
            max_batch=min(graph_max_batch or self._slots, self._slots),
            context=self.context_length,
            dummy_slot=self.cache.spare,
            pad_token_id=self.runner.pad_token_id,
            hidden_size=hidden_size,
            dtype=self.runner.model.dtype,
            device=self.runner.device,
            capture=decode is DecodeMode.GRAPHS,
            capture_region=self.runner.memory.cuda_graph,
        )

    def zero_cache(self) -> None:
        """Zero every slot: after the cache's memory is given back and taken again its contents are
        undefined, and a masked-out position that holds a NaN still poisons the attention (0 x NaN)."""
        with torch.inference_mode():
            self.cache.keys.zero_()
            self.cache.values.zero_()

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
        start = time.perf_counter()
        if wants_routes(self.runner.routes, rows):
            return self._step_routed(rows, fresh, held, start)
        with torch.inference_mode():
            if not fresh:  # the usual decode step: its logits are the batch's, no scatter
                logits = self._decode(rows)
            else:
                logits = torch.empty((len(rows), self.vocab_size), dtype=torch.float64, device=self.runner.device)
                logits[fresh] = self._prefill([rows[i] for i in fresh])
                if held:
                    logits[held] = self._decode([rows[i] for i in held])
            self._max_in_use = max(self._max_in_use, len(self._slot))
            draws = draw_tokens(logits, rows)  # in inference mode too: it edits the logits in place
        self._timed(fresh, rows, start)
        return draws

    def _step_routed(self, rows: Sequence[Row], fresh: list[int], held: list[int], start: float) -> list[Draw]:
        """`_step` for a batch in which a request asks for its routes (R3, `moe_routes.py`): the
        same forwards with the routers recorded, and the decode step eager (a CUDA graph's replay
        runs no hooks)."""
        recorder = self.runner.routes
        assert recorder is not None
        routes: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        with torch.inference_mode():
            logits = torch.empty((len(rows), self.vocab_size), dtype=torch.float64, device=self.runner.device)
            if fresh:
                with recorder.recording():
                    logits[fresh] = self._prefill([rows[i] for i in fresh])
                width = max(len(rows[i].token_ids) for i in fresh)
                got = recorder.take().reshape(len(fresh), width, recorder.layers, recorder.top_k)
                for j, i in enumerate(fresh):  # right-padded: positions [0, n) are the first n columns
                    routes[i] = got[j, : len(rows[i].token_ids)]
            if held:
                with recorder.recording():
                    logits[held] = self._decode([rows[i] for i in held], eager=True)
                got = recorder.take()  # in slot order: one position a slot
                for i in held:
                    slot = self._slot[rows[i].key]
                    routes[i] = got[slot : slot + 1]
            self._max_in_use = max(self._max_in_use, len(self._slot))
            draws = with_routes(draw_tokens(logits, rows), rows, routes)
        self._timed(fresh, rows, start)
        return draws

    def _timed(self, fresh: list[int], rows: Sequence[Row], start: float) -> None:
        seconds = time.perf_counter() - start  # the draws read the device back: the work is done
        if fresh:
            self._prefill_seconds += seconds
            tokens = self._step_prefill_tokens  # what `_prefill` computed this step
            held = len(rows) - len(fresh)
            new = set(fresh)
            context = sum(r.position for i, r in enumerate(rows) if i not in new)
            m = self._mixed
            m["prefill_steps_decoding"] += int(held > 0)
            m["prefill_step_tokens_squared"] += tokens * tokens
            self._mixed_tokens_seconds += tokens * seconds
            m["prefill_step_held_rows"] += held
            m["prefill_step_tokens_held"] += tokens * held
            m["prefill_step_tokens_decoding"] += tokens if held else 0
            m["prefill_step_held_context"] += context
            m["prefill_step_tokens_held_context"] += tokens * context
        else:
            context = sum(r.position for r in rows)
            self._decode_seconds += seconds
            self._timed_steps += 1
            self._decode_rows += len(rows)
            self._rows_squared += len(rows) ** 2
            self._rows_seconds += len(rows) * seconds
            c = self._context_sums
            c["decode_context"] += context
            c["decode_context_squared"] += context * context
            c["decode_rows_context"] += len(rows) * context
            self._context_seconds += context * seconds

    def _prefill(self, rows: Sequence[Row]) -> torch.Tensor:
        for row in rows:
            self._free_slot(row.key)  # a stale slot: start over
        self._compact()
        for row in rows:
            if not self._free:  # the scheduler admits at most one request per slot: a bug, not load
                raise RuntimeError(f"no free KV slot for {row.rid!r}: {len(self._slot)} slots held")
            self._slot[row.key] = heapq.heappop(self._free)
        lengths = [len(r.prompt_ids) + len(r.output_ids) for r in rows]
        width = max(lengths)
        dev = self.runner.device
        ids = torch.full((len(rows), width), self.runner.pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : lengths[i]] = torch.tensor(row.token_ids, dtype=torch.long)
        n = torch.tensor(lengths, device=dev)
        positions = torch.arange(width, device=dev).expand(len(rows), width)
        slots = torch.tensor([self._slot[r.key] for r in rows], device=dev)
        plan = SlotPlan(write_slots=slots, positions=positions, kv=width, decode=False)
        hidden = self._decoder(ids.to(dev), plan)
        for row, length in zip(rows, lengths, strict=True):
            self._cached[row.key] = length
        self._prefills += 1
        self._step_prefill_tokens = sum(lengths)
        self._prefill_tokens += self._step_prefill_tokens
        return self._logits(hidden[torch.arange(len(rows), device=dev), n - 1])

    def _decode(self, rows: Sequence[Row], *, eager: bool = False) -> torch.Tensor:
        self._compact()
        dev = self.runner.device
        slots = [self._slot[r.key] for r in rows]
        width = max(slots) + 1  # rows are slots: 0 .. the highest slot decoding
        ids = [self.runner.pad_token_id] * width
        positions = [0] * width
        writes = [self.cache.spare] * width  # idle rows write into the spare slot
        for row, slot in zip(rows, slots, strict=True):
            ids[slot] = row.output_ids[-1] if row.output_ids else row.prompt_ids[-1]
            positions[slot] = self._cached[row.key]  # the position the new token takes
            writes[slot] = slot
        if self.graphs is not None and self.graphs.fits(width) and not eager:
            hidden = self.graphs.decode(ids, positions, writes)
        else:
            kv = max(positions) + 1  # from the host's numbers: no device read back
            hidden = _decode_rows(
                self._decoder,
                to_device(ids, torch.long, dev),
                to_device(positions, torch.long, dev),
                to_device(writes, torch.long, dev),
                kv,
            )
        for row in rows:
            self._cached[row.key] += 1
        self._decode_steps += 1
        if width != len(rows) or slots != list(range(width)):
            hidden = hidden[to_device(slots, torch.long, dev)]  # slot order -> the rows' order
        return self._logits(hidden[: len(rows)])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Sampling in float64 keeps the top-p/CDF arithmetic from adding noise of its own.
        logits: torch.Tensor = self.runner.model.get_output_embeddings()(hidden)
        return logits.to(torch.float64)

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
            heapq.heappush(self._free, slot)

    def _compact(self) -> None:
        """Move the requests in the highest slots down into the holes below, so that the slots in
        use are 0 .. n-1 and a decode step spans n rows."""
        used = len(self._slot)
        high = sorted(((s, k) for k, s in self._slot.items() if s >= used), reverse=True)
        for source, key in high:
            target = heapq.heappop(self._free)  # below `used`: that many slots are held, one is above
            self.cache.move(source, target, self._cached[key])
            self._slot[key] = target
            heapq.heappush(self._free, source)
            self._moves += 1

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
            moves=self._moves,
            decode_timed_steps=self._timed_steps,
            decode_rows=self._decode_rows,
            decode_seconds=self._decode_seconds,
            prefill_seconds=self._prefill_seconds,
            decode_rows_squared=self._rows_squared,
            decode_rows_seconds=self._rows_seconds,
            decode_context_seconds=self._context_seconds,
            **self._context_sums,
            prefill_step_tokens_seconds=self._mixed_tokens_seconds,
            **self._mixed,
        )

    # ---- what differs from the cacheless forward in the rest of the seam ----------------------------

    def server_details(self) -> dict[str, Any]:
        return {
            **super().server_details(),
            "kv_cache": "static-slots",
            "kv_cache_bytes": self.cache.nbytes,
            "disable_cuda_graph": self.graphs is None or not self.graphs.statistics().capturing,
            "cuda_graph_max_bs": None if self.graphs is None else self.graphs.max_batch,
            "forward_statistics": asdict(self.statistics()),
        }


def kv_bytes_per_position(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one position of one slot takes, over every layer."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * dtype.itemsize


def _fuse_ops(runner: ModelRunner) -> None:
    from engines.fused_ops import fuse_ops, unfuse_ops
    from engines.fused_projections import fuse_projections

    with runner.memory.region(WEIGHTS):  # the fused tensors are weights: released with them
        fused = fuse_projections(runner.model)
    if fused:  # the live weights are views of the fused tensors now
        runner.refresh_live_weights()
    if not fuse_ops(runner.model):
        return
    try:  # compile now, on a small input: a failure keeps the eager ops, it does not stop the engine
        with torch.inference_mode():
            runner.model(input_ids=torch.ones((1, 2), dtype=torch.long, device=runner.device), use_cache=False)
    except Exception:
        log.exception("compiling the norms and the rotary embedding failed; they stay eager")
        unfuse_ops(runner.model)


def _decode_rows(
    decoder: functools.partial[torch.Tensor],
    ids: torch.Tensor,
    positions: torch.Tensor,
    writes: torch.Tensor,
    kv: int,
) -> torch.Tensor:
    """One decode step over rows in slot order (token `ids[j]` at `positions[j]`, K/V written to
    slot `writes[j]`, keys [0, kv) read from slot j): the final hidden states [rows, H]. The CUDA
    graphs hold this same function."""
    reach = torch.arange(kv, device=ids.device)[None, :] <= positions[:, None]
    bias = torch.zeros(reach.shape, dtype=decoder.args[1].keys.dtype, device=ids.device)
    bias.masked_fill_(~reach, float("-inf"))
    plan = SlotPlan(write_slots=writes, positions=positions[:, None], kv=kv, decode=True, bias=bias[:, None, None])
    return decoder(ids[:, None], plan)[:, -1]


def _run_decoder(
    decoder: torch.nn.Module, cache: SlotCache, cache_kwarg: str, ids: torch.Tensor, plan: SlotPlan
) -> torch.Tensor:
    """The decoder over `ids` [B, q] as `plan` says; hidden states [B, q, H]."""
    cache.plan(plan)
    # A 4-D mask is passed through as is: transformers builds none (the plan's bias is the mask).
    mask = plan.bias
    if mask is None:
        mask = torch.zeros((ids.shape[0], 1, 1, 1), dtype=torch.bool, device=ids.device)
    kwargs = {cache_kwarg: cache}
    out = decoder(
        input_ids=ids,
        attention_mask=mask,
        position_ids=plan.positions,
        use_cache=True,
        slot_plan=plan,
        **kwargs,
    )
    return out.last_hidden_state  # type: ignore[no-any-return]
