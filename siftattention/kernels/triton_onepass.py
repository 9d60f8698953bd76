"""One-pass Triton kernel for the sift decode step with an anchored normaliser.

For each (batch b, query head h), over the valid keys ``[starts[b], seq_lens[b])`` with
scores ``s = scale * q.k``, the step keeps the keys with ``s > T``, where

    T = A + gap_prev + log(eta),   A = logsumexp(s over the anchor keys),

the anchors being the row's first ``first`` and newest ``last`` valid keys, ``gap_prev`` the
previous step's ``L - A`` (``L`` the exact log-sum-exp of the row) and
``log(eta) = log_alpha - beta * log_steps``. A NaN gap or ``log(eta) = -inf`` keeps every
valid key, ``log(eta) >= 0`` only the row maximum; the row's first maximum is always kept.
The output is ``sum_kept exp(s - L) v`` (divided by the kept mass with ``renormalize``),
plus the kept count per head, and this step's gap ``L - A`` is written over ``gap_prev``.

The exact filter ``p > eta`` needs ``L`` before any key can be judged, hence two passes over
K. Here ``A + gap_prev`` stands in for ``L``: each program scores the few anchor keys of its
row first, after which the threshold is known, so it streams its split of the row once,
flash-decoding style: K tile, scores of every query head of the GQA group, online exact
``(m, l)``, and V rows loaded only where some head of the group keeps the key. The last
program of each (batch, KV head) to finish merges the splits, writes the output, the kept
counts and the new gap. A head that kept nothing (``T`` at or above its maximum) gets its
first argmax there, from a rescan of K over the split that holds it, so the common case
pays nothing for it.

``OnePassPlan`` picks the geometry and allocates every scratch buffer once per shape; its
call only launches the kernel (no validation, no host synchronisation, no allocation that
depends on tensor values), so it can be captured in a CUDA graph. Calls that share a plan
must run one after another on one stream: they share the split partials and the arrival
counters (zeroed again by the last program of each row, so no memset is needed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .arguments import PowerLawThreshold, check_shape
from .triton_common import _INT_MAX, _dot, _group_query, _narrow, _row_range, _split_range, launch
from .triton_config import LOG2E, KernelConfig, _cdiv, _pow2, _regcap, config_for, geometry
from .triton_dense import _merge_chunk
from .triton_filter import _anchored_threshold, _gap

_F16_EXACT_TILES = 2048  # float16 lane counts are exact integers up to 2048


@dataclass(frozen=True)
class OnePassConfig:
    """Launch parameters of the one-pass kernel (defaults: the H200 measurements of onepass_bound.py).

    The split count is the dense kernel's (``triton_config.geometry(...)["nsd"]`` under ``dense``),
    doubled when there are fewer than 16 (batch, KV head) rows (``split_factor=0``), and never
    more than a full row's tiles; ``splits > 0`` fixes it instead.
    """

    block_n: int = 64  # keys per tile for 256-byte rows (D = 128 in 16 bits); wider rows get fewer
    warps: int = 4
    stages: int = 3
    split_factor: int = 0  # 0: 2 when batch * kv_heads < 16, else 1
    splits: int = 0  # > 0: exactly this many splits (capped by the tiles of a full row)
    # Register cap per thread for 16-bit caches (0: the compiler's choice; float32 plans take none;
    # -1: by split length, 160 where a split holds more than 4096 keys, else 168). Uncapped the
    # kernel takes 188-236 registers, two programs per SM; capped it runs three (H200, GQA 32/8,
    # s = 0.875, ratio to SDPA: B = 8, S = 32768: uncapped 1.30, 168 0.837, 160 0.817; B = 8,
    # S = 16384: 168 0.967, 160 0.992).
    maxnreg: int = -1
    evict: bool = True  # K and V tiles loaded evict-first
    dense: KernelConfig | None = None  # the dense kernel's config (None: config_for)

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"OnePassConfig.block_n must be a power of two >= 16, got {self.block_n}")
        for name in ("warps", "stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"OnePassConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("split_factor", "splits"):
            if getattr(self, name) < 0:
                raise ValueError(f"OnePassConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not (self.maxnreg in (-1, 0) or 24 <= self.maxnreg <= 255):
            raise ValueError(f"OnePassConfig.maxnreg must be -1 (by split length), 0 (no cap) or in 24..255, got {self.maxnreg}")


def _register_cap(maxnreg: int, dtype: torch.dtype, split_len: int) -> int:
    if dtype.itemsize != 2:
        return 0
    if maxnreg == -1:
        return 160 if split_len > 4096 else 168
    return maxnreg


def onepass_geometry(batch: int, q_heads: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device, cfg: OnePassConfig) -> dict:
    """Launch geometry of the one-pass kernel for one shape."""
    dense_cfg = cfg.dense or config_for(device)
    dgeo = geometry(batch, q_heads, kv_heads, max_len, head_dim, dtype, device, dense_cfg)
    G = q_heads // kv_heads
    rows = batch * kv_heads
    block_d = max(16, _pow2(head_dim))
    # As the shipped kernels: tiles of 256-byte rows; wider rows (D = 256, float32) get
    # proportionally fewer keys, so the pipelined K and V tiles fit in shared memory.
    shrink = max(1, (block_d * dtype.itemsize) // 256)
    block_n = max(16, cfg.block_n // shrink)
    tiles = _cdiv(max_len, block_n)
    if cfg.splits:
        splits = cfg.splits
    else:
        splits = dgeo["nsd"] * (cfg.split_factor or (2 if rows < 16 else 1))
    splits = min(max(splits, _cdiv(tiles, _F16_EXACT_TILES)), tiles)
    assert _cdiv(tiles, splits) <= _F16_EXACT_TILES, "float16 kept counts need <= 2048 tiles per split"
    block_ga = _pow2(G)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return dict(
        B=batch, Hq=q_heads, Hkv=kv_heads, S=max_len, D=head_dim, G=G, splits=splits,
        BLOCK_N=block_n, BLOCK_G=max(16, block_ga), BLOCK_GA=block_ga, BLOCK_D=block_d,
        # Splits per load in the combine: a [CH, G, D] float32 tile of about 4096 elements.
        CH=max(1, min(_pow2(splits), 4096 // (block_ga * block_d))),
        prec=dgeo["prec"], upcast=dgeo["upcast"], warps=cfg.warps, stages=cfg.stages,
        regs=_regcap(_register_cap(cfg.maxnreg, dtype, _cdiv(max_len, splits)), interp),
    )


# --------------------------------------------------------------------------- kernel


@triton.jit
def _tile_scores(q, k_base, offs, n_mask, stride_ks, stride_kd, offs_d, d_mask, qk_scale,
                 DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, EVICT: tl.constexpr):
    """log2-domain scores [BLOCK_G, BLOCK_N] of the keys at ``offs`` (-inf where masked)."""
    k = tl.load(k_base + offs[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
                mask=n_mask[:, None] & d_mask[None, :], other=0.0,
                eviction_policy="evict_first" if EVICT else "")
    s = _dot(q, tl.trans(k), DOT_PREC, DOT_UPCAST)
    return tl.where(n_mask[None, :], s * qk_scale, float("-inf"))


@triton.jit
def _lse_run(q, k_base, lo, hi, m, l, stride_ks, stride_kd, offs_d, d_mask, qk_scale,
             BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Online log2-sum-exp of the scores of keys [lo, hi), folded into (m, l)."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        s = _tile_scores(q, k_base, offs, offs < hi, stride_ks, stride_kd, offs_d, d_mask, qk_scale,
                         DOT_PREC, DOT_UPCAST, False)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.math.exp2(m - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    return m, l


@triton.jit
def _first_argmax(q, k_base, Mp, m, needy, row_c, begin, end, offs_g, offs_ga, offs_d, d_mask,
                  stride_ks, stride_kd, qk_scale, NUM_SPLITS,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
                  DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """First argmax position of each ``needy`` head (a [BLOCK_GA] tile), by rescanning K.

    The first split whose maximum equals the row maximum ``m`` holds it (splits are in
    position order); only the span of those splits is scored again, each head within its
    own split, with the main loop's tiles and score code.
    """
    offs_c = tl.arange(0, CH)
    jstar = tl.full(m.shape, _INT_MAX, tl.int32)
    for j0 in range(0, NUM_SPLITS, CH):
        js = j0 + offs_c
        pj = row_c[None, :] * NUM_SPLITS + js[:, None]  # [CH, GA]
        m2 = (js < NUM_SPLITS)[:, None] & needy[None, :]
        mj = tl.load(Mp + pj, mask=m2, other=float("-inf"), cache_modifier=".cg")
        hit = m2 & (mj == m[None, :])
        jstar = tl.minimum(jstar, tl.min(tl.where(hit, js[:, None], _INT_MAX), axis=0))
    # Onto the dot's head tile (padded heads: not needy, split 0).
    need_g = _narrow(needy.to(tl.int32), offs_ga, offs_g) > 0
    j_g = _narrow(tl.where(needy, jstar, 0), offs_ga, offs_g)
    lo_h, hi_h = _split_range(begin, end, j_g, NUM_SPLITS, BLOCK_N)
    r_lo = tl.min(tl.where(need_g, lo_h, _INT_MAX), axis=0)
    r_hi = tl.max(tl.where(need_g, hi_h, 0), axis=0)
    offs_n = tl.arange(0, BLOCK_N)
    m_r = tl.full([BLOCK_G], float("-inf"), tl.float32)
    a_r = tl.zeros([BLOCK_G], tl.int32)
    for n0 in range(r_lo, r_hi, BLOCK_N):
        offs = n0 + offs_n
        s = _tile_scores(q, k_base, offs, offs < r_hi, stride_ks, stride_kd, offs_d, d_mask, qk_scale,
                         DOT_PREC, DOT_UPCAST, False)
        own = need_g[:, None] & (offs[None, :] >= lo_h[:, None]) & (offs[None, :] < hi_h[:, None])
        s = tl.where(own, s, float("-inf"))
        m_blk = tl.max(s, axis=1)
        a_blk = tl.argmax(s, axis=1).to(tl.int32) + n0
        a_r = tl.where(m_blk > m_r, a_blk, a_r)  # strict: the first argmax
        m_r = tl.maximum(m_r, m_blk)
    return _narrow(a_r, offs_g, offs_ga)


@triton.jit
def _onepass_kernel(
    Q, K, V, LogAlpha, Beta, LogSteps, Gap, SeqLens, Starts, Part, Mp, Lp, Cnt, Mass, Sem, Out, Kept,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_od,
    qk_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, EVICT: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    """One split of one (batch, KV head), every query head of the group against one read of each K tile."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q, row, g_mask, d_mask = _group_query(Q, b, hkv, stride_qb, stride_qh, stride_qd, HQ, G, BLOCK_G, D, BLOCK_D)
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh

    # Anchors: the first FIRST and the newest LAST valid keys (all of a row shorter than both).
    m_a = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_a = tl.zeros([BLOCK_G], tl.float32)
    if FIRST > 0:
        m_a, l_a = _lse_run(q, k_base, begin, tl.minimum(begin + FIRST, end), m_a, l_a, stride_ks, stride_kd,
                            offs_d, d_mask, qk_scale, BLOCK_N, DOT_PREC, DOT_UPCAST)
    if LAST > 0:
        m_a, l_a = _lse_run(q, k_base, tl.maximum(begin + FIRST, end - LAST), end, m_a, l_a, stride_ks, stride_kd,
                            offs_d, d_mask, qk_scale, BLOCK_N, DOT_PREC, DOT_UPCAST)
    a2 = m_a + tl.math.log2(l_a)  # log2-domain anchor log-sum-exp

    # Every program reads the previous gap before its arrival below; only the last one to
    # arrive overwrites it.
    thr = _anchored_threshold(a2, Gap, LogAlpha, Beta, LogSteps, row, b, g_mask)

    lo, hi = _split_range(begin, end, split, NUM_SPLITS, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if RENORMALIZE:
        mass = tl.zeros([BLOCK_G], tl.float32)
    cnt = tl.zeros([BLOCK_G, BLOCK_N], tl.float16)  # per-lane kept counts, exact up to 2048 tiles
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        n_mask = offs < hi
        s = _tile_scores(q, k_base, offs, n_mask, stride_ks, stride_kd, offs_d, d_mask, qk_scale,
                         DOT_PREC, DOT_UPCAST, EVICT)
        keep = s > thr[:, None]
        cnt += keep.to(tl.float16)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        w = tl.where(keep, p, 0.0)
        rows_kept = tl.max(keep.to(tl.int32), axis=0) > 0
        v = tl.load(v_base + offs[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd,
                    mask=(n_mask & rows_kept)[:, None] & d_mask[None, :], other=0.0,
                    eviction_policy="evict_first" if EVICT else "")
        acc = acc * alpha[:, None] + _dot(w.to(v.dtype), v, DOT_PREC, DOT_UPCAST)
        if RENORMALIZE:
            mass = mass * alpha + tl.sum(w, axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    pst = row * NUM_SPLITS + split
    tl.store(Part + pst[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(Mp + pst, m_i, mask=g_mask)
    tl.store(Lp + pst, l_i, mask=g_mask)
    tl.store(Cnt + pst, tl.sum(cnt.to(tl.float32), axis=1).to(tl.int32), mask=g_mask)
    if RENORMALIZE:
        tl.store(Mass + pst, mass, mask=g_mask)
    tl.debug_barrier()  # every thread's stores (and the gap read) precede the release below
    done = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        tl.store(Sem + bh, 0)  # ready for the next call
        # Merge the splits on a G-row head tile, CH splits per load.
        offs_ga = tl.arange(0, BLOCK_GA)
        ga_mask = offs_ga < G
        row_c = b.to(tl.int64) * HQ + hkv * G + offs_ga
        m = tl.full([BLOCK_GA], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_GA], tl.float32)
        tot = tl.zeros([BLOCK_GA, BLOCK_D], tl.float32)
        tot_mass = tl.zeros([BLOCK_GA], tl.float32)
        kept = tl.zeros([BLOCK_GA], tl.int32)
        for j0 in range(0, NUM_SPLITS, CH):
            pj, m2, m, l, tot, alpha, wj = _merge_chunk(Part, Mp, Lp, row_c, j0, m, l, tot, ga_mask, offs_d,
                                                           NUM_SPLITS, BLOCK_D, CH)
            if RENORMALIZE:  # the kept mass merges as the sums do
                massj = tl.load(Mass + pj, mask=m2, other=0.0, cache_modifier=".cg")
                tot_mass = tot_mass * alpha + tl.sum(wj * massj, axis=0)
            kept += tl.sum(tl.load(Cnt + pj, mask=m2, other=0, cache_modifier=".cg"), axis=0)
        l = tl.where(ga_mask, l, 1.0)
        # This step's gap L - A (natural log), for the next step's threshold.
        a2_c = _narrow(a2, offs_g, offs_ga)
        tl.store(Gap + row_c, _gap(m, l, a2_c), mask=ga_mask)
        # Nothing passed T: keep the first argmax only. A row without keys (l = 0) keeps nothing: output 0.
        needy = (kept == 0) & ga_mask & (l > 0.0)
        if RENORMALIZE:
            denom = tot_mass
        else:
            denom = l
        res = tot / tl.where(needy | ~ga_mask | (l == 0.0), 1.0, denom)[:, None]
        if tl.max(needy.to(tl.int32), axis=0) > 0:
            amax = _first_argmax(q, k_base, Mp, m, needy, row_c, begin, end, offs_g, offs_ga, offs_d, d_mask,
                                 stride_ks, stride_kd, qk_scale, NUM_SPLITS, BLOCK_G, BLOCK_N, CH,
                                 DOT_PREC, DOT_UPCAST)
            v_top = tl.load(v_base + amax[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd,
                            mask=needy[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            if RENORMALIZE:
                res = tl.where(needy[:, None], v_top, res)
            else:
                res = tl.where(needy[:, None], v_top / l[:, None], res)  # p_max = exp2(m - m) / l
            kept = tl.where(needy, 1, kept)
        h_c = hkv * G + offs_ga
        tl.store(Out + b.to(tl.int64) * stride_ob + h_c[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 res.to(Out.dtype.element_ty), mask=ga_mask[:, None] & d_mask[None, :])
        tl.store(Kept + row_c, kept, mask=ga_mask)


# --------------------------------------------------------------------------- plan


class OnePassPlan:
    """The one-pass anchored sift step for one shape: geometry and scratch once, launched many times.

    ``config``: an ``OnePassConfig``, or a ``triton_config.KernelConfig`` (the dense
    kernel's, which sets the split count; one-pass defaults otherwise), or None.
    """

    def __init__(self, batch: int, q_heads: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, first: int, last: int,
                 config: OnePassConfig | KernelConfig | None = None) -> None:
        check_shape(batch, q_heads, kv_heads, max_len, head_dim, dtype)
        for name, v in (("first", first), ("last", last)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if isinstance(config, KernelConfig):
            config = OnePassConfig(evict=config.evict, dense=config)
        self.config = config or OnePassConfig()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.dtype, self.first, self.last = device, dtype, first, last
        geo = self.geometry = onepass_geometry(batch, q_heads, kv_heads, max_len, head_dim, dtype, device, self.config)
        ns, f32 = geo["splits"], torch.float32
        self.part = torch.empty(batch, q_heads, ns, geo["BLOCK_D"], device=device, dtype=f32)
        self.mp = torch.empty(batch, q_heads, ns, device=device, dtype=f32)
        self.lp = torch.empty(batch, q_heads, ns, device=device, dtype=f32)
        self.cnt = torch.empty(batch, q_heads, ns, device=device, dtype=torch.int32)
        self.mass = torch.empty(batch, q_heads, ns, device=device, dtype=f32)
        # Arrivals per (batch, KV head): the last program of each row sets its counter back to 0.
        self.sem = torch.zeros(batch * kv_heads, device=device, dtype=torch.int32)
        self.grid = (ns, batch * kv_heads)
        self._meta = dict(
            HQ=q_heads, HKV=kv_heads, G=geo["G"], BLOCK_G=geo["BLOCK_G"], BLOCK_GA=geo["BLOCK_GA"], D=head_dim,
            BLOCK_D=geo["BLOCK_D"], BLOCK_N=geo["BLOCK_N"], CH=geo["CH"], FIRST=first, LAST=last,
            DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"], EVICT=self.config.evict,
            num_warps=geo["warps"], num_stages=geo["stages"], **geo["regs"],
        )

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, threshold: PowerLawThreshold,
                 gap: torch.Tensor, scale: float, seq_lens: torch.Tensor | None, starts: torch.Tensor | None,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: out [B, Hq, D] in q's dtype and kept [B, Hq] int32; ``gap`` [B, Hq] float32 updated in place.

        Inputs are not checked: q [B, Hq, D]; caches [B, Hkv, max_len, D] of the planned dtype,
        any strides; ``threshold``'s tensors, ``gap``, ``seq_lens`` and ``starts`` (int32, or
        None) contiguous, with ``0 <= starts <= seq_lens <= max_len`` (an empty range: zeros, gap 0).
        """
        geo = self.geometry
        B, Hq, D = geo["B"], geo["Hq"], geo["D"]
        out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
        kept = torch.empty(B, Hq, device=q.device, dtype=torch.int32)
        log_alpha, beta, log_steps = threshold
        has_sl, has_st = seq_lens is not None, starts is not None
        launch(_onepass_kernel, self.grid,
            q, k_cache, v_cache, log_alpha, beta, log_steps, gap,
            seq_lens if has_sl else self.sem, starts if has_st else self.sem,
            self.part, self.mp, self.lp, self.cnt, self.mass, self.sem, out, kept,
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            out.stride(0), out.stride(1), out.stride(2),
            scale * LOG2E, geo["S"], geo["splits"],
            HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st, RENORMALIZE=bool(renormalize), **self._meta,
        )
        return out, kept

    def scratch_bytes(self) -> int:
        """Device memory the plan holds."""
        return sum(t.numel() * t.element_size() for t in (self.part, self.mp, self.lp, self.cnt, self.mass, self.sem))


__all__ = ["OnePassConfig", "OnePassPlan", "onepass_geometry"]
