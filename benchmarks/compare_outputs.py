"""Agreement between two methods' outputs of one `sift eval` run (same prompts, same settings).

For each pair of per-sample JSONL files (OUT/TASK/<method>.jsonl), the second against the first:
the mean of the eval's own agreement measures (identical outputs, common prefix, ROUGE-L) and the
share of prompts with the same headline verdict. Writes JSON with the run's summary.json beside it.

    python3 benchmarks/compare_outputs.py runs/eval/ifeval A.jsonl:B.jsonl [C.jsonl:D.jsonl ...] --out cmp.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from siftattention.eval.tasks.base import agreement


def load(path: Path) -> dict:
    return {r["id"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}


def compare(a: dict, b: dict, headline: str) -> dict:
    """Mean agreement of b's tokens with a's (a as the reference) and the share of equal verdicts."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise SystemExit("compare_outputs: the two files share no prompt")
    agree = [agreement(a[i]["tokens"], b[i]["tokens"]) for i in ids]
    mean = {key: sum(float(x[key]) for x in agree) / len(ids) for key in agree[0]}
    verdict = sum(a[i]["scores"].get(headline) == b[i]["scores"].get(headline) for i in ids)
    return dict(prompts=len(ids), **mean, same_verdict=verdict / len(ids), headline=headline)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path, help="OUT/TASK of a sift eval run")
    ap.add_argument("pairs", nargs="+", help="A.jsonl:B.jsonl, file names inside run_dir")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    summary = json.loads((args.run_dir / "summary.json").read_text())
    headline = summary["methods"][0]["headline"]
    rows = []
    for pair in args.pairs:
        fa, fb = pair.split(":")
        res = compare(load(args.run_dir / fa), load(args.run_dir / fb), headline)
        rows.append(dict(a=fa, b=fb, **res))
        print(f"{fa} vs {fb} ({res['prompts']} prompts): identical {res['identical']:.3f}, common prefix "
              f"{res['lcp_fraction']:.3f}, ROUGE-L {res['rouge_l']:.3f}, same {headline} {res['same_verdict']:.3f}")
    args.out.write_text(json.dumps(dict(summary=summary, pairs=rows), indent=1))


if __name__ == "__main__":
    main()
