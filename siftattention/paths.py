"""Where the library keeps what it builds once: joined and converted models, the compiled CPU kernel."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$SIFTATTENTION_CACHE``, else ``$SIFT_CACHE_DIR`` (an older name), else ``~/.cache/siftattention``."""
    root = os.environ.get("SIFTATTENTION_CACHE") or os.environ.get("SIFT_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "siftattention"
