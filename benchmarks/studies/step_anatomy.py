"""Where a decode step's time goes beside attention: dense against Sift on a planted Qwen2.5-1.5B-shaped model.

For each method the loop's own CUDA graphs are replayed for ``--steps`` decode steps under torch's CUDA profiler
(kernel device time, summed per step: attention kernels, the rest, and the wall time per step), and the attention
of one step alone is replayed from a graph of its own (``bench_generate.attention_share``). If the attention
kernels take longer inside the step than alone, or the step's wall time exceeds its kernels' sum, the difference
is what the step loses between kernels (tails, bubbles), not bytes.

    PYTHONPATH=/tmp/sift-site:. python3 benchmarks/studies/step_anatomy.py --model qwen2.5-1.5b --data-file /root/wiki.utf8 \
        --warm 100 --out $OUT/step_anatomy_qwen_h100.json [--trace 256]
    PYTHONPATH=. python3 benchmarks/studies/step_anatomy.py --batch 16 --prompt 32768   # the planted model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_generate import attention_share, fast, free, planted_qwen_model, prefilled_loop  # noqa: E402

from siftattention import Full, Sift, apply  # noqa: E402

ATTENTION = ("_scores_kernel", "_filter_kernel", "_dense_kernel", "_quantile_kernel", "_warmup")


def profiled_steps(model, ids: torch.Tensor, method, warm: int, steps: int, compile: bool = False) -> dict:
    """Kernel device time per step of ``steps`` graph replays after ``warm`` steps, and the wall time per step."""
    from torch.profiler import ProfilerActivity, profile

    handle = apply(model, method)
    loop = None
    try:
        loop = prefilled_loop(model, handle, ids, warm + steps + 2, True, 4096, compile)  # a step writes one position ahead
        with torch.inference_mode():
            for step in range(warm):
                loop.decode(step)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for step in range(warm, warm + steps // 2):  # unprofiled: the wall time CUPTI does not perturb
                loop.decode(step)
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / (steps // 2)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for step in range(warm + steps // 2, warm + steps):
                    loop.decode(step)
                torch.cuda.synchronize()
    finally:
        if loop is not None:
            loop.detach()
        handle.remove()
    n = steps - steps // 2
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time_total / 1e3 / n
    attention = sum(v for k, v in per_kernel.items() if any(a in k for a in ATTENTION))
    total = sum(per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    free()
    return {"wall_ms": wall_ms, "kernels_ms": total, "attention_kernels_ms": attention, "rest_kernels_ms": total - attention,
            "top": [(k[:90], round(v, 4)) for k, v in top]}


def step_trace(model, ids: torch.Tensor, method, new: int, compile: bool = False) -> list[tuple[int, str, float]]:
    """(step, phase, ms) of every decode step of one ``new``-token call of the loop (graphs, a CUDA event pair a step),
    and beside it nothing else: how a step's time moves along a whole call."""
    handle = apply(model, method)
    marks = []
    loop = None
    try:
        loop = prefilled_loop(model, handle, ids, new, ids.is_cuda, 4096, compile)
        with torch.inference_mode():
            for step in range(new - 1):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                phase = handle.method.decode_phase(step)
                a.record()
                loop.decode(step)
                b.record()
                marks.append((step, str(phase), a, b))
            torch.cuda.synchronize()
    finally:
        if loop is not None:
            loop.detach()
        handle.remove()
    free()
    return [(step, phase, a.elapsed_time(b)) for step, phase, a, b in marks]


def _windows(trace: list[tuple[int, str, float]], width: int) -> list[str]:
    out = []
    for lo in range(0, len(trace), width):
        part = sorted(ms for step, phase, ms in trace[lo:lo + width] if phase in ("sparse", "exact"))
        if part:
            out.append(f"{lo}-{min(lo + width, len(trace)) - 1}: {part[len(part) // 2]:.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--tau", type=float, default=0.875)
    ap.add_argument("--warm", type=int, default=24, help="decode steps before the measured ones (warmup, captures)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--model", default=None, help="an embedded model on real text instead of the planted one")
    ap.add_argument("--data-file", action="append", default=[], help="text after WikiText-2 (with --model)")
    ap.add_argument("--trace", type=int, default=0, metavar="NEW",
                    help="also every step's time along one NEW-token call of the loop, and generate's own steady step")
    ap.add_argument("--compile", action="store_true", help="the decode step's model code through torch.compile")
    ap.add_argument("--out", type=Path, default=Path("step_anatomy.json"))
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    if args.model:
        from bench_generate_real import prompt_tokens, windows

        from siftattention.models import load_model

        model, tokenizer = load_model(args.model, dtype=torch.bfloat16, device="cuda")
        ids = windows(prompt_tokens(tokenizer, args.data_file), args.batch, args.prompt).cuda()
    else:
        model = planted_qwen_model()
        ids = torch.randint(3, 32000, (args.batch, args.prompt), device="cuda")
    report: dict = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)}}
    for name, method in (("dense", Full()), ("sift", Sift(tau=args.tau)), ("dense_again", Full())):
        report[name] = profiled_steps(model, ids, method, args.warm, args.steps, args.compile)
        print(name, json.dumps({k: v for k, v in report[name].items() if k != "top"}), flush=True)
    report["attention_alone"] = attention_share(model, ids, args.tau, 16)
    print("attention alone", json.dumps(report["attention_alone"]), flush=True)
    if args.trace:
        for name, make in (("dense", Full), ("sift", lambda: Sift(tau=args.tau))):
            trace = step_trace(model, ids, make(), args.trace, args.compile)
            report.setdefault("trace", {})[name] = trace
            # generate's own phases, a second identical call (the first compiles and captures)
            report.setdefault("generate_phases", {})[name] = fast(model, ids, make(), args.trace, 4096, args.compile)["phases"]
            print(f"{name}: median step ms by 32 steps: {'; '.join(_windows(trace, 32))}", flush=True)
            print(f"{name}: generate's phases: {json.dumps(report['generate_phases'][name])}", flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    a = report["attention_alone"]
    print("\n| method | step wall ms | kernels ms | attention kernels ms | rest kernels ms | attention alone ms |")
    print("|---|---|---|---|---|---|")
    for name, alone in (("dense", a["dense_ms"]), ("sift", a["sift_decode_step_ms"]), ("dense_again", a["dense_ms"])):
        r = report[name]
        print(f"| {name} | {r['wall_ms']:.3f} | {r['kernels_ms']:.3f} | {r['attention_kernels_ms']:.3f} | "
              f"{r['rest_kernels_ms']:.3f} | {alone:.3f} |")
    v = a["v_rows_read"]
    print(f"\nSift keeps {v['kept_per_head']:.3f} of a head's keys; some head of a group keeps {v['v_rows_per_kv_head']:.3f} "
          "of the V rows (one step after the warmup, all layers)")
    for name in ("dense", "sift"):
        print(f"\n{name} top kernels (ms a step):")
        for k, v in report[name]["top"]:
            print(f"  {v:8.4f}  {k}")


if __name__ == "__main__":
    main()
