"""Public decode entry points: validation and backend dispatch (thin wrappers).

Semantics (docs/design.md, "Semantics"): ``p = softmax(scale * q.k)`` over the valid keys
of each (batch, query head) row (positions ``[starts[b], seq_lens[b])``); keep keys
with ``p > eta`` (every key where ``eta <= 0``), and always the row's maximum; the
output is ``sum_kept p_i v_i`` with the full-softmax normaliser, or divided by the kept
mass with ``renormalize=True``.

These functions validate every call; ``DecodeKernels`` (plan.py) is the planned form
for loops that run one shape many times (and CUDA graphs). Apart from ``sift_decode``'s
NaN check on eta (skipped while a CUDA graph is being captured), nothing here reads a
tensor value on the host: eta, tau, seq_lens and starts may be computed on the device
every step.
"""

from __future__ import annotations

import math

import torch

from .arguments import DTYPES as _DTYPES
from .arguments import check_compensation
from .plan import on_device, resolve_backend
from .torch_ref import sift_decode_torch, sift_warmup_decode_torch


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


def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    return resolve_backend(backend, q.device, q.dtype)


def _check_common(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float | None,
    seq_lens: torch.Tensor | None,
    starts: torch.Tensor | None = None,
) -> tuple[float, torch.Tensor | None, torch.Tensor | None]:
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
    # Values are not checked (that would sync): 0 <= starts <= seq_lens <= S_max.
    seq_lens = _index_vector(seq_lens, "seq_lens", B, q.device)
    starts = _index_vector(starts, "starts", B, q.device)
    if scale is None:
        scale = D**-0.5
    return float(scale), seq_lens, starts


def _index_vector(x: torch.Tensor | None, name: str, B: int, device: torch.device) -> torch.Tensor | None:
    if x is None:
        return None
    if not isinstance(x, torch.Tensor) or x.shape != (B,):
        raise ValueError(f"{name} must be [B] = [{B}], got {tuple(getattr(x, 'shape', ()))}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on the same device as q")
    return x.to(torch.int32).contiguous()


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


def _check_eta_not_nan(eta: torch.Tensor | float) -> None:
    """NaN eta is an error here. A tensor eta costs one host sync for this check, skipped
    while a CUDA graph is being captured (``DecodeKernels.sparse`` never checks: there a
    NaN eta keeps the row maximum only)."""
    if not isinstance(eta, torch.Tensor):
        if math.isnan(float(eta)):
            raise ValueError("eta is NaN")
        return
    if eta.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if bool(torch.isnan(eta).any()):
        raise ValueError("eta holds NaN values")


