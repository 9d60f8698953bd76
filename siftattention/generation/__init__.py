"""The fast decode path: ``generate(model, input_ids, attention_mask, method, ...)``.

A fixed-size KV cache, an exact prefill and one device-only step per token, captured
as a CUDA graph per method phase on CUDA (see ``loop.py`` and docs/design.md); ``DecodeSession``
keeps the cache and graphs across calls (``session.py``).
"""

from .cache import FixedCache
from .loop import GenerationResult, fast_path_problem, generate, reference_generate
from .session import DecodeSession

__all__ = ["DecodeSession", "FixedCache", "GenerationResult", "fast_path_problem", "generate", "reference_generate"]
