"""What every decode backend takes: the supported dtypes, the shape checks of a plan, the
power-law threshold given by its parts, and when value-mean compensation applies."""

from __future__ import annotations

from typing import NamedTuple

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class PowerLawThreshold(NamedTuple):
    """The threshold eta = exp(log_alpha - beta * log_steps) given by its parts.

    The Triton filter pass computes it in its prologue, which saves the three small
    elementwise launches per layer and step that forming eta in torch costs; the other
    backends form it with ``eta()``, Sift's arithmetic exactly.
    """

    log_alpha: torch.Tensor  # [B, Hq] float32; -inf keeps every key
    beta: torch.Tensor  # [B, Hq] float32
    log_steps: torch.Tensor  # [B] float32, log S of each row

    def eta(self) -> torch.Tensor:
        return torch.exp(self.log_alpha - self.beta * self.log_steps[:, None])


def check_shape(batch: int, q_heads: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> None:
    """Raise ValueError naming the first bad shape argument of a decode-step plan."""
    for name, v in (("batch", batch), ("q_heads", q_heads), ("kv_heads", kv_heads), ("max_len", max_len),
                    ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} not supported; expected one of {DTYPES}")


def check_compensation(compensate: bool, renormalize: bool) -> None:
    """Value-mean compensation with renormalisation is a ValueError: the kept probabilities then sum
    to 1, so there would be no pruned mass to compensate."""
    if compensate and renormalize:
        raise ValueError("value-mean compensation (vmc, value_sum) needs renormalize=False: after renormalisation "
                         "the kept mass is 1 and there is nothing to compensate")
