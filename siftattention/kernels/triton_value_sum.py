"""``value_sum.add_step_value_rows`` as one launch: a program per sequence walks its KV heads, so the
sliding window's old start is read and rewritten by the one program that uses it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import launch
from .triton_config import _pow2


@triton.jit
def _add_step_value_rows_kernel(ValueSum, ValueStart, V, SeqLens, Starts, L,
                                stride_sb, stride_sh, stride_vb, stride_vh, stride_vs,
                                HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SLIDE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    d_mask = offs < D
    new = tl.minimum(tl.maximum(tl.load(SeqLens + b).to(tl.int64) - 1, 0), L - 1)
    if SLIDE:
        start = tl.load(Starts + b)
        old = tl.load(ValueStart + b)
        leaves = start > old
        old_row = tl.minimum(tl.maximum(old.to(tl.int64), 0), L - 1)
    for h in range(HKV):
        v_base = V + b * stride_vb + h * stride_vh
        s_ptr = ValueSum + b * stride_sb + h * stride_sh + offs
        total = tl.load(s_ptr, mask=d_mask, other=0.0)
        total += tl.load(v_base + new * stride_vs + offs, mask=d_mask, other=0.0).to(tl.float32)
        if SLIDE:
            old_v = tl.load(v_base + old_row * stride_vs + offs, mask=d_mask, other=0.0).to(tl.float32)
            total -= tl.where(leaves, old_v, 0.0)
        tl.store(s_ptr, total, mask=d_mask)
    if SLIDE:
        tl.store(ValueStart + b, start.to(ValueStart.dtype.element_ty))


def add_step_value_rows_triton(value_sum: torch.Tensor, value_start: torch.Tensor, v_cache: torch.Tensor,
                               seq_lens: torch.Tensor, starts: torch.Tensor | None) -> None:
    B, H, L, D = v_cache.shape
    if v_cache.stride(3) != 1 or value_sum.stride(2) != 1:
        raise ValueError("the value cache and the value sum need unit stride along head_dim")
    slide = starts is not None
    launch(_add_step_value_rows_kernel, (B,),
           value_sum, value_start, v_cache, seq_lens, starts if slide else seq_lens, L,
           value_sum.stride(0), value_sum.stride(1), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
           HKV=H, D=D, BLOCK_D=_pow2(D), SLIDE=slide, num_warps=1)
