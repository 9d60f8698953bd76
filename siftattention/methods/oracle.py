"""Oracle: SiftAttention's rule with the exact per-step tau-quantile as threshold.

The best a power-law prediction could do; comparing Sift against it isolates the
prediction error. ``vmc=True`` (with ``renormalize=False``) adds value-mean compensation, as Sift's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..powerlaw import masked_quantile
from .base import KeyRange, Rows, check_bool, check_fraction, check_vmc
from .threshold import RowThresholds, StepThreshold, ThresholdMethod


@dataclass
class Oracle(ThresholdMethod):
    """Keep keys with p > theta_S(tau), the row's exact tau-quantile (and the row's maximum)."""

    tau: float = 0.875
    renormalize: bool = False
    vmc: bool = False
    name = "oracle"
    spec_optional: ClassVar[tuple[str, ...]] = ("vmc",)

    def __post_init__(self) -> None:
        self.tau = check_fraction("tau", self.tau)
        self.renormalize = check_bool("renormalize", self.renormalize)
        self.vmc = check_vmc(self.vmc, self.renormalize)

    def row_thresholds(self, rows: Rows, state: None) -> RowThresholds:
        return RowThresholds(masked_quantile(rows.probs, rows.valid.expand_as(rows.probs), self.tau), rows.is_step)

    def decode_phase(self, step: int) -> str:
        return "sparse"

    def phases_to_compile(self, step: int) -> tuple[str, ...]:
        return ("sparse",)

    def step_threshold(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange,
                       state: None, phase: str, kernels: Any) -> StepThreshold:
        # The exact quantile of this step is the threshold (the warmup kernel computes it).
        _, theta = kernels.warmup(query, k_cache, v_cache, self.tau, keys.seq_lens, keys.starts)
        return StepThreshold(theta)
