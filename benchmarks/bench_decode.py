"""Decode-step benchmark: SiftAttention Triton kernels vs torch SDPA vs top-k decode.

One command on a CUDA machine, from the repository root:

    PYTHONPATH=. python3 benchmarks/bench_decode.py --out results.json            # full sweep
    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --out q.json          # target settings
    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --heads 32,8 --group-corr 0.5 0.9   # correlated GQA heads
    PYTHONPATH=. python3 benchmarks/bench_decode.py --check                       # GPU correctness suite
    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --keybound            # + the key-bound step (int8 key scan)
    PYTHONPATH=. python3 benchmarks/bench_decode.py --check --keybound            # + its correctness cases
    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --keybound channel    # per-channel int8 scales and offsets
    PYTHONPATH=. python3 benchmarks/bench_decode.py --tune                        # per-pass config sweep
    PYTHONPATH=. python3 benchmarks/bench_decode.py --tune-grid                   # whole-step KernelConfig grid
    PYTHONPATH=. python3 benchmarks/bench_decode.py --ncu --batch 8 --seq 32768   # DRAM bytes (Nsight Compute)

The sift, dense and warmup steps run through ``DecodeKernels`` (planned once per
shape, as the generation loop runs them). Times are GPU time: medians of CUDA-graph
replays of each side, measured in the same run (``--eager`` adds Python-launched
timings). Each row also gives the byte-floor ratio: measured time over (bytes that
must be read / device-to-device copy bandwidth measured at the start of the run),
with K + V for SDPA and the dense kernel, and K + (V rows some head of the group
keeps) for sift (the float32 scores are not counted: they may stay in L2).

Inputs are random but peaky (logit std ``--logit-std``, default 3): flat random
attention would make every threshold meaningless. Per head, eta is placed in the
widest log-gap among the 33 sorted probabilities around the target rank, so the
realized sparsity is the target to within 16 / S and float32 rounding cannot flip a
decision; the kernel's ``kept`` must equal the float64 count exactly. Every config's
output is checked against a float64 reference before it is timed. Timings are
medians of ``triton.testing.do_bench`` rotating ``--sets`` input sets (more than L2).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from siftattention.kernels import DecodeKernels, sift_decode, sift_warmup_decode
from siftattention.kernels import triton_decode as td
from siftattention.kernels.keybound import Int8Keys, keybound_bytes, keybound_step_torch, quantize_keys
from siftattention.kernels.plan import PowerLawThreshold
from siftattention.kernels.torch_ref import anchor_gap_torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Dry runs of this script's logic on a CPU: BENCH_DEVICE=cpu TRITON_INTERPRET=1 (tiny shapes).
DEV = os.environ.get("BENCH_DEVICE", "cuda")


# ----------------------------------------------------------------------------- data


def kernel_overrides(text: str) -> dict:
    """argparse type: a JSON object of ``KernelConfig`` fields, checked before any work starts."""
    from dataclasses import fields

    try:
        over = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(over, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of KernelConfig fields")
    unknown = sorted(set(over) - {f.name for f in fields(td.KernelConfig)})
    if unknown:
        raise argparse.ArgumentTypeError(f"not KernelConfig fields: {', '.join(unknown)}")
    try:
        td.KernelConfig(**over)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return over


def use_kernel_overrides(over: dict) -> None:
    """Every later kernel plan of this process takes ``over`` on top of its device's own launch parameters."""
    from dataclasses import replace

    from siftattention.kernels import triton_config

    triton_config._DEFAULT = replace(triton_config._DEFAULT, **over)
    for device_over in triton_config.DEVICE_CONFIGS.values():
        device_over.update(over)


def make_inputs(B, Hq, Hkv, S, D, dtype, logit_std, group_corr, gen):
    """Peaky scores: k ~ N(0, 1), q ~ N(0, logit_std^2), heads of a group correlated."""
    dev = DEV
    G = Hq // Hkv
    k = torch.randn(B, Hkv, S, D, device=dev, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, device=dev, generator=gen).to(dtype)
    shared = torch.randn(B, Hkv, 1, D, device=dev, generator=gen)
    own = torch.randn(B, Hkv, G, D, device=dev, generator=gen)
    q = (group_corr * shared + math.sqrt(1 - group_corr**2) * own) * logit_std
    return q.reshape(B, Hq, D).to(dtype), k, v


def captured_inputs(path, B, n_sets, dtype):
    """``n_sets`` (q, k, v) of real attention: the last captured step of successive layers, tiled over B rows."""
    from siftattention.capture import CapturedAttention

    cap = CapturedAttention.load(path, device=DEV)
    sets = []
    for i in range(n_sets):
        q, k, v = cap.step(cap.layers[i % len(cap.layers)])
        sets.append(tuple(t[:1].expand(B, *t.shape[1:]).contiguous().to(dtype) for t in (q, k, v)))
    return sets, cap


def ref_scores64(q, k, b):
    """float64 scaled scores of batch row b: [Hq, S]."""
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k.shape[1]
    G = Hq // Hkv
    s = torch.matmul(q[b].double().reshape(Hkv, G, D), k[b].double().transpose(-1, -2))
    return s.reshape(Hq, -1) * D**-0.5


def thresholds(q, k, sparsities, seq_lens=None, window=16):
    """Per-head eta for each target sparsity, placed in the widest log-gap near the rank.

    Returns a list (one per sparsity) of (eta [B, Hq], kept [B, Hq] (exact float64
    count), fraction of V rows that some head of their group keeps).
    """
    B, Hq, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    res = [[torch.zeros(B, Hq, device=q.device), torch.zeros(B, Hq, dtype=torch.int32, device=q.device), 0] for _ in sparsities]
    total = 0
    for b in range(B):
        n = S if seq_lens is None else int(seq_lens[b])
        total += Hkv * n
        s = ref_scores64(q, k[:, :, :n], b)
        lse = torch.logsumexp(s, dim=-1)
        srt = torch.sort(s, dim=-1).values  # ascending
        for i, sp in enumerate(sparsities):
            if sp <= 0 or n == 1:  # eta = 0: every key kept
                res[i][1][b] = n
                res[i][2] += Hkv * n
                continue
            target = n - max(1, round((1 - sp) * n))  # rank of the largest dropped key
            lo, hi = max(0, target - window), min(n - 2, target + window)
            gaps = srt[:, lo + 1 : hi + 2] - srt[:, lo : hi + 1]
            r = lo + gaps.argmax(dim=-1)  # drop ranks 0..r
            mid = (srt.gather(1, r[:, None]) + srt.gather(1, r[:, None] + 1)).squeeze(1) / 2
            res[i][0][b] = torch.exp(mid - lse).float()
            keep = s > mid[:, None]
            res[i][1][b] = keep.sum(-1).int()
            res[i][2] += int(keep.reshape(Hkv, G, n).any(dim=1).sum())
    return [(e, kp, u / total) for e, kp, u in res]


def ref_out64(q, k, v, eta, b, renormalize=False):
    s = ref_scores64(q, k, b)
    p = torch.softmax(s, dim=-1)
    keep = p > eta[b, :, None].double()
    keep.scatter_(-1, s.argmax(-1, keepdim=True), True)
    w = torch.where(keep, p, 0.0)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    Hkv, D = v.shape[1], v.shape[3]
    G = q.shape[1] // Hkv
    return torch.matmul(w.reshape(Hkv, G, -1), v[b].double()).reshape(-1, D)


def oracle_gaps(q, k, first, last):
    """float32 [B, Hq] gap ``logsumexp(s) - logsumexp(s over the anchors)`` of this very step (float64):
    handed to the anchored step it predicts the normaliser exactly, so its kept keys are the exact filter's."""
    scale = q.shape[-1] ** -0.5
    return torch.cat([anchor_gap_torch(q[b : b + 1].double(), k[b : b + 1].double(), scale, None, None, first, last)
                      for b in range(q.shape[0])])


