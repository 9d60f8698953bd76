"""Does a method's decode speed depend on its place in the process?

Runs the dense fast path and Sift alternately (dense, Sift, dense, Sift, ... ``--rounds`` times) on a real
model, each a ``DecodeSession``'s second call as ``bench_generate_real.py`` times it, and prints every call's
steady step. On the H100 the dense path timed first decoded 5-9% faster than timed after Sift (Qwen2.5-1.5B
8 x 16384: 3.69 against 3.85 ms a step), while Sift's step did not depend on its place. ``--keep-cache`` leaves
torch's allocator cache alone between calls (the benchmarks empty it, so each call's KV cache is new device
memory): if the effect is where the first cache lands in memory, it moves with this flag.

    PYTHONPATH=/tmp/sift-site:. python3 benchmarks/studies/order_probe.py --model qwen2.5-1.5b --setting 8x16384 \
        --data-file /root/wiki.utf8 [--keep-cache] --out $OUT/order_probe_qwen_h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_generate  # noqa: E402
from bench_generate_real import prompt_tokens, windows  # noqa: E402

from siftattention import Full, Sift  # noqa: E402
from siftattention.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--setting", default="8x16384", help="BATCHxPROMPT")
    ap.add_argument("--data-file", action="append", default=[], help="text after WikiText-2")
    ap.add_argument("--rounds", type=int, default=3, help="dense-then-Sift rounds")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--keep-cache", action="store_true", help="never empty torch's allocator cache between calls")
    ap.add_argument("--out", type=Path, default=Path("order_probe.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("order_probe.py needs a CUDA GPU")
    if args.keep_cache:
        bench_generate.free = gc.collect  # fast() frees between its calls through this name
    batch, prompt = (int(x) for x in args.setting.split("x"))
    model, tokenizer = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    ids = windows(prompt_tokens(tokenizer, args.data_file), batch, prompt).cuda()
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)},
              "calls": []}
    print(report["device"], flush=True)
    for r in range(args.rounds):
        for name, method in (("dense", Full()), ("sift", Sift())):
            out = bench_generate.fast(model, ids, method, args.new, 8192, compile=True, session=True)
            report["calls"].append({"round": r, "method": name, "steady_ms": out["steady_ms"], "decode_ms": out["decode_ms"],
                                    "allocated_gb": torch.cuda.memory_allocated() / 1e9,
                                    "reserved_gb": torch.cuda.memory_reserved() / 1e9})
            print(json.dumps(report["calls"][-1]), flush=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| call | method | steady step ms | decode ms a step |\n|---|---|---|---|")
    for i, c in enumerate(report["calls"]):
        print(f"| {i} | {c['method']} | {c['steady_ms']:.3f} | {c['decode_ms']:.3f} |")


if __name__ == "__main__":
    main()
