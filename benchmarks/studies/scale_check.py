"""Methods across devices on the GPU: an accelerate device map and tensor parallelism.

One command on the GPU machine:

    PYTHONPATH=. python3 benchmarks/studies/scale_check.py --out $OUT/scale.json

A small random fp32 Llama (4 layers, GQA 8/2, head_dim 64, vocab 1000) and a left-padded
batch of 3 prompts of 600 tokens; every method (Full, Top-k, Sift, Sift anchored,
Top-theta) through transformers' ``generate`` with ``apply`` (decode steps on the Triton
kernels) and through ``siftattention.generate``, 48 new tokens, compared with the same
weights in one process on one device: tokens, per-head realized sparsity.

1. Device map: with two GPUs visible, layers 0-1 on cuda:0 and 2-3 on cuda:1; with one,
   layers 2-3 offloaded to the CPU (accelerate streams their weights in at each forward).
   ``siftattention.generate`` falls back to transformers' generate with its one-line warning.
   Then a device map that puts the whole model on cuda:0 (what ``device_map="auto"`` does
   where it fits): the fast loop serves it, CUDA graphs and all.
2. Tensor parallelism (two GPUs): the script starts itself under ``torch.distributed.run``
   with two ranks over NCCL, each holding half of the heads; the fast loop captures its
   CUDA graphs with the all-reduces inside. With one GPU it is skipped: NCCL refuses two
   ranks on one device, and gloo with CUDA tensors crashed (SIGSEGV) on the H200 tried.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from siftattention import Full, Sift, TopK, TopTheta, apply
from siftattention.generation import generate

NEW = 48


def methods() -> dict:
    return {
        "full": Full(),
        "topk": TopK(k=0.125),
        "sift": Sift(tau=0.875, warmup=8),
        "sift_anchored": Sift(tau=0.875, warmup=8, normalizer="anchored"),
        "toptheta": TopTheta(k=32, first_layers=0),
    }


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (3, 600), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    mask[2, :333] = 0
    ids = ids.masked_fill(mask == 0, 0)
    calibration = torch.randint(3, 1000, (2, 256), generator=g)
    return ids.to(device), mask.to(device), calibration.to(device)


def run_methods(model, device: torch.device) -> dict:
    ids, mask, calibration = inputs(device)
    out = {}
    for name, method in methods().items():
        if isinstance(method, TopTheta):
            method.calibrate(model, calibration)
        kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        with apply(model, method) as handle, torch.inference_mode():
            hf = model.generate(input_ids=ids, attention_mask=mask, **kw)
            per_head = handle.stats.per_head()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            fast = generate(model, ids, mask, method, max_new_tokens=NEW, eos_token_id=-1, pad_token_id=0)
            seconds = time.perf_counter() - start
        out[name] = {
            "hf_tokens": hf.cpu(), "fast_tokens": fast.sequences.cpu(), "per_head": per_head,
            "fast_per_head": fast.stats.per_head(), "fast": fast.fast, "fast_s": seconds,
            "warnings": [str(w.message) for w in caught if "siftattention" in str(w.message)],
        }
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The largest absolute difference, None where the shapes differ (0 for two empty records: Full keeps none)."""
    if a.shape != b.shape:
        return None
    return float((a - b).abs().max()) if a.numel() else 0.0


def compare(test: dict, ref: dict) -> dict:
    """Per method: tokens equal on both paths, the largest per-head sparsity difference."""
    rows = {}
    for name in ref:
        a, b = test[name], ref[name]
        rows[name] = {
            "hf_tokens_equal": bool(torch.equal(a["hf_tokens"], b["hf_tokens"])),
            "fast_tokens_equal": bool(torch.equal(a["fast_tokens"], b["fast_tokens"])),
            "fast_token_agreement": float((a["fast_tokens"] == b["fast_tokens"]).float().mean()),
            "heads": list(a["per_head"].shape),
            "per_head_max_diff": max_diff(a["per_head"], b["per_head"]),
            "fast_per_head_max_diff": max_diff(a["fast_per_head"], b["fast_per_head"]),
            "sparsity": float(b["per_head"].mean()) if b["per_head"].numel() else 0.0,
            "fast_path": a["fast"], "fallback_warnings": a["warnings"],
        }
    return rows