def sift_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eta: torch.Tensor | float,
    *,
    scale: float | None = None,
    seq_lens: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    renormalize: bool = False,
    backend: str = "auto",
    value_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of SiftAttention.

    Args:
        q: [B, Hq, D] query of the new token.
        k_cache, v_cache: [B, Hkv, S_max, D]; any strides (Hq must be a multiple of Hkv).
        eta: [B, Hq] probability thresholds (float32 on q's device), or one float.
            ``eta <= 0`` keeps every valid key, ``eta >= 1`` only the row maximum; NaN
            is an error (checked on the host: one sync for a tensor eta, skipped while
            a CUDA graph is being captured).
        scale: score scale, default ``D ** -0.5``.
        seq_lens: [B] end of the valid keys (positions >= seq_len are ignored);
            None means S_max.
        starts: [B] first valid key (left padding, sliding windows); None means 0.
            Values must satisfy 0 <= start <= seq_len <= S_max (not checked: no sync);
            a row with start == seq_len has no valid key: its output is zeros and kept 0.
        renormalize: divide by the kept probability mass instead of the full softmax sum.
        backend: "torch" (any device, fp32), "triton" (fused kernel), "cpu" (fused C++
            kernel, float32 CPU tensors), "auto" (Triton on CUDA tensors, "cpu" for float32
            CPU tensors where it builds, torch otherwise).
        value_sum: [B, Hkv, D] float32, the sum of each KV head's value rows over the valid
            keys, for value-mean compensation: the output gains ``(1 - kept mass) * value_sum / n``,
            n the row's valid keys. Not with ``renormalize``.

    Returns:
        out [B, Hq, D] in q's dtype, kept [B, Hq] int32 (keys kept per head).

    The Triton path keeps a small counter buffer per CUDA stream (zeroed again by each
    call), so calls on one stream need no memset; CUDA graphs that capture it on one
    stream must not be replayed concurrently on several streams.
    """
    scale_f, seq_lens, starts = _check_common(q, k_cache, v_cache, scale, seq_lens, starts)
    eta_t = _per_head(eta, "eta", q, torch.float32)
    _check_eta_not_nan(eta)
    value_sum = _check_value_sum(value_sum, k_cache, renormalize)
    which = _resolve_backend(backend, q)
    if which == "torch":
        return sift_decode_torch(q, k_cache, v_cache, eta_t, scale_f, seq_lens, renormalize, starts, value_sum)
    if which == "cpu":
        from .cpu_decode import sift_decode_cpu

        return sift_decode_cpu(q, k_cache, v_cache, eta_t, scale_f, seq_lens, renormalize, starts, value_sum)
    from .triton_decode import sift_decode_triton

    with on_device(q.device):
        return sift_decode_triton(q, k_cache, v_cache, eta_t, scale_f, seq_lens, renormalize, starts=starts,
                                  value_sum=value_sum)


def _check_value_sum(value_sum: torch.Tensor | None, k_cache: torch.Tensor, renormalize: bool) -> torch.Tensor | None:
    if value_sum is None:
        return None
    B, Hkv, _, D = k_cache.shape
    if not isinstance(value_sum, torch.Tensor) or tuple(value_sum.shape) != (B, Hkv, D):
        raise ValueError(f"value_sum must be [B, Hkv, D] = [{B}, {Hkv}, {D}], got {tuple(getattr(value_sum, 'shape', ()))}")
    if not value_sum.dtype.is_floating_point or value_sum.device != k_cache.device:
        raise ValueError("value_sum must be a floating tensor on the caches' device")
    check_compensation(True, renormalize)
    return value_sum.float().contiguous()


def sift_warmup_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tau: torch.Tensor | float,
    *,
    scale: float | None = None,
    seq_lens: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact decode step that also records the tau-quantile of each head's probabilities.

    Returns ``out`` [B, Hq, D] (exact attention, q's dtype) and ``theta`` [B, Hq]
    float32: the tau-quantile of the probabilities over the valid keys
    ``[starts, seq_lens)``, with linear interpolation between order statistics
    (``torch.quantile``'s default: position ``tau * (n - 1)`` in ascending order,
    ``n = seq_len - start``). The Triton path finds the order statistics by a counting
    search over the scores, without sorting. A row without valid keys gives zeros
    (output and theta).

    ``tau`` is a float in [0, 1] or a [B, Hq] tensor.
    """
    scale_f, seq_lens, starts = _check_common(q, k_cache, v_cache, scale, seq_lens, starts)
    if not isinstance(tau, torch.Tensor) and not (math.isfinite(tau) and 0.0 <= float(tau) <= 1.0):
        raise ValueError(f"tau must lie in [0, 1], got {tau}")
    tau_t = _per_head(tau, "tau", q, torch.float64)
    which = _resolve_backend(backend, q)
    if which == "cpu":
        from .cpu_decode import warmup_decode_cpu

        return warmup_decode_cpu(q, k_cache, v_cache, tau_t, scale_f, seq_lens, starts)
    if which == "torch":
        return sift_warmup_decode_torch(q, k_cache, v_cache, tau_t, scale_f, seq_lens, starts)
    from .triton_decode import sift_warmup_decode_triton

    with on_device(q.device):
        return sift_warmup_decode_triton(q, k_cache, v_cache, tau_t, scale_f, seq_lens, starts=starts)