def rel_err(a, b):
    return float((a.double() - b).norm() / b.norm())


# ----------------------------------------------------------------------------- baselines


def sdpa_decode(q, k, v):
    return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=q.shape[1] != k.shape[1])[:, :, 0]


def topk_decode(q, k, v, kk):
    """Top-k decode (renormalised over the kept keys): scores, topk, gather V, attend."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    s = torch.matmul(q.reshape(B, Hkv, G, D), k.transpose(-1, -2)) * D**-0.5  # [B,Hkv,G,S]
    vals, idx = torch.topk(s, kk, dim=-1, sorted=False)
    p = torch.softmax(vals.float(), dim=-1).to(q.dtype)
    vg = torch.gather(v[:, :, None].expand(B, Hkv, G, S, D), 3, idx[..., None].expand(B, Hkv, G, kk, D))
    return torch.matmul(p[..., None, :], vg).reshape(B, Hq, D)


# ----------------------------------------------------------------------------- timing


def bench(fn, sets, warmup=25, rep=100):
    rep = int(os.environ.get("BENCH_REP_MS", rep))
    import triton

    it = itertools.cycle(range(len(sets)))
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn(*sets[next(it)])
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(lambda: fn(*sets[next(it)]), warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, sets):
    """Median time of CUDA-graph replays of fn (one graph per input set): no launch overhead."""
    if DEV != "cuda":  # CPU dry runs of the script's logic
        return bench(fn, sets)
    graphs = []
    for args in sets:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*args)
            fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):  # the warm-up stream: per-stream buffers exist already
            fn(*args)
        graphs.append(g)
    return bench(lambda g: g.replay(), [(g,) for g in graphs])


def bytes_dense(B, Hkv, S, D, esize):
    return 2 * B * Hkv * S * D * esize


def copy_bandwidth(nbytes=2 << 30):
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), measured here."""
    if DEV != "cuda":
        return float("nan")
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=DEV).normal_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), [()], warmup=25, rep=200)
    x = y = None  # noqa: F841 - free the buffers before the sweep
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def planned(q, k, cfg=None, renormalize=False):
    """The kernels for this shape, planned once (as the generation loop does)."""
    B, Hq, D = q.shape
    return DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=k.shape[1], max_len=k.shape[2], head_dim=D, dtype=q.dtype,
                              device=q.device, scale=D**-0.5, renormalize=renormalize, backend="triton", config=cfg)


def full_lens(B, S):
    return torch.full((B,), S, dtype=torch.int32, device=DEV)


# ----------------------------------------------------------------------------- modes


def run_check(args):
    """Correctness of the Triton path on odd shapes vs float64 (and the torch backend), then the CUDA tests."""
    base = td.config_for(torch.device(DEV))
    other = td.KernelConfig(**{**base.__dict__, "pdl": not base.pdl, "warmup_dense": not base.warmup_dense})
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows, fails = [], 0
    cases = [
        # B, Hq, Hkv, S, D, dtype, ragged, noncontig
        (1, 4, 4, 1, 64, torch.float16, False, False),
        (3, 8, 8, 1000, 64, torch.float16, True, False),
        (2, 16, 4, 4097, 128, torch.bfloat16, True, False),
        (4, 32, 4, 3001, 128, torch.float16, True, True),
        (2, 32, 32, 777, 128, torch.float32, False, False),
        (2, 16, 2, 20000, 64, torch.bfloat16, False, True),
        (1, 28, 4, 333, 96, torch.float16, True, False),
        (1, 32, 8, 65537, 128, torch.float16, True, False),
        (1, 32, 8, 8200, 128, torch.bfloat16, True, False),  # B = 1: filter splits of 128-key runs
        (2, 32, 16, 5000, 128, torch.bfloat16, True, False),
        (3, 4, 1, 2051, 256, torch.float32, True, False),  # Gemma-3's heads: 256 wide, one KV head
        (2, 8, 2, 9000, 256, torch.bfloat16, True, True),
        (3, 9, 3, 8191, 64, torch.bfloat16, True, False),  # SmolLM2's heads: GQA 3
        (2, 12, 2, 16385, 128, torch.bfloat16, True, False),  # Qwen2.5-1.5B's heads: GQA 6
    ]
    if DEV != "cuda":  # CPU dry run under the interpreter: the small cases only
        cases = [c for c in cases if c[0] * c[1] * c[3] <= 8000]
    for (B, Hq, Hkv, S, D, dt, ragged, nc) in cases:
        q, k, v = make_inputs(B, Hq, Hkv, S + (5 if nc else 0), D, dt, 3.0, 0.3, gen)
        if nc:  # a slice of a longer cache: non-contiguous along S
            k, v = k[:, :, 2 : S + 2], v[:, :, 2 : S + 2]
        sl = torch.randint(1, S + 1, (B,), device=DEV, generator=gen) if ragged else None
        ths = thresholds(q, k, (0.0, 0.5, 0.9, 0.999), sl)
        tol = 2e-5 if dt == torch.float32 else 1e-2
        for sp, (eta, kept_ref, _) in zip((0.0, 0.5, 0.9, 0.999), ths):
            for renorm in (False, True):
                out, kept = sift_decode(q, k, v, eta, seq_lens=sl, renormalize=renorm, backend="triton")
                out_t, kept_t = sift_decode(q, k, v, eta, seq_lens=sl, renormalize=renorm, backend="torch")
                out_o, kept_o = td.sift_decode_triton(q, k, v, eta.float(), D**-0.5, None if sl is None else sl.int(), renorm, other)
                errs = []
                for b in range(B):
                    n = S if sl is None else int(sl[b])
                    r = ref_out64(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], eta[b : b + 1], 0, renorm)
                    errs.append(max(rel_err(out[b], r), rel_err(out_o[b], r)))
                err = max(errs)
                kept_ok = all(bool((x == kept_ref).all()) for x in (kept, kept_t, kept_o))
                ok = err < tol and kept_ok and bool(torch.isfinite(out).all())
                fails += not ok
                rows.append(dict(case=[B, Hq, Hkv, S, D, str(dt), ragged, nc], sparsity=sp, renorm=renorm, err=err, kept_ok=kept_ok, ok=ok))
                if args.keybound and D <= 256:
                    row = keybound_check(q, k, v, eta, sl, kept_ref, renorm, tol, args.keybound == "channel")
                    fails += not row["ok"]
                    rows.append(dict(case=[B, Hq, Hkv, S, D, str(dt), ragged, nc], sparsity=sp, renorm=renorm, **row))
        # eta edges: <= 0 keeps every valid key, >= 1 the maximum only, in both backends
        n_valid = (torch.full((B,), S, device=DEV) if sl is None else sl)[:, None].expand(B, Hq).int()
        for e in (-1.0, 0.0, 1.0, 3.0):
            eta = torch.full((B, Hq), e, device=DEV)
            _, kept = sift_decode(q, k, v, eta, seq_lens=sl, backend="triton")
            _, kept_t = sift_decode(q, k, v, eta, seq_lens=sl, backend="torch")
            want = n_valid if e <= 0 else torch.ones_like(n_valid)
            ok = bool(torch.equal(kept, want)) and bool(torch.equal(kept_t, want))
            fails += not ok
            rows.append(dict(case=[B, Hq, Hkv, S, D, str(dt), ragged, nc], eta=e, ok=ok))
        # the dense kernel (planned) against float64, and the warmup in both of its forms
        sl_i = (full_lens(B, S) if sl is None else sl.int())
        dense_out = planned(q, k).dense(q, k, v, sl_i)
        derr = 0.0
        for b in range(B):
            n = S if sl is None else int(sl[b])
            derr = max(derr, rel_err(dense_out[b], ref_out64(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], torch.zeros(1, Hq, device=DEV), 0)))
        ok = derr < tol
        fails += not ok
        rows.append(dict(case=[B, Hq, Hkv, S, D, str(dt), ragged, nc], dense_err=derr, ok=ok))
        for tau in (0.5, 0.875, 0.99):
            for cfg in (base, other):
                out, th = td.sift_warmup_decode_triton(q, k, v, torch.full((B, Hq), tau, device=DEV, dtype=torch.float64),
                                                       D**-0.5, None if sl is None else sl.int(), cfg)
                terr, oerr = 0.0, 0.0
                for b in range(B):
                    n = S if sl is None else int(sl[b])
                    s = ref_scores64(q[b : b + 1], k[b : b + 1, :, :n], 0)
                    p = torch.softmax(s, -1)
                    th_ref = torch.quantile(p, tau, dim=-1)
                    terr = max(terr, float(((th[b].double() - th_ref).abs() / th_ref).max()))
                    oerr = max(oerr, rel_err(out[b], ref_out64(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], torch.zeros(1, Hq, device=DEV), 0)))
                ok = terr < 1e-4 and oerr < tol
                fails += not ok
                rows.append(dict(case=[B, Hq, Hkv, S, D, str(dt), ragged, nc], tau=tau, warmup_dense=cfg.warmup_dense,
                                 theta_rel_err=terr, out_err=oerr, ok=ok))
    for r in rows:
        print(json.dumps(r))
    print(f"CHECK: {len(rows) - fails} passed, {fails} failed", flush=True)
    # DecodeKernels with starts, GQA 1/2/4/8, eta edges, CUDA-graph capture: the CUDA tests of tests/test_kernels.py
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = [os.path.join(root, "tests", f) for f in ("test_kernels.py",) + (("test_keybound.py",) if args.keybound else ())]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
                        "-k", "cuda"], capture_output=True, text=True, cwd=root)
    print(p.stdout[-3000:], p.stderr[-2000:])
    tests_ok = p.returncode == 0
    rows.append(dict(pytest_cuda=p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "", ok=tests_ok))
    fails += not tests_ok
    print(f"CHECK + CUDA tests: {len(rows) - fails} passed, {fails} failed")
    return rows, fails


