"""One Sift decode step on the CPU, exact or anchored normaliser, fused C++ kernel against the torch
backend (float32, SmolLM2's head layout: 9 query heads, 3 KV heads, D = 64).

    .venv/bin/python benchmarks/studies/cpu_anchored_step.py --out benchmarks/results/cpu_anchored_step.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from siftattention.kernels import DecodeKernels
from siftattention.kernels.plan import PowerLawThreshold


def step_ms(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["32x600", "4x2048"], help="BATCHxKEYS")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    Hq, Hkv, D = 9, 3, 64
    rows = []
    for shape in args.shapes:
        B, S = map(int, shape.split("x"))
        q, k, v = torch.randn(B, Hq, D) * 2, torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
        seq_lens = torch.full((B,), S, dtype=torch.int32)
        threshold = PowerLawThreshold(torch.full((B, Hq), -3.0), torch.zeros(B, Hq), torch.zeros(B))  # eta = e^-3
        row = dict(batch=B, keys=S)
        for backend in ("cpu", "torch"):
            kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=torch.float32,
                                      device="cpu", scale=D**-0.5, backend=backend)
            gap = torch.zeros(B, Hq)
            row[f"{backend}_exact_ms"] = step_ms(lambda: kern.sparse(q, k, v, threshold, seq_lens), args.repeats)
            row[f"{backend}_anchored_ms"] = step_ms(
                lambda: kern.sparse_anchored(q, k, v, threshold, gap, seq_lens, None, 64, 256), args.repeats)
        rows.append(row)
        print(" ".join(f"{key} {val:.3f}" if isinstance(val, float) else f"{key} {val}" for key, val in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, threads=torch.get_num_threads(),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
