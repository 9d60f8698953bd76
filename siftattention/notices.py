"""The library's own warnings, as categories a caller (the ``sift`` command) can tell apart."""

from __future__ import annotations


class SiftWarning(UserWarning):
    """Something the user should know that does not stop the work (a kernel not built, a slower path)."""


class FallbackWarning(SiftWarning):
    """``siftattention.generate`` runs transformers' ``generate`` instead of its fast loop, and says why."""
