"""Keys as two byte planes instead of a 16-bit cache plus an int8 copy: candidates, bytes and score error on real keys, CPU.

The key-bound step (``kernels/keybound.py``) keeps an int8 copy of the keys beside the 16-bit cache (+25.8%
of a 16-bit KV cache at D = 128). ``kernels/key_planes.py`` stores the keys as 16-bit fixed point instead,
its high byte the scan (+0.8%). This script replays a ``sift capture`` file: per layer and decode step the
keys are cast to ``--dtype`` (bf16: as the GPU caches), eta is the exact tau-quantile of each head's
probabilities on those keys, and for the int8 copy (per row, per channel) and the planes (per row, per channel;
channel ranges from the step's whole cache, as ``keybound_bound.py``'s ``channel``) it reports:

- candidates (key rows read in full) and kept V rows (union over a KV group), as fractions of the key rows;
- the step's bytes against a dense 16-bit step's K + V (``keybound_bytes``; the planes' candidates read their
  low plane only, ``planes=True``; ``both_planes``: reading both) and the exact step's (all K + kept V);
- epsilon and the heads whose kept count differs from the float64 rule's on the step's own keys (the 16-bit
  keys for the copy, the stored keys for the planes) beyond their keys within epsilon of the threshold;
- for the planes: the stored keys against the 16-bit keys (elements that differ; scores ``|s(stored) -
  s(16-bit)|`` in logits, float64, every query head and key: median, p99, max) and the keys whose kept
  decision the float64 rule makes otherwise on the stored keys than on the 16-bit keys (same eta), and
  the step's kept sets against the 16-bit keys' rule;
- as a yardstick, the same two of the 16-bit keys against the captured float32 keys.

    PYTHONPATH=. .venv/bin/python benchmarks/studies/key_planes.py --captured cap_qwen_4096.pt --out planes.json

(``sift capture --model qwen2.5-1.5b --seq-len 4096 --positions 1023,2047,3071,4095 --device cpu --dtype
float32 --out cap_qwen_4096.pt``.)
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from keybound_bound import DTYPES, rounded, to_json

from siftattention.capture import CapturedAttention
from siftattention.kernels.key_planes import key_bytes_per_row, keybound_step_planes, quantize_planes, reconstruct_keys
from siftattention.kernels.keybound import keybound_bytes, keybound_step_torch, quantize_keys

FORMS = ("int8_row", "int8_channel", "planes_row", "planes_channel")


def scores64(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    s = torch.matmul(q.double().reshape(B, Hkv, Hq // Hkv, D), k.double().transpose(-1, -2))
    return s.reshape(B, Hq, -1) * scale


def rule64(s: torch.Tensor, eta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 rule: kept = s > logsumexp(s) + log(eta), or the first maximum; and T."""
    t = torch.logsumexp(s, -1) + torch.log(eta.double())
    keep = s > t[..., None]
    keep.scatter_(-1, s.argmax(-1, keepdim=True), True)
    return keep, t


