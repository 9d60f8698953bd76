"""Runs the sparse step of one GQA shape (32 / 8 heads, D = 128, fp16, s = 0.875) in four forms, for ncu.

Forms: the two passes; the one-launch resident kernel with 32- and 64-feature chunks; the
resident kernel as two launches (statistics, then scores again and the filter). Under ncu:

    ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum,dram__bytes_read.sum,... \\
        -k regex:"_resident_kernel|_scores_kernel|_filter_kernel" python3 benchmarks/profile_resident.py 8192
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_decode as bd  # noqa: E402

from siftattention.kernels import DecodeKernels  # noqa: E402
from siftattention.kernels import triton_decode as td  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(6)
    B, Hq, Hkv, D = 1, 32, 8, 128
    S = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    q, k, v = bd.make_inputs(B, Hq, Hkv, S, D, torch.float16, 3.0, 0.0, gen)
    eta, kept_ref, _ = bd.thresholds(q, k, [0.875])[0]
    sl = bd.full_lens(B, S)
    base = td.config_for(dev)
    forms = (("two_pass", {"resident": False}, False), ("resident_dc32", {"resident": True}, False),
             ("resident_dc64", {"resident": True, "resident_block_d": 64}, False),
             ("resident_dc64_two_launches", {"resident": True, "resident_block_d": 64}, True))
    for name, over, two in forms:
        cfg = td.KernelConfig(**{**base.__dict__, **over})
        kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=q.dtype, device=dev,
                                  scale=D**-0.5, backend="triton", config=cfg)
        if two:
            kern.geometry = dict(kern.geometry, RONE=False)
        for _ in range(4):
            _, kept = kern.sparse(q, k, v, eta, sl)
        torch.cuda.synchronize()
        print(name, "kept equal to float64:", bool(torch.equal(kept, kept_ref)), flush=True)
    for r in bd.kernel_resources():
        print("resources", json.dumps(r))


if __name__ == "__main__":
    main()
