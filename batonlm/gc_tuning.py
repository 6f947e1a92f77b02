"""The garbage collector for a serving process: start-up's objects frozen, young collections rare.

A stream allocates a few small objects per token (messages, chunks, frames) that die at once:
reference counting frees them, the cyclic collector finds nothing in them. With CPython's
default thresholds (a young collection every 700 allocations, an old one every 100 of those)
the collector still walks the process's young objects thousands of times a second, and the
old generation holds everything start-up made (the app, the tokenizer, the model config):
benchmarks/host_overhead.py measured 49 -> 41 us of main-process CPU per streamed token
(256 streams, null device) from this alone.
"""

from __future__ import annotations

import gc

# Allocations between young collections; and young (then middle) collections per older one.
THRESHOLDS = (50_000, 50, 100)


def tune_for_serving() -> None:
    """Call once start-up is done: what exists now lives as long as the process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
