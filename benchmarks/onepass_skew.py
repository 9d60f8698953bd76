"""The one-pass anchored kernel with each tile's V rows folded in one iteration late
(``OnePassConfig(skew=True)``) against the shipped loop, beside the two-pass anchored step and
SDPA (ratios to SDPA, CUDA graphs, fp16, D = 128, the gap handed in exactly; kept keys checked
against the float64 thresholds). Run from benchmarks/ on a GPU:

    PYTHONPATH=..:. python3 onepass_skew.py OUT.json
"""
import json, sys, time
import torch
import bench_decode as bd
from siftattention.kernels.triton_onepass import OnePassConfig, OnePassPlan
from siftattention.kernels.plan import PowerLawThreshold

out_path = sys.argv[1]
shapes = [(8, 32, 8, 32768), (16, 32, 8, 32768), (8, 32, 8, 16384), (4, 32, 8, 32768), (1, 32, 8, 32768),
          (1, 32, 8, 131072), (8, 32, 32, 8192), (8, 32, 32, 32768)]
import os
if os.environ.get('SHAPES'): shapes = json.loads(os.environ['SHAPES'])
variants = {"base": OnePassConfig(), "vskew": OnePassConfig(skew=True), "vskew_nocap": OnePassConfig(skew=True, maxnreg=0), "vskew_s2": OnePassConfig(skew=True, stages=2), "vskew_n32": OnePassConfig(skew=True, block_n=32)}
gen = torch.Generator(device=bd.DEV).manual_seed(3)
rows = []
for (B, Hq, Hkv, S) in shapes:
    t0 = time.time()
    sets = [bd.make_inputs(B, Hq, Hkv, S, 128, torch.float16, 3.0, 0.0, gen) for _ in range(2)]
    sl = bd.full_lens(B, S)
    t_sdpa = bd.bench_graph(bd.sdpa_decode, sets)
    kern = bd.planned(sets[0][0], sets[0][1])
    for sp in (0.875, 0.0):
        if sp == 0.0 and B not in (8,):
            continue
        ths = [bd.thresholds(q, k, [sp])[0] for (q, k, v) in sets]
        zeros = torch.zeros(B, device=bd.DEV)
        a_sets = [s + (PowerLawThreshold(torch.log(t[0]), torch.zeros_like(t[0]), zeros), bd.oracle_gaps(s[0], s[1], 64, 256))
                  for s, t in zip(sets, ths)]
        row = dict(B=B, Hq=Hq, Hkv=Hkv, S=S, sparsity=sp, sdpa_ms=t_sdpa, union=sum(t[2] for t in ths) / 2)
        two = lambda q, k, v, t, g: kern.sparse_anchored(q, k, v, t, g, sl, None, 64, 256, False)
        row["two_pass"] = bd.bench_graph(two, a_sets) / t_sdpa
        for name, cfg in variants.items():
            plan = OnePassPlan(B, Hq, Hkv, S, 128, torch.float16, bd.DEV, 64, 256, cfg)
            fn = lambda q, k, v, t, g, plan=plan: plan(q, k, v, t, g, 128 ** -0.5, sl, None, False)
            for si, a in enumerate(a_sets):
                g0 = a[4].clone()
                o, kept = fn(*a[:4], g0)
                assert torch.equal(kept, ths[si][1]), (name, B, Hq, Hkv, S, sp)
                if si == 0:
                    err = max(bd.rel_err(o[b], bd.ref_out64(*a[:3], ths[0][0], b)) for b in range(B))
                    assert err < 1e-2, (name, err)
            row[name] = bd.bench_graph(fn, a_sets) / t_sdpa
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), f"{time.time()-t0:.0f}s", flush=True)
    del sets, a_sets
    torch.cuda.empty_cache()
json.dump(rows, open(out_path, "w"), indent=1)
names = ["two_pass"] + list(variants)
print("\n| B | Hq/Hkv | S | s | " + " | ".join(names) + " |")
for r in rows:
    print(f"| {r['B']} | {r['Hq']}/{r['Hkv']} | {r['S']} | {r['sparsity']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " |")
