"""Sift(gqa="shared") through the Triton kernels on a GPU against float64 (tests/test_gqa_shared.py runs the
same checks under the interpreter); the planned decode shapes of the real models included."""

from __future__ import annotations

import pytest
import torch

from test_gqa_shared import (CASES, TAU, group_thresholds, make_inputs, reference, reference_quantile, rel,
                             value_sums)
from siftattention.kernels import DecodeKernels
from siftattention.kernels.plan import PowerLawThreshold

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# CASES, then Qwen2.5-1.5B's (GQA 6, head_dim 128) and SmolLM2's (GQA 3, head_dim 64) heads at lengths
# that span many splits and no block multiple.
GPU_CASES = CASES + [(2, 12, 2, 5003, 128), (3, 9, 3, 2049, 64)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_cuda_shared_step_matches_float64(case, dtype):
    pytest.importorskip("triton")
    B, Hq, Hkv, S, D = GPU_CASES[case]
    q, k, v, sl, st = make_inputs(B, Hq, Hkv, S, D, dtype, 300 + case)
    scale = D**-0.5
    eta = group_thresholds(q, k, scale, sl, st, case)
    vs = value_sums(v, sl, st)
    ref, ref_kept = reference(q, k, v, eta, scale, sl, st)
    ref_vmc, _ = reference(q, k, v, eta, scale, sl, st, vs)
    ref_theta = reference_quantile(q, k, scale, sl, st, TAU)
    dev = [t.cuda() for t in (q, k, v, sl, st, eta, vs)]
    q, k, v, sl, st, eta, vs = dev
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=q.dtype, device="cuda",
                              scale=scale, backend="triton")
    out, kept = kern.sparse(q, k, v, eta, sl, st, shared=True)
    law = PowerLawThreshold(eta.clamp(min=0).log(), torch.zeros(B, Hq, device="cuda"), torch.zeros(B, device="cuda"))
    out_law, kept_law = kern.sparse(q, k, v, law, sl, st, shared=True)
    out_vmc, kept_vmc, theta = kern.sparse_quantile(q, k, v, eta, TAU, sl, st, vs, shared=True)
    _, theta_warm = kern.warmup(q, k, v, TAU, sl, st, shared=True)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for x in (kept, kept_law, kept_vmc):
        assert torch.equal(x.cpu(), ref_kept)
    assert rel(out.cpu(), ref) < tol and rel(out_law.cpu(), ref) < tol and rel(out_vmc.cpu(), ref_vmc) < tol
    assert rel(theta.cpu(), ref_theta) < tol and rel(theta_warm.cpu(), ref_theta) < tol
    assert (kern.workspace.sync == 0).all()
