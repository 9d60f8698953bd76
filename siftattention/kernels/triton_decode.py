"""Triton kernels for the sift decode step (backend="triton"): each step as a sequence of passes.

One query token per sequence, memory bound. Valid keys of batch row b are the
positions ``[starts[b], seq_lens[b])``; every kernel splits that range (not the
cache's whole length) into a fixed number of splits, so a short row in a long cache
keeps the chip busy and a launch plan made once per cache shape serves every step.

- Sparse step (``sparse``): the scores pass (``triton_scores``: float32 log2-domain scores
  and per-split softmax statistics), then the filter pass (``triton_filter``: threshold,
  compaction of the kept positions, V gather, and the output from the last split program).
- Dense step (``dense``, ``triton_dense``): flash-decoding, one pass over K and V per split
  with an online softmax, the last split program of each row combines.
- Warmup step (``warmup``): the dense kernel also storing the scores, then the exact
  tau-quantile of the probabilities from them (``triton_quantile``). (``warmup_dense=False``:
  the scores pass, the quantile, then the filter pass keeping every key.) ``warmup_gap``
  (``triton_warmup``) then gives the anchored normaliser's gap from what it left.

Launch parameters, geometry and the workspace live in ``triton_config``. The counters
that order the passes (row arrivals, finished splits) live in a workspace buffer that
the last program of each row zeroes again, so a call launches no memset. No step reads
a tensor value on the host: every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from .arguments import PowerLawThreshold
from .triton_config import LOG2E, KernelConfig, Workspace, anchored_onepass, config_for, geometry, stream_counters
from .triton_dense import dense
from .triton_filter import filter_pass
from .triton_quantile import quantile_pass
from .triton_scores import scores_pass
from .triton_warmup import warmup_gap


def _filter_or_reset(geo: dict, ws: Workspace, *args, **kwargs):
    """filter_pass; if it fails to launch, zero the counters the scores pass advanced."""
    try:
        return filter_pass(geo, ws, *args, **kwargs)
    except BaseException:
        ws.sync[:2].zero_()
        raise


def sparse(geo: dict, ws: Workspace, q, k_cache, v_cache, eta, scale: float, seq_lens, starts, renormalize: bool,
           cfg: KernelConfig, anchors: tuple[torch.Tensor, int, int] | None = None,
           value_sum: torch.Tensor | None = None, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One sift decode step on prepared inputs: (out, kept). ``anchors``, ``value_sum``, ``shared``: see
    ``filter_pass``."""
    if anchors is not None and not (geo["fused"] and isinstance(eta, PowerLawThreshold)):
        raise ValueError("the anchored two-pass step needs fused_combine and a PowerLawThreshold")
    pdl = geo["pdl"]
    scores_pass(geo, ws, q, k_cache, scale, seq_lens, starts, cfg, pdl, None if anchors is None else anchors[1:])
    out, kept = _filter_or_reset(geo, ws, v_cache, eta, seq_lens, starts, cfg, q.dtype, renormalize, True, pdl,
                                 anchors, value_sum=value_sum, shared=shared)
    return out, kept


def sparse_quantile(geo: dict, ws: Workspace, q, k_cache, v_cache, eta, tau, scale: float, seq_lens, starts,
                    renormalize: bool, cfg: KernelConfig,
                    value_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sparse step, then theta [B, Hq] from the scores its first pass left in the workspace: the exact
    quantile of the step's probabilities for one more pass over float32 scores, K and V read once."""
    out, kept = sparse(geo, ws, q, k_cache, v_cache, eta, scale, seq_lens, starts, renormalize, cfg, value_sum=value_sum)
    return out, kept, quantile_pass(geo, ws, tau, seq_lens, starts, cfg)


def warmup(geo: dict, ws: Workspace, q, k_cache, v_cache, tau, scale: float, seq_lens, starts,
           cfg: KernelConfig, quantile: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact output plus theta; ``tau`` is a float64 [B, Hq] tensor. ``quantile=False``: no theta (None), the
    scores left in the workspace for a quantile of the caller's (``gqa="shared"``'s group maximum)."""
    if cfg.warmup_dense:
        out = dense(geo, ws, q, k_cache, v_cache, scale, seq_lens, starts, cfg, store_scores=True)
        return out, quantile_pass(geo, ws, tau, seq_lens, starts, cfg, from_dense=True) if quantile else None
    pdl = geo["pdl"]
    scores_pass(geo, ws, q, k_cache, scale, seq_lens, starts, cfg, pdl)
    try:
        theta = quantile_pass(geo, ws, tau, seq_lens, starts, cfg) if quantile else None
    except BaseException:
        ws.sync[:2].zero_()
        raise
    out, _ = _filter_or_reset(geo, ws, v_cache, None, seq_lens, starts, cfg, q.dtype, False, False, pdl)
    return out, theta


# --------------------------------------------------------------------------- functional entry points


def _functional_setup(q, k_cache, cfg: KernelConfig | None, dense_only: bool = False):
    cfg = cfg or config_for(q.device)
    B, Hq, D = q.shape
    geo = geometry(B, Hq, k_cache.shape[1], k_cache.shape[2], D, q.dtype, q.device, cfg)
    sync = stream_counters(q.device, B * k_cache.shape[1]) if cfg.reuse_sync and geo["fused"] else None
    return cfg, geo, Workspace(geo, q.device, sync, dense_only)


def sift_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eta: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    renormalize: bool,
    cfg: KernelConfig | None = None,
    starts: torch.Tensor | None = None,
    value_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs already validated by :func:`siftattention.kernels.sift_decode`."""
    cfg, geo, ws = _functional_setup(q, k_cache, cfg)
    return sparse(geo, ws, q, k_cache, v_cache, eta, scale, seq_lens, starts, renormalize, cfg, value_sum=value_sum)


def sift_warmup_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tau: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    cfg: KernelConfig | None = None,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact output plus theta; ``tau`` is a float64 [B, Hq] tensor."""
    cfg, geo, ws = _functional_setup(q, k_cache, cfg)
    return warmup(geo, ws, q, k_cache, v_cache, tau, scale, seq_lens, starts, cfg)


def dense_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    cfg: KernelConfig | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the valid keys, flash-decoding split-K."""
    cfg, geo, ws = _functional_setup(q, k_cache, cfg, dense_only=True)
    return dense(geo, ws, q, k_cache, v_cache, scale, seq_lens, starts, cfg)


__all__ = [
    "KernelConfig", "Workspace", "config_for", "geometry", "anchored_onepass", "stream_counters", "scores_pass",
    "filter_pass", "sparse", "sparse_quantile", "dense", "warmup", "warmup_gap", "sift_decode_triton", "sift_warmup_decode_triton",
    "dense_decode_triton", "LOG2E",
]
