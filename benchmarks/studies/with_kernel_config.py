"""Run a benchmark script with kernel launch parameters overridden on every device: a probe of a plan choice.

    PYTHONPATH=. python3 benchmarks/studies/with_kernel_config.py onepass_min_rows=16 onepass_min_len=8192 -- \
        benchmarks/bench_generate_real.py --model qwen2.5-1.5b --methods dense sift_anchored ...

Each ``NAME=VALUE`` sets a ``KernelConfig`` field (an int, or true / false) for every CUDA device
(``triton_config.DEVICE_CONFIGS``) before the script runs in this process.
"""

from __future__ import annotations

import runpy
import sys
from dataclasses import fields

from siftattention.kernels import triton_config


def main() -> None:
    if "--" not in sys.argv:
        raise SystemExit("usage: with_kernel_config.py NAME=VALUE ... -- SCRIPT [ARGS ...]")
    cut = sys.argv.index("--")
    known = {f.name: f.type for f in fields(triton_config.KernelConfig)}
    over: dict = {}
    for item in sys.argv[1:cut]:
        name, _, value = item.partition("=")
        if name not in known:
            raise SystemExit(f"KernelConfig has no field {name!r}")
        over[name] = {"true": True, "false": False}.get(value.lower(), None)
        if over[name] is None:
            over[name] = int(value)
    triton_config.DEVICE_CONFIGS[""] = over  # "" is in every device name
    script, *args = sys.argv[cut + 1:]
    sys.argv = [script, *args]
    print(f"KernelConfig overrides: {over}", flush=True)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
