"""One prompt chunk's attention after earlier chunks: the mask transformers builds vs the lower-right causal kernel.

A chunked prefill (``siftattention.generate(..., prefill_chunk=N)``) gives every chunk after
the first fewer queries than keys. transformers materialises a [B, 1, Q, K] boolean mask
for it and SDPA runs a masked kernel; ``exact_attention(..., causal=True)`` runs SDPA's
lower-right causal variant instead, with no mask. This script checks the two against a
float64 softmax on small odd shapes, then times both (CUDA events, median of repeats) at
Llama-3.1-8B's attention shape (GQA 32/8, D = 128, bf16)::

    PYTHONPATH=. python3 benchmarks/studies/bench_prefill_chunk.py --out prefill_chunk.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from siftattention.attention import exact_attention


def masked(q, k, v, scale):
    Q, K = q.shape[2], k.shape[2]
    mask = torch.ones(Q, K, dtype=torch.bool, device=q.device).tril(K - Q)[None, None].expand(q.shape[0], 1, Q, K)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def reference64(q, k, v, scale):
    Q, K = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(g, 1) for t in (k, v))
    s = scale * q.double() @ k64.transpose(-1, -2)
    s = s.masked_fill(~torch.ones(Q, K, dtype=torch.bool, device=q.device).tril(K - Q), float("-inf"))
    return s.softmax(-1) @ v64


def timed(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["8,8192,16384", "8,8192,32768", "16,8192,32768", "1,8192,8192"],
                    help="B,Q,K (the chunk's queries, the keys so far)")
    ap.add_argument("--out", type=Path, default=Path("prefill_chunk.json"))
    args = ap.parse_args()
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "checks": [], "timings": []}
    for B, Hq, Hkv, Q, K, D, dt in [(2, 32, 8, 301, 1000, 128, torch.bfloat16), (1, 8, 8, 77, 130, 64, torch.float16),
                                    (3, 16, 2, 5, 517, 128, torch.bfloat16), (2, 32, 8, 1000, 1000, 128, torch.bfloat16)]:
        q, k, v = (torch.randn(B, h, n, D, device=dev, dtype=dt, generator=gen) for h, n in ((Hq, Q), (Hkv, K), (Hkv, K)))
        ref = reference64(q, k, v, D**-0.5)
        errs = {name: float((fn().double() - ref).abs().max())
                for name, fn in (("lower_right", lambda: exact_attention(q, k, v, None, scaling=D**-0.5, causal=True)),
                                 ("masked", lambda: masked(q, k, v, D**-0.5)))}
        report["checks"].append(dict(B=B, Hq=Hq, Hkv=Hkv, Q=Q, K=K, D=D, dtype=str(dt), max_abs_err=errs))
        print("check", report["checks"][-1], flush=True)
    for shape in args.shapes:
        B, Q, K = (int(x) for x in shape.split(","))
        q = torch.randn(B, 32, Q, 128, device=dev, dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(B, 8, K, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        row = dict(B=B, Q=Q, K=K, lower_right_ms=timed(lambda: exact_attention(q, k, v, None, scaling=128**-0.5, causal=True)))
        try:
            row["masked_ms"] = timed(lambda: masked(q, k, v, 128**-0.5))
        except torch.OutOfMemoryError:
            row["masked_ms"] = None
        report["timings"].append(row)
        print("time", row, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\n{'B':>3} {'Q':>6} {'K':>6} | masked ms | lower-right ms | ratio")
    for r in report["timings"]:
        m = r["masked_ms"]
        print(f"{r['B']:>3} {r['Q']:>6} {r['K']:>6} | {m if m is None else round(m, 2)!s:>9} | {r['lower_right_ms']:14.2f} | "
              f"{'' if m is None else round(m / r['lower_right_ms'], 2)}")


if __name__ == "__main__":
    main()
