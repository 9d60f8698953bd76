"""Can a decode step's log-normaliser be predicted before its keys are read? Real models, CPU.

A one-pass sift step would have to filter keys before the row's normaliser is known:
``p > eta`` is ``s > log(eta) + logsumexp(s)``. This script tests two predictions of
``LSE_t`` on an embedded model over WikiText-2 (teacher-forced, so consecutive queries are a
real decode's), per (layer, query head, step) after a prompt of ``--prompt`` tokens:

- ``previous``: the previous step's ``LSE_{t-1}`` (same head, one key fewer);
- ``anchored``: this step's log-sum-exp over the first and the newest keys (``--anchor``; the
  attention sinks and recent tokens) plus the previous step's gap between the row's LSE and
  its anchor sum.

It reports the drift ``|LSE_t - prediction|`` in nats; for band half-widths ``delta``, the
share of keys within ``delta`` of the threshold (what an exact design would set aside for a
second look) and how often the drift fits in the band, per head and per KV group (a group's V
rows are read once for all its heads, so an exact one-pass design repairs a group only when
every head's drift fits; its band is the keys some head of the group has inside); and, filtering with each prediction's
threshold (``eta`` = the exact tau-quantile, so only the normaliser is predicted), the
realized sparsity, the attention output's error against full attention (float64), and the
share of keys decided unlike the exact filter. Sliding-window layers (Gemma-3) are masked as
the model masks them and also reported apart.

    .venv/bin/python benchmarks/studies/lse_drift.py --prompt 4096 --steps 64 --windows 2 --out lse.json
    .venv/bin/python benchmarks/studies/lse_drift.py --model gemma3-270m --prompt 2048 --steps 64 --windows 2  # after make gemma
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from siftattention.data import load_corpus, token_windows
from siftattention.models import DEFAULT_MODEL, load_model

RECORD: list = []
PROMPT = 0


def decode_scores(query, key, scaling, sliding_window, first: int) -> torch.Tensor:
    """Batch row 0's scaled float64 scores [Hq, rows, keys] of the query rows from ``first`` on, the layer's
    causal mask (and sliding window) as -inf."""
    G = query.shape[1] // key.shape[1]
    k = key[0].repeat_interleave(G, dim=0).double()
    s = torch.matmul(query[0, :, first:].double(), k.transpose(-1, -2)) * (
        scaling if scaling is not None else query.shape[-1] ** -0.5)
    rows = torch.arange(first, query.shape[2], device=s.device)[:, None]
    pos = torch.arange(key.shape[2], device=s.device)[None, :]
    allowed = pos <= rows
    if sliding_window:  # local layers (Gemma-3): key j is seen from query i when i - j < window
        allowed &= pos > rows - sliding_window
    return s.masked_fill(~allowed[None], float("-inf"))


def probe(module, query, key, value, attention_mask, scaling=None, **kw):
    """SDPA, recording each layer's scaled causal scores (rows of the measured steps) and values on the side."""
    G = query.shape[1] // key.shape[1]
    RECORD.append((decode_scores(query, key, scaling, kw.get("sliding_window"), PROMPT - 1),
                   value.repeat_interleave(G, dim=1)[0].double(), bool(kw.get("sliding_window"))))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)


def add_probe_args(ap: argparse.ArgumentParser, prompt: int, steps: int, windows: int) -> None:
    """The model and the WikiText-2 windows a probing study reads: a prompt, then the measured decode steps."""
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt", type=int, default=prompt)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--windows", type=int, default=windows)


