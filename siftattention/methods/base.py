"""The interface every attention method implements.

A method sees a chunk of attention rows (probabilities over the causally valid
keys, one row per generation step) and decides which keys each query head keeps.
It owns a small per-(sequence, layer) state, created by ``new_state`` and reset for
every new batch of sequences. Everything else -- computing the probabilities,
applying the selection to V, recording realized sparsity -- lives in
``siftattention.attention`` so that methods stay a few dozen lines each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class Rows:
    """A chunk of attention rows of one layer.

    probs:   [B, H, R, K] float32 softmax over the valid keys (0 elsewhere).
    valid:   [B, 1, R, K] bool, the causally valid (non-padded) keys of each row.
    steps:   [B, R] int64, the generation step S of each row = number of valid keys.
    is_step: [B, R] bool, rows that are generation steps. False for padding rows and,
             in decode mode, for the prompt rows of the prefill (computed exactly).
    last_step: [B] int64, the largest step of the whole forward call (the prompt
             length during a prefill), which a chunk of rows cannot see by itself.
    """

    probs: torch.Tensor
    valid: torch.Tensor
    steps: torch.Tensor
    is_step: torch.Tensor
    last_step: torch.Tensor


@dataclass
class Selection:
    """What a method keeps for a chunk of rows.

    keep:      [B, H, R, K] bool, or None to keep every valid key.
    approx:    [B, R] bool, rows the method approximated (after any warmup).
    probs:     optional replacement probabilities (H2O attends over its own cache).
    """

    keep: torch.Tensor | None
    approx: torch.Tensor
    probs: torch.Tensor | None = None


def check_fraction(name: str, value: float, *, low_open: bool = True, high_open: bool = True) -> float:
    """Raise ValueError naming ``name`` unless ``value`` lies in the interval."""
    lo_ok = value > 0 if low_open else value >= 0
    hi_ok = value < 1 if high_open else value <= 1
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not (lo_ok and hi_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def keep_row_max(probs: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Add each row's largest probability (one key: the first argmax) so no row goes empty."""
    top = torch.zeros_like(keep).scatter_(-1, probs.argmax(dim=-1, keepdim=True), True)
    return (keep | top) & valid


class Method:
    """Base class of the attention methods (each one a small dataclass)."""

    name: ClassVar[str] = "method"
    #: the method never prunes (Full): its rows can run through a fused exact kernel.
    always_exact: ClassVar[bool] = False
    renormalize: bool = False
    #: rows with S <= warmup (teacher-forced) or the first ``warmup`` decoded tokens are exact.
    warmup: int = 0

    def new_state(self, batch: int, heads: int, device: torch.device) -> Any:
        """Per-(sequence, head) state for one layer; None when the method keeps none."""
        return None

    def select(self, rows: Rows, state: Any) -> Selection:
        raise NotImplementedError

    def observes_prefill(self) -> bool:
        """Whether ``observe_prefill`` needs the prompt's attention probabilities."""
        return False

    def observe_prefill(self, rows: Rows, state: Any) -> None:
        """Called, in decode mode, with the prompt rows that are computed exactly."""

    def finish_prefill(self, state: Any) -> None:
        """Called after a prompt was prefilled in decode mode."""

    def spec(self) -> str:
        """The method as a CLI spec, ``name:key=value,...``."""
        from dataclasses import fields

        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)]  # type: ignore[arg-type]
        return self.name + (":" + ",".join(parts) if parts else "")
