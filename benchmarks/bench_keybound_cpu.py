"""The key-bound step on the CPU: the fused C++ key-bound step against the C++ exact Sift step and the dense steps.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_keybound_cpu.py --captured cap_qwen_4096.pt --batch 1 2 4 --out kb_cpu_qwen.json
    PYTHONPATH=. .venv/bin/python benchmarks/bench_keybound_cpu.py --heads 12,2 --head-dim 128 --seq 8192 16384 32768 --batch 1 2 4

Per (batch B, length S) the inputs are sets of (q, k, v) float32: every layer of a capture (``sift capture``; the
last captured position's query, tiled over the B rows) or planted attention (keys with an offset channel, a few
keys every query attends to, queries of a group correlated), as many sets as it takes to pass twice the
last-level cache, so every timed call reads its caches from memory as a decode step through a model's layers
does. Per target sparsity s each head's eta is the exact s-quantile of its float64 probabilities. Timed, with the
order rotated every round, median over ``--repeats`` rounds of one call per set (time per layer step; the ratios
are medians of each round's own ratio, so a load that comes and goes between rounds cancels):

- ``keybound_row`` / ``keybound_channel``: ``cpu_decode.keybound_decode_cpu`` over the per-row / per-channel int8
  copy (channel ranges from the first ``--prompt`` of each set's keys, the rest quantised as decode keys are);
- ``exact``: ``cpu_decode.sift_decode_cpu``, the CPU's exact Sift step (all of K through one BLAS product);
- ``dense``: ``cpu_decode.dense_decode_cpu`` (the CPU fast loop's dense step) and ``sdpa``: torch SDPA.

Checked first: on every set the key-bound steps keep the float64 rule's keys outside their epsilon (kept counts
within the keys near the threshold). Reported per row: the candidate key rows and the V rows some head keeps
(fractions of the valid key rows), bytes per step against the dense step's K + V (``keybound.keybound_bytes`` with
float32 caches: the int8 rows and scales, the candidates' K rows, the kept V rows; the exact step reads all of K
and the kept V rows), and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch

from siftattention.kernels import cpu_decode
from siftattention.kernels.keybound import channel_ranges, keybound_bytes, keybound_step_torch, quantize_keys
from siftattention.kernels.torch_ref import dense_decode_torch

LAST_LEVEL_CACHE = 32 << 20  # bytes, the L3 of the machine the table was measured on (lscpu)


def planted_sets(n_sets: int, B: int, Hq: int, Hkv: int, S: int, D: int, gen: torch.Generator) -> list[tuple]:
    """Planted attention: keys N(0, 1) plus a constant offset channel (a key bias) and 16 keys every query leans
    on (sinks and a few recent ones), queries N(0, 2^2) correlated 0.9 within a group."""
    G = Hq // Hkv
    sets = []
    for _ in range(n_sets):
        k = torch.randn(B, Hkv, S, D, generator=gen)
        k[..., 3] += 6.0
        v = torch.randn(B, Hkv, S, D, generator=gen)
        shared = torch.randn(B, Hkv, 1, D, generator=gen)
        q = (0.9 * shared + math.sqrt(1 - 0.81) * torch.randn(B, Hkv, G, D, generator=gen)) * 2.0
        heavy = torch.cat([torch.arange(4), torch.randint(4, S, (12,), generator=gen)])
        k[:, :, heavy] += 0.35 * shared  # aligned with the group's queries
        sets.append((q.reshape(B, Hq, D), k, v))
    return sets


def captured_sets(path: str, n_sets: int | None, B: int) -> tuple[list[tuple], dict]:
    """Successive captured layers' last decode step (``n_sets`` of them, None: every layer), each tiled over B rows
    (float32)."""
    from siftattention.capture import CapturedAttention

    cap = CapturedAttention.load(path)
    sets = []
    for i in range(len(cap.layers) if n_sets is None else n_sets):
        q, k, v = cap.step(cap.layers[i % len(cap.layers)])
        sets.append(tuple(t[:1].float().expand(B, *t.shape[1:]).contiguous() for t in (q, k, v)))
    return sets, dict(model=cap.model, layers=cap.layers, positions=cap.positions, scaling=cap.scaling,
                      source=cap.source)


def quantile_eta(q: torch.Tensor, k: torch.Tensor, scale: float, sparsity: float) -> tuple[torch.Tensor, float]:
    """Each head's exact ``sparsity``-quantile of its float64 probabilities (float32 [B, Hq]) and the fraction of
    (batch row, KV head, key) rows some head of the group keeps at it."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    s = torch.matmul(q.double().reshape(B, Hkv, Hq // Hkv, D), k.double().transpose(-1, -2)) * scale
    p = torch.softmax(s, -1)
    eta = torch.quantile(p.reshape(B * Hq, -1), sparsity, dim=-1).reshape(B, Hkv, -1)
    union = (p > eta[..., None]).any(2).double().mean()
    return eta.reshape(B, Hq).float(), float(union)


