"""`/generate` sent to the engines themselves, for requests whose fields a router would drop.

Why: sglang-router 0.3.2 (the last `sglang-router` release on PyPI, January 2026) parses each
`/generate` body into a fixed request struct and serializes that struct again, so a field it does
not declare never reaches the engine. R3's `return_routed_experts` and `routed_experts_start_len`
are two of them: behind it every R3 answer comes back without `meta_info.routed_experts`. Routers
that keep them do exist (smg >= 1.5.0, the gateway's successor package, whose `GenerateRequest`
keeps unknown fields in a flattened map; forks such as radixark/sgl-router-for-miles that declare
them), but a version string does not tell them apart (that fork also calls itself 0.3.2), so the
fleet asks the router itself: one R3 request through it on entry (`EngineFleet(routed_experts=True)`), and where the
answer has no routes while an engine's own answer does, `/generate` goes straight to the engines.

`EnginePicker` then does the router's job for those requests. A request goes to its prompt's
preferred engine (rendezvous hashing over the live engines, so an eviction moves only the prompts
that engine had) while that engine holds fewer than its share of the fleet's requests: the G
samples of a group share their prompt's prefill in one engine's prefix cache, which is what the
router's `cache_aware` policy aims for. Past its share, a request goes to the engine holding the
fewest: the pool never keeps more than the fleet's concurrency in flight, so while one engine is
over its share another is under it, and no engine queues requests that another could run now.
Control calls (abort, pause, weights) fan out to every engine as before.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EnginePicker", "PickerStatistics"]

# How much of a request's input names its prompt: its length and last tokens. The G samples of a
# group send the same input; two prompts that differ only before their last 64 tokens and have
# the same length share a preference, which costs nothing but that preference.
_KEY_TOKENS = 64


@dataclass(frozen=True, slots=True)
class PickerStatistics:
    in_flight: dict[str, int]  # requests each engine holds now
    picked: int  # requests sent
    preferred: int  # of those, sent to their prompt's preferred engine


_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: 64 bits in, 64 well-mixed bits out."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class EnginePicker:
    """Chooses the engine for each `/generate`; `share` is the fleet's concurrency, split over the
    live engines when a request is placed."""

    def __init__(self, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._concurrency = concurrency
        self._in_flight: dict[str, int] = {}
        self._url_keys: dict[str, int] = {}
        self._picked = 0
        self._preferred = 0

    def pick(self, urls: Sequence[str], input_ids: Sequence[int]) -> str:
        """The engine (one of `urls`, the live ones) for a request whose input is `input_ids`;
        counted as holding it until `release`."""
        if not urls:
            raise ValueError("no engine to send the request to")
        key = hash((len(input_ids), tuple(input_ids[-_KEY_TOKENS:]))) & _MASK
        # Rendezvous: each engine's score mixes the prompt's key with the engine's; a plain tuple
        # hash of the two is too regular (with two engines, 8 prompts all chose one 7% of the time).
        preferred = max(urls, key=lambda u: _mix(key ^ self._url_key(u)))
        share = -(-self._concurrency // len(urls))
        load = self._in_flight.get(preferred, 0)
        if load < share:
            url = preferred
            self._preferred += 1
        else:
            url = min(urls, key=lambda u: self._in_flight.get(u, 0))
        self._in_flight[url] = self._in_flight.get(url, 0) + 1
        self._picked += 1
        return url

    def release(self, url: str) -> None:
        """The request `pick` placed on `url` has its answer (or failed)."""
        left = self._in_flight.get(url, 0) - 1
        if left > 0:
            self._in_flight[url] = left
        else:
            self._in_flight.pop(url, None)

    def statistics(self) -> PickerStatistics:
        return PickerStatistics(dict(self._in_flight), self._picked, self._preferred)

    def _url_key(self, url: str) -> int:
        # crc32, not hash(): a str's hash differs between processes, and Ray producers should
        # agree on which engine a prompt prefers.
        key = self._url_keys.get(url)
        if key is None:
            key = self._url_keys[url] = zlib.crc32(url.encode())
        return key
