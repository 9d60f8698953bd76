"""Full attention: keep every key (the exact baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method, Rows, Selection


@dataclass
class Full(Method):
    """Exact attention; realized sparsity 0."""

    name = "full"
    always_exact = True

    def select(self, rows: Rows, state: None) -> Selection:
        return Selection(keep=None, approx=rows.is_step)
