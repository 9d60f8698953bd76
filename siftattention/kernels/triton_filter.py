"""The sparse step's second pass: threshold, compaction, V gather and the output (``filter_pass``).

``_filter_kernel`` (split-K) merges the split statistics into the row max ``M`` and
normaliser ``L``, turns eta into the log2-domain threshold ``M + log2(eta) + log2(L)``
(eta <= 0: keep every key; eta >= 1: the maximum only), compacts the positions of the rows
that some head of the group keeps and gathers only those V rows (or streams with masked V
loads when nothing is filtered). The compaction scan is ``_scan_packed`` (a thread holds whole
keys, every head of the group; a kept key is one word and one record of weights) where the
group has at most 8 heads; otherwise a scan of [heads, keys] tiles. Partial outputs are already
divided by ``L``, so splits add up: the last split program of each (batch, KV head) sums them, renormalises or adds the
value-mean compensation if asked and writes the output and the kept counts (``_combine_kernel`` does this as a launch of its own
when ``fused_combine`` is off). On Hopper it is launched with programmatic dependent launch:
it is dispatched during the scores kernel's tail and each program waits only for the splits
of its own row, so the V gathers of finished rows overlap the last K reads.

SHARED (``Sift(gqa="shared")``, eta equal over each group's heads): a key is kept for every head of the
group when some head's score passes its threshold (``_kept``), so the kept set is the group's; each
head still keeps its own maximum.

The anchored normaliser's threshold and gap (``_anchored_threshold``, ``_gap``) live here
too; the one-pass kernel (``triton_onepass``) uses the same ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arguments import PowerLawThreshold
from .triton_common import _INT_MAX, _dot, _narrow, _row_ml, _row_range, _split_range, launch
from .triton_config import KernelConfig, Workspace


@triton.jit
def _split_span(begin, end, split, NUM_SPLITS, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """One filter split's keys as ``n`` virtual positions u, at ``base + (u // CHUNK) * stride + u % CHUNK``.

    Returns (lo, n, base, stride, hi): ``lo`` is where the split's compacted lists start
    (at most ``n`` entries; the splits' lists tile [begin, end) without overlap) and every
    key position is below ``hi``. CHUNK = 0: one contiguous range [lo, lo + n). CHUNK > 0:
    the chunks c0, c0 + NUM_SPLITS, ... of CHUNK keys; the last (partial) chunk goes to the
    last split, so every list ends by ``end``.
    """
    if CHUNK == 0:
        lo, hi = _split_range(begin, end, split, NUM_SPLITS, BLOCK)
        return lo, tl.maximum(hi - lo, 0), lo, lo * 0, hi
    else:
        n_chunks = tl.cdiv(tl.maximum(end - begin, 0), CHUNK)
        q = n_chunks // NUM_SPLITS
        r = n_chunks % NUM_SPLITS
        first = NUM_SPLITS - r  # splits from here on own one chunk more
        count = q + (split >= first).to(tl.int32)
        lo = begin + (split * q + tl.maximum(split - first, 0)) * CHUNK
        c0 = (n_chunks + split) % NUM_SPLITS
        return lo, count * CHUNK, begin + c0 * CHUNK, begin * 0 + NUM_SPLITS * CHUNK, end


@triton.jit
def _split_pos(u, base, stride, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Key positions of the virtual positions ``u``, a tile of TILE starting at a multiple of min(TILE, CHUNK)."""
    if CHUNK == 0:
        return base + u
    else:
        pos = base + (u // CHUNK) * stride + u % CHUNK
        return tl.max_contiguous(pos, CHUNK if CHUNK < TILE else TILE)


@triton.jit
def _row_stats(Mst, Lst, Ast, row, g_mask, NUM_SPLITS, BLOCK_S: tl.constexpr):
    """Row max M, normaliser L and first argmax from the per-split statistics."""
    m, l, mst, ptr, msk = _row_ml(Mst, Lst, row, g_mask, NUM_SPLITS, BLOCK_S)
    ast = tl.load(Ast + ptr, mask=msk, other=_INT_MAX)
    amax = tl.min(tl.where(mst == m[:, None], ast, _INT_MAX), axis=1)  # splits are in order
    return m, l, amax


@triton.jit
def _eta_threshold(m, l, Eta, Beta, LogSteps, row, b, g_mask, POWER_LAW: tl.constexpr):
    """log2-domain threshold ``m + log2(eta) + log2(l)`` per head of the tile.

    POWER_LAW: ``Eta`` holds log alpha, and log2(eta) = (log alpha - beta * log S) * log2(e).
    """
    # p > eta  <=>  s2 > M + log2(eta) + log2(L). eta <= 0 (log alpha = -inf: no fit) keeps
    # every key; eta >= 1 keeps none but the maximum (p <= 1), whatever the rounding of
    # log2(L); NaN keeps the maximum only, as p > NaN.
    if POWER_LAW:
        log_alpha = tl.load(Eta + row, mask=g_mask, other=0.0)
        beta = tl.load(Beta + row, mask=g_mask, other=0.0)
        log2_eta = (log_alpha - beta * tl.load(LogSteps + b)) * 1.4426950408889634
        at_least_one = log2_eta >= 0.0
    else:
        eta = tl.load(Eta + row, mask=g_mask, other=1.0)
        log2_eta = tl.where(eta <= 0.0, float("-inf"), tl.math.log2(eta))  # log2 of eta < 0 is NaN
        at_least_one = eta >= 1.0
    return tl.where(at_least_one, float("inf"), m + log2_eta + tl.math.log2(l))


@triton.jit
def _thresholds(Mst, Lst, Ast, Eta, Beta, LogSteps, row, b, g_mask, NUM_SPLITS1, BLOCK_S1: tl.constexpr,
                KEEP_ALL: tl.constexpr, POWER_LAW: tl.constexpr):
    """Row max M, normaliser L, log2-domain threshold and argmax per head of the tile."""
    m, l, amax = _row_stats(Mst, Lst, Ast, row, g_mask, NUM_SPLITS1, BLOCK_S1)
    if KEEP_ALL:
        thr = tl.full(m.shape, float("-inf"), tl.float32)
    else:
        thr = _eta_threshold(m, l, Eta, Beta, LogSteps, row, b, g_mask, POWER_LAW)
    return m, l, thr, amax


@triton.jit
def _anchored_threshold(a2, Gap, LogAlpha, Beta, LogSteps, row, b, g_mask):
    """The anchored normaliser's log2-domain threshold ``A + gap_prev + log(eta)`` per head
    (``a2``: the anchors' log2-sum-exp2 A); a NaN gap or log(eta) = -inf keeps every key,
    log(eta) >= 0 the row maximum only, padded heads nothing. Shared by both anchored steps."""
    log_eta = tl.load(LogAlpha + row, mask=g_mask, other=0.0) - tl.load(Beta + row, mask=g_mask, other=0.0) * \
        tl.load(LogSteps + b)
    gap_prev = tl.load(Gap + row, mask=g_mask, other=0.0)
    thr = a2 + (gap_prev + log_eta) * 1.4426950408889634
    thr = tl.where((gap_prev != gap_prev) | (log_eta == float("-inf")), float("-inf"), thr)
    thr = tl.where(log_eta >= 0.0, float("inf"), thr)
    return tl.where(g_mask, thr, float("inf"))


@triton.jit
def _gap(m, l, a2):
    """The anchored normaliser's gap ``L - A`` in natural log, from the row's log2-domain maximum ``m``,
    sum ``l`` and anchor log-sum-exp ``a2``; 0 on a row without keys (l = 0: all of its keys, none, are anchors)."""
    return tl.where(l > 0.0, (m + tl.math.log2(l) - a2) * 0.6931471805599453, 0.0)


@triton.jit
def _kept(s, idx, jm, thr, amax, g_mask, SHARED: tl.constexpr):
    """[G, N] the keys each head of the tile keeps (scores s [G, N] at positions idx [N], ``jm`` the real ones):
    those above its threshold (SHARED: above some head's) and its own maximum."""
    if SHARED:
        above = tl.max(((s > thr[:, None]) & g_mask[:, None]).to(tl.int32), axis=0) > 0
        return (above[None, :] | (idx[None, :] == amax[:, None])) & jm[None, :] & g_mask[:, None]
    else:
        return ((s > thr[:, None]) | (idx[None, :] == amax[:, None])) & jm[None, :] & g_mask[:, None]


@triton.jit
def _accumulate(acc, mass, s, idx, jm, thr, amax, m, g_mask, v_ptrs, vmask, DOT_PREC, DOT_UPCAST, USE_DOT, EVICT,
                SHARED: tl.constexpr):
    """Add the kept keys of one tile (scores s [G, N] at positions idx [N]) to acc / mass."""
    keep = _kept(s, idx, jm, thr, amax, g_mask, SHARED)
    w = tl.where(keep, tl.math.exp2(s - m[:, None]), 0.0)
    v = tl.load(v_ptrs, mask=vmask, other=0.0, eviction_policy="evict_first" if EVICT else "")
    if USE_DOT:
        acc += _dot(w.to(v.dtype), v, DOT_PREC, DOT_UPCAST)
    else:
        acc += tl.sum(w[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    return acc, mass + tl.sum(w, axis=1), tl.sum(keep.to(tl.int32), axis=1)


@triton.jit
def _scan_tiles(Scores, Wc, idx_ptr, row_a, ga_mask, thr_a, amax_a, m_a, n_virt, base, stride, end, start, S_MAX,
                BLOCK_GA: tl.constexpr, BLOCK_A: tl.constexpr, CHUNK: tl.constexpr, COMPACT_W: tl.constexpr,
                SHARED: tl.constexpr):
    """Phase A on [heads, keys] tiles (groups of more than 8 heads): the positions of the rows some head
    keeps, in order (a prefix sum per tile) and, COMPACT_W, their heads' weights compacted alike
    (``Wc`` [B * Hq, S]). Returns the rows kept, and each head's kept count and (COMPACT_W) mass."""
    offs_a = tl.arange(0, BLOCK_A)
    cnt_a = tl.zeros([BLOCK_GA], tl.int32)
    mass_a = tl.zeros([BLOCK_GA], tl.float32)
    n_kept = start * 0
    sa_base = Scores + row_a[:, None] * S_MAX
    wa_base = Wc + row_a[:, None] * S_MAX + start
    # Not software-pipelined: prefetching the score tiles made GQA ~5% slower.
    for u0 in tl.range(0, n_virt, BLOCK_A, num_stages=1):
        offs = _split_pos(u0 + offs_a, base, stride, CHUNK, BLOCK_A)
        n_mask = (u0 + offs_a < n_virt) & (offs < end)
        s = tl.load(sa_base + offs[None, :], mask=ga_mask[:, None] & n_mask[None, :], other=float("-inf"))
        keep = _kept(s, offs, n_mask, thr_a, amax_a, ga_mask, SHARED)
        cnt_a += tl.sum(keep.to(tl.int32), axis=1)
        rk = tl.max(keep.to(tl.int32), axis=0)
        pos = tl.cumsum(rk, axis=0) - rk
        tl.store(idx_ptr + n_kept + pos, offs, mask=rk > 0)
        if COMPACT_W:
            # The kept weights of every head of the group, compacted like the positions:
            # phase B then reads them directly (one indirection, the V rows, per tile).
            w_a = tl.where(keep, tl.math.exp2(s - m_a[:, None]), 0.0)
            mass_a += tl.sum(w_a, axis=1)
            tl.store(wa_base + (n_kept + pos)[None, :], w_a.to(Wc.dtype.element_ty),
                     mask=ga_mask[:, None] & (rk > 0)[None, :])
        n_kept += tl.sum(rk, axis=0)
    return n_kept, cnt_a, mass_a


@triton.jit
def _gather_tiles(acc, mass, Wc, idx_ptr, v_base, s_base, row, start, thr, amax, m, g_mask, offs_g, offs_ga, offs_d,
                  d_mask, mass_a, n_kept, stride_vs, stride_vd, S_MAX, BLOCK_N: tl.constexpr, BLOCK_NB: tl.constexpr,
                  STAGES_B: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_DOT: tl.constexpr,
                  EVICT: tl.constexpr, COMPACT_W: tl.constexpr, SHARED: tl.constexpr):
    """Phase B after ``_scan_tiles``: gathers the kept V rows with the compacted weights (COMPACT_W,
    the mass as phase A summed it), or with the scores read back at their positions. Returns acc, mass."""
    if COMPACT_W:
        offs_nb = tl.arange(0, BLOCK_NB)
        w_base = Wc + row[:, None] * S_MAX + start
        for j in tl.range(0, n_kept, BLOCK_NB, num_stages=STAGES_B):
            jj = j + offs_nb
            jm = jj < n_kept
            idx = tl.load(idx_ptr + jj, mask=jm, other=0)
            w = tl.load(w_base + jj[None, :], mask=g_mask[:, None] & jm[None, :], other=0.0)
            v = tl.load(v_base + idx[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd,
                        mask=jm[:, None] & d_mask[None, :], other=0.0, eviction_policy="evict_first" if EVICT else "")
            acc += _dot(w, v, DOT_PREC, DOT_UPCAST)
        mass = _narrow(mass_a, offs_ga, offs_g)
    else:
        offs_n = tl.arange(0, BLOCK_N)
        for j in tl.range(0, n_kept, BLOCK_N, num_stages=STAGES_B):
            jj = j + offs_n
            jm = jj < n_kept
            idx = tl.load(idx_ptr + jj, mask=jm, other=0)
            s = tl.load(s_base + idx[None, :], mask=g_mask[:, None] & jm[None, :], other=float("-inf"))
            v_ptrs = v_base + idx[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd
            acc, mass, _ = _accumulate(acc, mass, s, idx, jm, thr, amax, m, g_mask, v_ptrs,
                                       jm[:, None] & d_mask[None, :], DOT_PREC, DOT_UPCAST, USE_DOT, EVICT, SHARED)
    return acc, mass


@triton.jit
def _opaque(x, ON: tl.constexpr):
    """``x`` unchanged, hidden from Triton's contiguity analysis: a load through it gets one key a
    thread per access, the layout the records' stores want, instead of a vector of 4 (the layouts
    would then differ and every tile would convert its records through shared memory)."""
    if ON:  # not under the interpreter, which has no inline assembly (and no layouts)
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return x


@triton.jit
def _head_scalar(x, offs_ga, h: tl.constexpr):
    """Element ``h`` of a per-head vector, exactly (every other term of the sum is zero)."""
    return tl.sum(tl.where(offs_ga == h, x, tl.zeros_like(x)), axis=0)


@triton.jit
def _above_head(Scores, row0, S_MAX, offs, n_mask, thr_a, offs_ga, above, h: tl.constexpr, G: tl.constexpr):
    """``above`` or-ed with the keys head ``h`` of the group passes (``Sift(gqa="shared")``'s first sweep)."""
    if h < G:
        s = tl.load(Scores + (row0 + h) * S_MAX + offs, mask=n_mask, other=float("-inf"))
        return above | (s > _head_scalar(thr_a, offs_ga, h))
    else:
        return above


@triton.jit
def _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, h: tl.constexpr,
               G: tl.constexpr, WDTYPE: tl.constexpr, SHARED: tl.constexpr):
    """One head of ``_scan_packed``'s tile: its weights (0 where not kept; padded heads 0) and the bits.
    SHARED: a key is kept where some head of the group passes (``above``), as well as at the head's maximum."""
    if h < G:
        s = tl.load(Scores + (row0 + h) * S_MAX + offs, mask=n_mask, other=float("-inf"))
        if SHARED:
            passes = above
        else:
            passes = s > _head_scalar(thr_a, offs_ga, h)
        keep = (passes | (offs == _head_scalar(amax_a, offs_ga, h))) & n_mask
        w = tl.where(keep, tl.math.exp2(s - _head_scalar(m_a, offs_ga, h)), 0.0).to(WDTYPE)
        return w, bits | (keep.to(tl.int32) << h)
    else:
        return tl.zeros(offs.shape, WDTYPE), bits


@triton.jit
def _scan_packed(Scores, idx_ptr, wk_ptr, row0, thr_a, amax_a, m_a, n_virt, base, stride, end, S_MAX,
                 G: tl.constexpr, BLOCK_GA: tl.constexpr, BLOCK_A: tl.constexpr, CHUNK: tl.constexpr,
                 OPAQUE: tl.constexpr, STAGES: tl.constexpr, SHARED: tl.constexpr):
    """Phase A with few instructions a key: each thread scans whole keys, one head at a time, so the
    group's union and each key's head bits form in-thread, the prefix sum needs no change of layout,
    and each kept key is stored as one word (its position | its heads' bits << 24) and one record of
    its heads' weights (BLOCK_GA of them, ``wk_ptr``), a vector store. Returns the rows kept."""
    offs_a = tl.arange(0, BLOCK_A)
    offs_ga = tl.arange(0, BLOCK_GA)
    n_kept = n_virt * 0
    WDTYPE: tl.constexpr = wk_ptr.dtype.element_ty
    for u0 in tl.range(0, n_virt, BLOCK_A, num_stages=STAGES):
        offs = _opaque(_split_pos(u0 + offs_a, base, stride, CHUNK, BLOCK_A), OPAQUE)
        n_mask = (u0 + offs_a < n_virt) & (offs < end)
        bits = tl.zeros([BLOCK_A], tl.int32)
        above = tl.zeros([BLOCK_A], tl.int1)
        if SHARED:  # a first sweep over the group's heads (the second one reads the scores again, from cache)
            for h in tl.static_range(BLOCK_GA):
                above = _above_head(Scores, row0, S_MAX, offs, n_mask, thr_a, offs_ga, above, h, G)
        w0, bits = _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, 0, G,
                              WDTYPE, SHARED)
        w1, bits = _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, 1, G,
                              WDTYPE, SHARED)
        w2, bits = _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, 2, G,
                              WDTYPE, SHARED)
        w3, bits = _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, 3, G,
                              WDTYPE, SHARED)
        w4, bits = _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, 4, G,
                              WDTYPE, SHARED)
        w5, bits = _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, 5, G,
                              WDTYPE, SHARED)
        w6, bits = _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, 6, G,
                              WDTYPE, SHARED)
        w7, bits = _scan_head(Scores, row0, S_MAX, offs, n_mask, thr_a, amax_a, m_a, offs_ga, bits, above, 7, G,
                              WDTYPE, SHARED)
        rk = (bits != 0).to(tl.int32)
        dst = n_kept + tl.cumsum(rk, axis=0) - rk
        tl.store(idx_ptr + dst, offs | (bits << 24), mask=rk > 0)
        # join stacks on a new last axis: the outermost join holds the lowest bit of the head index
        if BLOCK_GA == 8:
            rec = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
        elif BLOCK_GA == 4:
            rec = tl.join(tl.join(w0, w2), tl.join(w1, w3))
        elif BLOCK_GA == 2:
            rec = tl.join(w0, w1)
        else:
            rec = w0
        rec = tl.reshape(rec, [BLOCK_A, BLOCK_GA])
        tl.store(wk_ptr + (dst * BLOCK_GA)[:, None] + offs_ga[None, :], rec, mask=(rk > 0)[:, None])
        n_kept += tl.sum(rk, axis=0)
    return n_kept


