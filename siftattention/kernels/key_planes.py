"""Keys stored as two byte planes: the key-bound step without an int8 copy beside the cache (torch reference).

The key-bound step (``keybound.py``) keeps an int8 copy of every key row beside the 16-bit cache: D + 4
bytes a row, +25.8% of a 16-bit KV cache at D = 128. Here the cache's keys *are* 16-bit fixed point,
split into a high and a low byte, and the high plane serves as the int8 copy (its scale at most 2^-7 above
the copy's):

- Per row (per channel as ``keybound.quantize_keys``: the rows ``x = (k - o) / c`` with the prompt's
  channel scales and offsets, ``keybound.key_rows``) the least scale ``M = max(max|x| / 127, floor)``
  as today's copy's, then a power-of-two grid ``g = 2^(ceil(log2 M) - 8)`` and the plane scale
  ``c = m g``, ``m = ceil(M / g)`` in [129, 256]: ``c`` is ``M`` rounded up to 8 significant bits (at
  most ``M (1 + 2^-7)``), and ``g = 2^(ceil(log2 c) - 8)`` follows from ``c``, so one float32 a row.
- ``w = round(x / g)`` (exact: ``x / g`` is a power-of-two scaling, ``|w| <= 127 m``), the high plane
  ``h = floor((w + floor(m / 2)) / m)`` in [-127, 127] (int8) and the low plane ``l = w - m h`` in
  [-128, 127] (int8), ``|l| <= m / 2``. The stored key is ``x_s = g w = c h + g l`` (per channel
  ``o + c_d x_s``): 2 bytes a channel and 4 a row, the 16-bit cache's size plus 4 bytes a row (+0.8% of
  a 16-bit KV cache at D = 128; per channel 8 D more per (batch row, KV head), as the copy).

Exactness is with respect to the stored keys, and inherited from ``keybound.py``:
``|x_s - c h| = g |l| <= g m / 2 = c / 2`` holds exactly in every channel (integers times powers of
two), which is the one inequality the int8 copy's bound rests on (there ``|x - c k_hat| <= c / 2``),
with ``h`` int8 in [-127, 127] and ``c`` a normal float32 (``c >= M >= 2^-126``, per channel ``2^-116``)
as there. So ``keybound.score_bounds`` on ``Int8Keys(h, c, channel, offset)`` (``KeyPlanes.high_keys``)
bounds the stored key's exact score: ``|sm q . k_s - s_hat| <= e`` with the same ``e`` and ``MARGIN``,
whose float32 terms (the dot, ``q' = q c``, ``q . o``, what follows) are the same computations; the
quantisation's own rounding, which the copy's margin also absorbs, is not even needed here. The rest of
the step (``T_lo``, candidates, ``Z_est``, ``T_est``, epsilon) is ``keybound_step_torch`` with the stored
keys as the cache: the kept set is the float64 rule's on the stored keys except keys within epsilon (and
the float32 rounding the exact step has: the reference's stored keys are float32, exact per row, rounded
to 2^-24 relative per channel, ``o + c_d x_s``).

What the stored key loses against the 16-bit key it came from (per row; ``x = k``): nothing in any
element with ``|k| >= 2^7 g`` for bfloat16 keys (``2^10 g`` for float16): those are multiples of ``g``
below ``127 m g``, so ``w = k / g`` exactly; ``2^7 g`` lies in ``[M / 2, M)``, between ``max|k| / 254``
and ``max|k| / 127``. Smaller elements are rounded to the grid: ``|k - x_s| <= g / 2 < max|k| / 32512``
(bfloat16 keeps ``2^-8 |k|``; for float32 keys no element is sure to be exact). Per channel the grid is ``c_d g``
in each channel and nothing is kept exactly: ``|k - k_s| <= c_d g / 2 (1 + 2^-6)``, the ``2^-6`` covering
float32 rounding of ``(k - o) / c``. How far the stored keys' scores and kept sets are from the 16-bit
keys' is measured (``benchmarks/studies/key_planes.py``), not bounded here.

On a kernel the scan is the int8 copy's, reading the high plane and ``c``; a candidate's exact score is
the scan's dot ``q . h`` plus ``q . l`` times ``g / c``, so refine reads only its low plane: D bytes where
the copy reads the 16-bit row's 2 D (``keybound_bytes(..., planes=True)``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .keybound import MARGIN, QMAX, Int8Keys, key_rows, keybound_step_torch
from .torch_ref import _acc_dtype

#: A plane scale c = m g keeps m in [129, 256]: M rounded up to 8 significant bits.
GRID_BITS = 8


class KeyPlanes(NamedTuple):
    """A key cache as two byte planes: ``high`` and ``low`` [B, Hkv, S, D] int8, ``scales`` [B, Hkv, S] float32
    (the plane scale ``c``, the grid ``g`` derived from it) and, per channel, ``channel`` and ``offset``
    [B, Hkv, D] float32 (as ``Int8Keys``)."""

    high: torch.Tensor
    low: torch.Tensor
    scales: torch.Tensor
    channel: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    nbytes = Int8Keys.nbytes  # every tensor's bytes

    def high_keys(self) -> Int8Keys:
        """The high plane as the int8 copy ``keybound.score_bounds`` and ``keybound_step_torch`` take."""
        return Int8Keys(self.high, self.scales, self.channel, self.offset)


def plane_scales(least: torch.Tensor) -> torch.Tensor:
    """The plane scale ``c = m g`` (float32) of each row's least scale ``M`` (``least``, positive and normal):
    ``g = 2^(ceil(log2 M) - 8)``, ``m = ceil(M / g)`` in [129, 256]; ``M`` taken in float32 (rounded to nearest:
    ``|x| / c`` may pass 127 by ``2^-24``, which ``w``'s rounding and clamp absorb)."""
    m = least.float().double()  # float32 first: m / grid then lies in (128, 256]
    grid = grid_of(m)
    return (torch.ceil(m / grid) * grid).float()


def grid_of(scales: torch.Tensor) -> torch.Tensor:
    """The grid ``g = 2^(ceil(log2 c) - 8)`` (float64) of plane scales ``c`` (``M``'s too)."""
    mant, exp = torch.frexp(scales.double())  # c = mant 2^exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(mant), exp - GRID_BITS - (mant == 0.5).to(exp.dtype))


def quantize_planes(k: torch.Tensor, channel: tuple[torch.Tensor, torch.Tensor] | bool | None = None) -> KeyPlanes:
    """Keys ``k`` [B, Hkv, S, D] as planes: per row (``channel`` None) or with per-channel scales and offsets
    (``(c, o)`` from ``keybound.channel_ranges``, or True to take them from ``k``), as ``keybound.quantize_keys``."""
    x, least, c, o = key_rows(k, channel)
    scales = plane_scales(least)
    g = grid_of(scales)[..., None]
    m = torch.round(scales.double()[..., None] / g).long()  # exactly an integer in [129, 256]
    w = torch.round(x.double() / g).long()
    w = torch.minimum(torch.maximum(w, -QMAX * m), QMAX * m)  # binds only where |x| passes 127 M by its ulp
    high = torch.div(w + m // 2, m, rounding_mode="floor")
    return KeyPlanes(high.to(torch.int8), (w - m * high).to(torch.int8), scales, c, o)


def reconstruct_keys(planes: KeyPlanes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored keys [B, Hkv, S, D] in ``dtype``: ``c h + g l`` (exact in float32 per row), per channel
    ``o + c_d (c h + g l)``."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    c = planes.scales.to(acc)[..., None]
    g = grid_of(planes.scales).to(acc)[..., None]
    x = c * planes.high.to(acc) + g * planes.low.to(acc)
    if planes.channel is not None:
        x = planes.offset.to(acc)[:, :, None, :] + planes.channel.to(acc)[:, :, None, :] * x
    return x.to(dtype)


def reconstruction_bound(planes: KeyPlanes) -> torch.Tensor:
    """Per element, a bound on ``|k - k_s|`` (float64, broadcast to [B, Hkv, S, D]) between the keys that were
    quantised and the stored keys: ``g / 2`` per row, ``c_d g / 2 (1 + MARGIN)`` per channel."""
    half = grid_of(planes.scales)[..., None] / 2
    if planes.channel is None:
        return half.expand(planes.high.shape)
    return half * planes.channel.double()[:, :, None, :] * (1 + MARGIN)


def keybound_step_planes(
    q: torch.Tensor, planes: KeyPlanes, v_cache: torch.Tensor, eta: torch.Tensor, scale: float,
    seq_lens: torch.Tensor | None, renormalize: bool, starts: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``keybound.keybound_step_torch`` over planes: the scan from the high plane, exact scores of the stored keys
    (float32; float64 for float64 q). Same terms: ``out``, ``kept``, ``keep``, ``candidates``, ``epsilon``, ..."""
    k_stored = reconstruct_keys(planes, _acc_dtype(q))
    return keybound_step_torch(q, k_stored, v_cache, planes.high_keys(), eta, scale, seq_lens, renormalize, starts)


def key_bytes_per_row(head_dim: int, elem_bytes: int = 2) -> dict[str, int]:
    """Bytes a key row takes with its value row: the 16-bit cache (``dense``), with the int8 copy beside it
    (``int8_copy``), as planes (``planes``); per channel both forms add 8 D per (batch row, KV head)."""
    dense = 2 * head_dim * elem_bytes
    return dict(dense=dense, int8_copy=dense + head_dim + 4, planes=2 * head_dim + head_dim * elem_bytes + 4)
