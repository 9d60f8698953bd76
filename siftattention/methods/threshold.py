"""The threshold methods: keep, in each row, the keys above a threshold of the method's own.

Sift (a power law in S), the Oracle (the row's exact tau-quantile) and Top-theta (a calibrated
score per row length) differ only in the threshold. ``ThresholdMethod`` owns everything else, on
the reference path (``select``) and the decode path (``decode_step``) alike:

- the filter: ``p > eta`` with probabilities (``eta <= 0`` keeps every valid key, ``eta >= 1`` and
  NaN only the maximum), or ``s > theta`` with scaled scores (``theta = -inf`` keeps every key);
- the row's maximum, always kept, so no row goes empty;
- with ``gqa="shared"`` (Sift's option; the threshold then equal over each KV group's query heads) one
  kept set per KV group: a key is kept for every head of the group when some head passes;
- rows the method does not approximate (its warmup) keep every valid key;
- the output: the full-softmax normaliser, the kept mass (``renormalize``), and value-mean
  compensation (``vmc``): the pruned probability mass times the mean of the row's valid value rows.

On the decode path a kernel reads only the value rows some head keeps, so the mean comes from a
running sum of each KV head's valid value rows in the state (``ThresholdState``; docs/design.md,
"Value-mean compensation"). Compensation needs ``renormalize=False`` (after renormalisation the
kept mass is 1); Top-theta, whose ``vmc`` defaults to True, keeps accepting both, and then
compensates nothing.

A subclass supplies ``row_thresholds`` for a chunk of teacher-forced rows and ``step_threshold``
for one decode step. Probability thresholds run through the decode kernels (``DecodeKernels``);
score thresholds through the torch reference (no kernel filters on raw scores).

Top-k is not one of them: it keeps exactly ``ceil(k * S)`` keys, ties broken by position, which
no threshold ``p > eta`` can say where probabilities tie. Skip-Softmax neither: its threshold
moves along the row with the running maximum of the blocks before each block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ..kernels.arguments import PowerLawThreshold
from ..kernels.torch_ref import group_keep
from ..kernels.value_sum import add_step_value_rows
from .base import (DecodeOutput, KeyRange, Method, PromptChunk, Rows, Selection, compensate_value_mean, keep_row_max,
                   put_in_place, select_sequences, sum_value_rows)


@dataclass(kw_only=True)
class ThresholdState:
    """What every threshold method's per-(sequence, layer) state can hold besides its own, for value-mean
    compensation at decode steps: the running sum of each KV head's valid value rows and the first valid
    cache position it covers. None until a prompt forms them."""

    value_sum: torch.Tensor | None = None  # [B, Hkv, D] float32
    value_start: torch.Tensor | None = None  # [B] int32


@dataclass
class RowThresholds:
    """A threshold method's decision for a chunk of rows.

    eta:    [B, H, R] float32 threshold per row, in the method's ``threshold_space``; None when no
            row of the chunk is approximated.
    approx: [B, R] bool, the rows the threshold filters; the others keep every valid key.
    """

    eta: torch.Tensor | None
    approx: torch.Tensor


@dataclass
class StepThreshold:
    """A threshold method's decision for one decode step.

    eta:     [B, Hq] float32 (or, in probabilities, a ``PowerLawThreshold`` the kernels evaluate),
             or None for an exact step.
    approx:  [B] bool or one bool: the rows the method approximates.
    out:     an exact step's output where the method already has it (a warmup kernel that also
             measured the quantile); None runs the dense kernel.
    anchors: (gap, first, last) for Sift's anchored normaliser (``DecodeKernels.sparse_anchored``).
    """

    eta: torch.Tensor | PowerLawThreshold | None
    approx: torch.Tensor | bool = True
    out: torch.Tensor | None = None
    anchors: tuple[torch.Tensor, int, int] | None = None


class ThresholdMethod(Method):
    """Base of the methods that keep the keys above a per-row threshold (and the row's maximum)."""

    #: "prob": the threshold is on softmax probabilities; "score": on scaled pre-softmax scores
    threshold_space: ClassVar[Literal["prob", "score"]] = "prob"
    #: "head": each query head keeps its own set; "shared": each KV group one (a method whose thresholds are
    #: equal over a group's heads: Sift's ``gqa`` field)
    gqa: str = "head"

    @property
    def shared(self) -> bool:
        return self.gqa == "shared"

    @property
    def tracks_values(self) -> bool:
        """Whether decode steps keep the running value sum: compensation through the kernels (a probability
        threshold without renormalisation; the score path reads every value row anyway)."""
        return self.vmc and not self.renormalize and self.threshold_space == "prob"

    def new_state(self, batch: int, heads: int, device: torch.device, layer: int = 0) -> ThresholdState | None:
        return ThresholdState() if self.tracks_values else None

    def reorder_state(self, state: Any, index: torch.Tensor) -> Any:
        return None if state is None else select_sequences(state, index)

    def observes_prompt(self) -> bool:
        return self.tracks_values

    def observe_prompt(self, chunk: PromptChunk, state: Any) -> None:
        """The running value sum starts from the prompt's valid value rows (each chunk sums them all again)."""
        if self.tracks_values:
            # In place where the state has them: a session's captured decode steps read these tensors.
            put_in_place(state, "value_sum", chunk.value_sum())
            put_in_place(state, "value_start", chunk.valid[:, 0, -1].int().argmax(-1).int())  # the last row's first valid key

    def _step_values(self, state: Any, v_cache: torch.Tensor, keys: KeyRange) -> torch.Tensor | None:
        """The sum of this step's valid value rows (None without compensation), ``state.value_sum`` brought
        up to date in place: the new token's row (at ``seq_lens - 1``) added and, on a sliding-window layer,
        the row that left the window subtracted. No host synchronisation: the step replays from a graph."""
        if not self.tracks_values:
            return None
        if state.value_sum is None or (keys.window is not None and v_cache.shape[2] <= keys.window):
            # No prompt seen (a scratch state compiling kernels ahead), or a cache that holds the window only
            # (transformers' sliding cache drops the rows that leave it, so none is left to subtract; its sum
            # costs at most the window): the valid rows summed afresh.
            self._fresh_values(state, v_cache, keys)
            return state.value_sum
        sliding = keys.window is not None and keys.starts is not None
        add_step_value_rows(state.value_sum, state.value_start, v_cache, keys.seq_lens,
                            keys.starts if sliding else None)
        return state.value_sum

    @staticmethod
    def _fresh_values(state: Any, v_cache: torch.Tensor, keys: KeyRange) -> None:
        from ..kernels.torch_ref import valid_keys

        valid = valid_keys(v_cache.shape[0], v_cache.shape[2], v_cache.device, keys.seq_lens, keys.starts)
        starts = keys.starts if keys.starts is not None else torch.zeros_like(keys.seq_lens)
        if state.value_sum is None:
            state.value_sum, state.value_start = sum_value_rows(v_cache, valid), starts.int().clone()
        else:
            state.value_sum.copy_(sum_value_rows(v_cache, valid))
            state.value_start.copy_(starts)

    def row_thresholds(self, rows: Rows, state: Any) -> RowThresholds:
        """The threshold of every row of a teacher-forced chunk (the method's state may learn from them)."""
        raise NotImplementedError

    def step_threshold(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange,
                       state: Any, phase: str, kernels: Any) -> StepThreshold:
        """The threshold of one decode step (``decode_step``'s arguments); no host synchronisation."""
        raise NotImplementedError

    def select(self, rows: Rows, state: Any) -> Selection:
        th = self.row_thresholds(rows, state)
        if th.eta is None:
            return Selection(keep=None, approx=th.approx)
        eta = th.eta.unsqueeze(-1)
        if self.threshold_space == "score":
            keep = rows.scores > eta
        else:
            keep = (rows.probs > eta) | (eta <= 0)
        if self.shared:
            keep = group_keep(keep, rows.groups)
        keep = keep_row_max(rows.probs, keep, rows.valid)
        keep = torch.where(th.approx[:, None, :, None], keep, rows.valid)
        return Selection(keep=keep, approx=th.approx)

    def decode_step(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange, state: Any,
                    phase: str, kernels: Any) -> DecodeOutput:
        value_sum = self._step_values(state, v_cache, keys)  # every step, exact ones too: the sum follows the cache
        th = self.step_threshold(query, k_cache, v_cache, keys, state, phase, kernels)
        if th.eta is None:  # an exact step keeps the whole mass: nothing to compensate
            out = th.out if th.out is not None else kernels.dense(query, k_cache, v_cache, keys.seq_lens, keys.starts)
            return DecodeOutput(out, None, th.approx)
        if self.threshold_space == "score":
            out, kept = self._score_step(query, k_cache, v_cache, th.eta, keys, kernels.scale)
        elif th.anchors is not None:
            gap, first, last = th.anchors
            out, kept = kernels.sparse_anchored(query, k_cache, v_cache, th.eta, gap, keys.seq_lens, keys.starts,
                                                first, last, value_sum=value_sum)
        else:
            out, kept = kernels.sparse(query, k_cache, v_cache, th.eta, keys.seq_lens, keys.starts, value_sum,
                                       shared=self.shared)
        return DecodeOutput(out, kept, th.approx)

    def _score_step(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, theta: torch.Tensor,
                    keys: KeyRange, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step with a score threshold, through the torch reference: out and kept counts."""
        from ..kernels.torch_ref import _apply_v, _kept_weights, _probs, _scores, keep_mask

        s, valid = _scores(query, k_cache, scale, keys.seq_lens, keys.starts)
        p = _probs(s)
        keep = keep_mask(p, s, valid, theta, on_scores=True)
        weights = _kept_weights(p, keep, self.renormalize)
        if self.vmc:  # every value row is read here anyway: the mean comes through the weights
            weights = compensate_value_mean(weights, valid, keys.steps().float()[:, None, None])
        return _apply_v(weights, v_cache).to(query.dtype), keep.sum(-1, dtype=torch.int32)


__all__ = ["RowThresholds", "StepThreshold", "ThresholdMethod", "ThresholdState"]
