"""The running sum of each (sequence, KV head)'s valid value rows that value-mean compensation reads,
brought up to date after a decode step appended one key: one small launch on CUDA instead of the
handful of tensor operations (each a graph node per layer per token) the torch form needs."""

from __future__ import annotations

import torch

from .plan import resolve_backend, triton_available


def rows_at(v_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float32 [B, Hkv, D]: each sequence's value rows at cache position ``positions`` [B] (clamped to the cache)."""
    B, H, L, D = v_cache.shape
    index = positions.clamp(0, L - 1)[:, None, None, None].expand(B, H, 1, D)
    return v_cache.gather(2, index)[:, :, 0].float()


def add_step_value_rows_torch(value_sum: torch.Tensor, value_start: torch.Tensor, v_cache: torch.Tensor,
                              seq_lens: torch.Tensor, starts: torch.Tensor | None) -> None:
    """In place: add each sequence's newest value row (at ``seq_lens - 1``) to ``value_sum`` [B, Hkv, D]
    (float32); with ``starts`` (a sliding window's first valid key per sequence) also subtract the row at the
    old start ``value_start`` [B] where the window moved past it, and record the new start."""
    value_sum += rows_at(v_cache, seq_lens.long() - 1)
    if starts is not None:
        # Decode steps advance every row by one key, so at most the row at the old start leaves.
        left = (starts > value_start)[:, None, None]
        value_sum -= torch.where(left, rows_at(v_cache, value_start.long()), 0.0)
        value_start.copy_(starts)


def add_step_value_rows(value_sum: torch.Tensor, value_start: torch.Tensor, v_cache: torch.Tensor,
                        seq_lens: torch.Tensor, starts: torch.Tensor | None, backend: str = "auto") -> None:
    """``add_step_value_rows_torch``'s update, by one Triton launch on CUDA ("auto"), or the torch form
    ("torch"); "triton" forces the kernel (on the CPU under ``TRITON_INTERPRET=1``). Bit-identical: the
    kernel adds and subtracts in the torch form's order, in float32."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'triton'")
    if backend == "triton":
        resolve_backend(backend, v_cache.device)  # the one-line refusal where Triton cannot run
    if backend == "triton" or (backend == "auto" and v_cache.is_cuda and triton_available()):
        from .triton_value_sum import add_step_value_rows_triton

        add_step_value_rows_triton(value_sum, value_start, v_cache, seq_lens, starts)
    else:
        add_step_value_rows_torch(value_sum, value_start, v_cache, seq_lens, starts)

__all__ = ["add_step_value_rows", "add_step_value_rows_torch", "rows_at"]
