"""The fused CPU decode kernel (backend="cpu"): built once from the sources in ``cpu/``.

On the CPU the torch backend's separate passes over ``[B, Hq, S]`` tensors, and its
dense product with every value row, cost more than one fused pass; this C++ kernel
takes the scores from one BLAS product, then does the softmax statistics, the
threshold and the weighted sum over the value rows some head of the group keeps in
one pass per (batch row, KV head). With every key kept it is exact attention, the
dense step of the CPU fast path. ``cpu/keybound_decode.cpp`` is the key-bound step
(``keybound``): the int8 key copy scanned, full keys read for the candidates only, in one
task per (batch row, KV head); ``cpu/key_write.cpp`` writes that copy (``write_keys``: new keys quantised
as ``keybound.quantize_keys``, bit for bit, in one call in place of its ten or so torch operations).

The extension is compiled with the machine's C++ compiler the first time it is needed
(about 30 s, a one-line notice) into ``$SIFTATTENTION_CACHE`` (default
``~/.cache/siftattention``), under a name that hashes the source, the flags, the torch
version and installation, the Python version and the CPU's instruction sets, and loaded
from there afterwards. Where it cannot be built (no
compiler), one warning says why and the torch backend runs instead.
``SIFTATTENTION_CPU_KERNEL=0`` switches it off. float32 only.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

from ..paths import cache_root
from .keybound import _LN2, _TINY, _TINY_ROW, INV_QMAX, MARGIN, OFFSET_ROUNDING, SLACK2, Int8Keys

SOURCE_DIR = Path(__file__).with_name("cpu")
SOURCES = [SOURCE_DIR / "sift_decode.cpp", SOURCE_DIR / "keybound_decode.cpp", SOURCE_DIR / "key_write.cpp"]
HEADERS = [SOURCE_DIR / "common.h", SOURCE_DIR / "dots.h"]
# -fno-trapping-math lets the exp and threshold loops vectorise (no NaN or rounding change);
# -march=native: the cache directory is per machine.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
_EMPTY_INDEX = torch.empty(0, dtype=torch.int32)

_module: ModuleType | None = None
_problem: str | None = None


def _cache_dir() -> Path:
    return cache_root() / "cpu_kernel"


def _cpu_signature() -> bytes:
    """The instruction sets of this CPU (-march=native code must not run on another kind of CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor()).encode()
    except OSError:
        return (platform.machine() + platform.processor()).encode()


def build_problem() -> str | None:
    """Why the kernel cannot be used here (switched off, no compiler, failed build), or None."""
    load()
    return _problem


def build_name() -> str:
    """The extension's name and cache directory: a hash of what the compiled code depends on.

    The build records the environment's include paths, so each environment (and Python) gets
    its own; sharing one, torch's loader would rebuild silently whenever another used it.
    """
    environment = f"{torch.__version__} {Path(torch.__file__).parent} {sys.version}".encode()
    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(code + " ".join(CFLAGS).encode() + environment + _cpu_signature()).hexdigest()[:12]
    return f"siftattention_cpu_{key}"


