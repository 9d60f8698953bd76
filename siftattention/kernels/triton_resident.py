"""The sift decode step in one launch for grids that fit on the chip at once (small batches).

At B = 1 the two-pass step (``triton_decode.sparse``) is latency bound: each pass is a chain
of dependent loads over a few short splits, and the filter pass waits for the whole scores
pass before it can judge a key (the exact threshold needs the row's log-sum-exp). Here each
program takes one split of at most ``max keys`` keys and:

1. scores it against every query head of the KV group as one [heads, keys] tile, a small
   matrix product over feature chunks of K (``BLOCK_DC`` features a load, pipelined), and
   keeps the scores in registers;
2. publishes the split's (max, sum of exp2, first argmax) and meets the row's other
   programs at a counter (every program of the grid is resident, so none waits for a
   program that cannot start);
3. merges the row's statistics into the exact threshold ``M + log2(eta) + log2(L)`` and
   weighs its own scores, then reads only the V rows some head keeps, feature chunk by
   feature chunk, each chunk's output written as a partial already divided by ``L``;
4. the last program of the row sums the partials (``triton_decode._sum_splits``).

K is read once and no score goes through memory. The meeting needs every program of the
grid resident at once: the plan (``triton_decode._plan``, keys ``rs`` / ``RS_N``) sizes the grid
to a few programs per SM and launches it cooperatively, so that the driver refuses a grid that
cannot be resident (the step then warns once and runs as two launches). Elsewhere, and under
Triton's interpreter (which runs programs one at a time), the same kernel runs as two
launches: the first publishes the statistics, the second scores the split again and
filters, so the interpreter tests check the arithmetic of the one-launch form.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from . import triton_decode as td
from .plan import PowerLawThreshold

_INT_MAX = tl.constexpr(2147483647)


@triton.jit
def _feature_mask(offs_dc, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """[1, chunk] mask of the real features. All true where D fills BLOCK_D: a mask the compiler
    cannot see is constant along a row (the chunk start is a loop variable) would cut every
    row's load into 2-byte pieces."""
    if D == BLOCK_D:
        return tl.full([1, offs_dc.shape[0]], 1, tl.int1)
    else:
        return (offs_dc < D)[None, :]


@triton.jit
def _split_scores(Q, k_base, b, hkv, offs, n_mask, stride_qb, stride_qh, stride_qd, stride_ks, stride_kd, qk_scale,
                  HQ: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DC: tl.constexpr, SPLIT_N: tl.constexpr, STAGES: tl.constexpr, DOT_PREC: tl.constexpr,
                  DOT_UPCAST: tl.constexpr, EVICT: tl.constexpr):
    """log2-domain scores [BLOCK_G, keys] of the keys at ``offs`` (-inf where masked), summed over
    feature chunks so that each K load is a [keys, BLOCK_DC] tile the pipeliner can prefetch."""
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < G
    h = hkv * G + offs_g
    q_base = Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh
    k_rows = k_base + offs[:, None].to(tl.int64) * stride_ks
    s = tl.zeros([BLOCK_G, SPLIT_N], tl.float32)
    for d0 in tl.range(0, BLOCK_D, BLOCK_DC, num_stages=STAGES):
        offs_dc = d0 + tl.arange(0, BLOCK_DC)
        q = tl.load(q_base + offs_dc[None, :] * stride_qd, mask=g_mask[:, None] & _feature_mask(offs_dc, D, BLOCK_D),
                    other=0.0)
        k = tl.load(k_rows + offs_dc[None, :] * stride_kd, mask=n_mask[:, None] & _feature_mask(offs_dc, D, BLOCK_D),
                    other=0.0, eviction_policy="evict_first" if EVICT else "")
        s += td._dot(q, tl.trans(k), DOT_PREC, DOT_UPCAST)
    # Scale after the fp32 dot, as the other kernels do.
    return tl.where(n_mask[None, :], s * qk_scale, float("-inf"))


