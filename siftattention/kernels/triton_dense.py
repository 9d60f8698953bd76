"""Exact attention, flash-decoding split-K (``dense``), and the merge of split partials it shares.

``_dense_kernel``: one pass over K and V per split with an online softmax (log2 domain);
the last split program of each row merges the splits' partial outputs (``_merge_splits``).
With ``store_scores`` it also stores the scores, which the warmup step's quantile reads.
The one-pass anchored kernel (``triton_onepass``) merges its splits with ``_merge_chunk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import _dot, _group_query, _row_range, _split_range, launch
from .triton_config import LOG2E, KernelConfig, Workspace


@triton.jit
def _merge_chunk(Part, Mp, Lp, row_c, j0, m, l, tot, ga_mask, offs_d, NUM_SPLITS, BLOCK_D: tl.constexpr,
                 CH: tl.constexpr):
    """Fold splits [j0, j0 + CH) of the head rows ``row_c`` into the running (max, sum, output).

    Returns the chunk's [CH, GA] partial indices and mask, the new (m, l, tot), and the
    rescale of the old sums (alpha) and the splits' weights (w), for callers that merge more
    per-split sums the same way.
    """
    js = j0 + tl.arange(0, CH)
    pj = row_c[None, :] * NUM_SPLITS + js[:, None]  # [CH, GA]
    m2 = (js < NUM_SPLITS)[:, None] & ga_mask[None, :]
    mj = tl.load(Mp + pj, mask=m2, other=float("-inf"), cache_modifier=".cg")
    lj = tl.load(Lp + pj, mask=m2, other=0.0, cache_modifier=".cg")
    part = tl.load(Part + pj[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=m2[:, :, None], other=0.0,
                   cache_modifier=".cg")
    m_new = tl.maximum(m, tl.max(mj, axis=0))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.where(m > float("-inf"), tl.math.exp2(m - m_ref), 0.0)
    w = tl.where(mj > float("-inf"), tl.math.exp2(mj - m_ref[None, :]), 0.0)  # empty splits weigh 0
    l = l * alpha + tl.sum(w * lj, axis=0)
    tot = tot * alpha[:, None] + tl.sum(w[:, :, None] * part, axis=0)
    return pj, m2, m_new, l, tot, alpha, w


@triton.jit
def _merge_splits(Part, Mp, Lp, Out, b, hkv, stride_ob, stride_oh, stride_od, NUM_SPLITS,
                  HQ: tl.constexpr, G: tl.constexpr, BLOCK_GA: tl.constexpr, BLOCK_D: tl.constexpr,
                  CH: tl.constexpr, d_mask):
    """Flash-decoding's combine: merge one (batch, KV head)'s split partials (unnormalised
    outputs, maxima and sums, log2 domain) into the output, on a G-row head tile, CH splits per load."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_ga = tl.arange(0, BLOCK_GA)
    ga_mask = offs_ga < G
    row_c = b.to(tl.int64) * HQ + hkv * G + offs_ga
    m = tl.full([BLOCK_GA], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_GA], tl.float32)
    tot = tl.zeros([BLOCK_GA, BLOCK_D], tl.float32)
    for j0 in range(0, NUM_SPLITS, CH):
        _, _, m, l, tot, _, _ = _merge_chunk(Part, Mp, Lp, row_c, j0, m, l, tot, ga_mask, offs_d, NUM_SPLITS,
                                             BLOCK_D, CH)
    l = tl.where(ga_mask & (l > 0.0), l, 1.0)  # a row without keys: tot = 0, output 0
    h_c = hkv * G + offs_ga
    tl.store(
        Out + b.to(tl.int64) * stride_ob + h_c[:, None] * stride_oh + offs_d[None, :] * stride_od,
        (tot / l[:, None]).to(Out.dtype.element_ty), mask=ga_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _dense_kernel(
    Q, K, V, SeqLens, Starts, Part, Mp, Lp, Sem, Out, Scores,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_od,
    qk_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, EVICT: tl.constexpr, STORE_SCORES: tl.constexpr,
):
    """Exact attention (flash-decoding): one split of one (batch, KV head), all heads of the group.

    One pass over the split's K and V with an online softmax (log2 domain); the split
    writes its unnormalised partial output, max and sum, and the last split program of
    the row (a counter in ``Sem``, zeroed again by it) merges them. With STORE_SCORES
    it also stores the log2-domain scores (the warmup's quantile reads them and the
    per-split max and sum).
    """
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q, row, g_mask, d_mask = _group_query(Q, b, hkv, stride_qb, stride_qh, stride_qd, HQ, G, BLOCK_G, D, BLOCK_D)
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    lo, hi = _split_range(begin, end, split, NUM_SPLITS, BLOCK_N)
    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    s_base = Scores + row[:, None] * S_MAX
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        n_mask = offs < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0, eviction_policy="evict_first" if EVICT else "")
        s = _dot(q, tl.trans(k), DOT_PREC, DOT_UPCAST)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        if STORE_SCORES:
            tl.store(s_base + offs[None, :], s, mask=g_mask[:, None] & n_mask[None, :],
                     eviction_policy="evict_last" if EVICT else "")
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        v = tl.load(v_base + offs[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0, eviction_policy="evict_first" if EVICT else "")
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, DOT_UPCAST)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    pst = row * NUM_SPLITS + split
    tl.store(Part + pst[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(Mp + pst, m_i, mask=g_mask)
    tl.store(Lp + pst, l_i, mask=g_mask)
    tl.debug_barrier()  # every thread's partial stores precede the release below
    done = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        tl.store(Sem + bh, 0)  # ready for the next call
        _merge_splits(Part, Mp, Lp, Out, b, hkv, stride_ob, stride_oh, stride_od, NUM_SPLITS,
                      HQ, G, BLOCK_GA, BLOCK_D, CH, d_mask)


def dense(geo: dict, ws: Workspace, q, k_cache, v_cache, scale: float, seq_lens, starts, cfg: KernelConfig,
          store_scores: bool = False) -> torch.Tensor:
    """Exact attention over the valid keys (flash-decoding split-K); optionally stores the scores."""
    B, Hq, Hkv, D = geo["B"], geo["Hq"], geo["Hkv"], geo["D"]
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    has_sl, has_st = seq_lens is not None, starts is not None
    launch(_dense_kernel, (geo["nsd"], B * Hkv),
        q, k_cache, v_cache, seq_lens if has_sl else ws.dm, starts if has_st else ws.dm,
        ws.dpart, ws.dm, ws.dl, ws.dense_sem, out, ws.scores if store_scores else ws.dm,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        scale * LOG2E, geo["S"], geo["nsd"],
        HQ=Hq, HKV=Hkv, G=geo["G"], BLOCK_G=max(16, geo["BLOCK_GA"]), BLOCK_GA=geo["BLOCK_GA"], D=D,
        BLOCK_D=geo["BLOCK_D"], BLOCK_N=geo["BLOCK_ND"], CH=geo["CHD"], HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st,
        DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"], EVICT=cfg.evict, STORE_SCORES=store_scores,
        num_warps=cfg.warpsd, num_stages=cfg.stagesd, **geo["regsd"],
    )
    return out
