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
- Per channel (``quantize_keys(k, channel)``; the per-row form is ``c = 1, o = 0``): per (batch row,
  KV head) and channel an offset ``o_d`` (the midpoint of the channel's range) and a scale ``c_d`` in
  [2^-10, 1] (its half-width over the widest channel's), fixed from the prompt's keys (``channel_ranges``);
  per row a factor ``r_i = max(max_d |k_id - o_d| / c_d / 127, 2^-116)`` and
  ``k_hat_id = round((k_id - o_d) / c_d / r_i)``, so ``|k_id - o_d - r_i c_d k_hat_id| <= r_i c_d / 2``: a
  channel's error follows its own spread, not the row's largest channel's nor a constant offset (a key
  bias), and a key beyond the prompt's ranges only gets a larger ``r_i``. With ``q'_d = q_d c_d`` (once per
  step): ``s_hat_i = sm (q . o) + sm r_i (q' . k_hat_i)`` and ``e_i = sm r_i |q'|_1 / 2 (1 + MARGIN) + e_o``,
  ``e_o = sm |q| . |o| * OFFSET_ROUNDING`` bounding float32 rounding of ``q . o`` (``2 gamma_D``) and of
  the sum it enters. Rounding the rest adds: the subtraction and two divisions move ``k_hat`` by at
  most ``383 * 2^-24`` (``2^-14 e_i``), ``q'`` in float32 moves the dot by ``127 * 2^-24 |q'|_1`` (``2^-16
  e_i``) and tensor cores' two bfloat16 terms of ``q'`` (``triton_keybound``) by ``2^-8 e_i``: within
  ``MARGIN`` with the rest. ``(k - o) / c`` stays finite for ``|k| < 2^116`` (every float16 key).
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
#: Scales are ``max|k| * float32(1 / 127)``, the product torch computes for a division by a scalar on CUDA (not
#: on the CPU): the same copy, bit for bit, on every device. ``|k / c|`` may then pass 127 by an ulp; it still
#: rounds to 127.
INV_QMAX = 1.0 / QMAX
#: Relative margin on the bound e_i for float32 rounding (valid for head_dim <= MAX_HEAD_DIM).
MARGIN = 2.0**-6
MAX_HEAD_DIM = 256
#: Log2-domain amount T_lo is lowered by, for float32 rounding of its log-sum-exp.
SLACK2 = 2.0**-10
_TINY = 2.0**-126  # least normal float32: the scale stays normal, so k / c is correctly rounded
#: Least per-channel scale, relative to the head's widest channel (channel scales lie in [2^-10, 1]).
CHANNEL_FLOOR = 2.0**-10
#: Bound on the relative float32 rounding of ``sm q . o`` and of its sum with the rest of ``s_hat``.
OFFSET_ROUNDING = 2.0**-14
_TINY_ROW = _TINY / CHANNEL_FLOOR  # r c_d >= 2^-126: normal, as the per-row scale
_LN2 = 0.6931471805599453
#: The int8 copy's forms: a scale per key row, or per-channel scales and offsets fixed by the prompt (and a
#: factor per row).
KEY_FORMS = ("row", "channel")


def key_copy_form(value: object, name: str) -> str | None:
    """The int8 copy's form that ``value`` asks for: "row" (True too), "channel", or None (False; numpy's
    and a 0-d tensor's bools too); ValueError naming ``name`` otherwise."""
    if isinstance(value, str) and value in KEY_FORMS:
        return value
    item = value.item() if tuple(getattr(value, "shape", (0,))) == () and callable(getattr(value, "item", None)) else value
    if isinstance(item, bool):
        return "row" if item else None
    raise ValueError(f"{name} must be False, True, 'row' or 'channel', got {value!r}")


class Int8Keys(NamedTuple):
    """The int8 copy of a key cache: ``values`` [B, Hkv, S, D] int8, ``scales`` [B, Hkv, S] float32 (one per
    key row) and, for the per-channel form, ``channel`` and ``offset`` [B, Hkv, D] float32 (per KV head)."""

    values: torch.Tensor
    scales: torch.Tensor
    channel: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self if t is not None)


def channel_ranges(k: torch.Tensor, starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel scales ``c_d`` and offsets ``o_d`` [B, Hkv, D] float32 of keys ``k`` [B, Hkv, n, D]: ``o``
    the midpoint of each channel's range over the rows, ``c`` its half-width over the widest channel's,
    floored at ``CHANNEL_FLOOR`` (all ones for constant keys). ``starts`` [B]: only rows at or after
    ``starts[b]`` count (left padding); a batch row with none gets ``c = 1, o = 0``."""
    kf = k.to(torch.float64 if k.dtype == torch.float64 else torch.float32)
    if starts is None:
        hi, lo = kf.amax(2), kf.amin(2)
    else:
        valid = (torch.arange(k.shape[2], device=k.device) >= starts.to(k.device)[:, None])[:, None, :, None]
        hi = torch.where(valid, kf, float("-inf")).amax(2)
        lo = torch.where(valid, kf, float("inf")).amin(2)
        empty = hi < lo  # no valid row
        hi, lo = torch.where(empty, 0.0, hi), torch.where(empty, 0.0, lo)
    offset = (hi / 2 + lo / 2).float()  # halves first: no overflow at the dtype's limits
    dev = (kf - offset.to(kf.dtype)[:, :, None, :]).abs()
    half = (dev if starts is None else torch.where(valid, dev, 0.0)).amax(2)
    top = half.amax(-1, keepdim=True)
    c = torch.where(top > 0, half / torch.where(top > 0, top, 1.0), 1.0)
    return c.clamp_min(CHANNEL_FLOOR).float(), offset


def quantize_keys(k: torch.Tensor, channel: tuple[torch.Tensor, torch.Tensor] | bool | None = None) -> Int8Keys:
    """Symmetric int8 per key row (the last axis). Per row: scale ``max(max|k| / 127, 2^-126)`` in float32
    (the division as a product with ``INV_QMAX``; k_hat rounds half to even).
    With ``channel`` (scales and offsets ``(c, o)`` from ``channel_ranges``, or True to take them from ``k``):
    row factor ``r = max(max_d |k_d - o_d| / c_d / 127, 2^-116)`` and ``k_hat = round((k - o) / c / r)``, so
    that ``|k_d - o_d - r c_d k_hat_d| <= r c_d / 2``; rows beyond the channels' ranges only get a larger ``r``."""
    x, scales, c, o = key_rows(k, channel)
    values = torch.round(x / scales[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Keys(values, scales.float(), c, o)


def key_rows(k: torch.Tensor, channel: tuple[torch.Tensor, torch.Tensor] | bool | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What ``quantize_keys`` rounds: the rows ``x`` (``k`` in float32, float64 for float64; per channel
    ``(k - o) / c``), each row's least scale ``max(max|x| * INV_QMAX, floor)`` (``x.dtype``) and the channel scales
    and offsets (float32; None per row)."""
    kf = k.to(torch.float64 if k.dtype == torch.float64 else torch.float32)
    if channel is None or channel is False:
        return kf, (kf.abs().amax(-1) * INV_QMAX).clamp_min(_TINY), None, None
    c, o = channel_ranges(k) if channel is True else channel
    x = (kf - o.to(kf.dtype)[:, :, None, :]) / c.to(kf.dtype)[:, :, None, :]
    return x, (x.abs().amax(-1) * INV_QMAX).clamp_min(_TINY_ROW), c.float(), o.float()


def new_int8_keys(batch: int, kv_heads: int, max_len: int, head_dim: int, device: torch.device | str,
                  per_channel: bool = False) -> Int8Keys:
    """An empty copy for a cache of ``max_len`` positions (zero keys: the least scale, values 0; with
    ``per_channel`` channel scales of one and offsets of zero until the prompt's write fixes them)."""
    shape = (batch, kv_heads, head_dim)
    channel = torch.ones(shape, device=device) if per_channel else None
    offset = torch.zeros(shape, device=device) if per_channel else None
    return Int8Keys(torch.zeros(batch, kv_heads, max_len, head_dim, dtype=torch.int8, device=device),
                    torch.full((batch, kv_heads, max_len), _TINY_ROW if per_channel else _TINY, dtype=torch.float32,
                               device=device), channel, offset)


def clear_int8_keys(keys: Int8Keys, start: int) -> None:
    """Positions ``start`` on back to ``new_int8_keys``'s empty copy, and the channel ranges back to theirs,
    in place."""
    keys.values[:, :, start:].zero_()
    keys.scales[:, :, start:].fill_(_TINY_ROW if keys.channel is not None else _TINY)
    if keys.channel is not None:
        keys.channel.fill_(1.0)
        keys.offset.zero_()


def score_bounds(q: torch.Tensor, keys: Int8Keys, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s_hat`` and ``e`` [B, Hq, S] (float32; float64 for float64 q): ``|sm q.k_i - s_hat_i| <= e_i``.
    Per channel the query is scaled once, ``q'_d = q_d c_d``: ``s_hat = sm (q . o) + sm r (q' . k_hat)`` and
    ``e = sm r |q'|_1 / 2 (1 + MARGIN) + e_o``."""
    B, Hq, D = q.shape
    Hkv, S = keys.values.shape[1], keys.values.shape[2]
    G = Hq // Hkv
    acc = _acc_dtype(q)
    qf = q.to(acc).reshape(B, Hkv, G, D)
    shift = err = 0.0
    if keys.channel is not None:
        o = keys.offset.to(acc)[:, :, None, :]
        shift = (qf * o).sum(-1, keepdim=True) * scale  # [B, Hkv, G, 1]
        err = (qf * o).abs().sum(-1, keepdim=True) * (scale * OFFSET_ROUNDING)
        qf = qf * keys.channel.to(acc)[:, :, None, :]
    c = keys.scales.to(acc)[:, :, None, :]  # [B, Hkv, 1, S]
    s_hat = torch.matmul(qf, keys.values.to(acc).transpose(-1, -2)) * c * scale + shift
    e = qf.abs().sum(-1)[..., None] * c * (0.5 * scale * (1 + MARGIN)) + err
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
    """The key-bound step with its intermediate terms: ``out``, ``kept`` [B, Hq], ``keep`` [B, Hq, S] (the kept
    keys), ``candidates`` [B, Hkv, S] (key rows read in full), ``epsilon`` [B, Hq] (bound on |T_est - T| in
    nats), ``t_lo`` and ``t_est`` [B, Hq]."""
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
    return dict(out=out, kept=kept, keep=keep, candidates=candidates, epsilon=epsilon, t_lo=t_lo, t_est=t_est)


def sift_keybound_decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: Int8Keys, eta: torch.Tensor, scale: float,
    seq_lens: torch.Tensor | None, renormalize: bool, starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key-bound sift step (see the module docstring): out [B, Hq, D] (q's dtype), kept [B, Hq] int32
    and the key rows read in full per (batch, KV head), [B, Hkv] int32."""
    r = keybound_step_torch(q, k_cache, v_cache, keys, eta, scale, seq_lens, renormalize, starts)
    return r["out"], r["kept"], r["candidates"].sum(-1, dtype=torch.int32)


def keybound_bytes(batch: int, kv_heads: int, keys: int | float, head_dim: int, elem_bytes: int,
                   candidate_rows: int | float, v_rows: int | float, per_channel: bool = False,
                   group: int = 0, planes: bool = False) -> dict[str, float]:
    """Bytes one key-bound step must read: the int8 keys and their scales (``keys`` valid positions per
    (batch, KV head) row; ``per_channel``: and the channel scales and offsets of each (batch, KV head)), the candidates'
    full K rows and the kept V rows (both counts summed over the batch and KV heads), against the dense
    step's K + V (``total``, ``vs_dense``). ``scores``: the float32 score traffic, with ``group`` query heads per
    KV head (0: not counted): the scan writes an estimate per key and head, refine reads them all, writes the
    candidates' positions and reads them back and overwrites their estimates with exact scores, and the filter
    pass reads every score again (the exact step writes and reads a score per key and head: ``2 * 4 * group``
    bytes a key row; neither counts the filter pass's compaction of its kept rows). Kept apart from ``total``:
    much of it may stay in L2; ``total_with_scores`` counts it all. ``planes``: keys stored as two byte planes
    (``key_planes.py``): the scan reads the high plane (as the int8 copy), a candidate only its low plane
    (``head_dim`` bytes), the scan's dot of its high plane being kept; ``dense`` stays the 16-bit cache's."""
    rows = batch * kv_heads * keys
    scan = rows * (head_dim + 4) + (batch * kv_heads * head_dim * 8 if per_channel else 0)
    k_full = candidate_rows * head_dim * (1 if planes else elem_bytes)
    v = v_rows * head_dim * elem_bytes
    total = scan + k_full + v
    scores = 3 * rows * 4 * group + candidate_rows * (4 * group + 2 * 4) if group else 0
    dense = 2 * rows * head_dim * elem_bytes
    return dict(scan=scan, candidate_k=k_full, kept_v=v, total=total, dense=dense, vs_dense=total / dense,
                scores=scores, total_with_scores=total + scores)