def keybound_check(q, k, v, eta, sl, kept_ref, renorm, tol, per_channel=False) -> dict:
    """The planned key-bound step against float64: each head's kept count off the exact rule's by at most its
    keys within epsilon of the threshold, the output within tol and the normaliser's factor exp(epsilon)."""
    B, Hq, D = q.shape
    S = k.shape[2]
    kern = planned(q, k, renormalize=renorm)
    sl_i = full_lens(B, S) if sl is None else sl.int()
    keys = quantize_keys(k, per_channel)
    out, kept = kern.sparse_keybound(q, k, v, keys, eta.float(), sl_i)
    ref = keybound_step_torch(q, k, v, keys, eta.float(), D**-0.5, sl_i, renorm)
    eps = ref["epsilon"]
    err, near = 0.0, torch.zeros(B, Hq, dtype=torch.int32, device=DEV)
    for b in range(B):
        n = int(sl_i[b])
        s = ref_scores64(q[b : b + 1], k[b : b + 1, :, :n], 0)
        t = torch.logsumexp(s, -1) + torch.log(eta[b].double())
        near[b] = ((s - t[:, None]).abs() <= eps[b].double()[:, None] + 1e-3).sum(-1).int()
        r = ref_out64(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], eta[b : b + 1], 0, renorm)
        err = max(err, rel_err(out[b], r))
    kept_ok = bool(((kept - kept_ref).abs() <= near).all())
    bound = tol + (0.0 if renorm else 2 * math.expm1(float(eps.max())))
    cand = float(kern.keybound_candidates().double().sum()) / float(sl_i.double().sum() * k.shape[1])
    return dict(keybound=True, err=err, err_bound=bound, kept_ok=kept_ok, kept_equal=bool(torch.equal(kept, kept_ref)),
                eps_max=float(eps.max()), candidates=cand, ok=kept_ok and err < bound and bool(torch.isfinite(out).all()))


