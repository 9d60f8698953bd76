"""The int8 key copy's decode write on the CPU: torch's ops (``quantize_keys`` and ``index_copy_``) against the C++
writer (``kernels/cpu/key_write.cpp``), and optionally the CPU fast loop's key-bound step with each.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_key_write_cpu.py --out benchmarks/results/key_write_cpu.json
    PYTHONPATH=. .venv/bin/python benchmarks/bench_key_write_cpu.py --loop --out benchmarks/results/key_write_cpu.json

``writes``: one decode step's write of one layer (n = 1 new key per (batch row, KV head), at a device position
``index`` [1] int64, as ``FixedLayer.update`` writes it) into a copy of ``--length`` positions, for Qwen2.5-1.5B's
key shape (Hkv 2, D 128) and SmolLM2's (Hkv 3, D 64) at each ``--batch``, both forms of the copy. The keys are a
transposed view of [B, 1, Hkv * D] (attention's projections leave them so). Both writers are first checked equal,
bit for bit; then, with the order alternating every round, each round times ``--calls`` calls of each writer;
reported: the median over ``--repeats`` rounds of the time per call (``*_us``: wall clock; ``*_thread_us``: the
calling thread's CPU time, less moved by other processes' load on a shared machine), and the median of each
round's ratio of wall times.
``--threads`` torch threads (1: the C++ writer runs its rows on the calling thread for any decode write anyway).

``--loop``: ``siftattention.generate`` with ``Sift(keybound="row")`` on the embedded SmolLM2-135M (float32, eager
on the CPU, the fused C++ key-bound step), with each writer (the C++ writer, or "auto" turned to torch's ops for
the run), runs alternated: the steady sparse step's median time, and the time one step's decode writes take (every
layer's write timed where the cache calls it, summed per step; medians over runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from siftattention.kernels import cpu_decode, key_write
from siftattention.kernels.key_write import write_int8_keys
from siftattention.kernels.keybound import Int8Keys, channel_ranges, new_int8_keys

SHAPES = {"qwen2.5-1.5b": (2, 128), "smollm2-135m": (3, 64)}


def _copy(B: int, H: int, S: int, D: int, form: str, gen: torch.Generator) -> Int8Keys:
    keys = new_int8_keys(B, H, S, D, "cpu", per_channel=form == "channel")
    if form == "channel":
        c, o = channel_ranges(torch.randn(B, H, 64, D, generator=gen) * 2 + torch.randn(D, generator=gen))
        keys.channel.copy_(c)
        keys.offset.copy_(o)
    return keys


def write_times(B: int, H: int, D: int, form: str, S: int, calls: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(B * 100 + H * 10 + D)
    k = torch.randn(B, 1, H * D, generator=gen).view(B, 1, H, D).transpose(1, 2)  # [B, H, 1, D]
    pos = torch.tensor([S // 2])
    copies = {name: _copy(B, H, S, D, form, torch.Generator().manual_seed(1)) for name in ("torch", "cpu")}
    for name, keys in copies.items():
        write_int8_keys(keys, k, index=pos, backend=name)
    assert all(torch.equal(a, b) for a, b in zip(*copies.values()) if a is not None), "the writers differ"
    wall: dict[str, list[float]] = {name: [] for name in copies}
    own: dict[str, list[float]] = {name: [] for name in copies}
    ratios = []
    for r in range(repeats):
        order = list(copies) if r % 2 == 0 else list(copies)[::-1]
        for name in order:
            keys = copies[name]
            start, start_own = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                write_int8_keys(keys, k, index=pos, backend=name)
            wall[name].append((time.perf_counter() - start) / calls * 1e6)
            own[name].append((time.thread_time() - start_own) / calls * 1e6)
        ratios.append(wall["torch"][-1] / wall["cpu"][-1])
    return dict(batch=B, kv_heads=H, head_dim=D, form=form, rows=B * H,
                torch_us=statistics.median(wall["torch"]), cpu_us=statistics.median(wall["cpu"]),
                speedup=statistics.median(ratios), torch_thread_us=statistics.median(own["torch"]),
                cpu_thread_us=statistics.median(own["cpu"]))


def loop_times(batch: int, prompt: int, new: int, repeats: int, form: str) -> dict:
    """The CPU fast loop's steady sparse step with the C++ writer and with torch's (``auto`` turned to torch), and
    the time its decode writes take in it (every layer's, summed per step; wall clock and thread time)."""
    from siftattention import Sift
    from siftattention.data import load_corpus
    from siftattention.generation import cache, generate
    from siftattention.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    text = load_corpus("wikitext2").text
    all_ids = tokenizer(text[:100_000], return_tensors="pt", add_special_tokens=False).input_ids[0]
    ids = torch.stack([all_ids[i * prompt:(i + 1) * prompt] for i in range(batch)])
    method = Sift(keybound=form, warmup=4)
    real_writer, real_write = key_write._key_writer, cache.write_int8_keys
    writers = {"cpu": real_writer, "torch": lambda k, backend: "torch"}
    spent = [0.0, 0.0, 0]  # wall s, thread s, decode writes

    def timed_write(keys, k, *args, index=None, **kwargs):
        if index is None:  # the prompt's writes
            return real_write(keys, k, *args, index=index, **kwargs)
        start, start_own = time.perf_counter(), time.thread_time()
        real_write(keys, k, *args, index=index, **kwargs)
        spent[0] += time.perf_counter() - start
        spent[1] += time.thread_time() - start_own
        spent[2] += 1

    steps: dict[str, list[float]] = {name: [] for name in writers}
    writes: dict[str, list[tuple[float, float]]] = {name: [] for name in writers}
    layers = model.config.num_hidden_layers
    for r in range(repeats):
        for name in (writers if r % 2 == 0 else list(writers)[::-1]):
            key_write._key_writer, cache.write_int8_keys = writers[name], timed_write
            spent[:] = [0.0, 0.0, 0]
            try:
                res = generate(model, ids, None, method, max_new_tokens=new, eos_token_id=-1)
            finally:
                key_write._key_writer, cache.write_int8_keys = real_writer, real_write
            steps[name].append(list(res.timings["phases"].values())[-1]["steady_ms"])
            per_step = layers / spent[2] * 1e3  # ms of a step's writes per second of writes
            writes[name].append((spent[0] * per_step, spent[1] * per_step))
    row = dict(batch=batch, prompt=prompt, new=new, form=form, layers=layers, phase=list(res.timings["phases"])[-1])
    for name in writers:
        row[f"{name}_writer_step_ms"] = statistics.median(steps[name])
        row[f"{name}_writes_per_step_ms"] = statistics.median(w[0] for w in writes[name])
        row[f"{name}_writes_per_step_thread_ms"] = statistics.median(w[1] for w in writes[name])
    return row | dict(step_ms_runs=steps)


def machine() -> dict:
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return dict(cpu=name, cores=os.cpu_count(), torch=torch.__version__, threads=torch.get_num_threads(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg=os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--loop", action="store_true", help="also time the CPU fast loop's key-bound step with each writer")
    ap.add_argument("--loop-batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--loop-prompt", type=int, default=512)
    ap.add_argument("--loop-new", type=int, default=48)
    ap.add_argument("--loop-repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("key_write_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_decode.available():
        raise SystemExit(f"the fused CPU kernel cannot be built here: {cpu_decode.build_problem()}")
    info = machine()
    rows = []
    for model, (H, D) in SHAPES.items():
        for B in args.batch:
            for form in ("row", "channel"):
                row = dict(model=model) | write_times(B, H, D, form, args.length, args.calls, args.repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = dict(machine=info, args=vars(args) | dict(out=str(args.out)), writes=rows)
    if args.loop:
        out["loop"] = []
        for B in args.loop_batch:
            row = loop_times(B, args.loop_prompt, args.loop_new, args.loop_repeats, "row")
            out["loop"].append(row)
            print(json.dumps(row), flush=True)
    out["machine"]["loadavg_after"] = os.getloadavg()
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
