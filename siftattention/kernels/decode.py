"""Public decode entry points: validation and backend dispatch (thin wrappers).

Semantics (DESIGN.md, "Semantics"): ``p = softmax(scale * q.k)`` over the valid keys
of each (batch, query head) row; keep keys with ``p > eta``, and always the row's
maximum; the output is ``sum_kept p_i v_i`` with the full-softmax normaliser, or
divided by the kept mass with ``renormalize=True``.

Nothing here reads a tensor value on the host: eta, tau and seq_lens may be computed
on the device every step without a synchronisation.
"""

from __future__ import annotations

import math
import os

import torch

from .torch_ref import sift_decode_torch, sift_warmup_decode_torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "torch", "triton")


def logit_threshold(eta: torch.Tensor | float, row_max: torch.Tensor, sum_exp: torch.Tensor) -> torch.Tensor:
    """Logit threshold equivalent to the probability threshold ``eta``.

    With scores ``s`` (already scaled), ``m = max_j s_j`` and
    ``sum_exp = sum_j exp(s_j - m)``, the softmax probability is
    ``p_i = exp(s_i - m) / sum_exp``, so

        p_i > eta  <=>  s_i > m + log(eta) + log(sum_exp).

    A kernel that knows ``m`` and ``sum_exp`` can therefore filter raw scores without
    forming probabilities. ``eta <= 0`` gives ``-inf`` (keep every key).
    """
    eta_t = torch.as_tensor(eta, dtype=torch.float32, device=row_max.device)
    return row_max + torch.log(eta_t) + torch.log(sum_exp)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {_BACKENDS}")
    if backend == "auto":
        return "triton" if q.is_cuda and _triton_available() else "torch"
    if backend == "triton":
        if not _triton_available():
            raise ValueError("backend='triton' needs the triton package")
        if not q.is_cuda and not _interpreting():
            raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    return backend


def _check_common(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float | None,
    seq_lens: torch.Tensor | None,
) -> tuple[float, torch.Tensor | None]:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"k_cache and v_cache must be [B, Hkv, S_max, D], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    B, Hq, D = q.shape
    Bk, Hkv, S, Dk = k_cache.shape
    if Bk != B:
        raise ValueError(f"batch mismatch: q has {B}, caches have {Bk}")
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q has {D}, caches have {Dk}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if S == 0:
        raise ValueError("the caches hold no keys (S_max = 0)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {_DTYPES}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError("q, k_cache and v_cache must be on one device")
    if seq_lens is not None:
        if seq_lens.shape != (B,):
            raise ValueError(f"seq_lens must be [B] = [{B}], got {tuple(seq_lens.shape)}")
        if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool or seq_lens.is_complex():
            raise ValueError(f"seq_lens must be an integer tensor, got {seq_lens.dtype}")
        if seq_lens.device != q.device:
            raise ValueError("seq_lens must be on the same device as q")
        # Values are not checked (that would sync): they must lie in [1, S_max].
        seq_lens = seq_lens.to(torch.int32).contiguous()
    if scale is None:
        scale = D**-0.5
    return float(scale), seq_lens


def _per_head(x: torch.Tensor | float, name: str, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    B, Hq, _ = q.shape
    if not isinstance(x, torch.Tensor):
        return torch.full((B, Hq), float(x), dtype=dtype, device=q.device)
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
    if x.shape != (B, Hq):
        raise ValueError(f"{name} must be [B, Hq] = [{B}, {Hq}], got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on the same device as q")
    return x.to(dtype).contiguous()


def sift_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eta: torch.Tensor | float,
    *,
    scale: float | None = None,
    seq_lens: torch.Tensor | None = None,
    renormalize: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of SiftAttention.

    Args:
        q: [B, Hq, D] query of the new token.
        k_cache, v_cache: [B, Hkv, S_max, D]; any strides (Hq must be a multiple of Hkv).
        eta: [B, Hq] probability thresholds (float32 on q's device), or one float.
        scale: score scale, default ``D ** -0.5``.
        seq_lens: [B] valid lengths (keys at positions >= seq_len are ignored);
            None means S_max. Values must lie in [1, S_max] (not checked: no sync).
        renormalize: divide by the kept probability mass instead of the full softmax sum.
        backend: "torch" (any device, fp32), "triton" (fused kernel), "auto" (Triton
            on CUDA tensors, torch otherwise).

    Returns:
        out [B, Hq, D] in q's dtype, kept [B, Hq] int32 (keys kept per head).

    The Triton path keeps a small counter buffer per CUDA stream (zeroed again by each
    call), so calls on one stream need no memset; CUDA graphs that capture it on one
    stream must not be replayed concurrently on several streams.
    """
    scale_f, seq_lens = _check_common(q, k_cache, v_cache, scale, seq_lens)
    eta_t = _per_head(eta, "eta", q, torch.float32)
    which = _resolve_backend(backend, q)
    if which == "torch":
        return sift_decode_torch(q, k_cache, v_cache, eta_t, scale_f, seq_lens, renormalize)
    from .triton_decode import sift_decode_triton

    return sift_decode_triton(q, k_cache, v_cache, eta_t, scale_f, seq_lens, renormalize)


def sift_warmup_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tau: torch.Tensor | float,
    *,
    scale: float | None = None,
    seq_lens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact decode step that also records the tau-quantile of each head's probabilities.

    Returns ``out`` [B, Hq, D] (exact attention, q's dtype) and ``theta`` [B, Hq]
    float32: the tau-quantile of the probabilities over the valid keys, with linear
    interpolation between order statistics (``torch.quantile``'s default: position
    ``tau * (n - 1)`` in ascending order). The Triton path finds the order statistics
    by a counting search over the scores, without sorting.

    ``tau`` is a float in (0, 1) or a [B, Hq] tensor.
    """
    scale_f, seq_lens = _check_common(q, k_cache, v_cache, scale, seq_lens)
    if not isinstance(tau, torch.Tensor) and not (0.0 <= float(tau) <= 1.0 and math.isfinite(tau)):
        raise ValueError(f"tau must lie in [0, 1], got {tau}")
    tau_t = _per_head(tau, "tau", q, torch.float64)
    which = _resolve_backend(backend, q)
    if which == "torch":
        return sift_warmup_decode_torch(q, k_cache, v_cache, tau_t, scale_f, seq_lens)
    from .triton_decode import sift_warmup_decode_triton

    return sift_warmup_decode_triton(q, k_cache, v_cache, tau_t, scale_f, seq_lens)
