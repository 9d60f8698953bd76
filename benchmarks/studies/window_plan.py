"""Does a sliding-window layer's decode step pay for a plan sized for the whole cache?

Gemma-3's shape (B = 16, GQA 4/1, D = 256, bf16), planted random keys: the Sift step (``DecodeKernels.sparse``),
the dense kernel and SDPA on the window's keys alone, for a window at the end of a 33024-key cache planned for
the cache (``max_range`` None), the same planned for the window (``max_range`` = window), and caches as short as
the window. GPU time of CUDA-graph replays (``do_bench_cudagraph`` medians), one run.

    PYTHONPATH=. python3 benchmarks/studies/window_plan.py --out window_plan.json
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

from siftattention.kernels import DecodeKernels

B, HQ, HKV, D, CACHE = 16, 4, 1, 256, 33024


def measure(max_len: int, length: int, window: int | None, max_range: int | None) -> dict:
    dev = torch.device("cuda")
    k = torch.randn(B, HKV, max_len, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16) * 0.5
    seq = torch.full((B,), length, device=dev, dtype=torch.int32)
    starts = None if window is None else torch.full((B,), length - window, device=dev, dtype=torch.int32)
    kern = DecodeKernels.plan(batch=B, q_heads=HQ, kv_heads=HKV, max_len=max_len, head_dim=D, dtype=torch.bfloat16,
                              device=dev, scale=D**-0.5, max_range=max_range)
    eta = torch.full((B, HQ), 0.004, device=dev)
    _, kept = kern.sparse(q, k, v, eta, seq, starts)
    kern.dense(q, k, v, seq, starts)
    lo = 0 if window is None else length - window
    ks, vs = k[:, :, lo:length], v[:, :, lo:length]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], ks, vs, enable_gqa=True)  # noqa: E731
    geo = kern.geometry
    return dict(cache=max_len, keys=length - lo, max_range=max_range, splits=[geo["ns1"], geo["ns2"], geo["nsd"]],
                sift_us=do_bench_cudagraph(lambda: kern.sparse(q, k, v, eta, seq, starts), rep=200) * 1e3,
                dense_us=do_bench_cudagraph(lambda: kern.dense(q, k, v, seq, starts), rep=200) * 1e3,
                sdpa_us=do_bench_cudagraph(sdpa, rep=200) * 1e3, kept_mean=float(kept.float().mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--out", default="window_plan.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for w in args.windows:
        rows += [measure(CACHE, CACHE - 24, w, None), measure(CACHE, CACHE - 24, w, w), measure(w, w, None, None)]
    res = {"device": torch.cuda.get_device_name(), "shape": dict(B=B, Hq=HQ, Hkv=HKV, D=D), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{res['device']}\n| keys | cache | plan's range | splits (scores, filter, dense) | Sift us | dense us | SDPA us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['keys']} | {r['cache']} | {r['max_range'] or r['cache']} | {r['splits']} | {r['sift_us']:.1f} | "
              f"{r['dense_us']:.1f} | {r['sdpa_us']:.1f} |")


if __name__ == "__main__":
    main()
