"""Decode kernels planned once per shape and run many times (the plan / run split).

``DecodeKernels.plan`` checks the shape arguments, picks the backend and the launch
geometry and allocates every scratch buffer and counter; its ``sparse``, ``dense``
and ``warmup`` methods then only launch kernels: no validation, no host
synchronisation, no allocation whose size depends on tensor values. Each run method
can therefore be captured in a CUDA graph, and one graph may replay many plans (one
per layer, or one shared by the layers of one shape) on one stream.

Preconditions of the run methods (not checked, so that they stay cheap):

- ``q`` [B, Hq, D]; ``k_cache``, ``v_cache`` [B, Hkv, max_len, D], any strides (a
  transformers ``StaticCache`` buffer works), all of the planned dtype on the planned
  device; or a shorter cache [B, Hkv, L, D], L < max_len, with ``seq_lens`` given (no
  key at or beyond L is read), so one plan serves a cache that grows; ``eta`` [B, Hq]
  float32 (or a ``PowerLawThreshold`` of contiguous float32 tensors), ``seq_lens`` [B]
  int32 and ``starts`` [B] int32 (or None), all contiguous.
- Valid keys of row b: positions ``[starts[b], seq_lens[b])`` with
  ``0 <= starts[b] <= seq_lens[b] <= max_len``; keys outside never count (softmax,
  quantile, kept, argmax). An empty range (``starts[b] == seq_lens[b]``) gives zeros on
  every backend: output, kept count, warmup quantile and anchored gap, never NaN.
- eta: ``<= 0`` keeps every valid key, ``>= 1`` (and NaN) only the row maximum; the row
  maximum (first one on ties) is always kept.
- ``value_sum`` (sparse steps, value-mean compensation): [B, Hkv, D] float32 contiguous, the sum
  of each KV head's value rows over the row's valid keys; the step's output gains
  ``(1 - kept mass) * value_sum / n``, n the valid keys (``torch_ref.value_mean_term``). Not with
  ``renormalize`` (the kept mass is then 1 by construction: nothing would be compensated).
- ``shared`` (``Sift(gqa="shared")``): eta is equal over each KV group's query heads, and a key is kept
  for every head of the group when some head's probability exceeds it (plus each head's own maximum);
  ``warmup`` and ``sparse_quantile`` then measure the tau-quantile of the group's maximum probability.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator

import torch

from .arguments import PowerLawThreshold, check_compensation, check_shape
from .keybound import MAX_HEAD_DIM, Int8Keys, sift_keybound_decode_torch
from .torch_ref import (anchor_gap_torch, dense_decode_torch, group_quantile_of_scores, sift_anchored_decode_torch,
                        sift_decode_torch, sift_warmup_decode_torch)

BACKENDS = ("auto", "torch", "triton", "cpu")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """"auto" -> "triton" on CUDA (when Triton imports), "cpu" (the fused C++ kernel) for
    float32 on the CPU where it builds, "torch" elsewhere; forced names checked."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        if device.type == "cpu" and dtype in (None, torch.float32):
            from . import cpu_decode

            return "cpu" if cpu_decode.available() else "torch"
        return "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package")
        if device.type != "cuda" and not interpreting():
            raise ValueError("backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    if backend == "cpu":
        from . import cpu_decode

        if device.type != "cpu" or dtype not in (None, torch.float32):
            raise ValueError(f"backend='cpu' runs float32 tensors on the CPU, got {dtype} on {device.type}")
        if not cpu_decode.available():
            raise ValueError(f"backend='cpu' cannot run here: {cpu_decode.build_problem()}")
    return backend


def on_device(device: torch.device) -> Any:
    """A context that makes ``device`` the current CUDA device: Triton launches on the current one,
    and the layers of an accelerate device map keep their tensors on others."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class DecodeKernels:
    """One decode-step shape, planned: ``sparse`` (sift), ``dense`` (exact) and ``warmup`` steps.

    >>> kern = DecodeKernels.plan(batch=8, q_heads=32, kv_heads=8, max_len=4096, head_dim=128,
    ...                           dtype=torch.bfloat16, device=torch.device("cuda"), scale=128**-0.5)
    >>> out, kept = kern.sparse(q, k_cache, v_cache, eta, seq_lens)

    The Triton backend keeps its scratch (float32 scores [B, Hq, max_len], compaction
    indices, split partials) and its counters in the plan, so calls of one plan must
    run one after another on one stream (a CUDA graph captured on one stream does); two
    plans never share anything. Outputs are fresh tensors on every call.
    """

    def __init__(self, backend: str, batch: int, q_heads: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, scale: float, renormalize: bool, config=None,
                 max_range: int | None = None):
        self.backend = backend
        self.batch, self.q_heads, self.kv_heads, self.max_len, self.head_dim = batch, q_heads, kv_heads, max_len, head_dim
        self.max_range = max_range
        self.dtype, self.device, self.scale, self.renormalize = dtype, device, scale, renormalize
        self._taus: dict[float, torch.Tensor] = {}  # a float tau as the [B, Hq] tensor the kernels read
        self._onepass: dict[tuple[int, int], object] = {}  # one-pass anchored plans by (first, last) anchors
        self.anchored_onepass = False  # Triton plans: whether sparse_anchored runs the one-pass kernel
        self._keybound: Any = None  # Triton: the key-bound step's extra buffers, allocated on first use
        self._candidates: torch.Tensor | None = None  # other backends: the last key-bound step's candidate rows
        if backend == "triton":
            from . import triton_decode as td

            self._td = td
            self.config = config or td.config_for(device)
            self.geometry = td.geometry(batch, q_heads, kv_heads, max_len, head_dim, dtype, device, self.config,
                                        span=max_range)
            self.workspace = td.Workspace(self.geometry, device)
            self.anchored_onepass = td.anchored_onepass(self.geometry, self.config)
        if backend == "cpu":
            from . import cpu_decode

            self._cpu = cpu_decode

    @classmethod
    def plan(
        cls,
        *,
        batch: int,
        q_heads: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scale: float,
        renormalize: bool = False,
        backend: str = "auto",
        config=None,
        max_range: int | None = None,
    ) -> "DecodeKernels":
        """Check the shape, pick the backend and allocate the scratch for it.

        ``backend``: "auto" (Triton on CUDA, the fused C++ kernel for float32 on the CPU,
        torch elsewhere), "torch", "cpu", or "triton" (on CPU only under TRITON_INTERPRET=1). ``config``: a Triton ``KernelConfig``
        (default: the tuned one for the device). ``max_range``: the most valid keys a row will have (a sliding
        window's length), which sizes the Triton launch grids; rows of any length stay correct (None: ``max_len``).
        """
        check_shape(batch, q_heads, kv_heads, max_len, head_dim, dtype)
        if max_range is not None and (isinstance(max_range, bool) or not isinstance(max_range, int) or max_range < 1):
            raise ValueError(f"max_range must be a positive int or None, got {max_range!r}")
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a positive finite float, got {scale!r}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        which = resolve_backend(backend, device, dtype)
        return cls(which, batch, q_heads, kv_heads, max_len, head_dim, dtype, device, float(scale),
                   bool(renormalize), config, max_range)

    def sparse(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               eta: torch.Tensor | PowerLawThreshold, seq_lens: torch.Tensor,
               starts: torch.Tensor | None = None, value_sum: torch.Tensor | None = None,
               shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Sift step: out [B, Hq, D] (q's dtype) and kept [B, Hq] int32 (keys kept per head);
        ``value_sum``: value-mean compensation, ``shared``: one kept set per KV group (module docstring)."""
        check_compensation(value_sum is not None, self.renormalize)
        shared = self._grouped(shared)
        if self.backend == "triton":
            return self._launch(self._td.sparse, q, k_cache, v_cache, eta, self.scale, seq_lens, starts,
                                self.renormalize, self.config, value_sum=value_sum, shared=shared)
        if isinstance(eta, PowerLawThreshold):
            eta = eta.eta()
        if self.backend == "cpu":
            return self._cpu.sift_decode_cpu(q, k_cache, v_cache, eta, self.scale, seq_lens, self.renormalize, starts,
                                             value_sum, shared)
        return sift_decode_torch(q, k_cache, v_cache, eta, self.scale, seq_lens, self.renormalize, starts, value_sum,
                                 shared)


    def sparse_keybound(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: Int8Keys,
                        eta: torch.Tensor | PowerLawThreshold, seq_lens: torch.Tensor,
                        starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sift step that reads full keys only where an int8 bound cannot drop them (``keybound``): out and kept
        as ``sparse``, equal to it except keys within the step's epsilon of the threshold.

        ``keys``: the int8 copy of ``k_cache`` (``keybound.quantize_keys``), values [B, Hkv, >= L, D] int8,
        scales [B, Hkv, >= L] float32 and, per channel, channel scales and offsets [B, Hkv, D] float32 (or
        None). Its shapes are checked on every call (metadata only, no sync); the Triton buffers are
        allocated on the first (eager) call. The "cpu" backend runs the fused C++ step
        (``cpu/keybound_decode.cpp``), the torch backend the reference. ``keybound_candidates()`` then
        gives the key rows it read in full.
        """
        check_int8_keys(keys, k_cache, self.head_dim)
        if self.backend == "triton":
            if self._keybound is None:
                from .triton_keybound import KeyboundWorkspace

                self._keybound = KeyboundWorkspace(self.geometry, self.device)
            from .triton_keybound import sparse_keybound

            return self._launch(sparse_keybound, self._keybound, q, k_cache, v_cache, keys, eta, self.scale, seq_lens,
                                starts, self.renormalize, self.config)
        if isinstance(eta, PowerLawThreshold):
            eta = eta.eta()
        if self.backend == "cpu":
            out, kept, self._candidates = self._cpu.keybound_decode_cpu(q, k_cache, v_cache, keys, eta, self.scale,
                                                                        seq_lens, self.renormalize, starts)
            return out, kept
        L = k_cache.shape[2]
        keys = Int8Keys(keys.values[:, :, :L], keys.scales[:, :, :L], keys.channel, keys.offset)
        out, kept, self._candidates = sift_keybound_decode_torch(q, k_cache, v_cache, keys, eta, self.scale, seq_lens,
                                                                 self.renormalize, starts)
        return out, kept

    def keybound_candidates(self) -> torch.Tensor:
        """[B, Hkv] int32: key rows the last ``sparse_keybound`` call read in full (its candidates)."""
        if self.backend == "triton":
            if self._keybound is None:
                raise ValueError("keybound_candidates: no sparse_keybound step has run on this plan")
            return self._keybound.candidates()
        if self._candidates is None:
            raise ValueError("keybound_candidates: no sparse_keybound step has run on this plan")
        return self._candidates

    def sparse_anchored(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        threshold: PowerLawThreshold, gap: torch.Tensor, seq_lens: torch.Tensor,
                        starts: torch.Tensor | None, first: int, last: int,
                        onepass: bool | None = None,
                        value_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sift step with the anchored normaliser (``Sift(normalizer="anchored")``): out and kept as ``sparse``.

        ``gap`` [B, Hq] float32 holds the previous step's gap (NaN: keep every key) and is
        overwritten with this step's. On Triton the step is either one pass over K and V
        (``triton_onepass``, planned on first use for each anchor count) or the two passes
        of ``sparse`` with the anchored threshold; ``onepass`` None takes the plan's choice
        (``anchored_onepass``). The one-pass kernel has no value-mean compensation: with
        ``value_sum`` the two passes run.
        """
        check_compensation(value_sum is not None, self.renormalize)
        if self.backend == "triton":
            if value_sum is not None and onepass:
                raise ValueError("the one-pass anchored step has no value-mean compensation (value_sum)")
            if value_sum is not None or not (self.anchored_onepass if onepass is None else onepass):
                return self._launch(self._td.sparse, q, k_cache, v_cache, threshold, self.scale, seq_lens, starts,
                                    self.renormalize, self.config, anchors=(gap, first, last), value_sum=value_sum)
            run = self._onepass.get((first, last))
            if run is None:  # planned on the first (eager) call, never inside a captured step
                from .triton_onepass import OnePassPlan

                run = self._onepass[(first, last)] = OnePassPlan(
                    self.batch, self.q_heads, self.kv_heads, self.max_len, self.head_dim, self.dtype, self.device,
                    first, last, self.config)
            with on_device(self.device):
                return run(q, k_cache, v_cache, threshold, gap, self.scale, seq_lens, starts, self.renormalize)
        log_eta = threshold.log_alpha - threshold.beta * threshold.log_steps[:, None]
        if self.backend == "cpu":
            return self._cpu.sift_anchored_decode_cpu(q, k_cache, v_cache, log_eta, gap, self.scale, seq_lens,
                                                      self.renormalize, starts, first, last, value_sum)
        out, kept, new_gap = sift_anchored_decode_torch(q, k_cache, v_cache, log_eta, gap, self.scale, seq_lens,
                                                        self.renormalize, starts, first, last, value_sum)
        gap.copy_(new_gap)
        return out, kept

    def warmup_gap(self, q: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor | None,
                   first: int, last: int) -> torch.Tensor:
        """The anchored normaliser's gap [B, Hq] float32 of an exact step (log-sum-exp minus the anchors').

        On Triton it reads the scores and statistics the ``warmup`` call just before it left
        in the workspace (same q, cache and key range); elsewhere it scores the keys again.
        """
        if self.backend == "triton":
            return self._launch(self._td.warmup_gap, seq_lens, starts, first, last, self.config)
        return anchor_gap_torch(q, k_cache, self.scale, seq_lens, starts, first, last)

    def dense(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
              starts: torch.Tensor | None = None) -> torch.Tensor:
        """Exact attention over the valid keys: out [B, Hq, D] (q's dtype)."""
        if self.backend == "triton":
            return self._launch(self._td.dense, q, k_cache, v_cache, self.scale, seq_lens, starts, self.config)
        if self.backend == "cpu":
            return self._cpu.dense_decode_cpu(q, k_cache, v_cache, self.scale, seq_lens, starts)
        return dense_decode_torch(q, k_cache, v_cache, self.scale, seq_lens, starts)

    def sparse_quantile(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        eta: torch.Tensor | PowerLawThreshold, tau: float, seq_lens: torch.Tensor,
                        starts: torch.Tensor | None = None, value_sum: torch.Tensor | None = None,
                        shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``sparse``'s out and kept, and theta [B, Hq]: the exact tau-quantile of the step's probabilities (as
        ``warmup``'s). On Triton the quantile selects from the scores the sparse step stored, so K and V
        are read once (``shared``: torch takes the group's quantile from those scores); elsewhere an exact
        ``warmup`` step measures it."""
        shared = self._grouped(shared)
        if self.backend == "triton":
            check_compensation(value_sum is not None, self.renormalize)
            if shared:
                out, kept = self.sparse(q, k_cache, v_cache, eta, seq_lens, starts, value_sum, shared=True)
                return out, kept, self._stored_group_quantile(tau, seq_lens, starts)
            return self._launch(self._td.sparse_quantile, q, k_cache, v_cache, eta, self._tau_tensor(tau), self.scale,
                                seq_lens, starts, self.renormalize, self.config, value_sum)
        out, kept = self.sparse(q, k_cache, v_cache, eta, seq_lens, starts, value_sum, shared=shared)
        return out, kept, self.warmup(q, k_cache, v_cache, tau, seq_lens, starts, shared=shared)[1]

    def _grouped(self, shared: bool) -> bool:
        """Whether a ``shared`` step differs from a per-head one: not with one query head per KV head, which then
        runs the per-head kernels themselves (bit for bit the same)."""
        return shared and self.q_heads != self.kv_heads

    def _stored_group_quantile(self, tau: torch.Tensor | float, seq_lens: torch.Tensor,
                               starts: torch.Tensor | None) -> torch.Tensor:
        """Triton: the group maximum's tau-quantile [B, Hq] from the scores the step just run stored, in torch (a
        sort of [B, Hkv, S] probabilities: these are calibration steps, one in ``recalibrate_every``)."""
        return group_quantile_of_scores(self.workspace.scores, self._tau_tensor(tau), seq_lens, starts,
                                        self.q_heads // self.kv_heads)

    def _tau_tensor(self, tau: torch.Tensor | float) -> torch.Tensor:
        """``tau`` as the float64 [B, Hq] tensor the kernels read (a float's tensor made once, on the first,
        eager step, never inside a captured one)."""
        if isinstance(tau, torch.Tensor):
            return tau.to(torch.float64).contiguous()
        tau_t = self._taus.get(float(tau))
        if tau_t is None:
            tau_t = self._taus[float(tau)] = torch.full((self.batch, self.q_heads), float(tau), dtype=torch.float64,
                                                       device=self.device)
        return tau_t

    def warmup(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tau: torch.Tensor | float,
               seq_lens: torch.Tensor, starts: torch.Tensor | None = None,
               shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact output and theta [B, Hq] float32, the tau-quantile of each head's probabilities (``shared``: of
        each KV group's maximum probability, given to every head of the group).

        ``tau``: a float or a [B, Hq] tensor; the quantile is torch.quantile's linear
        rule at position ``tau * (n - 1)`` ascending, ``n = seq_len - start``. The
        "cpu" backend selects the order statistics in linear time (no sort).
        """
        tau_t = self._tau_tensor(tau)
        shared = self._grouped(shared)
        if self.backend == "triton":
            out, theta = self._launch(self._td.warmup, q, k_cache, v_cache, tau_t, self.scale, seq_lens, starts,
                                      self.config, quantile=not shared)
            return (out, self._stored_group_quantile(tau_t, seq_lens, starts)) if shared else (out, theta)
        if self.backend == "cpu":
            return self._cpu.warmup_decode_cpu(q, k_cache, v_cache, tau_t, self.scale, seq_lens, starts, shared)
        return sift_warmup_decode_torch(q, k_cache, v_cache, tau_t, self.scale, seq_lens, starts, shared)

    @property
    def compiles_ahead(self) -> bool:
        """Whether ``compiling()`` does anything: Triton on a GPU (not its interpreter), unless
        ``SIFTATTENTION_PRECOMPILE=0``."""
        return (self.backend == "triton" and not interpreting()
                and os.environ.get("SIFTATTENTION_PRECOMPILE", "1").strip() != "0")

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Inside, this plan's run methods compile their Triton kernels for the arguments given
        instead of launching them (side by side on a thread pool); on exit every one has compiled.

        The outputs of calls made inside are left unset. A step that launches several kernels
        otherwise compiles them one after another on its first call (float32 on an H200: 10 s
        for Sift's warmup and sparse steps; side by side, a first generation 4.9-6.4 s shorter).
        Elsewhere (``compiles_ahead`` false) the calls run as usual.
        """
        if not self.compiles_ahead:
            yield
            return
        from .triton_common import compiling

        with on_device(self.device), compiling():
            yield

    def _launch(self, run: Any, *args: Any, **kwargs: Any) -> Any:
        """A Triton entry point on this plan's geometry and workspace, launched on the plan's device."""
        with on_device(self.device):
            return run(self.geometry, self.workspace, *args, **kwargs)

    def scratch_bytes(self) -> int:
        """Device memory the plan holds (0 for the torch backend)."""
        if self.backend != "triton":
            return 0
        extra = self._keybound.nbytes() if self._keybound is not None else 0
        return self.workspace.nbytes() + extra + sum(run.scratch_bytes() for run in self._onepass.values())

    def __repr__(self) -> str:
        return (f"DecodeKernels(backend={self.backend!r}, batch={self.batch}, heads={self.q_heads}/{self.kv_heads}, "
                f"max_len={self.max_len}, head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})")


def check_int8_keys(keys: Any, k_cache: torch.Tensor, head_dim: int) -> None:
    """Raise ValueError (one line) unless ``keys`` is an int8 copy that fits ``k_cache`` [B, Hkv, L, D]."""
    if not isinstance(keys, Int8Keys):
        raise ValueError("keys must be an Int8Keys from keybound.quantize_keys")
    values, scales, channel, offset = keys
    B, Hkv, L, D = k_cache.shape
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the key-bound step supports head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    if values.dtype != torch.int8 or scales.dtype != torch.float32:
        raise ValueError(f"keys must be int8 values and float32 scales, got {values.dtype} and {scales.dtype}")
    if values.dim() != 4 or tuple(values.shape[:2]) != (B, Hkv) or values.shape[2] < L or values.shape[3] != D:
        raise ValueError(f"key values {tuple(values.shape)} do not cover the cache {tuple(k_cache.shape)}")
    if tuple(scales.shape) != tuple(values.shape[:3]):
        raise ValueError(f"key scales {tuple(scales.shape)} must be {tuple(values.shape[:3])}")
    if (channel is None) != (offset is None):
        raise ValueError("per-channel keys need both channel scales and offsets")
    for t in (channel, offset) if channel is not None else ():
        if t.dtype != torch.float32 or tuple(t.shape) != (B, Hkv, D) or t.stride() != channel.stride():
            raise ValueError(f"channel scales and offsets must be float32 [{B}, {Hkv}, {D}] of one layout, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if any(t is not None and t.device != k_cache.device for t in keys):
        raise ValueError("keys must be on the cache's device")
