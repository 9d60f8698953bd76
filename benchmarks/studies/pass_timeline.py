"""When do the sparse step's two passes run, and how long does the filter pass outlast the scores pass?

The exact Sift step is a scores pass (every K row) and a filter pass (threshold, compaction, V gather)
launched with programmatic dependent launch, so the filter programs of finished rows may run while later
rows are scored. This study records each kernel's start and end (torch.profiler, CUPTI) over eager
calls on planted inputs and reports, per configuration: the scores pass's duration, when the filter pass
starts and ends relative to it, and the *tail*, the time the filter pass runs after the scores pass
ends; with ``pdl`` off the filter pass runs alone after it. The dense kernel's duration is the reference.

    PYTHONPATH=. python3 benchmarks/studies/pass_timeline.py --shapes 16,12,2,32768 8,12,2,16384 \\
        --group-corr 0.7 --configs '{}' '{"pdl": false}' --out pass_timeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd  # noqa: E402
from siftattention.kernels import triton_config as tc  # noqa: E402


def kernel_spans(fn, reps: int, warmup: int = 3, kernels_only: bool = True) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every CUDA kernel (``kernels_only=False``: every device activity, copies and
    sets too) of ``reps`` calls of ``fn`` after ``warmup`` calls, in start order."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    spans = [(ev.name, ev.time_range.start, ev.time_range.end) for ev in prof.events()
             if ev.device_type == torch.autograd.DeviceType.CUDA and (not kernels_only or "kernel" in ev.name.lower())]
    return sorted(spans, key=lambda s: s[1])


def step_timeline(spans: list[tuple[str, float, float]]) -> dict:
    """Medians over calls of the two passes' spans, relative to the scores pass's start."""
    scores = [s for s in spans if "scores" in s[0]]
    filters = [s for s in spans if "filter" in s[0]]
    n = min(len(scores), len(filters))
    rows = []
    for (_, s0, s1), (_, f0, f1) in zip(scores[:n], filters[:n]):
        rows.append(dict(scores_us=s1 - s0, filter_start_us=f0 - s0, filter_us=f1 - f0, tail_us=f1 - s1, step_us=f1 - s0))
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["16,12,2,32768", "8,12,2,16384"], help="B,Hq,Hkv,S")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group-corr", type=float, default=0.7)
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--configs", nargs="+", default=["{}", '{"pdl": false}'], help="KernelConfig overrides (JSON)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pass_timeline.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(11)
    base = tc.config_for(torch.device("cuda"))
    out = dict(device=torch.cuda.get_device_name(), argv=sys.argv, results=[])
    for shape in args.shapes:
        B, Hq, Hkv, S = map(int, shape.split(","))
        q, k, v = bd.make_inputs(B, Hq, Hkv, S, args.head_dim, torch.bfloat16, 3.0, args.group_corr, gen)
        (eta, kept_ref, _), = bd.thresholds(q, k, [args.sparsity])
        sl = bd.full_lens(B, S)
        for over in args.configs:
            kw = json.loads(over)
            cfg = tc.KernelConfig(**{**base.__dict__, **kw})
            kern = bd.planned(q, k, cfg)
            _, kept = kern.sparse(q, k, v, eta, sl)
            ok = bool(torch.equal(kept, kept_ref))
            tl_sparse = step_timeline(kernel_spans(lambda: kern.sparse(q, k, v, eta, sl), args.reps))
            dense = [e - s for (n, s, e) in kernel_spans(lambda: kern.dense(q, k, v, sl), args.reps) if "dense" in n]
            geo = kern.geometry
            row = dict(shape=[B, Hq, Hkv, S, args.head_dim], cfg=kw, kept_exact=ok, ns1=geo["ns1"], ns2=geo["ns2"],
                       persistent=geo.get("programs1", 0), dense_us=statistics.median(dense) if dense else None,
                       **tl_sparse)
            out["results"].append(row)
            print(f"B={B} H={Hq}/{Hkv} S={S} {json.dumps(kw):24s} kept_exact={ok} ns1={geo['ns1']} ns2={geo['ns2']} "
                  f"dense {row['dense_us']:.1f} us | scores {row.get('scores_us', 0):.1f}  filter starts "
                  f"+{row.get('filter_start_us', 0):.1f} runs {row.get('filter_us', 0):.1f}  tail {row.get('tail_us', 0):.1f}"
                  f"  step {row.get('step_us', 0):.1f} us", flush=True)
    out["kernel_resources"] = bd.kernel_resources()
    for r in out["kernel_resources"]:
        print("resources", json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
