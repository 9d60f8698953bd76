"""Generation speed on the CPU with the embedded model: what Full() through apply costs, and where Sift stands.

    .venv/bin/python benchmarks/bench_generate_cpu.py --check --out benchmarks/results/generate_cpu.json

SmolLM2-135M-Instruct (embedded), batch 4, greedy, ``--new`` tokens after a prompt of
real text (WikiText-2 from the package data). Per prompt length:

- ``sdpa``: transformers' ``generate`` with its own SDPA attention (no method applied);
- ``apply_full``: the same ``generate`` with ``apply(model, Full())``;
- ``fast_full`` / ``fast_sift``: ``siftattention.generate`` (fixed cache, eager on the CPU)
  with ``Full()`` and ``Sift(tau, warmup)`` through the fused C++ kernel (backend "cpu",
  the default on the CPU), post-warmup steps timed apart; ``fast_full_sdpa``: the same
  loop with ``Full()`` through torch's SDPA (backend "torch"), the other dense option (the
  three runs alternate);
- ``attention``: one layer's decode attention alone at a length (random K/V of the
  model's shape, thresholds at each head's tau-quantile): torch SDPA, the fused kernel
  dense and sparse, and the torch sparse step, timed interleaved.

transformers' prefill is the time to the first step's logits and its decode the median
interval between later steps (a logits processor notes the time of each step); the fast
loop times its steps itself. Times are medians of ``--repeats`` runs (the 2-core machine is
noisy); ``sdpa`` and ``apply_full`` runs alternate, so a slow spell hits both.

``--check`` first verifies what is timed: the fused kernel's dense and warmup steps against
the float64 torch reference and its sparse step against the torch backend's (one layer's
shape, random K/V), and the fast loop's greedy tokens (``Full()``, the fused kernel) against
transformers' generate; it stops with status 1 where a kernel is off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from siftattention import Full, Sift, apply
from siftattention.generation import generate


class StepClock:
    """A logits processor that only notes the time of every generation step (transformers calls it once a step)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.marks.append(time.perf_counter())
        return scores


def hf_pair(model, ids, new: int, repeats: int) -> tuple[dict, dict]:
    """transformers' generate without and with ``apply(model, Full())``, runs alternated so drift hits both.

    Prefill is the time to the first step's logits; decode the median interval between
    later steps (each step's time measured on its own, so prefill's jitter stays out of it).
    """
    from transformers import LogitsProcessorList

    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, min_new_tokens=0, max_new_tokens=new)
    runs: dict[str, dict[str, list[float]]] = {"sdpa": {"prefill": [], "step": []}, "apply_full": {"prefill": [], "step": []}}

    def timed(name: str) -> None:
        clock = StepClock()
        start = time.perf_counter()
        model.generate(input_ids=ids, logits_processor=LogitsProcessorList([clock]), **kw)
        runs[name]["prefill"].append(clock.marks[0] - start)
        runs[name]["step"].append(statistics.median(b - a for a, b in zip(clock.marks, clock.marks[1:])))

    with torch.inference_mode():
        for _ in range(repeats):
            timed("sdpa")
            with apply(model, Full()):
                timed("apply_full")
    return tuple({"prefill_s": statistics.median(runs[n]["prefill"]), "decode_ms": statistics.median(runs[n]["step"]) * 1e3}
                 for n in ("sdpa", "apply_full"))


def fast_times(model, ids, runs: dict[str, tuple], new: int, repeats: int) -> dict[str, dict]:
    """``siftattention.generate`` per named (method, backend), the names' runs alternated so drift hits all."""
    results: dict[str, list] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (method, backend) in runs.items():
            results[name].append(generate(model, ids, None, method, max_new_tokens=new, eos_token_id=-1, decode_backend=backend))
    out = {}
    for name, rs in results.items():
        # decode_ms: the median step of the phase a run settles in (Full's exact steps, Sift's
        # sparse ones), from the loop's phase clock, as transformers' steps are timed: a slow
        # spell of this shared machine moves a mean, not a median. decode_mean_ms: every step.
        row = {
            "backend": runs[name][1],
            "prefill_s": statistics.median(r.timings["prefill_s"] for r in rs),
            "decode_mean_ms": statistics.median(r.timings["decode_s"] / r.timings["decode_steps"] for r in rs) * 1e3,
            "decode_ms": statistics.median(list(r.timings["phases"].values())[-1]["steady_ms"] for r in rs),
        }
        if all("sparse" in r.timings["phases"] for r in rs):
            row["realized_post_warmup"] = rs[-1].stats.realized_sparsity(post_warmup=True)
        out[name] = row
    return out


