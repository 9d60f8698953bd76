"""The key-bound step in one launch, its estimates and scores never leaving registers: does it read less than the
exact step and finish sooner?

The library's key-bound step (``Sift(keybound=...)``, docs/kernels.md "The key-bound step") reads an int8 copy of
the keys, then the candidates' full keys, in three launches whose float32 estimates and scores cross memory three
times (72 bytes a key row at GQA 12/2, beside the 132-byte int8 row): it is 1.28-1.45x slower than the exact step
on captured Qwen2.5-1.5B caches. Here each program takes one chunk of a (batch, KV head) row, as
``onelaunch_probe.py`` does, with the per-channel int8 copy and the library's bound (``kernels/keybound.py``):

1. estimates ``s_hat`` and bounds ``e`` of its chunk; it publishes the (max, sum) of the lower bounds ``s_hat - e``;
2. after the row's programs meet: ``T_lo``, the candidates (some head's ``s_hat + e`` above ``T_lo``, or at least
   the largest lower bound), their full K rows by a masked load, exact scores for them, and it publishes the
   (max, sum) of the mixed scores (exact for candidates, estimates elsewhere);
3. after a second meeting: ``T_est = max(LSE_est + log eta, T_lo)``, the kept keys (candidates above it, and the
   row maximum), their V rows by a masked load, the parts summed in two levels.

Checked against float64 (kept counts equal to the exact rule's, output error < 1e-2) and timed beside the
library's exact and key-bound steps, its dense kernel and SDPA, on planted inputs or ``--captured`` real caches
(``sift capture``, tiled over the batch; SDPA, dense and the exact step see the same keys):

    PYTHONPATH=. timeout 400 python3 benchmarks/studies/onelaunch_keybound_probe.py --captured /root/cap_qwen_32768.pt \
        --batch 16 --out $OUT/onelaunch_keybound_probe_h100.json
    BENCH_DEVICE=cpu TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/studies/onelaunch_keybound_probe.py --smoke

Answer (H100, 2026-11-27, planted GQA 12/2 at 16 x 32768 and 8 x 16640, ``onelaunch_keybound_probe_h100.json``):
no. Exact in every variant, but 2.9-4.1x SDPA against the three launches' 1.10-1.35x: the meetings make a row's
programs wait in lockstep (docs/kernels.md, "One launch, the scores kept on chip").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from onelaunch_probe import (LOG2E, _chunk_program, _gather_and_combine, _row_stats, baselines,  # noqa: E402
                             best_variant, resident_programs)

from siftattention.kernels.keybound import MARGIN, OFFSET_ROUNDING, SLACK2, quantize_keys  # noqa: E402
from siftattention.kernels.triton_keybound import _channel_dot  # noqa: E402

_MARGIN = tl.constexpr(MARGIN)
_OFFSET_ROUNDING = tl.constexpr(OFFSET_ROUNDING)
_SLACK2 = tl.constexpr(SLACK2)


@triton.jit
def _kb_kernel(Q, KQ, R, Chan, Off, K, V, Eta, Out, Kept, Cand, M1, L1, M2, L2, RowM1, RowL1, RowM2, RowL2,
               Part, Cnt, GPart, GCnt, GSync, Sync,
               S, NSPLIT, BASE, NGMAX, sm2, stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
               stride_rb, stride_rh, stride_vb, stride_vh, stride_vs,
               HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
               CHUNK: tl.constexpr, MB: tl.constexpr, CH: tl.constexpr, GROUP: tl.constexpr,
               PHASE: tl.constexpr, UPCAST: tl.constexpr):
    split, row, b, h, g, gm, d, q, n, valid = _chunk_program(Q, S, stride_qb, stride_qh, HKV, G, BLOCK_G, D, CHUNK)
    qf = q.to(tl.float32)
    z = row * D + d
    qo = qf * tl.load(Off + z)[None, :]
    shift = tl.sum(qo, axis=1) * sm2
    e_off = tl.sum(tl.abs(qo), axis=1) * (sm2 * _OFFSET_ROUNDING)
    qs = qf * tl.load(Chan + z)[None, :]
    e_head = tl.sum(tl.abs(qs), axis=1) * (sm2 * 0.5 * (1 + _MARGIN))
    kq = tl.load(KQ + b * stride_kb + h * stride_kh + n[:, None] * stride_ks + d[None, :], mask=valid[:, None], other=0)
    r = tl.load(R + b * stride_rb + h * stride_rh + n, mask=valid, other=0.0)
    s_hat = shift[:, None] + _channel_dot(qs, kq, True, False, UPCAST) * (r * sm2)[None, :]
    e = e_head[:, None] * r[None, :] + e_off[:, None]
    lo = tl.where(valid[None, :], s_hat - e, float("-inf"))
    hi = tl.where(valid[None, :], s_hat + e, float("-inf"))
    stat = (row * NSPLIT + split) * BLOCK_G + g
    if PHASE == 0 or PHASE == 1:
        m1 = tl.max(lo, axis=1)
        m1s = tl.where(m1 == float("-inf"), 0.0, m1)
        tl.store(M1 + stat, m1)
        tl.store(L1 + stat, tl.sum(tl.exp2(lo - m1s[:, None]), axis=1))
    if PHASE == 1:  # the interpreter runs programs one by one: three launches instead of two meetings
        return
    maxlo, tot1 = _row_stats(M1, L1, RowM1, RowL1, Sync, row, NSPLIT, NSPLIT, g, BLOCK_G, MB, PHASE == 0)
    big1 = tl.where(maxlo == float("-inf"), 0.0, maxlo)  # maxlo: the largest lower bound
    log_eta = tl.log2(tl.load(Eta + b * HQ + h * G + g, mask=gm, other=1.0))
    t_lo = big1 + tl.log2(tl.where(gm, tot1, 1.0)) + log_eta - _SLACK2
    cand_h = ((hi > t_lo[:, None]) | (hi >= maxlo[:, None])) & gm[:, None] & valid[None, :]
    cand = tl.max(cand_h.to(tl.int32), axis=0) > 0
    k = tl.load(K + b * stride_kb + h * stride_kh + n[:, None] * stride_ks + d[None, :], mask=cand[:, None], other=0.0)
    if UPCAST:
        s = tl.dot(qf, tl.trans(k.to(tl.float32)), input_precision="ieee") * sm2
    else:
        s = tl.dot(q, tl.trans(k)) * sm2
    mixed = tl.where(cand[None, :], s, tl.where(valid[None, :], s_hat, float("-inf")))
    if PHASE == 0 or PHASE == 2:
        m2 = tl.max(mixed, axis=1)
        m2s = tl.where(m2 == float("-inf"), 0.0, m2)
        tl.store(M2 + stat, m2)
        tl.store(L2 + stat, tl.sum(tl.exp2(mixed - m2s[:, None]), axis=1))
        tl.store(Cand + row * NSPLIT + split, tl.sum(cand.to(tl.int32), axis=0))
    if PHASE == 2:
        return
    big2, tot2 = _row_stats(M2, L2, RowM2, RowL2, Sync, row, NSPLIT, 2 * NSPLIT + 1, g, BLOCK_G, MB, PHASE == 0)
    big2 = tl.where(big2 == float("-inf"), 0.0, big2)
    t_est = tl.maximum(big2 + tl.log2(tl.where(gm, tot2, 1.0)) + log_eta, t_lo)
    keep = cand[None, :] & gm[:, None] & ((mixed > t_est[:, None]) | (mixed == big2[:, None]))
    _gather_and_combine(keep, mixed, big2, tot2, V, stride_vb, stride_vh, stride_vs, Part, Cnt, GPart, GCnt, GSync,
                        Sync, Out, Kept, split, row, b, h, g, gm, d, n, NSPLIT, BASE, NGMAX, HQ, G, BLOCK_G, D, CH, GROUP,
                        UPCAST)


class OneLaunchKeybound:
    """The probe's key-bound step for one shape: workspace allocated once, then ``run(q, k, v, keys, eta)``."""

    def __init__(self, B: int, Hq: int, Hkv: int, S: int, D: int, chunk: int, warps: int, device, group: int = 8,
                 maxnreg: int = 0):
        self.B, self.Hq, self.Hkv, self.S, self.D, self.chunk, self.warps, self.group = B, Hq, Hkv, S, D, chunk, warps, group
        self.maxnreg = maxnreg  # a register cap (0: none): more programs resident, so longer rows fit at once
        self.G = Hq // Hkv
        self.block_g = max(16, triton.next_power_of_2(self.G))
        self.nsplit = triton.cdiv(S, chunk)
        self.ngmax = triton.cdiv(self.nsplit, group) if group else 1
        rows, f32, i32 = B * Hkv, torch.float32, torch.int32
        stats = rows * self.nsplit * self.block_g
        self.m1, self.l1, self.m2, self.l2 = (torch.empty(stats, device=device, dtype=f32) for _ in range(4))
        self.rows_ml = [torch.empty(rows * self.block_g, device=device, dtype=f32) for _ in range(4)]
        self.part = torch.empty(stats * D, device=device, dtype=f32)
        self.cnt = torch.empty(stats, device=device, dtype=i32)
        self.cand = torch.empty(rows * self.nsplit, device=device, dtype=i32)
        self.gpart = torch.empty(rows * self.ngmax * self.block_g * D, device=device, dtype=f32)
        self.gcnt = torch.empty(rows * self.ngmax * self.block_g, device=device, dtype=i32)
        self.gsync = torch.zeros(rows * self.ngmax, device=device, dtype=i32)
        self.sync = torch.zeros(rows, device=device, dtype=i32)
        self.kept = torch.empty(B, Hq, device=device, dtype=i32)

    def _args(self, q, k, v, keys, eta, out, phase: int):
        kq, r, c, o = keys.values, keys.scales, keys.channel.contiguous(), keys.offset.contiguous()
        assert kq.stride() == k.stride() and kq.stride(3) == 1 and v.stride(3) == 1 and q.stride(2) == 1
        return ((q, kq, r, c, o, k, v, eta, out, self.kept, self.cand, self.m1, self.l1, self.m2, self.l2, *self.rows_ml,
                 self.part, self.cnt, self.gpart, self.gcnt, self.gsync, self.sync, self.S, self.nsplit,
                 2 * self.nsplit + 2 if phase == 0 else 0, self.ngmax, self.D**-0.5 * LOG2E,
                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), r.stride(0), r.stride(1),
                 v.stride(0), v.stride(1), v.stride(2)),
                dict(HQ=self.Hq, HKV=self.Hkv, G=self.G, BLOCK_G=self.block_g, D=self.D, CHUNK=self.chunk,
                     MB=32, CH=4, GROUP=self.group, PHASE=phase,
                     UPCAST=not q.is_cuda, num_warps=self.warps, **({"maxnreg": self.maxnreg} if self.maxnreg and q.is_cuda else {})))

    def resident(self, q, k, v, keys, eta) -> tuple[int, dict]:
        """Programs that fit on the GPU at once (a row's programs wait for each other twice)."""
        return resident_programs(_kb_kernel, *self._args(q, k, v, keys, eta, torch.empty_like(q), 0), self.warps, q)

    def run(self, q, k, v, keys, eta):
        out = torch.empty_like(q)
        grid = (self.nsplit, self.B * self.Hkv)
        for phase in ((0,) if q.is_cuda else (1, 2, 3)):
            args, kw = self._args(q, k, v, keys, eta, out, phase)
            _kb_kernel[grid](*args, **kw)
        return out, self.kept

    def candidates(self) -> float:
        """Key rows read in full, as a share of the valid rows (the last call)."""
        return float(self.cand.double().sum()) / (self.B * self.Hkv * self.S)


