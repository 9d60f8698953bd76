"""The largest haystack that fits: RULER's binary search over the haystack size, in the model's own tokens."""

from __future__ import annotations

from typing import Callable


class LengthError(ValueError):
    """The task's fixed text alone does not fit the requested length."""


def largest_fitting(tokens_of: Callable[[int], int], budget: int, start: int = 16, limit: int | None = None) -> int:
    """The largest ``units >= 1`` with ``tokens_of(units) <= budget``, assuming ``tokens_of`` grows with ``units``.

    Doubling from ``start`` (or from ``limit``) finds a size that does not fit, then a binary
    search narrows the gap: about 2 log2(units) measurements.
    """
    if tokens_of(1) > budget:
        raise LengthError(f"{tokens_of(1)} tokens without a haystack, more than the {budget} available")
    low, high = 1, max(2, start)
    if limit is not None:
        high = min(high, limit)
    while tokens_of(high) <= budget:
        if limit is not None and high >= limit:
            return limit
        low, high = high, high * 2 if limit is None else min(high * 2, limit)
    while high - low > 1:
        mid = (low + high) // 2
        if tokens_of(mid) <= budget:
            low = mid
        else:
            high = mid
    return low