def device_map_check(directory: Path) -> dict:
    from transformers import AutoModelForCausalLM

    two = torch.cuda.device_count() >= 2
    second = "cuda:1" if two else "cpu"
    device_map = {"model.embed_tokens": "cuda:0", "model.rotary_emb": "cuda:0", "model.layers.0": "cuda:0",
                  "model.layers.1": "cuda:0", "model.layers.2": second, "model.layers.3": second,
                  "model.norm": second, "lm_head": second}
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to("cuda:0").eval()
    ref = run_methods(plain, torch.device("cuda:0"))
    del plain
    dispatched = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, device_map=device_map).eval()
    test = run_methods(dispatched, torch.device("cuda:0"))
    del dispatched
    # device_map="auto" where the model fits on cuda:0: one device, so the fast loop (CUDA graphs) serves it.
    whole = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, device_map={"": "cuda:0"}).eval()
    one_device = run_methods(whole, torch.device("cuda:0"))
    return {"layout": "layers 2-3 on cuda:1" if two else "layers 2-3 offloaded to the CPU", "methods": compare(test, ref),
            "one_device_methods": compare(one_device, ref)}


def tensor_parallel_worker(directory: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore", category=FutureWarning)
    tp = AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", dtype=torch.float32).eval()
    device = next(p.device for p in tp.parameters())
    rank = dist.get_rank()
    test = run_methods(tp, device)
    del tp
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    ref = run_methods(plain, device)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"backend": dist.get_backend(), "device": str(device), "methods": compare(test, ref)}))
    dist.barrier()
    dist.destroy_process_group()


def tensor_parallel_check(directory: Path, work: Path) -> dict:
    if torch.cuda.device_count() < 2:
        # Measured on one H200: NCCL refuses two ranks on one device, and gloo with CUDA tensors crashed (SIGSEGV).
        return {"skipped": "needs two GPUs"}
    backend = "nccl"
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--tp-worker", str(directory), str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)
    if proc.returncode != 0:
        return {"backend": backend, "error": proc.stderr[-3000:]}
    return {"backend": backend, "ranks": [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(2)]}


def table(results: dict) -> str:
    lines = ["| check | method | heads | hf tokens equal | fast tokens equal | fast path | per-head diff | sparsity |",
             "|---|---|---|---|---|---|---|---|"]
    blocks = [("device map: " + results["device_map"]["layout"], results["device_map"]["methods"]),
              ("device map: the whole model on cuda:0", results["device_map"]["one_device_methods"])]
    tp = results["tensor_parallel"]
    for r in tp.get("ranks", []):
        blocks.append((f"TP rank of 2 ({tp['backend']}, {r['device']})", r["methods"]))
    for label, rows in blocks:
        for name, row in rows.items():
            lines.append(f"| {label} | {name} | {row['heads']} | {row['hf_tokens_equal']} | {row['fast_tokens_equal']} "
                         f"({row['fast_token_agreement']:.3f}) | {row['fast_path']} | {row['per_head_max_diff']} | {row['sparsity']:.3f} |")
    if "skipped" in tp:
        lines.append(f"tensor parallelism skipped: {tp['skipped']}")
    if "error" in tp:
        lines.append(f"tensor parallelism failed: {tp['error'][-600:]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("scale.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp, "model")
        small_llama().save_pretrained(directory)
        results = {
            "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
            "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
            "date": time.strftime("%Y-%m-%d"),
            "device_map": device_map_check(directory),
            "tensor_parallel": tensor_parallel_check(directory, Path(tmp)),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tp-worker"]:
        tensor_parallel_worker(*sys.argv[2:4])
    else:
        main()
