"""Writing the int8 key copy (``keybound``'s ``Int8Keys``) where keys are appended: one Triton launch on CUDA,
one call of the fused C++ extension on the CPU, torch ops as the reference and the fallback; all three bit for bit
``keybound.quantize_keys``."""

from __future__ import annotations

import torch

from . import cpu_decode
from .keybound import Int8Keys, channel_ranges, quantize_keys
from .plan import resolve_backend, triton_available


def write_int8_keys(keys: Int8Keys, k: torch.Tensor, start: int | None = None, index: torch.Tensor | None = None,
                    fix_channel: bool = False, starts: torch.Tensor | None = None, backend: str = "auto") -> None:
    """Quantise ``k`` [B, Hkv, n, D] into ``keys`` at positions ``[start, start + n)`` or at the device
    positions ``index`` [n] (no host sync: the fast loop's one-token writes). A per-channel copy takes
    its channel scales and offsets from ``k`` where ``fix_channel`` (the prompt's write; ``starts`` [B]: from
    the rows at or after ``starts[b]`` only, as ``channel_ranges``), else keeps them. ``backend``: "auto" writes
    float16, bfloat16 and float32 keys on CUDA by one Triton launch (``triton_key_write``), float32 keys on the
    CPU by one call of the fused C++ extension where it builds (``cpu_decode.write_int8_keys_cpu``), both bit
    for bit ``quantize_keys``, and the rest by torch ops ("torch", the reference); "triton" forces the kernel
    (on the CPU under ``TRITON_INTERPRET=1``), "cpu" the C++ writer. The channel ranges are fixed in torch
    either way (once per prompt)."""
    if keys.channel is not None and fix_channel:
        c, o = channel_ranges(k, starts)
        keys.channel.copy_(c)
        keys.offset.copy_(o)
    writer = _key_writer(k, backend)
    if writer == "triton":
        from .triton_key_write import write_int8_keys_triton

        write_int8_keys_triton(keys, k, start, index)
        return
    if writer == "cpu":
        cpu_decode.write_int8_keys_cpu(keys, k, start, index)
        return
    new = quantize_keys(k, None if keys.channel is None else (keys.channel, keys.offset))
    if index is not None:
        keys.values.index_copy_(2, index, new.values)
        keys.scales.index_copy_(2, index, new.scales)
    else:
        n = k.shape[2]
        keys.values[:, :, start:start + n] = new.values
        keys.scales[:, :, start:start + n] = new.scales


_WRITER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_WRITE_BACKENDS = ("auto", "torch", "triton", "cpu")


def _key_writer(k: torch.Tensor, backend: str) -> str:
    """The writer ``write_int8_keys`` takes for ``k`` under ``backend`` (see there): "triton", "cpu" or "torch"."""
    if backend not in _WRITE_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch', 'triton' or 'cpu'")
    if backend == "auto":
        if k.is_cpu:  # the CPU first: its checks are the cheap ones, once a layer per decode step
            return "cpu" if k.dtype == torch.float32 and cpu_decode.available() else "torch"
        return "triton" if k.is_cuda and k.dtype in _WRITER_DTYPES and triton_available() else "torch"
    if backend == "torch":
        return "torch"
    resolve_backend(backend, k.device, k.dtype if backend == "cpu" else None)  # the one-line refusals
    if backend == "triton" and k.dtype not in _WRITER_DTYPES:
        raise ValueError(f"the Triton key writer takes float16, bfloat16 or float32 keys, got {k.dtype}")
    return backend
