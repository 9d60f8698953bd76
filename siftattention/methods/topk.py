"""Top-k attention (Gupta et al. 2021): keep the ceil(k*S) largest scores of each row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method, Rows, Selection, check_fraction


@dataclass
class TopK(Method):
    """Keep the ``ceil(k * S)`` highest-scoring keys of every step; renormalise by default."""

    k: float = 0.125
    renormalize: bool = True
    name = "topk"

    def __post_init__(self) -> None:
        self.k = check_fraction("k", self.k, high_open=False)

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
