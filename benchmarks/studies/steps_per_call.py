"""Sift's steady decode step call after call: plain ``generate`` calls in a row, then one ``DecodeSession``'s calls.

The per-call figures separate what a session saves (the captures of each call) from what depends on which
graph a process captured (the first Sift graph of a process replayed ~4% faster than every later one on an H100,
sessions or not; results/first_graph_h100/steps_per_call_h100.txt)::

    PYTHONPATH=. python3 benchmarks/studies/steps_per_call.py --data-file /root/wiki.utf8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_generate import free  # noqa: E402
from bench_generate_real import prompt_tokens, windows  # noqa: E402

from siftattention import DecodeSession, Sift, load_model  # noqa: E402
from siftattention.generation import generate  # noqa: E402


def show(tag: str, res) -> None:
    p = res.timings["phases"]["sparse"]
    step = res.timings["decode_s"] * 1e3 / res.timings["decode_steps"]
    print(f"{tag} sparse steady {p['steady_ms']:.3f} ms, decode {step:.3f} ms/step, captures {res.timings['captures']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--data-file", action="append", default=[], help="more text after WikiText-2 (for long prompts)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("steps_per_call.py times CUDA graphs: it needs a GPU")
    print(torch.cuda.get_device_name())
    model, tokenizer = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    ids = windows(prompt_tokens(tokenizer, args.data_file), args.batch, args.prompt).cuda()
    kw = dict(max_new_tokens=args.new, eos_token_id=-1, pad_token_id=0)
    for i in range(args.calls):
        show(f"generate {i}", generate(model, ids, None, Sift(tau=0.875), prefill_chunk=4096, **kw))
        free()
    with DecodeSession(model, Sift(tau=0.875), args.batch, args.prompt + args.new, **kw) as session:
        for i in range(args.calls):
            show(f"session {i}", session.generate(ids, prefill_chunk=4096))
            free()
    show("generate after", generate(model, ids, None, Sift(tau=0.875), prefill_chunk=4096, **kw))


if __name__ == "__main__":
    main()
