"""Perplexity of Sift with an anchored normaliser against Sift, on an embedded model (CPU).

A one-pass sift step cannot know the row's normaliser before it reads the row, so it would
filter with a predicted one: this step's log-sum-exp over the anchor keys (the first ``first``
and newest ``last`` valid keys) plus the previous step's gap between the exact log-sum-exp and
the anchor sum (``lse_drift.py`` measures that prediction's error). The kept keys still get the
exact normaliser (or are renormalised, as Sift's option does).

In probabilities the rule is a per-row factor on Sift's threshold: with
``g_t = -log(sum of p_t over the anchors)`` (the gap), the predicted probability of a key is
``p * exp(g_t - g_{t-1})``, so a key is kept when ``p > eta * exp(g_{t-1} - g_t)``. The first
step of a sequence (no previous gap) uses the exact normaliser.

This script runs the teacher-forced perplexity of full attention, Sift and the anchored
variant (both with and without renormalisation) through the library's evaluation, so all of
them see the same windows and warmup, and reports perplexity against realized sparsity.

    .venv/bin/python benchmarks/anchored_ppl.py --seq-len 2048 --num-seqs 4 --out anchored_ppl.json
    .venv/bin/python benchmarks/anchored_ppl.py --model gemma3-270m ...  # after make gemma
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from siftattention.data import load_corpus, token_windows
from siftattention.eval.perplexity import evaluate_perplexity
from siftattention.methods import Full, Sift
from siftattention.methods.base import Rows, Selection
from siftattention.methods.sift import SiftState
from siftattention.models import DEFAULT_MODEL, load_model


@dataclass
class AnchoredState(SiftState):
    last_gap: torch.Tensor = None  # [B, H] the gap of the last step row seen; NaN before the first
    factor: torch.Tensor = None  # [B, H, R] exp(g_{t-1} - g_t) of the chunk being selected


@dataclass
class AnchoredSift(Sift):
    """Sift whose filter uses the anchored prediction of the normaliser (teacher-forced rows only)."""

    first: int = 64
    last: int = 256
    name = "sift_anchored"

    def new_state(self, batch: int, heads: int, device: torch.device) -> AnchoredState:
        base = super().new_state(batch, heads, device)
        return AnchoredState(**vars(base), last_gap=torch.full((batch, heads), float("nan"), device=device))

    def gaps(self, rows: Rows) -> torch.Tensor:
        """g = -log(sum of p over each row's anchor keys), [B, H, R]."""
        rank = rows.valid.cumsum(-1)  # 1-based rank of each valid key in its row
        n = rows.valid.sum(-1, keepdim=True)
        anchor = rows.valid & ((rank <= self.first) | (rank > n - self.last))
        return -torch.log((rows.probs * anchor).sum(-1).clamp_min(1e-30))

    def select(self, rows: Rows, state: AnchoredState) -> Selection:
        gap = self.gaps(rows)
        prev = torch.cat([state.last_gap[:, :, None], gap[:, :, :-1]], dim=2)
        state.factor = torch.exp(torch.nan_to_num(prev - gap, nan=0.0))  # the first step: exact normaliser
        R = rows.is_step.shape[1]
        last = (rows.is_step.long() * torch.arange(1, R + 1, device=gap.device)).argmax(dim=1)  # last step row
        has_step = rows.is_step.any(dim=1)
        state.last_gap = torch.where(has_step[:, None], gap[torch.arange(gap.shape[0]), :, last], state.last_gap)
        return super().select(rows, state)

    def row_threshold(self, rows: Rows, state: AnchoredState) -> torch.Tensor:
        return super().row_threshold(rows, state) * state.factor

    def decode_step(self, *args, **kwargs):
        raise NotImplementedError("AnchoredSift is a teacher-forced study; it has no decode step")


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
                            AnchoredSift(tau=tau, warmup=args.warmup, renormalize=renorm,
                                         first=args.anchor[0], last=args.anchor[1])))
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
