"""Does an exact Sift step in one launch, its scores never leaving registers, beat today's two passes at few rows?

Today's exact step writes every key's float32 scores (scores pass) and reads them back to threshold, compact and
gather (filter pass): at GQA 12/2 that is 48 of a key row's 390 bytes at tau 0.875, a second launch, and a scan
bound by the latency of its L2 loads. Here each program takes one chunk of ``--chunk`` keys of a (batch, KV head)
row: it computes the group's scores in registers, publishes their (max, sum), meets the row's other programs at a
counter (all of a row's programs are resident: the grid runs in order, a row's chunks one after another), forms the
row's threshold, keeps p > eta (and the row maximum) as the float64 rule does, reads only the V rows some head keeps
(a masked load) and multiplies; the last program of each ``--groups`` chunks sums their parts and the row's last
group the groups' sums (0: the row's last program sums every part). Nothing is compacted and no score is written.

Planted inputs as ``bench_decode.py --tune-grid`` (a group's queries correlated 0.7), each checked against float64
(kept counts equal, output error < 1e-2), timed as CUDA graphs beside the library's exact step, its dense kernel and
SDPA in one run. A probe, not a library kernel: no sequence lengths, left padding or renormalisation.

    PYTHONPATH=. timeout 400 python3 benchmarks/studies/onelaunch_probe.py --out $OUT/onelaunch_probe_h100.json

(``timeout``: the meeting assumes the GPU starts a row's programs before the next row's, as it starts blocks in
order; the probe skips variants whose row cannot be resident at once, but a hang would otherwise hold the machine.)
    BENCH_DEVICE=cpu TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/studies/onelaunch_probe.py --smoke   # CPU
    BENCH_DEVICE=cpu TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/studies/onelaunch_probe.py \
        --shapes 2,12,2,300 --chunks 64 --warps 4      # the whole script on the CPU (times meaningless)

Answer (H100, 2026-11-27, ``onelaunch_probe_h100.json``): no. Exact in every variant; the best at 2.2-2.9x SDPA on
Qwen's shapes and 1.24-1.28x on SmolLM2's, against the two passes' 0.84-1.00x (docs/kernels.md, "One launch, the
scores kept on chip").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOG2E = 1.4426950408889634


@triton.jit
def _chunk_program(Q, S, stride_qb, stride_qh, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                   D: tl.constexpr, CHUNK: tl.constexpr):
    """This program's chunk and (batch, KV head) row, the group's query heads (padded to BLOCK_G) and its keys'
    positions and validity."""
    split = tl.program_id(0)
    row = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=gm[:, None], other=0.0)
    n = split * CHUNK + tl.arange(0, CHUNK)
    return split, row, b, h, g, gm, d, q, n, n < S


@triton.jit
def _merged(Mst, Lst, row, NSPLIT, g, BLOCK_G: tl.constexpr, MB: tl.constexpr):
    """(largest max, sum of exp2 relative to it) [BLOCK_G] over the row's published chunk statistics, MB chunks a load
    (the largest may be -inf: no valid key)."""
    big = tl.full([BLOCK_G], float("-inf"), tl.float32)
    tot = tl.zeros([BLOCK_G], tl.float32)
    mb = tl.arange(0, MB)
    for j0 in range(0, NSPLIT, MB):
        idx = (row * NSPLIT + j0 + mb)[:, None] * BLOCK_G + g[None, :]
        msk = ((j0 + mb) < NSPLIT)[:, None]
        ms = tl.load(Mst + idx, mask=msk, other=float("-inf"))
        ls = tl.load(Lst + idx, mask=msk, other=0.0)
        new = tl.maximum(big, tl.max(ms, axis=0))
        safe = tl.where(new == float("-inf"), 0.0, new)
        tot = tot * tl.exp2(big - safe) + tl.sum(ls * tl.exp2(ms - safe[None, :]), axis=0)
        big = new
    return big, tot


@triton.jit
def _row_stats(Mst, Lst, RowM, RowL, Sync, row, NSPLIT, target, g, BLOCK_G: tl.constexpr, MB: tl.constexpr,
               MEET: tl.constexpr):
    """The row's merged (max, sum) once every chunk has published its own. ``MEET`` (one launch on the GPU): the
    program that arrives ``target``-th at the row's counter merges and publishes them and adds one more, the others
    wait for that and read them (a row's chunks are merged once, not by each program). Without (the interpreter's
    phase launches, programs run one at a time): each program merges."""
    if MEET:
        tl.debug_barrier()
        seen = tl.atomic_add(Sync + row, 1, sem="acq_rel", scope="gpu") + 1
        if seen == target:
            big, tot = _merged(Mst, Lst, row, NSPLIT, g, BLOCK_G, MB)
            tl.store(RowM + row * BLOCK_G + g, big)
            tl.store(RowL + row * BLOCK_G + g, tot)
            tl.debug_barrier()
            tl.atomic_add(Sync + row, 1, sem="release", scope="gpu")
        else:
            while seen < target + 1:
                seen = tl.load(Sync + row, volatile=True)
            tl.atomic_add(Sync + row, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        big = tl.load(RowM + row * BLOCK_G + g)
        tot = tl.load(RowL + row * BLOCK_G + g)
    else:
        big, tot = _merged(Mst, Lst, row, NSPLIT, g, BLOCK_G, MB)
    return big, tot


@triton.jit
def _sum_parts(Part, Cnt, first, count, g, gm, d, BLOCK_G: tl.constexpr, D: tl.constexpr, CH: tl.constexpr):
    """The sums of ``count`` consecutive parts from ``first`` ([BLOCK_G, D] outputs and kept counts), CH a load."""
    out = tl.zeros([BLOCK_G, D], tl.float32)
    kept = tl.zeros([BLOCK_G], tl.int32)
    ch = tl.arange(0, CH)
    for j0 in range(0, count, CH):
        pj = (first + j0 + ch)[:, None] * BLOCK_G + g[None, :]  # [CH, BLOCK_G]
        pm = ((j0 + ch) < count)[:, None] & gm[None, :]
        out += tl.sum(tl.load(Part + pj[:, :, None] * D + d[None, None, :], mask=pm[:, :, None], other=0.0), axis=0)
        kept += tl.sum(tl.load(Cnt + pj, mask=pm, other=0), axis=0)
    return out, kept


@triton.jit
def _finish(Out, Kept, Sync, out, kept, total, b, h, row, g, gm, d, HQ: tl.constexpr, G: tl.constexpr,
            D: tl.constexpr):
    o = b * HQ + h * G + g
    tl.store(Out + o[:, None] * D + d[None, :], (out / total[:, None]).to(Out.dtype.element_ty), mask=gm[:, None])
    tl.store(Kept + o, kept, mask=gm)
    tl.store(Sync + row, 0)


@triton.jit
def _combine(Part, Cnt, GPart, GCnt, GSync, Sync, Out, Kept, acc, cnt, total, split, row, b, h, g, gm, d, NSPLIT, BASE,
             NGMAX, HQ: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, CH: tl.constexpr,
             GROUP: tl.constexpr):
    """Publish this chunk's part (``acc`` [BLOCK_G, D], kept counts ``cnt``) and, for the last to finish, sum the row's:
    in two levels with ``GROUP`` (the last of each GROUP chunks sums them, the row's last group the groups' sums), else
    the row's last program sums them all. The row's counter stands at ``BASE`` when the chunks start to finish."""
    part = (row * NSPLIT + split) * BLOCK_G + g
    tl.store(Part + part[:, None] * D + d[None, :], acc, mask=gm[:, None])  # the group's heads only
    tl.store(Cnt + part, cnt, mask=gm)
    tl.debug_barrier()
    if GROUP > 0:
        grp = split // GROUP
        gsize = tl.minimum(NSPLIT - grp * GROUP, GROUP)
        seen_g = tl.atomic_add(GSync + row * NGMAX + grp, 1, sem="acq_rel", scope="gpu") + 1
        if seen_g == gsize:
            tl.debug_barrier()
            gout, gkept = _sum_parts(Part, Cnt, row * NSPLIT + grp * GROUP, gsize, g, gm, d, BLOCK_G, D, CH)
            gp = (row * NGMAX + grp) * BLOCK_G + g
            tl.store(GPart + gp[:, None] * D + d[None, :], gout, mask=gm[:, None])
            tl.store(GCnt + gp, gkept, mask=gm)
            tl.store(GSync + row * NGMAX + grp, 0)
            tl.debug_barrier()
            seen = tl.atomic_add(Sync + row, 1, sem="acq_rel", scope="gpu") + 1
            if seen == BASE + tl.cdiv(NSPLIT, GROUP):
                tl.debug_barrier()
                out, kept = _sum_parts(GPart, GCnt, row * NGMAX, tl.cdiv(NSPLIT, GROUP), g, gm, d, BLOCK_G, D, CH)
                _finish(Out, Kept, Sync, out, kept, total, b, h, row, g, gm, d, HQ, G, D)
    else:
        seen = tl.atomic_add(Sync + row, 1, sem="acq_rel", scope="gpu") + 1
        if seen == BASE + NSPLIT:
            tl.debug_barrier()
            out, kept = _sum_parts(Part, Cnt, row * NSPLIT, NSPLIT, g, gm, d, BLOCK_G, D, CH)
            _finish(Out, Kept, Sync, out, kept, total, b, h, row, g, gm, d, HQ, G, D)


@triton.jit
def _gather_and_combine(keep, s, big, total, V, stride_vb, stride_vh, stride_vs, Part, Cnt, GPart, GCnt, GSync, Sync,
                        Out, Kept, split, row, b, h, g, gm, d, n, NSPLIT, BASE, NGMAX, HQ: tl.constexpr, G: tl.constexpr,
                        BLOCK_G: tl.constexpr, D: tl.constexpr, CH: tl.constexpr, GROUP: tl.constexpr,
                        UPCAST: tl.constexpr):
    """The kept keys' weights ``exp2(s - big)``, the V rows some head keeps (a masked load: the others are not
    read), their product, and the row's sum (``_combine``), divided there by ``total``."""
    p = tl.where(keep, tl.exp2(s - big[:, None]), 0.0)
    union = tl.max(keep.to(tl.int32), axis=0) > 0
    v = tl.load(V + b * stride_vb + h * stride_vh + n[:, None] * stride_vs + d[None, :], mask=union[:, None], other=0.0)
    if UPCAST:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v)
    _combine(Part, Cnt, GPart, GCnt, GSync, Sync, Out, Kept, acc, tl.sum(keep.to(tl.int32), axis=1), total, split, row,
             b, h, g, gm, d, NSPLIT, BASE, NGMAX, HQ, G, BLOCK_G, D, CH, GROUP)


