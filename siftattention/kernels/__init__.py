"""Decode kernels for SiftAttention: a fused Triton path with a torch fallback.

``sift_decode`` runs one approximate generation step (threshold filter on the
softmax probabilities); ``sift_warmup_decode`` runs one exact warmup step and
records the tau-quantile of each head's probabilities. ``DecodeKernels`` is the
planned form (plan once per shape, run many times, CUDA-graph capturable) with an
exact ``dense`` step beside them. Triton is imported only when the Triton backend is
used, so this package imports on machines without it.
"""

from .decode import logit_threshold, sift_decode, sift_warmup_decode
from .plan import DecodeKernels

__all__ = ["DecodeKernels", "logit_threshold", "sift_decode", "sift_warmup_decode"]
