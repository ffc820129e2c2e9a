"""Choosing a window of consecutive blocks for a joining server (CG-BP: docs/reference.md 3.1 step 4;
PETALS: 3.3).

Both rules scan every start `a` in `[0, L - m]` and break ties towards the lowest `a`
(docs/reference.md 3).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def max_sum_window(values: np.ndarray, width: int, eligible: np.ndarray) -> int | None:
    """Lowest `a` maximizing `sum(values[a:a+width])` among windows holding an `eligible` block.

    CG-BP's "need of service" rule (Sun et al., Alg. 1 line 5). Sums are exactly rounded
    (`math.fsum`), so windows holding the same values tie exactly whatever their order. Only the
    first few servers (until every block is covered) take this branch, so its cost is immaterial.
    Returns None when no window holds an eligible block.
    """
    eligible_count = np.concatenate(([0], np.cumsum(eligible, dtype=np.int64)))
    best_start, best_sum = None, -math.inf
    for start in range(len(values) - width + 1):
        if eligible_count[start + width] == eligible_count[start]:
            continue
        window_sum = math.fsum(values[start : start + width])
        if window_sum > best_sum:
            best_start, best_sum = start, window_sum
    return best_start


def lexicographic_min_window(values: np.ndarray, width: int) -> int:
    """Lowest `a` whose window `values[a:a+width]`, sorted ascending, is lexicographically smallest.

    CG-BP's rule once every block is covered (Sun et al., Alg. 1 line 6) and PETALS' block choice
    (docs/reference.md 3.3). Every server after the first few takes this branch, so it is CG-BP's hot spot:
    the sorted windows become fixed-width byte strings of order-preserving big-endian keys, which
    compare lexicographically exactly like the windows, and one `argmin` (first minimum, i.e. the
    lowest `a`) picks the window. NumPy ignores trailing NUL bytes when comparing, which keeps the
    order: the shorter string is then a prefix padded with the smallest byte.
    """
    sorted_keys = np.sort(sliding_window_view(_order_keys(np.asarray(values)), width), axis=1)
    rows = np.ascontiguousarray(sorted_keys.astype(">u8")).view(f"S{8 * width}").ravel()
    return int(np.argmin(rows))


def _order_keys(values: np.ndarray) -> np.ndarray:
    """Unsigned 64-bit keys ordered like `values` (integers, or floats without NaN)."""
    if values.dtype.kind == "f":
        bits = (values.astype(np.float64) + 0.0).view(np.int64)  # + 0.0 turns -0.0 into 0.0
        # IEEE 754: flipping all bits of negatives and the sign bit of the rest sorts as unsigned.
        return np.where(bits < 0, ~bits, bits | np.int64(-(2**63))).view(np.uint64)
    return values.astype(np.int64).view(np.uint64) ^ np.uint64(2**63)
