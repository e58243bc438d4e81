"""gc_heap: the start-up heap frozen out of the cyclic GC, and given back (and its cycles collected) after."""

import gc
import weakref

from sarathi_jax.engine.gc_heap import freeze_startup_heap, startup_heap_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic GC frees it


def test_frozen_block_skips_live_objects_then_collects_their_cycles():
    assert gc.get_freeze_count() == 0
    node = _Node()
    alive = weakref.ref(node)
    with startup_heap_frozen() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: a full collection does not look at it
    assert gc.get_freeze_count() == 0
    assert alive() is None  # unfrozen and collected on leaving the block


def test_freeze_collects_garbage_first():
    node = _Node()
    dead = weakref.ref(node)
    del node
    try:
        freeze_startup_heap()
        assert dead() is None  # garbage made before start-up ended is not frozen (it would never be freed)
    finally:
        gc.unfreeze()
