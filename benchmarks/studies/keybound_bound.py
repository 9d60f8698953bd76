"""How many key rows must the key-bound step read in full? Per-row against per-channel int8 scales, real keys, CPU.

The key-bound step (``kernels/keybound.py``) bounds each score from an int8 copy of the keys and reads
a key row in full only where the bound cannot drop it (a *candidate*). With one scale per row every
channel's error is as large as the row's largest channel's; with per-channel scales and offsets (fixed
by the prompt) and a factor per row it follows each channel's own spread. This script captures a model's
post-RoPE queries and keys on WikiText-2 (``siftattention.capture``), then per layer and query position,
at each target sparsity ``tau`` with the exact threshold (eta = the tau-quantile of each head's
probabilities):

- the channel spread: each KV head's largest channel ``max |k|`` over its median channel's, and the same
  of the half-widths of the channels' ranges (what is left once each channel's midpoint is taken off);
- the V rows kept (union over the query heads of a KV group) and the candidate key rows of the torch
  reference (``keybound_step_torch``) with: per-row scales (``row``); per-channel scales without offsets
  (``scale_only``, each channel's max ``|k|``); per-channel scales and offsets from the whole cache
  (``channel``: the prompt is the cache); and from the first ``--prompt`` of the step's keys only
  (``channel_prompt``: the later keys quantised as decode keys are, with a larger row factor where they
  leave those ranges; 0.75 leaves a quarter of the cache to decode, far more than a long prompt does);
- the bytes of each against a dense step's K + V (``keybound_bytes``), and the exact step's (K + kept V);
- each one's epsilon (nats) and the heads whose kept count differs from the float64 rule's, in all and
  by more than their keys within epsilon of the threshold (which the step may decide either way).

Keys are cast to ``--dtype`` (bf16: as the GPU caches) before they are quantised and scored.

    PYTHONPATH=. .venv/bin/python benchmarks/studies/keybound_bound.py --model qwen2.5-1.5b --layers all --out kb_qwen.json
    PYTHONPATH=. .venv/bin/python benchmarks/studies/keybound_bound.py --model smollm2-135m --layers all --out kb_smollm2.json

The results in ``benchmarks/results/keybound_bound_*_cpu.json`` replayed captures (the same float32 tensors):

    sift capture --model qwen2.5-1.5b --seq-len 4096 --positions 1023,2047,3071,4095 --device cpu --dtype float32 --out q.pt
    PYTHONPATH=. .venv/bin/python benchmarks/studies/keybound_bound.py --captured q.pt --layers all --out kb_qwen.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from siftattention.capture import CapturedAttention, capture_attention
from siftattention.kernels.keybound import CHANNEL_FLOOR, channel_ranges, keybound_bytes, keybound_step_torch, quantize_keys

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def capture(model_name: str, seq_len: int, layers: list[int], positions: list[int]) -> CapturedAttention:
    from siftattention.data import load_corpus, token_windows
    from siftattention.models import load_model

    model, tok = load_model(model_name)
    ids = token_windows(load_corpus("wikitext2").text, tok, seq_len, 1)
    cap = capture_attention(model, ids, layers=layers, positions=positions, source=f"wikitext2, first {seq_len} tokens")
    cap.model = model_name
    return cap


def channel_spread(k: torch.Tensor) -> dict[str, list[float]]:
    """Per KV head: the largest channel's max |k| over the median channel's, and the same of the half-widths."""
    kd = k.double()[0]
    m = kd.abs().amax(1)  # [Hkv, D]
    half = (kd.amax(1) - kd.amin(1)) / 2
    ratio = lambda x: (x.amax(-1) / x.median(-1).values.clamp_min(1e-30)).tolist()  # noqa: E731
    return dict(abs=ratio(m), half_width=ratio(half), largest_abs=m.amax(-1).tolist(), largest_half=half.amax(-1).tolist())


def scale_only(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel scales without offsets: each channel's max |k| over the largest channel's."""
    m = k.float().abs().amax(2)
    c = (m / m.amax(-1, keepdim=True).clamp_min(1e-30)).clamp_min(CHANNEL_FLOOR)
    return c, torch.zeros_like(c)


def one_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tau: float, prompt: float) -> dict:
    """Kept union, candidates and bytes of the per-row and per-channel key copies at one decode step."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    s = torch.matmul(q.double().reshape(B, Hkv, G, D), k.double().transpose(-1, -2)).reshape(B, Hq, S) * scale
    p = torch.softmax(s, -1)
    eta = torch.quantile(p, tau, dim=-1)
    t = torch.logsumexp(s, -1, keepdim=True) + torch.log(eta)[..., None]
    keep = (s > t)
    keep.scatter_(-1, s.argmax(-1, keepdim=True), True)
    union = keep.reshape(B, Hkv, G, S).any(2)
    n_union = float(union.sum())
    elem = k.element_size()
    exact_bytes = (B * Hkv * S * D * elem + n_union * D * elem) / (2 * B * Hkv * S * D * elem)
    copies = {
        "row": quantize_keys(k),
        "scale_only": quantize_keys(k, scale_only(k)),
        "channel": quantize_keys(k, True),
        "channel_prompt": quantize_keys(k, channel_ranges(k[:, :, : max(1, round(prompt * S))])),
    }
    row = dict(S=S, tau=tau, kept_per_head=float(keep.double().mean()), kept_union=n_union / (B * Hkv * S),
               exact_bytes_vs_dense=exact_bytes)
    for name, keys in copies.items():
        r = keybound_step_torch(q, k, v, keys, eta.float(), scale, None, False)
        n_cand = float(r["candidates"].sum())
        nbytes = keybound_bytes(B, Hkv, S, D, elem, n_cand, n_union, per_channel=keys.channel is not None)
        off = (r["kept"] - keep.sum(-1)).abs()
        near = ((s - t).abs() <= r["epsilon"].double()[..., None] + 1e-4).sum(-1)  # keys epsilon may decide
        row[name] = dict(candidates=n_cand / (B * Hkv * S), bytes_vs_dense=nbytes["vs_dense"],
                         eps_max=float(r["epsilon"].max()), kept_heads_off=int((off > 0).sum()),
                         kept_heads_off_beyond_eps=int((off > near).sum()))
    return row


def rounded(x: object) -> object:
    """``x`` with every float to 4 significant digits (the JSON stays small)."""
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def to_json(res: dict) -> str:
    """Indented JSON with each layer's entry on one line."""
    layers = ",\n".join(f'  "{k}": {json.dumps(rounded(v))}' for k, v in res["per_layer"].items())
    return json.dumps(rounded({**res, "per_layer": "@"}), indent=1).replace('"@"', "{\n" + layers + "\n }") + "\n"


