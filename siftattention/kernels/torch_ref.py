"""Plain torch implementation of the sift decode step (backend="torch").

This is the CPU path and the reference the Triton kernels are checked against. It
works on any device, accumulates in float32 and materialises the whole [B, Hq, S]
probability matrix, so it is simple rather than fast.
"""

from __future__ import annotations

import torch


def _scores(
    q: torch.Tensor, k_cache: torch.Tensor, scale: float, seq_lens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled float32 scores [B, Hq, S] (invalid keys at -inf) and the validity mask."""
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    qf = q.float().reshape(B, Hkv, G, D)
    s = torch.matmul(qf, k_cache.float().transpose(-1, -2)).reshape(B, Hq, S) * scale
    pos = torch.arange(S, device=q.device)
    if seq_lens is None:
        valid = torch.ones(B, 1, S, dtype=torch.bool, device=q.device)
    else:
        valid = (pos[None, :] < seq_lens.to(q.device)[:, None])[:, None, :]
    return s.masked_fill(~valid, float("-inf")), valid.expand(B, Hq, S)


def _probs(s: torch.Tensor) -> torch.Tensor:
    return torch.softmax(s, dim=-1)  # exp(-inf) = 0 for invalid keys


def _apply_v(p: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    B, Hq, S = p.shape
    Hkv, D = v_cache.shape[1], v_cache.shape[3]
    G = Hq // Hkv
    out = torch.matmul(p.reshape(B, Hkv, G, S), v_cache.float())
    return out.reshape(B, Hq, D)


def sift_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eta: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    s, valid = _scores(q, k_cache, scale, seq_lens)
    p = _probs(s)
    keep = p > eta[..., None].float()
    # The row maximum is always kept, so a row never goes empty.
    keep.scatter_(-1, s.argmax(dim=-1, keepdim=True), True)
    keep &= valid
    w = torch.where(keep, p, torch.zeros((), dtype=p.dtype, device=p.device))
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    out = _apply_v(w, v_cache)
    return out.to(q.dtype), keep.sum(dim=-1, dtype=torch.int32)


def quantile_of_valid(p: torch.Tensor, valid: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """tau-quantile of each row of ``p`` over its valid entries, linear interpolation.

    Same definition as ``torch.quantile`` (position ``tau * (n - 1)`` in ascending
    order), but works with a different ``n`` per row and with rows longer than 2^24.
    ``tau`` is a float64 tensor broadcastable to ``p.shape[:-1]``.
    """
    n = valid.sum(dim=-1)
    srt = torch.sort(p.masked_fill(~valid, float("inf")), dim=-1).values
    pos = tau.to(torch.float64) * (n - 1).to(torch.float64)
    lo = pos.floor()
    frac = (pos - lo).to(p.dtype)
    lo_i = lo.long().clamp(min=0)
    hi_i = torch.minimum(lo_i + 1, (n - 1).clamp(min=0))
    a = srt.gather(-1, lo_i[..., None]).squeeze(-1)
    b = srt.gather(-1, hi_i[..., None]).squeeze(-1)
    return torch.lerp(a, b, frac)


def sift_warmup_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tau: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    s, valid = _scores(q, k_cache, scale, seq_lens)
    p = _probs(s)
    out = _apply_v(p, v_cache)
    theta = quantile_of_valid(p, valid, tau)
    return out.to(q.dtype), theta.float()
