"""Triton kernels for the sift decode step (backend="triton").

One query token per sequence, memory bound. The pipeline, per call:

1. ``_scores_kernel`` (split-K over the sequence, one program per (split, batch, KV
   head), all query heads of the GQA group together): reads every K row once,
   writes float32 scores in the log2 domain (``s2 = scale * log2(e) * q.k``, 4 bytes
   per key and query head, vs 2*D bytes of K per key) and per-split softmax
   statistics (max, sum of exp2, first argmax).
2. ``_quantile_kernel`` (warmup only, one program per (batch, query head)): exact
   tau-quantile of the probabilities by radix select over the order-preserving
   32-bit image of the float32 scores (no sort: 4 histogram passes of 8 bits and
   one pass for the next order statistic).
3. ``_filter_kernel`` (split-K): merges the split statistics into the row max ``M``
   and normaliser ``L``, turns eta into the log2-domain threshold
   ``M + log2(eta) + log2(L)``, compacts the positions of the rows that some head of
   the group keeps and gathers only those V rows (or streams with masked V loads
   when nothing is filtered). Partial outputs are already divided by ``L``, so
   splits add up: the last split program of each (batch, KV head) sums them,
   renormalises if asked and writes the output and the kept counts.
   (``_combine_kernel`` does that step as a separate launch when
   ``KernelConfig.fused_combine`` is off.) On Hopper the filter kernel is launched
   with programmatic dependent launch: it is dispatched during the scores kernel's
   tail and each program waits only for the splits of its own row (a counter the
   scores programs release), so the V gathers of finished rows overlap the last K
   reads.

K and V are loaded with an evict-first L2 policy and the scores stored evict-last, so the
filter pass tends to find them in L2. The two counters per (batch, KV head) that order
the passes (row arrivals, finished splits) live in one buffer per stream that the
filter kernel zeroes again at the end, so a call launches no memset.

Bytes moved at realized sparsity s: K + (rows some head of the group keeps) x V +
8 bytes of scores per key and query head (see benchmarks/NOTES_kernels.md).

No step reads a tensor value on the host, so the whole call can be captured in a
CUDA graph and eta can be computed on the device.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Programmatic dependent launch (Hopper+): the filter kernel is dispatched while the
# scores kernel drains, and each of its programs waits for its own row only.
try:
    from triton.language.extra.cuda import gdc_launch_dependents

    _HAS_PDL = True
except ImportError:  # older Triton
    _HAS_PDL = False
_INT_MAX = tl.constexpr(2147483647)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters; the defaults were tuned on an H100 (benchmarks/NOTES_kernels.md)."""

    block_n1: int = 128  # keys per iteration in the scores pass
    warps1: int = 4
    stages1: int = 3
    programs1: int = 64  # target programs per SM for the scores pass (sets the split)
    min_split1: int = 1024  # fewest keys per split
    block_n2: int = 32  # V rows per iteration in the filter pass
    warps2: int = 4
    stages2: int = 3
    programs2: int = 8
    min_split2: int = 4096
    fill: int = 2  # fewest programs per SM (overrides the minimum split length)
    # Tensor-core dot for QK and PV (heads padded to 16). Triton pipelines the loads
    # that feed a dot through shared memory (cp.async), so this is the default even
    # for MHA; the elementwise path loads to registers without prefetch.
    use_dot: bool = True
    compact: bool = True  # filter pass: gather compacted kept rows (see _filter_kernel)
    block_a: int = 1024  # fewest keys per iteration of the compaction scan
    scan_elems: int = 2048  # scan tile [G, keys] of at least this many elements (MHA: longer rows)
    dense_pct: int = 85  # stream instead of gather when more than this % of rows is kept
    fused_combine: bool = True  # last split program reduces (no separate combine launch)
    quantile_block: int = 4096
    quantile_warps: int = 8
    quantile_stages: int = 2
    # Programmatic dependent launch (Hopper+): the filter kernel starts during the scores
    # kernel's tail and each of its programs waits for its own row only.
    pdl: bool = True
    # L2 policy: K and V rows are read once (evict first); the float32 scores are read
    # again by the filter pass (evict last), so they may still be in L2 then.
    evict: bool = True
    # Reuse one zeroed counter buffer per stream (the filter kernel zeroes it again)
    # instead of a memset per call; needs fused_combine.
    reuse_sync: bool = True


