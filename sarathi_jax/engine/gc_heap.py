"""The cyclic garbage collector kept off an engine's start-up heap while it serves.

Building an engine leaves some 170k long-lived Python objects behind (JAX's tracing and compilation state, the
tokenizer, the model's pytrees). CPython's collection of its oldest generation walks every one of them: 60-180
ms on a 2-core CPU machine, on the thread that happens to allocate, so a serving
engine stalls for that long whenever enough objects have survived into that generation (a few times a minute
under load), and every running request sees one long time between tokens. `gc.freeze()` after start-up moves
those objects into the permanent generation, which collections skip (vLLM freezes its engine's start-up heap
the same way). Objects made later are collected as before.

Frozen objects that become cyclic garbage stay until `gc.unfreeze()`: a process that builds several engines in
turn (the bench) unfreezes before dropping one (`startup_heap_frozen`); a server, which keeps its engine for the
life of the process, freezes once (`freeze_startup_heap`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze every live object; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[int]:
    """`freeze_startup_heap()` for the block; on leaving it, unfreeze and collect (the engine's cycles go too)."""
    try:
        yield freeze_startup_heap()
    finally:
        gc.unfreeze()
        gc.collect()
