"""How fast can the filter pass read the V rows a GQA group keeps? Floors on this GPU.

The sift filter pass at GQA (32, 8), B = 8, S = 32768, s = 0.875 reads the V rows some
head of a group keeps (about 41% with independent heads) at about 2 TB/s. This script
times the pieces of that pass in isolation, on the same data layout, to tell apart
"the kernel's structure is slow" from "reading scattered 256-byte rows is slow":

- ``copy``: device-to-device copy (the byte floor's bandwidth);
- ``stream``: every V row of a split read in tiles, weights applied with one dot
  (what the streaming mode does; reads all of V);
- ``masked``: the same tiles with V loads masked to the kept rows (a per-key mask);
- ``gather``: a precomputed list of kept positions and compacted weights per split,
  V rows gathered by index (the compact mode's phase B on its own);
- ``scan``: the compaction alone (scores -> kept positions and weights; phase A);
- ``scan+gather``: both in one program, one after the other (the current structure);
- ``index_select``: torch's gather of the same rows, for reference.

Bandwidth is useful bytes over time: kept V rows (plus the index and weight bytes a
variant reads); ``stream`` counts all V. Each Triton variant's output is checked
against a float64 torch reference before it is timed.

    PYTHONPATH=. python3 benchmarks/studies/gather_floor.py --out gather.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _program_split(S, SPLIT_LEN):
    """(split, row, lo, hi): this program's split of its (batch, KV head) row of S keys."""
    split = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    lo = split * SPLIT_LEN
    return split, r, lo, tl.minimum(lo + SPLIT_LEN, S)


@triton.jit
def _store_partial(Out, r, split, acc, BLOCK_G: tl.constexpr, D: tl.constexpr):
    offs_g = tl.arange(0, BLOCK_G)
    tl.store(Out + ((r * tl.num_programs(0) + split) * BLOCK_G + offs_g)[:, None] * D + tl.arange(0, D)[None, :], acc)


@triton.jit
def _stream_kernel(V, W, Mask, Out, S, SPLIT_LEN, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                   BLOCK: tl.constexpr, MASKED: tl.constexpr, STAGES: tl.constexpr):
    split, r, lo, hi = _program_split(S, SPLIT_LEN)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK)
    g_mask = offs_g < G
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for n0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = n0 + offs_n
        nm = offs < hi
        w = tl.load(W + (r * G + offs_g)[:, None] * S + offs[None, :], mask=g_mask[:, None] & nm[None, :], other=0.0)
        if MASKED:
            keep = tl.load(Mask + r * S + offs, mask=nm, other=0) != 0
            vm = keep & nm
        else:
            vm = nm
        v = tl.load(V + (r * S + offs)[:, None] * D + offs_d[None, :], mask=vm[:, None], other=0.0,
                    eviction_policy="evict_first")
        acc += tl.dot(w, v)
    _store_partial(Out, r, split, acc, BLOCK_G, D)


@triton.jit
def _scan(Scores, Thr, Idx, Wc, r, lo, hi, S, G: tl.constexpr, BLOCK_GA: tl.constexpr, BLOCK_A: tl.constexpr):
    offs_ga = tl.arange(0, BLOCK_GA)
    ga_mask = offs_ga < G
    offs_a = tl.arange(0, BLOCK_A)
    thr = tl.load(Thr + r * G + offs_ga, mask=ga_mask, other=float("inf"))
    n_kept = lo * 0
    for n0 in tl.range(lo, hi, BLOCK_A, num_stages=1):
        offs = n0 + offs_a
        nm = offs < hi
        s = tl.load(Scores + (r * G + offs_ga)[:, None] * S + offs[None, :], mask=ga_mask[:, None] & nm[None, :],
                    other=float("-inf"))
        keep = (s > thr[:, None]) & nm[None, :]
        rk = tl.max(keep.to(tl.int32), axis=0)
        pos = tl.cumsum(rk, axis=0) - rk
        tl.store(Idx + r * S + lo + n_kept + pos, offs, mask=rk > 0)
        w = tl.where(keep, tl.math.exp2(s), 0.0)
        tl.store(Wc + (r * G + offs_ga)[:, None] * S + (lo + n_kept + pos)[None, :], w.to(Wc.dtype.element_ty),
                 mask=ga_mask[:, None] & (rk > 0)[None, :])
        n_kept += tl.sum(rk, axis=0)
    return n_kept


