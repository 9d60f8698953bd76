"""Perplexity of Sift with an anchored normaliser against Sift, on an embedded model (CPU).

A one-pass sift step cannot know the row's normaliser before it reads the row, so it would
filter with a predicted one: this step's log-sum-exp over the anchor keys (the first ``first``
and newest ``last`` valid keys) plus the previous step's gap between the exact log-sum-exp and
the anchor sum (``lse_drift.py`` measures that prediction's error). The kept keys still get the
exact normaliser (or are renormalised, as Sift's option does).

In probabilities the rule is a per-row factor on Sift's threshold: with
``g_t = -log(sum of p_t over the anchors)`` (the gap), the predicted probability of a key is
``p * exp(g_t - g_{t-1})``, so a key is kept when ``p > eta * exp(g_{t-1} - g_t)`` (every
approximated row has a predecessor: the warmup rows measure the gap too).

This script runs the teacher-forced perplexity of full attention, Sift and the anchored
variant (the library's ``Sift(normalizer="anchored")``; both with and without
renormalisation) through the library's evaluation, so all of them see the same windows and
warmup, and reports perplexity against realized sparsity.

    .venv/bin/python benchmarks/studies/anchored_ppl.py --seq-len 2048 --num-seqs 4 --out anchored_ppl.json
    .venv/bin/python benchmarks/studies/anchored_ppl.py --model gemma3-270m ...  # after make gemma
"""

from __future__ import annotations

import argparse
import json
import time

from siftattention.data import load_corpus, token_windows
from siftattention.eval.perplexity import evaluate_perplexity
from siftattention.methods import Full, Sift
from siftattention.models import DEFAULT_MODEL, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--tau", type=float, nargs="+", default=[0.875])
    ap.add_argument("--warmup", type=int, default=128)
    ap.add_argument("--anchor", type=int, nargs=2, default=[64, 256], metavar=("FIRST", "LAST"))
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.time()
    model, tok = load_model(args.model)
    corpus = load_corpus("wikitext2")
    windows = token_windows(corpus.text, tok, args.seq_len, args.num_seqs)
    methods = [("full", Full())]
    for tau in args.tau:
        for renorm in (False, True):
            tag = f"tau={tau},warmup={args.warmup}" + (",renormalize=true" if renorm else "")
            methods.append((f"sift:{tag}", Sift(tau=tau, warmup=args.warmup, renormalize=renorm)))
            methods.append((f"sift_anchored:{tag},anchor={args.anchor[0]}+{args.anchor[1]}",
                            Sift(tau=tau, warmup=args.warmup, renormalize=renorm, normalizer="anchored",
                                 anchor_first=args.anchor[0], anchor_last=args.anchor[1])))
    done = []

    def progress(spec: str, i: int) -> None:
        done.append(spec)
        total = len(methods) * len(windows)
        el = time.time() - t0
        print(f"[{len(done)}/{total}] {spec} window {i + 1}  {el:.0f}s, ETA {el / len(done) * (total - len(done)):.0f}s",
              flush=True)

    results, warm = evaluate_perplexity(model, windows, methods, on_step=progress)
    print(f"\n{args.model}, WikiText-2, {len(windows)} windows of {args.seq_len} tokens, W = {warm}\n")
    print("| method | ppl | ppl (S>W) | sparsity (S>W) |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r.method} | {r.ppl:.3f} | {r.ppl_post_warmup:.3f} | {r.realized_sparsity_post_warmup:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, dataset=corpus.source, seq_len=args.seq_len, windows=len(windows),
                           warmup=warm, anchor=args.anchor, date=time.strftime("%Y-%m-%d"),
                           seconds=time.time() - t0, results=[r.to_dict() for r in results]), f, indent=1)


if __name__ == "__main__":
    main()
