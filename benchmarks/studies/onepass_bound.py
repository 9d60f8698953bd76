"""How fast could a one-pass sift step be, if it knew each head's threshold before reading K?

The sift decode step is two passes because its filter, ``p > eta``, needs the row's
normaliser: a key's probability is only known once every key of the row has been scored.
This script measures the best case of any one-pass design: the threshold (in the score
domain, ``log(eta) + logsumexp(s)``) is computed beforehand by a float64 reference and handed
to a flash-decoding kernel that reads every K row and only the V rows some head of the
group keeps (masked loads), in one pass. No real design gets the threshold for free (it
would have to predict it and repair the keys it got wrong), so this is a lower bound on a
one-pass step's time, measured beside SDPA, the dense kernel and the two-pass sift step.

Variants, each checked against a float64 reference (renormalize=False) before it is timed:

- ``onepass``: the kernel as above; ``onepass_scores``: the same, also storing the float32
  scores (what a design that repairs mispredicted keys afterwards would need);
- ``onepass_all``: the same kernel with every key kept (its dense form: the kernel's own cost);
- with ``--anchors FIRST LAST``: ``onepass_anchored``, the threshold predicted as in
  ``lse_drift.py`` (each program first reads the row's first and newest keys and adds their
  log-sum-exp to a per-head offset; the offset handed in here makes it the oracle's threshold,
  so the output and the kept counts are checked exactly): what the prediction costs;
- with ``--store-variants``: storing the scores without the evict-last hint, and passes that read
  K only (``k_only``), or K and store the scores (``k_scores``): what the scores cost by themselves.
- with ``--count-variants``: each way of counting every head's kept keys (``count_<mode>``,
  ``COUNT_MODES``; with ``--anchors`` also ``anchored_count_<mode>``), checked against float64.

A fifth number in a ``--geoms`` entry caps the kernel's registers per thread (``maxnreg``);
``--dtype`` takes fp16 and bf16, ``--only`` restricts the variants timed.

    PYTHONPATH=. python3 benchmarks/studies/onepass_bound.py --out onepass.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for bench_decode
import bench_decode as bd  # noqa: E402
from siftattention.kernels import triton_common, triton_dense  # noqa: E402
from siftattention.kernels import triton_decode as td  # noqa: E402

LOG2E = 1.4426950408889634
COUNT_MODES = {1: "lane", 2: "tile", 3: "dot", 4: "lane_f32", 5: "lane_f16"}


@triton.jit
def _lse_run(q, k_row, lo, hi, m, l, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """Online log2-sum-exp of the scores of keys [lo, hi), folded into (m, l)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        mask = offs < hi
        k = tl.load(k_row + offs[:, None].to(tl.int64) * D + offs_d[None, :], mask=mask[:, None], other=0.0)
        sa = tl.where(mask[None, :], triton_common._dot(q, tl.trans(k), "tf32", UPCAST) * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(sa, axis=1))
        l = l * tl.math.exp2(m - m_new) + tl.sum(tl.math.exp2(sa - m_new[:, None]), axis=1)
        m = m_new
    return m, l