@triton.jit
def _gather(V, Idx, Wc, Out, r, split, lo, n, S, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
            BLOCK: tl.constexpr, STAGES: tl.constexpr):
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK)
    g_mask = offs_g < G
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for j in tl.range(0, n, BLOCK, num_stages=STAGES):
        jj = j + offs_n
        jm = jj < n
        idx = tl.load(Idx + r * S + lo + jj, mask=jm, other=0)
        w = tl.load(Wc + (r * G + offs_g)[:, None] * S + (lo + jj)[None, :], mask=g_mask[:, None] & jm[None, :], other=0.0)
        v = tl.load(V + (r * S + idx.to(tl.int64))[:, None] * D + offs_d[None, :], mask=jm[:, None], other=0.0,
                    eviction_policy="evict_first")
        acc += tl.dot(w, v)
    _store_partial(Out, r, split, acc, BLOCK_G, D)


@triton.jit
def _scan_kernel(Scores, Thr, Idx, Wc, Cnt, S, SPLIT_LEN, G: tl.constexpr, BLOCK_GA: tl.constexpr,
                 BLOCK_A: tl.constexpr):
    split, r, lo, hi = _program_split(S, SPLIT_LEN)
    n = _scan(Scores, Thr, Idx, Wc, r, lo, hi, S, G, BLOCK_GA, BLOCK_A)
    tl.store(Cnt + r * tl.num_programs(0) + split, n)


@triton.jit
def _gather_kernel(V, Idx, Wc, Cnt, Out, S, SPLIT_LEN, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                   BLOCK: tl.constexpr, STAGES: tl.constexpr):
    split, r, lo, _ = _program_split(S, SPLIT_LEN)
    n = tl.load(Cnt + r * tl.num_programs(0) + split)
    _gather(V, Idx, Wc, Out, r, split, lo, n, S, G, BLOCK_G, D, BLOCK, STAGES)


@triton.jit
def _scan_gather_kernel(V, Scores, Thr, Idx, Wc, Out, S, SPLIT_LEN, G: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_GA: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_A: tl.constexpr,
                        STAGES: tl.constexpr):
    split, r, lo, hi = _program_split(S, SPLIT_LEN)
    n = _scan(Scores, Thr, Idx, Wc, r, lo, hi, S, G, BLOCK_GA, BLOCK_A)
    tl.debug_barrier()
    _gather(V, Idx, Wc, Out, r, split, lo, n, S, G, BLOCK_G, D, BLOCK, STAGES)


# Dry runs of the script's logic on a CPU: BENCH_DEVICE=cpu TRITON_INTERPRET=1 (tiny shapes).
DEV = os.environ.get("BENCH_DEVICE", "cuda")


