"""Plain torch implementation of the sift decode step (backend="torch").

This is the CPU path and the reference the Triton kernels are checked against. It
works on any device, accumulates in float32 and materialises the whole [B, Hq, S]
probability matrix, so it is simple rather than fast. Nothing here reads a tensor
value on the host, so it never synchronises with the device.

Valid keys of batch row b are the positions ``[starts[b], seq_lens[b])`` (``starts``
None means 0, ``seq_lens`` None means S_max); other keys count nowhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def valid_keys(
    B: int, S: int, device: torch.device, seq_lens: torch.Tensor | None, starts: torch.Tensor | None
) -> torch.Tensor | None:
    """[B, S] boolean mask of the valid keys, or None when every key is valid."""
    if seq_lens is None and starts is None:
        return None
    pos = torch.arange(S, device=device)[None, :]
    valid = torch.ones(B, S, dtype=torch.bool, device=device)
    if seq_lens is not None:
        valid &= pos < seq_lens.to(device)[:, None]
    if starts is not None:
        valid &= pos >= starts.to(device)[:, None]
    return valid


def _scores(
    q: torch.Tensor, k_cache: torch.Tensor, scale: float, seq_lens: torch.Tensor | None, starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled float32 scores [B, Hq, S] (invalid keys at -inf) and the validity mask [B, Hq, S]."""
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    qf = q.float().reshape(B, Hkv, G, D)
    s = torch.matmul(qf, k_cache.float().transpose(-1, -2)).reshape(B, Hq, S) * scale
    valid = valid_keys(B, S, q.device, seq_lens, starts)
    if valid is None:
        return s, torch.ones(B, Hq, S, dtype=torch.bool, device=q.device)
    valid = valid[:, None, :]
    return s.masked_fill(~valid, float("-inf")), valid.expand(B, Hq, S)


def _probs(s: torch.Tensor) -> torch.Tensor:
    return torch.softmax(s, dim=-1)  # exp(-inf) = 0 for invalid keys


def _apply_v(p: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    B, Hq, S = p.shape
    Hkv, D = v_cache.shape[1], v_cache.shape[3]
    G = Hq // Hkv
    out = torch.matmul(p.reshape(B, Hkv, G, S), v_cache.float())
    return out.reshape(B, Hq, D)


def keep_mask(p: torch.Tensor, s: torch.Tensor, valid: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """Keys kept: ``p > eta``, every valid key where ``eta <= 0``, and always the row maximum.

    (``eta <= 0`` is explicit: ``p > 0`` would drop keys whose float32 probability
    underflows to 0, where the logit test of the Triton kernels keeps them. ``eta >= 1``
    and NaN keep the maximum only, as ``p > eta`` says.)
    """
    e = eta[..., None].float()
    keep = (p > e) | (e <= 0)
    keep.scatter_(-1, s.argmax(dim=-1, keepdim=True), True)  # first maximum, as the kernels
    return keep & valid


def sift_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eta: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    renormalize: bool,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    s, valid = _scores(q, k_cache, scale, seq_lens, starts)
    p = _probs(s)
    keep = keep_mask(p, s, valid, eta)
    w = torch.where(keep, p, torch.zeros((), dtype=p.dtype, device=p.device))
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    out = _apply_v(w, v_cache)
    return out.to(q.dtype), keep.sum(dim=-1, dtype=torch.int32)


def dense_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the valid keys through torch SDPA (a boolean mask only when needed)."""
    B, Hq, D = q.shape
    mask = valid_keys(B, k_cache.shape[2], q.device, seq_lens, starts)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k_cache, v_cache, attn_mask=None if mask is None else mask[:, None, None, :],
        scale=scale, enable_gqa=Hq != k_cache.shape[1],
    )
    return out[:, :, 0]


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
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    s, valid = _scores(q, k_cache, scale, seq_lens, starts)
    p = _probs(s)
    out = _apply_v(p, v_cache)
    theta = quantile_of_valid(p, valid, tau)
    return out.to(q.dtype), theta.float()
