"""What the Pallas kernel (`ragged_paged_attention.py`, with its metadata pass `ragged_paged_attention_tiles.py`)
and the XLA path (`ragged_paged_attention_xla.py`) share: the score given to positions a row may not see, and
ceiling division."""

from __future__ import annotations

import numpy as np

# Finite, not -inf: a fully masked block then gives exp(mask - running max) == 0 instead of inf - inf = NaN,
# and far enough below any real score (float32) that exp underflows to exactly 0.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def cdiv(a, b):
    """Ceiling of a / b for non-negative ints, Python or jnp (traced) alike."""
    return (a + b - 1) // b
