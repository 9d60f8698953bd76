"""The sparse step's first pass: scores and per-split softmax statistics (``scores_pass``).

``_scores_kernel`` (split-K, one program per (split, batch, KV head), all query heads of
the GQA group as one tile, so K is read once per group) writes float32 scores in the log2
domain (``s2 = scale * log2(e) * q.k``, 4 bytes per key and query head, vs 2*D bytes of K
per key) and per-split softmax statistics (max, sum of exp2, first argmax). K is loaded
with an evict-first L2 policy and the scores stored evict-last, so the filter pass tends to
find them in L2. On Hopper each program releases a per-row counter as it finishes, which
the filter pass (launched with programmatic dependent launch) waits on.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import _anchor_stats, _dot, _group_query, _row_range, _split_range, launch
from .triton_config import LOG2E, KernelConfig, Workspace, _pow2

try:  # Programmatic dependent launch (Hopper+); the kernels use it only where geometry() found it
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # older Triton
    pass


@triton.jit
def _score_split(
    split, bh,
    Q, K, Scores, Mst, Lst, Ast, Mas, Las, SeqLens, Starts, Arrive,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    qk_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    PDL: tl.constexpr, EVICT: tl.constexpr,
    ANCHORED: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """One split of one (batch, KV head) of pass 1 (see ``_scores_kernel``)."""
    b = bh // HKV
    hkv = bh % HKV
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    # row: the (batch, query head) row index into Scores / stats
    q, row, g_mask, d_mask = _group_query(Q, b, hkv, stride_qb, stride_qh, stride_qd, HQ, G, BLOCK_G, D, BLOCK_D)
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    lo, hi = _split_range(begin, end, split, NUM_SPLITS, BLOCK_N)

    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    s_base = Scores + row[:, None] * S_MAX
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    a_i = tl.zeros([BLOCK_G], tl.int32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        n_mask = offs < hi
        k = tl.load(
            k_base + offs[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
            mask=n_mask[:, None] & d_mask[None, :], other=0.0,
            eviction_policy="evict_first" if EVICT else "",
        )
        if USE_DOT:
            s = _dot(q, tl.trans(k), DOT_PREC, DOT_UPCAST)
        else:
            s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        # Scale after the fp32 dot: rounding a pre-scaled q to fp16 would cost accuracy.
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        tl.store(s_base + offs[None, :], s, mask=g_mask[:, None] & n_mask[None, :],
                 eviction_policy="evict_last" if EVICT else "")
        m_blk = tl.max(s, axis=1)
        a_blk = tl.argmax(s, axis=1).to(tl.int32) + n0
        a_i = tl.where(m_blk > m_i, a_blk, a_i)  # strict: keeps the first argmax
        m_new = tl.maximum(m_i, m_blk)
        l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new

    st = row * NUM_SPLITS + split
    tl.store(Mst + st, m_i, mask=g_mask)
    tl.store(Lst + st, l_i, mask=g_mask)
    tl.store(Ast + st, a_i, mask=g_mask)
    if ANCHORED:
        m_a = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_a = tl.zeros([BLOCK_G], tl.float32)
        last_lo = tl.maximum(begin + FIRST, end - LAST)
        if (lo < begin + FIRST) | (hi > last_lo):  # only the splits that hold anchors pay for them
            tl.debug_barrier()  # the split's scores, stored by every thread, read back below
            m_a, l_a = _anchor_stats(s_base, begin + FIRST, last_lo, lo, hi, g_mask, FIRST, LAST, BLOCK_F, BLOCK_L)
        tl.store(Mas + st, m_a, mask=g_mask)
        tl.store(Las + st, l_a, mask=g_mask)
    if PDL:
        tl.debug_barrier()  # every thread's scores and stats precede the release below
        tl.atomic_add(Arrive + bh, 1, sem="release", scope="gpu")


@triton.jit
def _scores_kernel(
    Q, K, Scores, Mst, Lst, Ast, Mas, Las, SeqLens, Starts, Arrive,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    qk_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    PDL: tl.constexpr, EVICT: tl.constexpr,
    ANCHORED: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr,
    NUM_ROWS, PERSIST: tl.constexpr,
):
    """Pass 1 over one split of one (batch, KV head): scores and split statistics.

    ANCHORED: also (max, sum of exp2) over the split's anchor keys (the row's first FIRST
    and newest LAST valid keys) into Mas / Las, so the filter pass merges them as it merges
    the split statistics, with no load that waits for the row's length.

    PERSIST: a grid of fewer programs than (split, row) items, each taking every
    num_programs-th item in row order, so that rows finish one after another from the
    start and the filter pass (launched once every program here has started) can filter
    the first rows while the later ones are still scored.
    """
    if PDL:
        # The filter kernel may be dispatched once every program here has started; its
        # programs then wait for their own row's counter (Arrive), not for this grid.
        gdc_launch_dependents()
    # Two call sites rather than one loop for both grids: a one-item loop costs the
    # one-program-per-split grid 1-2% at B = 1 (H200, GQA 32/8, S = 8192: 1.18 -> 1.20x SDPA).
    if PERSIST:
        for item in range(tl.program_id(0), NUM_SPLITS * NUM_ROWS, tl.num_programs(0)):
            _score_split(item % NUM_SPLITS, item // NUM_SPLITS,
                         Q, K, Scores, Mst, Lst, Ast, Mas, Las, SeqLens, Starts, Arrive,
                         stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd, qk_scale, S_MAX,
                         NUM_SPLITS, HQ, HKV, G, BLOCK_G, D, BLOCK_D, BLOCK_N, HAS_SEQ_LENS, HAS_STARTS, USE_DOT, DOT_PREC,
                         DOT_UPCAST, PDL, EVICT, ANCHORED, FIRST, LAST, BLOCK_F, BLOCK_L)
    else:
        _score_split(tl.program_id(0), tl.program_id(1),
                     Q, K, Scores, Mst, Lst, Ast, Mas, Las, SeqLens, Starts, Arrive,
                     stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd, qk_scale, S_MAX,
                     NUM_SPLITS, HQ, HKV, G, BLOCK_G, D, BLOCK_D, BLOCK_N, HAS_SEQ_LENS, HAS_STARTS, USE_DOT, DOT_PREC,
                     DOT_UPCAST, PDL, EVICT, ANCHORED, FIRST, LAST, BLOCK_F, BLOCK_L)


def scores_pass(geo: dict, ws: Workspace, q, k_cache, scale: float, seq_lens, starts, cfg: KernelConfig, pdl: bool,
                anchors: tuple[int, int] | None = None) -> None:
    """Pass 1: float32 log2-domain scores and per-split softmax statistics into ``ws``
    (with ``anchors`` (first, last), the anchor keys' statistics too)."""
    first, last = anchors or (0, 0)
    B, Hq, Hkv, S = geo["B"], geo["Hq"], geo["Hkv"], geo["S"]
    has_sl, has_st = seq_lens is not None, starts is not None
    grid = (geo["programs1"],) if geo["programs1"] else (geo["ns1"], B * Hkv)
    launch(_scores_kernel, grid,
        q, k_cache, ws.scores, ws.mst, ws.lst, ws.ast, ws.mas, ws.las,
        seq_lens if has_sl else ws.ast, starts if has_st else ws.ast,
        ws.arrive,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        scale * LOG2E, S, geo["ns1"],
        HQ=Hq, HKV=Hkv, G=geo["G"], BLOCK_G=geo["BLOCK_G"], D=geo["D"], BLOCK_D=geo["BLOCK_D"],
        BLOCK_N=geo["BLOCK_N1"], HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st,
        USE_DOT=geo["use_dot"], DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"],
        PDL=pdl, EVICT=cfg.evict, ANCHORED=anchors is not None, FIRST=first, LAST=last, BLOCK_F=_pow2(first),
        BLOCK_L=_pow2(last), NUM_ROWS=B * Hkv, PERSIST=geo["programs1"] > 0,
        num_warps=cfg.warps1, num_stages=cfg.stages1, **geo["regs1"],
    )
