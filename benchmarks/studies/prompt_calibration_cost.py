"""What Sift's prompt calibration adds to a prefill: ``Sift.observe_prompt`` alone, on one layer's queries, keys and
validity masks as the attention glue gives them (random, the 8B shape by default), prompt in chunks.

    PYTHONPATH=. python3 benchmarks/studies/prompt_calibration_cost.py [--batch 8 --prompt 32768 --chunk 8192] [--profile]
    PYTHONPATH=. python3 benchmarks/studies/prompt_calibration_cost.py --device cpu --dtype float32 --batch 2 \\
        --heads 8,2 --prompt 4096 --chunk 1024 --out prompt_calibration_cpu.json

Times three things, median of ``--repeats``:

- ``structural``: each chunk with its rows' key ranges (``PromptChunk.ranges``), as the glue gives them to every
  layer: steps and the sampled rows' ranges in O(B * Q);
- ``mask_rows``: the same chunks without ranges, so steps are the mask's row sums, O(B * Q * K) a layer (the glue's
  fallback for a mask of unknown structure, and what every layer did before the ranges);
- ``mask_check``: the glue's work once per mask and forward, shared by all the layers that get the mask: the ranges
  read off the structure (``prompt_row_ranges``) and checked against the mask (``rows_are_ranges``);
- ``steps_structural`` and ``steps_mask_rows``: the chunks' ``PromptChunk.steps`` alone, with and without ranges (the
  part of a layer's calibration the ranges change; the rest is the kernels').

Compare a layer's time with the dense prefill of the same shape (``bench_generate.py``'s prefill seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Callable

import torch

from siftattention import Sift
from siftattention.attention import prompt_row_ranges, rows_are_ranges
from siftattention.methods.base import PromptChunk


def _median_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=lambda s: tuple(map(int, s.split(","))), default=(32, 8), help="query,kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="float32 on the CPU: its decode kernel measures the sampled rows, as CUDA's does")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the times as JSON")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's table of one structural call")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    machine = torch.cuda.get_device_name(device) if cuda else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(machine)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    B, (Hq, Hkv), D, P, C = args.batch, args.heads, args.head_dim, args.prompt, args.chunk
    dtype = getattr(torch, args.dtype)
    q = torch.randn(B, Hq, P, D, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, P, D, device=device, dtype=dtype)
    prompt = torch.full((B,), P, device=device)
    starts = list(range(0, P, C))
    # Materialised, as the attention glue's valid_keys gives them.
    masks = [(torch.arange(min(a + C, P), device=device)[None, :] <= torch.arange(a, min(a + C, P), device=device)[:, None])
             [None, None].repeat(B, 1, 1, 1) for a in starts]
    ranges = [prompt_row_ranges(valid) for valid in masks]
    method = Sift(tau=0.875)

    def calibrate(with_ranges: bool) -> Callable[[], None]:
        def once() -> None:
            state = method.new_state(B, Hq, q.device)
            for a, valid, rows in zip(starts, masks, ranges):
                b = min(a + C, P)
                method.observe_prompt(PromptChunk(q[:, :, a:b], k[:, :, :b], valid, prompt, D**-0.5, final=b == P,
                                                  ranges=rows if with_ranges else None), state)
                method.finish_prefill(state)
        return once

    def check() -> None:
        for valid in masks:
            assert rows_are_ranges(valid, prompt_row_ranges(valid))

    def steps(with_ranges: bool) -> Callable[[], None]:
        def once() -> None:
            for a, valid, rows in zip(starts, masks, ranges):
                PromptChunk(q[:, :, a:a + C], k, valid, prompt, D**-0.5, ranges=rows if with_ranges else None).steps
        return once

    times = {"structural": _median_seconds(calibrate(True), args.repeats, sync),
             "mask_rows": _median_seconds(calibrate(False), args.repeats, sync),
             "mask_check": _median_seconds(check, args.repeats, sync),
             "steps_structural": _median_seconds(steps(True), args.repeats, sync),
             "steps_mask_rows": _median_seconds(steps(False), args.repeats, sync)}
    shape = f"B={B} heads {Hq}/{Hkv} D={D} {args.dtype} prompt {P} in chunks of {C}"
    print(f"observe_prompt, one layer, {shape}:")
    for name, what in [("structural", "with the rows' ranges (a layer)"), ("mask_rows", "summing the masks' rows (a layer)"),
                       ("mask_check", "the glue's mask check (a forward, all layers)"),
                       ("steps_structural", "its steps alone, from the ranges"), ("steps_mask_rows", "its steps alone, summing the masks' rows")]:
        total = times[name] * (1 if name == "mask_check" else args.layers)
        print(f"  {what}: median {times[name] * 1e3:.2f} ms; x{args.layers} layers = {total:.3f} s")
    per_layer = times["structural"] + times["mask_check"] / args.layers
    print(f"  a layer with the ranges and its share of the check: {per_layer * 1e3:.2f} ms "
          f"(was {times['mask_rows'] * 1e3:.2f} ms: {times['mask_rows'] / per_layer:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "cpus": os.cpu_count(), "torch": torch.__version__, "shape": shape,
                       "layers": args.layers, "repeats": args.repeats, "seconds": times,
                       "per_layer_with_check_s": per_layer}, f, indent=1)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            calibrate(True)()
            sync()
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