def mean(rows: list[dict], path: tuple[str, ...]) -> float:
    vals = []
    for r in rows:
        for p in path:
            r = r[p]
        vals.append(r)
    return sum(vals) / len(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--captured", metavar="FILE", help="a `sift capture` file (float32 or bf16) instead of capturing")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--layers", default="0,9,19,27", help="comma-separated layers (of the capture too), or all")
    ap.add_argument("--positions", default="2047,4095", help="comma-separated query positions (of the capture too)")
    ap.add_argument("--prompt", type=float, default=0.75, help="share of the keys that fixes channel_prompt's ranges")
    ap.add_argument("--tau", type=float, nargs="+", default=[0.875, 0.95])
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--save-capture", metavar="FILE", help="write the capture for --captured")
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.time()
    torch.set_grad_enabled(False)
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    positions = [int(x) for x in args.positions.split(",")]
    if args.captured:
        cap = CapturedAttention.load(args.captured)
    else:
        cap = capture(args.model, args.seq_len, layers, positions)
        if args.save_capture:
            cap.save(args.save_capture)
    for layer in set(cap.layers) - set(cap.layers if layers is None else layers):
        del cap.key[layer], cap.value[layer], cap.query[layer]
    dt = DTYPES[args.dtype]
    res = dict(model=cap.model, source=cap.source, positions=positions, layers=cap.layers, prompt=args.prompt,
               dtype=args.dtype, tau=args.tau, date=time.strftime("%Y-%m-%d"), torch=torch.__version__, per_layer={})
    rows_all = []
    for layer in cap.layers:
        spread = channel_spread(cap.key[layer].to(dt))
        steps = []
        for i in (i for i, p in enumerate(cap.positions) if p in positions):
            q, k, v = (x.to(dt) for x in cap.step(layer, i))
            for tau in args.tau:
                steps.append(one_step(q, k, v, cap.scaling, tau, args.prompt))
        res["per_layer"][str(layer)] = dict(channel_spread=spread, steps=steps)
        rows_all += [dict(s, layer=layer) for s in steps]
        print(f"layer {layer}: channel spread {', '.join(f'{x:.1f}' for x in spread['abs'])}, of half-widths "
              f"{', '.join(f'{x:.1f}' for x in spread['half_width'])} ({time.time() - t0:.0f} s)", flush=True)
    names = ("row", "scale_only", "channel", "channel_prompt")
    summary = {}
    for tau in args.tau:
        rows = [r for r in rows_all if r["tau"] == tau]
        summary[str(tau)] = dict(kept_union=mean(rows, ("kept_union",)),
                                 exact_bytes_vs_dense=mean(rows, ("exact_bytes_vs_dense",)),
                                 **{n: dict(candidates=mean(rows, (n, "candidates")),
                                            bytes_vs_dense=mean(rows, (n, "bytes_vs_dense"))) for n in names})
    res["summary"] = summary
    res["seconds"] = round(time.time() - t0, 1)
    print(f"\n{cap.model}, layers {cap.layers}, positions {positions}, {args.dtype} keys; channel ranges from the "
          f"whole cache (channel) or its first {args.prompt:.0%} (channel_prompt)")
    print("| layer | tau | channel spread: abs / half-width | V rows kept (union) | candidates: " + " / ".join(names)
          + " | bytes vs dense: exact / " + " / ".join(names) + " |")
    print("|---|---|---|---|---|---|")
    for layer in cap.layers:
        sp = res["per_layer"][str(layer)]["channel_spread"]
        spread = f"{max(sp['abs']):.1f} / {max(sp['half_width']):.1f}"
        for tau in args.tau:
            rows = [r for r in rows_all if r["tau"] == tau and r["layer"] == layer]
            print(f"| {layer} | {tau} | {spread} | {mean(rows, ('kept_union',)):.3f} | "
                  + " / ".join(f"{mean(rows, (n, 'candidates')):.3f}" for n in names) + " | "
                  + f"{mean(rows, ('exact_bytes_vs_dense',)):.3f} / "
                  + " / ".join(f"{mean(rows, (n, 'bytes_vs_dense')):.3f}" for n in names) + " |")
    for tau, s in summary.items():
        print(f"| all | {tau} | | {s['kept_union']:.3f} | " + " / ".join(f"{s[n]['candidates']:.3f}" for n in names)
              + f" | {s['exact_bytes_vs_dense']:.3f} / " + " / ".join(f"{s[n]['bytes_vs_dense']:.3f}" for n in names) + " |")
    if args.out:
        with open(args.out, "w") as f:
            f.write(to_json(res))


if __name__ == "__main__":
    main()
