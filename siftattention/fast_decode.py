"""The decode step of Sift through ``siftattention.kernels`` (the GPU path of one token).

During ``generate`` a query of one token over a cache whose valid keys form a prefix
(no left padding, no sliding window) skips the reference attention: warmup steps call
``sift_warmup_decode`` (exact output + theta of every head), later steps predict eta
on the device and call ``sift_decode``. The caller passes the step count as a Python
int (decode steps are in lockstep across the batch), so nothing here synchronises
with the device except the one-off fit at the end of the warmup.
"""

from __future__ import annotations

import torch

from .kernels import sift_decode, sift_warmup_decode
from .methods.sift import Sift, SiftState
from .powerlaw import predict


def sift_decode_step(
    method: Sift,
    state: SiftState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scaling: float,
    decoded: int,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One decode step. ``query`` [B, Hq, 1, D], caches [B, Hkv, S, D], ``seq_lens`` [B].

    ``decoded`` counts the decode steps of this sequence batch before this one.
    Returns (out [B, Hq, 1, D], kept [B, Hq], approximated).
    """
    q = query[:, :, 0]
    warming = method.warmup_source == "decode" and decoded < method.warmup
    if warming:
        out, theta = sift_warmup_decode(q, key, value, method.tau, scale=scaling, seq_lens=seq_lens, backend=backend)
        state.thetas[:, :, decoded] = theta
        state.theta_steps[:, decoded] = seq_lens.float()
        state.count += 1
        if decoded + 1 == method.warmup:
            method._fit(state, torch.ones_like(state.fitted))
        kept = seq_lens[:, None].expand(q.shape[0], q.shape[1]).int()
        return out[:, :, None], kept, False
    eta = predict(state.alpha, state.beta, seq_lens.float()[:, None])  # [B, Hq] on the device
    # Sequences whose prefill fit was impossible (prompt of one token) keep every key.
    eta = torch.where(state.fitted[:, None], eta, torch.zeros_like(eta))
    out, kept = sift_decode(q, key, value, eta.float(), scale=scaling, seq_lens=seq_lens, renormalize=method.renormalize, backend=backend)
    return out[:, :, None], kept, True
