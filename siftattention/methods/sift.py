"""SiftAttention (the paper's Algorithms 1 and 2).

Warmup: the first ``warmup`` generation steps of each sequence are exact and record
theta_S, the tau-quantile of each head's attention probabilities. At the end of the
warmup, ``log theta`` is regressed on ``log S`` per (sequence, head). Afterwards a
key is kept when its probability exceeds the predicted eta_S = alpha * S^-beta.

``normalizer="anchored"`` (beyond the paper) predicts the row's normaliser as well, so a
decode step can filter while it reads the keys, in one pass: the log-sum-exp of the row's
anchor keys (its first ``anchor_first`` and newest ``anchor_last`` valid keys) plus the
previous step's gap between the exact log-sum-exp and the anchor sum. In probabilities: with
``g_t = -log(sum of p_t over the anchors)``, a key is kept when
``p > eta * exp(g_{t-1} - g_t)``. The kept keys still get the exact normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import torch

from ..kernels.plan import PowerLawThreshold
from ..kernels.torch_ref import anchor_mask
from ..powerlaw import fit_power_law, masked_quantile, predict_log
from .base import (DecodeOutput, KeyRange, Method, Rows, Selection, check_bool, check_fraction, check_int, keep_row_max,
                   select_sequences)


#: The longest warmup: its buffers are allocated whole ([batch, heads, warmup] per layer).
MAX_WARMUP = 65536


@dataclass
class SiftState:
    """Per-(sequence, head) state of one layer."""

    thetas: torch.Tensor  # [B, H, w] recorded quantiles
    theta_steps: torch.Tensor  # [B, w] the step S of each recorded quantile
    count: torch.Tensor  # [B] recorded so far
    fitted: torch.Tensor  # [B] bool
    beta: torch.Tensor  # [B, H]
    r2: torch.Tensor  # [B, H] in-sample R^2 of the warmup fit
    log_alpha: torch.Tensor  # [B, H] log alpha of fitted rows, -inf elsewhere (so the decode threshold is 0)
    gap: torch.Tensor  # [B, H] logsumexp - anchor logsumexp of the last step row (anchored normaliser); NaN before

    @property
    def alpha(self) -> torch.Tensor:
        """[B, H] exp(log_alpha) of fitted rows (inf or 0 where it leaves float32's range), 1 elsewhere."""
        return torch.where(self.fitted[:, None], self.log_alpha.exp(), torch.ones_like(self.log_alpha))


@dataclass
class Sift(Method):
    """Power-law guided threshold: keep keys with p > alpha * S^-beta after a warmup."""

    tau: float = 0.875
    warmup: int = 128
    renormalize: bool = False
    warmup_source: Literal["decode", "prefill"] = "decode"
    normalizer: Literal["exact", "anchored"] = "exact"
    anchor_first: int = 64
    anchor_last: int = 256
    name = "sift"
    #: shown in ``spec()`` only where they differ from their defaults
    spec_optional: ClassVar[tuple[str, ...]] = ("normalizer", "anchor_first", "anchor_last")

    def __post_init__(self) -> None:
        self.tau = check_fraction("tau", self.tau)
        self.warmup = check_int("warmup", self.warmup, 2)
        if self.warmup > MAX_WARMUP:
            # Each layer's state holds a quantile per sequence, head and warmup step from the first forward on.
            raise ValueError(f"warmup must be at most {MAX_WARMUP} steps, got {self.warmup!r}")
        self.renormalize = check_bool("renormalize", self.renormalize)
        if self.warmup_source not in ("decode", "prefill"):
            raise ValueError(f"warmup_source must be 'decode' or 'prefill', got {self.warmup_source!r}")
        if self.normalizer not in ("exact", "anchored"):
            raise ValueError(f"normalizer must be 'exact' or 'anchored', got {self.normalizer!r}")
        self.anchor_first = check_int("anchor_first", self.anchor_first, 0)
        self.anchor_last = check_int("anchor_last", self.anchor_last, 0)
        if self.anchor_first + self.anchor_last == 0:
            raise ValueError("anchor_first + anchor_last must be at least 1")

    def reorder_state(self, state: SiftState, index: torch.Tensor) -> SiftState:
        return select_sequences(state, index)  # every field has one row per sequence

    @property
    def anchored(self) -> bool:
        return self.normalizer == "anchored"

    def new_state(self, batch: int, heads: int, device: torch.device, layer: int = 0) -> SiftState:
        f32 = dict(dtype=torch.float32, device=device)
        return SiftState(
            thetas=torch.zeros(batch, heads, self.warmup, **f32),
            theta_steps=torch.ones(batch, self.warmup, **f32),
            count=torch.zeros(batch, dtype=torch.long, device=device),
            fitted=torch.zeros(batch, dtype=torch.bool, device=device),
            beta=torch.zeros(batch, heads, **f32),
            r2=torch.zeros(batch, heads, **f32),
            log_alpha=torch.full((batch, heads), float("-inf"), **f32),
            gap=torch.full((batch, heads), float("nan"), **f32),
        )

    def _record(self, rows: Rows, state: SiftState, record: torch.Tensor, slot: torch.Tensor) -> None:
        """Store theta of the rows in ``record`` ([B, R] bool) at buffer position ``slot``."""
        b_idx, r_idx = record.nonzero(as_tuple=True)
        if b_idx.numel() == 0:
            return
        probs = rows.probs[b_idx, :, r_idx]  # [n, H, K]
        valid = rows.valid[b_idx, :, r_idx].expand_as(probs)
        theta = masked_quantile(probs, valid, self.tau)
        pos = slot[b_idx, r_idx]
        state.thetas[b_idx, :, pos] = theta
        state.theta_steps[b_idx, pos] = rows.steps[b_idx, r_idx].float()

    def _fit(self, state: SiftState, which: torch.Tensor) -> None:
        """Fit the sequences in ``which`` ([B] bool) on their recorded points.

        Every row is fitted and the result kept where ``which`` holds: no host
        synchronisation, so the fit can run inside a captured decode step.
        """
        points = torch.arange(self.warmup, device=state.count.device)[None, :] < state.count[:, None]
        fit = fit_power_law(state.theta_steps[:, None, :], state.thetas, points[:, None, :])
        pick = which[:, None]
        state.log_alpha.copy_(torch.where(pick, fit.log_alpha.float(), state.log_alpha))
        state.beta.copy_(torch.where(pick, fit.beta.float(), state.beta))
        state.r2.copy_(torch.where(pick, fit.r2.float(), state.r2))
        state.fitted |= which

    def select(self, rows: Rows, state: SiftState) -> Selection:
        factor = self._anchored_factor(rows, state) if self.anchored else None
        # Index of each step row within its sequence's steps: warmup rows come first.
        order = state.count[:, None] + torch.cumsum(rows.is_step.long(), dim=1) - 1
        warm = rows.is_step & (order < self.warmup) & ~state.fitted[:, None]
        self._record(rows, state, warm, order.clamp(max=self.warmup - 1))
        state.count += warm.sum(dim=1)
        self._fit(state, (state.count >= self.warmup) & ~state.fitted)

        approx = rows.is_step & ~warm & state.fitted[:, None]
        if not bool(approx.any()):
            return Selection(keep=None, approx=approx)
        eta = predict_log(state.log_alpha[:, :, None], state.beta[:, :, None], rows.steps[:, None, :].float())  # [B, H, R]
        if factor is not None:
            eta = eta * factor
        keep = keep_row_max(rows.probs, rows.probs > eta.unsqueeze(-1), rows.valid)
        keep = torch.where(approx[:, None, :, None], keep, rows.valid)
        return Selection(keep=keep, approx=approx)

    def _anchored_factor(self, rows: Rows, state: SiftState) -> torch.Tensor:
        """exp(g_{t-1} - g_t) per row [B, H, R] (0 where no earlier step row has a gap: keep every key),
        and the gap of each sequence's last step row kept for the next chunk."""
        gap = self._gaps(rows)
        prev = torch.cat([state.gap[:, :, None], gap[:, :, :-1]], dim=2)
        factor = torch.where(torch.isnan(prev), 0.0, torch.exp(prev - gap))
        R = rows.is_step.shape[1]
        last = (rows.is_step.long() * torch.arange(1, R + 1, device=gap.device)).argmax(dim=1)
        newest = gap[torch.arange(gap.shape[0], device=gap.device), :, last]
        state.gap.copy_(torch.where(rows.is_step.any(dim=1)[:, None], newest, state.gap))
        return factor

    def _gaps(self, rows: Rows) -> torch.Tensor:
        """g = -log(sum of p over each row's anchor keys), [B, H, R]: logsumexp minus the anchors' logsumexp."""
        anchor = anchor_mask(rows.valid, self.anchor_first, self.anchor_last)
        return -torch.log((rows.probs * anchor).sum(-1))

    def decode_phase(self, step: int) -> str:
        """'warmup' for the first ``warmup`` decoded tokens, then 'sparse'."""
        if self.warmup_source == "decode" and step < self.warmup:
            return "warmup"
        return "sparse"

    def phases_to_compile(self, step: int) -> tuple[str, ...]:
        return ("warmup", "sparse") if self.decode_phase(step) == "warmup" else ("sparse",)

    def decode_step(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange, state: SiftState, phase: str, kernels: Any) -> DecodeOutput:
        if phase == "warmup":
            out, theta = kernels.warmup(query, k_cache, v_cache, self.tau, keys.seq_lens, keys.starts)
            # Decode steps run in lockstep over the batch, so one slot index serves every row.
            slot = state.count[:1]
            state.thetas.index_copy_(2, slot, theta[:, :, None].float())
            state.theta_steps.index_copy_(1, slot, keys.steps().float()[:, None])
            state.count += 1
            if self.anchored:
                state.gap.copy_(kernels.warmup_gap(query, k_cache, keys.seq_lens, keys.starts, *self.anchors))
            return DecodeOutput(out, None, False)
        if self.anchored:
            out, kept = kernels.sparse_anchored(query, k_cache, v_cache, self.power_law(state, keys), state.gap,
                                                keys.seq_lens, keys.starts, *self.anchors)
        else:
            out, kept = kernels.sparse(query, k_cache, v_cache, self.power_law(state, keys), keys.seq_lens, keys.starts)
        return DecodeOutput(out, kept, state.fitted)

    @property
    def anchors(self) -> tuple[int, int]:
        return self.anchor_first, self.anchor_last

    def end_decode_phase(self, phase: str, states: list[SiftState]) -> None:
        """After the warmup: fit every layer's power law, layers of one shape in one batched fit."""
        if phase != "warmup":
            return
        groups: dict[tuple, list[SiftState]] = {}
        for state in states:
            groups.setdefault((tuple(state.thetas.shape), state.thetas.device), []).append(state)
        for group in groups.values():
            # The layers' rows side by side: one fit of [layers * B] rows.
            joined = SiftState(*(torch.cat([getattr(s, f.name) for s in group]) for f in fields(SiftState)))
            self._fit(joined, joined.count >= self.warmup)
            batch = group[0].count.shape[0]
            for name in ("fitted", "beta", "r2", "log_alpha"):
                torch._foreach_copy_([getattr(s, name) for s in group], list(getattr(joined, name).split(batch)))

    @staticmethod
    def power_law(state: SiftState, keys: KeyRange) -> PowerLawThreshold:
        """The threshold of one decode step by its parts (the Triton filter pass evaluates it itself)."""
        return PowerLawThreshold(state.log_alpha, state.beta, keys.log_steps())

    @staticmethod
    def decode_threshold(state: SiftState, keys: KeyRange) -> torch.Tensor:
        """eta [B, H] of one decode step: powerlaw.predict_log's arithmetic in float32.

        A row without a fit (a one-token prompt with warmup_source='prefill') has
        log alpha = -inf, so eta = 0 and it keeps every key.
        """
        return Sift.power_law(state, keys).eta()

    def observes_prefill(self) -> bool:
        return self.warmup_source == "prefill"

    def observe_prefill(self, rows: Rows, state: SiftState) -> None:
        """warmup_source='prefill': record the last ``warmup`` prompt rows (all if shorter)."""
        if self.warmup_source != "prefill":
            return
        n_total = rows.last_step.clamp(max=self.warmup)[:, None]
        first = rows.last_step[:, None] - n_total  # rows with S > first are recorded
        record = (rows.steps > first) & (rows.steps > 0)
        self._record(rows, state, record, (rows.steps - first - 1).clamp(0, self.warmup - 1))
        state.count = n_total[:, 0].clone()
        if self.anchored:  # the first decoded token filters with the last prompt row's gap
            last = rows.steps == rows.last_step[:, None]  # [B, R]
            gap = torch.where(last[:, None, :], self._gaps(rows), 0.0).sum(-1)
            state.gap.copy_(torch.where(last.any(dim=1)[:, None], gap, state.gap))

    def finish_prefill(self, state: SiftState) -> None:
        if self.warmup_source == "prefill":
            self._fit(state, (state.count >= 2) & ~state.fitted)
