"""Taking what is already waiting in a stream, without waiting for more.

A stage that stores groups pays one store call (with LMDB synced, one fsync) per call, not per
group, so it stores together whatever has already queued up behind the group it just received.
It never waits for more to arrive: under light load every group is stored as soon as it comes,
alone, and latency does not grow; under heavy load the queue is full and the calls get fewer.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

__all__ = ["drain_nowait"]

T = TypeVar("T")


def drain_nowait(receive: MemoryObjectReceiveStream[T], limit: int) -> list[T]:
    """Up to `limit` items that `receive` holds right now (buffered, or offered by a waiting
    sender), in order. Returns early, with what it has, at an empty or finished stream: the
    caller's next `receive` sees the end of the stream as usual."""
    out: list[T] = []
    while len(out) < limit:
        try:
            out.append(receive.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
    return out