def check(step, q, k, v, keys, eta, kept_ref, rows) -> float:
    """Kept counts against the exact rule's (float64; the key-bound step may differ only within its epsilon of the
    threshold, which the thresholds here avoid), the output against the library's key-bound rule in float64 (its
    normaliser is the estimate's, within exp(+-epsilon) of the exact one)."""
    from bench_decode import rel_err

    from siftattention.kernels.keybound import keybound_step_torch

    out, kept = step.run(q, k, v, keys, eta)
    assert torch.equal(kept, kept_ref), f"kept counts differ in {int((kept != kept_ref).sum())} heads"
    ref = keybound_step_torch(q.double(), k.double(), v.double(), keys, eta, q.shape[-1] ** -0.5, None, False)["out"]
    return max(rel_err(out[b], ref[b]) for b in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["16,12,2,32768", "8,12,2,16640"], help="B,Hq,Hkv,S planted (D 128)")
    ap.add_argument("--captured", metavar="FILE", help="real caches from `sift capture` instead, tiled over --batch")
    ap.add_argument("--batch", type=int, nargs="*", default=[16])
    ap.add_argument("--chunks", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--maxnreg", type=int, nargs="*", default=[0, 128], help="register caps to try (0: none)")
    ap.add_argument("--sparsity", type=float, nargs="*", default=[0.875, 0.95])
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1 (BENCH_DEVICE=cpu): the math")
    ap.add_argument("--out", type=Path, default=Path("onelaunch_keybound_probe.json"))
    args = ap.parse_args()
    import bench_decode as bd

    dev = bd.DEV
    gen = torch.Generator(device=dev).manual_seed(3)
    if args.smoke:
        for B, Hq, Hkv, S, D, chunk, group in ((2, 12, 2, 333, 128, 32, 4), (3, 9, 3, 250, 64, 16, 0),
                                               (1, 8, 8, 33, 32, 64, 4), (2, 16, 2, 100, 64, 16, 2),
                                               (2, 12, 2, 600, 64, 16, 8)):
            q, k, v = bd.make_inputs(B, Hq, Hkv, S, D, torch.float32, 3.0, 0.7, gen)
            k = k + torch.randn(1, Hkv, 1, D, generator=gen) * 2  # a per-channel offset, as a key bias gives
            keys = quantize_keys(k, True)
            for sp in (0.875, 0.95):
                (eta, kept_ref, _), = bd.thresholds(q, k, [sp])
                step = OneLaunchKeybound(B, Hq, Hkv, S, D, chunk, 4, q.device, group)
                err = check(step, q, k, v, keys, eta.float(), kept_ref.int(), range(B))
                print(f"smoke {B},{Hq},{Hkv},{S},{D}, {step.nsplit} chunks, s = {sp}: kept equal, output error {err:.1e}, "
                      f"candidates {step.candidates():.3f} of key rows")
                assert err < 1e-4, err
        return
    report = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
              "date": time.strftime("%Y-%m-%d %H:%M"), "triton": triton.__version__, "rows": []}
    print(report["device"], flush=True)
    cases = ([(B, None) for B in args.batch] if args.captured else
             [(None, tuple(int(x) for x in s.split(","))) for s in args.shapes])
    for B_cap, shape in cases:
        if args.captured:
            sets, cap = bd.captured_inputs(args.captured, B_cap, args.sets, torch.bfloat16)
            B, Hq, _ = sets[0][0].shape
            Hkv, S, D = sets[0][1].shape[1], sets[0][1].shape[2], sets[0][1].shape[3]
        else:
            B, Hq, Hkv, S = shape
            D = 128
            sets = [bd.make_inputs(B, Hq, Hkv, S, D, torch.bfloat16, 3.0, 0.7, gen) for _ in range(args.sets)]
        keys = [quantize_keys(k, True) for q, k, v in sets]
        kern, full, t_sdpa, t_dense, ths = baselines(sets, args.sparsity, dev)
        for j, sp in enumerate(args.sparsity):
            eta_sets = [s + (t[j][0].float(),) for s, t in zip(sets, ths)]
            kb_sets = [s + (kk, t[j][0].float()) for s, kk, t in zip(sets, keys, ths)]
            t_exact = bd.bench_graph(lambda q, k, v, e: kern.sparse(q, k, v, e, full), eta_sets)
            t_kb = bd.bench_graph(lambda q, k, v, kk, e: kern.sparse_keybound(q, k, v, kk, e, full), kb_sets)
            row = dict(B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, sparsity=sp, captured=args.captured,
                       v_rows=sum(t[j][2] for t in ths) / len(ths), sdpa_ms=t_sdpa, dense_ms=t_dense,
                       exact_two_pass_ms=t_exact, keybound_three_launch_ms=t_kb, variants={})
            for chunk, warps, cap in ((c, w, m) for c in args.chunks for w in args.warps for m in args.maxnreg):
                name = f"chunk{chunk}_w{warps}" + (f"_r{cap}" if cap else "")
                try:
                    step = OneLaunchKeybound(B, Hq, Hkv, S, D, chunk, warps, dev, maxnreg=cap)
                    slots, res = step.resident(*kb_sets[0])
                    if step.nsplit > 0.9 * slots:  # the row would not fit on the GPU at once: it would hang
                        row["variants"][name] = dict(skipped=f"{step.nsplit} programs a row, {slots} fit", **res)
                        print(B, S, sp, name, json.dumps(row["variants"][name]), flush=True)
                        continue
                    errs, cands = [], []
                    for s, t in zip(kb_sets, ths):
                        errs.append(check(step, *s, t[j][1].int(), range(0, B, max(1, B // 3))))
                        cands.append(step.candidates())
                    t_one = bd.bench_graph(lambda q, k, v, kk, e: step.run(q, k, v, kk, e), kb_sets)
                    row["variants"][name] = dict(ms=t_one, err=max(errs), candidates=sum(cands) / len(cands),
                                                 vs_exact=t_one / t_exact, vs_keybound=t_one / t_kb,
                                                 vs_sdpa=t_one / t_sdpa, **res)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile or check is reported
                    row["variants"][name] = dict(error=repr(e)[:300])
                print(B, S, sp, name, json.dumps(row["variants"][name]), flush=True)
            report["rows"].append(row)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| B x S | s | V rows | exact / SDPA | key-bound (3 launches) / SDPA | best one-launch key-bound / SDPA "
          "(candidates; variant) |")
    print("|---|---|---|---|---|---|")
    for r in report["rows"]:
        best = best_variant(r["variants"])
        cell = f"{best[1]['vs_sdpa']:.3f} ({best[1]['candidates']:.3f}; {best[0]})" if best else "failed"
        print(f"| {r['B']}x{r['S']} | {r['sparsity']} | {r['v_rows']:.3f} | {r['exact_two_pass_ms'] / r['sdpa_ms']:.3f} | "
              f"{r['keybound_three_launch_ms'] / r['sdpa_ms']:.3f} | {cell} |")


if __name__ == "__main__":
    main()
