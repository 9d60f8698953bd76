"""Seconds per 1024-token window of each method's teacher-forced forward on the embedded model (CPU).

    .venv/bin/python benchmarks/studies/cpu_method_cost.py [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import time

import torch

from siftattention.data import load_corpus, token_windows
from siftattention.eval.perplexity import evaluate_perplexity
from siftattention.methods import parse_method
from siftattention.models import load_model

SPECS = ["full", "topk:k=0.125", "h2o:k=0.125", "sift:tau=0.875,warmup=128", "oracle:tau=0.875"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    window = token_windows(load_corpus("wikitext2").text, tokenizer, args.seq_len, 1)
    evaluate_perplexity(model, window[:, :128], [("full", parse_method("full"))])  # warm up
    print(f"threads: {torch.get_num_threads()}; seq-len {args.seq_len}")
    for spec in SPECS:
        start = time.perf_counter()
        evaluate_perplexity(model, window, [(spec, parse_method(spec))])
        print(f"{spec:28s} {time.perf_counter() - start:6.1f} s")
    model.set_attn_implementation("sdpa")
    start = time.perf_counter()
    with torch.no_grad():
        model(window)
    print(f"{'transformers sdpa (no hook)':28s} {time.perf_counter() - start:6.1f} s")


if __name__ == "__main__":
    main()