_DEVICES: dict[int, tuple[int, bool]] = {}


def _device_info(device: torch.device) -> tuple[int, bool]:
    """(SM count, Hopper or newer) of a device, read once."""
    if device.type != "cuda":
        return 4, False  # interpreter: a few splits so tests exercise the combine step
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICES:
        props = torch.cuda.get_device_properties(idx)
        _DEVICES[idx] = (props.multi_processor_count, props.major >= 9)
    return _DEVICES[idx]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 / triton.cdiv are @jit functions, slow to call on the host.
    return 1 << max(0, (n - 1).bit_length())


def _split(
    s_max: int, rows: int, block_n: int, programs_per_sm: int, sms: int, min_len: int, fill: int
) -> tuple[int, int]:
    """(split length, number of splits).

    Aim for ``programs_per_sm`` programs per SM with splits of at least ``min_len``
    keys, but never fewer than ``fill`` programs per SM while the sequence allows
    (few rows, i.e. small batch or few KV heads, need short splits to fill the chip).
    """
    n_blocks = _cdiv(s_max, block_n)
    want = min(_cdiv(programs_per_sm * sms, rows), _cdiv(s_max, min_len))
    want = max(1, want, _cdiv(fill * sms, rows))
    splits = min(want, n_blocks)
    split_len = _cdiv(n_blocks, splits) * block_n
    return split_len, _cdiv(s_max, split_len)


