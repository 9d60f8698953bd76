"""Why the sparse decode kernels run slower inside the generation loop than in bench_decode.py.

Captures the attention calls of one post-warmup Sift step of the planted Llama-3.1-8B
shape (``bench_generate.py``'s model, first ``--layers`` layers), then times the same
sparse step on those inputs and on variants that each change one condition towards
``bench_decode.py``'s synthetic case (the work of a step depends only on the kept set,
so the thresholds themselves are not varied):

- ``in_loop``: the captured query, the loop's fixed caches (allocated ``P + T`` keys,
  ``seq_lens`` valid), the power-law thresholds, bf16;
- ``shuffled``: the same keys and values at randomly permuted positions (the same kept
  set and the same bytes; only where the kept rows lie changes);
- ``interleaveN``: the captured inputs through filter splits that take every
  ``ns2``-th run of N keys (``KernelConfig.interleave2``); ``interleave0``: one
  contiguous range per split;
- ``equal_heads``: the captured inputs with every head's threshold placed so that it keeps
  the mean share (``bench_decode.thresholds``): the kept set's spread over heads removed;
- ``synthetic``: ``bench_decode.make_inputs`` of the same shape at the same realized
  sparsity (independent heads), bf16;
- ``planted_corr07`` (GQA): the same with a group's queries correlated 0.7, the planted inputs
  of ``bench_decode.py --tune-grid``.

``--model NAME`` captures a real embedded model's step on real text (WikiText-2, then any
``--data-file``) instead of the planted 8B shape; ``--every N`` replays every N-th layer.

Two earlier variants, contiguous caches of exactly the valid length and the inputs cast to
float16, timed equal to ``in_loop`` (``benchmarks/results/replay_h200.json``) and were
dropped. ``layout`` says where the kept V rows lie: the most one filter program gathers
over the mean, and their share per 1/32 of the positions.

Each variant reports GPU time per layer (CUDA graph, ``do_bench`` median), the device
time of each kernel (torch.profiler over eager calls), the kept share per head and the
share of V rows some head of the group keeps; ``dense`` (the dense kernel) and ``sdpa``
run on the captured inputs as the yardsticks.

    PYTHONPATH=. python3 benchmarks/studies/replay_decode.py --setting 8x32768 --out $OUT/replay.json
    PYTHONPATH=/tmp/sift-site:. python3 benchmarks/studies/replay_decode.py --model qwen2.5-1.5b --data-file /root/wiki.utf8 \
        --setting 8x16384 --every 3 --out $OUT/replay_qwen8x16384_h100.json

On a machine without CUDA it runs a small smoke version (tiny model, the CPU backend,
host timers) so the script itself can be checked: ``--smoke``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for bench_decode and bench_generate

from bench_decode import make_inputs, thresholds  # noqa: E402
from cpu_sparse_breakdown import timed  # noqa: E402
from pass_timeline import kernel_spans  # noqa: E402
from bench_generate import add_planting_args, capture_decode_calls, free, kept_counts, kept_masks, planted_model  # noqa: E402

from siftattention import Sift  # noqa: E402
from siftattention.kernels import DecodeKernels  # noqa: E402


def plan_like(q: torch.Tensor, k: torch.Tensor, scale: float, backend: str, config=None) -> DecodeKernels:
    return DecodeKernels.plan(batch=q.shape[0], q_heads=q.shape[1], kv_heads=k.shape[1], max_len=k.shape[2], head_dim=q.shape[2],
                              dtype=q.dtype, device=q.device, scale=scale, backend=backend, config=config)


def kept_layout(q, k, eta, seq_lens, scale: float, splits: int, bins: int = 32) -> dict:
    """Where the V rows some head of a group keeps lie: per contiguous filter split and per position bin.

    ``split_max_over_mean``: the most rows one (batch, KV head, split) program gathers over
    the mean (1 = balanced); ``bins``: the share of kept rows in each of ``bins`` equal
    position ranges, averaged over rows (uniform = 1 / bins each).
    """
    def range_sums(rows: torch.Tensor, parts: int) -> torch.Tensor:
        """[Hkv, parts]: kept rows in each of ``parts`` equal position ranges."""
        edges = torch.linspace(0, rows.shape[-1], parts + 1).round().long().tolist()
        return torch.stack([rows[:, a:e].sum(-1) for a, e in zip(edges[:-1], edges[1:])], -1)

    per_split, per_group, per_head, hist = [], [], [], torch.zeros(bins, dtype=torch.float64)
    for keep in kept_masks(q, k, eta, seq_lens, scale):
        rows = keep.any(1).double()  # [Hkv, n]
        per_split.append(range_sums(rows, splits).flatten())
        per_group.append(rows.sum(-1))
        per_head.append(keep.double().mean(-1).flatten())
        h = range_sums(rows, bins)
        hist += (h / h.sum(-1, keepdim=True).clamp_min(1)).mean(0).cpu()
    counts, groups, heads = torch.cat(per_split), torch.cat(per_group), torch.cat(per_head)
    return {"splits": splits, "split_max_over_mean": float(counts.max() / counts.mean().clamp_min(1e-9)),
            "split_cv": float(counts.std() / counts.mean().clamp_min(1e-9)),
            "group_max_over_mean": float(groups.max() / groups.mean().clamp_min(1e-9)),
            "head_kept": [round(float(x), 4) for x in (heads.min(), heads.median(), heads.max())],
            "bins": [round(float(x), 4) for x in hist / q.shape[0]]}


def shares(q, k, eta, seq_lens, scale: float) -> dict:
    """Kept keys per head and V rows some head of the group keeps, as shares of the valid keys (float32 scores)."""
    kept, rows, valid = kept_counts(q, k, eta, seq_lens, scale)
    return {"kept_per_head": kept / (valid * q.shape[1]), "v_rows": rows / (valid * k.shape[1])}


def gpu_ms(fn) -> float:
    import triton.testing

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def host_ms(fn) -> float:
    return timed(fn, 5)


def kernel_us(fn, n: int = 10) -> dict:
    """Device time per kernel name over ``n`` eager calls, per call."""
    per: dict[str, float] = {}
    for name, start, end in kernel_spans(fn, n, warmup=1, kernels_only=False):
        per[name[:40]] = per.get(name[:40], 0.0) + (end - start) / n
    return per


def layer_variants(call, cuda: bool, gen: torch.Generator, chunks: tuple[int, ...] = (256,)) -> dict:
    """Every variant of one captured layer call (the captured plan's backend throughout)."""
    q, k, v, keys, state, _phase, kern = call
    scale, backend = kern.scale, kern.backend
    seq_lens, starts = keys.seq_lens, keys.starts
    eta = Sift.decode_threshold(state, keys)
    n = int(seq_lens.max())
    timer = gpu_ms if cuda else host_ms
    out: dict = {"valid_len": n, "allocated_len": k.shape[2]}

    def record(name: str, fn, q_, k_, eta_, lens) -> None:
        out[name] = {"ms": timer(fn), **shares(q_, k_, eta_, lens, scale)}
        if cuda:
            out[name]["kernels_us"] = kernel_us(fn)

    plan = plan_like(q, k, scale, backend)
    record("in_loop", lambda: plan.sparse(q, k, v, eta, seq_lens, starts), q, k, eta, seq_lens)
    realized = 1 - out["in_loop"]["kept_per_head"]
    if cuda:
        out["layout"] = kept_layout(q, k, eta, seq_lens, scale, plan.geometry["ns2"])
        # The same call with interleaved filter splits (runs of CHUNK keys dealt round-robin).
        for chunk in chunks:
            if chunk == plan.config.interleave2:  # the captured plan's own split: in_loop, timed above
                out[f"interleave{chunk}"] = out["in_loop"]
                continue
            plan_i = plan_like(q, k, scale, backend, replace(plan.config, interleave2=chunk))
            record(f"interleave{chunk}", lambda: plan_i.sparse(q, k, v, eta, seq_lens, starts), q, k, eta, seq_lens)

    # The same keys and values at permuted positions: the same work, spread evenly over the splits.
    if (starts is None or not bool(starts.any())) and bool((seq_lens == n).all()):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(3)).to(k.device)
        kp, vp = k[:, :, :n][:, :, perm].contiguous(), v[:, :, :n][:, :, perm].contiguous()
        plan_p = plan_like(q, kp, scale, backend)
        record("shuffled", lambda: plan_p.sparse(q, kp, vp, eta, seq_lens, starts), q, kp, eta, seq_lens)
        del kp, vp

    # The captured keys with every head keeping the same share (the mean): only the spread of
    # the kept share over heads (and so over KV groups) changes.
    if bool((seq_lens == n).all()):
        (eq_eta, _, _), = thresholds(q, k[:, :, :n], [realized])
        record("equal_heads", lambda: plan.sparse(q, k, v, eq_eta, seq_lens, starts), q, k, eq_eta, seq_lens)

    B, Hq, D = q.shape
    qs, ks, vs = make_inputs(B, Hq, k.shape[1], n, D, q.dtype, 2.0, 0.0, gen) if cuda else _cpu_inputs(B, Hq, k.shape[1], n, D, gen)
    full = torch.full((B,), n, dtype=torch.int32, device=q.device)
    (syn_eta, _, _), = thresholds(qs, ks, [realized])
    plan_s = plan_like(qs, ks, scale, backend)
    record("synthetic", lambda: plan_s.sparse(qs, ks, vs, syn_eta, full), qs, ks, syn_eta, full)
    if cuda and k.shape[1] < q.shape[1]:  # bench_decode --tune-grid's planted heads: a group's queries correlated 0.7
        del qs, ks, vs
        qc, kc, vc = make_inputs(B, Hq, k.shape[1], n, D, q.dtype, 3.0, 0.7, gen)
        (corr_eta, _, _), = thresholds(qc, kc, [realized])
        record("planted_corr07", lambda: plan_s.sparse(qc, kc, vc, corr_eta, full), qc, kc, corr_eta, full)
        del qc, kc, vc

    out["dense"] = {"ms": timer(lambda: plan.dense(q, k, v, seq_lens, starts))}
    kd, vd = k[:, :, :n], v[:, :, :n]
    out["sdpa"] = {"ms": timer(lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale, enable_gqa=True))}
    if cuda:
        out["dense"]["kernels_us"] = kernel_us(lambda: plan.dense(q, k, v, seq_lens, starts))
    return out