def anchored_lse(s: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Log-sum-exp of each row over its first ``first`` and newest ``last`` keys (rows of growing length)."""
    n = PROMPT + torch.arange(s.shape[1])  # keys of each row
    pos = torch.arange(s.shape[-1])
    anchor = (pos[None, :] < first) | ((pos[None, :] < n[:, None]) & (pos[None, :] >= n[:, None] - last))
    return torch.logsumexp(s.masked_fill(~anchor[None], float("-inf")), dim=-1)


def probed_windows(model_name: str, name: str, probe_fn, n_tokens: int, windows: int):
    """The model with ``probe_fn`` as its attention (registered as ``name``) and ``windows`` WikiText-2 windows of
    ``n_tokens`` tokens."""
    model, tok = load_model(model_name)
    AttentionInterface.register(name, probe_fn)
    model.config._attn_implementation = name
    return model, token_windows(load_corpus("wikitext2").text, tok, n_tokens, windows)


def main():
    global PROMPT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_probe_args(ap, prompt=1024, steps=128, windows=2)
    ap.add_argument("--tau", type=float, default=0.875)
    ap.add_argument("--deltas", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    ap.add_argument("--anchor", type=int, nargs=2, default=[64, 256], metavar=("FIRST", "LAST"),
                    help="the anchored predictor's keys: the first FIRST and the newest LAST of each row")
    ap.add_argument("--out")
    args = ap.parse_args()
    PROMPT = args.prompt
    t0 = time.time()
    model, ids = probed_windows(args.model, "lse_probe", probe, args.prompt + args.steps, args.windows)
    predictors = ("previous", "anchored")
    filters = ("exact",) + predictors
    drift = {k: [] for k in predictors}
    group_drift = {k: [] for k in predictors}  # the largest drift over the heads of a KV group
    cfg = model.config.get_text_config()
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    inband = {d: [] for d in args.deltas}
    inband_group = {d: [] for d in args.deltas}
    err = {f: [] for f in filters}
    err_global = {f: [] for f in filters}  # full-attention layers only (the others see a sliding window)
    kept = {f: [] for f in filters}
    flipped = {k: [] for k in predictors}
    for w in range(args.windows):
        RECORD.clear()
        with torch.no_grad():
            model(ids[w : w + 1])
        for s, v, local in RECORD:  # s [Hq, steps + 1, keys]: rows of steps P-1 .. P+steps-1; v [Hq, keys, D]
            lse = torch.logsumexp(s, dim=-1)
            a = anchored_lse(s, *args.anchor)
            pred = {"previous": lse[:, :-1], "anchored": a[:, 1:] + lse[:, :-1] - a[:, :-1]}
            for k in predictors:
                d = (lse[:, 1:] - pred[k]).abs()
                drift[k].append(d.flatten())
                group_drift[k].append(d.view(-1, G, d.shape[-1]).amax(1).flatten())
            for j in range(1, s.shape[1]):
                n = args.prompt + j
                valid = torch.isfinite(s[0, j, :n])  # the layer's mask is the same for every head
                row, vals = s[:, j, :n][:, valid], v[:, :n][:, valid]
                p = torch.softmax(row, dim=-1)
                log_theta = torch.log(torch.quantile(p, args.tau, dim=-1))  # the oracle's eta, exact
                thr = {"exact": log_theta + lse[:, j]}
                for k in predictors:
                    thr[k] = log_theta + pred[k][:, j - 1]
                for dl in args.deltas:
                    near = (row - thr["exact"][:, None]).abs() <= dl
                    inband[dl].append(near.double().mean(-1))
                    inband_group[dl].append(near.view(-1, G, near.shape[-1]).any(1).double().mean(-1))
                full = torch.bmm(p[:, None], vals)[:, 0]
                keep_exact = row > thr["exact"][:, None]
                for f in filters:
                    keep = row > thr[f][:, None]
                    keep.scatter_(-1, row.argmax(-1, keepdim=True), True)  # the row maximum is always kept
                    out = torch.bmm((p * keep)[:, None], vals)[:, 0]
                    err[f].append((out - full).norm(dim=-1) / full.norm(dim=-1))
                    if not local:
                        err_global[f].append(err[f][-1])
                    kept[f].append(keep.double().mean(-1))
                    if f != "exact":
                        flipped[f].append((keep != keep_exact).double().mean(-1))
    qs = [0.5, 0.9, 0.99]
    drift = {k: torch.cat(d) for k, d in drift.items()}
    group_drift = {k: torch.cat(d) for k, d in group_drift.items()}
    res = dict(model=args.model, prompt=args.prompt, steps=args.steps, windows=args.windows, tau=args.tau,
               anchor=args.anchor, rows=int(drift["previous"].numel()), date=time.strftime("%Y-%m-%d"),
               drift={k: dict({f"p{int(q * 100)}": float(torch.quantile(d, q)) for q in qs}, max=float(d.max()))
                      for k, d in drift.items()},
               # the rows whose drift fits inside the band
               bands=[dict(delta=dl, keys_in_band=float(torch.cat(inband[dl]).mean()),
                           key_rows_in_group_band=float(torch.cat(inband_group[dl]).mean()),
                           **{f"hit_{k}": float((d <= dl).double().mean()) for k, d in drift.items()},
                           **{f"group_hit_{k}": float((d <= dl).double().mean()) for k, d in group_drift.items()})
                      for dl in args.deltas],
               query_heads_per_group=G,
               filters={f: dict(realized_sparsity=1 - float(torch.cat(kept[f]).mean()),
                                output_rel_err=float(torch.cat(err[f]).mean()),
                                output_rel_err_full_attention_layers=float(torch.cat(err_global[f]).mean()),
                                keys_flipped=float(torch.cat(flipped[f]).mean()) if f != "exact" else 0.0)
                        for f in filters})
    print(f"{args.model}, prompt {args.prompt}, {args.steps} steps x {args.windows} windows, {res['rows']} "
          f"(layer, head, step) rows, tau {args.tau}, anchors: first {args.anchor[0]} + newest {args.anchor[1]} keys, "
          f"{time.time() - t0:.0f}s")
    print("\n| predictor of LSE_t | drift p50 | p90 | p99 | max (nats) |\n|---|---|---|---|---|")
    for k in predictors:
        d = res["drift"][k]
        print(f"| {k} | {d['p50']:.3f} | {d['p90']:.3f} | {d['p99']:.3f} | {d['max']:.3f} |")
    print(f"\n| band half-width (nats) | keys in the band: a head / some head of a group of {G} | drift inside, previous: "
          "a head / every head of a group | drift inside, anchored: a head / every head of a group |\n|---|---|---|---|")
    for b in res["bands"]:
        print(f"| {b['delta']} | {b['keys_in_band']:.4f} / {b['key_rows_in_group_band']:.4f} | {b['hit_previous']:.4f} / "
              f"{b['group_hit_previous']:.4f} | {b['hit_anchored']:.4f} / {b['group_hit_anchored']:.4f} |")
    print("\n| filter threshold from | realized sparsity | output rel. error vs full attention (all layers; "
          "full-attention layers) | keys decided unlike exact |\n|---|---|---|---|")
    for f in filters:
        r = res["filters"][f]
        print(f"| {f} | {r['realized_sparsity']:.4f} | {r['output_rel_err']:.4f}; "
              f"{r['output_rel_err_full_attention_layers']:.4f} | {r['keys_flipped']:.4f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
