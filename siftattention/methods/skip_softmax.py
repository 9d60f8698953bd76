"""Skip-Softmax (BLASST, Yuan et al. 2025; TensorRT-LLM's skip-softmax attention).

A flash-attention kernel streams the keys in blocks and keeps a running maximum of the
scores. Skip-Softmax drops a block whose largest score lies more than ``-log(lambda)``
below the running maximum of the blocks before it,

    max(block) - m_prev < log(lambda),   lambda = scale / S,

with S the row's valid keys (TensorRT-LLM's ``threshold_scale_factor``: one scale per model
and phase, the threshold falling as the context grows). A skipped block adds nothing to the
softmax's numerator or denominator and its value rows are never read, so the output is the
softmax over the kept blocks. The first block holding a valid key is never skipped
(``m_prev = -inf``), and ``lambda >= 1`` skips nothing (TensorRT-LLM turns skipping off there).

Blocks are ``block`` cache positions wide, aligned on position 0, taken in position order
with one running maximum per row (a kernel with several splits per row would restart it
per split). A decode kernel reads a block's keys once for every query head of a KV group
and can skip it only when all of them agree: that is the default; ``per_head=True`` decides
per query head instead (NVIDIA Model-Optimizer's emulation, which overstates what a GQA
kernel can skip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .base import DecodeOutput, KeyRange, Method, Rows, Selection, check_bool, check_int, check_real


def skip_softmax_keep(scores: torch.Tensor, log_lambda: torch.Tensor, block: int, groups: int) -> torch.Tensor:
    """Keys in blocks that are not skipped: ``scores`` [B, H, R, K] (-inf at invalid keys),
    ``log_lambda`` broadcastable to [B, H, R]; ``groups`` query heads vote together (1: per head)."""
    B, H, R, K = scores.shape
    block = min(block, K)  # a block wider than the row is the whole row: never pad to its width
    nb = -(-K // block)
    s = F.pad(scores, (0, nb * block - K), value=float("-inf")).view(B, H, R, nb, block)
    block_max = s.amax(-1)  # [B, H, R, nb]
    before = torch.cat([torch.full_like(block_max[..., :1], float("-inf")), block_max.cummax(-1).values[..., :-1]], -1)
    # Before any valid key the difference is +inf or NaN: never skipped.
    skip = (block_max - before) < log_lambda[..., None]
    if groups > 1:
        skip = skip.view(B, H // groups, groups, R, nb).all(2, keepdim=True).expand(-1, -1, groups, -1, -1).reshape(B, H, R, nb)
    return (~skip).repeat_interleave(block, -1)[..., :K]


@dataclass
class SkipSoftmax(Method):
    """Skip key blocks whose maximum falls ``-log(scale / S)`` below the running maximum."""

    scale: float = 16.0
    block: int = 128
    per_head: bool = False
    name = "skipsoftmax"
    renormalize = True  # skipped blocks are absent from the softmax

    def __post_init__(self) -> None:
        self.scale = check_real("scale", self.scale, positive=True)
        self.block = check_int("block", self.block, 1)
        self.per_head = check_bool("per_head", self.per_head)

    def log_lambda(self, steps: torch.Tensor) -> torch.Tensor:
        """log(scale / S) per row, -inf where lambda >= 1 (nothing skipped)."""
        log_lam = math.log(self.scale) - steps.float().log()
        return log_lam.masked_fill(log_lam >= 0, float("-inf"))

    def _keep(self, scores: torch.Tensor, steps: torch.Tensor, groups: int) -> torch.Tensor:
        return skip_softmax_keep(scores, self.log_lambda(steps), self.block, 1 if self.per_head else groups)

    def select(self, rows: Rows, state: None) -> Selection:
        keep = self._keep(rows.scores, rows.steps[:, None, :], rows.groups) & rows.valid
        return Selection(keep=keep, approx=rows.is_step)

    def decode_phase(self, step: int) -> str:
        return "sparse"

    def decode_step(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange, state: None, phase: str, kernels: Any) -> DecodeOutput:
        from ..kernels.torch_ref import _kept_output, _probs, _scores

        scores, valid = _scores(query, k_cache, kernels.scale, keys.seq_lens, keys.starts)
        groups = query.shape[1] // k_cache.shape[1]
        keep = self._keep(scores[:, :, None], keys.steps()[:, None, None], groups)[:, :, 0] & valid
        out, kept = _kept_output(_probs(scores), keep, v_cache, True, query.dtype)
        return DecodeOutput(out, kept, True)
