"""Compile every Triton decode kernel variant for sm_90 (Hopper) on a machine with no GPU.

Run as a script by ``tests/test_kernels.py`` in a subprocess without TRITON_INTERPRET. The
interpreter accepts code that Triton's GPU code generator rejects (a variable rebound with
another shape in a constexpr branch, for one), so the CPU tests alone cannot vouch for the
kernels the GPU runs. Here Triton's driver is replaced by one that reports an sm_90 target
and launches nothing: each planned step of ``DecodeKernels`` runs on CPU tensors with the
H200's launch plan, and every kernel it would launch is compiled through ptxas instead. Each
case's steps then run again inside ``DecodeKernels.compiling`` (compile ahead, no launch), which
must ask for the same variants. The last stdout line is JSON: the variants compiled, the
failures and the compile-ahead gaps.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import replace

import torch

#: Largest shared memory one block may use on Hopper (227 KB).
SM90_MAX_SHARED = 232448

#: (batch, q heads, kv heads, max_len, head_dim, dtype, renormalize, starts, eta as tensor, config changes).
#: Together they reach every constexpr branch the launch plan takes on an H200: GQA ratios 1 / 2 / 4 / 6 / 8
#: (the packed scan; ``gqa="shared"`` takes the scan of [heads, keys] tiles),
#: D 64 / 128 / 256, the three dtypes, short and long caches (8- and 12-bit quantile digits), one
#: row (chunked quantile, small-B splits), and the unfused combine.
CASES = [
    (8, 32, 8, 32768, 128, torch.float16, False, True, False, {}),
    (8, 32, 32, 8192, 128, torch.bfloat16, True, False, True, {}),
    (1, 32, 8, 131072, 128, torch.float16, False, True, False, {}),
    (2, 16, 8, 1000, 64, torch.float32, True, True, True, {}),
    (2, 8, 2, 3000, 256, torch.float32, False, True, False, {}),
    (3, 16, 2, 777, 64, torch.bfloat16, False, False, False, {"fused_combine": False, "pdl": False}),
    (2, 12, 2, 2000, 128, torch.bfloat16, False, False, False, {}),
]


class CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: an sm_90 target, device 0, no launches."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def install(compiled: dict) -> None:
    """Route every kernel launch to a compile for sm_90 recorded in ``compiled`` (by cache key)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    only = CompileOnlyDriver()
    driver.set_active(only)

    def compile_only(self, key, signature, device, constexprs, options, attrs, warmup):
        name = self.fn.__name__
        entry = (name, str(key))
        _CALLS.append((name, entry[1], bool(warmup)))
        if entry not in compiled:
            t0 = time.perf_counter()
            kernel = self.compile(self.ASTSource(self, signature, constexprs, attrs), target=only.target,
                                  options=options.__dict__)
            compiled[entry] = dict(kernel=name, key=entry[1], shared=int(kernel.metadata.shared),
                                   warps=int(kernel.metadata.num_warps), seconds=round(time.perf_counter() - t0, 2))
        return None  # JITFunction.run returns before launching

    JITFunction._do_compile = compile_only


def run_case(case: tuple) -> dict:
    """Launch (here: compile) every step of the case's plan; then check that compiling the same
    steps ahead (``DecodeKernels.compiling``) asks for exactly the variants the launches do.
    Returns the variants launched but not compiled ahead, those compiled ahead but never
    launched, and the launches made while compiling ahead (each list should be empty)."""
    from siftattention.kernels import triton_config
    from siftattention.kernels.plan import DecodeKernels

    B, Hq, Hkv, S, D, dtype, renorm, with_starts, eta_tensor, changes = case
    cpu = torch.device("cpu")
    cfg = replace(triton_config._DEFAULT, **changes)
    kern = DecodeKernels("triton", B, Hq, Hkv, S, D, dtype, cpu, D**-0.5, renorm, cfg)
    _CALLS.clear()
    run_steps(kern, case)
    launched = {(name, key) for name, key, ahead in _CALLS if not ahead}
    _CALLS.clear()
    with kern.compiling():
        run_steps(kern, case)
    ahead = {(name, key) for name, key, ahead in _CALLS if ahead}
    return dict(not_ahead=sorted(launched - ahead), never_launched=sorted(ahead - launched),
                launched_while_compiling=[c for c in _CALLS if not c[2]])


