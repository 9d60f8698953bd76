"""What Sift's prompt calibration adds to a prefill: ``Sift.observe_prompt`` alone, on one layer's queries, keys and
validity masks as the attention glue gives them (random bf16, the 8B shape by default), prompt in chunks.

    PYTHONPATH=. python3 benchmarks/studies/prompt_calibration_cost.py [--batch 8 --prompt 32768 --chunk 8192] [--profile]

Prints the median time a layer and for ``--layers`` layers; compare it with the dense prefill of the same shape
(``bench_generate.py``'s prefill seconds).
"""

from __future__ import annotations

import argparse
import time

import torch

from siftattention import Sift
from siftattention.methods.base import PromptChunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=lambda s: tuple(map(int, s.split(","))), default=(32, 8), help="query,kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's table of one call")
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    B, (Hq, Hkv), D, P, C = args.batch, args.heads, args.head_dim, args.prompt, args.chunk
    q = torch.randn(B, Hq, P, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, P, D, device="cuda", dtype=torch.bfloat16)
    prompt = torch.full((B,), P, device="cuda")
    starts = list(range(0, P, C))
    # Materialised, as the attention glue's valid_keys gives them.
    masks = [(torch.arange(min(a + C, P), device="cuda")[None, :] <= torch.arange(a, min(a + C, P), device="cuda")[:, None])
             [None, None].repeat(B, 1, 1, 1) for a in starts]
    method = Sift(tau=0.875)

    def once() -> None:
        state = method.new_state(B, Hq, q.device)
        for a, valid in zip(starts, masks):
            b = min(a + C, P)
            method.observe_prompt(PromptChunk(q[:, :, a:b], k[:, :, :b], valid, prompt, D**-0.5, final=b == P), state)
            method.finish_prefill(state)

    once()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        once()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    median = sorted(times)[2]
    print(f"observe_prompt, one layer, B={B} heads {Hq}/{Hkv} D={D} prompt {P} in chunks of {C}: median {median * 1e3:.1f} ms; "
          f"x{args.layers} layers = {median * args.layers:.3f} s")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