def bench(fn) -> float:
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="B x Hkv (default 8 x 8)")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--keep", type=float, nargs="*", default=[0.125], help="fraction each head keeps")
    ap.add_argument("--quick", action="store_true", help="a few configs per variant")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = DEV
    R, S, G, D = args.rows, args.seq, args.group, 128
    BG, BGA = max(16, G), triton.next_power_of_2(G)
    gen = torch.Generator(device=dev).manual_seed(0)
    V = torch.randn(R, S, D, device=dev, dtype=torch.float16, generator=gen)
    v_bytes = V.numel() * 2
    src = torch.empty(1 << 30 if dev == "cuda" else 1 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() / (bench(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    rows = [dict(variant="copy", tbps=copy_bps / 1e12)]
    print(f"copy {copy_bps / 1e12:.2f} TB/s (read + write)", flush=True)

    def record(variant, ms, useful, **kw):
        rows.append(dict(variant=variant, ms=ms, tbps=useful / (ms * 1e-3) / 1e12, **kw))
        print(f"{variant:13s} {json.dumps(kw):70s} {ms * 1e3:8.1f} us {useful / (ms * 1e-3) / 1e12:5.2f} TB/s", flush=True)

    for keep_frac, corr in itertools.product(args.keep, (0, 1)):
        if corr:  # every head of a group alike: the union is one head's keep set
            scores = torch.randn(R, 1, S, device=dev, generator=gen).expand(R, G, S).contiguous()
        else:
            scores = torch.randn(R, G, S, device=dev, generator=gen)
        thr = torch.quantile(scores[:, :, : min(S, 1 << 14)].float(), 1 - keep_frac, dim=-1).contiguous()
        keep = scores > thr[..., None]
        union = keep.any(1)
        density = union.float().mean().item()
        n_union = int(union.sum())
        w_full = torch.where(keep, torch.exp2(scores), torch.zeros((), device=dev)).to(torch.float16)
        ref = torch.einsum("rgs,rsd->rgd", w_full.double(), V.double())
        def rel_err(out: torch.Tensor) -> float:
            """Max error of the split partials' sum against float64, relative to the largest output."""
            return (out.sum(1)[:, :G].double() - ref).abs().max().item() / ref.abs().max().item()

        tag = dict(keep=keep_frac, corr=corr, density=round(density, 4))
        print(f"-- each head keeps {keep_frac}, heads {'identical' if corr else 'independent'}: "
              f"union density {density:.3f}", flush=True)

        flat = (union.nonzero()[:, 0] * S + union.nonzero()[:, 1]).to(torch.int64)
        Vf = V.view(-1, D)
        record("index_select", bench(lambda: Vf.index_select(0, flat)), n_union * D * 2 * 2, **tag)

        mask8 = union.to(torch.int8).contiguous()
        splits_all = (8, 16, 32, 64) if not args.quick else (8, 32)
        for masked, nsplit, block, stages, warps in itertools.product(
                (False, True), splits_all, (32, 64, 128), (2, 3, 4), (4, 8)):
            if args.quick and (stages != 3 or warps != 4):
                continue
            split_len = triton.cdiv(S, nsplit)
            out = torch.empty(R, nsplit, BG, D, device=dev, dtype=torch.float32)
            fn = lambda: _stream_kernel[(nsplit, R)](V, w_full, mask8, out, S, split_len, G=G, BLOCK_G=BG, D=D,
                                                    BLOCK=block, MASKED=masked, STAGES=stages, num_warps=warps)
            fn()
            err = rel_err(out)
            useful = (n_union * D * 2 if masked else v_bytes) + R * S * (G * 2 + (1 if masked else 0))
            record("masked" if masked else "stream", bench(fn), useful, nsplit=nsplit, block=block, stages=stages,
                   warps=warps, err=err, **tag)

        for nsplit, block_a in itertools.product(splits_all, (512, 1024, 2048)):
            split_len = triton.cdiv(S, nsplit)
            idx = torch.empty(R, S, device=dev, dtype=torch.int32)
            wc = torch.empty(R, G, S, device=dev, dtype=torch.float16)
            cnt = torch.empty(R, nsplit, device=dev, dtype=torch.int32)
            scan = lambda: _scan_kernel[(nsplit, R)](scores, thr, idx, wc, cnt, S, split_len, G=G, BLOCK_GA=BGA,
                                                     BLOCK_A=block_a)
            scan()
            ok_cnt = int(cnt.sum()) == n_union
            record("scan", bench(scan), scores.numel() * 4 + n_union * (4 + 2 * G), nsplit=nsplit, block_a=block_a,
                   ok=ok_cnt, **tag)
            for block, stages, warps in itertools.product((32, 64, 128), (2, 3, 4), (4, 8)):
                if args.quick and (stages != 3 or warps != 4 or block_a != 1024):
                    continue
                if block_a != 1024 and (stages != 3 or warps != 4):
                    continue
                out = torch.empty(R, nsplit, BG, D, device=dev, dtype=torch.float32)
                gather = lambda: _gather_kernel[(nsplit, R)](V, idx, wc, cnt, out, S, split_len, G=G, BLOCK_G=BG, D=D,
                                                             BLOCK=block, STAGES=stages, num_warps=warps)
                gather()
                err = rel_err(out)
                useful = n_union * (D * 2 + 4 + 2 * G)
                cfg = dict(nsplit=nsplit, block=block, stages=stages, warps=warps, block_a=block_a)
                record("gather", bench(gather), useful, err=err, **cfg, **tag)
                both = lambda: _scan_gather_kernel[(nsplit, R)](V, scores, thr, idx, wc, out, S, split_len, G=G,
                                                               BLOCK_G=BG, BLOCK_GA=BGA, D=D, BLOCK=block,
                                                               BLOCK_A=block_a, STAGES=stages, num_warps=warps)
                both()
                err = rel_err(out)
                record("scan+gather", bench(both), useful + scores.numel() * 4 + n_union * (4 + 2 * G), err=err,
                       **cfg, **tag)
        del scores, keep, w_full, ref
        torch.cuda.empty_cache()

    best = {}
    for r in rows:
        if "ms" not in r or r.get("err", 0) > 1e-2 or r.get("ok") is False:
            continue
        k = (r["variant"], r.get("keep"), r.get("corr"))
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    print("\nbest per variant (useful TB/s; copy", f"{copy_bps / 1e12:.2f})")
    for k, r in sorted(best.items(), key=lambda kv: str(kv[0])):
        cfg = {x: r[x] for x in ("nsplit", "block", "stages", "warps", "block_a") if x in r}
        print(f"{k[0]:13s} keep={k[1]} corr={k[2]} density={r.get('density')}  {r['ms'] * 1e3:7.1f} us "
              f"{r['tbps']:5.2f} TB/s  {cfg}")
    if args.out:
        meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__, triton=triton.__version__,
                    date=time.strftime("%Y-%m-%d"), rows=R, seq=S, group=G, head_dim=D)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, copy_tbps=copy_bps / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