def _cpu_inputs(B, Hq, Hkv, S, D, gen):
    G = Hq // Hkv
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    q = torch.randn(B, Hkv, G, D, generator=gen) * 2.0
    return q.reshape(B, Hq, D), k, v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", default="8x32768", help="BATCHxPROMPT")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B shape to build (each replayed)")
    ap.add_argument("--tau", type=float, default=0.875)
    ap.add_argument("--warmup", type=int, default=16)
    add_planting_args(ap)
    ap.add_argument("--interleave", type=int, nargs="*", default=[0, 256],
                    help="filter-split chunk sizes to time on the captured inputs (0: contiguous splits)")
    ap.add_argument("--model", default=None, help="an embedded model on real text instead of the planted 8B shape")
    ap.add_argument("--data-file", action="append", default=[], help="text after WikiText-2 (with --model)")
    ap.add_argument("--every", type=int, default=1, help="replay every N-th layer's call")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU version: checks the script, measures nothing useful")
    ap.add_argument("--out", type=Path, default=Path("replay_decode.json"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        ap.error("needs a CUDA device (or --smoke)")
    batch, prompt = (int(x) for x in args.setting.split("x"))
    if cuda and args.model:
        from bench_generate_real import prompt_tokens, windows

        from siftattention.models import load_model

        model, tokenizer = load_model(args.model, dtype=torch.bfloat16, device="cuda")
        device = "cuda"
    elif cuda:
        model = planted_model(args, layers=args.layers)
        device = "cuda"
    else:
        model = planted_model(args, layers=2, dtype=torch.float32, device="cpu", attention_bias=True, hidden_size=256, intermediate_size=512,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=512)
        device, batch, prompt = "cpu", 2, 300
    vocab = model.config.vocab_size
    if cuda and args.model:
        ids = windows(prompt_tokens(tokenizer, args.data_file), batch, prompt).to(device)
    else:
        ids = torch.randint(3, vocab - 1, (batch, prompt), device=device)
    method, calls, handle = capture_decode_calls(model, ids, args.tau, args.warmup)
    gen = torch.Generator(device=device).manual_seed(5)
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)}, "layers": []}
    try:
        with torch.inference_mode():
            for i, call in enumerate(calls):
                if i % args.every:
                    continue
                row = layer_variants(call, cuda, gen, tuple(args.interleave)) | {"layer": i}
                report["layers"].append(row)
                print(json.dumps(row)[:600], flush=True)
    finally:
        handle.context = None
        handle.remove()
        free() if cuda else None
    args.out.write_text(json.dumps(report, indent=1))

    names = ["in_loop", "shuffled"] + [f"interleave{c}" for c in args.interleave] + ["equal_heads", "synthetic", "planted_corr07"]
    print(f"\n{report['device']}, {args.setting}, {len(calls)} layers, tau {args.tau}, warmup {args.warmup}: ms per layer "
          "(kept per head / V rows); dense kernel and SDPA on the captured inputs")
    print("layer | " + " | ".join(names) + " | dense | sdpa")
    for r in report["layers"]:
        cells = [f"{r[n]['ms']:.3f} ({r[n]['kept_per_head']:.3f}/{r[n]['v_rows']:.3f})" if n in r else "-" for n in names]
        print(f"{r['layer']:5d} | " + " | ".join(cells) + f" | {r['dense']['ms']:.3f} | {r['sdpa']['ms']:.3f}")
    if cuda:
        print("kernel device time per call, us (in_loop / synthetic):")
        for r in report["layers"]:
            print(f"{r['layer']:5d} | {r['in_loop']['kernels_us']} / {r['synthetic']['kernels_us']}")
        print("kept V rows: max/mean per filter program, share per 1/32 of the positions (first 4, last 4):")
        for r in report["layers"]:
            lay = r["layout"]
            print(f"{r['layer']:5d} | {lay['split_max_over_mean']:.2f} (cv {lay['split_cv']:.2f}, {lay['splits']} splits) | "
                  f"groups max/mean {lay['group_max_over_mean']:.2f} | head kept {lay['head_kept']} | "
                  f"{lay['bins'][:4]} ... {lay['bins'][-4:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