def run_steps(kern, case: tuple) -> None:
    """Every run method of the plan once, on empty tensors of the case's shapes."""
    from siftattention.kernels.keybound import MAX_HEAD_DIM, Int8Keys
    from siftattention.kernels.plan import PowerLawThreshold

    B, Hq, Hkv, S, D, dtype, renorm, with_starts, eta_tensor, changes = case
    cfg = kern.config
    q = torch.empty(B, Hq, D, dtype=dtype)
    k, v = torch.empty(B, Hkv, S, D, dtype=dtype), torch.empty(B, Hkv, S, D, dtype=dtype)
    seq_lens = torch.full((B,), S, dtype=torch.int32)
    starts = torch.zeros(B, dtype=torch.int32) if with_starts else None
    power_law = PowerLawThreshold(torch.zeros(B, Hq), torch.ones(B, Hq), torch.full((B,), float(S)).log())
    gap = torch.zeros(B, Hq)
    kern.dense(q, k, v, seq_lens, starts)
    kern.warmup(q, k, v, 0.875, seq_lens, starts)
    kern.sparse(q, k, v, torch.full((B, Hq), 1e-3) if eta_tensor else power_law, seq_lens, starts)
    if D <= MAX_HEAD_DIM:
        keys = Int8Keys(torch.empty(B, Hkv, S, D, dtype=torch.int8), torch.empty(B, Hkv, S))
        kern.sparse_keybound(q, k, v, keys, torch.full((B, Hq), 1e-3) if eta_tensor else power_law, seq_lens, starts)
        keys = Int8Keys(*keys[:2], torch.ones(B, Hkv, D), torch.zeros(B, Hkv, D))  # per-channel scales and offsets
        kern.sparse_keybound(q, k, v, keys, torch.full((B, Hq), 1e-3) if eta_tensor else power_law, seq_lens, starts)
    value_sum = None if renorm else torch.zeros(B, Hkv, D)  # value-mean compensation in the combine
    if value_sum is not None:
        kern.sparse(q, k, v, power_law, seq_lens, starts, value_sum)
    if Hq != Hkv:  # Sift(gqa="shared"): one kept set per KV group in the filter pass
        kern.sparse(q, k, v, power_law, seq_lens, starts, value_sum, shared=True)
    if cfg.fused_combine:  # the anchored steps need the fused combine (the gap is written there)
        kern.warmup_gap(q, k, seq_lens, starts, 64, 256)
        kern.sparse_anchored(q, k, v, power_law, gap, seq_lens, starts, 64, 256, onepass=False, value_sum=value_sum)
        kern.sparse_anchored(q, k, v, power_law, gap, seq_lens, starts, 64, 256, onepass=True)


def kernel_names() -> list[str]:
    """Every ``*_kernel`` JIT function of the Triton modules."""
    from triton.runtime.jit import JITFunction

    from siftattention.kernels import (triton_dense, triton_filter, triton_keybound, triton_onepass, triton_quantile,
                                       triton_scores, triton_warmup)

    modules = (triton_scores, triton_filter, triton_dense, triton_warmup, triton_onepass, triton_quantile,
               triton_keybound)
    return sorted({name for mod in modules for name, obj in vars(mod).items()
                   if isinstance(obj, JITFunction) and name.endswith("_kernel")})


_COMPILED: dict = {}  # one worker's variants, by (kernel, cache key)
_CALLS: list = []  # (kernel, cache key, compiled ahead) of every compile the worker was asked for


def _worker_init() -> None:
    install(_COMPILED)
    from siftattention.kernels import triton_config

    # The H200's launch plan: 132 SMs, Hopper features (programmatic dependent launch).
    triton_config._device_info = lambda device: (132, True, "NVIDIA H200")


def compile_case(case: tuple) -> tuple[list[dict], list[dict], dict]:
    """(variants compiled, failures, compile-ahead gaps) of one case, in a worker process set up
    by ``_worker_init``."""
    _COMPILED.clear()
    try:
        gaps = run_case(case)
        return list(_COMPILED.values()), [], {repr(case): gaps} if any(gaps.values()) else {}
    except Exception:
        return list(_COMPILED.values()), [dict(case=repr(case), error=traceback.format_exc(limit=3)[-2000:])], {}


def main() -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    compiled, failures = {}, []
    # Compiling is single-threaded: one worker per core (two in CI) halves the wall time.
    workers = max(1, min(len(CASES), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init) as pool:
        gaps = {}
        for done, failed, gap in pool.map(compile_case, CASES):
            compiled.update({(c["kernel"], c.pop("key")): c for c in done})  # cases share some variants
            failures += failed
            gaps.update(gap)
    print(json.dumps(dict(compiled=list(compiled.values()), kernels=kernel_names(), failures=failures,
                          max_shared=SM90_MAX_SHARED, compile_ahead_gaps=gaps)))


if __name__ == "__main__":
    sys.exit(main())
