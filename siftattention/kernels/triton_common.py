"""Triton helpers shared by the decode kernels (``triton_decode``'s passes and
``triton_quantile``'s select): the launch (or, while compiling ahead, the compilation) of a
kernel, the dot with the interpreter's bf16 workaround, a row's valid key range, its split
ranges, and the merge of per-split softmax statistics."""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, Iterator

import triton
import triton.language as tl

_INT_MAX = tl.constexpr(2147483647)

_COMPILING: ContextVar[bool] = ContextVar("siftattention_compiling", default=False)


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)``; inside ``compiling()`` only its compilation for these arguments."""
    if _COMPILING.get():
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def compile_threads() -> int:
    """Threads for compiling ahead: ``SIFTATTENTION_COMPILE_THREADS``, else up to 8 (0 or 1: one at a time)."""
    value = os.environ.get("SIFTATTENTION_COMPILE_THREADS")
    if value is not None and value.strip().isdigit():
        return int(value)
    return min(8, os.cpu_count() or 1)


@contextlib.contextmanager
def compiling(threads: int | None = None) -> Iterator[None]:
    """Kernels ``launch``ed inside are compiled, not run; every compilation has finished on exit.

    The compilations run side by side on a thread pool where Triton offers it (its
    ``AsyncCompileMode``; ptxas runs as a process of its own, the Python part of the lowering
    does not overlap), so a step's kernels cost nearer the slowest one's compile than the sum.
    """
    threads = compile_threads() if threads is None else threads
    token = _COMPILING.set(True)
    try:
        with contextlib.ExitStack() as stack:
            if threads > 1:
                try:
                    from triton.runtime._async_compile import AsyncCompileMode, active_mode
                except ImportError:  # an older Triton: one after another
                    active_mode = None
                if active_mode is not None and active_mode.get() is None:
                    # Exits first, waiting for every compilation; then the pool shuts down.
                    stack.enter_context(AsyncCompileMode(stack.enter_context(ThreadPoolExecutor(threads))))
            yield
    finally:
        _COMPILING.reset(token)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: Triton's CPU interpreter (3.9) computes bf16 dots wrongly; fp32 is exact there.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """[begin, end) of batch row b's valid keys."""
    if HAS_SEQ_LENS:
        end = tl.minimum(tl.load(SeqLens + b), S_MAX)
    else:
        end = S_MAX
    if HAS_STARTS:
        begin = tl.maximum(tl.load(Starts + b), 0)
    else:
        begin = tl.full([], 0, tl.int32)  # a tensor even where S_MAX is specialised to a constant
    return begin, end


@triton.jit
def _split_range(begin, end, split, NUM_SPLITS, BLOCK: tl.constexpr):
    """[lo, hi) of one split: the valid range cut into NUM_SPLITS runs of whole BLOCKs."""
    n_blocks = tl.cdiv(end - begin, BLOCK)
    per = tl.cdiv(n_blocks, NUM_SPLITS) * BLOCK
    lo = begin + split * per
    return lo, tl.minimum(lo + per, end)


@triton.jit
def _row_ml(Mst, Lst, row, g_mask, NUM_SPLITS, BLOCK_S: tl.constexpr):
    """Merge per-split (max, sum of exp2) into the row max M and normaliser L.

    One [heads, splits] tile load (a loop over the splits would serialise their
    load latencies in every program's preamble). Empty splits hold (-inf, 0).
    """
    offs_s = tl.arange(0, BLOCK_S)
    ptr = row[:, None] * NUM_SPLITS + offs_s[None, :]
    msk = g_mask[:, None] & (offs_s[None, :] < NUM_SPLITS)
    mst = tl.load(Mst + ptr, mask=msk, other=float("-inf"))
    lst = tl.load(Lst + ptr, mask=msk, other=0.0)
    m = tl.max(mst, axis=1)
    m = tl.where(g_mask, m, 0.0)  # padded heads: keep arithmetic finite
    l = tl.sum(tl.where(msk & (mst > float("-inf")), lst * tl.math.exp2(mst - m[:, None]), 0.0), axis=1)
    return m, tl.where(g_mask, l, 1.0), mst, ptr, msk