def one_step(q: torch.Tensor, k32: torch.Tensor, v: torch.Tensor, scale: float, tau: float, dt: torch.dtype,
             errs: dict[str, list[torch.Tensor]]) -> dict:
    B, Hq, D = q.shape
    Hkv, S = k32.shape[1], k32.shape[2]
    G = Hq // Hkv
    k = k32.to(dt)
    s = scores64(q, k, scale)
    eta = torch.quantile(torch.softmax(s, -1), tau, dim=-1)
    keep, t = rule64(s, eta)
    n_union = float(keep.reshape(B, Hkv, G, S).any(2).sum())
    elem = k.element_size()
    rows = B * Hkv * S
    exact_bytes = (rows * D * elem + n_union * D * elem) / (2 * rows * D * elem)
    row = dict(S=S, tau=tau, kept_union=n_union / rows, exact_bytes_vs_dense=exact_bytes)
    # The yardstick: the 16-bit keys against the float32 keys they were cast from.
    s32 = scores64(q, k32, scale)
    errs["bf16_vs_fp32"].append((s - s32).abs().flatten().float())
    keep32, _ = rule64(s32, eta)
    row["yardstick"] = dict(elements_differ=float((k.double() != k32.double()).double().mean()),
                            flips=int((keep32 != keep).sum()), keys=int(keep.numel()))
    for name in FORMS:
        channel = True if name.endswith("channel") else None
        planes = name.startswith("planes")
        if planes:
            kp = quantize_planes(k, channel)
            r = keybound_step_planes(q, kp, v, eta.float(), scale, None, False)
            stored = reconstruct_keys(kp, torch.float64)
            s_own = scores64(q, stored, scale)
        else:
            kq = quantize_keys(k, channel)
            r = keybound_step_torch(q, k, v, kq, eta.float(), scale, None, False)
            s_own = s
        keep_own, t_own = rule64(s_own, eta)
        n_cand = float(r["candidates"].sum())
        nb = keybound_bytes(B, Hkv, S, D, elem, n_cand, n_union, per_channel=channel is not None, planes=planes)
        off = (r["kept"] - keep_own.sum(-1)).abs()
        # Keys the step may decide either way: within epsilon of T, or within float32's rounding of T (a few ulps:
        # Qwen's layer 0 has scores of thousands of logits, where an ulp is 2^-11 and more).
        tol = r["epsilon"].double() + 1e-4 + 2.0**-21 * t_own.abs()
        near = ((s_own - t_own[..., None]).abs() <= tol[..., None]).sum(-1)
        res = dict(candidates=n_cand / rows, bytes_vs_dense=nb["vs_dense"], bytes_vs_exact=nb["vs_dense"] / exact_bytes,
                   eps_max=float(r["epsilon"].max()), kept_heads_off=int((off > 0).sum()),
                   kept_heads_off_beyond_eps=int((off > near).sum()),
                   step_flips=int((r["keep"] != keep).sum()))  # the step's kept sets against the 16-bit keys' rule
        if planes:
            both = keybound_bytes(B, Hkv, S, D, elem, n_cand, n_union, per_channel=channel is not None)
            d = (s_own - s).abs().flatten().float()
            errs[name].append(d)
            res.update(both_planes_bytes_vs_dense=both["vs_dense"],
                       elements_differ=float((stored != k.double()).double().mean()),
                       score_err_max=float(d.max()),
                       rule_flips=int((keep_own != keep).sum()),  # float64 rule: stored keys against 16-bit keys
                       keys=int(keep.numel()))
        row[name] = res
    return row


def quantiles(x: list[torch.Tensor]) -> dict[str, float]:
    """Median, p99 and max of the concatenated values (p99 and the median from a sorted copy: no size limit)."""
    v = torch.sort(torch.cat(x)).values
    at = lambda p: float(v[min(len(v) - 1, int(p * (len(v) - 1)))])  # noqa: E731
    return dict(median=at(0.5), p99=at(0.99), max=float(v[-1]), n=len(v))


