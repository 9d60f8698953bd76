"""How many V rows does a KV group read? Real models, teacher-forced, CPU.

A decode kernel reads a V row once for its KV group when any query head of the group keeps
the key, so the V traffic of a sparse step is the union of the group's kept sets, not one
head's share. With independent heads keeping a fraction f each, a group of g heads reads
``1 - (1 - f)^g`` of the rows (41% for g = 4 at f = 0.125); heads that attend to the same keys
read fewer. The GPU benchmarks plant attention with independent heads by default
(``bench_generate.py --head-corr 0``, ``bench_decode.py --group-corr 0``). This script measures
the union on the embedded GQA models over WikiText-2: per layer and overall, over the rows the
method approximates (after Sift's warmup), the kept fraction per query head, the fraction of V
rows the group reads, and what independent heads keeping the same per-head fractions would read.

``--prompt-len P`` scores each window as a decode instead (as ``sift ppl --prompt-len``): its first P tokens
are a prompt (prefilled exactly, what Sift calibrates on), the rest teacher-forced decode steps, which are
measured, with their perplexity and realized sparsity (``Sift(gqa="shared")`` against per-head sets).

    .venv/bin/python benchmarks/studies/group_union.py --seq-len 2048 --num-seqs 4 --out union_smollm2.json
    .venv/bin/python benchmarks/studies/group_union.py --model gemma3-270m --seq-len 2048 --num-seqs 4   # after make gemma
    .venv/bin/python benchmarks/studies/group_union.py --seq-len 2048 --prompt-len 1536 --num-seqs 4 \
        --methods full sift:tau=0.875,vmc=true sift:tau=0.875,vmc=true,gqa=shared --out gqa_shared.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from siftattention import apply
from siftattention.data import load_corpus, token_windows
from siftattention.eval.perplexity import token_nll_after_prompt
from siftattention.methods import parse_method
from siftattention.methods.base import Method, Rows, Selection
from siftattention.models import DEFAULT_MODEL, load_model


@dataclass
class LayerUnion:
    """Sums over the approximated rows of one layer (one term per (sequence, KV head, row))."""

    rows: int = 0
    kept_per_head: float = 0.0
    union: float = 0.0
    independent: float = 0.0


def probe(method: Method, layers: dict[int, LayerUnion]) -> dict[int, int]:
    """Record, per layer, the group union of every selection ``method`` makes (its ``select`` wrapped on the
    instance, so a method calibrating on a prompt runs unchanged). Layers are told apart by their state, in
    the order a forward pass first meets them: clear the returned map before each window."""
    inner = method.select
    order: dict[int, int] = {}

    def select(rows: Rows, state: Any) -> Selection:
        sel = inner(rows, state)
        layer = order.setdefault(id(state), len(order))
        if sel.keep is None:
            return sel
        B, H, R, K = sel.keep.shape
        g = rows.groups
        keep = (sel.keep & rows.valid).view(B, H // g, g, R, K)
        n = rows.steps.clamp(min=1).double()  # [B, R] valid keys per row
        frac = keep.sum(-1).double() / n[:, None, None, :]  # [B, Hkv, g, R]
        union = keep.any(dim=2).sum(-1).double() / n[:, None, :]  # [B, Hkv, R]
        independent = 1 - (1 - frac).prod(dim=2)
        use = (sel.approx & rows.is_step)[:, None, :].expand(B, H // g, R)
        acc = layers.setdefault(layer, LayerUnion())
        acc.rows += int(use.sum())
        acc.kept_per_head += float(frac.mean(dim=2)[use].sum())
        acc.union += float(union[use].sum())
        acc.independent += float(independent[use].sum())
        return sel

    method.select = select  # type: ignore[method-assign]
    return order


def summary(layers: dict[int, LayerUnion]) -> dict:
    def ratios(acc: LayerUnion) -> dict:
        r = max(acc.rows, 1)
        return dict(rows=acc.rows, kept_per_head=acc.kept_per_head / r, v_rows_read=acc.union / r,
                    independent_heads=acc.independent / r, union_vs_independent=acc.union / max(acc.independent, 1e-30))
    total = LayerUnion()
    for acc in layers.values():
        total.rows += acc.rows
        total.kept_per_head += acc.kept_per_head
        total.union += acc.union
        total.independent += acc.independent
    return dict(overall=ratios(total), per_layer={str(k): ratios(v) for k, v in sorted(layers.items())})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=0, help="score each window as a decode after this prompt (0: teacher-forced)")
    ap.add_argument("--methods", nargs="+", default=["sift:tau=0.875,warmup=128", "oracle:tau=0.875", "topk:k=0.125"])
    ap.add_argument("--out")
    args = ap.parse_args()
    try:  # bad specs fail before the model loads
        methods = [parse_method(m) for m in args.methods]
    except ValueError as err:
        ap.error(str(err))
    t0 = time.time()
    model, tok = load_model(args.model)
    cfg = model.config.get_text_config()
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    ids = token_windows(load_corpus("wikitext2").text, tok, args.seq_len, args.num_seqs)
    res = dict(model=args.model, seq_len=args.seq_len, prompt_len=args.prompt_len, num_seqs=args.num_seqs, query_heads=cfg.num_attention_heads,
               kv_heads=cfg.num_key_value_heads, group=groups, date=time.strftime("%Y-%m-%d"),
               torch=torch.__version__, methods={})
    for spec, method in zip(args.methods, methods):
        layers: dict[int, LayerUnion] = {}
        order = probe(method, layers)
        nll, sparsity = [], []
        for w in range(args.num_seqs):
            order.clear()
            with apply(model, method) as handle, torch.no_grad():
                if args.prompt_len:
                    nll.append(token_nll_after_prompt(model, ids[w], args.prompt_len, handle))
                    sparsity.append(handle.stats.realized_sparsity(min_step=args.prompt_len + 1))
                else:
                    model(ids[w : w + 1])
            print(f"  {spec}: window {w + 1}/{args.num_seqs} ({time.time() - t0:.0f} s)", flush=True)
        res["methods"][spec] = summary(layers)
        if args.prompt_len:
            res["methods"][spec].update(ppl=math.exp(float(torch.cat(nll).double().mean())),
                                        realized_sparsity=sum(sparsity) / len(sparsity))
    res["seconds"] = round(time.time() - t0, 1)
    scored = (f"the last {args.seq_len - args.prompt_len} scored as decode steps" if args.prompt_len
              else "teacher-forced")
    print(f"\n{args.model}: {cfg.num_attention_heads} query heads / {cfg.num_key_value_heads} KV heads (group {groups}), "
          f"{args.num_seqs} x {args.seq_len} WikiText-2 tokens, {scored}")
    decode = "| ppl | realized sparsity " if args.prompt_len else ""
    print(f"| method {decode}| kept per query head | V rows the group reads | independent heads would read | ratio |")
    print("|---|---|---|---|---|" + ("---|---|" if args.prompt_len else ""))
    for spec, m in res["methods"].items():
        o = m["overall"]
        if not o["rows"]:  # nothing approximated (Full): every key
            o.update(kept_per_head=1.0, v_rows_read=1.0, independent_heads=1.0, union_vs_independent=1.0)
        ppl = f"| {m['ppl']:.3f} | {m['realized_sparsity']:.4f} " if args.prompt_len else ""
        print(f"| {spec} {ppl}| {o['kept_per_head']:.4f} | {o['v_rows_read']:.4f} | {o['independent_heads']:.4f} | {o['union_vs_independent']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