@triton.jit
def _head_pairs(word, p: tl.constexpr):
    """Heads 2p and 2p + 1 of each packed word's head bits as the two 32-bit lanes of an int64: summed over
    keys they count both heads' kept keys, with no reduction across threads a tile."""
    x = ((word >> (24 + 2 * p)) & 3).to(tl.int64)
    return (x & 1) | ((x & 2) << 31)


@triton.jit
def _gather_packed(acc, mass, idx_ptr, wk_ptr, v_base, g_mask, offs_g, offs_d, d_mask, n_kept, stride_vs, stride_vd,
                   BLOCK_GA: tl.constexpr, BLOCK_NB: tl.constexpr, STAGES_B: tl.constexpr, DOT_PREC: tl.constexpr,
                   DOT_UPCAST: tl.constexpr, EVICT: tl.constexpr, NEED_MASS: tl.constexpr):
    """Phase B after ``_scan_packed``: gathers the kept V rows beside their weight records; returns acc,
    mass (NEED_MASS; else as given) and each head's kept count, from the words' head bits."""
    offs_nb = tl.arange(0, BLOCK_NB)
    c0 = tl.zeros([BLOCK_NB], tl.int64)
    c1 = tl.zeros([BLOCK_NB], tl.int64)
    c2 = tl.zeros([BLOCK_NB], tl.int64)
    c3 = tl.zeros([BLOCK_NB], tl.int64)
    for j in tl.range(0, n_kept, BLOCK_NB, num_stages=STAGES_B):
        jj = j + offs_nb
        jm = jj < n_kept
        word = tl.load(idx_ptr + jj, mask=jm, other=0)
        w = tl.load(wk_ptr + jj[None, :] * BLOCK_GA + offs_g[:, None], mask=(offs_g < BLOCK_GA)[:, None] & jm[None, :],
                    other=0.0)
        v = tl.load(v_base + (word & 0xFFFFFF)[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd,
                    mask=jm[:, None] & d_mask[None, :], other=0.0, eviction_policy="evict_first" if EVICT else "")
        acc += _dot(w, v, DOT_PREC, DOT_UPCAST)
        if NEED_MASS:
            mass += tl.sum(w.to(tl.float32), axis=1)
        c0 += _head_pairs(word, 0)
        c1 += _head_pairs(word, 1)
        c2 += _head_pairs(word, 2)
        c3 += _head_pairs(word, 3)
    pair = offs_g // 2
    lanes = tl.where(pair == 0, tl.sum(c0, axis=0), tl.where(pair == 1, tl.sum(c1, axis=0),
                     tl.where(pair == 2, tl.sum(c2, axis=0), tl.sum(c3, axis=0))))
    cnt = tl.where(offs_g < 8, (lanes >> ((offs_g % 2) * 32).to(tl.int64)) & 0xFFFFFFFF, 0).to(tl.int32)
    return acc, mass, cnt


@triton.jit
def _filter_kernel(
    V, Scores, Mst, Lst, Ast, Mas, Las, Eta, Beta, LogSteps, Gap, Floor, SeqLens, Starts, Idx, Wc, Part, Cnt, Mass, Sem,
    Arrive, Out, Kept, ValueSum,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh, stride_od,
    S_MAX, NUM_SPLITS1, NUM_SPLITS2,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_NB: tl.constexpr,
    BLOCK_S1: tl.constexpr, CH: tl.constexpr, COMPACT_W: tl.constexpr, STREAM_MASK_V: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KEEP_ALL: tl.constexpr, POWER_LAW: tl.constexpr, COMPACT: tl.constexpr, DENSE_PCT: tl.constexpr,
    STAGES_B: tl.constexpr, FUSED_COMBINE: tl.constexpr, RESET_SYNC: tl.constexpr, RENORMALIZE: tl.constexpr,
    WRITE_KEPT: tl.constexpr, PDL: tl.constexpr, EVICT: tl.constexpr, CHUNK: tl.constexpr,
    ANCHORED: tl.constexpr, FLOOR: tl.constexpr, VMC: tl.constexpr, SHARED: tl.constexpr, PACKED: tl.constexpr,
    PACKED_OPAQUE: tl.constexpr, SCAN_STAGES: tl.constexpr,
):
    """Pass 2 over one split of one (batch, KV head).

    FLOOR (the key-bound step, ``triton_keybound``): the threshold is at least ``Floor`` per
    (batch, query head), the lower bound the unread keys were dropped by, so that none of their
    estimated scores is kept whatever the rounding of the normaliser.

    ANCHORED (``Sift(normalizer="anchored")``; ``Eta`` holds log alpha): the threshold is
    the anchored normaliser's, from the scores pass's anchor statistics and the previous
    gap in ``Gap``, which the row's last program (FUSED_COMBINE) overwrites with this step's.

    Streaming mode reads the split's scores tile by tile and masks the V loads; its
    loop carries a score load -> dependent V load chain, so at high sparsity it is
    latency bound (few useful bytes per iteration). Compact mode first writes the
    positions of the rows some head keeps to ``Idx`` (prefix sum per tile, on a head
    tile of G rows, not the 16 the dot needs), then gathers only those V rows,
    BLOCK_N useful rows per iteration. Rows where every eta <= 0 (nothing to filter)
    and splits kept above DENSE_PCT percent stream.

    With FUSED_COMBINE the last split program of each (batch, KV head) to finish
    (a counter in ``Sem``) sums the split partials and writes the output, which
    saves the separate combine launch. VMC: it also adds the pruned mass times the mean of
    the row's valid value rows, from ``ValueSum`` [B, Hkv, D] (their float32 sum).
    """
    split = tl.program_id(0)
    bh = tl.program_id(1)
    if PDL:
        # Launched before the scores kernel ends (every scores program has started, so
        # this wait ends): filter this row as soon as all its splits are in.
        # Poll with plain volatile loads (polling with atomics from hundreds of waiting
        # programs contends in L2 with the scores kernel: GQA 2-3% slower), then acquire
        # once so that the row's scores and statistics are visible below.
        arrived = tl.load(Arrive + bh, volatile=True)
        while arrived < NUM_SPLITS1:
            arrived = tl.load(Arrive + bh, volatile=True)
        tl.atomic_add(Arrive + bh, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
    b = bh // HKV
    hkv = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    row = b.to(tl.int64) * HQ + hkv * G + offs_g

    begin, end_row = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    if ANCHORED:
        m, l, amax = _row_stats(Mst, Lst, Ast, row, g_mask, NUM_SPLITS1, BLOCK_S1)
        anc_m, anc_l, _, _, _ = _row_ml(Mas, Las, row, g_mask, NUM_SPLITS1, BLOCK_S1)  # the scores pass's anchor stats
        a2 = anc_m + tl.math.log2(anc_l)
        thr = _anchored_threshold(a2, Gap, Eta, Beta, LogSteps, row, b, g_mask)
    else:
        m, l, thr, amax = _thresholds(Mst, Lst, Ast, Eta, Beta, LogSteps, row, b, g_mask, NUM_SPLITS1, BLOCK_S1,
                                      KEEP_ALL, POWER_LAW)
    if FLOOR:
        thr = tl.maximum(thr, tl.load(Floor + row, mask=g_mask, other=float("-inf")))
    start, n_virt, base, stride, end = _split_span(begin, end_row, split, NUM_SPLITS2, BLOCK_N, CHUNK)

    v_base = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    s_base = Scores + row[:, None] * S_MAX
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    mass = tl.zeros([BLOCK_G], tl.float32)
    pst = row * NUM_SPLITS2 + split
    dense = True
    if COMPACT:
        dense = tl.max(tl.where(g_mask, thr, float("-inf")), axis=0) == float("-inf")
        if not dense:
            # Phase A: positions of the rows that some head of the group keeps, in order.
            offs_ga = tl.arange(0, BLOCK_GA)
            ga_mask = offs_ga < G
            row_a = b.to(tl.int64) * HQ + hkv * G + offs_ga
            # The scan's head tile has G rows (the dot's has >= 16): same decisions, exactly.
            thr_a = _narrow(thr, offs_g, offs_ga)
            amax_a = _narrow(amax, offs_g, offs_ga)
            m_a = _narrow(m, offs_g, offs_ga)
            idx_ptr = Idx + bh.to(tl.int64) * S_MAX + start
            wk_ptr = Wc + (bh.to(tl.int64) * S_MAX + start) * BLOCK_GA
            if PACKED:
                n_kept = _scan_packed(Scores, idx_ptr, wk_ptr, b.to(tl.int64) * HQ + hkv * G, thr_a, amax_a, m_a,
                                      n_virt, base, stride, end, S_MAX, G, BLOCK_GA, BLOCK_A, CHUNK, PACKED_OPAQUE,
                                      SCAN_STAGES, SHARED)
            else:
                n_kept, cnt_a, mass_a = _scan_tiles(Scores, Wc, idx_ptr, row_a, ga_mask, thr_a, amax_a, m_a, n_virt,
                                                    base, stride, end, start, S_MAX, BLOCK_GA, BLOCK_A, CHUNK,
                                                    COMPACT_W, SHARED)
            tl.debug_barrier()  # Idx (and the weights) written by this program's threads, read back below
            dense = n_kept * 100 > n_virt * DENSE_PCT
            if not dense:
                # Phase B: gather the kept rows, all useful.
                if PACKED:
                    acc, mass, cnt_p = _gather_packed(acc, mass, idx_ptr, wk_ptr, v_base, g_mask, offs_g, offs_d,
                                                      d_mask, n_kept, stride_vs, stride_vd, BLOCK_GA, BLOCK_NB,
                                                      STAGES_B, DOT_PREC, DOT_UPCAST, EVICT, RENORMALIZE or VMC)
                    tl.store(Cnt + pst, cnt_p, mask=g_mask)
                else:
                    acc, mass = _gather_tiles(acc, mass, Wc, idx_ptr, v_base, s_base, row, start, thr, amax, m, g_mask,
                                              offs_g, offs_ga, offs_d, d_mask, mass_a, n_kept, stride_vs, stride_vd,
                                              S_MAX, BLOCK_N, BLOCK_NB, STAGES_B, DOT_PREC, DOT_UPCAST, USE_DOT, EVICT,
                                              COMPACT_W, SHARED)
                    tl.store(Cnt + row_a * NUM_SPLITS2 + split, cnt_a, mask=ga_mask)
    if dense:
        # Streaming: every tile, V loads masked to the rows some head keeps.
        cnt = tl.zeros([BLOCK_G], tl.int32)
        for u0 in range(0, n_virt, BLOCK_N):
            offs = _split_pos(u0 + offs_n, base, stride, CHUNK, BLOCK_N)
            n_mask = (u0 + offs_n < n_virt) & (offs < end)
            s = tl.load(s_base + offs[None, :], mask=g_mask[:, None] & n_mask[None, :], other=float("-inf"))
            v_ptrs = v_base + offs[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd
            if STREAM_MASK_V:
                # Only the rows some head keeps (the V load then waits for the score load).
                row_kept = tl.max(((s > thr[:, None]) | (offs[None, :] == amax[:, None])).to(tl.int32), axis=0) > 0
                v_mask = (row_kept & n_mask)[:, None] & d_mask[None, :]
            else:
                # Every row of the tile: streaming runs where most rows are kept, and a V load
                # that does not wait for the scores keeps the loop pipelined.
                v_mask = n_mask[:, None] & d_mask[None, :]
            acc, mass, c = _accumulate(
                acc, mass, s, offs, n_mask, thr, amax, m, g_mask, v_ptrs, v_mask, DOT_PREC, DOT_UPCAST, USE_DOT, EVICT,
                SHARED,
            )
            cnt += c
        tl.store(Cnt + pst, cnt, mask=g_mask)

    inv_l = tl.where(l > 0.0, 1.0 / l, 0.0)  # a row without keys (l = 0) contributes zeros
    tl.store(Part + pst[:, None] * BLOCK_D + offs_d[None, :], acc * inv_l[:, None], mask=g_mask[:, None])
    tl.store(Mass + pst, mass * inv_l, mask=g_mask)
    if FUSED_COMBINE:
        last = _combine_last(Part, Mass, Cnt, Out, Kept, ValueSum, Sem, Arrive, bh, b, hkv, end_row - begin, offs_d,
                             d_mask, stride_ob, stride_oh, stride_od, NUM_SPLITS2, HQ, G, BLOCK_GA, D, BLOCK_D, CH,
                             RESET_SYNC, RENORMALIZE, VMC, WRITE_KEPT)
        if ANCHORED:
            if last:  # every program of the row read the previous gap before it arrived
                tl.store(Gap + row, _gap(m, l, a2), mask=g_mask)


@triton.jit
def _combine_last(Part, Mass, Cnt, Out, Kept, ValueSum, Sem, Arrive, bh, b, hkv, n_keys, offs_d, d_mask,
                  stride_ob, stride_oh, stride_od, NUM_SPLITS, HQ: tl.constexpr, G: tl.constexpr,
                  BLOCK_GA: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr,
                  RESET_SYNC: tl.constexpr, RENORMALIZE: tl.constexpr, VMC: tl.constexpr, WRITE_KEPT: tl.constexpr):
    """Called by each split program of (batch, KV head) ``bh`` once its partials (``Part``, ``Mass``, ``Cnt`` at
    [row, split]) are stored: the last to arrive (a counter in ``Sem``) sums them, renormalises or adds the
    value-mean compensation (``n_keys`` valid keys) if asked and writes the output and kept counts. Returns
    whether this program was the last."""
    tl.debug_barrier()  # every thread's partial stores precede the release below
    done = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
    last = done == NUM_SPLITS - 1
    if last:
        if RESET_SYNC:
            # Every program of this row has passed its wait and its count: zero both
            # counters for the next call (saves a memset launch per call).
            tl.store(Sem + bh, 0)
            tl.store(Arrive + bh, 0)
        # Sum the split partials on a G-row head tile, CH splits per load (one dependent
        # load per split would serialise ~0.5 us each: most of the tail at small B).
        offs_ga = tl.arange(0, BLOCK_GA)
        ga_mask = offs_ga < G
        row_c = b.to(tl.int64) * HQ + hkv * G + offs_ga
        offs_c = tl.arange(0, CH)
        tot = tl.zeros([BLOCK_GA, BLOCK_D], tl.float32)
        tot_mass = tl.zeros([BLOCK_GA], tl.float32)
        kept = tl.zeros([BLOCK_GA], tl.int32)
        for j0 in range(0, NUM_SPLITS, CH):
            js = j0 + offs_c
            pj = row_c[None, :] * NUM_SPLITS + js[:, None]  # [CH, GA]
            m2 = (js < NUM_SPLITS)[:, None] & ga_mask[None, :]
            tot += tl.sum(tl.load(Part + pj[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=m2[:, :, None],
                                  other=0.0, cache_modifier=".cg"), axis=0)
            tot_mass += tl.sum(tl.load(Mass + pj, mask=m2, other=0.0, cache_modifier=".cg"), axis=0)
            kept += tl.sum(tl.load(Cnt + pj, mask=m2, other=0, cache_modifier=".cg"), axis=0)
        if RENORMALIZE:  # the kept mass is 0 only on a row without keys, whose output stays 0
            tot = tot / tl.where(ga_mask & (tot_mass > 0.0), tot_mass, 1.0)[:, None]
        if VMC:
            mean = _value_mean(ValueSum, bh, n_keys, offs_d, d_mask, D)
            tot += (1.0 - tot_mass)[:, None] * mean[None, :]
        h = hkv * G + offs_ga
        tl.store(
            Out + b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
            tot.to(Out.dtype.element_ty), mask=ga_mask[:, None] & d_mask[None, :],
        )
        if WRITE_KEPT:
            tl.store(Kept + row_c, kept, mask=ga_mask)
    return last


@triton.jit
def _value_mean(ValueSum, kv_row, n, offs_d, d_mask, D: tl.constexpr):
    """The mean of the valid value rows of (batch, KV head) ``kv_row`` from their sum [B, Hkv, D] and
    their count ``n``; 0 on a row without keys. Value-mean compensation adds (1 - kept mass) times it."""
    vs = tl.load(ValueSum + kv_row.to(tl.int64) * D + offs_d, mask=d_mask, other=0.0)
    return tl.where(n > 0, vs / tl.maximum(n, 1).to(tl.float32), 0.0)


@triton.jit
def _combine_kernel(
    Part, Cnt, Mass, Out, Kept, ValueSum, SeqLens, Starts,
    stride_ob, stride_oh, stride_od,
    NUM_SPLITS2, S_MAX,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S2: tl.constexpr,
    RENORMALIZE: tl.constexpr, WRITE_KEPT: tl.constexpr, VMC: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // HQ
    h = row % HQ
    offs_s = tl.arange(0, BLOCK_S2)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS2
    part = tl.load(
        Part + (row * NUM_SPLITS2 + offs_s[:, None]) * BLOCK_D + offs_d[None, :],
        mask=s_mask[:, None], other=0.0,
    )
    out = tl.sum(part, axis=0)
    if RENORMALIZE or VMC:
        mass = tl.sum(tl.load(Mass + row * NUM_SPLITS2 + offs_s, mask=s_mask, other=0.0), axis=0)
    if RENORMALIZE:  # the kept mass is 0 only on a row without keys, whose output stays 0
        out = out / tl.where(mass > 0.0, mass, 1.0)
    if VMC:
        begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
        out += (1.0 - mass) * _value_mean(ValueSum, b * (HQ // G) + h // G, end - begin, offs_d, offs_d < D, D)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d * stride_od,
        out.to(Out.dtype.element_ty), mask=offs_d < D,
    )
    if WRITE_KEPT:
        kept = tl.sum(tl.load(Cnt + row * NUM_SPLITS2 + offs_s, mask=s_mask, other=0), axis=0)
        tl.store(Kept + row, kept)


def filter_pass(
    geo: dict, ws: Workspace, v_cache, eta, seq_lens, starts, cfg: KernelConfig, out_dtype: torch.dtype,
    renormalize: bool, want_kept: bool, pdl: bool, anchors: tuple[torch.Tensor, int, int] | None = None,
    floor: torch.Tensor | None = None, value_sum: torch.Tensor | None = None, shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pass 2: threshold, compaction, V gather and (fused) the output; ``eta`` None keeps every key.

    ``eta``: [B, Hq] probabilities, or a ``PowerLawThreshold`` the kernel evaluates itself.
    ``anchors`` (gap, first, last): the anchored normaliser's threshold (``eta`` a
    ``PowerLawThreshold``); the gap [B, Hq] float32 is overwritten with this step's.
    ``floor`` [B, Hq] float32: a least log2-domain threshold per head (the key-bound step's).
    ``value_sum``: [B, Hkv, D] float32 contiguous, the sum of each KV head's valid value rows, for
    value-mean compensation (``torch_ref.value_mean_term``; not with ``renormalize``).
    ``shared``: one kept set per KV group (``eta`` equal over each group's heads; module docstring).
    """
    B, Hq, Hkv, S, D = geo["B"], geo["Hq"], geo["Hkv"], geo["S"], geo["D"]
    power_law = isinstance(eta, PowerLawThreshold)
    if power_law:
        eta_arg, beta_arg, log_steps_arg = eta
    else:  # unused pointers get any float32 buffer
        eta_arg, beta_arg, log_steps_arg = (eta if eta is not None else ws.mst), ws.mst, ws.mst
    dev = v_cache.device
    compact = cfg.compact and eta is not None
    fused = geo["fused"]
    out = torch.empty(B, Hq, D, device=dev, dtype=out_dtype)
    kept = torch.empty(B, Hq, device=dev, dtype=torch.int32) if want_kept else None
    has_sl, has_st = seq_lens is not None, starts is not None
    gap = anchors[0] if anchors is not None else ws.mst
    launch(_filter_kernel, (geo["ns2"], B * Hkv),
        v_cache, ws.scores, ws.mst, ws.lst, ws.ast, ws.mas, ws.las, eta_arg, beta_arg, log_steps_arg, gap,
        floor if floor is not None else ws.mst, seq_lens if has_sl else ws.ast, starts if has_st else ws.ast,
        ws.idx, ws.wc, ws.part, ws.cnt, ws.mass, ws.sem, ws.arrive,
        out, kept if kept is not None else ws.cnt, value_sum if value_sum is not None else ws.mst,
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        S, geo["ns1"], geo["ns2"],
        HQ=Hq, HKV=Hkv, G=geo["G"], BLOCK_G=geo["BLOCK_G"], BLOCK_GA=geo["BLOCK_GA"], D=D, BLOCK_D=geo["BLOCK_D"],
        BLOCK_N=geo["BLOCK_N2"], BLOCK_A=geo["BLOCK_A"], BLOCK_NB=geo["BLOCK_NB"], BLOCK_S1=geo["BLOCK_S1"], CH=geo["CH2"],
        COMPACT_W=cfg.compact_weights and geo["use_dot"], STREAM_MASK_V=cfg.stream_mask_v,
        HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st,
        USE_DOT=geo["use_dot"], DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"], KEEP_ALL=eta is None,
        POWER_LAW=power_law, COMPACT=compact, DENSE_PCT=cfg.dense_pct, STAGES_B=geo["STAGES_B"],
        FUSED_COMBINE=fused, RESET_SYNC=fused, RENORMALIZE=renormalize, WRITE_KEPT=want_kept,
        PDL=pdl, EVICT=cfg.evict, CHUNK=geo["CHUNK2"], ANCHORED=anchors is not None, FLOOR=floor is not None,
        VMC=value_sum is not None, SHARED=shared and eta is not None, PACKED=geo["PACKED"],
        PACKED_OPAQUE=not geo["interp"], SCAN_STAGES=cfg.scan_stages,
        num_warps=cfg.warps2, num_stages=cfg.stages2, **geo["regs2"], **({"launch_pdl": True} if pdl else {}),
    )
    if not fused:
        launch(_combine_kernel, (B * Hq,),
            ws.part, ws.cnt, ws.mass, out, kept if kept is not None else ws.cnt,
            value_sum if value_sum is not None else ws.mst, seq_lens if has_sl else ws.ast, starts if has_st else ws.ast,
            out.stride(0), out.stride(1), out.stride(2), geo["ns2"], S,
            HQ=Hq, G=geo["G"], D=D, BLOCK_D=geo["BLOCK_D"], BLOCK_S2=geo["BLOCK_S2"],
            RENORMALIZE=renormalize, WRITE_KEPT=want_kept, VMC=value_sum is not None,
            HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st, num_warps=4,
        )
        ws.sync[:2].zero_()  # no fused reduction to zero them (a test and tuning mode only)
    return out, kept
