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

``keybound="row"`` or ``"channel"`` (beyond the paper; True means "row") runs each sparse step as the
key-bound step (``kernels.keybound``): an int8 copy of the keys, written where keys are appended (the
fast loop's cache, or beside transformers' cache under ``apply``: ``key_copy.py``), bounds every score,
and only keys the bound cannot drop are read in full. It keeps the exact step's keys except those within
a small epsilon of the threshold.
"row" scales each key row by its largest channel; "channel" also scales and offsets each channel by its
range over the prompt's keys (per sequence and KV head), which bounds keys with outlier channels (a key
bias, as Qwen's) far tighter.

Calibration (beyond the paper; docs/design.md, "Calibration"): by default a decode fits each
(sequence, layer, head) on the prompt's own exact rows, ``PromptCalibration.rows`` rows spaced
geometrically in step over the whole prompt, so decoding is sparse from its first token;
``warmup_source="decode"`` is the paper's decode warmup (optionally adaptive, ``AdaptiveWarmup``).
Every ``recalibrate_every`` sparse steps one step also measures its exact quantile and adds it to
the fit's least-squares sums, every earlier point weighted down by ``recalibrate_decay``.

``gqa="shared"`` (beyond the paper): the query heads of each KV group keep one set, so a decode step reads the
V rows of about one head's share instead of the union of the group's sets. The group's statistic is the
largest probability of a key over the group's heads; its tau-quantile is measured, fitted and predicted per
(sequence, layer, KV head) exactly as a head's is (the state stays per query head, every head of a group
holding the same points and fit), and a key is kept for the whole group when its statistic exceeds the
prediction (each head also keeps its own maximum).

