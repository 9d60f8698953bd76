"""End-to-end generate() on a GPU: Sift through the fused kernels vs the reference path vs SDPA.

The embedded model cannot travel to the GPU machine, so this uses a randomly initialised
model of SmolLM2-135M's shape (30 layers, 9 heads, 3 KV heads, head_dim 64) or, with
--shape llama8b-attn, 4 layers of Llama-3-8B's attention shape (32 heads, 8 KV heads, 128).

1. Check: greedy generate with Sift(decode_backend="triton") and with the reference attention
   (decode_backend=None) on the same prompt; per-step logits and tokens compared.
2. Time: per-token decode latency of generate() (wall time of N new tokens minus that of one,
   so the prefill is excluded) for SDPA (Full), Sift via the kernels, and Sift via the
   reference attention; the Sift figures include its warmup steps.

    PYTHONPATH=. python3 benchmarks/gpu_generate.py --out $OUT/gpu_generate.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from siftattention import Sift, apply

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
    "llama8b-attn": dict(hidden_size=4096, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8),
}


def build(shape: str, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, max_position_embeddings=65536, **SHAPES[shape])
    model = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    # Sharper attention than a random init gives (closer to a trained model's peaky rows).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def timed_generate(model, ids, new_tokens: int, method=None, backend="auto") -> tuple[torch.Tensor, float, dict]:
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
               output_logits=True, return_dict_in_generate=True)
    mask = torch.ones_like(ids)
    stats = {}
    if method is None:
        model.set_attn_implementation("sdpa")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **gen)
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0, stats
    with apply(model, method, decode_backend=backend) as handle:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **gen)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        stats = {"sparsity_post_warmup": handle.stats.realized_sparsity(post_warmup=True)}
    return out, elapsed, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--tau", type=float, default=0.875)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile one generate() per path (host time by function)")
    args = ap.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(), "args": vars(args), "torch": torch.__version__}

    # 1. Correctness in float32 (the reference path is exact float32 torch).
    model = build(args.shape, torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(3, 4000, (2, 300), device="cuda")
    method = Sift(tau=args.tau, warmup=args.warmup)
    ref, _, ref_stats = timed_generate(model, ids, 40, method, backend=None)
    ker, _, ker_stats = timed_generate(model, ids, 40, method, backend="triton")
    diffs = [float((a - b).abs().max()) for a, b in zip(ref.logits, ker.logits)]
    same = (ref.sequences == ker.sequences).float().mean().item()
    report["check_fp32"] = {"max_logit_diff_per_step": diffs, "token_agreement": same,
                            "sparsity_reference": ref_stats["sparsity_post_warmup"], "sparsity_kernels": ker_stats["sparsity_post_warmup"]}
    print(f"fp32 check: token agreement {same:.3f}, max logit diff {max(diffs):.2e} "
          f"(first approximated step {diffs[args.warmup]:.2e}); sparsity ref {ref_stats['sparsity_post_warmup']:.3f} "
          f"kernels {ker_stats['sparsity_post_warmup']:.3f}")
    del model
    torch.cuda.empty_cache()

    # 2. Timing in bf16 at a long prompt: whole generate() wall time over `new` tokens.
    model = build(args.shape, torch.bfloat16)
    ids = torch.randint(3, 4000, (args.batch, args.prompt), device="cuda")
    rows = []
    for name, meth, backend in [("sdpa (full)", None, None), ("sift kernels", method, "triton"), ("sift reference", method, None)]:
        # Warm up at the timed shapes: Triton compiles one variant per specialisation it meets.
        timed_generate(model, ids, args.new, meth, backend)
        _, prefill_only, _ = timed_generate(model, ids, 1, meth, backend)
        out, elapsed, stats = timed_generate(model, ids, args.new, meth, backend)
        # Decode steps only: the prefill (exact attention in every path) is subtracted.
        per_token = (elapsed - prefill_only) / (args.new - 1)
        rows.append({"path": name, "seconds": elapsed, "prefill_s": prefill_only, "ms_per_token": 1000 * per_token, **stats})
    report["timing_bf16"] = rows
    if args.profile:
        import cProfile
        import io
        import pstats

        for name, meth, backend in [("sift kernels", method, "triton"), ("sift reference", method, None)]:
            prof = cProfile.Profile()
            prof.enable()
            timed_generate(model, ids, args.new, meth, backend)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            report[f"profile {name}"] = buf.getvalue()
            print(f"\n===== cProfile: {name} (by tottime)\n" + "\n".join(buf.getvalue().splitlines()[:45]))
    print(f"\ngenerate() B={args.batch} prompt={args.prompt} new={args.new} shape={args.shape} on {report['device']}")
    print(f"{'path':16s} {'prefill s':>9s} {'decode ms/token':>15s} {'sparsity':>9s}")
    for r in rows:
        print(f"{r['path']:16s} {r['prefill_s']:9.2f} {r['ms_per_token']:15.2f} {r.get('sparsity_post_warmup', 0.0):9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
