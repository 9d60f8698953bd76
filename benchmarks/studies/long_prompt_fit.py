"""How well Sift's power law predicts thresholds after a long prompt (CPU, embedded model).

Decode mode fits theta_S ~ alpha * S^-beta over the warmup steps S = P+1..P+w. After a
prompt of P tokens that is a narrow range of log S (w / P), so the fitted exponent rests on
step-to-step noise. This script measures it teacher-forced on one WikiText-2 window of
P + T tokens (the teacher-forced and token-by-token passes give the same quantiles,
docs/design.md): per (layer, head) it takes the exact tau-quantiles of rows P+1..P+T, fits
the warmup rows, predicts the later rows and reports the error of the predicted threshold
and the sparsity it realizes, against fits over wider ranges.

    .venv/bin/python benchmarks/studies/long_prompt_fit.py --prompt 2048 --tail 512 --out long_prompt_fit.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from siftattention.data import load_corpus, token_windows
from siftattention.models import load_model
from siftattention.powerlaw import fit_power_law, masked_quantile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt length P")
    ap.add_argument("--tail", type=int, default=512, help="rows after the prompt, T")
    ap.add_argument("--tau", type=float, default=0.875)
    ap.add_argument("--warmups", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if max(args.warmups) >= args.tail:
        raise SystemExit(f"long_prompt_fit: every warmup must be shorter than --tail ({args.tail})")
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    model.set_attn_implementation("eager")  # the attention modules then return their probabilities
    P, T, tau = args.prompt, args.tail, args.tau
    ids = token_windows(load_corpus("wikitext2").text, tok, P + T, 1)
    n = P + T
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    steps = torch.arange(P + 1, P + T + 1, dtype=torch.float64)  # S of rows P..P+T-1
    head_rows: dict[str, list[dict]] = {f"w={w}": [] for w in args.warmups}
    head_rows["whole tail"] = []
    head_rows["S=1..64 (start of text)"] = []

    def record(name: str, fit, rows: torch.Tensor, valid: torch.Tensor, theta: torch.Tensor, first: int) -> None:
        # Rows after the fitted range: predicted threshold against the exact quantile, and
        # the share of valid keys the prediction prunes (the realized sparsity).
        eta = fit.predict(steps[first:]).float()  # [H, rows]
        err = (eta.double().log() - theta[:, first:].double().clamp(min=1e-30).log()).abs()
        pruned = ((rows[:, first:] < eta[..., None]) & valid[first:]).sum(-1) / valid[first:].sum(-1)
        for h in range(theta.shape[0]):
            head_rows[name].append(dict(beta=float(fit.beta[h]), log_err=float(err[h].median()),
                                        sparsity=float(pruned[h].mean())))

    def hook(module, inputs, output):
        probs = output[1][0].float()  # [H, n, n]
        rows, valid = probs[:, P:], causal[P:]
        theta = masked_quantile(rows, valid.expand_as(rows), tau)  # [H, T]
        for w in args.warmups:
            record(f"w={w}", fit_power_law(steps[:w], theta[:, :w]), rows, valid, theta, w)
        record("whole tail", fit_power_law(steps, theta), rows, valid, theta, 0)
        head = probs[:, :64]
        theta0 = masked_quantile(head, causal[:64].expand_as(head), tau)
        fit0 = fit_power_law(torch.arange(1, 65, dtype=torch.float64), theta0)
        record("S=1..64 (start of text)", fit0, rows, valid, theta, 0)
        return output

    handles = [layer.self_attn.register_forward_hook(hook) for layer in model.model.layers]
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    summary = {}
    for name, rows in head_rows.items():
        betas = sorted(r["beta"] for r in rows)
        q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]
        errs = sorted(r["log_err"] for r in rows)
        summary[name] = dict(
            heads=len(rows),
            beta_p10=q(betas, 0.1), beta_median=q(betas, 0.5), beta_p90=q(betas, 0.9),
            median_abs_log_error=q(errs, 0.5), p90_abs_log_error=q(errs, 0.9),
            realized_sparsity=sum(r["sparsity"] for r in rows) / len(rows),
            heads_pruning_over_99pct=sum(r["sparsity"] > 0.99 for r in rows) / len(rows),
        )
    result = dict(model=args.model, prompt=P, tail=T, tau=tau, seconds=time.perf_counter() - start,
                  log_range={f"w={w}": math.log((P + w) / (P + 1)) for w in args.warmups}, summary=summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{args.model}, prompt {P}, rows {P + 1}..{P + T}, tau {tau}: threshold predicted from each fit")
    print("fit over | beta p10 / median / p90 | |log(eta / theta)| median / p90 | realized sparsity | heads > 0.99")
    for name, s in summary.items():
        print(f"{name} | {s['beta_p10']:.2f} / {s['beta_median']:.2f} / {s['beta_p90']:.2f} | "
              f"{s['median_abs_log_error']:.2f} / {s['p90_abs_log_error']:.2f} | {s['realized_sparsity']:.3f} | "
              f"{s['heads_pruning_over_99pct']:.2f}")


if __name__ == "__main__":
    main()
