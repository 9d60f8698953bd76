"""The anchored normaliser's gap after an exact warmup step (``warmup_gap``): one small launch
that reads the scores and split statistics the warmup left in the workspace."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import _anchor_stats, _row_ml, _row_range, launch
from .triton_config import KernelConfig, Workspace, _pow2


@triton.jit
def _warmup_gap_kernel(Scores, Mst, Lst, SeqLens, Starts, Gap, S_MAX, NUM_SPLITS,
                       HQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                       FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr,
                       HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """One batch row's gaps ``L - A`` (natural log) from an exact step's stored scores and split statistics."""
    b = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < HQ
    row = b.to(tl.int64) * HQ + offs_h
    m, l, _, _, _ = _row_ml(Mst, Lst, row, h_mask, NUM_SPLITS, BLOCK_S)
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    m_a, l_a = _anchor_stats(Scores + row[:, None] * S_MAX, begin + FIRST, tl.maximum(begin + FIRST, end - LAST),
                             begin, end, h_mask, FIRST, LAST, BLOCK_F, BLOCK_L)
    gap = (m + tl.math.log2(l) - m_a - tl.math.log2(l_a)) * 0.6931471805599453
    tl.store(Gap + row, tl.where(l > 0.0, gap, 0.0), mask=h_mask)  # no keys: 0, as _gap


def warmup_gap(geo: dict, ws: Workspace, seq_lens, starts, first: int, last: int, cfg: KernelConfig) -> torch.Tensor:
    """The anchored normaliser's gap [B, Hq] of the warmup step just run on ``ws``: its exact
    log-sum-exp (from the split statistics) minus that of its anchor keys (read from the
    stored scores), in natural log. One small launch."""
    B, Hq = geo["B"], geo["Hq"]
    mst, lst, ns = (ws.dm, ws.dl, geo["nsd"]) if cfg.warmup_dense else (ws.mst, ws.lst, geo["ns1"])
    gap = torch.empty(B, Hq, device=ws.scores.device, dtype=torch.float32)
    has_sl, has_st = seq_lens is not None, starts is not None
    launch(_warmup_gap_kernel, (B,),
        ws.scores, mst, lst, seq_lens if has_sl else gap, starts if has_st else gap, gap, geo["S"], ns,
        HQ=Hq, BLOCK_H=_pow2(Hq), BLOCK_S=_pow2(ns), FIRST=first, LAST=last, BLOCK_F=_pow2(first),
        BLOCK_L=_pow2(last), HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st, num_warps=4,
    )
    return gap
