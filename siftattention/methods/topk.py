"""Top-k attention (Gupta et al. 2021): keep the ceil(k*S) largest scores of each row.

``vmc=True`` (with ``renormalize=False``) adds value-mean compensation: the pruned probability mass
times the mean of the row's valid value rows. The decode step reads every value row anyway (a
torch step), so the mean comes through the weights, with no running sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .base import DecodeOutput, KeyRange, Method, Rows, Selection, check_bool, check_fraction, check_vmc, compensate_value_mean


@dataclass
class TopK(Method):
    """Keep the ``ceil(k * S)`` highest-scoring keys of every step; renormalise by default."""

    k: float = 0.125
    renormalize: bool = True
    vmc: bool = False
    name = "topk"
    spec_optional: ClassVar[tuple[str, ...]] = ("vmc",)

    def __post_init__(self) -> None:
        self.k = check_fraction("k", self.k, high_open=False)
        self.renormalize = check_bool("renormalize", self.renormalize)
        self.vmc = check_vmc(self.vmc, self.renormalize)

    def budget(self, steps: torch.Tensor) -> torch.Tensor:
        """Keys kept at step S: ceil(k*S), at least 1 (computed in float64 to match the closed form)."""
        return torch.ceil(steps.to(torch.float64) * self.k).clamp(min=1).long()

    def select(self, rows: Rows, state: None) -> Selection:
        probs = rows.probs
        budget = self.budget(rows.steps).clamp(max=probs.shape[-1])[:, None, :, None]  # [B, 1, R, 1]
        # A partial topk up to the largest budget in the chunk is much cheaper than sorting
        # whole rows; each row then keeps its first `budget` indices (exactly that many).
        top = torch.topk(probs, int(budget.max()), dim=-1, sorted=True).indices
        within = torch.arange(top.shape[-1], device=probs.device) < budget
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top, within.expand_as(top)) & rows.valid
        return Selection(keep=keep, approx=rows.is_step)

    def decode_phase(self, step: int) -> str:
        return "sparse"

    def decode_step(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange, state: None, phase: str, kernels: Any) -> DecodeOutput:
        from ..attention import decode_probs, weighted_values

        probs, valid = decode_probs(query, k_cache, keys, kernels.scale)
        budget = self.budget(keys.steps())[:, None, None]  # [B, 1, 1]
        # Rank every key by a full sort (no host-side k, so the step can be captured in a graph).
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
        keep = (ranks < budget) & valid
        weights = probs * keep
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
        if self.vmc:
            weights = compensate_value_mean(weights, valid, keys.steps().float()[:, None, None])
        return DecodeOutput(weighted_values(weights, v_cache, query.dtype), keep.sum(-1, dtype=torch.int32), True)