@triton.jit
def _onelaunch_kernel(Q, K, V, Eta, Out, Kept, Mst, Lst, RowM, RowL, Part, Cnt, GPart, GCnt, GSync, Sync, S, NSPLIT,
                      BASE, NGMAX,
                      qk_scale2, stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                      HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                      CHUNK: tl.constexpr, MB: tl.constexpr, CH: tl.constexpr, GROUP: tl.constexpr,
                      PHASE: tl.constexpr, UPCAST: tl.constexpr):
    split, row, b, h, g, gm, d, q, n, valid = _chunk_program(Q, S, stride_qb, stride_qh, HKV, G, BLOCK_G, D, CHUNK)
    k = tl.load(K + b * stride_kb + h * stride_kh + n[:, None] * stride_ks + d[None, :], mask=valid[:, None], other=0.0)
    if UPCAST:  # the interpreter's 16-bit dots are not exact
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * qk_scale2, float("-inf"))  # [BLOCK_G, CHUNK], log2 units
    m = tl.max(s, axis=1)
    l_ = tl.sum(tl.exp2(s - m[:, None]), axis=1)
    stat = (row * NSPLIT + split) * BLOCK_G + g
    if PHASE != 2:
        tl.store(Mst + stat, m)
        tl.store(Lst + stat, l_)
    if PHASE == 1:  # the interpreter runs programs one by one: its first launch only publishes the statistics
        return
    big, total = _row_stats(Mst, Lst, RowM, RowL, Sync, row, NSPLIT, NSPLIT, g, BLOCK_G, MB, PHASE == 0)
    big_safe = tl.where(gm, big, 0.0)
    eta = tl.load(Eta + b * HQ + h * G + g, mask=gm, other=1.0)
    thr = big_safe + tl.log2(tl.where(gm, total, 1.0)) + tl.log2(eta)  # p > eta  <=>  s > thr
    keep = ((s > thr[:, None]) | (s == big_safe[:, None])) & valid[None, :] & gm[:, None]
    _gather_and_combine(keep, s, big_safe, total, V, stride_vb, stride_vh, stride_vs, Part, Cnt, GPart, GCnt, GSync,
                        Sync, Out, Kept, split, row, b, h, g, gm, d, n, NSPLIT, BASE, NGMAX, HQ, G, BLOCK_G, D, CH, GROUP,
                        UPCAST)