@triton.jit
def _onepass_kernel(
    Q, K, V, Thr, Part, Mp, Lp, Sem, Out, Scores,
    S_MAX, NUM_SPLITS, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
    STORE_SCORES: tl.constexpr, MASK_V: tl.constexpr, READ_V: tl.constexpr = True,
    ANCHOR_FIRST: tl.constexpr = 0, ANCHOR_LAST: tl.constexpr = 0, COUNT: tl.constexpr = 0, Kept=None,
    UPCAST: tl.constexpr = False,
):
    """Flash-decoding over one split of one (batch, KV head); keys at or below the threshold get weight 0.

    The threshold is Thr, or with anchors (ANCHOR_FIRST + ANCHOR_LAST > 0) Thr plus the
    log2-sum-exp of the row's first and newest keys, which every program computes first (what an
    anchored prediction of the normaliser costs). COUNT > 0 counts each head's kept keys of the
    split: 1 per lane in int32, reduced after the loop; 2 reduced per tile; 3 on the tensor cores
    (the keep mask times a tile of ones); 4 per lane in float32; 5 per lane in float16 (exact up to
    2048 tiles per split).
    """
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    h = hkv * G + offs_g
    row = b.to(tl.int64) * HQ + h
    q = tl.load(Q + row[:, None] * D + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    thr = tl.load(Thr + row, mask=g_mask, other=float("inf"))
    lo, hi = triton_common._split_range(0, S_MAX, split, NUM_SPLITS, BLOCK_N)
    base = bh.to(tl.int64) * S_MAX * D
    if ANCHOR_FIRST + ANCHOR_LAST > 0:
        m_a = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_a = tl.zeros([BLOCK_G], tl.float32)
        m_a, l_a = _lse_run(q, K + base, 0, tl.minimum(ANCHOR_FIRST, S_MAX), m_a, l_a, qk_scale, D, BLOCK_N, UPCAST)
        m_a, l_a = _lse_run(q, K + base, tl.maximum(ANCHOR_FIRST, S_MAX - ANCHOR_LAST), S_MAX, m_a, l_a, qk_scale,
                            D, BLOCK_N, UPCAST)
        thr = thr + m_a + tl.math.log2(l_a)
    if COUNT == 1:
        cnt = tl.zeros([BLOCK_G, BLOCK_N], tl.int32)
    elif COUNT == 2:
        cnt = tl.zeros([BLOCK_G], tl.int32)
    elif COUNT == 3:
        cnt = tl.zeros([BLOCK_G, 16], tl.float32)
        ones = tl.full([BLOCK_N, 16], 1.0, tl.float16)
    elif COUNT == 4:
        cnt = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    elif COUNT == 5:
        cnt = tl.zeros([BLOCK_G, BLOCK_N], tl.float16)
    s_base = Scores + row[:, None] * S_MAX
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        n_mask = offs < hi
        k = tl.load(K + base + offs[:, None].to(tl.int64) * D + offs_d[None, :], mask=n_mask[:, None], other=0.0,
                    eviction_policy="evict_first")
        s = triton_common._dot(q, tl.trans(k), "tf32", UPCAST)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        if STORE_SCORES == 1:
            tl.store(s_base + offs[None, :], s, mask=g_mask[:, None] & n_mask[None, :], eviction_policy="evict_last")
        elif STORE_SCORES == 2:
            tl.store(s_base + offs[None, :], s, mask=g_mask[:, None] & n_mask[None, :])
        keep = s > thr[:, None]
        if COUNT == 1:
            cnt += keep.to(tl.int32)
        elif COUNT == 2:
            cnt += tl.sum(keep.to(tl.int32), axis=1)
        elif COUNT == 3:
            cnt = tl.dot(keep.to(tl.float16), ones, cnt)
        elif COUNT == 4:
            cnt += tl.where(keep, 1.0, 0.0)
        elif COUNT == 5:
            cnt += keep.to(tl.float16)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        if MASK_V:
            rows = tl.max(keep.to(tl.int32), axis=0) > 0
            v_mask = (n_mask & rows)[:, None]
        else:
            v_mask = n_mask[:, None]
        if READ_V:
            v = tl.load(V + base + offs[:, None].to(tl.int64) * D + offs_d[None, :], mask=v_mask, other=0.0,
                        eviction_policy="evict_first")
            acc = acc * alpha[:, None] + triton_common._dot(tl.where(keep, p, 0.0).to(v.dtype), v, "tf32", UPCAST)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    pst = row * NUM_SPLITS + split
    tl.store(Part + pst[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(Mp + pst, m_i, mask=g_mask)
    tl.store(Lp + pst, l_i, mask=g_mask)
    if COUNT == 1 or COUNT == 4 or COUNT == 5:
        tl.store(Kept + pst, tl.sum(cnt.to(tl.float32), axis=1).to(tl.int32), mask=g_mask)
    elif COUNT == 2:
        tl.store(Kept + pst, cnt, mask=g_mask)
    elif COUNT == 3:
        tl.store(Kept + pst, (tl.sum(cnt, axis=1) / 16).to(tl.int32), mask=g_mask)
    tl.debug_barrier()
    done = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        tl.store(Sem + bh, 0)
        triton_dense._merge_splits(Part, Mp, Lp, Out, b, hkv, HQ * D, D, 1, NUM_SPLITS, HQ, G, BLOCK_GA, D, CH, offs_d < D)


class OnePass:
    """The one-pass kernel for one shape: buffers allocated once, launched many times."""

    def __init__(self, B, Hq, Hkv, S, D, splits, block_n, warps, stages, store_scores, mask_v, read_v=True,
                 anchors=(0, 0), count=0, maxnreg=0, dtype=torch.float16):
        G = Hq // Hkv
        dev = bd.DEV
        self.args = (B, Hq, Hkv, S, D, G)
        self.grid = (splits, B * Hkv)
        self.part = torch.empty(B * Hq * splits, D, device=dev)
        self.mp = torch.empty(B * Hq * splits, device=dev)
        self.lp = torch.empty(B * Hq * splits, device=dev)
        self.sem = torch.zeros(B * Hkv, dtype=torch.int32, device=dev)
        self.kept = torch.zeros(B * Hq * splits, dtype=torch.int32, device=dev)
        self.scores = torch.empty(B * Hq, S, device=dev) if store_scores else self.mp
        self.meta = dict(HQ=Hq, HKV=Hkv, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)),
                         BLOCK_GA=triton.next_power_of_2(G), D=D, BLOCK_N=block_n,
                         CH=max(1, min(triton.next_power_of_2(splits), 4096 // (triton.next_power_of_2(G) * D))),
                         STORE_SCORES=int(store_scores), MASK_V=mask_v, READ_V=read_v,
                         ANCHOR_FIRST=anchors[0], ANCHOR_LAST=anchors[1], COUNT=int(count), num_warps=warps, num_stages=stages,
                         UPCAST=dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1")
        if count == 5:
            assert triton.cdiv(triton.cdiv(S, splits), block_n) <= 2048, "float16 counts are exact up to 2048 tiles"
        if maxnreg and bd.DEV == "cuda":  # a register cap, for the occupancy it buys
            self.meta["maxnreg"] = maxnreg
        self.splits = splits

    def __call__(self, q, k, v, thr2):
        B, Hq, Hkv, S, D, G = self.args
        out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
        self.compiled = _onepass_kernel[self.grid](q, k, v, thr2, self.part, self.mp, self.lp, self.sem, out, self.scores,
                                   S, self.splits, D**-0.5 * LOG2E, Kept=self.kept, **self.meta)
        return out


def oracle_thresholds(q, k, etas):
    """Score-domain thresholds in the log2 domain, ``(log eta + logsumexp(s)) * log2(e)``, float64."""
    B, Hq, _ = q.shape
    thr = torch.empty(B, Hq, dtype=torch.float64, device=q.device)
    for b in range(B):
        lse = torch.logsumexp(bd.ref_scores64(q, k, b), dim=-1)
        thr[b] = (torch.log(etas[b].double()) + lse) * LOG2E
    return thr


def anchor_lse2(q, k, first, last):
    """log2-sum-exp of each row's scores over its first ``first`` and newest ``last`` keys, float64."""
    S = k.shape[2]
    pos = torch.cat([torch.arange(min(first, S)), torch.arange(max(first, S - last), S)]).to(q.device)
    return torch.stack([torch.logsumexp(bd.ref_scores64(q, k, b)[:, pos], dim=-1) for b in range(q.shape[0])]) * LOG2E


def run(args):
    torch.manual_seed(0)
    gen = torch.Generator(device=bd.DEV).manual_seed(3)
    copy_bps = bd.copy_bandwidth()
    rows = []
    D = 128
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    variants = [dict(name="onepass", store=0, mask=True), dict(name="onepass_scores", store=1, mask=True),
                dict(name="onepass_all", store=0, mask=False)]
    if args.anchors:  # the threshold as an anchored prediction: the anchors' log-sum plus a per-head offset
        variants += [dict(name="onepass_counted", store=0, mask=True, count=1),
                     dict(name="onepass_anchored_uncounted", store=0, mask=True, anchors=tuple(args.anchors)),
                     dict(name="onepass_anchored", store=0, mask=True, anchors=tuple(args.anchors), count=1)]
    if args.count_variants:  # how the kept keys are counted (threshold known)
        variants += [dict(name=f"count_{name}", store=0, mask=True, count=mode)
                     for mode, name in COUNT_MODES.items()]
        if args.anchors:
            variants += [dict(name=f"anchored_count_{name}", store=0, mask=True, anchors=tuple(args.anchors),
                              count=mode) for mode, name in COUNT_MODES.items()]
    if args.store_variants:
        variants += [dict(name="onepass_scores_nohint", store=2, mask=True),
                     dict(name="k_only", store=0, mask=True, read_v=False),
                     dict(name="k_scores", store=1, mask=True, read_v=False),
                     dict(name="k_scores_nohint", store=2, mask=True, read_v=False),
                     ]
    # (split factor, block_n, warps, stages[, register cap per thread])
    geoms = [tuple(int(x) for x in g.split(",")) + (0,) * (5 - len(g.split(","))) for g in args.geoms]
    if args.only:
        variants = [v for v in variants if v["name"] in args.only]
    for (B, Hq, Hkv, S), dname in ((shape, d) for shape in shapes for d in args.dtype):
        t0 = time.time()
        dt = bd.DTYPES[dname]
        sets = [bd.make_inputs(B, Hq, Hkv, S, D, dt, 3.0, 0.0, gen) for _ in range(2)]
        kern = bd.planned(sets[0][0], sets[0][1])
        geo = td.geometry(B, Hq, Hkv, S, D, dt, sets[0][0].device, td.config_for(sets[0][0].device))
        sl = bd.full_lens(B, S)
        t_sdpa = bd.bench_graph(bd.sdpa_decode, sets)
        t_dense = bd.bench_graph(lambda q, k, v: kern.dense(q, k, v, sl), sets)
        dense_bytes = bd.bytes_dense(B, Hkv, S, D, 2)
        ths = [bd.thresholds(q, k, args.sparsity) for (q, k, v) in sets]
        q, k, v = sets[0]  # every variant is checked on the first set
        ref_s = (torch.stack([bd.ref_scores64(q, k, b) for b in range(B)]).reshape(B * Hq, S) * LOG2E
                 if any(var["store"] for var in variants) else None)
        for j, sp in enumerate(args.sparsity):
            etas = [t[j][0] for t in ths]
            union = sum(t[j][2] for t in ths) / len(ths)
            thr = [oracle_thresholds(q, k, e) for (q, k, v), e in zip(sets, etas)]
            # The anchored kernel adds its own anchor sum to Thr: hand it the oracle's offset from it.
            thr_anchored = [t - anchor_lse2(q, k, *args.anchors) for (q, k, v), t in zip(sets, thr)] if args.anchors else None
            sift_sets = [s + (e,) for s, e in zip(sets, etas)]
            t_sift = bd.bench_graph(lambda q, k, v, e: kern.sparse(q, k, v, e, sl), sift_sets)
            floor_bytes = dense_bytes / 2 * (1 + union)
            # float64 outputs, filtered (mask) and not (every key kept: eta = 0)
            refs = {mask: [bd.ref_out64(q, k, v, etas[0] if mask else torch.zeros_like(etas[0]), b) for b in range(B)]
                    for mask in {var["mask"] for var in variants}}
            row = dict(B=B, Hq=Hq, Hkv=Hkv, S=S, dtype=dname, sparsity=sp, v_rows_read=union, copy_tbps=copy_bps / 1e12,
                       sdpa_ms=t_sdpa, dense_ms=t_dense, sift_two_pass_ms=t_sift, nsd=geo["nsd"],
                       floor_vs_sdpa_bytes=floor_bytes / dense_bytes, variants=[])
            for var in variants:
                for fac, bn, warps, stages, maxnreg in geoms:
                    fn = OnePass(B, Hq, Hkv, S, D, max(1, geo["nsd"] * fac), bn, warps, stages, var["store"],
                                 var["mask"], var.get("read_v", True), var.get("anchors", (0, 0)),
                                 var.get("count", 0), maxnreg, dt)
                    vthr = [(t if var["mask"] else torch.full_like(t, -float("inf"))).float()
                            for t in (thr_anchored if "anchors" in var else thr)]
                    out = fn(q, k, v, vthr[0])
                    err = max(bd.rel_err(out[b], refs[var["mask"]][b]) for b in range(B))
                    if var.get("read_v", True):
                        assert err < 1e-2, (var, err)
                    if var.get("count"):  # the kernel's kept counts against float64
                        kept = fn.kept.view(B, Hq, fn.splits).sum(-1)
                        assert torch.equal(kept, ths[0][j][1].to(kept)), (var, int((kept != ths[0][j][1]).sum()))
                    if var["store"]:  # the stored scores against float64
                        s_err = float((fn.scores.double() - ref_s).abs().max())
                        assert s_err < 1e-2, (var, s_err)
                    tsets = [s + (t,) for s, t in zip(sets, vthr)]
                    t = bd.bench_graph(fn, tsets)
                    row["variants"].append(dict(name=var["name"], splits=fn.splits, block_n=bn, warps=warps,
                                                stages=stages, maxnreg=maxnreg, ms=t, vs_sdpa=t / t_sdpa, err=err,
                                                regs=getattr(fn.compiled, "n_regs", None),
                                                spills=getattr(fn.compiled, "n_spills", None),
                                                vs_floor=t * 1e-3 / (floor_bytes / copy_bps)))
            rows.append(row)
            best = {}
            for r in row["variants"]:
                if r["name"] not in best or r["ms"] < best[r["name"]]["ms"]:
                    best[r["name"]] = r
            print(f"B={B} H={Hq}/{Hkv} S={S} {dname} s={sp} vrows={union:.3f} sdpa={t_sdpa:.4f} dense={t_dense / t_sdpa:.3f}x "
                  f"two-pass={t_sift / t_sdpa:.3f}x " +
                  " ".join(f"{n}={r['vs_sdpa']:.3f}x({r['splits']},{r['block_n']},{r['warps']},{r['stages']},{r['maxnreg']})"
                           for n, r in best.items()), flush=True)
        sets = kern = None
        if bd.DEV == "cuda":
            torch.cuda.empty_cache()
        print(f"  {time.time() - t0:.1f}s", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(copy_tbps=copy_bps / 1e12, device=torch.cuda.get_device_name() if bd.DEV == "cuda" else "cpu",
                               date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)
    names = list(dict.fromkeys(v["name"] for r in rows for v in r["variants"]))
    print("\n| B | Hq/Hkv | S | dtype | s | V rows | dense/SDPA | two-pass/SDPA | " + " | ".join(names) + " |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(names))
    for r in rows:
        best = {}
        for v in r["variants"]:
            best[v["name"]] = min(best.get(v["name"], math.inf), v["vs_sdpa"])
        print(f"| {r['B']} | {r['Hq']}/{r['Hkv']} | {r['S']} | {r.get('dtype', 'fp16')} | {r['sparsity']} | {r['v_rows_read']:.3f} | "
              f"{r['dense_ms'] / r['sdpa_ms']:.3f} | {r['sift_two_pass_ms'] / r['sdpa_ms']:.3f} | "
              + " | ".join(f"{best[n]:.3f}" for n in names) + " |")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8,32,8,32768", "16,32,8,32768", "8,32,32,8192", "8,32,32,32768",
                                                      "1,32,8,32768"])
    ap.add_argument("--sparsity", nargs="+", type=float, default=[0.875, 0.5])
    ap.add_argument("--geoms", nargs="+", default=["1,64,4,3", "1,64,4,4", "2,64,4,3", "1,128,8,3", "1,32,4,4"],
                    help="split factor (times the dense kernel's), keys per tile, warps, stages[, register cap]")
    ap.add_argument("--anchors", type=int, nargs=2, metavar=("FIRST", "LAST"),
                    help="also time the threshold predicted from each row's first FIRST and newest LAST keys")
    ap.add_argument("--count-variants", action="store_true",
                    help="also time every way of counting each head's kept keys (threshold known)")
    ap.add_argument("--store-variants", action="store_true",
                    help="also time how the scores are stored, and passes that read K only (no output check)")
    ap.add_argument("--dtype", nargs="+", default=["fp16"], choices=sorted(bd.DTYPES))
    ap.add_argument("--only", nargs="+", metavar="VARIANT", help="time only these variants (names as in the table)")
    ap.add_argument("--out")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
