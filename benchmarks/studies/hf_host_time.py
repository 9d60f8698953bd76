"""Host time of a decode step through transformers' generate under apply() on CUDA, and of the kernel launches in it.

    PYTHONPATH=. python3 benchmarks/studies/hf_host_time.py --out hf_host_time.json

On a small model a step of transformers' generate is bound by the host (Python and kernel
launches), not by the GPU. This measures, on SmolLM2-135M's shape with random weights
(float32, a 185-token prompt, 96 new tokens, greedy):

- the median step of ``model.generate`` with no method applied, and under ``apply`` with
  Full, Sift (tau 0.875, warmup 16; warmup and post-warmup steps apart) and Top-k (0.125),
  the second of three calls;
- the host cost of one eager decode-kernel call of one layer's shape (B = 1, 9 / 3 heads of
  64, 300 keys): ``DecodeKernels.sparse`` (two Triton kernels), ``dense`` (one), and the two
  sparse kernels launched through Triton's ``kernel[grid](...)`` against its compiled
  launcher called directly with the bound arguments (what binding the launch once at plan
  time could save). Microseconds per call over 400 calls, a device sync at both ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
from hf_generate_compiles import StepClock, smollm2_shaped  # this script's directory is on sys.path
from transformers import LogitsProcessorList


def per_call_us(fn, n: int = 400) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round(1e6 * (time.perf_counter() - start) / n, 1)


def generate_steps(model, ids) -> dict:
    from siftattention import Full, Sift, TopK, apply

    out = {}
    for name, make in (("none", None), ("full", Full), ("sift", lambda: Sift(tau=0.875, warmup=16)),
                       ("topk", lambda: TopK(k=0.125))):
        calls = []
        for _ in range(3):
            clock = StepClock()
            handle = apply(model, make()) if make else None
            try:
                with torch.no_grad():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, min_new_tokens=96,
                                   do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
            finally:
                if handle is not None:
                    handle.remove()
            calls.append([1e3 * (b - a) for a, b in zip(clock.times, clock.times[1:])])
        steps = calls[1]
        out[name] = dict(median_ms=statistics.median(steps), warmup_steps_ms=statistics.median(steps[1:15]),
                         late_steps_ms=statistics.median(steps[20:]))
        print(name, {k: round(v, 2) for k, v in out[name].items()}, flush=True)
    return out


def launch_costs() -> dict:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction, compute_cache_key

    from siftattention.kernels import DecodeKernels
    from siftattention.kernels import triton_decode as td
    from siftattention.kernels.plan import PowerLawThreshold

    kern = DecodeKernels.plan(batch=1, q_heads=9, kv_heads=3, max_len=512, head_dim=64, dtype=torch.float32,
                              device="cuda", scale=0.125)
    q = torch.randn(1, 9, 64, device="cuda")
    k, v = torch.randn(1, 3, 300, 64, device="cuda"), torch.randn(1, 3, 300, 64, device="cuda")
    seq_lens = torch.tensor([300], device="cuda", dtype=torch.int32)
    law = PowerLawThreshold(torch.full((1, 9), -3.0, device="cuda"), torch.full((1, 9), 0.5, device="cuda"),
                            torch.full((1,), 5.7, device="cuda"))
    out = dict(sparse_us=per_call_us(lambda: kern.sparse(q, k, v, law, seq_lens)),
               dense_us=per_call_us(lambda: kern.dense(q, k, v, seq_lens)))
    # The two sparse kernels' arguments, as DecodeKernels.sparse passes them.
    captured = {}
    real = JITFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        captured[self.fn.__name__] = (self, args, grid, kwargs)
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = spy
    kern.sparse(q, k, v, law, seq_lens)
    JITFunction.run = real
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    bound = {}
    for name in ("_scores_kernel", "_filter_kernel"):
        fn, args, grid, kwargs = captured[name]
        options = dict(kwargs, debug=False, instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
        kernel_cache, key_cache, _, _, binder = fn.device_caches[device]
        values, specialization, opts = binder(*args, **options)
        compiled = kernel_cache[compute_cache_key(key_cache, specialization, opts)]
        vals = list(values.values())
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        bound[name] = (fn, args, grid, kwargs, compiled, vals, grid3, compiled.launch_metadata(grid, stream, *vals))

    def through_jit():
        for fn, args, grid, kwargs, *_ in bound.values():
            fn[grid](*args, **kwargs)

    def direct():
        for *_, compiled, vals, g, meta in bound.values():
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta,
                         triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook, *vals)

    out["sparse_kernels_through_jit_us"] = per_call_us(through_jit)
    out["sparse_kernels_direct_us"] = per_call_us(direct)
    print(out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, ids = smollm2_shaped()
    import transformers

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               transformers=transformers.__version__, date=time.strftime("%Y-%m-%d"),
               layers=model.config.num_hidden_layers,
               generate=generate_steps(model, ids), launches=launch_costs())
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
