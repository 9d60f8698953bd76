"""Where a decode step of the evaluation's generation goes on the GPU (the embedded models, float32).

    PYTHONPATH=. python3 benchmarks/studies/profile_eval_step.py --model gemma3-270m --out $OUT/profile.json

``sift eval`` decodes batches of up to 50 long prompts in float32 (the de-quantised GGUF
weights) through ``siftattention.generate``. This times that loop per method at the
evaluation's shape (a random prompt of ``--prompt`` tokens, ``--batch`` rows, ``--new``
tokens), optionally with ``compile=True``, and lists the CUDA kernels of one run under
``torch.profiler`` by total time, so the cost of a cell can be split into attention,
GEMMs and the small ops around them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from siftattention import generate
from siftattention.methods import parse_method
from siftattention.models import load_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_ms_per_step(model, ids, method: str, new: int, compile: bool) -> float:
    """Decode time per token: a run of ``new`` tokens minus a run of one (the prefill)."""
    # Warm with the timed shapes: a new prompt or cache length would recompile inside the timing.
    for n in (1, new):
        generate(model, ids, method=parse_method(method), max_new_tokens=n, compile=compile)
    seconds = []
    for n in (1, new):
        _sync(ids.device)
        t0 = time.perf_counter()
        generate(model, ids, method=parse_method(method), max_new_tokens=n, compile=compile)
        _sync(ids.device)
        seconds.append(time.perf_counter() - t0)
    return 1e3 * (seconds[1] - seconds[0]) / (new - 1)


def kernel_table(model, ids, method: str, new: int, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if ids.is_cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        generate(model, ids, method=parse_method(method), max_new_tokens=new)
        _sync(ids.device)
    rows = []
    for e in prof.key_averages():
        t = (getattr(e, "device_time_total", 0) if ids.is_cuda else e.self_cpu_time_total) or 0
        if t > 0:
            rows.append({"name": e.key[:90], "calls": e.count, "total_ms": t / 1e3})
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--methods", nargs="+", default=["full", "sift:tau=0.875,warmup=16", "topk:k=0.125"])
    ap.add_argument("--compile", nargs="*", default=[], metavar="METHOD", help="also time these methods with compile=True")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    model, _ = load_model(args.model, dtype=torch.float32, device=args.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(100, min(vocab, 30000), (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)).to(args.device)
    result: dict = {"model": args.model, "batch": args.batch, "prompt": args.prompt, "new": args.new,
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "torch": torch.__version__, "methods": {}}
    profiled_steps = min(args.new, 128)
    for method in args.methods:
        entry: dict = {}
        for compile in ([False, True] if method in args.compile else [False]):
            entry["compiled_ms_per_step" if compile else "ms_per_step"] = decode_ms_per_step(model, ids, method, args.new, compile)
        entry["kernels"] = kernel_table(model, ids, method, profiled_steps, args.top)
        result["methods"][method] = entry
        print(f"== {method}: " + ", ".join(f"{k} {v:.2f}" for k, v in entry.items() if k != "kernels"))
        for r in entry["kernels"]:
            print(f"   {r['total_ms'] / profiled_steps:8.3f} ms/step {r['calls']:7d}  {r['name']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
