"""The controller process's garbage collector, set once start-up is done (`settle_gc`).

Every engine answer becomes two 1k-element tuples (token ids, log-probs) of fresh int and float
objects. CPython's cyclic collector traverses every tracked object of the young generation when it
collects it, and a tuple stays tracked until its first collection: with the default gen-0
threshold (700 net new containers) a collection comes every few dozen answers, and it walks the
tuples of every sample still alive, item by item, cache miss by cache miss. Measured with
`benchmarks/controller_overhead.py` (sync, LMDB synced, gc time per thread over 8 more steps):
about 200 us of collector time per sample at the default, about 10 us at 100,000.

Why a larger threshold is not the same cost deferred: gen 0 counts *net* new containers
(allocations minus frees). A sample lives from its answer until its batch is trained, so the live
set rises and falls by a step's worth of objects (a few thousand per 512 samples); at 700 every
rise past 700 triggers a collection that walks the samples then alive, at 100,000 those samples
are freed before a collection ever sees them. What still accumulates (reference cycles, groups a
store keeps in memory) is collected when it reaches the threshold, in one longer pause.
"""

from __future__ import annotations

import gc

__all__ = ["GEN0_THRESHOLD", "settle_gc"]

GEN0_THRESHOLD = 100_000


def settle_gc() -> None:
    """Freeze what start-up built out of every later scan, and raise the young generation's
    threshold to `GEN0_THRESHOLD` (the older generations' thresholds are kept)."""
    # Everything built so far (torch, transformers, the model, the dataset) lives for the whole
    # run: full scans over it were a measurable share of the controller's time.
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