``vmc=True`` (beyond the paper, with ``renormalize=False``): value-mean compensation, the pruned
probability mass times the mean of the row's valid value rows added to the output
(``ThresholdMethod``; a running sum of the value rows keeps the decode step's kernels sparse in V).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import torch

from ..kernels.keybound import KEY_FORMS, key_copy_form
from ..kernels.plan import DecodeKernels, PowerLawThreshold, resolve_backend
from ..kernels.torch_ref import anchor_mask, group_quantile
from ..powerlaw import PowerLawFit, PowerLawSums, fit_power_law, predict_log
from .base import (DecodeOutput, KeyRange, PromptChunk, Rows, check_bool, check_fraction, check_int, check_real,
                   check_vmc)
from .threshold import RowThresholds, StepThreshold, ThresholdMethod, ThresholdState


#: The longest warmup: its buffers are allocated whole ([batch, heads, warmup] per layer).
MAX_WARMUP = 65536
#: Soft bound on the float32 scores of one batch of sampled prompt rows ([H, rows, K]).
PROMPT_CHUNK_ELEMENTS = 1 << 24
#: The fields every threshold method's state has (value-mean compensation), none of them Sift's fit's.
_VALUE_FIELDS = {f.name for f in fields(ThresholdState)}


@dataclass
class SiftState(ThresholdState):
    """Per-(sequence, head) state of one layer (and, with ``vmc``, the running value sum)."""

    thetas: torch.Tensor  # [B, H, w] recorded quantiles
    theta_steps: torch.Tensor  # [B, w] the step S of each recorded quantile
    count: torch.Tensor  # [B] recorded so far
    fitted: torch.Tensor  # [B] bool
    beta: torch.Tensor  # [B, H]
    r2: torch.Tensor  # [B, H] in-sample R^2 of the warmup fit
    log_alpha: torch.Tensor  # [B, H] log alpha of fitted rows, -inf elsewhere (so the decode threshold is 0)
    gap: torch.Tensor  # [B, H] logsumexp - anchor logsumexp of the last step row (anchored normaliser); NaN before
    fit_sums: torch.Tensor  # [B, H, 6] float64 least-squares sums of the current fit (PowerLawSums), updated by recalibration
    prompt_thetas: torch.Tensor  # [B, H, n] quantiles of the sampled prompt rows
    prompt_targets: torch.Tensor  # [B, n] int64 the sampled steps (-1: a repeated step, not a point)
    prompt_recorded: torch.Tensor  # [B, n] bool, sampled rows measured so far
    prompt_queries: torch.Tensor  # [B, H, n, D] the sampled rows' queries, measured once the prompt's keys are all in
    prompt_ranges: torch.Tensor  # [B, n, 2] int32 each sampled row's valid keys [start, end)
    prompt_pending: torch.Tensor  # [B, n] bool, sampled rows whose queries wait for the prompt's last chunk
    calibrated: torch.Tensor  # [B] bool, the batch's prompts are long enough to calibrate on
    sparse_steps: torch.Tensor  # [B] int64 approximated steps so far (``select``'s recalibration count)
    warmup_fit: torch.Tensor  # [B, H, 2] float64 the decode warmup's fit so far, log alpha and beta (adaptive warmup)
    warmup_settled: torch.Tensor  # [B] bool, its predicted next quantile moved by at most the tolerance at the last step

    @property
    def sums(self) -> PowerLawSums:
        """``fit_sums`` as ``PowerLawSums`` of views: updating them updates the state."""
        return PowerLawSums(*self.fit_sums.unbind(-1))

    @property
    def alpha(self) -> torch.Tensor:
        """[B, H] exp(log_alpha) of fitted rows (inf or 0 where it leaves float32's range), 1 elsewhere."""
        return torch.where(self.fitted[:, None], self.log_alpha.exp(), torch.ones_like(self.log_alpha))


@dataclass(frozen=True)
class PromptCalibration:
    """Which prompt rows calibrate the power law: ``rows`` steps spaced geometrically from ``first``
    to the prompt's last row, so the fit spans ``log(P / first)`` of ``log S``.

    A prompt of ``min_prompt`` real tokens or more calibrates on whatever rows it has, however short
    the span: recalibration (``Sift.recalibrate_every``) adds points at the decode's own steps, which
    corrects a short prompt's extrapolation. A batch with a prompt shorter than ``min_prompt`` is not
    calibrated on its prompts: the whole batch runs the decode warmup instead.
    """

    rows: int = 64
    first: int = 8
    # At least 5 distinct rows (steps 8..12), and low enough that every IFEval prompt qualifies without a
    # chat template (Gemma-3's tokenizer: the shortest has 13 tokens): a batch falls back as a whole, so
    # one short prompt would cost them all their calibration.
    min_prompt: int = 12

    def targets(self, prompt_steps: torch.Tensor) -> torch.Tensor:
        """[B, rows] int64 steps to sample for prompts of ``prompt_steps`` [B] tokens; a step already
        listed is -1 (short prompts have fewer distinct rows than ``rows``)."""
        last = prompt_steps.clamp(min=self.first).double()[:, None]
        spacing = torch.linspace(0.0, 1.0, self.rows, dtype=torch.float64, device=prompt_steps.device)
        steps = torch.round(self.first * (last / self.first) ** spacing).long()
        repeated = torch.zeros_like(steps, dtype=torch.bool)
        repeated[:, 1:] = steps[:, 1:] == steps[:, :-1]
        return steps.masked_fill(repeated, -1)

    def usable(self, prompt_steps: torch.Tensor) -> torch.Tensor:
        """[B] bool: every prompt of the batch has at least ``min_prompt`` tokens (decode steps run in
        lockstep, so a batch is calibrated on its prompts, or warms up, as a whole)."""
        return (prompt_steps >= self.min_prompt).all().expand_as(prompt_steps)


@dataclass(frozen=True)
class AdaptiveWarmup:
    """A decode warmup that ends once the fit's predicted next quantile stops moving: after step t
    (``min_steps <= t <= max_steps``) when, for every head, the fits on points 1..t and 1..t-1
    predict log theta at the next step to within ``tolerance`` of each other."""

    min_steps: int
    max_steps: int
    tolerance: float

    @staticmethod
    def fit(steps: torch.Tensor, thetas: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fit on the first ``count`` points and the log of the step after them: ``steps`` [..., w],
        ``thetas`` [..., H, w], ``count`` [...] -> log alpha and beta [..., H], log S_next [..., 1]."""
        points = torch.arange(thetas.shape[-1], device=thetas.device) < count[..., None]  # [..., w]
        fit = fit_power_law(steps[..., None, :], thetas, points[..., None, :])
        last = (steps * points).amax(-1).double()
        return fit.log_alpha, fit.beta, (last + 1).log()[..., None]

    def settled(self, previous: torch.Tensor, current: torch.Tensor, log_next: torch.Tensor) -> torch.Tensor:
        """[...] bool: the previous and current fits (log alpha and beta stacked on the last dimension,
        [..., H, 2]) predict log theta at the next step within the tolerance, for every head."""
        moved = (current[..., 0] - previous[..., 0]) - (current[..., 1] - previous[..., 1]) * log_next
        return (moved.abs() <= self.tolerance).all(-1)

    def stop_step(self, steps: torch.Tensor, thetas: torch.Tensor) -> int:
        """The warmup length for one whole series (``steps`` [w], ``thetas`` [H, w], w >= max_steps)."""
        previous = None
        for t in range(1, self.max_steps + 1):
            log_alpha, beta, log_next = self.fit(steps, thetas, torch.tensor(t))
            current = torch.stack([log_alpha, beta], -1)
            if previous is not None and t >= self.min_steps and bool(self.settled(previous, current, log_next)):
                return t
            previous = current
        return self.max_steps


@dataclass
class Sift(ThresholdMethod):
    """Power-law guided threshold: keep keys with p > alpha * S^-beta after a warmup."""

    tau: float = 0.875
    warmup: int = 128
    renormalize: bool = False
    warmup_source: Literal["prompt", "decode", "prefill"] = "prompt"
    normalizer: Literal["exact", "anchored"] = "exact"
    anchor_first: int = 64
    anchor_last: int = 256
    recalibrate_every: int = 64
    recalibrate_decay: float = 0.9
    warmup_tolerance: float = 0.0
    warmup_min: int = 16
    vmc: bool = False
    keybound: bool | Literal["row", "channel"] = False
    gqa: Literal["head", "shared"] = "head"
    name = "sift"
    #: shown in ``spec()`` only where they differ from their defaults
    spec_optional: ClassVar[tuple[str, ...]] = ("normalizer", "anchor_first", "anchor_last", "recalibrate_every",
                                                "recalibrate_decay", "warmup_tolerance", "warmup_min", "vmc", "keybound",
                                                "gqa")
    spec_words: ClassVar[dict[str, tuple[str, ...]]] = {"keybound": KEY_FORMS}
    #: the prompt rows a decode calibrates on (``warmup_source="prompt"``)
    calibration: ClassVar[PromptCalibration] = PromptCalibration()

    def __post_init__(self) -> None:
        self.tau = check_fraction("tau", self.tau)
        self.warmup = check_int("warmup", self.warmup, 2)
        if self.warmup > MAX_WARMUP:
            # Each layer's state holds a quantile per sequence, head and warmup step from the first forward on.
            raise ValueError(f"warmup must be at most {MAX_WARMUP} steps, got {self.warmup!r}")
        self.renormalize = check_bool("renormalize", self.renormalize)
        if self.warmup_source not in ("prompt", "decode", "prefill"):
            raise ValueError(f"warmup_source must be 'prompt', 'decode' or 'prefill', got {self.warmup_source!r}")
        self.recalibrate_every = check_int("recalibrate_every", self.recalibrate_every, 0)
        self.recalibrate_decay = check_fraction("recalibrate_decay", self.recalibrate_decay, high_open=False)
        self.warmup_tolerance = check_real("warmup_tolerance", self.warmup_tolerance)
        if self.warmup_tolerance < 0:
            raise ValueError(f"warmup_tolerance must be >= 0, got {self.warmup_tolerance!r}")
        self.warmup_min = check_int("warmup_min", self.warmup_min, 2)
        if self.normalizer not in ("exact", "anchored"):
            raise ValueError(f"normalizer must be 'exact' or 'anchored', got {self.normalizer!r}")
        self.anchor_first = check_int("anchor_first", self.anchor_first, 0)
        self.anchor_last = check_int("anchor_last", self.anchor_last, 0)
        if self.anchor_first + self.anchor_last == 0:
            raise ValueError("anchor_first + anchor_last must be at least 1")
        self.vmc = check_vmc(self.vmc, self.renormalize)
        self.keybound = key_copy_form(self.keybound, "keybound") or False
        if self.keybound and self.anchored:
            raise ValueError("keybound needs normalizer='exact' (the key-bound step computes the exact normaliser's bounds)")
        if self.keybound and self.vmc:
            raise ValueError("keybound does not compensate (vmc=True): the key-bound step has no value sum")
        if self.gqa not in ("head", "shared"):
            raise ValueError(f"gqa must be 'head' or 'shared', got {self.gqa!r}")
        if self.shared and self.anchored:
            raise ValueError("gqa='shared' needs normalizer='exact' (the anchored normaliser predicts each head's own "
                             "normaliser, not a group's)")
        if self.shared and self.keybound:
            raise ValueError("gqa='shared' does not run the key-bound step (keybound): its bounds drop keys per head")
        # Host-side, set by each prompt: the decode step where the decode warmup ends (0: no decode warmup),
        # and whether the batch was calibrated on its prompts (only such fits recalibrate).
        self._warmup_end = 0 if self.warmup_source == "prefill" else self.warmup
        self._recalibrating = False
        self._prompt_plan: tuple[tuple, DecodeKernels] | None = None

    @property
    def key_copy_form(self) -> str | None:
        return self.keybound or None

    @property
    def anchored(self) -> bool:
        return self.normalizer == "anchored"

    def new_state(self, batch: int, heads: int, device: torch.device, layer: int = 0) -> SiftState:
        f32 = dict(dtype=torch.float32, device=device)
        flag = dict(dtype=torch.bool, device=device)
        rows = self.calibration.rows
        return SiftState(
            thetas=torch.zeros(batch, heads, self.warmup, **f32),
            theta_steps=torch.ones(batch, self.warmup, **f32),
            count=torch.zeros(batch, dtype=torch.long, device=device),
            fitted=torch.zeros(batch, **flag),
            beta=torch.zeros(batch, heads, **f32),
            r2=torch.zeros(batch, heads, **f32),
            log_alpha=torch.full((batch, heads), float("-inf"), **f32),
            gap=torch.full((batch, heads), float("nan"), **f32),
            fit_sums=torch.zeros(batch, heads, 6, dtype=torch.float64, device=device),
            prompt_thetas=torch.zeros(batch, heads, rows, **f32),
            prompt_targets=torch.full((batch, rows), -1, dtype=torch.long, device=device),
            prompt_recorded=torch.zeros(batch, rows, **flag),
            prompt_queries=torch.zeros(batch, heads, rows, 0, **f32),  # sized by the first prompt chunk
            prompt_ranges=torch.zeros(batch, rows, 2, dtype=torch.int32, device=device),
            prompt_pending=torch.zeros(batch, rows, **flag),
            calibrated=torch.zeros(batch, **flag),
            sparse_steps=torch.zeros(batch, dtype=torch.long, device=device),
            warmup_fit=torch.full((batch, heads, 2), float("nan"), dtype=torch.float64, device=device),
            warmup_settled=torch.zeros(batch, **flag),
        )

    def _record(self, rows: Rows, state: SiftState, record: torch.Tensor, slot: torch.Tensor) -> None:
        """Store theta of the rows in ``record`` ([B, R] bool) at buffer position ``slot``."""
        b_idx, r_idx = record.nonzero(as_tuple=True)
        if b_idx.numel() == 0:
            return
        probs = rows.probs[b_idx, :, r_idx]  # [n, H, K]
        theta = self._quantile(probs, rows.valid[b_idx, :, r_idx], rows.groups)
        pos = slot[b_idx, r_idx]
        state.thetas[b_idx, :, pos] = theta
        state.theta_steps[b_idx, pos] = rows.steps[b_idx, r_idx].float()

    def _quantile(self, probs: torch.Tensor, valid: torch.Tensor, groups: int) -> torch.Tensor:
        """theta [..., H] of rows of probabilities [..., H, K] (``valid`` broadcast against them): each head's
        tau-quantile, or with ``gqa="shared"`` its KV group's (``groups`` heads a group)."""
        return group_quantile(probs, valid, self.tau, groups if self.shared else 1)

    def _fit(self, state: SiftState, which: torch.Tensor) -> None:
        """Fit the sequences in ``which`` ([B] bool) on their recorded warmup points.

        Every row is fitted and the result kept where ``which`` holds: no host
        synchronisation, so the fit can run inside a captured decode step.
        """
        points = torch.arange(self.warmup, device=state.count.device)[None, :] < state.count[:, None]
        fit = fit_power_law(state.theta_steps[:, None, :], state.thetas, points[:, None, :])
        sums = PowerLawSums.of_points(state.theta_steps[:, None, :], state.thetas, points[:, None, :])
        self._take_fit(state, fit, sums, which)

    def _take_fit(self, state: SiftState, fit: PowerLawFit, sums: PowerLawSums, which: torch.Tensor) -> None:
        """Make ``fit`` the sequences' fit where ``which`` ([B] bool) holds. Its points weigh as much together
        as recalibration remembers, ``1 / (1 - recalibrate_decay)`` points, so the first measurements of a
        decode already move the fit (64 prompt points at full weight would outvote them for ~10 updates)."""
        if self.recalibrate_decay < 1:
            sums = sums.scaled_to(1.0 / (1.0 - self.recalibrate_decay))
        state.sums.copy_(sums, which[:, None])
        self._set_fit(state, fit, which)

    @staticmethod
    def _set_fit(state: SiftState, fit: PowerLawFit, which: torch.Tensor) -> None:
        pick = which[:, None]
        state.log_alpha.copy_(torch.where(pick, fit.log_alpha.float(), state.log_alpha))
        state.beta.copy_(torch.where(pick, fit.beta.float(), state.beta))
        state.r2.copy_(torch.where(pick, fit.r2.float(), state.r2))
        state.fitted |= which

    def _recalibrate(self, state: SiftState, steps: torch.Tensor, theta: torch.Tensor, where: torch.Tensor) -> None:
        """Add the exact quantiles ``theta`` [B, H] measured at ``steps`` [B] to the fits of the fitted
        sequences in ``where`` ([B] bool), earlier points weighted down by ``recalibrate_decay``, and refit.
        Pure tensor work: it runs inside a captured decode step."""
        which = where & state.fitted
        sums = state.sums
        sums.add(steps.double()[:, None], theta, which[:, None], decay=self.recalibrate_decay)
        self._set_fit(state, sums.fit(), which)

    def row_thresholds(self, rows: Rows, state: SiftState) -> RowThresholds:
        factor = self._anchored_factor(rows, state) if self.anchored else None
        # Index of each step row within its sequence's steps: warmup rows come first.
        order = state.count[:, None] + torch.cumsum(rows.is_step.long(), dim=1) - 1
        warm = rows.is_step & (order < self.warmup) & ~state.fitted[:, None]
        self._record(rows, state, warm, order.clamp(max=self.warmup - 1))
        state.count += warm.sum(dim=1)
        self._fit(state, (state.count >= self.warmup) & ~state.fitted)

        approx = rows.is_step & ~warm & state.fitted[:, None]
        if not bool(approx.any()):
            return RowThresholds(None, approx)
        log_alpha, beta = self._row_fits(rows, state, approx)
        eta = predict_log(log_alpha, beta, rows.steps[:, None, :].float())  # [B, H, R]
        return RowThresholds(eta if factor is None else eta * factor, approx)

    def _row_fits(self, rows: Rows, state: SiftState, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log alpha and beta [B, H, R] that each row filters with: the fit as it stands, recalibrated
        after every ``recalibrate_every``-th approximated row of a sequence (that row filters with the
        fit before its own point, as a decode step does)."""
        B, H, R = rows.probs.shape[:3]
        log_alpha = state.log_alpha[:, :, None].expand(B, H, R).clone()
        beta = state.beta[:, :, None].expand(B, H, R).clone()
        if self.recalibrate_every:
            index = state.sparse_steps[:, None] + torch.cumsum(approx.long(), dim=1)  # 1-based among approximated rows
            # Fits made on a prompt only: the paper's warmup (and a teacher-forced pass) keeps its one fit.
            measure = approx & state.calibrated[:, None] & (index % self.recalibrate_every == 0)
            for r in measure.any(dim=0).nonzero()[:, 0].tolist():
                theta = self._quantile(rows.probs[:, :, r], rows.valid[:, :, r], rows.groups)
                self._recalibrate(state, rows.steps[:, r], theta, measure[:, r])
                log_alpha[:, :, r + 1:] = state.log_alpha[:, :, None]
                beta[:, :, r + 1:] = state.beta[:, :, None]
        state.sparse_steps += approx.sum(dim=1)
        return log_alpha, beta

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
        """'warmup' for the decode warmup's steps (none after a calibrating prompt), then 'sparse'; after a
        calibrating prompt every ``recalibrate_every``-th sparse step is a 'recalibrate' step."""
        if step < self._warmup_end:
            return "warmup"
        if self._recalibrating and self.recalibrate_every and (step - self._warmup_end + 1) % self.recalibrate_every == 0:
            return "recalibrate"
        return "sparse"

    def phases_to_compile(self, step: int) -> tuple[str, ...]:
        later = ("sparse", "recalibrate") if self._recalibrating and self.recalibrate_every else ("sparse",)
        return ("warmup", *later) if self.decode_phase(step) == "warmup" else later

    def step_threshold(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange,
                       state: SiftState, phase: str, kernels: Any) -> StepThreshold:
        if phase == "warmup":
            out, theta = kernels.warmup(query, k_cache, v_cache, self.tau, keys.seq_lens, keys.starts,
                                        shared=self.shared)
            # Decode steps run in lockstep over the batch, so one slot index serves every row.
            slot = state.count[:1].clamp(max=self.warmup - 1)
            state.thetas.index_copy_(2, slot, theta[:, :, None].float())
            state.theta_steps.index_copy_(1, slot, keys.steps().float()[:, None])
            state.count += 1
            if self.warmup_tolerance:
                self._watch_warmup(state)
            if self.anchored:
                state.gap.copy_(kernels.warmup_gap(query, k_cache, keys.seq_lens, keys.starts, *self.anchors))
            return StepThreshold(None, False, out=out)
        anchors = (state.gap, *self.anchors) if self.anchored else None
        return StepThreshold(self.power_law(state, keys), state.fitted, anchors=anchors)

    def decode_step(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange,
                    state: SiftState, phase: str, kernels: Any) -> DecodeOutput:
        measured = phase == "recalibrate" and not self.anchored
        keybound = phase == "sparse" and self.keybound and keys.key_copy is not None
        if not (measured or keybound):
            res = super().decode_step(query, k_cache, v_cache, keys, state, phase, kernels)
            if phase == "recalibrate":  # the anchored one-pass step stores no scores: an exact step measures
                _, theta = kernels.warmup(query, k_cache, v_cache, self.tau, keys.seq_lens, keys.starts)
                self._recalibrate(state, keys.steps(), theta, state.calibrated)
            return res
        value_sum = self._step_values(state, v_cache, keys)
        threshold = self.power_law(state, keys)
        if keybound:
            out, kept = kernels.sparse_keybound(query, k_cache, v_cache, keys.key_copy, threshold, keys.seq_lens,
                                                keys.starts)
            return DecodeOutput(out, kept, state.fitted)
        # The step filters with the fit so far, then its exact quantile (from the scores the step computed
        # anyway) joins the fit.
        out, kept, theta = kernels.sparse_quantile(query, k_cache, v_cache, threshold, self.tau, keys.seq_lens,
                                                   keys.starts, value_sum, shared=self.shared)
        self._recalibrate(state, keys.steps(), theta, state.calibrated)
        return DecodeOutput(out, kept, state.fitted)

    def _watch_warmup(self, state: SiftState) -> None:
        """Adaptive warmup: whether the predicted next quantile moved by at most the tolerance (device-side)."""
        rule = self.adaptive_warmup
        log_alpha, beta, log_next = rule.fit(state.theta_steps, state.thetas, state.count)
        current = torch.stack([log_alpha, beta], -1)
        state.warmup_settled.copy_(rule.settled(state.warmup_fit, current, log_next))
        state.warmup_fit.copy_(current)

    @property
    def adaptive_warmup(self) -> AdaptiveWarmup:
        return AdaptiveWarmup(min(self.warmup_min, self.warmup), self.warmup, self.warmup_tolerance)

    def after_decode_step(self, step: int, phase: str, states: list[SiftState]) -> None:
        """Adaptive warmup: end the decode warmup after this step once every layer's, sequence's and
        head's prediction has settled (one host synchronisation per warmup step from ``warmup_min`` on)."""
        if phase != "warmup" or not self.warmup_tolerance or step + 1 < self.adaptive_warmup.min_steps:
            return
        if all(bool(state.warmup_settled.all()) for state in states):
            self._warmup_end = step + 1

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
            # The layers' rows side by side: one fit of [layers * B] rows (the value sums play no part).
            joined = SiftState(**{f.name: torch.cat([getattr(s, f.name) for s in group])
                                  for f in fields(SiftState) if f.name not in _VALUE_FIELDS})
            self._fit(joined, (joined.count >= 2) & ~joined.fitted)  # the adaptive warmup may end early
            batch = group[0].count.shape[0]
            for name in ("fitted", "beta", "r2", "log_alpha", "fit_sums"):
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
        state.count.copy_(n_total[:, 0])
        if self.anchored:  # the first decoded token filters with the last prompt row's gap
            last = rows.steps == rows.last_step[:, None]  # [B, R]
            gap = torch.where(last[:, None, :], self._gaps(rows), 0.0).sum(-1)
            state.gap.copy_(torch.where(last.any(dim=1)[:, None], gap, state.gap))

    def observes_prompt(self) -> bool:
        return self.warmup_source == "prompt" or super().observes_prompt()

    def observe_prompt(self, chunk: PromptChunk, state: SiftState) -> None:
        """warmup_source='prompt': measure the quantiles of the chunk's sampled rows (``calibration``)."""
        super().observe_prompt(chunk, state)
        if self.warmup_source != "prompt":
            return
        calibration = self.calibration
        state.calibrated.copy_(calibration.usable(chunk.prompt_steps))
        self._recalibrating = bool(state.calibrated.all())
        self._warmup_end = 0 if self._recalibrating else self.warmup
        state.prompt_targets.copy_(calibration.targets(chunk.prompt_steps))
        # [B, Q, n]: which sampled step each row is. A sliding window's rows share its step once it is full: the
        # first row with the step is the sample.
        steps = chunk.steps
        first = torch.ones_like(steps, dtype=torch.bool)
        first[:, 1:] = steps[:, 1:] != steps[:, :-1]
        taken = state.prompt_recorded | state.prompt_pending  # by an earlier chunk
        hits = (steps[:, :, None] == state.prompt_targets[:, None, :]) & first[:, :, None] & ~taken[:, None, :]
        b_idx, r_idx, slot = hits.nonzero(as_tuple=True)
        if not self._defer_rows(chunk, state, b_idx, r_idx, slot):
            # Rows at a time so the float32 scores of a long prompt stay within PROMPT_CHUNK_ELEMENTS.
            heads, keys = chunk.query.shape[1], chunk.key.shape[2]
            per_call = max(1, PROMPT_CHUNK_ELEMENTS // max(1, heads * keys))
            for b in b_idx.unique().tolist():
                mine = b_idx == b
                rows, slots = r_idx[mine], slot[mine]
                for a in range(0, rows.numel(), per_call):
                    probs, valid = chunk.probs(b, rows[a:a + per_call])  # [H, n, K], [1, n, K]
                    groups = probs.shape[0] // chunk.key.shape[1]
                    theta = self._quantile(probs.transpose(0, 1), valid.transpose(0, 1), groups).t()  # [H, n]
                    state.prompt_thetas[b, :, slots[a:a + per_call]] = theta
                    state.prompt_recorded[b, slots[a:a + per_call]] = True
        if chunk.final:
            self._measure_deferred_rows(chunk, state)
        if self.anchored:  # the first decoded token filters with the last prompt row's gap, as after a warmup
            for b, r in (steps == chunk.prompt_steps[:, None]).nonzero().tolist():
                probs, valid = chunk.probs(b, torch.tensor([r], device=chunk.query.device))
                anchors = anchor_mask(valid, self.anchor_first, self.anchor_last)
                state.gap[b] = -torch.log((probs * anchors).sum(-1))[:, 0]

    def _defer_rows(self, chunk: PromptChunk, state: SiftState, b_idx: torch.Tensor, r_idx: torch.Tensor,
                    slot: torch.Tensor) -> bool:
        """Keep the chunk's sampled rows (queries and key ranges) for one measurement by the decode kernels at the
        prompt's end, where they run (CUDA, float32 on the CPU) and each row's valid keys are one range; False
        where they cannot measure these rows."""
        if chunk.bias is not None or chunk.softcap is not None:
            return False
        if resolve_backend("auto", chunk.query.device, chunk.query.dtype) == "torch":
            return False
        if chunk.ranges is not None:
            starts, ends = chunk.ranges[b_idx, r_idx].unbind(-1)
        else:  # a mask of unknown structure: the sampled rows' own keys, which must form one range each
            valid = chunk.valid[b_idx, 0, r_idx].to(torch.uint8)  # [n, K]
            starts = valid.argmax(-1)
            ends = valid.shape[-1] - valid.flip(-1).argmax(-1)
            if not bool((ends - starts == valid.sum(-1, dtype=torch.int64)).all()):
                return False
        B, H, n = state.prompt_thetas.shape
        if state.prompt_queries.shape[-1] != chunk.query.shape[-1] or state.prompt_queries.dtype != chunk.query.dtype:
            state.prompt_queries = chunk.query.new_zeros(B, H, n, chunk.query.shape[-1])
        state.prompt_queries[b_idx, :, slot] = chunk.query[b_idx, :, r_idx]
        state.prompt_ranges[b_idx, slot] = torch.stack([starts, ends], -1).int()
        state.prompt_pending[b_idx, slot] = True
        return True

    def _measure_deferred_rows(self, chunk: PromptChunk, state: SiftState) -> None:
        """The exact tau-quantiles of the deferred rows: per sequence, its rows as a batch of decode queries
        over its one cache (a stride-0 batch), through a kernel plan made once per shape. Rows not pending have
        an empty key range (theta 0) and keep what they had."""
        if not bool(state.prompt_pending.any()):
            return
        B, H, n = state.prompt_thetas.shape
        key = chunk.key
        kernels = self._prompt_kernels(n, H, key.shape[1], key.shape[2], key.shape[3], key.dtype, key.device, chunk.scaling)
        ranges = torch.where(state.prompt_pending[..., None], state.prompt_ranges, 0)
        starts, ends = ranges.unbind(-1)
        for b in range(B):
            queries = state.prompt_queries[b].transpose(0, 1).contiguous()  # [n, H, D]
            cache = key[b:b + 1].expand(n, -1, -1, -1)
            # The keys stand in for the values: the step's output is not used.
            _, theta = kernels.warmup(queries, cache, cache, self.tau, ends[b].contiguous(), starts[b].contiguous(),
                                      shared=self.shared)
            pending = state.prompt_pending[b]
            state.prompt_thetas[b] = torch.where(pending[None, :], theta.t(), state.prompt_thetas[b])
        state.prompt_recorded |= state.prompt_pending
        state.prompt_pending.zero_()

    def _prompt_kernels(self, rows: int, heads: int, kv_heads: int, keys: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device, scale: float) -> DecodeKernels:
        """A decode plan for ``rows`` prompt rows over ``keys`` keys, kept for the next prompt of that shape."""
        shape = (rows, heads, kv_heads, keys, head_dim, dtype, str(device), scale)
        if self._prompt_plan is None or self._prompt_plan[0] != shape:
            plan = DecodeKernels.plan(batch=rows, q_heads=heads, kv_heads=kv_heads, max_len=keys, head_dim=head_dim,
                                      dtype=dtype, device=device, scale=scale)
            self._prompt_plan = (shape, plan)
        return self._prompt_plan[1]

    def finish_prefill(self, state: SiftState) -> None:
        if self.warmup_source == "decode":
            self._warmup_end = self.warmup
        if self.warmup_source == "prefill":
            self._fit(state, (state.count >= 2) & ~state.fitted)
        if self.warmup_source == "prompt":
            # Refit on every point measured so far: the prompt's last chunk completes the fit.
            points = state.prompt_recorded[:, None, :]
            steps = state.prompt_targets.clamp(min=1)[:, None, :]
            sums = PowerLawSums.of_points(steps, state.prompt_thetas, points)
            self._take_fit(state, sums.fit(), sums, state.calibrated)
