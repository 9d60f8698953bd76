"""transformers' generate under apply() on CUDA: seconds and per-step times of repeated calls.

The first call of a process compiles the Triton kernels; a step that takes seconds is a
compile. Three calls per method on the embedded model, the paper's prompt, 96 new tokens:

    PYTHONPATH=. python3 benchmarks/studies/hf_generate_compiles.py --dtype float32 --out hf_generate_compiles.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from siftattention import Full, Sift, TopK, apply, load_model
from siftattention.cli import PAPER_PROMPT


class StepClock(LogitsProcessor):
    """A timestamp per generated token (after a device sync), read through the logits processors."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def smollm2_shaped(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.Tensor]:
    """A CUDA model of SmolLM2-135M's shape (30 layers, 9 query and 3 KV heads of 64) with random
    weights, and a random 185-token prompt (the paper prompt's length): where only the shapes matter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    return model, torch.randint(3, 49152, (1, 185), device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, tok = load_model("smollm2-135m", device="cuda", dtype=getattr(torch, args.dtype))
    ids = tok.apply_chat_template([{"role": "user", "content": PAPER_PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True).to("cuda")
    results = {}
    for name, method in (("full", Full()), ("sift", Sift(tau=0.875, warmup=16)), ("topk", TopK(k=0.125))):
        calls = []
        for call in range(args.calls):
            clock = StepClock()
            with apply(model, method), torch.no_grad():
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(**ids, max_new_tokens=args.new, do_sample=False, pad_token_id=tok.eos_token_id,
                               logits_processor=LogitsProcessorList([clock]))
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            steps = [1e3 * (b - a) for a, b in zip(clock.times, clock.times[1:])]
            slowest = sorted(((round(ms, 1), i) for i, ms in enumerate(steps)), reverse=True)[:5]
            calls.append({"seconds": seconds, "median_step_ms": statistics.median(steps), "slowest_steps": slowest})
            print(f"{name} call {call}: {seconds:.2f} s, median step {statistics.median(steps):.2f} ms, "
                  f"slowest (ms, step) {slowest}", flush=True)
        results[name] = calls
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
