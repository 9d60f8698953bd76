"""Tests for siftattention.kernels (decode step, warmup quantile).

The torch backend is checked here against an independent float64 reference. The
Triton kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1) in
subprocesses, so that the interpreter setting never leaks into this process; each
subprocess is this file run as a script and returns its measurements as JSON.

Every interpreted case and kernel configuration runs in ``make test``, against float64.
``SIFT_FULL_KERNEL_TESTS=1`` adds:

- the quantile's sampled bracket at its production sizes (256 and 512 keys), whose sort costs
  the interpreter about 1.5 s a row. By default the warmup steps sort 32-key samples with
  the margin scaled alike, and the radix-select check takes 32-key samples whose margins
  miss as the full list's do (``SMALL``, ``radix_select_variants``; docs/kernels.md);
- the edge thresholds (one key, every key) of the Triton sparse step with both renormalize
  settings: by default each case runs "one" without and "all" with renormalisation, and
  "some" with both (``DECODE_RENORMS``);
- the power-law thresholds of the planned Triton steps with renormalize=True too, and the
  full ranges (no starts) on every ``PLAN_CASES`` case: by default renormalize=False only, and
  the full ranges on cases 0 and 2 (``plan_results(lean=True)``);
- a second call of every radix-select configuration on the same workspace: by default the
  first of each group calls twice, and every call's leftover state is checked (``radix_repeats``).

The interpreted runs start ahead of the tests that read them (conftest's ``interpreted`` mark).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import zlib

import pytest
import torch
from conftest import full_kernel_tests, run_interpreted_parts, run_json_script

from siftattention.kernels import logit_threshold, sift_decode, sift_warmup_decode

# ----------------------------------------------------------------------------- reference


def ref_decode(q, k, v, eta, scale, seq_lens, renormalize):
    """float64, one (batch, head) row at a time over its valid keys only."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    kept = torch.zeros(B, Hq, dtype=torch.int32)
    for b in range(B):
        n = S if seq_lens is None else int(seq_lens[b])
        for h in range(Hq):
            s = (k[b, h // G, :n].double() @ q[b, h].double()) * scale
            p = torch.softmax(s, dim=0)
            keep = p > float(eta[b, h])
            keep[int(torch.argmax(s))] = True
            w = torch.where(keep, p, torch.zeros_like(p))
            if renormalize:
                w = w / w.sum()
            out[b, h] = w @ v[b, h // G, :n].double()
            kept[b, h] = int(keep.sum())
    return out, kept


def ref_probs(q, k, scale, seq_lens, b, h):
    G = q.shape[1] // k.shape[1]
    n = k.shape[2] if seq_lens is None else int(seq_lens[b])
    s = (k[b, h // G, :n].double() @ q[b, h].double()) * scale
    return torch.softmax(s, dim=0)


def ref_theta(q, k, scale, seq_lens, tau):
    B, Hq, _ = q.shape
    th = torch.zeros(B, Hq, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            th[b, h] = torch.quantile(ref_probs(q, k, scale, seq_lens, b, h), tau)
    return th


def midway_eta(q, k, scale, seq_lens, mode, gen):
    """Per-head thresholds away from ties: keep one key, all keys, or a random number."""
    B, Hq, _ = q.shape
    eta = torch.zeros(B, Hq)
    for b in range(B):
        for h in range(Hq):
            p = torch.sort(ref_probs(q, k, scale, seq_lens, b, h)).values
            n = p.numel()
            if mode == "one":
                eta[b, h] = 1.0
            elif mode == "all" or n == 1:
                eta[b, h] = 0.0
            else:
                r = int(torch.randint(0, n - 1, (1,), generator=gen))
                eta[b, h] = float((p[r] + p[r + 1]) / 2)
    return eta


def make_case(B, Hq, Hkv, S, D, dtype, gen, ragged=True, logit_std=2.0):
    q = (torch.randn(B, Hq, D, generator=gen) * logit_std).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    seq_lens = torch.randint(1, S + 1, (B,), generator=gen) if ragged else None
    if ragged:
        seq_lens[0] = S  # one full row, one row of length 1 where B allows
        if B > 1:
            seq_lens[1] = 1
    return q, k, v, seq_lens


def seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- torch backend

TORCH_CASES = [
    # B, Hq, Hkv, S, D
    (4, 4, 4, 37, 64),
    (3, 8, 2, 101, 128),
    (2, 16, 2, 67, 64),
    (1, 8, 1, 129, 128),
]


@pytest.mark.parametrize("B,Hq,Hkv,S,D", TORCH_CASES)
@pytest.mark.parametrize("mode", ["one", "some", "all"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_torch_backend_matches_float64(B, Hq, Hkv, S, D, mode, renormalize):
    gen = torch.Generator().manual_seed(seed(B, Hq, Hkv, S, D, mode))
    q, k, v, sl = make_case(B, Hq, Hkv, S, D, torch.float32, gen)
    scale = D**-0.5
    eta = midway_eta(q, k, scale, sl, mode, gen)
    out, kept = sift_decode(q, k, v, eta, seq_lens=sl, renormalize=renormalize, backend="torch")
    ref, ref_kept = ref_decode(q, k, v, eta, scale, sl, renormalize)
    assert out.dtype == torch.float32 and kept.dtype == torch.int32
    assert rel(out, ref) < 1e-5
    assert torch.equal(kept, ref_kept)
    if mode == "one":
        assert bool((kept == 1).all())
    if mode == "all":
        n = torch.full((B,), S) if sl is None else sl
        assert torch.equal(kept, n[:, None].expand(B, Hq).int())


def test_torch_backend_half_inputs_and_auto():
    gen = torch.Generator().manual_seed(7)
    q, k, v, sl = make_case(2, 8, 2, 45, 64, torch.float16, gen)
    eta = midway_eta(q, k, 0.125, sl, "some", gen)
    out, kept = sift_decode(q, k, v, eta, seq_lens=sl, backend="auto")  # CPU tensors: torch
    ref, ref_kept = ref_decode(q, k, v, eta, 0.125, sl, False)
    assert out.dtype == torch.float16
    assert rel(out, ref) < 2e-3
    assert torch.equal(kept, ref_kept)


def test_strided_cache_slice():
    """A cache slice that is non-contiguous along S (as from a preallocated cache)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v, _ = make_case(2, 4, 2, 60, 64, torch.float32, gen, ragged=False)
    ks, vs = k[:, :, 3:50], v[:, :, 3:50]
    eta = midway_eta(q, ks, 0.125, None, "some", gen)
    out, kept = sift_decode(q, ks, vs, eta, backend="torch")
    ref, ref_kept = ref_decode(q, ks.contiguous(), vs.contiguous(), eta, 0.125, None, False)
    assert rel(out, ref) < 1e-5 and torch.equal(kept, ref_kept)


def test_logit_threshold_equivalence():
    gen = torch.Generator().manual_seed(9)
    s = torch.randn(6, 300, generator=gen, dtype=torch.float64) * 3
    p = torch.softmax(s, dim=-1)
    m = s.max(dim=-1).values
    sum_exp = torch.exp(s - m[:, None]).sum(-1)
    for eta in (1e-5, 1e-3, 0.01, 0.2):
        thr = logit_threshold(torch.tensor(eta, dtype=torch.float64), m, sum_exp)
        # exclude keys within rounding of the threshold, where the two tests may differ
        clear = (s - thr[:, None]).abs() > 1e-9
        assert torch.equal((p > eta) & clear, (s > thr[:, None]) & clear)
    assert torch.isneginf(logit_threshold(0.0, m, sum_exp)).all()


@pytest.mark.parametrize("B,Hq,Hkv,S,D", [(3, 8, 2, 77, 64), (2, 4, 4, 130, 128), (2, 8, 1, 9, 64)])
@pytest.mark.parametrize("tau", [0.0, 0.3, 0.875, 1.0])
def test_torch_warmup_quantile(B, Hq, Hkv, S, D, tau):
    gen = torch.Generator().manual_seed(seed(B, S, tau))
    q, k, v, sl = make_case(B, Hq, Hkv, S, D, torch.float32, gen)
    out, theta = sift_warmup_decode(q, k, v, tau, seq_lens=sl, backend="torch")
    ref_out, _ = ref_decode(q, k, v, torch.zeros(B, Hq), D**-0.5, sl, False)
    assert rel(out, ref_out) < 1e-5
    assert theta.dtype == torch.float32 and theta.shape == (B, Hq)
    assert torch.allclose(theta.double(), ref_theta(q, k, D**-0.5, sl, tau), rtol=1e-5, atol=0)
    if sl is not None and B > 1:
        assert bool((theta[1] == 1.0).all())  # one valid key: theta_1 = 1 for every tau


def exact_score_case(gen, B=2, Hq=4, Hkv=2, S=53, D=64):
    """Small integer q and k with scale 1/8: float32 scores are exact, ties included."""
    q = torch.randint(-2, 3, (B, Hq, D), generator=gen).float()
    k = torch.randint(-1, 2, (B, Hkv, S, D), generator=gen).float()
    v = torch.randn(B, Hkv, S, D, generator=gen)
    return q, k, v, torch.tensor([S, 20][:B])


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| in units of the float32 spacing at b."""
    spacing = torch.finfo(torch.float32).eps * b.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return float(((a.double() - b) / spacing.double()).abs().max())


@pytest.mark.parametrize("tau", [0.1, 0.5, 0.875, 0.99])
def test_torch_warmup_quantile_exact_scores(tau):
    gen = torch.Generator().manual_seed(11)
    q, k, v, sl = exact_score_case(gen)
    _, theta = sift_warmup_decode(q, k, v, tau, scale=0.125, seq_lens=sl, backend="torch")
    # Only exp and the softmax sum round: a few float32 steps of the exact value.
    assert ulps(theta, ref_theta(q, k, 0.125, sl, tau)) <= 8


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads", [8, 32])
def test_planned_tiles_fit_shared_memory(D, dtype, kv_heads):
    # Wide rows (Gemma-3's D = 256, float32 models) failed to launch on the H200 (282 KB of
    # shared memory asked, 227 KB there) before the tiles shrank with the row size.
    from siftattention.kernels.triton_decode import KernelConfig, geometry

    cfg = KernelConfig()
    geo = geometry(8, 32, kv_heads, 32768, D, dtype, torch.device("cpu"), cfg)
    row = geo["BLOCK_D"] * dtype.itemsize
    assert geo["BLOCK_ND"] * row * 2 * cfg.stagesd <= 200 * 1024  # K and V tiles, pipelined
    assert geo["BLOCK_N1"] * row * cfg.stages1 <= 200 * 1024
    assert geo["BLOCK_N2"] * row * cfg.stages2 <= 200 * 1024
    assert geo["BLOCK_NB"] * row * geo["STAGES_B"] <= 200 * 1024
    gqa = kv_heads < 32
    if row <= 256:  # the tuned tiles are kept where they fit
        assert (geo["BLOCK_N1"], geo["BLOCK_ND"]) == (cfg.block_n1, cfg.block_nd)
        assert (geo["BLOCK_N2"], geo["BLOCK_NB"]) == (
            (cfg.block_n2_gqa, cfg.block_nb_gqa) if gqa else (cfg.block_n2, cfg.block_nb))


@pytest.mark.parametrize("S", [2048, 8192, 32768, 131072])
def test_small_batch_split_plans(S):
    # Few (batch, KV head) rows: the filter and dense passes get at most one program per SM from
    # the fill rule and are not rounded up to a whole wave of resident programs (more, shorter
    # splits only add partial outputs to combine); longer rows keep the minimum split length.
    from siftattention.kernels.triton_config import KernelConfig, _cdiv, _plan

    cfg, sms = KernelConfig(), 132
    for B, Hkv in ((1, 8), (2, 8), (1, 32), (4, 8), (8, 8)):
        rows = B * Hkv
        geo = _plan(B, 32, Hkv, S, 128, torch.float16, sms, True, False, cfg)
        persistent_gqa = Hkv < 32 and geo["programs1"] > 0  # see test_persistent_scores_plan
        programs2 = (cfg.programs2_persist_gqa if persistent_gqa else cfg.programs2) if Hkv < 32 else cfg.programs2_mha
        by_length = min(_cdiv(programs2 * sms, rows), _cdiv(S, cfg.min_split2))
        if persistent_gqa:
            by_length = max(by_length, _cdiv(S, cfg.max_split2_persist_gqa))
        if by_length * rows <= sms:  # the fill rule decides
            assert sms - rows < rows * geo["ns2"] <= sms, (B, Hkv, S, geo["ns2"])
        else:  # the split length decides (whole waves only past the first)
            assert geo["ns2"] >= by_length * 3 // 4, (B, Hkv, S, geo["ns2"])
        # The dense kernel follows the same rule with its own split length.
        by_length_d = min(_cdiv(cfg.programsd * sms, rows), _cdiv(S, cfg.min_splitd))
        if by_length_d * rows <= sms:
            assert sms - rows < rows * geo["nsd"] <= sms, (B, Hkv, S, geo["nsd"])
    if S >= 8192:  # the former rule is still a configuration: one whole wave of 4 programs per SM
        old = KernelConfig(fill2=2, whole_waves2=True)
        assert _plan(1, 32, 8, S, 128, torch.float16, sms, True, False, old)["ns2"] * 8 == 4 * sms


def test_narrow_head_dense_plan():
    # Heads of 64 channels take dense splits of at least min_splitd_narrow keys, not min_splitd: SmolLM2's
    # 48 (batch, KV head) rows of 8192 keys get 8 splits (384 programs for 132 SMs), not 2 (96 programs,
    # a quarter of the SMs idle); wider heads keep the rule they had.
    from siftattention.kernels.triton_config import KernelConfig, _cdiv, _plan

    cfg, sms = KernelConfig(), 132
    for B, Hkv, S in ((16, 3, 8192), (32, 3, 4096), (8, 3, 8192), (4, 3, 32768)):
        rows = B * Hkv
        narrow = _plan(B, 3 * Hkv, Hkv, S, 64, torch.bfloat16, sms, True, False, cfg)["nsd"]
        wide = _plan(B, 3 * Hkv, Hkv, S, 128, torch.bfloat16, sms, True, False, cfg)["nsd"]
        fill = (cfg.filld * sms) // rows
        assert narrow == max(min(_cdiv(cfg.programsd * sms, rows), _cdiv(S, cfg.min_splitd_narrow)), fill), (B, S, narrow)
        assert wide == max(min(_cdiv(cfg.programsd * sms, rows), _cdiv(S, cfg.min_splitd)), fill), (B, S, wide)
    assert _plan(16, 9, 3, 8192, 64, torch.bfloat16, sms, True, False, cfg)["nsd"] == 8
    same = KernelConfig(min_splitd_narrow=cfg.min_splitd)
    assert _plan(16, 9, 3, 8192, 64, torch.bfloat16, sms, True, False, same)["nsd"] == 2


def test_packed_scan_plan():
    # The packed scan holds a key's heads as 8 bits of its position word (positions below 2**24) and feeds
    # the tensor-core gather; wider groups, longer caches and the elementwise path take the [heads, keys] scan.
    from siftattention.kernels.triton_config import KernelConfig, _plan

    cfg, sms = KernelConfig(), 132

    def packed(Hq, Hkv, S, c=cfg):
        return _plan(2, Hq, Hkv, S, 128, torch.bfloat16, sms, True, False, c)["PACKED"]

    assert cfg.scan_packed and all(packed(g * 2, 2, 32768) for g in (1, 2, 3, 4, 6, 8))
    assert not packed(32, 2, 32768)  # GQA 16
    assert packed(8, 2, 2**24 - 1) and not packed(8, 2, 2**24)
    assert not packed(12, 2, 32768, KernelConfig(scan_packed=False))
    assert not packed(12, 2, 32768, KernelConfig(use_dot=False))


def test_balanced_splits_plan():
    # Filter and dense grids avoid a last few programs crowding some SMs: with P programs the busiest
    # SM runs ceil(P / SMs) of them, a 1/n share of a row each; fewer splits are taken where that
    # load falls by at least a tenth (ties: more splits).
    from siftattention.kernels.triton_config import KernelConfig, _balanced, _cdiv, _plan

    sms = 132

    def load(m, rows):
        return _cdiv(rows * m, sms) / m

    for rows in (1, 3, 8, 16, 24, 32, 48, 64, 96, 256):
        for n in range(1, 70):
            m = _balanced(n, rows, sms)
            assert 1 <= m <= n
            if m < n:
                assert load(m, rows) <= 0.9 * load(n, rows), (rows, n, m)
                assert all(load(j, rows) > load(m, rows) for j in range(m + 1, n + 1)), (rows, n, m)
            else:
                assert all(load(j, rows) > 0.9 * load(n, rows) for j in range(1, n)), (rows, n)

    def splits(B, Hq, Hkv, S, D, **kw):
        geo = _plan(B, Hq, Hkv, S, D, torch.bfloat16, sms, True, False, KernelConfig(**kw))
        return geo["ns2"], geo["nsd"]

    # Qwen2.5-1.5B at 8 x (16384 + 256): 9 filter splits were 144 programs for 132 SMs.
    assert splits(8, 12, 2, 16640, 128) == (8, 8) and splits(8, 12, 2, 16640, 128, balance_splits=False) == (9, 8)
    # ... and at 16 x (32768 + 256) 9 dense splits were 288 programs: three on 24 SMs, two elsewhere.
    assert splits(16, 12, 2, 33024, 128) == (8, 8) and splits(16, 12, 2, 33024, 128, balance_splits=False) == (8, 9)
    # Groups of at most 4 heads keep their filter splits, 64-channel heads both.
    assert splits(8, 32, 8, 8448, 128)[0] == splits(8, 32, 8, 8448, 128, balance_splits=False)[0] == 5
    assert splits(8, 9, 3, 8192, 64) == splits(8, 9, 3, 8192, 64, balance_splits=False)


def test_window_plan_sizes_grids_for_the_window():
    # A sliding-window layer's rows hold at most the window's keys however long the cache: its plan's
    # splits are those of a cache as long as the window (Gemma-3: 512 keys in a 33k-key cache took
    # 23.6 us a Sift step on an H100, against 14.4 us planned for 512 keys), its scratch the cache's.
    from siftattention.kernels.triton_config import KernelConfig, _plan

    cfg = KernelConfig()
    keys = ("ns1", "ns2", "nsd", "CHUNK2", "NQ", "QBITS")
    for B, Hq, Hkv, D, window in ((16, 4, 1, 256, 512), (8, 32, 8, 128, 4096), (1, 12, 2, 128, 1024)):
        windowed = _plan(B, Hq, Hkv, 33024, D, torch.bfloat16, 132, True, False, cfg, span=window)
        short = _plan(B, Hq, Hkv, window, D, torch.bfloat16, 132, True, False, cfg)
        whole = _plan(B, Hq, Hkv, 33024, D, torch.bfloat16, 132, True, False, cfg)
        assert {k: windowed[k] for k in keys} == {k: short[k] for k in keys}
        assert (windowed["S"], windowed["span"], whole["span"]) == (33024, window, 33024)
        assert windowed["ns1"] < whole["ns1"]
    assert _plan(4, 8, 2, 1000, 64, torch.float16, 132, True, False, cfg, span=5000)["span"] == 1000


def test_persistent_scores_plan():
    # The scores pass turns persistent (a fixed grid looping over every (split, row)) only with
    # many rows and several rounds of work per program; small batches and short caches keep
    # one program per split.
    from siftattention.kernels.triton_config import KernelConfig, _plan

    cfg, sms = KernelConfig(), 132
    for B, Hkv, S, persistent in ((8, 8, 32768, True), (16, 8, 32768, True), (4, 8, 32768, True),
                                  (8, 32, 8192, True), (8, 8, 8192, False), (2, 8, 32768, False),
                                  (1, 8, 131072, False)):
        geo = _plan(B, 32, Hkv, S, 128, torch.float16, sms, True, False, cfg)
        items = B * Hkv * geo["ns1"]
        if persistent:
            assert geo["programs1"] == cfg.persist1 * sms and items >= cfg.persist1_min_waves * geo["programs1"], (B, S)
        else:
            assert geo["programs1"] == 0, (B, Hkv, S)
    assert _plan(8, 32, 8, 32768, 128, torch.float16, sms, True, False, KernelConfig(persist1=0))["programs1"] == 0
    # Beside a persistent scores pass a GQA filter grid is one wave of resident programs, in splits
    # of at most max_split2_persist_gqa keys; without it, the splits of the general rule.
    slots = cfg.resident2 * sms
    for B, S in ((8, 32768), (16, 16384), (32, 8192), (16, 32768), (32, 32768)):
        rows = B * 8
        geo = _plan(B, 32, 8, S, 128, torch.float16, sms, True, False, cfg)
        one_wave = slots // rows
        assert geo["ns2"] == max(one_wave, S // cfg.max_split2_persist_gqa), (B, S, geo["ns2"])
        old = _plan(B, 32, 8, S, 128, torch.float16, sms, True, False, KernelConfig(persist1=0))
        assert old["programs1"] == 0 and old["ns2"] * rows >= slots and old["ns2"] * cfg.min_split2 <= S, (B, S)
    # More than 4 query heads a KV head: the filter pass fits resident2_wide programs on an SM, and
    # its grid is one wave of those (GQA 12/2 and 16/2, persistent scores pass).
    for B, Hq, S in ((16, 12, 32768), (32, 16, 16384)):
        geo = _plan(B, Hq, 2, S, 128, torch.float16, sms, True, False, cfg)
        assert geo["programs1"] > 0, (B, Hq, S)
        assert geo["ns2"] == max(cfg.resident2_wide * sms // (B * 2), S // cfg.max_split2_persist_gqa), (B, Hq, geo["ns2"])


def test_validation_errors():
    q = torch.randn(2, 8, 64)
    k = torch.randn(2, 2, 10, 64)
    eta = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="multiple"):
        sift_decode(torch.randn(2, 6, 64), torch.randn(2, 4, 10, 64), torch.randn(2, 4, 10, 64), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="q must be"):
        sift_decode(q[0], k, k, eta)
    with pytest.raises(ValueError, match="differ in shape"):
        sift_decode(q, k, k[:, :, :5], eta)
    with pytest.raises(ValueError, match="head_dim"):
        sift_decode(q, k[..., :32], k[..., :32], eta)
    with pytest.raises(ValueError, match="dtypes differ"):
        sift_decode(q.half(), k, k, eta)
    with pytest.raises(ValueError, match="dtype"):
        sift_decode(q.double(), k.double(), k.double(), eta)
    with pytest.raises(ValueError, match="unknown backend"):
        sift_decode(q, k, k, eta, backend="cuda")
    with pytest.raises(ValueError, match="eta must be"):
        sift_decode(q, k, k, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="seq_lens must be"):
        sift_decode(q, k, k, eta, seq_lens=torch.tensor([3]))
    with pytest.raises(ValueError, match="integer"):
        sift_decode(q, k, k, eta, seq_lens=torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match="tau"):
        sift_warmup_decode(q, k, k, 1.5)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="triton"):
            sift_decode(q, k, k, eta, backend="triton")


def test_kernel_config_rejects_bad_knobs():
    pytest.importorskip("triton")
    from siftattention.kernels.triton_decode import KernelConfig

    for kw, msg in (({"quantile_sample": 500}, "quantile_sample must be a power of two or 0"),
                    ({"quantile_block": 0}, "quantile_block must be a power of two"),
                    ({"quantile_margin": -1}, "quantile_margin must be >= 0"),
                    ({"quantile_resident": 0}, "quantile_resident must be >= 1"),
                    ({"min_splitq": 0}, "min_splitq must be >= 1"),
                    ({"maxnreg2": 16}, "maxnreg2 must be 0 \\(no cap\\) or in 24..255"),
                    ({"maxnregd": 256}, "maxnregd must be 0 \\(no cap\\) or in 24..255")):
        with pytest.raises(ValueError, match=msg):
            KernelConfig(**kw)
    assert KernelConfig(quantile_sample=0).quantile_sample == 0


def test_register_caps_are_planned_for_compiled_launches_only():
    pytest.importorskip("triton")
    from siftattention.kernels import triton_config as td

    cfg = td.KernelConfig(maxnreg2=168)
    compiled = td._plan(8, 32, 8, 4096, 128, torch.float16, 132, True, False, cfg)
    assert compiled["regs2"] == {"maxnreg": 168} and compiled["regs1"] == compiled["regsd"] == {}
    interpreted = td._plan(8, 32, 8, 4096, 128, torch.float16, 132, True, True, cfg)
    assert interpreted["regs2"] == {}  # the interpreter takes no register cap


# ----------------------------------------------------------------------------- planned kernels (DecodeKernels)


def ref_range(q, k, v, eta, scale, seq_lens, starts, renormalize=False, tau=None):
    """float64 reference over the valid keys [start, seq_len) of each row.

    Keeps ``p > eta``, every key where ``eta <= 0``, and the first maximum. Returns
    (out, kept, dense out, theta at ``tau`` or None).
    """
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    dense = torch.zeros(B, Hq, D, dtype=torch.float64)
    kept = torch.zeros(B, Hq, dtype=torch.int32)
    theta = torch.zeros(B, Hq, dtype=torch.float64)
    for b in range(B):
        lo, hi = int(starts[b]), int(seq_lens[b])
        for h in range(Hq):
            kk, vv = k[b, h // G, lo:hi].double(), v[b, h // G, lo:hi].double()
            s = (kk @ q[b, h].double()) * scale
            p = torch.softmax(s, dim=0)
            e = float(eta[b, h])
            keep = (p > e) | torch.tensor(e <= 0)
            keep[int(torch.argmax(s))] = True
            w = torch.where(keep, p, torch.zeros_like(p))
            if renormalize:
                w = w / w.sum()
            out[b, h] = w @ vv
            dense[b, h] = p @ vv
            kept[b, h] = int(keep.sum())
            if tau is not None:
                theta[b, h] = torch.quantile(p, tau)
    return out, kept, dense, (theta if tau is not None else None)


def range_case(B, Hq, Hkv, S, D, dtype, gen):
    """Random peaky inputs with ragged [start, seq_len): a full row, a one-key row, random rows."""
    q, k, v, _ = make_case(B, Hq, Hkv, S, D, dtype, gen, ragged=False)
    seq_lens = torch.randint(2, S + 1, (B,), generator=gen)
    starts = (torch.rand(B, generator=gen) * (seq_lens - 1)).long()
    seq_lens[0], starts[0] = S, 0
    if B > 1:
        starts[1] = seq_lens[1] - 1
    return q, k, v, seq_lens.int(), starts.int()


EDGE_ETAS = (-1.0, 0.0, 1.0, 2.5, float("nan"))


def range_eta(q, k, scale, seq_lens, starts, gen):
    """Per head: a threshold midway between two sorted probabilities, or an edge value."""
    B, Hq, _ = q.shape
    G = Hq // k.shape[1]
    eta = torch.zeros(B, Hq)
    for b in range(B):
        lo, hi = int(starts[b]), int(seq_lens[b])
        for h in range(Hq):
            i = b * Hq + h
            if i % 2 == 1:
                eta[b, h] = EDGE_ETAS[(i // 2) % len(EDGE_ETAS)]
                continue
            p = torch.sort(torch.softmax((k[b, h // G, lo:hi].double() @ q[b, h].double()) * scale, 0)).values
            r = int(torch.randint(0, max(1, p.numel() - 1), (1,), generator=gen))
            eta[b, h] = float((p[r] + p[min(r + 1, p.numel() - 1)]) / 2) if p.numel() > 1 else 0.5
    return eta


# B, Hq, Hkv, S, D, dtype: GQA group sizes 1, 2, 4, 8, odd S
PLAN_CASES = [
    (3, 4, 4, 37, 64, "float32"),
    (3, 8, 4, 29, 32, "float16"),
    (2, 8, 2, 53, 64, "bfloat16"),
    (2, 16, 2, 41, 32, "float32"),
]


def power_law_for(eta, seq_lens, starts, gen):
    """A PowerLawThreshold whose eta() is ``eta`` up to rounding: random exponents, log alpha to match
    (eta = 0 gives log alpha = -inf, so the row keeps every key)."""
    from siftattention.kernels.plan import PowerLawThreshold

    log_steps = (seq_lens - starts).float().log()
    beta = (torch.rand(eta.shape, generator=gen) * 3 - 1.5).float()
    log_alpha = (eta.double().clamp(min=0).log() + beta.double() * log_steps.double()[:, None]).float()
    return PowerLawThreshold(log_alpha.contiguous(), beta.contiguous(), log_steps.contiguous())


def workspace_at_rest(ws) -> bool:
    """The Triton workspace's counters and quantile buffers hold their rest values (the kernels
    set them back after each call, so the next call needs no memset)."""
    return bool((ws.sync == 0).all() and (ws.qhist == 0).all() and (ws.qbracket == 0).all()
                and (ws.qsync == 0).all() and (ws.qnext == 2**31 - 1).all())


def plan_results(device: str, backend: str, cases, config=None, seed_base: int = 31, exact: bool = True,
                 lean: bool = False) -> list[dict]:
    """DecodeKernels sparse / dense / warmup on ``cases`` against the float64 reference; ``exact``
    False: the sparse step only (dense and warmup as another config's run of the same cases).
    ``lean``: the power-law thresholds with renormalize=False only (the threshold is formed before,
    and apart from, the renormalisation), and the full ranges (no starts) on every other case only."""
    from siftattention.kernels import DecodeKernels
    from siftattention.kernels.plan import PowerLawThreshold

    res = []
    for i, (B, Hq, Hkv, S, D, dt) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed_base + i)
        dtype = getattr(torch, dt)
        q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, dtype, gen)
        scale = D**-0.5
        eta = range_eta(q, k, scale, sl, st, gen)
        tau = 0.75
        for renorm in (False, True):
            ref, ref_kept, ref_dense, ref_th = ref_range(q, k, v, eta, scale, sl, st, renorm, tau)
            kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=dtype,
                                      device=device, scale=scale, renormalize=renorm, backend=backend, config=config)
            torch_kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=dtype,
                                            device=device, scale=scale, renormalize=renorm, backend="torch")
            dev = lambda x: x.to(device)  # noqa: E731
            args = (dev(q), dev(k), dev(v))
            out, kept = kern.sparse(*args, dev(eta), dev(sl), dev(st))
            _, kept_t = torch_kern.sparse(*args, dev(eta), dev(sl), dev(st))
            row = dict(case=i, dtype=dt, renorm=renorm, backend=backend, err=rel(out.cpu(), ref),
                       kept_equal=bool(torch.equal(kept.cpu(), ref_kept)),
                       kept_equal_torch=bool(torch.equal(kept.cpu(), kept_t.cpu())),
                       dtypes_ok=out.dtype == dtype and kept.dtype == torch.int32)
            # The same thresholds given as a power law (log alpha, beta, log S), as Sift's decode step passes them.
            law = power_law_for(eta, sl, st, gen)
            if not (lean and renorm):
                pl_ref, pl_ref_kept, _, _ = ref_range(q, k, v, law.eta(), scale, sl, st, renorm, tau)
                pl_out, pl_kept = kern.sparse(*args, PowerLawThreshold(*(dev(x) for x in law)), dev(sl), dev(st))
                row.update(pl_err=rel(pl_out.cpu(), pl_ref), pl_kept_equal=bool(torch.equal(pl_kept.cpu(), pl_ref_kept)))
            full_ranges = not renorm and not (lean and i % 2)
            if full_ranges:  # dense, warmup and full ranges do not depend on renormalize
                full = torch.full((B,), S, dtype=torch.int32)
                ref_f, ref_kept_f, ref_dense_f, _ = ref_range(q, k, v, eta, scale, full, torch.zeros(B, dtype=torch.int32))
                out_f, kept_f = kern.sparse(*args, dev(eta), dev(full))  # no starts
                row.update(full_err=rel(out_f.cpu(), ref_f), full_kept_equal=bool(torch.equal(kept_f.cpu(), ref_kept_f)))
            if not renorm and exact:
                dense = kern.dense(*args, dev(sl), dev(st))
                w_out, theta = kern.warmup(*args, tau, dev(sl), dev(st))
                row.update(
                    dense_err=rel(dense.cpu(), ref_dense), warm_err=rel(w_out.cpu(), ref_dense),
                    theta_rel=float(((theta.cpu().double() - ref_th).abs() / ref_th).max()),
                    dtypes_ok=row["dtypes_ok"] and dense.dtype == dtype and theta.dtype == torch.float32,
                )
                if full_ranges:
                    row["full_dense_err"] = rel(kern.dense(*args, dev(full)).cpu(), ref_dense_f)
            if backend == "triton":  # counters and quantile buffers are back at their rest values
                row["sync_zero"] = workspace_at_rest(kern.workspace)
            else:
                row["sync_zero"] = True
            res.append(row)
    return res


def check_plan_rows(rows, n_expected, exact=True, lean=False):
    assert len(rows) == n_expected
    for r in rows:
        tol = 1e-5 if r["dtype"] == "float32" else 1e-2
        assert r["err"] < tol and r["kept_equal"] and r["kept_equal_torch"], r
        full_ranges = not r["renorm"] and not (lean and r["case"] % 2)
        assert ("pl_err" in r) == (not (lean and r["renorm"])) and ("full_err" in r) == full_ranges, r
        if "pl_err" in r:
            assert r["pl_err"] < tol and r["pl_kept_equal"], r
        if full_ranges:
            assert r["full_err"] < tol and r["full_kept_equal"], r
        if not r["renorm"] and exact:
            for key in ("dense_err", "warm_err") + (("full_dense_err",) if full_ranges else ()):
                assert r[key] < tol, (key, r)
            assert r["theta_rel"] < 1e-5, r
        assert r["dtypes_ok"] and r["sync_zero"], r


def test_plan_torch_backend_matches_float64():
    check_plan_rows(plan_results("cpu", "torch", PLAN_CASES), 2 * len(PLAN_CASES))


# ----------------------------------------------------------------------------- fused CPU kernel (backend="cpu")

needs_cpu_kernel = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")

# B, Hq, Hkv, S, D: GQA group sizes 1, 2, 4, 8; odd lengths, one long enough for many SIMD blocks
CPU_CASES = [
    (3, 4, 4, 37, 64, "float32"),
    (3, 8, 4, 301, 128, "float32"),
    (2, 8, 2, 53, 64, "float32"),
    (2, 16, 2, 1031, 64, "float32"),
    (1, 9, 3, 77, 64, "float32"),
]


@needs_cpu_kernel
def test_plan_cpu_backend_matches_float64():
    rows = plan_results("cpu", "cpu", CPU_CASES, seed_base=57)
    assert {r["backend"] for r in rows} == {"cpu"}
    check_plan_rows(rows, 2 * len(CPU_CASES))


@needs_cpu_kernel
@pytest.mark.parametrize("renormalize", [False, True])
def test_cpu_backend_strided_cache_and_full_rows(renormalize):
    """Caches laid out [B, S, Hkv, D] (a transposed view), no seq_lens, thresholds midway."""
    gen = torch.Generator().manual_seed(seed("strided", renormalize))
    B, Hq, Hkv, S, D = 2, 8, 2, 203, 64
    q = torch.randn(B, Hq, D, generator=gen) * 2
    k = torch.randn(B, S, Hkv, D, generator=gen).transpose(1, 2)
    v = torch.randn(B, S, Hkv, D, generator=gen).transpose(1, 2)
    eta = midway_eta(q, k, D**-0.5, None, "some", gen)
    out, kept = sift_decode(q, k, v, eta, renormalize=renormalize, backend="cpu")
    ref, ref_kept = ref_decode(q, k, v, eta, D**-0.5, None, renormalize)
    assert rel(out, ref) < 1e-5 and torch.equal(kept, ref_kept)
    assert (kept < S).all() and (kept >= 1).all()


@needs_cpu_kernel
def test_cpu_backend_eta_edges():
    gen = torch.Generator().manual_seed(43)
    q, k, v, sl, st = range_case(3, 8, 2, 131, 64, torch.float32, gen)
    for e in (-1.0, 0.0, 1.0, 2.5):
        eta = torch.full((3, 8), e)
        out, kept = sift_decode(q, k, v, eta, seq_lens=sl, starts=st, backend="cpu")
        ref, ref_kept, _, _ = ref_range(q, k, v, eta, 0.125, sl, st)
        assert rel(out, ref) < 1e-5 and torch.equal(kept, ref_kept)
    with pytest.raises(ValueError, match="NaN"):
        sift_decode(q, k, v, float("nan"), backend="cpu")
    for tau in (0.0, 0.3, 0.5, 1.0):
        out, th = sift_warmup_decode(q, k, v, tau, seq_lens=sl, starts=st, backend="cpu")
        _, _, ref_dense, ref_th = ref_range(q, k, v, torch.zeros(3, 8), 0.125, sl, st, tau=tau)
        assert rel(out, ref_dense) < 1e-5 and torch.allclose(th.double(), ref_th, rtol=1e-5, atol=0)


@needs_cpu_kernel
def test_cpu_backend_keeps_the_maximum_of_rows_with_all_the_mass():
    """Rows whose probability sits on one key (one valid key, or every other key's exponential below float32):
    with eta >= 1 or NaN they keep exactly that key, and its value row is the output. (D = 128: with a scale that
    is no power of two a fused multiply-add in scale * s - scale * s_max leaves a residue at the maximum.)"""
    from siftattention.kernels import DecodeKernels

    gen = torch.Generator().manual_seed(45)
    B, Hq, Hkv, S, D = 4, 16, 2, 40, 128
    q = torch.randn(B, Hq, D, generator=gen)
    q[2:] *= 400.0  # peaked rows: p_max = 1 to float32
    k, v = torch.randn(B, Hkv, S, D, generator=gen), torch.randn(B, Hkv, S, D, generator=gen)
    seq_lens = torch.tensor([40, 17, 40, 29], dtype=torch.int32)
    starts = torch.tensor([39, 16, 0, 3], dtype=torch.int32)
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=torch.float32,
                              device="cpu", scale=D**-0.5, backend="cpu")
    for e in (1.0, 2.5, float("nan")):
        eta = torch.full((B, Hq), e)
        out, kept = kern.sparse(q, k, v, eta, seq_lens, starts)
        ref, ref_kept, _, _ = ref_range(q, k, v, eta, D**-0.5, seq_lens, starts)
        assert torch.equal(kept, torch.ones(B, Hq, dtype=torch.int32)) and torch.equal(ref_kept, kept), e
        assert rel(out, ref) < 1e-5, e


@needs_cpu_kernel
def test_cpu_backend_quantile_threshold_drops_the_quantile_key():
    """theta from the warmup step, used as eta, filters the same probabilities: at tau * (n - 1)
    integral, theta is a key's own probability and that key is dropped, as ``p > theta`` says."""
    gen = torch.Generator().manual_seed(44)
    B, Hq, Hkv, S, D = 2, 8, 2, 101, 64  # n - 1 = 100: tau = 0.5 and 0.9 fall on order statistics
    q = torch.randn(B, Hq, D, generator=gen) * 2
    k, v = torch.randn(B, Hkv, S, D, generator=gen), torch.randn(B, Hkv, S, D, generator=gen)
    for tau in (0.5, 0.9):
        _, theta = sift_warmup_decode(q, k, v, tau, backend="cpu")
        _, kept = sift_decode(q, k, v, theta, backend="cpu")
        assert torch.equal(kept, torch.full((B, Hq), S - 1 - round(tau * (S - 1)), dtype=torch.int32))


@needs_cpu_kernel
@pytest.mark.parametrize("case", CPU_CASES, ids=[f"G{c[1] // c[2]}-S{c[3]}-D{c[4]}" for c in CPU_CASES])
@pytest.mark.parametrize("renormalize", [False, True])
def test_cpu_backend_anchored_matches_float64(case, renormalize):
    """Sift with the anchored normaliser, fused CPU kernel against the float64 torch reference: ragged
    rows, each head's score threshold A + gap + log eta placed midway between two scores, and the edge
    heads (no gap yet, eta <= 0, eta >= 1, NaN eta); the gap written in place is this step's."""
    from siftattention.kernels import DecodeKernels
    from siftattention.kernels.plan import PowerLawThreshold
    from siftattention.kernels.torch_ref import _anchor_lse, _scores, sift_anchored_decode_torch

    B, Hq, Hkv, S, D, _ = case
    gen = torch.Generator().manual_seed(seed("anchored-cpu", *case[:5], renormalize))
    q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, torch.float32, gen)
    first, last = 3, 7
    s64, valid = _scores(q.double(), k.double(), D**-0.5, sl, st)
    anchor = _anchor_lse(s64, valid, first, last)
    gap = torch.rand(B, Hq, generator=gen, dtype=torch.float64) * 2
    log_eta = torch.empty(B, Hq, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            row = torch.sort(s64[b, h][valid[b, h]]).values
            n = row.numel()
            if n < 3:
                log_eta[b, h] = -1.0
                continue
            lo = max(0, int(0.8 * n) - 8)
            gaps = row[lo + 1 : n] - row[lo : n - 1]
            i = lo + int(gaps.argmax())  # the widest gap above the 80% rank: no float32 rounding can cross it
            log_eta[b, h] = (row[i] + row[i + 1]) / 2 - anchor[b, h] - gap[b, h]
    log_eta[0, 0], gap[0, 1], log_eta[0, 1], log_eta[-1, -1] = 0.0, float("nan"), -1.0, float("-inf")
    log_eta[-1, 0] = float("nan")
    ref, ref_kept, ref_gap = sift_anchored_decode_torch(q.double(), k.double(), v.double(), log_eta, gap, D**-0.5, sl,
                                                        renormalize, st, first, last)
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=torch.float32,
                              device="cpu", scale=D**-0.5, renormalize=renormalize, backend="cpu")
    power_law = PowerLawThreshold(log_eta.float(), torch.zeros(B, Hq), torch.zeros(B))
    gap32 = gap.float()
    out, kept = kern.sparse_anchored(q, k, v, power_law, gap32, sl, st, first, last)
    assert torch.equal(kept, ref_kept)
    assert rel(out, ref) < 1e-5
    assert torch.allclose(gap32.double(), ref_gap, atol=1e-5, rtol=0)
    assert kept[0, 0] == 1 and kept[-1, 0] == 1  # eta >= 1 and NaN eta: the maximum only
    assert kept[0, 1] == sl[0] - st[0] and kept[-1, -1] == sl[-1] - st[-1]  # no gap yet, eta <= 0: every key


def test_cpu_kernel_unavailable_falls_back(monkeypatch):
    """No compiler: one warning says why and auto plans the torch backend; switched off: torch, silently."""
    import warnings

    from siftattention.kernels import DecodeKernels, cpu_decode

    ok = dict(batch=2, q_heads=8, kv_heads=2, max_len=16, head_dim=64, dtype=torch.float32, device="cpu", scale=0.125)
    monkeypatch.setattr(cpu_decode, "_module", None)
    monkeypatch.setattr(cpu_decode, "_problem", None)
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.warns(UserWarning, match="no C.. compiler found; the torch backend runs instead"):
        assert DecodeKernels.plan(**ok).backend == "torch"
    with pytest.raises(ValueError, match="cannot run here: no C.. compiler"):
        DecodeKernels.plan(**ok, backend="cpu")

    monkeypatch.setattr(cpu_decode, "_problem", None)
    monkeypatch.setenv("SIFTATTENTION_CPU_KERNEL", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DecodeKernels.plan(**ok).backend == "torch"


def test_cpu_kernel_builds_once_per_environment(monkeypatch):
    """Each environment (torch installation, Python) builds into its own directory: torch's loader
    records include paths, and would rebuild silently where two environments shared one."""
    from siftattention.kernels import cpu_decode

    name = cpu_decode.build_name()
    assert name == cpu_decode.build_name() and name.startswith("siftattention_cpu_")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    other_env = cpu_decode.build_name()
    monkeypatch.undo()
    monkeypatch.setattr(sys, "version", sys.version + " (another build)")
    other_python = cpu_decode.build_name()
    assert len({name, other_env, other_python}) == 3


def test_plan_argument_checks():
    from siftattention.kernels import DecodeKernels

    ok = dict(batch=2, q_heads=8, kv_heads=2, max_len=16, head_dim=64, dtype=torch.float32, device="cpu", scale=0.125)
    from siftattention.kernels import cpu_decode

    # auto on the CPU: the fused C++ kernel for float32 where it builds, torch otherwise
    assert DecodeKernels.plan(**ok).backend == ("cpu" if cpu_decode.available() else "torch")
    assert DecodeKernels.plan(**{**ok, "dtype": torch.bfloat16}).backend == "torch"
    with pytest.raises(ValueError, match="float32"):
        DecodeKernels.plan(**{**ok, "dtype": torch.float16}, backend="cpu")
    for bad, match in ((dict(kv_heads=3), "multiple"), (dict(batch=0), "batch"), (dict(dtype=torch.float64), "dtype"),
                       (dict(scale=float("nan")), "scale"), (dict(backend="cuda"), "unknown backend"),
                       (dict(max_range=0), "max_range"), (dict(max_range=4.0), "max_range")):
        with pytest.raises(ValueError, match=match):
            DecodeKernels.plan(**{**ok, **bad})
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="triton"):
            DecodeKernels.plan(**ok, backend="triton")


def test_functional_api_eta_edges_and_starts():
    """sift_decode: NaN eta is an error; edge values and starts follow the reference."""
    gen = torch.Generator().manual_seed(41)
    q, k, v, sl, st = range_case(3, 8, 2, 31, 64, torch.float32, gen)
    with pytest.raises(ValueError, match="NaN"):
        sift_decode(q, k, v, float("nan"), backend="torch")
    with pytest.raises(ValueError, match="NaN"):
        sift_decode(q, k, v, torch.full((3, 8), float("nan")), backend="torch")
    with pytest.raises(ValueError, match="starts must be"):
        sift_decode(q, k, v, 0.1, seq_lens=sl, starts=st[:2], backend="torch")
    for e in (-1.0, 0.0, 1.0, 2.5):
        eta = torch.full((3, 8), e)
        out, kept = sift_decode(q, k, v, eta, seq_lens=sl, starts=st, backend="torch")
        ref, ref_kept, _, _ = ref_range(q, k, v, eta, 0.125, sl, st)
        assert rel(out, ref) < 1e-5 and torch.equal(kept, ref_kept)
        n = (sl - st)[:, None].expand(3, 8)
        assert torch.equal(kept, n.int() if e <= 0 else torch.ones_like(kept))
    out, th = sift_warmup_decode(q, k, v, 0.5, seq_lens=sl, starts=st, backend="torch")
    _, _, ref_dense, ref_th = ref_range(q, k, v, torch.zeros(3, 8), 0.125, sl, st, tau=0.5)
    assert rel(out, ref_dense) < 1e-5 and torch.allclose(th.double(), ref_th, rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- triton (interpreter)

FULL = full_kernel_tests()
# Every warmup row below is shorter than 64 keys: a 32-key sample with margin 2 brackets about n/16 keys either
# side of the wanted rank, as the default 512 and 32 do, on the same paths, for a fraction of the interpreter's sort
# (of 64 keys: 2.4 times as long).
SAMPLE_SMALL = {} if FULL else dict(quantile_sample=32, quantile_margin=2)
# (B, Hq, Hkv, S, D, dtype, config overrides). Small blocks and splits so that odd
# lengths cross tile, split and compaction boundaries.
SMALL = dict(block_n1=16, block_n2=16, block_a=32, scan_elems=0, min_split1=16, min_split2=16, quantile_block=32,
             block_nd=16, min_splitd=16, block_nb=16, block_n2_gqa=16, block_nb_gqa=32, quantile_parallel=True,
             interleave2=0, interleave2_runs=1, **SAMPLE_SMALL)
TRITON_CASES = [
    (2, 4, 4, 37, 64, "float32", {"quantile_parallel": False}),  # one quantile program per row
    (2, 4, 4, 45, 64, "float16", {"scan_elems": 64, "reuse_sync": False}),  # MHA scan rows of 64 keys
    (3, 8, 2, 53, 128, "float16", {"warmup_dense": False}),  # warmup: scores, quantile, filter kernels
    (2, 8, 1, 41, 64, "bfloat16", {"compact_weights": False, "scan_packed": False}),  # phase B gathers the scores
    (2, 8, 1, 41, 64, "float16", {"compact": False, "stream_mask_v": True}),
    (1, 4, 4, 70, 128, "bfloat16", {"dense_pct": 0, "fused_combine": False}),
    (1, 4, 1, 29, 256, "float32", {"block_n1": 64, "block_nd": 64, "block_nb_gqa": 64}),  # Gemma-3's head: tiles shrink
    # Interleaved filter splits: chunks smaller than, equal to and larger than the tiles, a partial last chunk.
    (2, 8, 2, 53, 64, "float16", {"interleave2": 8}),
    (2, 4, 4, 61, 64, "float32", {"interleave2": 16, "dense_pct": 30}),  # some splits stream
    (2, 8, 1, 41, 64, "float16", {"compact": False, "interleave2": 32}),  # streaming only
    (1, 4, 2, 301, 64, "bfloat16", {"interleave2": 64}),  # chunks longer than the scan and stream tiles
    (2, 12, 2, 77, 128, "bfloat16", {}),  # GQA 6: the packed scan's records with two padded heads
    (2, 9, 3, 50, 64, "float16", {"scan_packed": False}),  # GQA 3 through the scan of [heads, keys] tiles
]


# The sparse step's thresholds and renormalize settings on each case: "some" with both, the edge
# thresholds (one key, every key) with one each by default; SIFT_FULL_KERNEL_TESTS=1: every pair.
DECODE_RENORMS = {mode: (False, True) if FULL or mode == "some" else (renorm,)
                  for mode, renorm in (("one", False), ("some", None), ("all", True))}


def _triton_cases(indices) -> dict:
    """Sparse and warmup steps on ``TRITON_CASES[indices]`` against float64, and the anchored gap
    the warmup step leaves."""
    from siftattention.kernels import triton_decode
    from siftattention.kernels import DecodeKernels
    from siftattention.kernels.torch_ref import anchor_gap_torch
    from siftattention.kernels.triton_decode import KernelConfig, sift_decode_triton, sift_warmup_decode_triton

    res: dict = {"decode": [], "warmup": [], "warmup_gap": [], "chunks": []}
    for i in indices:
        B, Hq, Hkv, S, D, dt, over = TRITON_CASES[i]
        gen = torch.Generator().manual_seed(seed("triton-case", i))
        dtype = getattr(torch, dt)
        cfg = KernelConfig(**{**SMALL, **over})
        q, k, v, sl = make_case(B, Hq, Hkv, S + 3, D, dtype, gen)
        k, v = k[:, :, 1 : S + 1], v[:, :, 1 : S + 1]  # strided along S
        sl = sl.clamp(max=S)
        scale = D**-0.5
        res["chunks"].append((i, triton_decode.geometry(B, Hq, Hkv, S, D, dtype, q.device, cfg)["CHUNK2"]))
        for mode in ("one", "some", "all"):
            eta = midway_eta(q, k, scale, sl, mode, gen)
            for renorm in DECODE_RENORMS[mode]:
                out, kept = sift_decode_triton(q, k, v, eta, scale, sl.int(), renorm, cfg)
                ref, ref_kept = ref_decode(q, k, v, eta, scale, sl, renorm)
                res["decode"].append(dict(case=i, mode=mode, renorm=renorm, dtype=dt, err=rel(out, ref),
                                          kept_equal=bool(torch.equal(kept.cpu(), ref_kept)),
                                          out_dtype=str(out.dtype)))
        if i < 4 or D == 256:  # warmup quantile on the same shapes
            for tau in (0.25, 0.9):
                tau_t = torch.full((B, Hq), tau, dtype=torch.float64)
                out, theta = sift_warmup_decode_triton(q, k, v, tau_t, scale, sl.int(), cfg)
                ref, _ = ref_decode(q, k, v, torch.zeros(B, Hq), scale, sl, False)
                th_ref = ref_theta(q, k, scale, sl, tau)
                res["warmup"].append(dict(case=i, tau=tau, dtype=dt, err=rel(out, ref),
                                          theta_rel=float(((theta.double() - th_ref).abs() / th_ref).max())))
            # The anchored normaliser's gap, read from what the warmup step left in its workspace.
            kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=dtype,
                                      device="cpu", scale=scale, backend="triton", config=cfg)
            starts = (sl // 3).int()
            kern.warmup(q, k, v, 0.5, sl.int(), starts)
            gap = kern.warmup_gap(q, k, sl.int(), starts, 3, 5)
            want = anchor_gap_torch(q.double(), k.double(), scale, sl, starts, 3, 5)
            res["warmup_gap"].append(dict(case=i, warmup_dense=cfg.warmup_dense,
                                          err=float((gap.double() - want).abs().max())))
    return res


def _triton_exact_quantile() -> dict:
    """The warmup quantile on scores with exact ties, with and without loading each pass's next tile
    ahead. (The interpreter runs one program per row whatever ``quantile_parallel`` says; rows cut
    into chunks run in ``test_cuda_radix_select_in_row_chunks``.)"""
    from siftattention.kernels.triton_decode import KernelConfig, sift_warmup_decode_triton

    res: dict = {"exact": []}
    gen = torch.Generator().manual_seed(21)
    q, k, v, sl = exact_score_case(gen)
    for tau in (0.1, 0.5, 0.875, 0.99, 1.0):
        tau_t = torch.full(q.shape[:2], tau, dtype=torch.float64)
        _, theta = sift_warmup_decode_triton(q, k, v, tau_t, 0.125, sl.int(), KernelConfig(**SMALL))
        res["exact"].append(dict(tau=tau, ulps=ulps(theta, ref_theta(q, k, 0.125, sl, tau))))
    # Without loading each pass's next tile ahead (SMALL loads it ahead).
    cfg = KernelConfig(**{**SMALL, "quantile_parallel": False, "quantile_prefetch": False})
    for tau in (0.1, 0.5, 0.99, 1.0):
        tau_t = torch.full(q.shape[:2], tau, dtype=torch.float64)
        _, theta = sift_warmup_decode_triton(q, k, v, tau_t, 0.125, sl.int(), cfg)
        res["exact"].append(dict(tau=tau, prefetch=False, ulps=ulps(theta, ref_theta(q, k, 0.125, sl, tau))))
    return res


def _sync_nonzero() -> int:
    """Nonzero entries left in this process's reused counter buffers."""
    from siftattention.kernels import triton_config

    return sum(int(b.count_nonzero()) for b in triton_config._SYNC.values())


def _triton_failed_launch() -> dict:
    """A filter pass that fails to launch leaves the reused counters zeroed (a scores pass on the
    GPU has advanced them by then: simulated here by dirtying the buffer)."""
    from siftattention.kernels import triton_decode
    from siftattention.kernels.triton_decode import KernelConfig, sift_decode_triton

    q, k, v, sl = make_case(1, 4, 4, 20, 64, torch.float32, torch.Generator().manual_seed(22))
    real = triton_decode.filter_pass

    def failing(geo, ws, *a, **kw):
        ws.sync[:2].fill_(7)  # the counters a scores pass advances
        raise RuntimeError("launch failed")

    triton_decode.filter_pass = failing
    try:
        sift_decode_triton(q, k, v, torch.zeros(1, 4), 0.125, None, False, KernelConfig(**SMALL))
    except RuntimeError:
        pass
    finally:
        triton_decode.filter_pass = real
    return {"sync_nonzero_after_failure": _sync_nonzero()}


def _triton_plans(interleave: int) -> dict:
    """DecodeKernels on ragged starts and lengths, contiguous or interleaved filter splits (only the
    filter pass interleaves: the dense and warmup steps of the interleaved plans would repeat the others')."""
    from siftattention.kernels.triton_decode import KernelConfig

    key = "plan_interleaved" if interleave else "plan"
    config = KernelConfig(**{**SMALL, "interleave2": interleave})
    return {key: plan_results("cpu", "triton", PLAN_CASES, config, exact=not interleave, lean=not FULL)}


def _triton_persistent() -> dict:
    """The persistent scores pass, and (one part with it, both short) the failed-launch counters."""
    from siftattention.kernels.triton_decode import KernelConfig

    return {"persistent": persistent_results(KernelConfig(**SMALL)), "capacity": capacity_results(KernelConfig(**SMALL)),
            **_triton_failed_launch()}


# The interpreter's work in parts, run side by side in subprocesses (one per core at a time), the
# longest first so that the cores finish together.
TRITON_PARTS = {
    "plans": lambda: _triton_plans(0),
    "radix": lambda: {"radix": radix_select_results(repeat=radix_repeats)},
    "cases-4-10": lambda: _triton_cases(range(4, len(TRITON_CASES))),
    "cases-2-3": lambda: _triton_cases(range(2, 4)),
    "exact-quantile": _triton_exact_quantile,
    "cases-0-1": lambda: _triton_cases(range(0, 2)),
    "plans-interleaved": lambda: _triton_plans(8),
    "persistent": _triton_persistent,
}
# The tests that read these parts' results (triton_results): the parts start ahead (conftest's ``interpreted``).
interpreted_parts = pytest.mark.interpreted(*[("--triton-worker", part) for part in TRITON_PARTS])


def _triton_worker(part: str) -> dict:
    """Runs in a subprocess with TRITON_INTERPRET=1; returns measured errors as JSON, with the
    state of the reused counters after every call."""
    from siftattention.kernels import triton_config

    res = TRITON_PARTS[part]()
    res["sync_buffers"] = len(triton_config._SYNC)
    res["sync_nonzero"] = _sync_nonzero()
    return res


def persistent_results(config) -> list[dict]:
    """The sparse step with a persistent scores pass (the interpreter's 4 "SMs": 4 programs loop
    over every (split, row)) against the same step with one program per split and float64."""
    from siftattention.kernels import DecodeKernels
    from siftattention.kernels.triton_decode import KernelConfig

    persistent = KernelConfig(**{**config.__dict__, "persist1": 1, "persist1_min_rows": 1, "persist1_min_waves": 1})
    res = []
    for i in (1, 2):  # GQA ratios 2 and 4, ragged starts and lengths
        B, Hq, Hkv, S, D, dt = PLAN_CASES[i]
        gen = torch.Generator().manual_seed(71 + i)
        dtype = getattr(torch, dt)
        q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, dtype, gen)
        eta = range_eta(q, k, D**-0.5, sl, st, gen)
        ref, ref_kept, _, _ = ref_range(q, k, v, eta, D**-0.5, sl, st, False, 0.75)
        outs = []
        for cfg in (config, persistent):
            kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=dtype,
                                      device="cpu", scale=D**-0.5, backend="triton", config=cfg)
            outs.append(kern.sparse(q, k, v, eta, sl, st) + (kern.geometry["programs1"],))
        (out_n, kept_n, _), (out_p, kept_p, programs) = outs
        res.append(dict(case=i, dtype=dt, persistent=0 < programs < B * Hkv * kern.geometry["ns1"],
                        out_equal=bool(torch.equal(out_n, out_p)), kept_equal=bool(torch.equal(kept_n, kept_p)),
                        kept_ref=bool(torch.equal(kept_p, ref_kept)), err=rel(out_p, ref)))
    return res


def three_steps_against_float64(kern, q, k, v, eta, sl, st, tau: float = 0.75) -> dict:
    """A plan's sparse, dense and warmup steps on CPU inputs, run on the plan's device, against ``ref_range``: kept
    counts equal (``kept_ref``), the outputs' relative errors and theta's largest relative error."""
    ref, ref_kept, ref_dense, ref_theta = ref_range(q, k, v, eta, kern.scale, sl, st, False, tau)
    q, k, v, eta, sl, st = (t.to(kern.device) for t in (q, k, v, eta, sl, st))
    out, kept = kern.sparse(q, k, v, eta, sl, st)
    dense = kern.dense(q, k, v, sl, st)
    warm_out, theta = kern.warmup(q, k, v, tau, sl, st)
    return dict(kept_ref=bool(torch.equal(kept.cpu(), ref_kept)), err=rel(out.cpu(), ref),
                dense_err=rel(dense.cpu(), ref_dense), warm_err=rel(warm_out.cpu(), ref_dense),
                theta_err=float(((theta.cpu().double() - ref_theta).abs() / ref_theta.abs().clamp_min(1e-30)).max()))


def capacity_results(config) -> list[dict]:
    """Plans for a larger capacity than the cache (transformers' growing cache: ``hf.plan_capacity``)
    against float64: the sparse, dense and warmup steps read only keys below each row's length."""
    from siftattention.hf import plan_capacity
    from siftattention.kernels import DecodeKernels

    res = []
    # MHA float32, GQA 4 bfloat16; ragged starts and lengths; then a plan whose grids are sized for 16-key rows
    # (a sliding window's plan), which must stay exact on the longer rows it is given here.
    for i, span in ((0, None), (2, None), (0, 16), (2, 16)):
        B, Hq, Hkv, S, D, dt = PLAN_CASES[i]
        gen = torch.Generator().manual_seed(91 + i)
        dtype = getattr(torch, dt)
        q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, dtype, gen)
        # Keys past each row's length are NaN: reading one would show in every output.
        k[:, :, S - 3:], v[:, :, S - 3:] = float("nan"), float("nan")
        sl = sl.clamp(max=S - 3)
        st = torch.minimum(st, sl - 1)
        eta = range_eta(q, k, D**-0.5, sl, st, gen)
        kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=plan_capacity(S), head_dim=D, dtype=dtype,
                                  device="cpu", scale=D**-0.5, backend="triton", config=config, max_range=span)
        res.append(dict(case=i, dtype=dt, capacity=kern.max_len, span=span, longest=int((sl - st).max()),
                        **three_steps_against_float64(kern, q, k, v, eta, sl, st)))
    return res


def crafted_score_rows(gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores [3, 4, 61] whose order statistics sit where the radix select branches, with taus and seq_lens.

    Around 2**16 a float32 step is 2**-7, so a neighbouring order statistic moves p by 0.5%:
    consecutive floats (the next key in the k-th key's last-digit bucket), keys 256 steps
    apart (in the next 24-bit bucket), all ties, tie groups, negatives, signed zeros, a
    random row with tau = 1 (no next key), keys spread over many 16-bit buckets, and keys
    each in a 16-bit bucket of its own.
    Positions past a row's length hold NaN, which no pass may read.
    """
    S, base, step = 61, 2.0**16, 2.0**-7
    j = torch.arange(S, dtype=torch.float64)

    def shuffled(x):
        return x[torch.randperm(x.numel(), generator=gen)]

    rows = [
        shuffled(base + step * j),
        shuffled(base + 256 * step * j),
        torch.full((S,), base, dtype=torch.float64),
        shuffled(base + step * torch.div(j, 5, rounding_mode="floor")),
        shuffled(-base - step * j),
        torch.tensor([-0.0, 0.0, 1e-3, -1e-3, 2.5], dtype=torch.float64)[torch.randint(0, 5, (S,), generator=gen)],
        torch.randn(S, generator=gen, dtype=torch.float64) * 4,
        base + step * torch.randint(0, 40000, (S,), generator=gen).double(),
        # Near 1 two digits span 2**-7: keys 0.01 apart sit in different two-digit buckets.
        shuffled(1.0 + 0.01 * j),
        shuffled(1.0 + 0.01 * torch.div(j, 3, rounding_mode="floor")),
        shuffled(-1.0 - 0.01 * j),
        torch.randn(S, generator=gen, dtype=torch.float64) * 0.5,
    ]
    scores = torch.stack(rows).float().reshape(3, 4, S)
    seq_lens = torch.tensor([S, 29, 45])
    scores[1, :, 29:] = float("nan")
    scores[2, :, 45:] = float("nan")
    tau = torch.tensor([[0.875, 0.5, 0.3, 0.875], [0.1, 0.6, 1.0, 0.875], [0.875, 0.5, 0.3, 0.875]],
                       dtype=torch.float64)
    return scores, tau, seq_lens


def radix_select_variants(parallel: bool, full: bool = True) -> list[dict]:
    """Quantile-kernel configurations for ``radix_select_results``; ``parallel``: rows cut into
    chunks (on the GPU; the interpreter runs one program per row); ``full``: the sampled bracket
    at its production sizes too."""
    variants = [dict(quantile_parallel=parallel, quantile_sparse_from=sparse_from, quantile_sample=0)
                for sparse_from in (0, 2, 4)]
    # The sampled bracket: 0 and 2 sample ranks either side (often missed: the full select
    # runs), 32 (the default; rarely), 8 of a sample of 64 (keys outside the bracket in the last bucket).
    # Not full, 32-key samples only: margins 0, 2 and 4 miss on 7, 1 and 0 of the 12 crafted rows
    # (256 / 0, 512 / 2 and 512 / 32 on 4, 1 and 0), and 4 leaves keys outside the bracket in the
    # last bucket on the rows where 8 of 64 does.
    brackets = ((256, 0), (512, 2), (512, 32), (64, 8)) if full else ((32, 0), (32, 2), (32, 4))
    variants += [dict(quantile_parallel=parallel, quantile_sample=sample, quantile_margin=margin)
                 for sample, margin in brackets]
    # Digits of 12 bits (up to 3 passes) and 4 bits (up to 8) inside the bracket (not full: 32-key
    # samples, with margins that miss and leave keys in the last bucket as those of 64 keys do).
    sample, digits = (64, ((8, 12), (2, 12), (8, 4))) if full else (32, ((4, 12), (2, 12), (4, 4)))
    variants += [dict(quantile_parallel=parallel, quantile_sample=sample, quantile_margin=margin,
                      quantile_bracket_bits=bits, quantile_long_row=0) for margin, bits in digits]
    return variants


def radix_select_results(device: str = "cpu", variants: list[dict] | None = None, repeat=lambda i: True) -> list[dict]:
    """The radix select alone on crafted scores: theta against float64 torch.quantile, and the
    histogram state left for the next call, for every kernel form and atomic-pass choice; the
    variants where ``repeat(index)`` holds run a second call on the same workspace, which must give
    the same theta and leave the same state."""
    from siftattention.kernels import triton_decode as td
    from siftattention.kernels.triton_quantile import quantile_pass

    gen = torch.Generator().manual_seed(5)
    scores, tau, seq_lens = crafted_score_rows(gen)
    B, Hq, S = scores.shape
    dev = torch.device(device)
    out = []
    for i, variant in enumerate(variants or radix_select_variants(False, FULL)):
        cfg = td.KernelConfig(**{**SMALL, **variant})
        geo = td.geometry(B, Hq, Hq, S, 64, torch.float32, dev, cfg)
        ws = td.Workspace(geo, dev)
        ws.scores.copy_(scores)
        valid = torch.arange(S)[None, None, :] < seq_lens[:, None, None]
        m = torch.where(valid, scores, float("-inf")).amax(-1)
        l = torch.where(valid, torch.exp2(scores - m[..., None]), 0.0).sum(-1)
        ws.mst.fill_(float("-inf")), ws.lst.zero_()
        ws.mst[..., 0], ws.lst[..., 0] = m, l
        p = torch.exp2(scores.double() - m.double()[..., None]) / l.double()[..., None]
        want = torch.tensor([[float(torch.quantile(p[b, h, : seq_lens[b]], tau[b, h])) for h in range(Hq)]
                             for b in range(B)], dtype=torch.float64)
        row = dict(variant, chunks=geo["NQ"], repeat_equal=True, hist_nonzero=0, next_reset=True)
        thetas = []
        for _ in range(2 if repeat(i) else 1):
            thetas.append(quantile_pass(geo, ws, tau.to(dev), seq_lens.int().to(dev), None, cfg).cpu())
            row["hist_nonzero"] += int(ws.qhist.count_nonzero() + ws.qbracket.count_nonzero() + ws.qsync.count_nonzero())
            row["next_reset"] &= bool((ws.qnext == 2**31 - 1).all())
        row.update(rel=float(((thetas[0].double() - want).abs() / want).max()), repeats=len(thetas) - 1,
                   repeat_equal=all(torch.equal(thetas[0], t) for t in thetas))
        out.append(row)
    return out


def radix_repeats(i: int) -> bool:
    """Which of ``radix_select_variants``' configurations the interpreter calls twice: by default the
    first of each group (full select, sampled bracket, bracket digits), with SIFT_FULL_KERNEL_TESTS=1 all;
    the state every call leaves is checked on all."""
    return FULL or i in (0, 3, 6)


@pytest.fixture(scope="module")
def triton_results():
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed: the Triton kernels cannot be checked (pip install triton)")
    merged: dict = {}
    for part in run_interpreted_parts(__file__, "--triton-worker", list(TRITON_PARTS)):
        for key, value in part.items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            else:  # counters: summed over the subprocesses
                merged[key] = merged.get(key, 0) + value
    return merged


@interpreted_parts
def test_triton_decode_matches_float64(triton_results):
    rows = triton_results["decode"]
    assert len(rows) == len(TRITON_CASES) * sum(map(len, DECODE_RENORMS.values()))
    assert {(r["case"], r["mode"], r["renorm"]) for r in rows} == {
        (i, mode, renorm) for i in range(len(TRITON_CASES)) for mode, renorms in DECODE_RENORMS.items() for renorm in renorms}
    for r in rows:
        tol = 1e-5 if r["dtype"] == "float32" else 1e-2
        assert r["err"] < tol, r
        assert r["kept_equal"], r
        assert r["out_dtype"] == "torch." + r["dtype"], r


@interpreted_parts
def test_triton_warmup_leaves_the_anchored_gap(triton_results):
    """The gap an exact (warmup) step leaves for the anchored normaliser, from the workspace, against float64."""
    rows = triton_results["warmup_gap"]
    assert {r["warmup_dense"] for r in rows} == {True, False} and len(rows) >= 5
    for r in rows:
        assert r["err"] < 1e-4, r


@interpreted_parts
def test_triton_interleaved_cases_interleave(triton_results):
    """The cases that ask for interleaved filter splits get chunks (else they would test contiguous splits)."""
    chunks = dict(triton_results["chunks"])
    assert sorted(chunks) == list(range(len(TRITON_CASES)))
    for i, (_, _, _, _, _, _, over) in enumerate(TRITON_CASES):
        assert (chunks[i] > 0) == ("interleave2" in over), (over, chunks[i])


def test_interleave_chunk_rule():
    from siftattention.kernels.triton_config import _chunk

    assert _chunk(256, 32768, 16) == 256 and _chunk(0, 32768, 16) == 0
    assert _chunk(256, 2048, 16) == 128  # every split of a full row gets a chunk
    assert _chunk(200, 100000, 4) == 256  # rounded up to a power of two
    assert _chunk(256, 100, 16) == 0  # rows too short for chunks of 8: contiguous splits
    # With at least 4 runs a split: B = 1, S = 8192 (+ 256 new keys) has 16 splits of ~528 keys.
    assert _chunk(256, 8448, 16, runs=4) == 128 and _chunk(256, 16640, 16, runs=4) == 256
    assert _chunk(256, 32768, 8, runs=4) == 256  # longer splits keep the full chunk
    assert _chunk(256, 600, 16, runs=4) == 8 and _chunk(256, 100, 16, runs=4) == 0  # the floor and the fallback


def test_h200_plan_shortens_runs_only_for_short_b1_rows():
    """The H200's plans (132 SMs): 128-key runs at B = 1 with an 8448-key cache, 256 on the longer shapes."""
    from siftattention.kernels.triton_config import KernelConfig, _plan

    def chunk(B, Hkv, S):
        return _plan(B, 32, Hkv, S, 128, torch.bfloat16, 132, True, False, KernelConfig())["CHUNK2"]

    assert chunk(1, 8, 8448) == 128
    assert chunk(1, 8, 16640) == chunk(1, 8, 32768) == chunk(8, 8, 33024) == chunk(16, 8, 33024) == chunk(8, 32, 8192) == 256
    with pytest.raises(ValueError, match="interleave2_runs"):
        KernelConfig(interleave2_runs=0)


@interpreted_parts
def test_triton_reused_counters_return_to_zero(triton_results):
    assert triton_results["sync_buffers"] >= 2  # one per (device, stream, rows) shape seen, summed over processes
    assert triton_results["sync_nonzero"] == 0
    assert triton_results["sync_nonzero_after_failure"] == 0


@interpreted_parts
def test_triton_warmup_matches_float64(triton_results):
    rows = triton_results["warmup"]
    assert len(rows) == 10
    for r in rows:
        assert r["err"] < (1e-5 if r["dtype"] == "float32" else 1e-2), r
        # float32 scores of fp16/bf16 inputs vs float64 scores: p differs by ~1e-6 relative
        assert r["theta_rel"] < 1e-5, r


@interpreted_parts
def test_triton_warmup_quantile_exact_scores(triton_results):
    rows = triton_results["exact"]
    assert len(rows) == 5 + 4
    for r in rows:
        assert math.isfinite(r["ulps"]) and r["ulps"] <= 8, r


def check_radix_rows(rows: list[dict], n: int) -> None:
    assert len(rows) == n
    for r in rows:
        # A neighbouring order statistic would be off by 0.5%; float32 exp2 and the interpolation by ~1e-7.
        assert r["rel"] < 2e-6, r
        assert r["repeat_equal"] and r["hist_nonzero"] == 0 and r["next_reset"], r


@interpreted_parts
def test_triton_radix_select_on_crafted_scores(triton_results):
    rows = triton_results["radix"]
    check_radix_rows(rows, len(radix_select_variants(False, FULL)))
    assert [r["repeats"] for r in rows] == [int(radix_repeats(i)) for i in range(len(rows))]


@interpreted_parts
def test_triton_plan_matches_float64(triton_results):
    check_plan_rows(triton_results["plan"], 2 * len(PLAN_CASES), lean=not FULL)
    check_plan_rows(triton_results["plan_interleaved"], 2 * len(PLAN_CASES), exact=False, lean=not FULL)
    for r in triton_results["persistent"]:
        assert r["persistent"] and r["out_equal"] and r["kept_equal"] and r["kept_ref"], r
        assert r["err"] < (1e-5 if r["dtype"] == "float32" else 1e-2), r
    assert [r["span"] for r in triton_results["capacity"]] == [None, None, 16, 16]
    for r in triton_results["capacity"]:
        tol = 1e-5 if r["dtype"] == "float32" else 1e-2
        assert r["capacity"] >= 128 and r["kept_ref"], r
        assert r["span"] is None or r["longest"] > r["span"], r  # rows longer than the plan's range, still exact
        assert max(r["err"], r["dense_err"], r["warm_err"]) < tol and r["theta_err"] < 1e-4, r


# ----------------------------------------------------------------------------- CUDA (skipped without a GPU)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_CASES = PLAN_CASES + [(2, 32, 8, 3001, 128, "float16"), (1, 32, 8, 20011, 128, "bfloat16"),
                           (4, 32, 32, 1500, 128, "float16"),
                           (16, 9, 3, 8191, 64, "bfloat16"),  # SmolLM2's heads: dense splits of min_splitd_narrow
                           (8, 12, 2, 16383, 128, "bfloat16")]  # Qwen2.5-1.5B's: the packed scan with two padded heads


@needs_cuda
@pytest.mark.parametrize("Hq,Hkv,D,dt", [(4, 1, 256, "bfloat16"), (12, 2, 128, "float16"), (9, 3, 64, "bfloat16")])
def test_cuda_window_plans_match_float64(Hq, Hkv, D, dt):
    # Sliding-window rows (the last 333 keys of a 3001-key cache, Gemma-3's and other layouts) under a plan sized
    # for the window, and two rows longer than it, which the plan must still serve exactly: all three steps.
    from siftattention.kernels import DecodeKernels

    B, S, W, dtype = 6, 3001, 333, getattr(torch, dt)
    gen = torch.Generator().manual_seed(67 + D)
    q, k, v, _ = make_case(B, Hq, Hkv, S, D, dtype, gen, ragged=False)
    sl = torch.randint(W + 1, S + 1, (B,), generator=gen).int()
    st = (sl - W).clamp(min=0).int()
    sl[0], st[0] = S, 0  # the whole cache
    st[1] = max(0, int(sl[1]) - 2 * W)  # twice the window
    eta = range_eta(q, k, D**-0.5, sl, st, gen)
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=dtype, device="cuda",
                              scale=D**-0.5, max_range=W)
    whole = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=dtype, device="cuda",
                               scale=D**-0.5)
    assert kern.geometry["ns1"] < whole.geometry["ns1"]
    r = three_steps_against_float64(kern, q, k, v, eta, sl, st)
    assert r["kept_ref"]
    tol = 1e-2
    assert max(r["err"], r["dense_err"], r["warm_err"]) < tol
    assert r["theta_err"] < 1e-4


@needs_cuda
def test_cuda_plan_matches_float64():
    check_plan_rows(plan_results("cuda", "triton", CUDA_CASES), 2 * len(CUDA_CASES))


@needs_cuda
def test_cuda_radix_select_in_row_chunks():
    """The cooperative quantile: each crafted row cut into 3 chunks whose programs meet after each digit."""
    variants = [dict(v, min_splitq=16, quantile_resident=4) for v in radix_select_variants(True)]
    rows = radix_select_results("cuda", variants)
    check_radix_rows(rows, len(variants))
    assert all(r["chunks"] == 3 for r in rows if r["quantile_sample"] > 0), rows


@needs_cuda
def test_cuda_graph_capture_of_plans():
    """Two plans and one plan used twice, all three steps, captured in one CUDA graph on one
    stream; replayed on two fresh input sets (the counters must be back at zero in between)."""
    from siftattention.kernels import DecodeKernels

    dev = torch.device("cuda")
    shapes = [(2, 32, 8, 2000, 128), (3, 8, 8, 777, 64)]
    plans, static = [], []
    for (B, Hq, Hkv, S, D) in shapes:
        plans.append(DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=torch.float16,
                                        device=dev, scale=D**-0.5))
        for _ in range(2):  # two "layers" of this shape share its plan
            static.append(dict(q=torch.empty(B, Hq, D, dtype=torch.float16, device=dev),
                               k=torch.empty(B, Hkv, S, D, dtype=torch.float16, device=dev),
                               v=torch.empty(B, Hkv, S, D, dtype=torch.float16, device=dev),
                               eta=torch.empty(B, Hq, device=dev), sl=torch.empty(B, dtype=torch.int32, device=dev),
                               st=torch.empty(B, dtype=torch.int32, device=dev)))
    owners = [0, 0, 1, 1]
    gen = torch.Generator().manual_seed(51)

    def fill():
        refs = []
        for x, o in zip(static, owners):
            B, Hq, Hkv, S, D = shapes[o]
            q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, torch.float16, gen)
            eta = range_eta(q, k, D**-0.5, sl, st, gen)
            for name, val in (("q", q), ("k", k), ("v", v), ("eta", eta), ("sl", sl), ("st", st)):
                x[name].copy_(val)
            refs.append(ref_range(q, k, v, eta, D**-0.5, sl, st, tau=0.875))
        return refs

    def step():
        outs = []
        for x, o in zip(static, owners):
            kern = plans[o]
            out, kept = kern.sparse(x["q"], x["k"], x["v"], x["eta"], x["sl"], x["st"])
            dense = kern.dense(x["q"], x["k"], x["v"], x["sl"], x["st"])
            w_out, theta = kern.warmup(x["q"], x["k"], x["v"], 0.875, x["sl"], x["st"])
            outs.append((out, kept, dense, w_out, theta))
        return outs

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        outs = step()
    for _ in range(2):
        refs = fill()
        graph.replay()
        torch.cuda.synchronize()
        for (out, kept, dense, w_out, theta), (ref, ref_kept, ref_dense, ref_th) in zip(outs, refs):
            assert rel(out.cpu(), ref) < 1e-2 and torch.equal(kept.cpu(), ref_kept)
            assert rel(dense.cpu(), ref_dense) < 1e-2 and rel(w_out.cpu(), ref_dense) < 1e-2
            assert float(((theta.cpu().double() - ref_th).abs() / ref_th).max()) < 1e-5
    for kern in plans:  # counters and quantile buffers at rest for the next replay
        assert workspace_at_rest(kern.workspace)


if __name__ == "__main__" and "--triton-worker" in sys.argv:
    print(json.dumps(_triton_worker(sys.argv[sys.argv.index("--triton-worker") + 1])))


def test_every_kernel_variant_compiles_for_sm90():
    # Triton's interpreter runs code its GPU compiler rejects: compile what the H200's launch
    # plan launches, for sm_90, with no GPU (tests/sm90_compile.py stands in for the driver).
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    from triton.runtime import jit

    if not hasattr(jit.JITFunction, "_do_compile"):
        pytest.skip(f"triton {triton.__version__} compiles through another internal path than the one the check replaces")
    res = run_json_script(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_compile.py"), interpret=False)
    assert res["failures"] == [], res["failures"][0]["error"]
    assert {c["kernel"] for c in res["compiled"]} == set(res["kernels"])  # every kernel reached
    # Compiling a step ahead asks for the very variants its launches need, and launches nothing.
    assert res["compile_ahead_gaps"] == {}
    too_big = [c for c in res["compiled"] if c["shared"] > res["max_shared"]]
    assert not too_big, too_big
