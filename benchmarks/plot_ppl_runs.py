"""One perplexity-against-sparsity plot and table from several `sift ppl` runs on the same windows.

    python benchmarks/plot_ppl_runs.py runs/a/results.json runs/b/results.json --out fig.png --title "..."

Runs must share the model, data, window length and count (checked); a method given in more
than one run is taken from the first. Prints the merged rows as a markdown table of perplexity
and realized sparsity over all steps (the runs' post-warmup columns depend on each run's
largest warmup, so they are left out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from siftattention.report import method_family, plot_ppl_vs_sparsity


def merge(paths: list[Path]) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in paths]
    key = ("model", "dataset", "data_source", "seq_len", "num_seqs")
    for path, run in zip(paths[1:], runs[1:]):
        if any(run[k] != runs[0][k] for k in key):
            raise SystemExit(f"{path}: not the windows of {paths[0]} ({', '.join(f'{k}={run[k]}' for k in key)})")
    rows, seen = [], set()
    for run in runs:
        for row in run["results"]:
            if row["method"] not in seen:
                seen.add(row["method"])
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="perplexity against realized sparsity")
    args = parser.parse_args()
    rows = merge(args.results)
    plot_ppl_vs_sparsity(rows, args.out, args.title)
    print("| method | ppl | realized sparsity (all steps) |\n|---|---|---|")
    for r in sorted(rows, key=lambda r: (method_family(r["method"]), r["realized_sparsity"])):
        print(f"| {r['method']} | {r['ppl']:.3f} | {r['realized_sparsity']:.3f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