def summarise(rows: list[dict], errs: dict[str, list[torch.Tensor]]) -> dict:
    """Means of the fractions over the rows, sums of the counts, and the score errors' quantiles."""
    mean = lambda f: sum(f(r) for r in rows) / len(rows)  # noqa: E731
    total = lambda f: sum(f(r) for r in rows)  # noqa: E731
    out = dict(kept_union=mean(lambda r: r["kept_union"]), exact_bytes_vs_dense=mean(lambda r: r["exact_bytes_vs_dense"]),
               yardstick=dict(elements_differ=mean(lambda r: r["yardstick"]["elements_differ"]),
                              flips=total(lambda r: r["yardstick"]["flips"]), keys=total(lambda r: r["yardstick"]["keys"]),
                              score_err=quantiles(errs["bf16_vs_fp32"])))
    for name in FORMS:
        f = dict(candidates=mean(lambda r: r[name]["candidates"]), bytes_vs_dense=mean(lambda r: r[name]["bytes_vs_dense"]),
                 bytes_vs_exact=mean(lambda r: r[name]["bytes_vs_exact"]), eps_max=max(r[name]["eps_max"] for r in rows),
                 kept_heads_off_beyond_eps=total(lambda r: r[name]["kept_heads_off_beyond_eps"]),
                 step_flips=total(lambda r: r[name]["step_flips"]))
        if name.startswith("planes"):
            f.update(both_planes_bytes_vs_dense=mean(lambda r: r[name]["both_planes_bytes_vs_dense"]),
                     elements_differ=mean(lambda r: r[name]["elements_differ"]), score_err=quantiles(errs[name]),
                     rule_flips=total(lambda r: r[name]["rule_flips"]),
                     keys=total(lambda r: r[name]["keys"]))
        out[name] = f
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--captured", metavar="FILE", required=True, help="a `sift capture` file (float32)")
    ap.add_argument("--layers", default="all", help="comma-separated layers of the capture, or all")
    ap.add_argument("--positions", default=None, help="comma-separated query positions (default: the capture's)")
    ap.add_argument("--tau", type=float, nargs="+", default=[0.875, 0.95])
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.time()
    torch.set_grad_enabled(False)
    cap = CapturedAttention.load(args.captured)
    layers = cap.layers if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    positions = cap.positions if args.positions is None else [int(x) for x in args.positions.split(",")]
    dt = DTYPES[args.dtype]
    B, Hq, _, D = cap.query[layers[0]].shape
    res = dict(model=cap.model, source=cap.source, positions=positions, layers=layers, dtype=args.dtype, tau=args.tau,
               machine=f"CPU ({platform.processor() or platform.machine()}), 2 shared cores of a VM", torch=torch.__version__,
               date=time.strftime("%Y-%m-%d"), bytes_per_row=key_bytes_per_row(D, DTYPES[args.dtype].itemsize),
               per_layer={})
    rows_all: list[dict] = []
    errs_all = {tau: {n: [] for n in ("bf16_vs_fp32",) + FORMS} for tau in args.tau}
    for layer in layers:
        errs = {tau: {n: [] for n in ("bf16_vs_fp32",) + FORMS} for tau in args.tau}
        steps = []
        for i in (i for i, p in enumerate(cap.positions) if p in positions):
            q, k, v = cap.step(layer, i)
            for tau in args.tau:
                steps.append(dict(one_step(q.to(dt), k.float(), v.to(dt), cap.scaling, tau, dt, errs[tau]), layer=layer))
        for tau in args.tau:
            for n, x in errs[tau].items():
                errs_all[tau][n] += x
        res["per_layer"][str(layer)] = {str(tau): summarise([r for r in steps if r["tau"] == tau], errs[tau])
                                        for tau in args.tau}
        rows_all += steps
        s = res["per_layer"][str(layer)][str(args.tau[0])]
        print(f"layer {layer}: candidates " + " / ".join(f"{s[n]['candidates']:.3f}" for n in FORMS)
              + f", score error p99 {s['planes_row']['score_err']['p99']:.2e} / {s['planes_channel']['score_err']['p99']:.2e}"
              f" ({time.time() - t0:.0f} s)", flush=True)
    res["summary"] = {str(tau): summarise([r for r in rows_all if r["tau"] == tau], errs_all[tau]) for tau in args.tau}
    res["seconds"] = round(time.time() - t0, 1)
    print(f"\n{cap.model}, layers {layers}, positions {positions}, {args.dtype} keys; bytes a key row with its value row: "
          + ", ".join(f"{k} {v}" for k, v in res["bytes_per_row"].items()))
    print("| layer | tau | V rows kept (union) | candidates: " + " / ".join(FORMS) + " | bytes vs dense: exact step / "
          + " / ".join(FORMS) + " | score error, planes row / channel: median, p99, max | rule flips: row / channel (keys) |")
    print("|---|---|---|---|---|---|---|")
    for layer, per in list(res["per_layer"].items()) + [("all", res["summary"])]:
        for tau in args.tau:
            s = per[str(tau)]
            err = " / ".join(", ".join(f"{s[n]['score_err'][x]:.1e}" for x in ("median", "p99", "max"))
                             for n in ("planes_row", "planes_channel"))
            print(f"| {layer} | {tau} | {s['kept_union']:.3f} | " + " / ".join(f"{s[n]['candidates']:.3f}" for n in FORMS)
                  + f" | {s['exact_bytes_vs_dense']:.3f} / " + " / ".join(f"{s[n]['bytes_vs_dense']:.3f}" for n in FORMS)
                  + f" | {err} | {s['planes_row']['rule_flips']} / {s['planes_channel']['rule_flips']} "
                  f"({s['planes_row']['keys']}) |")
    for tau in args.tau:
        s = res["summary"][str(tau)]
        y = s["yardstick"]
        print(f"tau {tau}: step kept sets against the 16-bit keys' rule, keys off: " + " / ".join(
              f"{n} {s[n]['step_flips']}" for n in FORMS) + f"; heads off beyond epsilon: " + " / ".join(
              f"{s[n]['kept_heads_off_beyond_eps']}" for n in FORMS) + f"; yardstick (16-bit against float32 keys): {y['flips']} keys"
              f" off, score error median {y['score_err']['median']:.1e}, p99 {y['score_err']['p99']:.1e}, max "
              f"{y['score_err']['max']:.1e}; elements differing: 16-bit {y['elements_differ']:.3f}, planes row "
              f"{s['planes_row']['elements_differ']:.3f} / channel {s['planes_channel']['elements_differ']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(to_json(rounded(res)))


if __name__ == "__main__":
    main()
