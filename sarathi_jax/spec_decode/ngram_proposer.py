"""N-gram (prompt lookup) proposals for speculative decoding: no model, only the request's own tokens.

The proposal for a sequence is the continuation of its last n-gram's most recent earlier occurrence in its
tokens (prompt + output), trying the longest n first (`max_n` down to `min_n`), at most `k` tokens. A match
whose continuation is cut short by the end of the tokens proposes what is there. Plain numpy, no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens continuing `token_ids` (none when no n-gram of `min_n..max_n` recurs)."""
    num = len(token_ids)
    if k < 1 or num < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        # Windows of length n that start before the suffix does (an earlier occurrence; it may overlap it).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: num - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent match's continuation
            return tokens[start : start + k].tolist()
    return []
