"""Full attention: keep every key (the exact baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import torch

from .base import DecodeOutput, KeyRange, Method, Rows, Selection


@dataclass
class Full(Method):
    """Exact attention; realized sparsity 0."""

    name = "full"
    always_exact = True

    def select(self, rows: Rows, state: None) -> Selection:
        return Selection(keep=None, approx=rows.is_step)

    def decode_phase(self, step: int) -> str:
        return "exact"

    def decode_step(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange, state: None, phase: str, kernels: Any) -> DecodeOutput:
        return DecodeOutput(kernels.dense(query, k_cache, v_cache, keys.seq_lens, keys.starts), None, True)
