"""Could the filter pass skip whole blocks of keys? Real models, teacher-forced, CPU.

The exact step's filter pass scans every key's float32 scores (all heads of a KV group) to find the
rows some head keeps; on the GPU that scan costs about as much as gathering the kept V rows
(docs/kernels.md, "What limits speed on real models"). If the scores pass also stored, per block of
``b`` keys, each head's largest score, the filter could first read those maxima and scan only the
blocks where some head's maximum passes its threshold. This pays only if kept keys cluster in
position: with keys kept independently at the group's union fraction u, a block holds a kept key with
probability 1 - (1 - u)^b, nearly 1 for b >= 16 at u = 0.3.

For each layer, KV group and decode step after a prompt (``--prompt``), with each head's threshold at
its exact tau-quantile (the oracle's eta, as ``lse_drift.py``), this reports the union u of kept rows,
the fraction of blocks holding a kept row, what independent positions would give, and the scan's work
against today's (blocks scanned plus the per-block maxima read).

    .venv/bin/python benchmarks/studies/block_skip.py --model qwen2.5-1.5b --prompt 4096 --steps 32 --out skip_qwen.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from lse_drift import add_probe_args, decode_scores, probed_windows  # benchmarks/studies, this script's folder
from transformers.integrations.sdpa_attention import sdpa_attention_forward

RECORD: list = []
PROMPT = 0


def probe(module, query, key, value, attention_mask, scaling=None, **kw):
    """SDPA, recording each layer's scaled scores of the measured decode rows (float64) on the side."""
    RECORD.append((decode_scores(query, key, scaling, kw.get("sliding_window"), PROMPT - 1),
                   query.shape[1] // key.shape[1], bool(kw.get("sliding_window"))))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)


def main() -> None:
    global PROMPT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_probe_args(ap, prompt=4096, steps=32, windows=1)
    ap.add_argument("--taus", type=float, nargs="+", default=[0.875, 0.95])
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--out")
    args = ap.parse_args()
    PROMPT = args.prompt
    t0 = time.time()
    model, ids = probed_windows(args.model, "block_probe", probe, args.prompt + args.steps, args.windows)
    acc = {(t, b): dict(union=[], hit=[], indep=[]) for t in args.taus for b in args.blocks}
    for w in range(args.windows):
        RECORD.clear()
        with torch.no_grad():
            model(ids[w: w + 1])
        for s, G, local in RECORD:  # s [Hq, steps + 1, keys]
            if local:
                continue  # sliding-window layers: a short row, no long scan to skip
            for j in range(1, s.shape[1]):
                n = args.prompt + j
                row = s[:, j, :n]
                p = torch.softmax(row, dim=-1)
                for t in args.taus:
                    eta = torch.quantile(p, t, dim=-1, keepdim=True)
                    keep = p > eta
                    keep.scatter_(-1, row.argmax(-1, keepdim=True), True)
                    union = keep.view(-1, G, n).any(1)  # [Hkv, n]
                    u = union.double().mean(-1)
                    for b in args.blocks:
                        nb = n // b  # whole blocks only
                        blk = union[:, : nb * b].view(union.shape[0], nb, b).any(-1).double().mean(-1)
                        acc[(t, b)]["union"].append(u)
                        acc[(t, b)]["hit"].append(blk)
                        acc[(t, b)]["indep"].append(1 - (1 - u) ** b)
    res = dict(model=args.model, prompt=args.prompt, steps=args.steps, windows=args.windows, date=time.strftime("%Y-%m-%d"),
               rows=[])
    print(f"{args.model}, prompt {args.prompt}, {args.steps} steps x {args.windows} windows, {time.time() - t0:.0f}s")
    print("\n| tau | block keys | V rows kept (union) | blocks holding a kept row | independent positions | scan work vs today |"
          "\n|---|---|---|---|---|---|")
    for (t, b), a in acc.items():
        u, hit, ind = (float(torch.cat(a[k]).mean()) for k in ("union", "hit", "indep"))
        r = dict(tau=t, block=b, union=u, blocks_hit=hit, blocks_hit_independent=ind, scan_work=hit + 1 / b)
        res["rows"].append(r)
        print(f"| {t} | {b} | {u:.3f} | {hit:.3f} | {ind:.3f} | {r['scan_work']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