def attention_times(model, batch: int, length: int, tau: float, repeats: int) -> dict:
    """One layer's decode attention at ``length`` keys (random K/V, the model's shape), interleaved.

    Thresholds sit at each head's ``tau``-quantile, so the sparse steps keep 1 - tau of
    every head's keys (the heads of a group independently).
    """
    from siftattention.kernels import DecodeKernels

    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    q = torch.randn(batch, hq, d) * 2  # peaked enough that a few keys carry most of the mass
    k = torch.randn(batch, hkv, length, d)
    v = torch.randn(batch, hkv, length, d)
    lens = torch.full((batch,), length, dtype=torch.int32)
    plans = {b: DecodeKernels.plan(batch=batch, q_heads=hq, kv_heads=hkv, max_len=length, head_dim=d, dtype=torch.float32,
                                   device=torch.device("cpu"), scale=d**-0.5, backend=b) for b in ("torch", "cpu")}
    _, theta = plans["torch"].warmup(q, k, v, tau, lens)
    fns = {
        "sdpa_ms": lambda: plans["torch"].dense(q, k, v, lens),
        "cpu_dense_ms": lambda: plans["cpu"].dense(q, k, v, lens),
        "cpu_sparse_ms": lambda: plans["cpu"].sparse(q, k, v, theta, lens),
        "torch_sparse_ms": lambda: plans["torch"].sparse(q, k, v, theta, lens),
    }
    n = max(1, 4096 // length)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(5, repeats * 5)):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - start) / n * 1e3)
    kept = plans["cpu"].sparse(q, k, v, theta, lens)[1].float().mean().item() / length
    return {name: statistics.median(t) for name, t in times.items()} | {"sparsity": 1 - kept}


def check(model, ids: torch.Tensor, new: int, tau: float, length: int = 2048) -> dict:
    """The fused kernel's steps against torch references, and the fast loop's tokens against transformers' (see the module doc)."""
    from siftattention.eval.tasks.base import common_prefix
    from siftattention.kernels import DecodeKernels
    from siftattention.kernels.torch_ref import dense_decode_torch, sift_warmup_decode_torch

    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(1)
    batch = ids.shape[0]
    q = torch.randn(batch, hq, d, generator=gen) * 2
    k, v = torch.randn(batch, hkv, length, d, generator=gen), torch.randn(batch, hkv, length, d, generator=gen)
    lens = torch.full((batch,), length, dtype=torch.int32)
    plans = {b: DecodeKernels.plan(batch=batch, q_heads=hq, kv_heads=hkv, max_len=length, head_dim=d, dtype=torch.float32,
                                   device=torch.device("cpu"), scale=d**-0.5, backend=b) for b in ("torch", "cpu")}
    tau64 = torch.full((batch, hq), tau, dtype=torch.float64)
    out64 = dense_decode_torch(q.double(), k.double(), v.double(), d**-0.5, lens)
    warm64, theta64 = sift_warmup_decode_torch(q.double(), k.double(), v.double(), tau64, d**-0.5, lens)
    warm, theta = plans["cpu"].warmup(q, k, v, tau, lens)
    (sparse, kept), (sparse_ref, kept_ref) = plans["cpu"].sparse(q, k, v, theta, lens), plans["torch"].sparse(q, k, v, theta, lens)
    errors = {
        "dense_vs_float64": (plans["cpu"].dense(q, k, v, lens).double() - out64).abs().max().item(),
        "warmup_vs_float64": (warm.double() - warm64).abs().max().item(),
        "theta_vs_float64": ((theta.double() - theta64).abs() / theta64.abs().clamp(min=1e-30)).max().item(),
        "sparse_vs_torch": (sparse - sparse_ref).abs().max().item(),
        "kept_differ": int((kept != kept_ref).sum()),
    }
    kernels_ok = max(v for name, v in errors.items() if name != "kept_differ") < 1e-4 and errors["kept_differ"] == 0
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, min_new_tokens=new, eos_token_id=None,
                             pad_token_id=0)[:, ids.shape[1]:].tolist()
    ours = generate(model, ids, None, Full(), max_new_tokens=new, eos_token_id=-1).new_tokens.tolist()
    agreeing = [common_prefix(r, o) for r, o in zip(ref, ours)]
    return {"kernels": errors, "kernels_ok": kernels_ok, "agreeing_tokens": agreeing, "of": new}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--attention-lengths", nargs="+", type=int, default=[512, 2048, 8192, 32768])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--tau", type=float, default=0.875)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench_generate_cpu.json"))
    ap.add_argument("--check", action="store_true", help="first verify the fused kernel and the fast loop's tokens (exit 1 if a kernel is off)")
    args = ap.parse_args()

    from siftattention.data import load_corpus
    from siftattention.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    text = load_corpus("wikitext2").text
    all_ids = tokenizer(text[:400_000], return_tensors="pt", add_special_tokens=False).input_ids[0]
    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)}, "rows": []}
    if args.check:
        prompt = min(args.prompts)
        report["check"] = check(model, torch.stack([all_ids[i * prompt : (i + 1) * prompt] for i in range(args.batch)]), args.new, args.tau)
        print("check:", json.dumps(report["check"]), flush=True)
        if not report["check"]["kernels_ok"]:
            args.out.write_text(json.dumps(report, indent=1))
            raise SystemExit("check failed: the fused kernel is off (see check.kernels)")
    for prompt in args.prompts:
        ids = torch.stack([all_ids[i * prompt : (i + 1) * prompt] for i in range(args.batch)])
        row = {"prompt": prompt}
        row["sdpa"], row["apply_full"] = hf_pair(model, ids, args.new, args.repeats)
        row |= fast_times(model, ids, {"fast_full": (Full(), "auto"), "fast_full_sdpa": (Full(), "torch"),
                                       "fast_sift": (Sift(tau=args.tau, warmup=args.warmup), "auto")}, args.new, args.repeats)
        print(json.dumps(row), flush=True)
        report["rows"].append(row)
    report["attention"] = []
    for length in args.attention_lengths:
        a = attention_times(model, args.batch, length, args.tau, args.repeats) | {"length": length}
        print(json.dumps(a), flush=True)
        report["attention"].append(a)
    args.out.write_text(json.dumps(report, indent=1))

    layers = model.config.num_hidden_layers
    print(f"\nCPU, {report['threads']} threads, SmolLM2-135M, batch {args.batch}, {args.new} new tokens (medians of {args.repeats})")
    print("prompt | sdpa prefill s / decode ms | apply(Full) prefill / decode | ratio prefill / decode | fast Full ms (SDPA) | fast Sift ms, all steps (post-warmup) | Sift/Full")
    for r in report["rows"]:
        s, a, f, fs, t = r["sdpa"], r["apply_full"], r["fast_full"], r["fast_full_sdpa"], r["fast_sift"]
        print(f"{r['prompt']:6d} | {s['prefill_s']:.3f} / {s['decode_ms']:.1f} | {a['prefill_s']:.3f} / {a['decode_ms']:.1f} | "
              f"{a['prefill_s'] / s['prefill_s']:.3f} / {a['decode_ms'] / s['decode_ms']:.3f} | {f['decode_ms']:.1f} ({fs['decode_ms']:.1f}) | "
              f"{t['decode_mean_ms']:.1f} ({t['decode_ms']:.1f}, s={t.get('realized_post_warmup', float('nan')):.3f}) | "
              f"{t['decode_ms'] / f['decode_ms']:.3f}")
    print("keys | one layer: SDPA ms | fused dense | fused sparse | torch sparse | sparsity | SDPA x layers (ms/step)")
    for a in report["attention"]:
        print(f"{a['length']:5d} | {a['sdpa_ms']:.3f} | {a['cpu_dense_ms']:.3f} | {a['cpu_sparse_ms']:.3f} | {a['torch_sparse_ms']:.3f} | "
              f"{a['sparsity']:.3f} | {a['sdpa_ms'] * layers:.1f}")


if __name__ == "__main__":
    main()
