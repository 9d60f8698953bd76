"""What makes a process's first Sift graph faster? Probes on a planted Qwen2.5-1.5B-shaped model (16 x 32768).

Each probe runs Sift calls in one process and prints the steady sparse step of each call:

- ``--shift-gb G``: allocate G GiB before the first call (moves every address the first call gets);
- ``--pause S``: before the third call, wait S seconds (the card cools; clocks, temperature and power printed);
- ``--profile``: run the first two calls under torch's CUDA profiler and compare each kernel's total time;
- ``--lead full``: one dense call (``Full()``, its own graphs) before the Sift calls: whether the effect belongs to
  the process's first graph or to its first Sift graph;
- ``--dump DIR``: every captured graph in debug mode, written as Graphviz (``CUDAGraph.debug_dump``) per call and
  phase, then the sparse graphs of the first two Sift calls compared: node and edge counts, and the lines (kernel
  names, launch geometry, parameters, dependencies) that differ once addresses are masked.

Results: results/first_graph_h100/probes_h100.txt::

    PYTHONPATH=. python3 benchmarks/studies/first_graph_probe.py --shift-gb 9 --calls 2
    PYTHONPATH=. python3 benchmarks/studies/first_graph_probe.py --pause 45 --calls 4
    PYTHONPATH=. python3 benchmarks/studies/first_graph_probe.py --profile --new 64
    PYTHONPATH=. python3 benchmarks/studies/first_graph_probe.py --lead full --dump $OUT/graphs --calls 2
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_generate import free, planted_qwen_model  # noqa: E402

from siftattention import Full, Sift  # noqa: E402
from siftattention.generation import generate  # noqa: E402
from siftattention.generation import loop as fast_loop  # noqa: E402

_DUMPED: list[tuple[str, torch.cuda.CUDAGraph]] = []


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


def dump_graphs() -> None:
    """Capture every fast-loop graph in debug mode and keep (phase, graph) in ``_DUMPED`` until dumped."""
    real_run = fast_loop._Loop._run
    real_graph = torch.cuda.CUDAGraph

    def debug_graph() -> torch.cuda.CUDAGraph:
        graph = real_graph(keep_graph=True)  # else the graph is freed once instantiated and dumps nothing
        graph.enable_debug_mode()
        return graph

    def run(self, phase: str) -> str:
        fast_loop.torch.cuda.CUDAGraph = debug_graph
        try:
            how = real_run(self, phase)
        finally:
            fast_loop.torch.cuda.CUDAGraph = real_graph
        if how == "capture":
            _DUMPED.append((phase, self.graphs[phase]))
        return how

    fast_loop._Loop._run = run


def write_dumps(folder: Path, call: str) -> list[Path]:
    """Write the graphs captured since the last call as DOT files named after ``call`` and their phase."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for phase, graph in _DUMPED:
        path = folder / f"{call}_{phase}.dot"
        graph.debug_dump(str(path))
        paths.append(path)
    _DUMPED.clear()
    return paths


def _normalised(path: Path) -> list[str]:
    """A DOT dump's lines with addresses and graph ids masked (they differ between any two captures)."""
    text = path.read_text(errors="replace")
    text = re.sub(r"0x[0-9a-fA-F]+", "0x_", text)
    text = re.sub(r"graph_\d+", "graph_", text)
    return text.splitlines()


def compare_graphs(a: Path, b: Path) -> None:
    """Print both graphs' node and edge counts and the first lines where their normalised dumps differ."""
    import difflib

    la, lb = _normalised(a), _normalised(b)
    for path, lines in ((a, la), (b, lb)):
        text = "\n".join(lines)
        print(f"{path.name}: {text.count('KERNEL')} kernel nodes, {text.count('->')} edges, "
              f"{sum(text.count(k) for k in ('MEMCPY', 'MEMSET'))} memcpy/memset nodes, {len(lines)} lines")
    diff = [d for d in difflib.unified_diff(la, lb, lineterm="", n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    print(f"differing lines after masking addresses: {len(diff)}")
    for d in diff[:20]:
        print("  " + d[:200])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--shift-gb", type=float, default=0.0)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds to wait before the third call")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--lead", choices=["none", "full"], default="none", help="a dense call before the Sift calls")
    ap.add_argument("--dump", type=Path, help="folder for the graphs' DOT dumps")
    args = ap.parse_args()
    if args.dump:
        dump_graphs()
    print(torch.cuda.get_device_name(), flush=True)
    model = planted_qwen_model()
    ids = torch.randint(3, 32000, (16, 32768), device="cuda")
    shift = torch.empty(int(args.shift_gb * 2**30), dtype=torch.uint8, device="cuda") if args.shift_gb else None
    tables = []
    if args.lead == "full":
        res = generate(model, ids, None, Full(), max_new_tokens=args.new, eos_token_id=-1, pad_token_id=0,
                       prefill_chunk=4096)
        print(f"lead dense call: steady {res.timings['phases']['exact']['steady_ms']:.3f} ms", flush=True)
        if args.dump:
            write_dumps(args.dump, "lead")
        del res
        free()
    sparse_dumps = []
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
        if args.dump:
            sparse_dumps += [p for p in write_dumps(args.dump, f"call{i}") if p.name.endswith("_sparse.dot")]
        del res, prof
        free()
    if len(tables) >= 2:
        a, b = tables[0], tables[1]
        names = sorted(set(a) | set(b), key=lambda n: -max(a[n][0], b[n][0]))
        print(f"{'kernel':70s} {'us call 0':>12s} {'n':>6s} {'us call 1':>12s} {'n':>6s} {'ratio':>6s}")
        for n in names[:25]:
            print(f"{n[:70]:70s} {a[n][0]:12.0f} {a[n][1]:6d} {b[n][0]:12.0f} {b[n][1]:6d} "
                  f"{b[n][0] / max(a[n][0], 1e-9):6.3f}")
    if len(sparse_dumps) >= 2:
        compare_graphs(sparse_dumps[0], sparse_dumps[1])
    del shift


if __name__ == "__main__":
    main()
