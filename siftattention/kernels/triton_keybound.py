"""The key-bound sift step on Triton: a scan of the int8 keys, a refine pass over the candidates'
full keys, then the filter pass (``sparse_keybound``; the rule and its exactness: ``keybound``).

- ``_scan_kernel`` (split-K per (batch, KV head), the group's query heads as one tile, as the
  scores pass) reads the int8 keys and their scales, writes the estimates ``s_hat`` (log2 domain)
  to the scores workspace and per-split (max, sum of exp2) of the lower bounds ``s_hat - e``. With
  per-channel scales the group's queries are scaled by them once, ``q' = q c``, and ``q'`` takes the
  place of ``q`` in the estimates and bounds (``_channel_dot``); each head's offset term ``sm q . o`` is
  added to its estimates and its rounding bound to ``e``.
- ``_refine_kernel`` (same splits) merges those into ``T_lo`` and the largest lower bound, marks a
  key row a candidate where some head's upper bound ``s_hat + e`` passes either, compacts the
  candidates' positions, gathers their full K rows and overwrites their scores with exact ones. It
  writes the per-split statistics of the mixed scores (exact for candidates, estimates elsewhere)
  where the scores pass writes its own, and ``T_lo`` per head.
- ``filter_pass`` then runs unchanged on the mixed scores with ``T_lo`` as a floor on its
  threshold: a non-candidate's estimate is at most ``T_lo`` and never kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arguments import PowerLawThreshold
from .keybound import MARGIN, OFFSET_ROUNDING, SLACK2, Int8Keys
from .triton_common import _INT_MAX, _dot, _group_query, _narrow, _row_ml, _row_range, _split_range, launch
from .triton_config import LOG2E, KernelConfig, Workspace
from .triton_filter import _eta_threshold, filter_pass

_OFFSET_ROUNDING = tl.constexpr(OFFSET_ROUNDING)


@triton.jit
def _group_split(Q, Chan, Off, SeqLens, Starts, stride_qb, stride_qh, stride_qd, stride_zb, stride_zh, stride_zd,
                 qk_scale, e_scale, S_MAX, NUM_SPLITS, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                 BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_CHANNEL: tl.constexpr):
    """This program's (split, batch row, KV head), the group's query tile (``_group_query``), the query
    scaled by the channel scales in float32 (``q' = q c``; ``q`` itself without them), each head's
    ``e_i / r_i`` (``|q'|_1`` times ``e_scale``), its offset term ``sm q . o`` and that term's rounding
    bound ``e_o`` (both log2 domain, zero without channels), the split's key range [lo, hi) and the
    feature and key offsets."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    q, row, g_mask, d_mask = _group_query(Q, b, hkv, stride_qb, stride_qh, stride_qd, HQ, G, BLOCK_G, D, BLOCK_D)
    qs = q.to(tl.float32)
    shift = tl.zeros([BLOCK_G], tl.float32)
    e_off = tl.zeros([BLOCK_G], tl.float32)
    if HAS_CHANNEL:
        z = b.to(tl.int64) * stride_zb + hkv.to(tl.int64) * stride_zh + tl.arange(0, BLOCK_D) * stride_zd
        qo = qs * tl.load(Off + z, mask=d_mask, other=0.0)[None, :]
        shift = tl.sum(qo, axis=1) * qk_scale
        e_off = tl.sum(tl.abs(qo), axis=1) * (qk_scale * _OFFSET_ROUNDING)
        qs = qs * tl.load(Chan + z, mask=d_mask, other=0.0)[None, :]
    e_head = tl.sum(tl.abs(qs), axis=1) * e_scale
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    lo, hi = _split_range(begin, end, split, NUM_SPLITS, BLOCK_N)
    return (split, bh, b, hkv, q, qs, row, g_mask, d_mask, e_head, shift, e_off, lo, hi, tl.arange(0, BLOCK_D),
            tl.arange(0, BLOCK_N))


@triton.jit
def _channel_dot(qs, kq, USE_DOT: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """``q' . k_hat`` [G, N] of the float32 scaled query and int8 keys. On tensor cores (16-bit queries)
    q' is split into two bfloat16 terms, each rounded to nearest: an element's error is at most
    2^-16 |q'_d|, which with |k_hat| <= 127 moves the dot by at most 2^-8 e_i (inside MARGIN); the int8
    values are exact in bf16. ``UPCAST`` (the interpreter, whose bf16 dots are wrong) multiplies the
    same two terms in float32."""
    if USE_DOT:
        if FP32_DOT:
            return tl.dot(qs, tl.trans(kq.to(tl.float32)), input_precision="ieee")
        else:
            hi = qs.to(tl.bfloat16, fp_downcast_rounding="rtne")
            lo = (qs - hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
            kh = tl.trans(kq.to(tl.float32 if UPCAST else tl.bfloat16))
            return _dot(hi, kh, "tf32", UPCAST) + _dot(lo, kh, "tf32", UPCAST)
    else:
        return tl.sum(qs[:, None, :] * kq[None, :, :].to(tl.float32), axis=2)


@triton.jit
def _scan_kernel(
    Q, KQ, KS, Chan, Off, Scores, Mlo, Llo, SeqLens, Starts,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_cb, stride_ch, stride_cs, stride_zb, stride_zh, stride_zd,
    qk_scale, e_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_CHANNEL: tl.constexpr, FP32_DOT: tl.constexpr,
    INTERP: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, EVICT: tl.constexpr,
):
    """Estimates and lower-bound statistics of one split of one (batch, KV head)."""
    split, bh, b, hkv, q, qs, row, g_mask, d_mask, e_head, shift, e_off, lo, hi, offs_d, offs_n = _group_split(
        Q, Chan, Off, SeqLens, Starts, stride_qb, stride_qh, stride_qd, stride_zb, stride_zh, stride_zd, qk_scale,
        e_scale, S_MAX, NUM_SPLITS, HQ, HKV, G, BLOCK_G, D, BLOCK_D, BLOCK_N, HAS_SEQ_LENS, HAS_STARTS, HAS_CHANNEL)
    k_base = KQ + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    c_base = KS + b.to(tl.int64) * stride_cb + hkv.to(tl.int64) * stride_ch
    s_base = Scores + row[:, None] * S_MAX
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        n_mask = offs < hi
        kq = tl.load(k_base + offs[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
                     mask=n_mask[:, None] & d_mask[None, :], other=0, eviction_policy="evict_first" if EVICT else "")
        c = tl.load(c_base + offs.to(tl.int64) * stride_cs, mask=n_mask, other=0.0)
        if HAS_CHANNEL:
            dot = _channel_dot(qs, kq, USE_DOT, FP32_DOT, INTERP)
        else:
            if DOT_UPCAST:  # the interpreter's int8 -> bf16 conversion is wrong; float32 is exact
                kh = kq.to(tl.float32)
            else:
                kh = kq.to(q.dtype)  # |k_hat| <= 127: exact in every float type
            if USE_DOT:
                dot = _dot(q, tl.trans(kh), DOT_PREC, DOT_UPCAST)
            else:
                dot = tl.sum(q[:, None, :].to(tl.float32) * kh[None, :, :].to(tl.float32), axis=2)
        s = dot * (c * qk_scale)[None, :]
        if HAS_CHANNEL:
            s = s + shift[:, None]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        tl.store(s_base + offs[None, :], s, mask=g_mask[:, None] & n_mask[None, :],
                 eviction_policy="evict_last" if EVICT else "")
        low = s - e_head[:, None] * c[None, :]
        if HAS_CHANNEL:
            low = low - e_off[:, None]
        m_new = tl.maximum(m_i, tl.max(low, axis=1))
        l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(low - m_new[:, None]), axis=1)
        m_i = m_new
    st = row * NUM_SPLITS + split
    tl.store(Mlo + st, m_i, mask=g_mask)
    tl.store(Llo + st, l_i, mask=g_mask)


@triton.jit
def _online(m_i, l_i, s):
    """(max, sum of exp2) of a row tile merged into the running ones; all -inf tiles leave them as they are."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, l_i * tl.math.exp2(m_i - m_safe) + tl.sum(tl.math.exp2(s - m_safe[:, None]), axis=1)


@triton.jit
def _refine_kernel(
    Q, K, KS, Chan, Off, Scores, Mlo, Llo, Mst, Lst, Ast, Eta, Beta, LogSteps, Tlo, Idx, Ccnt, SeqLens, Starts,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_cb, stride_ch, stride_cs, stride_zb, stride_zh, stride_zd,
    qk_scale, e_scale, slack, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_CHANNEL: tl.constexpr, FP32_DOT: tl.constexpr,
    INTERP: tl.constexpr,
    POWER_LAW: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    EVICT: tl.constexpr,
):
    """Candidates of one split of one (batch, KV head): their exact scores over the estimates in Scores,
    the mixed split statistics, the candidate count and (split 0) T_lo per head."""
    split, bh, b, hkv, q, qs, row, g_mask, d_mask, e_head, shift, e_off, lo, hi, offs_d, offs_n = _group_split(
        Q, Chan, Off, SeqLens, Starts, stride_qb, stride_qh, stride_qd, stride_zb, stride_zh, stride_zd, qk_scale,
        e_scale, S_MAX, NUM_SPLITS, HQ, HKV, G, BLOCK_G, D, BLOCK_D, BLOCK_N, HAS_SEQ_LENS, HAS_STARTS, HAS_CHANNEL)
    offs_g = tl.arange(0, BLOCK_G)
    # T_lo = LSE(lower bounds) + log(eta) - slack, and the largest lower bound (the row maximum's
    # upper bound is at least that), from the scan's split statistics.
    m_lo, l_lo, _, _, _ = _row_ml(Mlo, Llo, row, g_mask, NUM_SPLITS, BLOCK_S)
    t_lo = _eta_threshold(m_lo, l_lo, Eta, Beta, LogSteps, row, b, g_mask, POWER_LAW) - slack
    if split == 0:
        tl.store(Tlo + row, t_lo, mask=g_mask)

    # Phase A, on a G-row head tile: the candidate rows' positions, in order, and the statistics of
    # the other rows' estimates.
    offs_ga = tl.arange(0, BLOCK_GA)
    ga_mask = offs_ga < G
    row_a = b.to(tl.int64) * HQ + hkv * G + offs_ga
    t_lo_a = _narrow(t_lo, offs_g, offs_ga)
    top_a = _narrow(m_lo, offs_g, offs_ga)
    e_a = _narrow(e_head, offs_g, offs_ga)
    e_off_a = _narrow(e_off, offs_g, offs_ga)
    c_base = KS + b.to(tl.int64) * stride_cb + hkv.to(tl.int64) * stride_ch
    idx_ptr = Idx + bh.to(tl.int64) * S_MAX + lo
    offs_a = tl.arange(0, BLOCK_A)
    n_cand = lo * 0
    m_a = tl.full([BLOCK_GA], float("-inf"), tl.float32)
    l_a = tl.zeros([BLOCK_GA], tl.float32)
    for u0 in tl.range(lo, hi, BLOCK_A, num_stages=1):
        offs = u0 + offs_a
        n_mask = offs < hi
        s = tl.load(Scores + row_a[:, None] * S_MAX + offs[None, :], mask=ga_mask[:, None] & n_mask[None, :],
                    other=float("-inf"))
        c = tl.load(c_base + offs.to(tl.int64) * stride_cs, mask=n_mask, other=0.0)
        up = s + e_a[:, None] * c[None, :]
        if HAS_CHANNEL:
            up = up + e_off_a[:, None]
        cand = ((up > t_lo_a[:, None]) | (up >= top_a[:, None])) & n_mask[None, :] & ga_mask[:, None]
        rk = tl.max(cand.to(tl.int32), axis=0)
        pos = tl.cumsum(rk, axis=0) - rk
        tl.store(idx_ptr + n_cand + pos, offs, mask=rk > 0)
        n_cand += tl.sum(rk, axis=0)
        m_a, l_a = _online(m_a, l_a, tl.where((rk == 0)[None, :], s, float("-inf")))
    tl.debug_barrier()  # Idx written by this program's threads, read back below

    # Phase B: the candidates' full K rows, exact scores for every head of the group.
    m_i = _narrow(m_a, offs_ga, offs_g)
    l_i = _narrow(l_a, offs_ga, offs_g)
    a_i = tl.zeros([BLOCK_G], tl.int32)
    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    s_base = Scores + row[:, None] * S_MAX
    for j in tl.range(0, n_cand, BLOCK_N):
        jj = j + offs_n
        jm = jj < n_cand
        idx = tl.load(idx_ptr + jj, mask=jm, other=0)
        k = tl.load(k_base + idx[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
                    mask=jm[:, None] & d_mask[None, :], other=0.0, eviction_policy="evict_first" if EVICT else "")
        if USE_DOT:
            s = _dot(q, tl.trans(k), DOT_PREC, DOT_UPCAST)
        else:
            s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        s = tl.where(jm[None, :], s * qk_scale, float("-inf"))  # as the scores pass: scale after the dot
        tl.store(s_base + idx[None, :], s, mask=g_mask[:, None] & jm[None, :],
                 eviction_policy="evict_last" if EVICT else "")
        m_blk = tl.max(s, axis=1)
        a_blk = tl.min(tl.where(s == m_blk[:, None], idx[None, :], _INT_MAX), axis=1)  # positions ascend
        a_i = tl.where(m_blk > m_i, a_blk, a_i)  # strict: keeps the first argmax
        m_i, l_i = _online(m_i, l_i, s)
    st = row * NUM_SPLITS + split
    tl.store(Mst + st, m_i, mask=g_mask)
    tl.store(Lst + st, l_i, mask=g_mask)
    tl.store(Ast + st, a_i, mask=g_mask)
    tl.store(Ccnt + bh * NUM_SPLITS + split, n_cand)


class KeyboundWorkspace:
    """The buffers the key-bound step adds to a plan's ``Workspace``: the scan's lower-bound split
    statistics, ``T_lo`` per (batch, query head) and the candidate rows per (batch, KV head, split)."""

    def __init__(self, geo: dict, device: torch.device):
        B, Hq, Hkv, ns = geo["B"], geo["Hq"], geo["Hkv"], geo["ns1"]
        self.mlo = torch.empty(B, Hq, ns, device=device, dtype=torch.float32)
        self.llo = torch.empty(B, Hq, ns, device=device, dtype=torch.float32)
        self.tlo = torch.empty(B, Hq, device=device, dtype=torch.float32)
        self.ccnt = torch.zeros(B, Hkv, ns, device=device, dtype=torch.int32)

    def candidates(self) -> torch.Tensor:
        """[B, Hkv] int32 key rows the last step read in full."""
        return self.ccnt.sum(-1, dtype=torch.int32)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


def sparse_keybound(geo: dict, ws: Workspace, kws: KeyboundWorkspace, q, k_cache, v_cache, keys: Int8Keys, eta,
                    scale: float, seq_lens, starts, renormalize: bool, cfg: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One key-bound sift step (scan, refine, filter) on prepared inputs: (out, kept)."""
    B, Hq, Hkv, S, D = geo["B"], geo["Hq"], geo["Hkv"], geo["S"], geo["D"]
    has_sl, has_st = seq_lens is not None, starts is not None
    power_law = isinstance(eta, PowerLawThreshold)
    eta_arg, beta_arg, log_steps_arg = eta if power_law else (eta, ws.mst, ws.mst)
    kq, ks, kc, ko = keys
    has_ch = kc is not None
    kc_arg, ko_arg, kc_strides = (kc, ko, kc.stride()) if has_ch else (ks, ks, (0, 0, 0))
    qk_scale = scale * LOG2E
    e_scale = 0.5 * qk_scale * (1 + MARGIN)
    grid = (geo["ns1"], B * Hkv)
    common = dict(HQ=Hq, HKV=Hkv, G=geo["G"], BLOCK_G=geo["BLOCK_G"], D=D, BLOCK_D=geo["BLOCK_D"],
                  BLOCK_N=geo["BLOCK_N1"], HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st, HAS_CHANNEL=has_ch,
                  FP32_DOT=q.dtype == torch.float32, INTERP=geo["interp"], USE_DOT=geo["use_dot"],
                  DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"], EVICT=cfg.evict,
                  num_warps=cfg.warps1, num_stages=cfg.stages1)
    sl_arg, st_arg = (seq_lens if has_sl else ws.ast), (starts if has_st else ws.ast)
    launch(_scan_kernel, grid,
        q, kq, ks, kc_arg, ko_arg, ws.scores, kws.mlo, kws.llo, sl_arg, st_arg,
        q.stride(0), q.stride(1), q.stride(2), kq.stride(0), kq.stride(1), kq.stride(2), kq.stride(3),
        ks.stride(0), ks.stride(1), ks.stride(2), *kc_strides,
        qk_scale, e_scale, S, geo["ns1"], **common)
    launch(_refine_kernel, grid,
        q, k_cache, ks, kc_arg, ko_arg, ws.scores, kws.mlo, kws.llo, ws.mst, ws.lst, ws.ast, eta_arg, beta_arg,
        log_steps_arg, kws.tlo, ws.idx, kws.ccnt, sl_arg, st_arg,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        ks.stride(0), ks.stride(1), ks.stride(2), *kc_strides,
        qk_scale, e_scale, SLACK2, S, geo["ns1"],
        BLOCK_GA=geo["BLOCK_GA"], BLOCK_A=geo["BLOCK_A"], BLOCK_S=geo["BLOCK_S1"], POWER_LAW=power_law, **common)
    try:
        return filter_pass(geo, ws, v_cache, eta, seq_lens, starts, cfg, q.dtype, renormalize, True, False,
                           floor=kws.tlo)
    except BaseException:
        ws.sync[:2].zero_()
        raise