@functools.lru_cache(maxsize=256)
def _plan(
    B: int, Hq: int, Hkv: int, S: int, D: int, dtype: torch.dtype, sms: int, hopper: bool, interp: bool, cfg: KernelConfig
) -> dict:
    """Launch geometry for one problem shape, computed once (host time matters at decode)."""
    G = Hq // Hkv
    split1, ns1 = _split(S, B * Hkv, cfg.block_n1, cfg.programs1, sms, cfg.min_split1, cfg.fill)
    split2, ns2 = _split(S, B * Hkv, cfg.block_n2, cfg.programs2, sms, cfg.min_split2, cfg.fill)
    return dict(
        B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, G=G, use_dot=cfg.use_dot,
        BLOCK_G=max(16, _pow2(G)) if cfg.use_dot else _pow2(G),
        BLOCK_GA=_pow2(G),
        BLOCK_A=max(cfg.block_a, cfg.scan_elems // _pow2(G)),
        BLOCK_D=max(16, _pow2(D)),
        prec="ieee" if dtype == torch.float32 else "tf32",
        upcast=dtype == torch.bfloat16 and interp,
        split1=split1, ns1=ns1, BLOCK_S1=_pow2(ns1), split2=split2, ns2=ns2, BLOCK_S2=_pow2(ns2),
        pdl=cfg.pdl and _HAS_PDL and hopper,
        reuse_sync=cfg.reuse_sync and cfg.fused_combine,
    )


# --------------------------------------------------------------------------- kernels


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: Triton's CPU interpreter (3.9) computes bf16 dots wrongly; fp32 is exact there.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _scores_kernel(
    Q, K, Scores, Mst, Lst, Ast, SeqLens, Arrive,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    qk_scale, S_MAX, SPLIT_LEN, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    PDL: tl.constexpr, EVICT: tl.constexpr,
):
    """Pass 1 over one split of one (batch, KV head): scores and split statistics."""
    if PDL:
        # The filter kernel may be dispatched once every program here has started; its
        # programs then wait for their own row's counter (Arrive), not for this grid.
        gdc_launch_dependents()
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    h = hkv * G + offs_g
    row = b.to(tl.int64) * HQ + h  # (batch, query head) row index into Scores / stats

    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if HAS_SEQ_LENS:
        seq_len = tl.minimum(tl.load(SeqLens + b), S_MAX)
    else:
        seq_len = S_MAX
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, seq_len)

    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    s_base = Scores + row[:, None] * S_MAX
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    a_i = tl.zeros([BLOCK_G], tl.int32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        n_mask = offs < end
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
    if PDL:
        tl.debug_barrier()  # every thread's scores and stats precede the release below
        tl.atomic_add(Arrive + bh, 1, sem="release", scope="gpu")


@triton.jit
def _row_stats(Mst, Lst, Ast, row, g_mask, NUM_SPLITS, BLOCK_S: tl.constexpr):
    """Merge per-split (max, sum, first argmax) into the row max M, normaliser L, argmax.

    One [heads, splits] tile load (a loop over the splits would serialise their
    load latencies in every program's preamble).
    """
    offs_s = tl.arange(0, BLOCK_S)
    ptr = row[:, None] * NUM_SPLITS + offs_s[None, :]
    msk = g_mask[:, None] & (offs_s[None, :] < NUM_SPLITS)
    mst = tl.load(Mst + ptr, mask=msk, other=float("-inf"))
    lst = tl.load(Lst + ptr, mask=msk, other=0.0)
    ast = tl.load(Ast + ptr, mask=msk, other=_INT_MAX)
    m = tl.max(mst, axis=1)
    m = tl.where(g_mask, m, 0.0)  # padded heads: keep arithmetic finite
    l = tl.sum(tl.where(msk, lst * tl.math.exp2(mst - m[:, None]), 0.0), axis=1)
    amax = tl.min(tl.where(mst == m[:, None], ast, _INT_MAX), axis=1)  # splits are in order
    return m, tl.where(g_mask, l, 1.0), amax


@triton.jit
def _thresholds(Mst, Lst, Ast, Eta, row, g_mask, NUM_SPLITS1, BLOCK_S1: tl.constexpr, KEEP_ALL: tl.constexpr):
    """Row max M, normaliser L, log2-domain threshold and argmax per head of the tile."""
    m, l, amax = _row_stats(Mst, Lst, Ast, row, g_mask, NUM_SPLITS1, BLOCK_S1)
    if KEEP_ALL:
        thr = tl.full(m.shape, float("-inf"), tl.float32)
    else:
        eta = tl.load(Eta + row, mask=g_mask, other=1.0)
        # p > eta  <=>  s2 > M + log2(eta) + log2(L)   (eta <= 0 gives -inf: keep all)
        thr = m + tl.math.log2(eta) + tl.math.log2(l)
    return m, l, thr, amax


@triton.jit
def _narrow(x, offs_from, offs_to):
    """Re-lay a per-head vector onto another head tile, bit-exactly (one term per sum)."""
    sel = offs_to[:, None] == offs_from[None, :]
    return tl.sum(tl.where(sel, x[None, :], tl.zeros_like(x)[None, :]), axis=1)


@triton.jit
def _accumulate(acc, mass, s, idx, jm, thr, amax, m, g_mask, v_ptrs, vmask, DOT_PREC, DOT_UPCAST, USE_DOT, EVICT):
    """Add the kept keys of one tile (scores s [G, N] at positions idx [N]) to acc / mass."""
    keep = ((s > thr[:, None]) | (idx[None, :] == amax[:, None])) & jm[None, :] & g_mask[:, None]
    w = tl.where(keep, tl.math.exp2(s - m[:, None]), 0.0)
    v = tl.load(v_ptrs, mask=vmask, other=0.0, eviction_policy="evict_first" if EVICT else "")
    if USE_DOT:
        acc += _dot(w.to(v.dtype), v, DOT_PREC, DOT_UPCAST)
    else:
        acc += tl.sum(w[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    return acc, mass + tl.sum(w, axis=1), tl.sum(keep.to(tl.int32), axis=1)


@triton.jit
def _filter_kernel(
    V, Scores, Mst, Lst, Ast, Eta, SeqLens, Idx, Part, Cnt, Mass, Sem, Arrive, Out, Kept,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh, stride_od,
    S_MAX, SPLIT_LEN, NUM_SPLITS1, NUM_SPLITS2,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
    BLOCK_S1: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KEEP_ALL: tl.constexpr, COMPACT: tl.constexpr, DENSE_PCT: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, RESET_SYNC: tl.constexpr, RENORMALIZE: tl.constexpr, WRITE_KEPT: tl.constexpr,
    PDL: tl.constexpr, EVICT: tl.constexpr,
):
    """Pass 2 over one split of one (batch, KV head).

    Streaming mode reads the split's scores tile by tile and masks the V loads; its
    loop carries a score load -> dependent V load chain, so at high sparsity it is
    latency bound (few useful bytes per iteration). Compact mode first writes the
    positions of the rows some head keeps to ``Idx`` (prefix sum per tile, on a head
    tile of G rows, not the 16 the dot needs), then gathers only those V rows,
    BLOCK_N useful rows per iteration. Rows where every eta <= 0 (nothing to filter)
    and splits kept above DENSE_PCT percent stream.

    With FUSED_COMBINE the last split program of each (batch, KV head) to finish
    (a counter in ``Sem``) sums the split partials and writes the output, which
    saves the separate combine launch.
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

    m, l, thr, amax = _thresholds(Mst, Lst, Ast, Eta, row, g_mask, NUM_SPLITS1, BLOCK_S1, KEEP_ALL)
    if HAS_SEQ_LENS:
        seq_len = tl.minimum(tl.load(SeqLens + b), S_MAX)
    else:
        seq_len = S_MAX
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, seq_len)

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
            sa_base = Scores + row_a[:, None] * S_MAX
            idx_ptr = Idx + bh.to(tl.int64) * S_MAX + start
            offs_a = tl.arange(0, BLOCK_A)
            cnt_a = tl.zeros([BLOCK_GA], tl.int32)
            n_kept = start * 0
            # Not software-pipelined: prefetching the score tiles made GQA ~5% slower.
            for n0 in tl.range(start, end, BLOCK_A, num_stages=1):
                offs = n0 + offs_a
                n_mask = offs < end
                s = tl.load(sa_base + offs[None, :], mask=ga_mask[:, None] & n_mask[None, :], other=float("-inf"))
                keep = ((s > thr_a[:, None]) | (offs[None, :] == amax_a[:, None])) & n_mask[None, :] & ga_mask[:, None]
                cnt_a += tl.sum(keep.to(tl.int32), axis=1)
                rk = tl.max(keep.to(tl.int32), axis=0)
                pos = tl.cumsum(rk, axis=0) - rk
                tl.store(idx_ptr + n_kept + pos, offs, mask=rk > 0)
                n_kept += tl.sum(rk, axis=0)
            tl.debug_barrier()  # Idx written by this program's threads, read back below
            dense = n_kept * 100 > (end - start) * DENSE_PCT
            if not dense:
                # Phase B: gather the kept rows, all useful, BLOCK_N per iteration.
                for j in range(0, n_kept, BLOCK_N):
                    jj = j + offs_n
                    jm = jj < n_kept
                    idx = tl.load(idx_ptr + jj, mask=jm, other=0)
                    s = tl.load(s_base + idx[None, :], mask=g_mask[:, None] & jm[None, :], other=float("-inf"))
                    v_ptrs = v_base + idx[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd
                    acc, mass, _ = _accumulate(
                        acc, mass, s, idx, jm, thr, amax, m, g_mask, v_ptrs, jm[:, None] & d_mask[None, :],
                        DOT_PREC, DOT_UPCAST, USE_DOT, EVICT,
                    )
                tl.store(Cnt + row_a * NUM_SPLITS2 + split, cnt_a, mask=ga_mask)
    if dense:
        # Streaming: every tile, V loads masked to the rows some head keeps.
        cnt = tl.zeros([BLOCK_G], tl.int32)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + offs_n
            n_mask = offs < end
            s = tl.load(s_base + offs[None, :], mask=g_mask[:, None] & n_mask[None, :], other=float("-inf"))
            row_kept = tl.max(((s > thr[:, None]) | (offs[None, :] == amax[:, None])).to(tl.int32), axis=0) > 0
            v_ptrs = v_base + offs[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd
            acc, mass, c = _accumulate(
                acc, mass, s, offs, n_mask, thr, amax, m, g_mask, v_ptrs,
                (row_kept & n_mask)[:, None] & d_mask[None, :], DOT_PREC, DOT_UPCAST, USE_DOT, EVICT,
            )
            cnt += c
        tl.store(Cnt + pst, cnt, mask=g_mask)

    inv_l = 1.0 / l
    tl.store(Part + pst[:, None] * BLOCK_D + offs_d[None, :], acc * inv_l[:, None], mask=g_mask[:, None])
    tl.store(Mass + pst, mass * inv_l, mask=g_mask)
    if FUSED_COMBINE:
        tl.debug_barrier()  # every thread's partial stores precede the release below
        done = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS2 - 1:
            if RESET_SYNC:
                # Every program of this row has passed its wait and its count: zero both
                # counters for the next call (saves a memset launch per call).
                tl.store(Sem + bh, 0)
                tl.store(Arrive + bh, 0)
            tot = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            tot_mass = tl.zeros([BLOCK_G], tl.float32)
            kept = tl.zeros([BLOCK_G], tl.int32)
            for j in range(NUM_SPLITS2):
                pj = row * NUM_SPLITS2 + j
                tot += tl.load(Part + pj[:, None] * BLOCK_D + offs_d[None, :], mask=g_mask[:, None], other=0.0,
                               cache_modifier=".cg")
                tot_mass += tl.load(Mass + pj, mask=g_mask, other=0.0, cache_modifier=".cg")
                kept += tl.load(Cnt + pj, mask=g_mask, other=0, cache_modifier=".cg")
            if RENORMALIZE:
                tot = tot / tot_mass[:, None]
            h = hkv * G + offs_g
            tl.store(
                Out + b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
                tot.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
            )
            if WRITE_KEPT:
                tl.store(Kept + row, kept, mask=g_mask)


@triton.jit
def _combine_kernel(
    Part, Cnt, Mass, Out, Kept,
    stride_ob, stride_oh, stride_od,
    NUM_SPLITS2,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S2: tl.constexpr,
    RENORMALIZE: tl.constexpr, WRITE_KEPT: tl.constexpr,
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
    if RENORMALIZE:
        out = out / tl.sum(tl.load(Mass + row * NUM_SPLITS2 + offs_s, mask=s_mask, other=0.0), axis=0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d * stride_od,
        out.to(Out.dtype.element_ty), mask=offs_d < D,
    )
    if WRITE_KEPT:
        kept = tl.sum(tl.load(Cnt + row * NUM_SPLITS2 + offs_s, mask=s_mask, other=0), axis=0)
        tl.store(Kept + row, kept)


@triton.jit
def _ukey(x):
    """Order-preserving map float32 -> uint32: flip all bits of negatives, the sign of positives."""
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    return tl.where(neg, ~bits, bits | 0x80000000)


@triton.jit
def _ukey_float(key):
    neg = (key >> 31) == 0
    return tl.where(neg, ~key, key & 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _quantile_kernel(
    Scores, Mst, Lst, Ast, Tau, SeqLens, Theta,
    S_MAX, NUM_SPLITS1,
    HQ: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S1: tl.constexpr, HAS_SEQ_LENS: tl.constexpr,
    STAGES: tl.constexpr,
):
    """theta = tau-quantile of one row's probabilities, torch.quantile's 'linear' rule.

    Radix select, no sort: the k-th smallest score (k = floor(tau * (n - 1))) is
    found exactly, 8 bits of its order-preserving 32-bit key per pass (MSB first):
    each pass histograms the next digit of the keys that share the digits found so
    far and picks the bucket holding rank k. A fifth pass finds the next order
    statistic (a tie, or the least larger key). Probabilities are monotone in the
    scores, so interpolating exp2(s - M) / L at the two order statistics is the
    quantile of p.
    """
    row = tl.program_id(0).to(tl.int64)
    b = row // HQ
    one = tl.full([1], 0, tl.int32) == 0  # [1]-shaped head mask for the shared helper
    m, l, _ = _row_stats(Mst, Lst, Ast, tl.full([1], 0, tl.int64) + row, one, NUM_SPLITS1, BLOCK_S1)
    m = tl.sum(m, axis=0)
    l = tl.sum(l, axis=0)
    if HAS_SEQ_LENS:
        n = tl.minimum(tl.load(SeqLens + b), S_MAX)
    else:
        n = S_MAX
    tau = tl.load(Tau + row)  # float64, so that tau * (n - 1) matches the reference
    pos = tau * (n - 1).to(tl.float64)
    kf = tl.floor(pos)
    frac = (pos - kf).to(tl.float32)
    rank = kf.to(tl.int32)  # rank of the wanted key among those matching the prefix

    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    s_row = Scores + row * S_MAX
    prefix = (n * 0).to(tl.uint32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # constexpr: p is a static_range index
        hist = tl.zeros([256], tl.int32)
        for n0 in tl.range(0, n, BLOCK, num_stages=STAGES):
            idx = n0 + offs
            valid = idx < n
            u = _ukey(tl.load(s_row + idx, mask=valid, other=0.0))
            if p > 0:
                valid = valid & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            digit = ((u >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=valid)
        csum = tl.cumsum(hist, axis=0)
        d = tl.sum((csum <= rank).to(tl.int32), axis=0)  # first bucket whose cumsum passes rank
        rank -= tl.max(tl.where(csum <= rank, csum, 0), axis=0)
        n_in = tl.sum(tl.where(bins == d, hist, 0), axis=0)  # keys in that bucket
        prefix = prefix | (d.to(tl.uint32) << shift)

    t = prefix
    t_hi = t
    if rank + 1 >= n_in:  # the (k+1)-th is not a tie with the k-th: least larger key
        nxt = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
        for n0 in tl.range(0, n, BLOCK, num_stages=STAGES):
            idx = n0 + offs
            valid = idx < n
            u = _ukey(tl.load(s_row + idx, mask=valid, other=0.0))
            nxt = tl.minimum(nxt, tl.where(valid & (u > t), u, 0xFFFFFFFF))
        nxt_t = tl.min(nxt, axis=0)
        t_hi = tl.where(nxt_t == 0xFFFFFFFF, t, nxt_t)  # none when k = n - 1
    inv_l = 1.0 / l
    p_lo = tl.math.exp2(_ukey_float(t) - m) * inv_l
    p_hi = tl.math.exp2(_ukey_float(t_hi) - m) * inv_l
    tl.store(Theta + row, p_lo + frac * (p_hi - p_lo))


# --------------------------------------------------------------------------- launchers


def _meta(q: torch.Tensor, k_cache: torch.Tensor, cfg: KernelConfig) -> dict:
    B, Hq, D = q.shape
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return _plan(B, Hq, k_cache.shape[1], k_cache.shape[2], D, q.dtype, *_device_info(q.device), interp, cfg)


_SYNC: dict[tuple, torch.Tensor] = {}


def _sync_counters(dev: torch.device, rows: int) -> torch.Tensor:
    """Zeroed [2, rows] int32 counters, one buffer per (device, stream, rows).

    The filter kernel's last program of each row sets them back to zero, so a call
    needs no memset. Calls on one stream run in order; a buffer per stream keeps
    concurrent streams apart. A CUDA graph keeps the buffer of the stream it was
    captured on: graphs captured on one stream must be replayed one at a time.
    """
    key = (dev, torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0, rows)
    buf = _SYNC.get(key)
    if buf is None:
        buf = _SYNC[key] = torch.zeros(2, rows, device=dev, dtype=torch.int32)
    return buf


def scores_pass(q, k_cache, scale, seq_lens, cfg: KernelConfig, reuse_sync: bool = False) -> dict:
    """Pass 1: float32 log2-domain scores [B, Hq, S] and per-split softmax statistics.

    ``reuse_sync``: take the stream's reusable counters (only when a fused filter pass
    follows, which zeroes them again).
    """
    mt = _meta(q, k_cache, cfg)
    B, Hq, Hkv, S = mt["B"], mt["Hq"], mt["Hkv"], mt["S"]
    dev = q.device
    split1, ns1 = mt["split1"], mt["ns1"]
    reuse = reuse_sync and mt["reuse_sync"]
    st = dict(
        meta=mt, ns1=ns1,
        scores=torch.empty(B, Hq, S, device=dev, dtype=torch.float32),
        mst=torch.empty(B, Hq, ns1, device=dev, dtype=torch.float32),
        lst=torch.empty(B, Hq, ns1, device=dev, dtype=torch.float32),
        ast=torch.empty(B, Hq, ns1, device=dev, dtype=torch.int32),
        # Counters (combine, row arrivals), zeroed before pass 1: a memset between the two
        # kernels would break the PDL chain.
        sync=_sync_counters(dev, B * Hkv) if reuse else torch.zeros(2, B * Hkv, device=dev, dtype=torch.int32),
        reset_sync=reuse,
        pdl=mt["pdl"],
    )
    st["sem"], st["arrive"] = st["sync"]
    has_sl = seq_lens is not None
    _scores_kernel[(ns1, B * Hkv)](
        q, k_cache, st["scores"], st["mst"], st["lst"], st["ast"], seq_lens if has_sl else q, st["arrive"],
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        scale * LOG2E, S, split1, ns1,
        HQ=Hq, HKV=Hkv, G=mt["G"], BLOCK_G=mt["BLOCK_G"], D=mt["D"], BLOCK_D=mt["BLOCK_D"],
        BLOCK_N=cfg.block_n1, HAS_SEQ_LENS=has_sl, USE_DOT=mt["use_dot"], DOT_PREC=mt["prec"], DOT_UPCAST=mt["upcast"],
        PDL=st["pdl"], EVICT=cfg.evict, num_warps=cfg.warps1, num_stages=cfg.stages1,
    )
    return st


def quantile_pass(st: dict, tau: torch.Tensor, seq_lens, cfg: KernelConfig) -> torch.Tensor:
    """Warmup: theta [B, Hq] from the stored scores (run right after pass 1: L2-hot)."""
    mt = st["meta"]
    theta = torch.empty(mt["B"], mt["Hq"], device=tau.device, dtype=torch.float32)
    has_sl = seq_lens is not None
    _quantile_kernel[(mt["B"] * mt["Hq"],)](
        st["scores"], st["mst"], st["lst"], st["ast"], tau, seq_lens if has_sl else tau, theta,
        mt["S"], st["ns1"],
        HQ=mt["Hq"], BLOCK=cfg.quantile_block, BLOCK_S1=mt["BLOCK_S1"],
        HAS_SEQ_LENS=has_sl, STAGES=cfg.quantile_stages, num_warps=cfg.quantile_warps,
    )
    return theta


def filter_pass(
    st: dict, v_cache, eta, seq_lens, cfg: KernelConfig, out_dtype: torch.dtype, renormalize: bool, want_kept: bool
) -> dict:
    """Pass 2: threshold, compaction, V gather; with cfg.fused_combine also the output."""
    mt = st["meta"]
    B, Hq, Hkv, S, D = mt["B"], mt["Hq"], mt["Hkv"], mt["S"], mt["D"]
    dev = v_cache.device
    split2, ns2 = mt["split2"], mt["ns2"]
    compact = cfg.compact and eta is not None
    fused = cfg.fused_combine
    pt = dict(
        ns2=ns2,
        idx=torch.empty(B * Hkv, S, device=dev, dtype=torch.int32) if compact else st["ast"],
        part=torch.empty(B, Hq, ns2, mt["BLOCK_D"], device=dev, dtype=torch.float32),
        cnt=torch.empty(B, Hq, ns2, device=dev, dtype=torch.int32),
        mass=torch.empty(B, Hq, ns2, device=dev, dtype=torch.float32),
        out=torch.empty(B, Hq, D, device=dev, dtype=out_dtype) if fused else None,
        kept=torch.empty(B, Hq, device=dev, dtype=torch.int32) if fused and want_kept else None,
    )
    out = pt["out"] if fused else pt["part"]
    has_sl = seq_lens is not None
    _filter_kernel[(ns2, B * Hkv)](
        v_cache, st["scores"], st["mst"], st["lst"], st["ast"], eta if eta is not None else st["mst"],
        seq_lens if has_sl else st["mst"], pt["idx"], pt["part"], pt["cnt"], pt["mass"], st["sem"], st["arrive"],
        out, pt["kept"] if pt["kept"] is not None else pt["cnt"],
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        S, split2, st["ns1"], ns2,
        HQ=Hq, HKV=Hkv, G=mt["G"], BLOCK_G=mt["BLOCK_G"], BLOCK_GA=mt["BLOCK_GA"], D=D, BLOCK_D=mt["BLOCK_D"],
        BLOCK_N=cfg.block_n2, BLOCK_A=mt["BLOCK_A"], BLOCK_S1=mt["BLOCK_S1"], HAS_SEQ_LENS=has_sl,
        USE_DOT=mt["use_dot"], DOT_PREC=mt["prec"], DOT_UPCAST=mt["upcast"], KEEP_ALL=eta is None,
        COMPACT=compact, DENSE_PCT=cfg.dense_pct,
        FUSED_COMBINE=fused, RESET_SYNC=st["reset_sync"], RENORMALIZE=renormalize, WRITE_KEPT=want_kept,
        PDL=st["pdl"], EVICT=cfg.evict, num_warps=cfg.warps2, num_stages=cfg.stages2,
        **({"launch_pdl": True} if st["pdl"] else {}),
    )
    return pt


def combine_pass(st: dict, pt: dict, out_dtype: torch.dtype, renormalize: bool, want_kept: bool):
    mt = st["meta"]
    B, Hq, D = mt["B"], mt["Hq"], mt["D"]
    dev = pt["part"].device
    out = torch.empty(B, Hq, D, device=dev, dtype=out_dtype)
    kept = torch.empty(B, Hq, device=dev, dtype=torch.int32) if want_kept else None
    _combine_kernel[(B * Hq,)](
        pt["part"], pt["cnt"], pt["mass"], out, kept if want_kept else pt["cnt"],
        out.stride(0), out.stride(1), out.stride(2), pt["ns2"],
        HQ=Hq, D=D, BLOCK_D=mt["BLOCK_D"], BLOCK_S2=mt["BLOCK_S2"],
        RENORMALIZE=renormalize, WRITE_KEPT=want_kept, num_warps=4,
    )
    return out, kept


def _filter_or_reset(st: dict, *args, **kwargs) -> dict:
    """filter_pass; if it fails to launch, zero the reused counters the scores pass advanced."""
    try:
        return filter_pass(st, *args, **kwargs)
    except BaseException:
        if st["reset_sync"]:
            st["sync"].zero_()
        raise


_DEFAULT = KernelConfig()


def sift_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eta: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    renormalize: bool,
    cfg: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs already validated by :func:`siftattention.kernels.sift_decode`."""
    cfg = cfg or _DEFAULT
    st = scores_pass(q, k_cache, scale, seq_lens, cfg, reuse_sync=True)
    pt = _filter_or_reset(st, v_cache, eta, seq_lens, cfg, q.dtype, renormalize, want_kept=True)
    if cfg.fused_combine:
        return pt["out"], pt["kept"]
    return combine_pass(st, pt, q.dtype, renormalize, want_kept=True)


def sift_warmup_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tau: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    cfg: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact output plus theta; ``tau`` is a float64 [B, Hq] tensor."""
    cfg = cfg or _DEFAULT
    st = scores_pass(q, k_cache, scale, seq_lens, cfg, reuse_sync=True)
    theta = quantile_pass(st, tau, seq_lens, cfg)
    pt = _filter_or_reset(st, v_cache, None, seq_lens, cfg, q.dtype, False, want_kept=False)
    out = pt["out"] if cfg.fused_combine else combine_pass(st, pt, q.dtype, False, want_kept=False)[0]
    return out, theta


__all__ = ["KernelConfig", "sift_decode_triton", "sift_warmup_decode_triton", "LOG2E"]