@triton.jit
def _resident_kernel(
    Q, K, V, Mst, Lst, Ast, Eta, Beta, LogSteps, SeqLens, Starts, Part, Cnt, Mass, Sem, Arrive, Out, Kept,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_od,
    qk_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_S: tl.constexpr,
    CH: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    POWER_LAW: tl.constexpr, RENORMALIZE: tl.constexpr, EVICT: tl.constexpr, PHASE: tl.constexpr,
):
    """One split of one (batch, KV head). PHASE 0: the whole step, meeting the row's programs at
    ``Arrive``; PHASE 1: scores and statistics only; PHASE 2: scores again, then the filter (the
    two-launch form: the launch boundary stands in for the meeting)."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < G
    offs_d = tl.arange(0, BLOCK_D)
    row = b.to(tl.int64) * HQ + hkv * G + offs_g
    begin, end_row = td._row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    # The split's keys as in the filter pass: interleaved runs of CHUNK keys (0: one range).
    _, n_virt, base, stride, end = td._split_span(begin, end_row, split, NUM_SPLITS, 64, CHUNK)
    u = tl.arange(0, SPLIT_N)
    offs = td._split_pos(u, base, stride, CHUNK, SPLIT_N)
    n_mask = (u < n_virt) & (offs < end)
    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    s = _split_scores(Q, k_base, b, hkv, offs, n_mask, stride_qb, stride_qh, stride_qd, stride_ks, stride_kd, qk_scale,
                      HQ, G, BLOCK_G, D, BLOCK_D, BLOCK_DC, SPLIT_N, STAGES, DOT_PREC, DOT_UPCAST, EVICT)
    st = row * NUM_SPLITS + split
    if PHASE != 2:
        m_s = tl.max(s, axis=1)
        m_safe = tl.where(m_s == float("-inf"), 0.0, m_s)
        l_s = tl.sum(tl.math.exp2(s - m_safe[:, None]), axis=1)
        a_s = tl.min(tl.where(s == m_s[:, None], offs[None, :], _INT_MAX), axis=1)  # the split's first argmax
        tl.store(Mst + st, m_s, mask=g_mask)
        tl.store(Lst + st, l_s, mask=g_mask)
        tl.store(Ast + st, a_s, mask=g_mask)
    if PHASE == 0:
        td._row_meet(Arrive + bh, NUM_SPLITS)
    if PHASE != 1:
        m, l, thr, amax = td._thresholds(Mst, Lst, Ast, Eta, Beta, LogSteps, row, b, g_mask, NUM_SPLITS, BLOCK_S,
                                         False, POWER_LAW)
        keep = ((s > thr[:, None]) | (offs[None, :] == amax[:, None])) & n_mask[None, :] & g_mask[:, None]
        inv_l = 1.0 / l
        w = tl.where(keep, tl.math.exp2(s - m[:, None]), 0.0)
        tl.store(Cnt + st, tl.sum(keep.to(tl.int32), axis=1), mask=g_mask)
        tl.store(Mass + st, tl.sum(w, axis=1) * inv_l, mask=g_mask)
        row_kept = tl.max(keep.to(tl.int32), axis=0) > 0
        w = w.to(V.dtype.element_ty)
        v_rows = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh + offs[:, None].to(tl.int64) * stride_vs
        part = Part + st[:, None] * BLOCK_D
        # Each feature chunk of the output is its own product: no sum runs across the chunks.
        for d0 in tl.range(0, BLOCK_D, BLOCK_DC, num_stages=STAGES):
            offs_dc = d0 + tl.arange(0, BLOCK_DC)
            v = tl.load(v_rows + offs_dc[None, :] * stride_vd, mask=row_kept[:, None] & _feature_mask(offs_dc, D, BLOCK_D),
                        other=0.0, eviction_policy="evict_first" if EVICT else "")
            acc = td._dot(w, v, DOT_PREC, DOT_UPCAST)
            tl.store(part + offs_dc[None, :], acc * inv_l[:, None], mask=g_mask[:, None])
        tl.debug_barrier()  # every thread's partial stores precede the release below
        done = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            # Every program of the row has passed its meeting: both counters back to zero.
            tl.store(Sem + bh, 0)
            tl.store(Arrive + bh, 0)
            td._sum_splits(Part, Cnt, Mass, Out, Kept, b, hkv, stride_ob, stride_oh, stride_od, NUM_SPLITS,
                           HQ, G, BLOCK_GA, BLOCK_D, CH, offs_d < D, RENORMALIZE, True)


def sparse(geo: dict, ws: "td.Workspace", q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           eta: torch.Tensor | PowerLawThreshold, scale: float, seq_lens: torch.Tensor | None,
           starts: torch.Tensor | None, renormalize: bool, cfg: "td.KernelConfig") -> tuple[torch.Tensor, torch.Tensor]:
    """One sift decode step (out, kept) on the plan's resident geometry: one launch where the
    grid fits on the chip (``geo["RONE"]``), else the two-launch form."""
    B, Hq, Hkv, S, D = geo["B"], geo["Hq"], geo["Hkv"], geo["S"], geo["D"]
    power_law = isinstance(eta, PowerLawThreshold)
    if power_law:
        eta_arg, beta_arg, log_steps_arg = eta
    else:  # unused pointers get any float32 buffer
        eta_arg, beta_arg, log_steps_arg = eta, ws.r_mst, ws.r_mst
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    kept = torch.empty(B, Hq, device=q.device, dtype=torch.int32)
    has_sl, has_st = seq_lens is not None, starts is not None
    args = (
        q, k_cache, v_cache, ws.r_mst, ws.r_lst, ws.r_ast, eta_arg, beta_arg, log_steps_arg,
        seq_lens if has_sl else ws.r_ast, starts if has_st else ws.r_ast,
        ws.r_part, ws.r_cnt, ws.r_mass, ws.sem, ws.arrive, out, kept,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        scale * td.LOG2E, S, geo["rs"],
    )
    meta = dict(
        HQ=Hq, HKV=Hkv, G=geo["G"], BLOCK_G=max(16, geo["BLOCK_GA"]), BLOCK_GA=geo["BLOCK_GA"], D=D,
        BLOCK_D=geo["BLOCK_D"], BLOCK_DC=geo["RS_DC"], SPLIT_N=geo["RS_N"], BLOCK_S=td._pow2(geo["rs"]),
        CH=geo["CHR"], CHUNK=geo["CHUNKR"], STAGES=cfg.resident_stages, HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st,
        DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"], POWER_LAW=power_law, RENORMALIZE=renormalize,
        EVICT=cfg.evict, num_warps=cfg.resident_warps,
    )
    grid = (geo["rs"], B * Hkv)
    if geo["RONE"] and not ws.resident_refused:
        try:
            _resident_kernel[grid](*args, PHASE=0, launch_cooperative_grid=True, **meta)
            return out, kept
        except RuntimeError as e:  # the driver found the grid cannot be resident at once
            if "cooperative" not in str(e):
                raise
            ws.resident_refused = True
            warnings.warn(f"siftattention: the one-launch sparse step does not fit on this device ({e}); "
                          "running it as two launches", RuntimeWarning, stacklevel=2)
    _resident_kernel[grid](*args, PHASE=1, **meta)
    _resident_kernel[grid](*args, PHASE=2, **meta)
    return out, kept
