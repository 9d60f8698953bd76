"""Generation speed under tensor parallelism: the model on one GPU against its heads split over two.

One command on a machine with two GPUs:

    PYTHONPATH=. python3 benchmarks/bench_generate_tp.py --compile --out $OUT/generate_tp.json

Llama-3.1-8B's full shape (``--shape 70b``: Llama-3.1-70B's) with random bf16 weights and
``bench_generate.py``'s planted attention, saved once to a directory (built a few layers at a
time) and loaded as a user would: on one GPU (``device_map={"": 0}``; ``--reference per-gpu``:
one rank's share of the heads and MLP as a model of its own, for a shape no one GPU holds)
and by ``--tp`` ranks of ``torch.distributed.run`` with
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

``--check`` first compares, in every world, the dense fast path's greedy tokens with
transformers' generate on the same loaded model (2 x 256 prompt tokens, 32 new), so a
sharding or capture fault shows before anything is timed.
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
from bench_generate import (LLAMA_8B, add_planting_args, copy_bandwidth, fast, floor_ms, free, greedy_agreement,  # noqa: E402
                            plant_attention, planted_model, profile_steps, set_q_scale, weight_bytes)

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
    if args["check"]:
        ids = torch.randint(3, 128000, (2, 256), generator=torch.Generator().manual_seed(1)).to(device)
        result["check"] = {"prompt": 256, "new": 32, "rows": greedy_agreement(model, ids, 32)}
        if rank == 0:
            print(f"world {world} check, dense fast path vs transformers' generate: {result['check']['rows']}", flush=True)
        free()
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


LLAMA_70B = dict(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128)
SHAPES = {"8b": LLAMA_8B, "70b": LLAMA_70B}


def per_gpu_shape(shape: dict, tp: int) -> dict:
    """The model one rank of ``tp`` holds, as a model of its own: 1/tp of the heads and MLP columns."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    return dict(shape, num_attention_heads=shape["num_attention_heads"] // tp, num_key_value_heads=shape["num_key_value_heads"] // tp,
                intermediate_size=shape["intermediate_size"] // tp, head_dim=head_dim)