def load() -> ModuleType | None:
    """The compiled extension, building it on first use; None where it cannot be built."""
    global _module, _problem
    if _module is not None or _problem is not None:
        return _module
    if os.environ.get("SIFTATTENTION_CPU_KERNEL", "1") == "0":
        _problem = "switched off by SIFTATTENTION_CPU_KERNEL=0"
        return None
    root = cache_root()
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        _problem = "no C++ compiler found"
    elif next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None) is not None:
        setting = "SIFTATTENTION_CACHE=" if os.environ.get("SIFTATTENTION_CACHE") else "the cache "
        _problem = f"{setting}{root} is not a directory (a file is in its place)"
    else:
        name = build_name()
        build_dir = _cache_dir() / name
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            if not any(build_dir.glob(f"{name}*.so")):
                print("siftattention: building the fused CPU decode kernel (once, about 30 s)", file=sys.stderr, flush=True)
            from torch.utils.cpp_extension import load as load_extension

            _module = load_extension(name=name, sources=[str(path) for path in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                                     build_directory=str(build_dir), verbose=False)
        except Exception as exc:  # an unwritable cache, a compiler or linker failure: fall back, say why once
            lines = str(exc).strip().splitlines() or [""]
            _problem = f"the build failed ({type(exc).__name__}: {lines[-1][:200]})"
    if _problem is not None:
        from ..notices import SiftWarning

        warnings.warn(f"siftattention: the fused CPU decode kernel is not used: {_problem}; the torch backend runs instead",
                      SiftWarning, stacklevel=3)
    return _module


def available() -> bool:
    return load() is not None


def _index(x: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY_INDEX if x is None else x


_SPARSE, _DENSE, _WARMUP, _ANCHORED = 0, 1, 2, 3
_NO_ETA = torch.empty(0, dtype=torch.float32)
_NO_TAU = torch.empty(0, dtype=torch.float64)


def _run(mode: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
         scale: float, seq_lens: torch.Tensor | None, starts: torch.Tensor | None, renormalize: bool,
         gap: torch.Tensor = _NO_ETA, first: int = 0, last: int = 0,
         value_sum: torch.Tensor | None = None, shared: bool = False) -> list[torch.Tensor]:
    v_rows = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    vs = _NO_ETA if value_sum is None else value_sum.float().contiguous()
    return load().decode(q.contiguous(), k_cache, v_rows, eta, tau, float(scale), _index(seq_lens), _index(starts),
                         bool(renormalize), mode, gap, int(first), int(last), vs, bool(shared))


def sift_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, eta: torch.Tensor, scale: float,
                    seq_lens: torch.Tensor | None, renormalize: bool, starts: torch.Tensor | None = None,
                    value_sum: torch.Tensor | None = None, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sift step: out [B, Hq, D] float32, kept [B, Hq] int32 (semantics of ``torch_ref.sift_decode_torch``).

    ``seq_lens`` and ``starts``: int32 [B] tensors or None; ``eta``: float32 [B, Hq]; ``value_sum``:
    [B, Hkv, D] for value-mean compensation (``torch_ref.value_mean_term``), or None; ``shared``: one kept
    set per KV group.
    """
    out, kept, _ = _run(_SPARSE, q, k_cache, v_cache, eta.float().contiguous(), _NO_TAU, scale, seq_lens, starts, renormalize,
                        value_sum=value_sum, shared=shared)
    return out, kept


def sift_anchored_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, log_eta: torch.Tensor,
                             gap: torch.Tensor, scale: float, seq_lens: torch.Tensor | None, renormalize: bool,
                             starts: torch.Tensor | None, first: int, last: int,
                             value_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sift step with the anchored normaliser (semantics of ``torch_ref.sift_anchored_decode_torch``):
    out [B, Hq, D] float32 and kept [B, Hq] int32; ``gap`` (float32 [B, Hq], contiguous) is read as
    the previous step's and overwritten with this step's."""
    if gap.dtype != torch.float32 or not gap.is_contiguous():
        raise ValueError("gap must be a contiguous float32 [B, Hq] tensor (it is updated in place)")
    out, kept, _ = _run(_ANCHORED, q, k_cache, v_cache, log_eta.float().contiguous(), _NO_TAU, scale, seq_lens, starts,
                        renormalize, gap, first, last, value_sum)
    return out, kept


def dense_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                     seq_lens: torch.Tensor | None, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention over the valid keys: out [B, Hq, D] float32."""
    return _run(_DENSE, q, k_cache, v_cache, _NO_ETA, _NO_TAU, scale, seq_lens, starts, False)[0]


def warmup_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tau: torch.Tensor, scale: float,
                      seq_lens: torch.Tensor | None, starts: torch.Tensor | None = None,
                      shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention and theta [B, Hq] float32, each head's tau-quantile (``tau``: float64 [B, Hq]; ``shared``:
    each KV group's maximum's, given to every head of the group).

    The probabilities are the ones ``sift_decode_cpu`` filters, bit for bit, so a threshold
    equal to theta drops exactly the keys at or below it there.
    """
    out, _, theta = _run(_WARMUP, q, k_cache, v_cache, _NO_ETA, tau.to(torch.float64).contiguous(), scale, seq_lens,
                         starts, False, shared=shared)
    return out, theta



def keybound_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: Int8Keys, eta: torch.Tensor,
                        scale: float, seq_lens: torch.Tensor | None, renormalize: bool,
                        starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key-bound Sift step (semantics of ``keybound.sift_keybound_decode_torch``): out [B, Hq, D] float32,
    kept [B, Hq] int32 and the key rows read in full per (batch row, KV head), [B, Hkv] int32.

    ``keys``: the int8 copy of ``k_cache`` (values [B, Hkv, >= L, D], scales [B, Hkv, >= L]; per channel,
    channel scales and offsets [B, Hkv, D]); only positions below ``k_cache``'s length are read.
    """
    values, scales, channel, offset = keys
    rows = [t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (k_cache, v_cache, values, scales, channel, offset)]
    k_rows, v_rows, values, scales, channel, offset = rows
    return tuple(load().keybound(q.contiguous(), k_rows, v_rows, values, scales, _NO_ETA if channel is None else channel,
                                 _NO_ETA if offset is None else offset, eta.float().contiguous(), float(scale),
                                 0.5 * scale * (1 + MARGIN), OFFSET_ROUNDING, SLACK2 * _LN2, _index(seq_lens),
                                 _index(starts), bool(renormalize)))


def write_int8_keys_cpu(keys: Int8Keys, k: torch.Tensor, start: int | None = None, index: torch.Tensor | None = None) -> None:
    """Quantise float32 keys ``k`` [B, Hkv, n, D] (any strides) into the CPU copy ``keys`` at positions
    ``[start, start + n)`` or at ``index`` [n] (int64 or int32), keeping its channel scales and offsets: bit for
    bit ``keybound.quantize_keys`` and the copy-in (``key_write.write_int8_keys`` routes here, backend "cpu")."""
    values, scales, channel, offset = keys
    per_channel = channel is not None
    load().write_keys(k, values, scales, channel if per_channel else _NO_ETA, offset if per_channel else _NO_ETA,
                      _index(index), 0 if start is None else int(start), INV_QMAX, _TINY_ROW if per_channel else _TINY)
