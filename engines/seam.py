"""The one seam between the shared engine and what computes tokens: `ModelForward`.

Every engine in this package is the same scheduler (`scheduler.EngineCore`) behind the same HTTP
surface (`http.EngineServer`); they differ only in the object that produces the next token of each
running request:

- `torch_model.TorchForward`: a Hugging Face causal LM, recomputing every sequence each step;
- `kv_forward.KVCacheForward`: the same model with a KV cache and continuous batching;
- `sim.SimModel`: no network at all, a time model and a length model (benchmarks in seconds).

The scheduler owns requests, queues, pauses and weight versions; a forward owns tensors (or their
simulated cost). The scheduler calls `forward` and `apply_weights` one at a time (its compute lane),
so a forward never races a weight update, and tells the forward when a request leaves the running
batch (`release`), so a cache can free what that request held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from core.errors import PipelineError

__all__ = [
    "GREEDY_TEMPERATURE",
    "Draw",
    "ModelForward",
    "Row",
    "SamplingParams",
    "Tokenizer",
    "WeightLoadError",
]

GREEDY_TEMPERATURE = 1e-6  # SGLang: temperature below this means greedy


class WeightLoadError(PipelineError):
    """New weights could not be read or do not fit the served model; the old weights keep serving."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"cannot load weights from {path!r}: {reason}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling parameters the engines honour (SGLang names and defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    sampling_seed: int | None = None
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True, slots=True)
class Row:
    """One running request's input to a forward: its sequence so far and how to draw the next token.

    `rid` names the request; `key` is unique to this request for the engine's life (a rid can be
    reused as soon as its request finished), so a cache keys its slots by `key`."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    banned: tuple[int, ...] = ()  # stop tokens masked out while min_new_tokens is not reached
    rid: str = ""
    key: int = 0
    end_at: int | None = None  # a length tail (length_tail.py): from this position on, draw `end_token`
    end_token: int = -1
    # R3 (`return_routed_experts`): the routes of positions [routes_from, len(token_ids)) are
    # wanted with the draw (the request holds the earlier ones); None: not asked (moe_routes.py).
    routes_from: int | None = None
    # SC (`top_logprobs_num`): the k most likely tokens of the distribution the token is drawn from.
    top_logprobs: int = 0

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.output_ids

    @property
    def position(self) -> int:
        """Absolute position of the token this step draws."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(frozen=True, slots=True)
class Draw:
    token_id: int
    logprob: float
    # R3: the router choices of the positions this forward read from the row's `routes_from` on,
    # int32 [positions, layers, top_k] as little-endian bytes; empty when not asked.
    routes: bytes = b""
    # SC: (token id, log-prob) of the row's `top_logprobs` most likely tokens, most likely first.
    top: tuple[tuple[int, float], ...] = ()


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ModelForward(Protocol):
    """What a model (or a time model) provides to the scheduler and the HTTP surface."""

    model_path: str
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    engine_version: str  # reported as `version` by /server_info and /v1/loads
    keeps_kv_cache: bool  # running requests hold cache: /v1/loads counts their tokens as used

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def forward(self, rows: Sequence[Row]) -> Sequence[Draw | None]:
        """One forward over the running batch: a Draw per row, or None for a row that gets no token
        this time (a prefill that serves only the requests without cache). Raising fails the batch."""
        ...

    def release(self, row: Row) -> None:
        """`row`'s request left the running batch (finished, aborted or retracted): free its cache."""
        ...

    def idle(self) -> None:
        """The scheduler has nothing to run until new work arrives."""
        ...

    async def read_weights(self, folder: str) -> object:
        """Read and check new weights while forwards go on; raise WeightLoadError, touching nothing live."""
        ...

    async def apply_weights(self, staged: object) -> None:
        """Make what `read_weights` returned live (between two forwards; never cancelled midway)."""
        ...

    def flush_cache(self) -> None:
        """Forget every cached prefix (the scheduler checks that nothing runs)."""
        ...

    def identity(self) -> dict[str, Any]:
        """`model_type` and `architectures` as /model_info reports them."""
        ...

    def server_details(self) -> dict[str, Any]:
        """What this engine adds to /server_info (device, dtype, ...)."""
        ...

    def accelerator(self) -> tuple[str, int]:
        """(kind, count) for /v1/loads."""
        ...
