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
        # Rank of every key within its row (0 = largest); invalid keys have p = 0 and
        # sort after every valid one, whose probability is positive.
        order = torch.argsort(probs, dim=-1, descending=True, stable=True)
        ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(probs.shape[-1], device=probs.device).expand_as(order))
        budget = self.budget(rows.steps)[:, None, :, None]
        keep = (ranks < budget) & rows.valid
        return Selection(keep=keep, approx=rows.is_step)
