"""What makes a process's first Sift graph faster? Probes on a planted Qwen2.5-1.5B-shaped model (16 x 32768).

Each probe runs Sift calls in one process and prints the steady sparse step of each call:

- ``--shift-gb G``: allocate G GiB before the first call (moves every address the first call gets);
- ``--pause S``: before the third call, wait S seconds (the card cools; clocks, temperature and power printed);
- ``--profile``: run the first two calls under torch's CUDA profiler and compare each kernel's total time.

Results: results/first_graph_h100/probes_h100.txt::

    PYTHONPATH=. python3 benchmarks/studies/first_graph_probe.py --shift-gb 9 --calls 2
    PYTHONPATH=. python3 benchmarks/studies/first_graph_probe.py --pause 45 --calls 4
    PYTHONPATH=. python3 benchmarks/studies/first_graph_probe.py --profile --new 64
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_generate import free, planted_model  # noqa: E402

from siftattention import Sift  # noqa: E402
from siftattention.generation import generate  # noqa: E402


def gpu_state() -> str:
    query = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def kernel_totals(prof) -> dict[str, list[float]]:
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name][0] += e.device_time_total
            totals[e.name][1] += 1
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--shift-gb", type=float, default=0.0)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds to wait before the third call")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    plant = argparse.Namespace(plant_std=2.0, head_corr=0.0, q_scale=0.1)
    model = planted_model(plant, layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                          num_key_value_heads=2, head_dim=128, vocab_size=32000)
    ids = torch.randint(3, 32000, (16, 32768), device="cuda")
    shift = torch.empty(int(args.shift_gb * 2**30), dtype=torch.uint8, device="cuda") if args.shift_gb else None
    tables = []
    for i in range(args.calls):
        pause = args.pause if i == 2 else 0.0
        time.sleep(pause)
        before = gpu_state()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if args.profile else None
        if prof is not None:
            prof.__enter__()
        res = generate(model, ids, None, Sift(tau=0.875), max_new_tokens=args.new, eos_token_id=-1, pad_token_id=0,
                       prefill_chunk=4096)
        if prof is not None:
            prof.__exit__(None, None, None)
            tables.append(kernel_totals(prof))
        steady = res.timings["phases"]["sparse"]["steady_ms"]
        print(f"call {i} (shift {args.shift_gb} GB, pause {pause:.0f} s): sparse steady {steady:.3f} ms; "
              f"gpu before [{before}] after [{gpu_state()}]", flush=True)
        del res, prof
        free()
    if len(tables) >= 2:
        a, b = tables[0], tables[1]
        names = sorted(set(a) | set(b), key=lambda n: -max(a[n][0], b[n][0]))
        print(f"{'kernel':70s} {'us call 0':>12s} {'n':>6s} {'us call 1':>12s} {'n':>6s} {'ratio':>6s}")
        for n in names[:25]:
            print(f"{n[:70]:70s} {a[n][0]:12.0f} {a[n][1]:6d} {b[n][0]:12.0f} {b[n][1]:6d} "
                  f"{b[n][0] / max(a[n][0], 1e-9):6.3f}")
    del shift


if __name__ == "__main__":
    main()
