"""Perplexity and realized sparsity of the embedded model under tensor parallelism (CPU).

    PYTHONPATH=. python3 benchmarks/studies/tp_quality.py --ranks 3 --out benchmarks/results/tp_ppl_smollm2_cpu.json

SmolLM2-135M-Instruct (9 query heads, 3 KV heads) loaded with ``tp_plan="auto"`` by
``--ranks`` processes of ``torch.distributed.run`` on the gloo backend, each holding
9 / ranks query heads and 3 / ranks KV heads; ``sift ppl``'s evaluation (teacher-forced,
WikiText-2 test windows) of each method, against the same evaluation in one process.
Every rank must report the one-process figures: a method decides per head, so sharding
the heads changes nothing but the order of floating-point sums.
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

SPECS = ["full", "topk:k=0.125", "h2o:k=0.125", "sift:tau=0.875,warmup=128", "sift:tau=0.875,warmup=128,renormalize=true",
         "oracle:tau=0.875", "toptheta:k=16", "skipsoftmax:scale=64,block=32"]


def evaluate(model, tokenizer, seq_len: int, num_seqs: int) -> list[dict]:
    from siftattention.data import load_corpus, token_windows
    from siftattention.eval.perplexity import evaluate_perplexity
    from siftattention.methods import parse_method

    methods = [(spec, parse_method(spec)) for spec in SPECS]
    for _, method in methods:
        method.prepare(model)
    windows = token_windows(load_corpus("wikitext2").text, tokenizer, seq_len, num_seqs)
    results, _ = evaluate_perplexity(model, windows, methods)
    return [r.to_dict() for r in results]


def worker(out: str, seq_len: int, num_seqs: int) -> None:
    import torch.distributed as dist

    from siftattention.models import load_model

    warnings.filterwarnings("ignore")
    model, tokenizer = load_model("smollm2-135m", tensor_parallel=True)
    heads = model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] // model.model.layers[0].self_attn.head_dim
    start = time.perf_counter()
    rows = evaluate(model, tokenizer, seq_len, num_seqs)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"local_query_heads": heads, "elapsed_s": round(time.perf_counter() - start, 1), "results": rows}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--num-seqs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from siftattention.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    start = time.perf_counter()
    single = evaluate(model, tokenizer, args.seq_len, args.num_seqs)
    single_s = time.perf_counter() - start
    del model
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks), __file__,
               "--worker", tmp, str(args.seq_len), str(args.num_seqs)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(proc.stderr[-4000:])
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    rows = []
    for i, ref in enumerate(single):
        tp = [r["results"][i] for r in ranks]
        rows.append({
            "method": ref["method"], "ppl": ref["ppl"], "realized_sparsity": ref["realized_sparsity"],
            "tp_ppl": [t["ppl"] for t in tp], "tp_realized_sparsity": [t["realized_sparsity"] for t in tp],
            "max_ppl_rel_diff": max(abs(t["ppl"] / ref["ppl"] - 1) for t in tp),
            "max_sparsity_diff": max(abs(t["realized_sparsity"] - ref["realized_sparsity"]) for t in tp),
        })
    payload = {
        "command": " ".join(["python3", "benchmarks/studies/tp_quality.py", *sys.argv[1:]]),
        "machine": f"CPU ({os.cpu_count()} cores), gloo", "date": time.strftime("%Y-%m-%d"),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "model": "smollm2-135m", "dataset": "wikitext2", "seq_len": args.seq_len, "num_seqs": args.num_seqs,
        "ranks": args.ranks, "local_query_heads": [r["local_query_heads"] for r in ranks],
        "single_process_s": round(single_s, 1), "rank_elapsed_s": [r["elapsed_s"] for r in ranks], "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"| method | ppl (1 process) | ppl (TP {args.ranks} ranks) | sparsity (1 process) | sparsity (TP) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['ppl']:.3f} | {' / '.join(f'{p:.3f}' for p in r['tp_ppl'])} | "
              f"{r['realized_sparsity']:.4f} | {' / '.join(f'{s:.4f}' for s in r['tp_realized_sparsity'])} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