def kept_off(q, k, v, keys, eta, scale, kept) -> int:
    """Heads whose kept count differs from the float64 rule's by more than their keys within epsilon of it."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    r = keybound_step_torch(q, k, v, keys, eta, scale, None, False)
    s = (torch.matmul(q.double().reshape(B, Hkv, Hq // Hkv, D), k.double().transpose(-1, -2)) * scale).reshape(B, Hq, -1)
    t = torch.logsumexp(s, -1) + torch.log(eta.double())
    keep = s > t[..., None]
    keep.scatter_(-1, s.argmax(-1, keepdim=True), True)
    near = ((s - t[..., None]).abs() <= r["epsilon"].double()[..., None] + 1e-4).sum(-1)
    return int(((kept - keep.sum(-1)).abs() > near).sum())


def timed(calls: dict, repeats: int) -> dict:
    """Seconds per call of each entry (each a list of zero-argument calls, one per set) in every round, the
    order rotated from round to round."""
    names = list(calls)
    times = {name: [] for name in names}
    for name in names:  # warm: first-touch of outputs, the kernel's thread pool
        for fn in calls[name]:
            fn()
    for rnd in range(repeats):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            t0 = time.perf_counter()
            for fn in calls[name]:
                fn()
            times[name].append((time.perf_counter() - t0) / len(calls[name]))
    return times


def paired(times: dict, name: str, base: str) -> float:
    """The median over rounds of ``name``'s time over ``base``'s in the same round (a load that comes and goes
    between rounds cancels)."""
    return statistics.median(a / b for a, b in zip(times[name], times[base]))


def run_setting(sets: list[tuple], scale: float, sparsities: list[float], prompt: float, repeats: int) -> list[dict]:
    B, Hq, D = sets[0][0].shape
    Hkv, S = sets[0][1].shape[1], sets[0][1].shape[2]
    copies = {"row": [quantize_keys(k) for _, k, _ in sets],
              "channel": [quantize_keys(k, channel_ranges(k[:, :, : max(1, int(prompt * S))])) for _, k, _ in sets]}
    rows = []
    for sp in sparsities:
        etas, unions = zip(*(quantile_eta(q, k, scale, sp) for q, k, _ in sets))
        cand, off = {}, {}
        for form, keys in copies.items():
            cand[form] = off[form] = 0
            for (q, k, v), kq, eta in zip(sets, keys, etas):
                out, kept, c = cpu_decode.keybound_decode_cpu(q, k, v, kq, eta, scale, None, False)
                cand[form] += float(c.double().sum()) / (B * Hkv * S * len(sets))
                off[form] += kept_off(q, k, v, kq, eta, scale, kept)
        calls = {f"keybound_{form}": [lambda q=q, k=k, v=v, kq=kq, e=e: cpu_decode.keybound_decode_cpu(
                     q, k, v, kq, e, scale, None, False) for (q, k, v), kq, e in zip(sets, keys, etas)]
                 for form, keys in copies.items()}
        calls["exact"] = [lambda q=q, k=k, v=v, e=e: cpu_decode.sift_decode_cpu(q, k, v, e, scale, None, False)
                          for (q, k, v), e in zip(sets, etas)]
        calls["dense"] = [lambda q=q, k=k, v=v: cpu_decode.dense_decode_cpu(q, k, v, scale, None) for q, k, v in sets]
        calls["sdpa"] = [lambda q=q, k=k, v=v: dense_decode_torch(q, k, v, scale, None) for q, k, v in sets]
        rounds = timed(calls, repeats)
        t = {name: statistics.median(ts) for name, ts in rounds.items()}
        union = sum(unions) / len(unions)
        key_rows = B * Hkv * S
        dense_bytes = 2 * key_rows * D * 4
        exact_bytes = key_rows * D * 4 + union * key_rows * D * 4
        row = dict(batch=B, seq=S, heads=[Hq, Hkv], head_dim=D, sparsity=sp, v_rows_kept=union,
                   exact_bytes_vs_dense=exact_bytes / dense_bytes,
                   **{f"{name}_ms": sec * 1e3 for name, sec in t.items()})
        for form in copies:
            nb = keybound_bytes(B, Hkv, S, D, 4, cand[form] * key_rows, union * key_rows, per_channel=form == "channel")
            row.update({f"candidates_{form}": cand[form], f"bytes_vs_dense_{form}": nb["vs_dense"],
                        f"bytes_vs_exact_{form}": nb["total"] / exact_bytes, f"kept_heads_off_{form}": off[form],
                        f"keybound_{form}_vs_exact": paired(rounds, f"keybound_{form}", "exact"),
                        f"keybound_{form}_vs_dense": paired(rounds, f"keybound_{form}", "dense")})
        row["exact_vs_dense"] = paired(rounds, "exact", "dense")
        rows.append(row)
        print(f"B={B} S={S} s={sp}: " + ", ".join(f"{n} {row[n + '_ms']:.3f} ms" for n in calls)
              + f"; vs exact: row {row['keybound_row_vs_exact']:.3f}, channel {row['keybound_channel_vs_exact']:.3f}"
              + f"; candidates row {cand['row']:.3f} channel {cand['channel']:.3f}, V rows kept {union:.3f}; bytes vs dense:"
              f" exact {row['exact_bytes_vs_dense']:.3f}, row {row['bytes_vs_dense_row']:.3f}, channel"
              f" {row['bytes_vs_dense_channel']:.3f}; heads off {off['row']}/{off['channel']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--captured", metavar="FILE", help="a `sift capture` file (its length and heads; else planted)")
    ap.add_argument("--heads", default="12,2", help="planted: query and KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768], help="planted: cache lengths")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.875, 0.95])
    ap.add_argument("--prompt", type=float, default=0.75, help="per channel: ranges from this fraction of the keys")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", help="JSON file for the rows")
    args = ap.parse_args()
    if not cpu_decode.available():
        raise SystemExit(f"the fused CPU kernel cannot run here: {cpu_decode.build_problem()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    Hq, Hkv = (int(x) for x in args.heads.split(","))
    meta = dict(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                load_before=os.getloadavg())
    rows = []
    for B in args.batch:
        for S in ([None] if args.captured else args.seq):
            if args.captured:  # every captured layer, whatever B, so that the rows of a table compare
                sets, meta["captured"] = captured_sets(args.captured, None, B)
                scale = meta["captured"]["scaling"]
            else:
                n_sets = max(2, math.ceil(2 * LAST_LEVEL_CACHE / (2 * B * Hkv * S * args.head_dim * 4)))
                sets = planted_sets(n_sets, B, Hq, Hkv, S, args.head_dim, gen)
                scale = args.head_dim**-0.5
            for row in run_setting(sets, scale, args.sparsity, args.prompt, args.repeats):
                rows.append(dict(row, sets=len(sets), inputs="captured" if args.captured else "planted"))
    meta["load_after"] = os.getloadavg()
    print(f"load average before {meta['load_before']}, after {meta['load_after']}; {meta['threads']} threads")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
