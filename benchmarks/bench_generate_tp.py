"""Generation speed under tensor parallelism: the model on one GPU against its heads split over two.

One command on a machine with two GPUs:

    PYTHONPATH=. python3 benchmarks/bench_generate_tp.py --compile --out $OUT/generate_tp.json

Llama-3.1-8B's full shape with random bf16 weights and ``bench_generate.py``'s planted
attention, saved once to a directory and loaded as a user would: on one GPU
(``device_map={"": 0}``) and by ``--tp`` ranks of ``torch.distributed.run`` with
``tp_plan="auto"`` (each rank holds 1/tp of every layer's heads and MLP columns; NCCL
all-reduces after the attention and the MLP). Every world size decodes on
``siftattention.generate`` (one CUDA graph a token, the all-reduces captured inside it;
``--compile`` as in ``bench_generate.py``). Per setting (batch x prompt) and world size:
the prefill seconds; decode ms/token of the dense fast path (``Full()``) and of ``Sift``
after its warmup; Sift's realized sparsity; one GPU's byte floor (its share of the weights
and of the KV cache read once per token at the copy bandwidth measured on it in the same
run); a token's all-reduces alone, replayed from a graph; whether Sift's first new tokens
equal the dense path's, and how many equal the one-GPU run's (bf16 sums in another order
flip greedy choices between near-equal logits of random weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import add_planting_args, copy_bandwidth, fast, floor_ms, free, planted_model, profile_steps, weight_bytes  # noqa: E402

from siftattention import Full, Sift  # noqa: E402


def all_reduce_ms(model, batch: int, device: torch.device, replays: int = 100) -> float:
    """GPU time of one token's all-reduces alone (two per layer, [batch, 1, hidden] bf16), from a CUDA graph.

    Every rank replays the same fixed number of times (a collective cannot be timed
    adaptively); the median of per-replay CUDA event times.
    """
    import torch.distributed as dist

    x = torch.zeros(batch, 1, model.config.hidden_size, dtype=torch.bfloat16, device=device)
    dist.all_reduce(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(2 * model.config.num_hidden_layers):
            dist.all_reduce(x)
    times = []
    for i in range(replays + 10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 10:
            times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def worker(model_dir: str, options: str, out: str) -> None:
    """One rank (or the one process): load the saved model, run every setting, rank 0 writes ``out``."""
    from transformers import AutoModelForCausalLM

    args = json.loads(options)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    warnings.filterwarnings("ignore", category=FutureWarning)
    start = time.perf_counter()
    if world > 1:
        model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.bfloat16).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map={"": 0}).eval()
    load_s = time.perf_counter() - start
    device = next(model.parameters()).device
    bandwidth = copy_bandwidth()
    result = {"world": world, "device": torch.cuda.get_device_name(device), "load_s": load_s, "weights_bytes_per_gpu": weight_bytes(model),
              "copy_bw_tb_s": bandwidth / 1e12, "rows": []}

    def save() -> None:  # after every part, so that a run cut short keeps what it measured
        if rank == 0:
            Path(out).write_text(json.dumps(result, indent=1))

    if args["profile"]:
        batch, prompt = (int(x) for x in args["settings"][0].split("x"))
        ids = torch.randint(3, 128000, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)
        # Eager: a rank's collectives also count the time spent waiting for the other rank's launches.
        result["profile"] = profile_steps(model, ids, Full(), new=6)
        if rank == 0:
            print(f"profile of one eager dense decode step, rank 0, {args['settings'][0]}:\n{result['profile']}", flush=True)
        save()
    for setting in [] if args["no_generate"] else args["settings"]:
        batch, prompt = (int(x) for x in setting.split("x"))
        ids = torch.randint(3, 128000, (batch, prompt), generator=torch.Generator().manual_seed(batch * prompt)).to(device)
        row = {"batch": batch, "prompt": prompt, "floor_ms": floor_ms(model, batch, prompt + args["new"] // 2, bandwidth, world)}
        if world > 1:
            row["all_reduce_ms"] = all_reduce_ms(model, batch, device)
        for name, method in (("dense", Full()), ("sift", Sift(tau=args["tau"], warmup=args["warmup"]))):
            try:
                row[name] = fast(model, ids, method, args["new"], args["prefill_chunk"], args["compile"])
            except torch.OutOfMemoryError as err:
                row[name] = {"error": f"out of memory: {str(err).splitlines()[0]}"}
                free()
            if rank == 0:
                print(f"world {world} {setting} {name}: {json.dumps(row[name])[:240]}", flush=True)
        result["rows"].append(row)
        save()
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def save_model(directory: Path, args: argparse.Namespace) -> float:
    """Build the planted 8B-shape model on the first GPU and save it; the seconds it took."""
    start = time.perf_counter()
    model = planted_model(args, layers=args.layers)
    model.save_pretrained(directory)
    del model
    free()
    return time.perf_counter() - start


def launch(world: int, model_dir: Path, options: dict, out: Path) -> dict:
    """Run ``worker`` under ``torch.distributed.run`` with ``world`` ranks; its JSON, or the error's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), __file__,
           "--worker", str(model_dir), json.dumps(options), str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "4"})
    if proc.returncode != 0:
        partial = json.loads(out.read_text()) if out.exists() else {"world": world}
        return partial | {"error": proc.stderr[-4000:]}
    return json.loads(out.read_text()) | {"wall_s": time.perf_counter() - start}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of equal tokens at equal positions."""
    pairs = [(x, y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def table(report: dict) -> str:
    runs = [r for r in report["runs"] if "rows" in r]
    lines = ["| GPUs | B x prompt | prefill s (dense) | dense ms | Sift ms | Sift speedup | floor ms / GPU | all-reduces ms | dense / floor | s (post-warmup) | first tokens: Sift = dense | as on 1 GPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    single = {(r["batch"], r["prompt"]): r for run in runs if run["world"] == 1 for r in run["rows"]}
    for run in runs:
        for r in run["rows"]:
            d, s = r["dense"], r["sift"]
            if "error" in d or "error" in s:
                lines.append(f"| {run['world']} | {r['batch']} x {r['prompt']} | {d.get('error') or s.get('error')} |")
                continue
            ref = single.get((r["batch"], r["prompt"]), {}).get("sift", {})
            same = "-" if run["world"] == 1 or "tokens" not in ref else f"{agreement(ref['tokens'], s['tokens']):.2f}"
            reduce = f"{r['all_reduce_ms']:.2f}" if "all_reduce_ms" in r else "-"
            lines.append(f"| {run['world']} | {r['batch']} x {r['prompt']} | {d['prefill_s']:.2f} | {d['steady_ms']:.2f} | {s['steady_ms']:.2f} | "
                         f"{d['steady_ms'] / s['steady_ms']:.3f} | {r['floor_ms']:.2f} | {reduce} | {d['steady_ms'] / r['floor_ms']:.2f} | "
                         f"{s.get('realized_post_warmup', math.nan):.3f} | {d['tokens'] == s['tokens']} | {same} |")
    for run in report["runs"]:
        if "error" in run:
            lines.append(f"world {run['world']} failed: {run['error'][-800:]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", nargs="+", default=["8x32768", "16x32768"], help="BATCHxPROMPT")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the tensor-parallel run")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (fewer for a quick trial)")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--tau", type=float, default=0.875)
    ap.add_argument("--warmup", type=int, default=16)
    add_planting_args(ap)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step's model code (both paths)")
    ap.add_argument("--profile", action="store_true", help="print the kernels of one eager dense decode step (the first setting)")
    ap.add_argument("--no-generate", action="store_true", help="skip the generation rows (with --profile)")
    ap.add_argument("--single", action=argparse.BooleanOptionalAction, default=True, help="also run the model on one GPU (the reference)")
    ap.add_argument("--out", type=Path, default=Path("bench_generate_tp.json"))
    args = ap.parse_args()
    for setting in args.settings:
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", setting):
            ap.error(f"--settings takes BATCHxPROMPT, for example 8x32768; got {setting!r}")
    if args.tp < 2:
        ap.error(f"--tp must be at least 2 (the one-GPU run is the reference), got {args.tp}")
    if torch.cuda.device_count() < args.tp:
        ap.error(f"--tp {args.tp} needs {args.tp} GPUs, this machine shows {torch.cuda.device_count()}")
    if 8 % args.tp:
        ap.error(f"--tp must divide the 8 KV heads, got {args.tp}")
    import transformers

    options = {k: getattr(args, k) for k in ("settings", "new", "tau", "warmup", "prefill_chunk", "compile", "profile", "no_generate")}
    report = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)},
              "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp, "model")
        report["save_s"] = save_model(model_dir, args)
        for world in (1, args.tp) if args.single else (args.tp,):
            report["runs"].append(launch(world, model_dir, options, Path(tmp, f"world{world}.json")))
            args.out.write_text(json.dumps(report, indent=1))
    print()
    print(f"planted logit std {args.plant_std}, head correlation {args.head_corr}, tau {args.tau}, warmup {args.warmup}, {args.new} new tokens, "
          f"compile {args.compile}")
    print(table(report))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:5])
    else:
        main()
