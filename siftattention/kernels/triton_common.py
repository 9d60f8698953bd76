"""Triton helpers shared by the decode kernels (the passes, ``triton_quantile``'s select and
``triton_onepass``): the launch (or, while compiling ahead, the compilation) of a kernel, the dot
with the interpreter's bf16 workaround, a row's valid key range, its split ranges, the merge of
per-split softmax statistics, a KV group's query tile, and the anchor keys' statistics."""

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


@triton.jit
def _group_query(Q, b, hkv, stride_qb, stride_qh, stride_qd, HQ: tl.constexpr, G: tl.constexpr,
                 BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The query rows of one (batch, KV head)'s group on a BLOCK_G x BLOCK_D tile (padding 0),
    their (batch, query head) row indices and the head and feature masks."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    h = hkv * G + offs_g
    row = b.to(tl.int64) * HQ + h
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    return q, row, g_mask, d_mask


@triton.jit
def _stored_run(s_base, lo, hi, g_mask, BLOCK: tl.constexpr):
    """Max and sum of exp2 over the stored scores of keys [lo, hi) (at most BLOCK keys), one load;
    (-inf, 0) for an empty run."""
    o = lo + tl.arange(0, BLOCK)
    s = tl.load(s_base + o[None, :], mask=g_mask[:, None] & (o < hi)[None, :], other=float("-inf"))
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.math.exp2(s - m_safe[:, None]), axis=1)


@triton.jit
def _anchor_stats(s_base, first_hi, last_lo, lo, hi, mask, FIRST: tl.constexpr, LAST: tl.constexpr,
                  BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr):
    """(max, sum of exp2) of the stored scores of the anchor keys within [lo, hi): the first
    run ends at ``first_hi``, the newest starts at ``last_lo``; (-inf, 0) where there is none."""
    m_a = tl.full(mask.shape, float("-inf"), tl.float32)
    l_a = tl.zeros(mask.shape, tl.float32)
    if FIRST > 0:
        m_a, l_a = _stored_run(s_base, lo, tl.minimum(hi, first_hi), mask, BLOCK_F)
    if LAST > 0:
        m2, l2 = _stored_run(s_base, tl.maximum(lo, last_lo), hi, mask, BLOCK_L)
        m_new = tl.maximum(m_a, m2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_a = l_a * tl.math.exp2(m_a - m_safe) + l2 * tl.math.exp2(m2 - m_safe)
        m_a = m_new
    return m_a, l_a


@triton.jit
def _narrow(x, offs_from, offs_to):
    """Re-lay a per-head vector onto another head tile, bit-exactly (one term per sum)."""
    sel = offs_to[:, None] == offs_from[None, :]
    return tl.sum(tl.where(sel, x[None, :], tl.zeros_like(x)[None, :]), axis=1)
