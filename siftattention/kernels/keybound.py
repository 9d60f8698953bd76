"""The key-bound sift step: drop keys by a sound bound from an int8 copy of the keys, read only
the candidates' full keys (torch reference, int8 key copy and byte count).

Each key row ``k_i`` (one per batch row, KV head and position) also lives as ``k_hat_i`` int8
with one float32 scale ``c_i = max(max|k_i| / 127, 2^-126)`` and ``k_hat_i = round(k_i / c_i)``,
so ``|k_i - c_i k_hat_i| <= c_i / 2`` in every channel. With ``sm`` the score scale:

- estimate ``s_hat_i = sm * c_i * (q . k_hat_i)`` and bound ``e_i = sm * c_i * |q|_1 / 2 * (1 + MARGIN)``:
  the exact score ``s_i = sm * q . k_i`` lies in ``[s_hat_i - e_i, s_hat_i + e_i]``. ``MARGIN = 2^-6``
  absorbs float32 rounding (of ``k / c``, of the dot: at most ``2 * gamma_D * 127 |q|_1 c_i`` with
  ``gamma_D = D 2^-24 / (1 - D 2^-24)``, counting tensor cores' truncating adds twice, and of the
  few products and sums after it, each relative to ``|s_hat_i| <= 254 e_i``): under 2^-7 for D <= 256.
- ``LSE_lo = logsumexp(s_hat - e) <= LSE`` gives ``T_lo = LSE_lo + log(eta) - SLACK <= T``
  (``SLACK = 2^-10`` log2 units covers float32 rounding of the log-sum-exp, the kind of rounding
  the exact step's own threshold has). A key with ``s_hat_i + e_i <= T_lo`` cannot be kept, so
  only *candidates* (``s_hat_i + e_i > T_lo``, or ``>= max_j (s_hat_j - e_j)``, which holds for the
  row maximum) are read in full; a key row is read where any query head of its group needs it, and
  then gets exact scores for every head.
- The normaliser ``Z_est`` sums ``exp(s_i)`` of the candidates and ``exp(s_hat_i)`` of the rest;
  the threshold is ``T_est = max(log Z_est + log(eta), T_lo)``. Kept: candidates with exact
  ``s_i > T_est``, and the row maximum (always a candidate); output ``sum_kept exp(s_i) v_i / Z_est``
  (or over the kept mass with ``renormalize``).

Exactness: ``Z`` and ``Z_est`` both lie in ``[Z_C + sum_nc exp(s_hat - e), Z_C + sum_nc exp(s_hat + e)]``
(``Z_C`` the candidates' exact sum, nc the others), so ``|T_est - T| <= epsilon``, the log of that
interval's ratio, at most ``(exp(2 max_nc e_i) - 1) * (the non-candidates' share of the mass)``.
The kept set is the float64 rule's except keys with ``|s_i - T| <= epsilon`` (plus the float32
rounding of the exact step); the output differs from the exact step's by a factor within
``exp(+-epsilon)`` besides those keys (none with ``renormalize``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .torch_ref import _acc_dtype, _kept_output, _probs, _scores, valid_keys

QMAX = 127
#: Relative margin on the bound e_i for float32 rounding (valid for head_dim <= MAX_HEAD_DIM).
MARGIN = 2.0**-6
MAX_HEAD_DIM = 256
#: Log2-domain amount T_lo is lowered by, for float32 rounding of its log-sum-exp.
SLACK2 = 2.0**-10
_TINY = 2.0**-126  # least normal float32: the scale stays normal, so k / c is correctly rounded
_LN2 = 0.6931471805599453


class Int8Keys(NamedTuple):
    """The int8 copy of a key cache: ``values`` [B, Hkv, S, D] int8 and ``scales`` [B, Hkv, S] float32."""

    values: torch.Tensor
    scales: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


def quantize_keys(k: torch.Tensor) -> Int8Keys:
    """Symmetric int8 per key row (the last axis): scale ``max(max|k| / 127, 2^-126)`` in float32."""
    kf = k.to(torch.float64 if k.dtype == torch.float64 else torch.float32)
    scales = (kf.abs().amax(-1) / QMAX).clamp_min(_TINY)
    values = torch.round(kf / scales[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Keys(values, scales.float())


def new_int8_keys(batch: int, kv_heads: int, max_len: int, head_dim: int, device: torch.device | str) -> Int8Keys:
    """An empty copy for a cache of ``max_len`` positions (zero keys: scale 2^-126, values 0)."""
    return Int8Keys(torch.zeros(batch, kv_heads, max_len, head_dim, dtype=torch.int8, device=device),
                    torch.full((batch, kv_heads, max_len), _TINY, dtype=torch.float32, device=device))


def write_int8_keys(keys: Int8Keys, k: torch.Tensor, start: int | None = None, index: torch.Tensor | None = None) -> None:
    """Quantise ``k`` [B, Hkv, n, D] into ``keys`` at positions ``[start, start + n)`` or at the device
    positions ``index`` [n] (no host sync: the fast loop's one-token writes)."""
    new = quantize_keys(k)
    if index is not None:
        keys.values.index_copy_(2, index, new.values)
        keys.scales.index_copy_(2, index, new.scales)
    else:
        n = k.shape[2]
        keys.values[:, :, start:start + n] = new.values
        keys.scales[:, :, start:start + n] = new.scales


def score_bounds(q: torch.Tensor, keys: Int8Keys, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s_hat`` and ``e`` [B, Hq, S] (float32; float64 for float64 q): ``|sm q.k_i - s_hat_i| <= e_i``."""
    B, Hq, D = q.shape
    Hkv, S = keys.values.shape[1], keys.values.shape[2]
    G = Hq // Hkv
    acc = _acc_dtype(q)
    qf = q.to(acc).reshape(B, Hkv, G, D)
    c = keys.scales.to(acc)[:, :, None, :]  # [B, Hkv, 1, S]
    s_hat = torch.matmul(qf, keys.values.to(acc).transpose(-1, -2)) * c * scale
    e = qf.abs().sum(-1)[..., None] * c * (0.5 * scale * (1 + MARGIN))
    return s_hat.reshape(B, Hq, S), e.reshape(B, Hq, S)


def _log_eta(eta: torch.Tensor) -> torch.Tensor:
    """log(eta) with the filter's edges: eta <= 0 gives -inf (keep all), eta >= 1 and NaN +inf (the maximum only)."""
    e = eta.to(torch.float64)
    out = torch.where(e <= 0, float("-inf"), torch.log(e.clamp_min(1e-300)))
    return torch.where((e >= 1) | torch.isnan(e), float("inf"), out)


def keybound_step_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: Int8Keys, eta: torch.Tensor, scale: float,
    seq_lens: torch.Tensor | None, renormalize: bool, starts: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The key-bound step with its intermediate terms: ``out``, ``kept`` [B, Hq], ``candidates`` [B, Hkv, S]
    (key rows read in full), ``epsilon`` [B, Hq] (bound on |T_est - T| in nats), ``t_lo`` and ``t_est`` [B, Hq]."""
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    s_hat, e = score_bounds(q, keys, scale)
    valid = valid_keys(B, S, q.device, seq_lens, starts)
    valid = torch.ones(B, 1, S, dtype=torch.bool, device=q.device) if valid is None else valid[:, None, :]
    ninf = torch.tensor(float("-inf"), dtype=s_hat.dtype, device=q.device)
    lo = torch.where(valid, s_hat - e, ninf)
    hi = torch.where(valid, s_hat + e, ninf)
    log_eta = _log_eta(eta).to(s_hat.dtype)
    slack = SLACK2 * _LN2
    t_lo = torch.logsumexp(lo, -1) + log_eta - slack
    t_lo = torch.where(torch.isinf(log_eta), log_eta, t_lo)
    cand_head = valid & ((hi > t_lo[..., None]) | (hi >= lo.amax(-1, keepdim=True)))
    candidates = cand_head.reshape(B, Hkv, G, S).any(2)  # [B, Hkv, S]
    cand = candidates[:, :, None, :].expand(B, Hkv, G, S).reshape(B, Hq, S)
    # Exact scores are needed at the candidates only (the reference computes them all, for brevity).
    s, _ = _scores(q, k_cache, scale, seq_lens, starts)
    mixed = torch.where(cand, s, torch.where(valid, s_hat, ninf))
    lse_est = torch.logsumexp(mixed, -1)
    t_est = torch.maximum(torch.where(torch.isinf(log_eta), log_eta, lse_est + log_eta), t_lo)
    keep = (mixed > t_est[..., None]) & valid
    keep.scatter_(-1, mixed.argmax(dim=-1, keepdim=True), True)  # the maximum (a candidate), first on ties
    keep &= valid
    p = _probs(mixed)
    out, kept = _kept_output(p, keep, v_cache, renormalize, q.dtype)
    # epsilon: log of the ratio of the bounds on Z that the non-candidates leave.
    nc = valid & ~cand
    z_c = torch.logsumexp(torch.where(cand & valid, s, ninf), -1)
    z_hi = torch.logaddexp(z_c, torch.logsumexp(torch.where(nc, hi, ninf), -1))
    z_lo = torch.logaddexp(z_c, torch.logsumexp(torch.where(nc, lo, ninf), -1))
    epsilon = torch.where(z_lo == float("-inf"), 0.0, z_hi - z_lo)
    return dict(out=out, kept=kept, candidates=candidates, epsilon=epsilon, t_lo=t_lo, t_est=t_est)


def sift_keybound_decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: Int8Keys, eta: torch.Tensor, scale: float,
    seq_lens: torch.Tensor | None, renormalize: bool, starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key-bound sift step (see the module docstring): out [B, Hq, D] (q's dtype), kept [B, Hq] int32
    and the key rows read in full per (batch, KV head), [B, Hkv] int32."""
    r = keybound_step_torch(q, k_cache, v_cache, keys, eta, scale, seq_lens, renormalize, starts)
    return r["out"], r["kept"], r["candidates"].sum(-1, dtype=torch.int32)


def keybound_bytes(batch: int, kv_heads: int, keys: int | float, head_dim: int, elem_bytes: int,
                   candidate_rows: int | float, v_rows: int | float) -> dict[str, float]:
    """Bytes one key-bound step must read: the int8 keys and their scales (``keys`` valid positions per
    (batch, KV head) row), the candidates' full K rows and the kept V rows (both counts summed over the
    batch and KV heads), against the dense step's K + V. The float32 scores it writes and reads back
    (as the exact step does) are not counted: they may stay in L2."""
    rows = batch * kv_heads * keys
    scan = rows * (head_dim + 4)
    k_full = candidate_rows * head_dim * elem_bytes
    v = v_rows * head_dim * elem_bytes
    total = scan + k_full + v
    dense = 2 * rows * head_dim * elem_bytes
    return dict(scan=scan, candidate_k=k_full, kept_v=v, total=total, dense=dense, vs_dense=total / dense)