def run_tune(args):
    """Time each pass alone (scores kernel, whole sift step, dense kernel, warmup) for the base config."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    results = []
    shapes = [(B, Hq, Hkv, S) for (Hq, Hkv) in (args.heads or [(32, 32), (32, 8)]) for B in (args.batch or [8]) for S in (args.seq or [32768])]
    base = td.config_for(torch.device(DEV))
    for (B, Hq, Hkv, S) in shapes:
        D, dt = 128, torch.float16
        sets = [make_inputs(B, Hq, Hkv, S, D, dt, 3.0, 0.0, gen) for _ in range(args.sets)]
        etas = [thresholds(q, k, [0.875])[0][0] for (q, k, v) in sets]
        kern = planned(sets[0][0], sets[0][1], base)
        geo, ws, sl = kern.geometry, kern.workspace, full_lens(B, S)
        scale = D**-0.5
        row = dict(shape=[B, Hq, Hkv, S], splits=[geo["ns1"], geo["ns2"], geo["nsd"]])
        row["scores_pass"] = bench_graph(lambda q, k, v: td.scores_pass(geo, ws, q, k, scale, sl, None, base, False), sets)
        ws.sync.zero_()  # the scores pass alone advanced the arrival counters (no PDL: unused)
        row["sift_0.875"] = bench_graph(lambda q, k, v, e: kern.sparse(q, k, v, e, sl), [s + (e,) for s, e in zip(sets, etas)])
        row["dense"] = bench_graph(lambda q, k, v: kern.dense(q, k, v, sl), sets)
        row["dense_with_scores"] = bench_graph(lambda q, k, v: td.dense(geo, ws, q, k, v, scale, sl, None, base, True), sets)
        row["warmup"] = bench_graph(lambda q, k, v: kern.warmup(q, k, v, 0.875, sl), sets)
        row["sdpa"] = bench_graph(sdpa_decode, sets)
        row["kv_bytes"] = bytes_dense(B, Hkv, S, D, 2)
        results.append(row)
        print("passes", json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()
    return results


# Default --tune-grid configs (KernelConfig overrides of the device's config), each checked, then timed beside SDPA.
TUNE_GRID = [
    {},
    dict(pdl=False),
    dict(min_split2=1024),
    dict(min_split2=1024, programs2=16),
    dict(block_n2=64),
]


def kernel_resources() -> list:
    """Registers, spills and shared memory of every compiled decode kernel (Triton's caches)."""
    from siftattention.kernels import triton_dense, triton_filter, triton_quantile, triton_scores

    res = []
    for mod, name in ((triton_scores, "_scores_kernel"), (triton_filter, "_filter_kernel"),
                      (triton_quantile, "_quantile_kernel"), (triton_dense, "_dense_kernel")):
        try:
            for dev_cache in getattr(mod, name).device_caches.values():
                for k in dev_cache[0].values():
                    res.append(dict(kernel=name, regs=k.n_regs, spills=k.n_spills, smem=k.metadata.shared,
                                    warps=k.metadata.num_warps, stages=k.metadata.num_stages))
        except Exception as e:  # noqa: BLE001 - Triton's cache layout differs between versions
            res.append(dict(kernel=name, error=repr(e)[:200]))
    return res


def run_tune_grid(args):
    """The planned steps over a grid of KernelConfigs, each checked against float64, timed (graphs) beside SDPA.

    Each grid entry times the sift step at each sparsity; entries that change dense or
    warmup knobs (or ``{}``) also time the dense and warmup steps.
    """
    gen = torch.Generator(device=DEV).manual_seed(6)
    rows = []
    grid = [json.loads(g) for g in args.grid] if args.grid else TUNE_GRID
    shapes = [(B, Hq, Hkv, S) for (Hq, Hkv) in (args.heads or [(32, 32), (32, 8)]) for B in (args.batch or [8]) for S in (args.seq or [8192, 32768])]
    if args.shapes:
        shapes = [tuple(map(int, x.split(","))) for x in args.shapes]
    base = td.config_for(torch.device(DEV))
    # Knobs of the dense kernel and of the warmup (every quantile_* knob too).
    dense_keys = {"block_nd", "warpsd", "stagesd", "programsd", "min_splitd", "residentd", "filld", "whole_wavesd", "wavesd", "warmup_dense",
                  "min_splitd_narrow", "balance_splits",
                  "min_splitq", "evict", "fill", "maxnregd", "maxnregq"}

    def dense_knobs(kw: dict) -> set:
        return {k for k in kw if k in dense_keys or k.startswith("quantile_")}

    scores_keys = {"block_n1", "warps1", "stages1", "programs1", "min_split1", "fill", "resident1", "waves1", "evict", "use_dot",
                   "persist1", "maxnreg1"}
    for (B, Hq, Hkv, S) in shapes:
        D, dt = args.head_dim, torch.float16
        sets = [make_inputs(B, Hq, Hkv, S, D, dt, args.logit_std, (args.group_corr or [0.0])[0], gen) for _ in range(args.sets)]
        sl = full_lens(B, S)
        t_sdpa = bench_graph(sdpa_decode, sets)
        sps = args.sparsity or [0.0, 0.875, 0.95]
        ths = [thresholds(q, k, sps) for (q, k, v) in sets]
        theta_ref = None  # float64 warmup quantile of sets[0], formed once per shape when a config first needs it
        for kw in grid:
            cfg = td.KernelConfig(**{**base.__dict__, **kw})
            try:
                kern = planned(sets[0][0], sets[0][1], cfg)
            except Exception as e:  # noqa: BLE001
                print("fail", kw, repr(e)[:300], flush=True)
                continue
            res = dict(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, cfg=kw, sdpa_graph_ms=t_sdpa, splits=[kern.geometry[x] for x in ("ns1", "ns2", "nsd")])
            if not kw or scores_keys & set(kw):
                geo, ws, scale = kern.geometry, kern.workspace, D**-0.5
                t = bench_graph(lambda q, k, v: td.scores_pass(geo, ws, q, k, scale, sl, None, cfg, False), sets)
                ws.sync.zero_()  # the scores pass alone advanced the arrival counters
                res["scores_pass"] = dict(ms=t, ratio=t / t_sdpa)
            dense_only = bool(kw) and dense_knobs(kw) - {"evict", "fill", "balance_splits"} == set(kw)
            for j, sp in enumerate([] if dense_only else sps):
                etas = [t[j][0] for t in ths]
                q, k, v = sets[0]
                try:
                    out, kept = kern.sparse(q, k, v, etas[0], sl)
                    err = max(rel_err(out[b], ref_out64(q, k, v, etas[0], b)) for b in range(B))
                    ok = bool(torch.equal(kept, ths[0][j][1])) and err < 1e-2
                    tg = bench_graph(lambda q, k, v, e: kern.sparse(q, k, v, e, sl), [s + (e,) for s, e in zip(sets, etas)])
                except Exception as e:  # noqa: BLE001 - report configs that fail to compile
                    print("fail", kw, repr(e)[:300], flush=True)
                    ok, err, tg = False, float("nan"), float("nan")
                res[f"sift_{sp}"] = dict(ok=ok, err=err, ms=tg, ratio=tg / t_sdpa)
            if not kw or dense_knobs(kw):
                try:
                    q, k, v = sets[0]
                    derr = max(rel_err(kern.dense(q, k, v, sl)[b], ref_out64(q, k, v, torch.zeros(B, Hq, device=DEV), b)) for b in range(B))
                    res["dense"] = dict(err=derr, ms=(t := bench_graph(lambda q, k, v: kern.dense(q, k, v, sl), sets)), ratio=t / t_sdpa)
                    _, theta = kern.warmup(q, k, v, 0.875, sl)
                    if theta_ref is None:
                        theta_ref = torch.stack([torch.quantile(torch.softmax(ref_scores64(q, k, b), -1), 0.875, dim=-1)
                                                 for b in range(B)])
                    qerr = float(((theta.double() - theta_ref).abs() / theta_ref).max())
                    res["warmup"] = dict(ms=(t := bench_graph(lambda q, k, v: kern.warmup(q, k, v, 0.875, sl), sets)), ratio=t / t_sdpa,
                                         theta_rel=qerr)
                except Exception as e:  # noqa: BLE001
                    print("fail dense", kw, repr(e)[:300], flush=True)
            rows.append(res)
            cells = " ".join(f"s={sp}:{res[f'sift_{sp}']['ratio']:.3f}{'' if res[f'sift_{sp}']['ok'] else '!'}" for sp in sps if f"sift_{sp}" in res)
            extra = "".join(f" {n}:{res[n]['ratio']:.3f}" for n in ("scores_pass", "dense", "warmup") if n in res)
            if "warmup" in res:
                extra += f" theta_rel:{res['warmup']['theta_rel']:.1e}"
            print(f"grid B={B} H={Hq}/{Hkv} S={S} D={D} {json.dumps(kw):60s} sdpa {t_sdpa:.4f} ms  {cells}{extra}", flush=True)
        del sets
        torch.cuda.empty_cache()
    for r in kernel_resources():
        print("resources", json.dumps(r))
    return rows


def run_profile(args):
    """Device time of every kernel of the planned steps (torch.profiler), per shape and step."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device=DEV).manual_seed(7)
    res = []
    shapes = [tuple(map(int, x.split(","))) for x in (args.shapes or ["8,32,32,8192", "8,32,8,32768", "1,32,8,32768"])]
    for (B, Hq, Hkv, S) in shapes:
        q, k, v = make_inputs(B, Hq, Hkv, S, 128, torch.float16, args.logit_std, 0.0, gen)
        (e0, _, _), (e875, _, _) = thresholds(q, k, [0.0, 0.875])
        kern, sl = planned(q, k), full_lens(B, S)
        steps = {"sift s=0": lambda: kern.sparse(q, k, v, e0, sl), "sift s=0.875": lambda: kern.sparse(q, k, v, e875, sl),
                 "dense": lambda: kern.dense(q, k, v, sl), "warmup": lambda: kern.warmup(q, k, v, 0.875, sl),
                 "sdpa": lambda: sdpa_decode(q, k, v)}
        for name, fn in steps.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            per = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    per[ev.name[:40]] = per.get(ev.name[:40], 0.0) + ev.device_time / 10
            res.append(dict(shape=[B, Hq, Hkv, S], step=name, kernels_us=per))
            print(f"profile B={B} H={Hq}/{Hkv} S={S} {name:13s} " + "  ".join(f"{n}: {t:.1f}" for n, t in per.items()), flush=True)
    return res


def host_us(fn, args, n=200):
    """Host time per call: n calls without a sync (the launch queue is deeper than n)."""
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


# The target settings: (Hq, Hkv, B, S).
QUICK_SHAPES = [(32, 32, 8, 8192), (32, 32, 8, 32768), (32, 8, 8, 32768), (32, 8, 16, 32768), (32, 8, 1, 32768), (32, 8, 1, 131072)]


def sweep_configs(args):
    dts = args.dtype or (["fp16"] if args.quick else ["fp16", "bf16"])
    if args.captured:  # the capture fixes heads and length; only the batch and dtype vary
        from siftattention.capture import CapturedAttention

        cap = CapturedAttention.load(args.captured)
        q, k, _ = cap.step(cap.layers[0])
        return [(B, q.shape[1], k.shape[1], k.shape[2], dt) for dt in dts for B in (args.batch or [8, 16])]
    if args.quick and not (args.batch or args.seq):
        heads = set(args.heads or [(32, 32), (32, 8)])
        return [(B, Hq, Hkv, S, dt) for dt in dts for (Hq, Hkv, B, S) in QUICK_SHAPES if (Hq, Hkv) in heads]
    batches = args.batch or ([8] if args.quick else [1, 8, 16])
    seqs = args.seq or ([8192, 32768] if args.quick else [2048, 8192, 32768])
    heads = args.heads or [(32, 32), (32, 8)]
    extra = [] if (args.batch or args.seq or args.quick) else [(1, 32, 8, 131072)]
    return [(B, Hq, Hkv, S, dt) for dt in dts for (Hq, Hkv) in heads for B in batches for S in seqs] + [
        (B, Hq, Hkv, S, dt) for dt in dts for (B, Hq, Hkv, S) in extra if (Hq, Hkv) in heads]


def run_sweep(args, copy_bps):
    gen = torch.Generator(device=DEV).manual_seed(3)
    D = args.head_dim
    rows = []
    done = set()
    if args.out and os.path.exists(args.out + ".partial"):  # resume an interrupted sweep
        with open(args.out + ".partial") as f:
            rows = json.load(f)
        done = {(r["B"], r["Hq"], r["Hkv"], r["S"], r["dtype"], r["group_corr"]) for r in rows}
    configs = [(c, gc) for c in sweep_configs(args) for gc in (args.group_corr or [0.0]) if gc == 0.0 or c[1] != c[2]]
    if args.captured:
        configs = [(c, "captured") for c, _ in configs[:: len(args.group_corr or [0.0])]]
    for i, ((B, Hq, Hkv, S, dtn), gc) in enumerate(configs):
        if (B, Hq, Hkv, S, dtn, gc) in done:
            continue
        dt = DTYPES[dtn]
        t0 = time.time()
        if args.captured:
            sets, cap = captured_inputs(args.captured, B, args.sets, dt)
            D = sets[0][0].shape[-1]
        else:
            sets = [make_inputs(B, Hq, Hkv, S, D, dt, args.logit_std, gc, gen) for _ in range(args.sets)]
        dense = bytes_dense(B, Hkv, S, D, 2)
        kern = planned(sets[0][0], sets[0][1])
        sl = full_lens(B, S)
        t_sdpa_g = bench_graph(sdpa_decode, sets)
        # dense kernel and warmup step: exact output and theta, checked on set 0
        q, k, v = sets[0]
        out_d = kern.dense(q, k, v, sl)
        out, th = kern.warmup(q, k, v, 0.875, sl)
        w_err, th_err, d_err = 0.0, 0.0, 0.0
        for b in range(B):
            s = ref_scores64(q, k, b)
            p = torch.softmax(s, -1)
            th_ref = torch.quantile(p, 0.875, dim=-1) if S < 2**24 else None
            th_err = max(th_err, float(((th[b].double() - th_ref).abs() / th_ref).max()))
            ref = torch.matmul(p.reshape(Hkv, Hq // Hkv, S), v[b].double()).reshape(Hq, D)
            w_err = max(w_err, rel_err(out[b], ref))
            d_err = max(d_err, rel_err(out_d[b], ref))
        # Real bf16 rows put theta among many near-equal probabilities: its search stops within 1e-3 there.
        assert w_err < 1e-2 and th_err < (1e-3 if args.captured else 1e-4) and d_err < 1e-2, (w_err, th_err, d_err)
        t_dense_g = bench_graph(lambda q, k, v: kern.dense(q, k, v, sl), sets)
        t_warm_g = bench_graph(lambda q, k, v: kern.warmup(q, k, v, 0.875, sl), sets)
        if args.eager:
            t_sdpa = bench(sdpa_decode, sets)
            t_warm = bench(lambda q, k, v: kern.warmup(q, k, v, 0.875, sl), sets)
        ths = [thresholds(q, k, args.sparsity) for (q, k, v) in sets]
        kb_keys = [quantize_keys(k, args.keybound == "channel") for (q, k, v) in sets] if args.keybound else None
        for j, sp in enumerate(args.sparsity):
            th = [t[j] for t in ths]
            etas = [t[0] for t in th]
            union = sum(t[2] for t in th) / len(th)
            realized = [1 - float(t[1].double().mean()) / S for t in th]
            err = 0.0
            for si, (q, k, v) in enumerate(sets):
                out, kept = kern.sparse(q, k, v, etas[si], sl)
                assert torch.equal(kept, th[si][1]), f"kept mismatch {B,Hq,Hkv,S,dtn,sp} set {si}: {int((kept != th[si][1]).sum())} heads"
                if si == 0:
                    err = max(rel_err(out[b], ref_out64(q, k, v, etas[0], b)) for b in range(B))
                    assert err < 1e-2, err
            sift_fn = lambda q, k, v, e: kern.sparse(q, k, v, e, sl)  # noqa: E731
            sift_sets = [s + (e,) for s, e in zip(sets, etas)]
            t_sift_g = bench_graph(sift_fn, sift_sets)
            anchored = {}
            if args.anchored:  # Sift(normalizer="anchored")'s step in both forms, its normaliser predicted exactly
                first, last = args.anchored
                zeros = torch.zeros(B, device=DEV)
                a_sets = [s + (PowerLawThreshold(torch.log(e), torch.zeros_like(e), zeros), oracle_gaps(s[0], s[1], first, last))
                          for s, e in zip(sets, etas)]
                anchored = dict(anchors=[first, last], anchored_form="one-pass" if kern.anchored_onepass else "two-pass")
                for form, one in (("1", True), ("2", False)):
                    a_fn = lambda q, k, v, t, g: kern.sparse_anchored(q, k, v, t, g, sl, None, first, last, one)  # noqa: E731
                    a_err = 0.0
                    for si, a_set in enumerate(a_sets):
                        g0 = a_set[4].clone()
                        out, kept = a_fn(*a_set[:4], g0)
                        assert torch.equal(kept, th[si][1]), f"anchored{form} kept mismatch {B,Hq,Hkv,S,dtn,sp} set {si}"
                        if si == 0:
                            a_err = max(rel_err(out[b], ref_out64(*a_set[:3], etas[0], b)) for b in range(B))
                            assert a_err < 1e-2, a_err
                            g_err = float((g0 - a_set[4]).abs().max())  # this step's gap: the oracle's own
                            assert g_err < 1e-3, g_err
                    t_anch = bench_graph(a_fn, a_sets)
                    anchored.update({f"anchored{form}_graph_ms": t_anch, f"anchored{form}_vs_sdpa_graph": t_anch / t_sdpa_g,
                                     f"anchored{form}_out_err": a_err,
                                     f"anchored{form}_vs_floor": t_anch * 1e-3 / (dense / 2 * (1 + union) / copy_bps)})
                pick = "1" if kern.anchored_onepass else "2"  # what the library runs on this plan
                anchored.update({key.replace(pick, "", 1): anchored[key] for key in list(anchored)
                                 if key.startswith(f"anchored{pick}_")})
            keybound = keybound_cells(kern, sets, kb_keys, etas, th, sl, union, t_sdpa_g, t_sift_g, copy_bps) if (
                args.keybound) else {}
            kk = max(1, round((1 - sp) * S))
            topk_fn = lambda q, k, v: topk_decode(q, k, v, kk)  # noqa: E731
            t_topk_g = bench_graph(topk_fn, sets)
            floor_bytes = dense / 2 * (1 + union)  # K + the V rows some head of the group keeps
            row = dict(
                B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, dtype=dtn, group_corr=gc, sparsity=sp,
                **({"captured": args.captured, "captured_model": cap.model, "captured_layers": cap.layers} if args.captured else {}), realized=sum(realized) / len(realized),
                v_rows_read=union, copy_tbps=copy_bps / 1e12,
                sdpa_graph_ms=t_sdpa_g, sift_graph_ms=t_sift_g, topk_graph_ms=t_topk_g, dense_graph_ms=t_dense_g,
                warmup_graph_ms=t_warm_g,
                sift_vs_sdpa_graph=t_sift_g / t_sdpa_g, topk_over_sift_graph=t_topk_g / t_sift_g,
                dense_vs_sdpa_graph=t_dense_g / t_sdpa_g, warmup_vs_sdpa_graph=t_warm_g / t_sdpa_g,
                floor_bytes=floor_bytes, dense_bytes=dense, byte_floor_vs_dense=floor_bytes / dense,
                # measured time / (bytes / copy bandwidth): 1.0 = moving the counted bytes at copy speed
                sift_vs_floor=t_sift_g * 1e-3 / (floor_bytes / copy_bps),
                sdpa_vs_floor=t_sdpa_g * 1e-3 / (dense / copy_bps),
                dense_vs_floor=t_dense_g * 1e-3 / (dense / copy_bps),
                out_rel_err=err, warmup_out_err=w_err, dense_out_err=d_err, theta_rel_err=th_err, **anchored, **keybound,
            )
            if args.eager:
                t_sift = bench(sift_fn, sift_sets)
                row.update(sdpa_ms=t_sdpa, sift_ms=t_sift, warmup_ms=t_warm, sift_vs_sdpa=t_sift / t_sdpa,
                           warmup_vs_sdpa=t_warm / t_sdpa, sift_host_us=host_us(sift_fn, sift_sets[0]))
            rows.append(row)
            print(
                f"B={B:2d} H={Hq}/{Hkv} S={S:6d} {dtn} corr={gc} s={row['realized']:.3f} vrows={union:.3f} sdpa={t_sdpa_g:.4f} "
                f"({row['sdpa_vs_floor']:.2f}x floor) sift={t_sift_g:.4f} ({row['sift_vs_sdpa_graph']:.3f}x sdpa, "
                f"{row['sift_vs_floor']:.2f}x floor) topk/sift={row['topk_over_sift_graph']:.2f} dense={row['dense_vs_sdpa_graph']:.3f}x "
                f"warm={row['warmup_vs_sdpa_graph']:.3f}x err={err:.1e}"
                + (f" anchored={row['anchored_vs_sdpa_graph']:.3f}x ({row['anchored_form']}; one-pass "
                   f"{row['anchored1_vs_sdpa_graph']:.3f}x, two-pass {row['anchored2_vs_sdpa_graph']:.3f}x)" if anchored else ""),
                flush=True,
            )
            if keybound:
                print(f"  keybound ({keybound['keybound_form']}): {keybound['keybound_graph_ms']:.4f} ms ({keybound['keybound_vs_sdpa_graph']:.3f}x sdpa, "
                      f"{keybound['keybound_vs_sift']:.3f}x exact sift, {keybound['keybound_vs_floor']:.2f}x its floor, "
                      f"{keybound['keybound_vs_floor_with_scores']:.2f}x with its scores' traffic) "
                      f"candidates={keybound['keybound_candidates']:.3f} of key rows, bytes={keybound['keybound_bytes_vs_dense']:.3f} "
                      f"of dense (exact sift's floor {floor_bytes / dense:.3f}), int8 copy +{keybound['keybound_copy_vs_kv']:.3f} "
                      f"of K+V, eps<={keybound['keybound_eps_max']:.1e}, kept heads off float64 {keybound['keybound_kept_off']}, "
                      f"err={keybound['keybound_out_err']:.1e}", flush=True)
        sets = kern = kb_keys = None  # free the inputs before the next shape
        torch.cuda.empty_cache()
        print(f"  config {i + 1}/{len(configs)} took {time.time() - t0:.1f}s", flush=True)
        if args.out:  # partial results survive a time limit (and are resumed)
            with open(args.out + ".partial", "w") as f:
                json.dump(rows, f)
    return rows


def keybound_cells(kern, sets, keys, etas, th, sl, union, t_sdpa, t_sift, copy_bps) -> dict:
    """The key-bound step on ``sets`` (planted or captured) beside the exact one: checked (set 0's output against
    float64 within its epsilon, kept counts against the planted float64 counts), timed from CUDA graphs, its
    candidate fraction, bytes (int8 scan + scales + candidates' K + kept V) and their ratio to its time."""
    q, k, v = sets[0]
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    cand, off = [], 0
    for si, ((q, k, v), kq, e) in enumerate(zip(sets, keys, etas)):
        out, kept = kern.sparse_keybound(q, k, v, kq, e, sl)
        cand.append(float(kern.keybound_candidates().double().sum()))
        off += int((kept != th[si][1]).sum())
        if si == 0:
            ref = keybound_step_torch(q, k, v, kq, e, kern.scale, None, kern.renormalize)
            eps = float(ref["epsilon"].max())
            err = max(rel_err(out[b], ref_out64(q, k, v, e, b)) for b in range(B))
            assert err < 1e-2 + 2 * math.expm1(eps), (err, eps)
    fn = lambda q, k, v, e, *kq: kern.sparse_keybound(q, k, v, Int8Keys(*kq), e, sl)  # noqa: E731
    t = bench_graph(fn, [s + (e,) + tuple(kq) for s, e, kq in zip(sets, etas, keys)])
    rows = sum(cand) / len(cand)
    nbytes = keybound_bytes(B, Hkv, S, D, k.element_size(), rows, union * B * Hkv * S,
                            per_channel=keys[0].channel is not None, group=Hq // Hkv)
    return dict(keybound_form="channel" if keys[0].channel is not None else "row", keybound_graph_ms=t,
                keybound_vs_sdpa_graph=t / t_sdpa, keybound_vs_sift=t / t_sift,
                keybound_candidates=rows / (B * Hkv * S), keybound_bytes=nbytes["total"],
                keybound_bytes_vs_dense=nbytes["vs_dense"], keybound_vs_floor=t * 1e-3 / (nbytes["total"] / copy_bps),
                keybound_score_bytes_vs_dense=nbytes["scores"] / nbytes["dense"],
                keybound_vs_floor_with_scores=t * 1e-3 / (nbytes["total_with_scores"] / copy_bps),
                keybound_copy_vs_kv=keys[0].nbytes() / nbytes["dense"], keybound_eps_max=eps,
                keybound_kept_off=off, keybound_out_err=err)


def print_table(rows):
    """GPU-time ratios over CUDA-graph replays, with each side's byte-floor ratio."""
    anchored = any("anchored_vs_sdpa_graph" in r for r in rows)
    print("\n| B | Hq/Hkv | S | dtype | corr | sparsity | V rows read | SDPA ms | SDPA / floor | sift / SDPA | sift / floor "
          "| top-k / sift | dense / SDPA | warmup / SDPA |"
          + (" anchored / SDPA | anchored / floor | one-pass / SDPA | two-pass / SDPA |" if anchored else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if anchored else ""))
    for r in rows:
        if "sdpa_vs_floor" not in r:  # an older result file (no byte floors)
            continue
        print(
            f"| {r['B']} | {r['Hq']}/{r['Hkv']} | {r['S']} | {r['dtype']} | {r.get('group_corr', 0.0)} | {r['realized']:.3f} | "
            f"{r['v_rows_read']:.3f} | {r['sdpa_graph_ms']:.4f} | {r['sdpa_vs_floor']:.2f} | {r['sift_vs_sdpa_graph']:.3f} | "
            f"{r['sift_vs_floor']:.2f} | {r['topk_over_sift_graph']:.2f} | {r['dense_vs_sdpa_graph']:.3f} | {r['warmup_vs_sdpa_graph']:.3f} |"
            + (f" {r['anchored_vs_sdpa_graph']:.3f} | {r['anchored_vs_floor']:.2f} | "
               f"{r.get('anchored1_vs_sdpa_graph', r['anchored_vs_sdpa_graph']):.3f} | "
               f"{r['anchored2_vs_sdpa_graph']:.3f} |" if "anchored2_vs_sdpa_graph" in r
               else f" {r['anchored_vs_sdpa_graph']:.3f} | {r['anchored_vs_floor']:.2f} | "
                    f"{r['anchored_vs_sdpa_graph']:.3f} | - |" if "anchored_vs_sdpa_graph" in r  # one-pass only
               else " - | - | - | - |" if anchored else "")
        )


# Issue 12's targets: (label, row filter, ratio key, sparsity filter or None, bound, upper bound?)
MHA_B8 = lambda r: r["Hkv"] == r["Hq"] == 32 and r["B"] == 8 and r["S"] in (8192, 32768)  # noqa: E731
GQA_B8 = lambda r: (r["Hq"], r["Hkv"]) == (32, 8) and r["B"] in (8, 16) and r["S"] == 32768  # noqa: E731
GQA_B1 = lambda r: (r["Hq"], r["Hkv"]) == (32, 8) and r["B"] == 1 and r["S"] in (32768, 131072)  # noqa: E731
GQA_ANY = lambda r: (r["Hq"], r["Hkv"]) == (32, 8)  # noqa: E731
TARGETS = [
    ("MHA B=8: sift <= 0.65x SDPA at s = 0.875", MHA_B8, "sift_vs_sdpa_graph", 0.875, 0.65, True),
    ("MHA B=8: sift <= 1.10x SDPA at s = 0", MHA_B8, "sift_vs_sdpa_graph", 0.0, 1.10, True),
    ("GQA B=8/16 S=32768: sift <= 0.82x SDPA at s = 0.875", GQA_B8, "sift_vs_sdpa_graph", 0.875, 0.82, True),
    ("GQA B=8/16 S=32768: sift <= 1.10x SDPA at s = 0", GQA_B8, "sift_vs_sdpa_graph", 0.0, 1.10, True),
    ("GQA, s >= 0.5: sift within 1.25x of its byte floor", GQA_ANY, "sift_vs_floor", "ge0.5", 1.25, True),
    ("GQA B=1: sift <= 0.90x SDPA at s = 0.875", GQA_B1, "sift_vs_sdpa_graph", 0.875, 0.90, True),
    ("sift >= 1.4x faster than top-k, every s", lambda r: True, "topk_over_sift_graph", None, 1.4, False),
    ("MHA: warmup <= 1.3x SDPA", lambda r: r["Hq"] == r["Hkv"], "warmup_vs_sdpa_graph", None, 1.3, True),
    ("GQA: warmup <= 1.5x SDPA", lambda r: r["Hq"] != r["Hkv"], "warmup_vs_sdpa_graph", None, 1.5, True),
]


# The same targets for Sift(normalizer="anchored")'s step (the form its plan picks), where a sweep timed it (--anchored).
TARGETS += [(label.replace("sift", "anchored sift", 1), sel, key.replace("sift", "anchored"), sp, bound, upper)
            for label, sel, key, sp, bound, upper in TARGETS if key in ("sift_vs_sdpa_graph", "sift_vs_floor")]


def print_targets(rows):
    """The short table printed last: each target per (shape, dtype, group correlation), worst cell."""
    rows = [r for r in rows if "sift_vs_floor" in r]
    if not rows:
        return
    print("\n| target | dtype | shape (B, Hq/Hkv, S) | corr | worst (at s) | met |")
    print("|---|---|---|---|---|---|")
    for label, sel, key, sp, bound, upper in TARGETS:
        cells = [r for r in rows if sel(r) and key in r]
        groups = sorted({(r["dtype"], r["B"], r["Hq"], r["Hkv"], r["S"], r.get("group_corr", 0.0)) for r in cells})
        for g in groups:
            cs = [r for r in cells if (r["dtype"], r["B"], r["Hq"], r["Hkv"], r["S"], r.get("group_corr", 0.0)) == g]
            if sp == "ge0.5":
                cs = [r for r in cs if r["sparsity"] >= 0.5]
            elif sp is not None:
                cs = [r for r in cs if abs(r["sparsity"] - sp) < 1e-9]
            if not cs:
                continue
            worst = max(cs, key=lambda r: r[key]) if upper else min(cs, key=lambda r: r[key])
            v = worst[key]
            ok = v <= bound if upper else v >= bound
            print(f"| {label} | {g[0]} | {g[1]}, {g[2]}/{g[3]}, {g[4]} | {g[5]} | {v:.3f} (s = {worst['sparsity']}) | {'yes' if ok else 'NO'} |")


def run_cpu_profile(args):
    """Host time per call (no device sync) and a cProfile of the launch path."""
    import cProfile
    import pstats

    gen = torch.Generator(device=DEV).manual_seed(5)
    res = {}
    for (Hq, Hkv) in args.heads or [(32, 32), (32, 8)]:
        q, k, v = make_inputs(1, Hq, Hkv, 2048, 128, torch.float16, 3.0, 0.0, gen)
        eta = thresholds(q, k, [0.875])[0][0]
        kern, sl = planned(q, k), full_lens(1, 2048)
        for name, fn in (
            ("sdpa", lambda: sdpa_decode(q, k, v)),
            ("sift", lambda: sift_decode(q, k, v, eta, backend="triton")),
            ("planned sift", lambda: kern.sparse(q, k, v, eta, sl)),
            ("empty_x10", lambda: [torch.empty(8, 32, 64, device=DEV) for _ in range(10)]),
        ):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            res[f"{Hq}/{Hkv} {name}"] = (t1 - t0) / 300 * 1e6
            print(f"host us/call {Hq}/{Hkv} {name}: {res[f'{Hq}/{Hkv} {name}']:.1f}", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            sift_decode(q, k, v, eta, backend="triton")
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    return res


def run_ncu_child(args):
    """Runs under ncu: one SDPA, one sift and one warmup call per sparsity, after a warm-up."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    B, S = args.batch[0], args.seq[0]
    Hq, Hkv = args.heads[0]
    q, k, v = make_inputs(B, Hq, Hkv, S, 128, DTYPES[(args.dtype or ["fp16"])[0]], args.logit_std, (args.group_corr or [0.0])[0], gen)
    info = []
    etas = []
    for sp, (eta, kept, union) in zip(args.sparsity, thresholds(q, k, args.sparsity)):
        etas.append(eta)
        info.append(dict(sparsity=sp, v_rows_read=union))
        sift_decode(q, k, v, eta, backend="triton")  # compile outside the profiled range
    sift_warmup_decode(q, k, v, 0.875, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    sdpa_decode(q, k, v)
    for eta in etas:
        sift_decode(q, k, v, eta, backend="triton")
    sift_warmup_decode(q, k, v, 0.875, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("NCUINFO " + json.dumps(info))


def run_ncu(args):
    res = []
    for (B, Hq, Hkv, S, dtn) in sweep_configs(args):
        cmd = [
            "ncu", "--clock-control", "none", "--profile-from-start", "off", "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
            "--csv", sys.executable, os.path.abspath(__file__), "--ncu-child", "--batch", str(B), "--seq", str(S),
            "--heads", f"{Hq},{Hkv}", "--dtype", dtn, "--sparsity", *map(str, args.sparsity),
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        info = json.loads(re.search(r"NCUINFO (.*)", p.stdout).group(1)) if "NCUINFO" in p.stdout else []
        kernels = []
        lines = p.stdout.splitlines()
        hdr = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
        if hdr is not None:
            for r in csv.DictReader(lines[hdr:]):
                if r.get("Metric Name", "").startswith("dram__bytes"):
                    kernels.append((r["Kernel Name"], r["Metric Name"], r["Metric Unit"], r["Metric Value"].replace(",", "")))
        if not kernels:
            print(p.stdout[-3000:], p.stderr[-3000:])
        dense = bytes_dense(B, Hkv, S, 128, 2)
        res.append(dict(B=B, Hq=Hq, Hkv=Hkv, S=S, dtype=dtn, dense_bytes=dense, info=info, kernels=kernels))
        print(f"ncu B={B} H={Hq}/{Hkv} S={S} dense K+V = {dense/1e6:.1f} MB; v rows read {info}")
        for kname, metric, unit, val in kernels:
            print(f"   {kname[:60]:60s} {metric:24s} {val} {unit}")
    return res


def render(paths):
    """Markdown tables from result JSON files (sweeps and --ncu runs)."""
    rows, ncu = [], []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        rows += d.get("sweep", [])
        ncu += d.get("ncu", [])
    if rows:
        print_table(rows)
        print_targets(rows)
    for r in ncu:
        B, Hq, Hkv, S = r["B"], r["Hq"], r["Hkv"], r["S"]
        kv = r["dense_bytes"] / 2
        scores = B * Hq * S * 4
        reads = [(k[0], float(k[3])) for k in r["kernels"] if k[1] == "dram__bytes_read.sum"]
        sdpa = next(v for n, v in reads if not n.startswith("_"))
        ours = [(n, v) for n, v in reads if n.startswith("_")]
        calls, cur = [], []
        for n, v in ours:  # one sift call = scores + filter; the warmup adds the quantile
            cur.append((n, v))
            if n == "_filter_kernel":
                calls.append(cur)
                cur = []
        print(f"\nB={B} Hq/Hkv={Hq}/{Hkv} S={S}: SDPA reads {sdpa / 1e6:.1f} MB (K+V = {2 * kv / 1e6:.1f} MB)")
        print("| call | V rows read | scores kernel MB | filter kernel MB | total MB | count K + rows*V + scores MB | total / count | total / SDPA |")
        print("|---|---|---|---|---|---|---|---|")
        labels = [f"sift s={i['sparsity']}" for i in r["info"]] + ["warmup"]
        vrows = [i["v_rows_read"] for i in r["info"]] + [1.0]
        for lab, vr, c in zip(labels, vrows, calls):
            tot = sum(v for _, v in c)
            sc = sum(v for n, v in c if n == "_scores_kernel")
            fi = sum(v for n, v in c if n == "_filter_kernel")
            count = kv + vr * kv + scores * (2 if lab == "warmup" else 1)
            print(f"| {lab} | {vr:.3f} | {sc / 1e6:.1f} | {fi / 1e6:.1f} | {tot / 1e6:.1f} | {count / 1e6:.1f} | "
                  f"{tot / count:.3f} | {tot / sdpa:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write JSON results here")
    ap.add_argument("--quick", action="store_true", help="target settings only: B=8, S in {8192, 32768}, fp16")
    ap.add_argument("--batch", type=int, nargs="*")
    ap.add_argument("--seq", type=int, nargs="*")
    ap.add_argument("--heads", type=lambda s: tuple(map(int, s.split(","))), nargs="*", help="e.g. 32,32 32,8")
    ap.add_argument("--dtype", nargs="*", choices=list(DTYPES))
    ap.add_argument("--sparsity", type=float, nargs="*", help="default 0 0.5 0.75 0.875 0.95 (--tune-grid: 0 0.875 0.95)")
    ap.add_argument("--sets", type=int, default=3, help="rotating input sets")
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128, 256], help="head dimension of the planted inputs")
    ap.add_argument("--captured", metavar="FILE", help="replay real attention saved by `sift capture` (tiled over --batch) "
                    "instead of planted inputs")
    ap.add_argument("--group-corr", type=float, nargs="*", help="correlations of q across a GQA group (default 0)")
    ap.add_argument("--graph", action="store_true", help="(kept for old command lines: times are always CUDA-graph replays)")
    ap.add_argument("--eager", action="store_true", help="also time Python-launched calls and host time per call")
    ap.add_argument("--shapes", nargs="*", help="--tune-grid shapes as B,Hq,Hkv,S")
    ap.add_argument("--anchored", type=int, nargs="*", metavar="N",
                    help="also time Sift(normalizer='anchored')'s step, one-pass and two-pass (anchors FIRST LAST, default 64 256)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--keybound", nargs="?", const="row", choices=["row", "channel"],
                    help="also run the key-bound step (int8 key scan, full keys of the candidates only) beside the "
                         "exact one: time, bytes, candidate fraction; with --check, its correctness cases. 'channel': "
                         "the int8 copy with per-channel scales and offsets (from the whole cache) instead of one "
                         "scale per row")
    ap.add_argument("--config", type=kernel_overrides, metavar="JSON",
                    help='KernelConfig overrides for every mode (the sweep, --check, --ncu, --tune-grid\'s base), e.g. {"stages1": 4}')
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-pass1", action="store_true", help="--tune: the scores pass only, configs from --grid")
    ap.add_argument("--tune-grid", action="store_true", help="whole decode step over KernelConfig overrides vs SDPA")
    ap.add_argument("--grid", nargs="*", help="--tune-grid configs as JSON KernelConfig overrides")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--cpu-profile", action="store_true", help="host-side launch overhead per call")
    ap.add_argument("--profile", action="store_true", help="device time of each kernel (torch.profiler), --shapes B,Hq,Hkv,S")
    ap.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--render", nargs="+", metavar="JSON", help="print markdown tables from result files")
    args = ap.parse_args()
    if args.config:
        use_kernel_overrides(args.config)
    if not args.tune_grid:
        args.sparsity = args.sparsity or [0.0, 0.5, 0.75, 0.875, 0.95]
    if args.render:
        return render(args.render)
    if args.anchored is not None:
        if args.anchored and (len(args.anchored) != 2 or min(args.anchored) < 0 or sum(args.anchored) == 0):
            ap.error("--anchored takes two counts FIRST LAST (>= 0, not both 0), or none for 64 256")
        args.anchored = tuple(args.anchored) or (64, 256)

    if args.ncu_child:
        return run_ncu_child(args)
    meta = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else DEV, torch=torch.__version__, argv=sys.argv)
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    out = dict(meta=meta)
    fails = 0
    if args.check:
        out["check"], fails = run_check(args)
    if args.tune:
        out["tune"] = run_tune(args)
    if args.tune_grid:
        out["tune_grid"] = run_tune_grid(args)
    if args.ncu:
        out["ncu"] = run_ncu(args)
    if args.cpu_profile:
        out["cpu_profile"] = run_cpu_profile(args)
    if args.profile:
        out["profile"] = run_profile(args)
    if not (args.check or args.tune or args.tune_grid or args.ncu or args.cpu_profile or args.profile):
        bps = copy_bandwidth()
        meta["copy_tbps"] = bps / 1e12
        print(f"device-to-device copy: {bps / 1e12:.3f} TB/s (read + write)", flush=True)
        out["sweep"] = run_sweep(args, bps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if "sweep" in out:
        print_table(out["sweep"])
        print_targets(out["sweep"])
    if fails:
        sys.exit(1)


if __name__ == "__main__":
    main()
