"""Where the CPU sift decode step of one layer spends its time, part by part, against SDPA.

The torch backend (kernels/torch_ref.py) runs the step as separate passes: scores (with the
validity mask), softmax, keep mask, then the weighted sum with V as a dense product in which
the pruned weights are zeros. This times each part on random inputs of the embedded model's
attention shape (batch 4, 9 query / 3 KV heads, head_dim 64, float32) at a given sparsity.

    .venv/bin/python benchmarks/studies/cpu_sparse_breakdown.py --lengths 512 2048 8192 --out cpu_sparse_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from siftattention.kernels import torch_ref


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls after a warmup."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--keep", type=float, default=0.025, help="target share of keys kept per head")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    B, Hq, Hkv, D, scale = 4, 9, 3, 64, 0.125
    rows = []
    for S in args.lengths:
        q, k, v = torch.randn(B, Hq, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
        lens = torch.full((B,), S, dtype=torch.int32)
        s, valid = torch_ref._scores(q, k, scale, lens)
        p = torch_ref._probs(s)
        eta = torch.quantile(p, 1 - args.keep, dim=-1)  # keeps about args.keep of each row
        keep = torch_ref.keep_mask(p, s, valid, eta)
        w = torch.where(keep, p, torch.zeros(()))
        row = dict(
            keys=S,
            kept=float(keep.float().mean()),
            sdpa_ms=timed(lambda: torch_ref.dense_decode_torch(q, k, v, scale, lens), args.repeats),
            sift_step_ms=timed(lambda: torch_ref.sift_decode_torch(q, k, v, eta, scale, lens, True), args.repeats),
            scores_ms=timed(lambda: torch_ref._scores(q, k, scale, lens), args.repeats),
            scores_unmasked_ms=timed(lambda: torch_ref._scores(q, k, scale, None), args.repeats),
            softmax_ms=timed(lambda: torch_ref._probs(s), args.repeats),
            keep_ms=timed(lambda: torch_ref.keep_mask(p, s, valid, eta), args.repeats),
            weighted_v_ms=timed(lambda: torch_ref._apply_v(w, v), args.repeats),
        )
        rows.append(row)
    result = dict(torch=torch.__version__, threads=torch.get_num_threads(), shape=dict(B=B, Hq=Hq, Hkv=Hkv, D=D), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("keys | kept | SDPA ms | sift step ms | scores (unmasked) | softmax | keep mask | weighted V")
    for r in rows:
        print(f"{r['keys']} | {r['kept']:.3f} | {r['sdpa_ms']:.3f} | {r['sift_step_ms']:.3f} | {r['scores_ms']:.3f} "
              f"({r['scores_unmasked_ms']:.3f}) | {r['softmax_ms']:.3f} | {r['keep_ms']:.3f} | {r['weighted_v_ms']:.3f}")


if __name__ == "__main__":
    main()
