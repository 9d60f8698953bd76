"""Where the anchored two-pass step's extra time goes at small batch: per-kernel times (torch
profiler, eager) and the whole step in a CUDA graph, beside the exact step with eta given directly
and as a power law (H200). The gap handed in is this step's own, so each call rewrites it unchanged.

    PYTHONPATH=. python3 benchmarks/studies/profile_anchored_two_pass.py OUT.json
"""
import json, os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for bench_decode
import bench_decode as bd
from siftattention.kernels.plan import PowerLawThreshold
from torch.profiler import profile, ProfilerActivity
gen = torch.Generator(device="cuda").manual_seed(3)
res = {}
for (B, Hq, Hkv, S) in [(1, 32, 8, 131072), (1, 32, 8, 32768), (8, 32, 8, 32768)]:
    q, k, v = bd.make_inputs(B, Hq, Hkv, S, 128, torch.float16, 3.0, 0.0, gen)
    sl = bd.full_lens(B, S)
    eta, kept, union = bd.thresholds(q, k, [0.875])[0]
    kern = bd.planned(q, k)
    thr = PowerLawThreshold(torch.log(eta), torch.zeros_like(eta), torch.zeros(B, device="cuda"))
    gap = bd.oracle_gaps(q, k, 64, 256)
    fns = {"exact_eta": lambda: kern.sparse(q, k, v, eta, sl),
           "exact_powerlaw": lambda: kern.sparse(q, k, v, thr, sl),
           "anchored2": lambda: kern.sparse_anchored(q, k, v, thr, gap, sl, None, 64, 256, False)}
    for name, fn in fns.items():
        for _ in range(20): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(50): fn()
            torch.cuda.synchronize()
        ev = {e.key: round(e.device_time_total / e.count, 2) for e in p.key_averages() if e.device_time_total > 0}
        t = bd.bench_graph(lambda *a: fn(), [()])
        res[f"{B}x{S} {name}"] = dict(graph_us=round(t * 1e3, 2), kernels_us=ev)
        print(f"{B}x{S} {name}: graph {t*1e3:.1f} us, kernels {ev}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
