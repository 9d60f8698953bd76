"""Does a method's decode speed depend on its place in the process?

Runs the dense fast path and Sift alternately (dense, Sift, dense, Sift, ... ``--rounds`` times) on a real
model, each a ``DecodeSession``'s second call as ``bench_generate_real.py`` times it, and prints every call's
steady step. On the H100 (Qwen2.5-1.5B 8 x 16384) dense timed first takes 3.68 ms a step and 3.85 ms timed after
Sift, while Sift's step does not depend on its place. The flags take away one suspect each: ``--keep-cache``
leaves torch's allocator cache alone between calls (the benchmarks empty it), ``--reset-compiler`` drops
torch.compile's frames before every call, ``--no-compile`` compiles nothing, ``--no-pdl`` launches Sift's kernels
without programmatic dependent launch. None of them moved it (benchmarks/studies/README.md).

    PYTHONPATH=/tmp/sift-site:. python3 benchmarks/studies/order_probe.py --model qwen2.5-1.5b --setting 8x16384 \
        --data-file /root/wiki.utf8 [--keep-cache | --reset-compiler | --no-compile | --no-pdl] --out $OUT/order.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_generate  # noqa: E402
from bench_generate_real import prompt_tokens, windows  # noqa: E402

from siftattention import Full, Sift  # noqa: E402
from siftattention.kernels.triton_config import DEVICE_CONFIGS  # noqa: E402
from siftattention.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--setting", default="8x16384", help="BATCHxPROMPT")
    ap.add_argument("--data-file", action="append", default=[], help="text after WikiText-2")
    ap.add_argument("--rounds", type=int, default=3, help="dense-then-Sift rounds")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--keep-cache", action="store_true", help="never empty torch's allocator cache between calls")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the step")
    ap.add_argument("--reset-compiler", action="store_true",
                    help="drop torch.compile's frames before every call, so each method compiles alone")
    ap.add_argument("--no-pdl", action="store_true", help="Sift's kernels launched without programmatic dependent launch")
    ap.add_argument("--out", type=Path, default=Path("order_probe.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("order_probe.py needs a CUDA GPU")
    if args.keep_cache:
        bench_generate.free = gc.collect  # fast() frees between its calls through this name
    if args.no_pdl:  # on top of any tuned overrides the device already has
        DEVICE_CONFIGS.update({key: {**over, "pdl": False} for key, over in DEVICE_CONFIGS.items()})
        DEVICE_CONFIGS.setdefault(torch.cuda.get_device_name(), {"pdl": False})
    batch, prompt = (int(x) for x in args.setting.split("x"))
    model, tokenizer = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    ids = windows(prompt_tokens(tokenizer, args.data_file), batch, prompt).cuda()
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)},
              "calls": []}
    print(report["device"], flush=True)
    for r in range(args.rounds):
        for name, method in (("dense", Full()), ("sift", Sift())):
            if args.reset_compiler:
                torch._dynamo.reset()
                model.__dict__.pop("_siftattention_compiled_forward", None)
            out = bench_generate.fast(model, ids, method, args.new, 8192, compile=args.compile, session=True)
            report["calls"].append({"round": r, "method": name, "ended": time.time(), "steady_ms": out["steady_ms"], "decode_ms": out["decode_ms"],
                                    "allocated_gb": torch.cuda.memory_allocated() / 1e9,
                                    "reserved_gb": torch.cuda.memory_reserved() / 1e9})
            print(json.dumps(report["calls"][-1]), flush=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| call | method | steady step ms | decode ms a step |\n|---|---|---|---|")
    for i, c in enumerate(report["calls"]):
        print(f"| {i} | {c['method']} | {c['steady_ms']:.3f} | {c['decode_ms']:.3f} |")


if __name__ == "__main__":
    main()