def resident_programs(kernel, args: tuple, kw: dict, warps: int, q: torch.Tensor) -> tuple[int, dict]:
    """Programs of ``kernel`` that fit on the GPU at once, from its compiled registers and shared memory (all, under
    the interpreter), and those resources."""
    if not q.is_cuda:
        return 1 << 30, {}
    compiled = kernel.warmup(*args, grid=(1,), **kw)
    compiled._init_handles()  # loads the module: registers and spills are known from here
    regs, smem = compiled.n_regs, compiled.metadata.shared
    per_sm = min(65536 // max(1, regs * 32 * warps), (233472 - 1024) // max(1, smem + 1024), 2048 // (32 * warps), 32)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return per_sm * sms, dict(regs=regs, spills=compiled.n_spills, smem=smem, per_sm=per_sm)


class OneLaunch:
    """The probe's step for one shape: workspace allocated once, then ``run(q, k, v, eta)``."""

    def __init__(self, B: int, Hq: int, Hkv: int, S: int, D: int, chunk: int, warps: int, device, group: int = 8):
        self.B, self.Hq, self.Hkv, self.S, self.D, self.chunk, self.warps = B, Hq, Hkv, S, D, chunk, warps
        self.group = group
        self.G = Hq // Hkv
        self.block_g = max(16, triton.next_power_of_2(self.G))
        self.nsplit = triton.cdiv(S, chunk)
        rows = B * Hkv
        f32 = torch.float32
        self.mst = torch.empty(rows * self.nsplit * self.block_g, device=device, dtype=f32)
        self.lst = torch.empty_like(self.mst)
        self.rowm = torch.empty(rows * self.block_g, device=device, dtype=f32)
        self.rowl = torch.empty_like(self.rowm)
        self.part = torch.empty(rows * self.nsplit * self.block_g * D, device=device, dtype=f32)
        self.cnt = torch.empty(rows * self.nsplit * self.block_g, device=device, dtype=torch.int32)
        self.sync = torch.zeros(rows, device=device, dtype=torch.int32)
        self.ngmax = triton.cdiv(self.nsplit, group) if group else 1
        self.gpart = torch.empty(rows * self.ngmax * self.block_g * D, device=device, dtype=f32)
        self.gcnt = torch.empty(rows * self.ngmax * self.block_g, device=device, dtype=torch.int32)
        self.gsync = torch.zeros(rows * self.ngmax, device=device, dtype=torch.int32)
        self.kept = torch.empty(B, Hq, device=device, dtype=torch.int32)

    def _args(self, q, k, v, eta, out, phase: int):
        return ((q, k, v, eta, out, self.kept, self.mst, self.lst, self.rowm, self.rowl, self.part, self.cnt, self.gpart,
                 self.gcnt, self.gsync, self.sync, self.S, self.nsplit, self.nsplit + 1 if phase == 0 else 0, self.ngmax,
                 self.D**-0.5 * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                 v.stride(0), v.stride(1), v.stride(2)),
                dict(HQ=self.Hq, HKV=self.Hkv, G=self.G, BLOCK_G=self.block_g, D=self.D, CHUNK=self.chunk,
                     MB=32, CH=4, GROUP=self.group, PHASE=phase,
                     UPCAST=not q.is_cuda, num_warps=self.warps))

    def resident(self, q, k, v, eta) -> tuple[int, dict]:
        """Programs that fit on the GPU at once: a row's programs wait for each other, so a row of more programs than
        the GPU holds would never finish."""
        return resident_programs(_onelaunch_kernel, *self._args(q, k, v, eta, torch.empty_like(q), 0), self.warps, q)

    def run(self, q, k, v, eta):
        out = torch.empty_like(q)
        grid = (self.nsplit, self.B * self.Hkv)
        for phase in ((0,) if q.is_cuda else (1, 2)):  # the interpreter: two launches instead of a meeting
            args, kw = self._args(q, k, v, eta, out, phase)
            _onelaunch_kernel[grid](*args, **kw)
        return out, self.kept


def check(step, q, k, v, eta, kept_ref, rows) -> float:
    from bench_decode import ref_out64, rel_err

    out, kept = step.run(q, k, v, eta)
    assert torch.equal(kept, kept_ref), f"kept counts differ in {int((kept != kept_ref).sum())} heads"
    return max(rel_err(out[b], ref_out64(q, k, v, eta, b)) for b in rows)


def best_variant(variants: dict) -> tuple[str, dict] | None:
    """The fastest variant that ran and checked (name, its row), or None where every one failed."""
    ran = {name: v for name, v in variants.items() if "ms" in v}
    return min(ran.items(), key=lambda item: item[1]["ms"]) if ran else None


def baselines(sets: list, sparsity: list[float], dev: str) -> tuple:
    """The library's plan for the sets' shape, full sequence lengths, SDPA's and the dense kernel's times, and each
    set's float64 thresholds at each sparsity (``bench_decode.thresholds``)."""
    import bench_decode as bd

    from siftattention.kernels import DecodeKernels

    (B, Hq, D), (Hkv, S) = sets[0][0].shape, sets[0][1].shape[1:3]
    full = bd.full_lens(B, S)
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=sets[0][0].dtype,
                              device=torch.device(dev), scale=D**-0.5)
    t_sdpa = bd.bench_graph(bd.sdpa_decode, sets)
    t_dense = bd.bench_graph(lambda q, k, v: kern.dense(q, k, v, full), sets)
    return kern, full, t_sdpa, t_dense, [bd.thresholds(q, k, sparsity) for q, k, v in sets]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["8,12,2,16640", "16,12,2,33024", "8,12,2,32768", "16,9,3,8192"],
                    help="B,Hq,Hkv,S (D = 128 at 12/2, 64 at 9/3: the real models' heads)")
    ap.add_argument("--chunks", type=int, nargs="*", default=[128, 256])
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--groups", type=int, nargs="*", default=[8, 0],
                    help="chunks summed by the last of each group before the row's sum (0: the row's last sums all)")
    ap.add_argument("--sparsity", type=float, nargs="*", default=[0.875, 0.95])
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1 (BENCH_DEVICE=cpu): the math, in two launches instead of a meeting")
    ap.add_argument("--out", type=Path, default=Path("onelaunch_probe.json"))
    args = ap.parse_args()
    import bench_decode as bd

    dev = bd.DEV  # "cuda", or "cpu" with BENCH_DEVICE=cpu: a dry run of the whole script under the interpreter
    gen = torch.Generator(device=dev).manual_seed(3)
    if args.smoke:
        for B, Hq, Hkv, S, D, chunk in ((2, 12, 2, 77, 128, 128), (2, 12, 2, 333, 128, 32), (3, 9, 3, 250, 64, 16),
                                        (1, 8, 8, 33, 32, 64), (2, 16, 2, 100, 64, 16), (2, 12, 2, 600, 64, 16)):
            q, k, v = bd.make_inputs(B, Hq, Hkv, S, D, torch.float32, 3.0, 0.7, gen)
            for sp, group in ((0.875, 4), (0.95, 0)):
                (eta, kept_ref, _), = bd.thresholds(q, k, [sp])
                step = OneLaunch(B, Hq, Hkv, S, D, chunk, 4, q.device, group)
                err = check(step, q, k, v, eta.float(), kept_ref.int(), range(B))
                print(f"smoke {B},{Hq},{Hkv},{S},{D}, {step.nsplit} chunks, groups of {group}, s = {sp}: kept equal, "
                      f"output error {err:.1e}")
                assert err < 1e-4, err
        return
    report = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)", "date": time.strftime("%Y-%m-%d %H:%M"), "triton": triton.__version__,
              "rows": []}
    print(report["device"], flush=True)
    for shape in args.shapes:
        B, Hq, Hkv, S = (int(x) for x in shape.split(","))
        D = 64 if Hq // Hkv == 3 else 128
        sets = [bd.make_inputs(B, Hq, Hkv, S, D, torch.bfloat16, 3.0, 0.7, gen) for _ in range(3)]
        kern, full, t_sdpa, t_dense, ths = baselines(sets, args.sparsity, dev)
        for j, sp in enumerate(args.sparsity):
            eta_sets = [s + (t[j][0].float(),) for s, t in zip(sets, ths)]
            t_two = bd.bench_graph(lambda q, k, v, e: kern.sparse(q, k, v, e, full), eta_sets)
            row = dict(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, sparsity=sp, v_rows=sum(t[j][2] for t in ths) / len(ths),
                       sdpa_ms=t_sdpa, dense_ms=t_dense, two_pass_ms=t_two, variants={})
            for chunk, warps, group in ((c, w, gr) for c in args.chunks for w in args.warps for gr in args.groups):
                name = f"chunk{chunk}_w{warps}_g{group}"
                try:
                    step = OneLaunch(B, Hq, Hkv, S, D, chunk, warps, dev, group)
                    slots, res = step.resident(*eta_sets[0])
                    if step.nsplit > 0.9 * slots:  # the row would not fit on the GPU at once: it would hang
                        row["variants"][name] = dict(skipped=f"{step.nsplit} programs a row, {slots} fit", **res)
                        print(shape, sp, name, json.dumps(row["variants"][name]), flush=True)
                        continue
                    errs = [check(step, *s, t[j][1].int(), range(0, B, max(1, B // 3))) for s, t in zip(eta_sets, ths)]
                    t_one = bd.bench_graph(lambda q, k, v, e: step.run(q, k, v, e), eta_sets)
                    row["variants"][name] = dict(ms=t_one, err=max(errs), vs_two_pass=t_one / t_two, vs_sdpa=t_one / t_sdpa,
                                                 programs=step.nsplit * B * Hkv, **res)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile or check is reported
                    row["variants"][name] = dict(error=repr(e)[:300])
                print(shape, sp, name, json.dumps(row["variants"][name]), flush=True)
            report["rows"].append(row)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| shape | s | V rows | SDPA ms | dense / SDPA | two-pass / SDPA | best one-launch / SDPA (variant) |")
    print("|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        best = best_variant(r["variants"])
        cell = f"{best[1]['vs_sdpa']:.3f} ({best[0]})" if best else "failed"
        print(f"| {r['B']}x{r['Hq']}/{r['Hkv']}x{r['S']} | {r['sparsity']} | {r['v_rows']:.3f} | {r['sdpa_ms']:.4f} | "
              f"{r['dense_ms'] / r['sdpa_ms']:.3f} | {r['two_pass_ms'] / r['sdpa_ms']:.3f} | {cell} |")
    if not math.isfinite(sum(r["sdpa_ms"] for r in report["rows"])):
        raise SystemExit("a timing failed")


if __name__ == "__main__":
    main()
