"""The first generation of a process on a GPU with an empty Triton cache: what compiling costs.

    PYTHONPATH=. python3 benchmarks/studies/first_call.py --out $OUT/first_call.json

Each case runs in a fresh process with a fresh ``TRITON_CACHE_DIR``, with Sift's kernels
compiled ahead, side by side, when the decode plan is made (the default) or one after
another at their first launches (``SIFTATTENTION_PRECOMPILE=0``): the first call's seconds,
the second call's, the kernels compiled and, for those compiled at a launch, their seconds. The model has SmolLM2-135M's shape (30 layers,
9 query and 3 KV heads of 64) with random weights: what compiles depends on the shapes and
the dtype only. The prompt is 185 tokens, 96 new tokens, greedy; ``fast`` is
``siftattention.generate``, ``hf`` transformers' ``generate`` under ``apply``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def one_case(path: str, method: str, dtype: str) -> dict:
    """Run in the child process: two calls, their seconds and the kernels compiled in the first."""
    import torch
    from hf_generate_compiles import smollm2_shaped  # this script's directory is on sys.path
    from triton.runtime.jit import JITFunction

    from siftattention import Full, Sift, apply
    from siftattention.generation import generate

    compiled = []
    real = JITFunction._do_compile

    def spy(self, key, signature, device, constexprs, options, attrs, warmup):
        start = time.perf_counter()
        kernel = real(self, key, signature, device, constexprs, options, attrs, warmup)
        # At a launch the compile is synchronous; compiled ahead, this is only its submission.
        compiled.append([self.__name__, bool(warmup), round(time.perf_counter() - start, 2)])
        return kernel

    JITFunction._do_compile = spy
    model, ids = smollm2_shaped(getattr(torch, dtype))
    mask = torch.ones_like(ids)
    seconds, first_compiles = [], None
    for _ in range(2):
        m = Sift(tau=0.875, warmup=16) if method == "sift" else Full()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if path == "fast":
            generate(model, ids, mask, m, max_new_tokens=96)
        else:
            with apply(model, m), torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=96, min_new_tokens=96, do_sample=False,
                               pad_token_id=0)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if first_compiles is None:
            first_compiles = list(compiled)
    return dict(first_s=seconds[0], second_s=seconds[1], compiled=len(first_compiles),
                compiled_at_launch=sorted(name for name, ahead, _ in first_compiles if not ahead),
                compile_s_at_launch=[[name, s] for name, ahead, s in first_compiles if not ahead])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_case(*args.child)))
        return
    cases = [(path, method, dtype, ahead) for dtype in args.dtypes
             for path, method in (("fast", "full"), ("fast", "sift"), ("hf", "sift")) for ahead in (True, False)
             if method == "sift" or ahead]
    rows = []
    for path, method, dtype, ahead in cases:
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-"),
                   SIFTATTENTION_PRECOMPILE="1" if ahead else "0",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", "-", "--child", path, method, dtype],
                           capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"{path} {method} {dtype}: {p.stderr[-2000:]}")
        row = dict(path=path, method=method, dtype=dtype, ahead=ahead, **json.loads(p.stdout.strip().splitlines()[-1]))
        rows.append(row)
        print(f"{path:4} {method:4} {dtype:8} ahead={str(ahead):5} first {row['first_s']:6.2f} s, second "
              f"{row['second_s']:5.2f} s, {row['compiled']} kernels compiled, at launch (s): {row['compile_s_at_launch']}",
              flush=True)
    import torch
    import transformers
    import triton

    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       transformers=transformers.__version__, date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
