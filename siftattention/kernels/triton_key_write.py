"""The int8 key copy's write (``key_write.write_int8_keys``) as one launch: new keys quantised exactly as
``keybound.quantize_keys`` does, per row or with the copy's channel scales and offsets, and stored at
positions ``[start, start + n)`` or at the device positions ``index`` (no host sync: a decode step's write
inside a CUDA graph is one node per layer, not the torch form's ten or so).

Bit for bit the torch form's: the key in float32, per channel ``(k - o) / c``, the scale ``max(max|x| *
float32(1 / 127), least)``, ``round(x / scale)`` half to even, clamped to +-127. Divisions are IEEE
(``div_rn``: Triton's ``/`` may be approximate on the GPU) and the rounding is the float32 addition of
``1.5 * 2^23`` (``|x / scale| <= 127``, far below 2^22, so the sum's unit is 1 and ties go to even), which
runs alike on the GPU and in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .keybound import _TINY, _TINY_ROW, INV_QMAX, QMAX, Int8Keys
from .plan import on_device
from .triton_common import launch
from .triton_config import _cdiv, _pow2

_ROUND = tl.constexpr(1.5 * 2.0**23)
#: Elements of one program's [rows, head_dim] tile (a decode write of a few rows is one or two programs).
_TILE = 2048


@triton.jit
def _key_write_kernel(
    K, Values, Scales, Chan, Off, Index,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_sb, stride_sh, stride_ss, stride_cb, stride_ch, stride_cd, stride_ob, stride_oh, stride_od,
    start, N, ROWS,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_CHANNEL: tl.constexpr, HAS_INDEX: tl.constexpr, INV_Q: tl.constexpr, LEAST: tl.constexpr,
    QLIM: tl.constexpr,
):
    """BLOCK_R of the B * Hkv * n new key rows (row r: batch r // (Hkv n), head r // n % Hkv, new key r % n)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = r < ROWS
    d_mask = offs_d < D
    mask = r_mask[:, None] & d_mask[None, :]
    i = r % N
    bh = r // N
    b = bh // HKV
    h = bh % HKV
    k = tl.load(K + (b * stride_kb + h * stride_kh + i * stride_kn)[:, None] + offs_d[None, :] * stride_kd,
                mask=mask, other=0.0)
    x = k.to(tl.float32)
    if HAS_CHANNEL:
        c = tl.load(Chan + (b * stride_cb + h * stride_ch)[:, None] + offs_d[None, :] * stride_cd, mask=mask, other=1.0)
        o = tl.load(Off + (b * stride_ob + h * stride_oh)[:, None] + offs_d[None, :] * stride_od, mask=mask, other=0.0)
        x = tl.math.div_rn(x - o, c)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) * INV_Q, LEAST)
    y = tl.math.div_rn(x, scale[:, None])
    q = (y + _ROUND) - _ROUND
    q = tl.minimum(tl.maximum(q, -QLIM), QLIM)
    if HAS_INDEX:
        pos = tl.load(Index + i, mask=r_mask, other=0).to(tl.int64)
    else:
        pos = start + i
    tl.store(Values + (b * stride_vb + h * stride_vh + pos * stride_vs)[:, None] + offs_d[None, :] * stride_vd,
             q.to(tl.int8), mask=mask)
    tl.store(Scales + b * stride_sb + h * stride_sh + pos * stride_ss, scale, mask=r_mask)


def write_int8_keys_triton(keys: Int8Keys, k: torch.Tensor, start: int | None = None,
                           index: torch.Tensor | None = None) -> None:
    """Quantise ``k`` [B, Hkv, n, D] (float16, bfloat16 or float32, any strides) into ``keys`` at positions
    ``[start, start + n)`` or at ``index`` [n] (a device tensor), keeping the copy's channel scales and
    offsets; one launch."""
    B, H, n, D = k.shape
    rows = B * H * n
    if rows == 0:
        return
    values, scales, chan, off = keys
    per_channel = chan is not None
    block_d = _pow2(D)
    block_r = min(_pow2(rows), max(1, _TILE // block_d))
    has_index = index is not None
    with on_device(k.device):  # Triton launches on the current device; a device map puts layers on others
        launch(_key_write_kernel, (_cdiv(rows, block_r),),
               k, values, scales, chan if per_channel else scales, off if per_channel else scales,
               index if has_index else scales,
               *k.stride(), *values.stride(), *scales.stride(), *(chan.stride() if per_channel else (0, 0, 0)),
               *(off.stride() if per_channel else (0, 0, 0)),
               0 if has_index else start, n, rows,
               HKV=H, D=D, BLOCK_R=block_r, BLOCK_D=block_d, HAS_CHANNEL=per_channel, HAS_INDEX=has_index,
               INV_Q=INV_QMAX, LEAST=_TINY_ROW if per_channel else _TINY, QLIM=float(QMAX),
               num_warps=max(1, min(4, block_r * block_d // 512)))
