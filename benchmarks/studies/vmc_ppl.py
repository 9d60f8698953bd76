"""What Top-theta's V-mean compensation would do for the other methods (teacher-forced, reference path).

    python benchmarks/studies/vmc_ppl.py --methods sift:tau=0.875,warmup=128 topk:k=0.125,renormalize=false \
        --seq-len 1024 --num-seqs 2 --out benchmarks/results/vmc_ppl_smollm2.json

Each method runs as given and again with ``vmc`` switched on (the pruned probability mass times
the mean of the row's valid value rows added to the output), on the demo's windows.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

from siftattention.data import load_corpus, token_windows
from siftattention.eval.perplexity import evaluate_perplexity
from siftattention.methods import parse_method
from siftattention.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--num-seqs", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    windows = token_windows(load_corpus("wikitext2").text, tokenizer, args.seq_len, args.num_seqs)
    methods = []
    for spec in args.methods:
        plain = parse_method(spec)
        compensated = copy.copy(plain)
        compensated.vmc = True
        methods += [(spec, plain), (spec + " +vmc", compensated)]
    start = time.perf_counter()
    results, warm = evaluate_perplexity(model, windows, methods)
    rows = [r.to_dict() for r in results]
    payload = dict(model=args.model, dataset="wikitext2", seq_len=args.seq_len, num_seqs=args.num_seqs,
                   post_warmup_from=warm, seconds=round(time.perf_counter() - start, 1), results=rows)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1)
    print("| method | ppl | ppl (S>W) | sparsity | sparsity (S>W) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['ppl']:.3f} | {r['ppl_post_warmup']:.3f} | {r['realized_sparsity']:.3f} | "
              f"{r['realized_sparsity_post_warmup']:.3f} |")


if __name__ == "__main__":
    main()
