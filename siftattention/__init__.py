"""SiftAttention: power-law guided dynamic sifting of attention for LLM decoding.

Public API::

    from siftattention import apply, generate, Full, TopK, H2O, Sift, Oracle, TopTheta, SkipSoftmax, load_model
    model, tokenizer = load_model("smollm2-135m")
    with apply(model, Sift(tau=0.875, warmup=128)) as handle:
        model.generate(...)                     # transformers' loop, the method applied
    res = generate(model, input_ids, attention_mask, Sift(tau=0.875, warmup=16), max_new_tokens=256)
                                                # the fast loop: fixed cache, CUDA graphs

Imports are lazy so that ``siftattention.kernels`` and the CLI start quickly.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "apply": "siftattention.hf",
    "SiftHandle": "siftattention.hf",
    "UnsupportedModelError": "siftattention.hf",
    "AlreadyAppliedError": "siftattention.hf",
    "generate": "siftattention.generation",
    "GenerationResult": "siftattention.generation",
    "DecodeSession": "siftattention.generation",
    "Method": "siftattention.methods",
    "Full": "siftattention.methods",
    "TopK": "siftattention.methods",
    "H2O": "siftattention.methods",
    "Sift": "siftattention.methods",
    "Oracle": "siftattention.methods",
    "TopTheta": "siftattention.methods",
    "SkipSoftmax": "siftattention.methods",
    "parse_method": "siftattention.methods",
    "load_model": "siftattention.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'siftattention' has no attribute {name!r}")
