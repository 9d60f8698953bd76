"""H2O (Zhang et al. 2023): heavy-hitter + recent-window KV eviction.

The cache keeps at most ``ceil(k * S)`` keys at step S: ``heavy_ratio`` of that
budget goes to the keys with the largest accumulated attention (summed over all
earlier queries), the rest to the most recent keys; the current key is always
kept. Eviction is permanent. The current query attends over the surviving cache
(so its probabilities renormalise over it) and its attention is added to the
accumulated scores. Rows are simulated one at a time, as H2O's reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method, Rows, Selection, check_fraction, select_sequences


@dataclass
class H2OState:
    accumulated: torch.Tensor  # [B, H, K] attention received by each key so far
    evicted: torch.Tensor  # [B, H, K] bool, permanently gone


def _grow(t: torch.Tensor, length: int) -> torch.Tensor:
    """Extend the key axis of a state tensor as the cache grows (new keys start at 0/False)."""
    if t.shape[-1] >= length:
        return t
    return torch.cat([t, t.new_zeros(*t.shape[:-1], length - t.shape[-1])], dim=-1)


@dataclass
class H2O(Method):
    """Keep heavy hitters + recent keys within a budget of ``k`` of the keys seen."""

    k: float = 0.125
    heavy_ratio: float = 0.5
    name = "h2o"
    renormalize = True  # evicted keys are gone, so the softmax runs over the cache only

    def __post_init__(self) -> None:
        self.k = check_fraction("k", self.k, high_open=False)
        self.heavy_ratio = check_fraction("heavy_ratio", self.heavy_ratio, low_open=False, high_open=False)

    def new_state(self, batch: int, heads: int, device: torch.device, layer: int = 0) -> H2OState:
        return H2OState(
            accumulated=torch.zeros(batch, heads, 0, device=device),
            evicted=torch.zeros(batch, heads, 0, dtype=torch.bool, device=device),
        )

    def reorder_state(self, state: H2OState, index: torch.Tensor) -> H2OState:
        return select_sequences(state, index)  # each sequence's accumulated attention and evictions

    def _fit_state(self, state: H2OState, keys: int) -> None:
        state.accumulated = _grow(state.accumulated, keys)
        state.evicted = _grow(state.evicted, keys)

    def _cache_for_step(self, cache: torch.Tensor, acc: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Select the kept cache ([B, H, K] bool) for one row, given its step per sequence [B]."""
        budget = torch.ceil(steps.to(torch.float64) * self.k).clamp(min=1).long()
        heavy = torch.minimum(torch.floor(budget * self.heavy_ratio).long(), budget - 1)
        recent = (budget - heavy)[:, None, None]
        # Recent: the last `recent` cached keys by position.
        from_end = torch.flip(torch.cumsum(torch.flip(cache.long(), [-1]), -1), [-1]) - 1
        keep_recent = cache & (from_end < recent)
        # Heavy hitters among the other cached keys, by accumulated attention.
        candidates = cache & ~keep_recent
        score = torch.where(candidates, acc, torch.full_like(acc, -1.0))
        order = torch.argsort(score, dim=-1, descending=True, stable=True)
        ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(acc.shape[-1], device=acc.device).expand_as(order))
        keep_heavy = candidates & (ranks < heavy[:, None, None])
        return keep_recent | keep_heavy

    def select(self, rows: Rows, state: H2OState) -> Selection:
        B, H, R, K = rows.probs.shape
        self._fit_state(state, K)
        keep = rows.valid.expand(B, H, R, K).clone()
        probs = rows.probs.clone()
        for r in range(R):
            valid = rows.valid[:, :, r]  # [B, 1, K]
            step = rows.is_step[:, r]
            cache = valid & ~state.evicted[..., :K]
            kept = self._cache_for_step(cache, state.accumulated[..., :K], rows.steps[:, r])
            kept = torch.where(step[:, None, None], kept, valid.expand_as(kept))
            state.evicted[..., :K] |= cache & ~kept
            p = rows.probs[:, :, r] * kept
            p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
            state.accumulated[..., :K] += p
            keep[:, :, r] = kept
            probs[:, :, r] = p
        return Selection(keep=keep, approx=rows.is_step, probs=probs)

    def observes_prefill(self) -> bool:
        return True

    def observe_prefill(self, rows: Rows, state: H2OState) -> None:
        # The prompt is attended exactly; its attention still counts towards the heavy hitters.
        self._fit_state(state, rows.probs.shape[-1])
        state.accumulated[..., : rows.probs.shape[-1]] += rows.probs.sum(dim=2)