def save_model(directory: Path, args: argparse.Namespace, shape: dict, chunk_layers: int = 8) -> float:
    """Build the planted model ``chunk_layers`` decoder layers at a time on the first GPU and save it; the seconds it took.

    A 70B-shape model (141 GB in bf16) fits no one GPU, so each chunk is a model of its own
    (random weights as transformers initialises them, planted attention, the query scale)
    whose layers are renumbered into one sharded safetensors checkpoint; the embedding, the
    final norm and the output matrix come from the first chunk.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from bench_generate import build

    start = time.perf_counter()
    layers = args.layers or shape["num_hidden_layers"]
    overrides = {k: v for k, v in shape.items() if k != "num_hidden_layers" and (k not in LLAMA_8B or LLAMA_8B[k] != v)}
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for first in range(0, layers, chunk_layers):
        n = min(chunk_layers, layers - first)
        model = build(layers=n, attention_bias=args.plant_std > 0, **overrides)
        if args.plant_std > 0:
            plant_attention(model, args.plant_std, args.head_corr, seed=1 + first)
        set_q_scale(model, args.q_scale)
        tensors = {}
        for name, tensor in model.state_dict().items():
            if name.startswith("model.layers."):
                index, rest = name[len("model.layers."):].split(".", 1)
                name = f"model.layers.{first + int(index)}.{rest}"
            elif first > 0:
                continue
            tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        shard = f"model-{first // chunk_layers:05d}.safetensors"
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del model, tensors
        free()
    cfg = LlamaConfig(**{**shape, "num_hidden_layers": layers, "attention_bias": args.plant_std > 0})
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(directory)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
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
    lines = ["| GPUs | B x prompt | prefill s (dense) | dense ms | Sift ms | Sift speedup | floor ms / GPU | all-reduces ms (share of dense step) | dense / floor | s (post-warmup) | first tokens: Sift = dense | as on 1 GPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    whole = report.get("args", {}).get("reference", "whole") == "whole"  # else the one-GPU run is another model
    single = {(r["batch"], r["prompt"]): r for run in runs if run["world"] == 1 for r in run["rows"]}
    for run in runs:
        for r in run["rows"]:
            d, s = r["dense"], r["sift"]
            if "error" in d or "error" in s:
                lines.append(f"| {run['world']} | {r['batch']} x {r['prompt']} | {d.get('error') or s.get('error')} |")
                continue
            ref = single.get((r["batch"], r["prompt"]), {}).get("sift", {})
            same = "-" if run["world"] == 1 or "tokens" not in ref or not whole else f"{agreement(ref['tokens'], s['tokens']):.2f}"
            reduce = f"{r['all_reduce_ms']:.2f} ({r['all_reduce_ms'] / d['steady_ms']:.2f})" if "all_reduce_ms" in r else "-"
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
    ap.add_argument("--shape", choices=list(SHAPES), default="8b", help="Llama-3.1-8B's or -70B's shape (random weights)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's; fewer for a quick trial)")
    ap.add_argument("--reference", choices=["whole", "per-gpu"], default="whole",
                    help="the one-GPU run: the whole model, or one rank's share as a model of its own (for shapes no one GPU holds)")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--tau", type=float, default=0.875)
    ap.add_argument("--warmup", type=int, default=16)
    add_planting_args(ap)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step's model code (both paths)")
    ap.add_argument("--check", action="store_true", help="first compare the dense fast path with transformers' generate in every world")
    ap.add_argument("--profile", action="store_true", help="print the kernels of one eager dense decode step (the first setting)")
    ap.add_argument("--no-generate", action="store_true", help="skip the generation rows (with --profile)")
    ap.add_argument("--single", action=argparse.BooleanOptionalAction, default=True, help="also run the model on one GPU (the reference)")
    ap.add_argument("--only", choices=["single", "tp"], help="run only the one-GPU reference or only the tensor-parallel run")
    ap.add_argument("--model-dir", type=Path, help="keep the saved models here and reuse them (a later call can run the other world)")
    ap.add_argument("--out", type=Path, default=Path("bench_generate_tp.json"))
    args = ap.parse_args()
    for setting in args.settings:
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", setting):
            ap.error(f"--settings takes BATCHxPROMPT, for example 8x32768; got {setting!r}")
    if args.tp < 2:
        ap.error(f"--tp must be at least 2 (the one-GPU run is the reference), got {args.tp}")
    if torch.cuda.device_count() < args.tp:
        ap.error(f"--tp {args.tp} needs {args.tp} GPUs, this machine shows {torch.cuda.device_count()}")
    shape = SHAPES[args.shape]
    if shape["num_key_value_heads"] % args.tp:
        ap.error(f"--tp must divide the {shape['num_key_value_heads']} KV heads, got {args.tp}")
    import transformers

    options = {k: getattr(args, k) for k in ("settings", "new", "tau", "warmup", "prefill_chunk", "compile", "profile", "no_generate", "check")}
    report = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "runs": []}
    worlds = {"single": (1,), "tp": (args.tp,)}.get(args.only, (1, args.tp) if args.single else (args.tp,))
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.model_dir or Path(scratch)
        model_dir = Path(tmp, "model")
        if args.tp in worlds or args.reference == "whole":
            if not (model_dir / "config.json").is_file():
                report["save_s"] = save_model(model_dir, args, shape)
        single_dir = model_dir
        if 1 in worlds and args.reference == "per-gpu":
            single_dir = Path(tmp, "per_gpu_model")
            if not (single_dir / "config.json").is_file():
                report["save_per_gpu_s"] = save_model(single_dir, args, per_gpu_shape(shape, args.tp))
        for world in worlds:
            report["runs"].append(launch(world, single_dir if world == 1 else model_dir, options, Path(tmp, f"world{world}.json")))
            args.out.write_text(json.dumps(report, indent=1))
    print()
    print(f"planted logit std {args.plant_std}, head correlation {args.head_corr}, tau {args.tau}, warmup {args.warmup}, {args.new} new tokens, "
          f"compile {args.compile}")
    print(table(report))
    for run in report["runs"]:
        if "check" in run:
            print(f"check, world {run['world']}: agreeing tokens {[r['agreeing_tokens'] for r in run['check']['rows']]} of {run['check']['new']}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:5])
    else:
        main()
