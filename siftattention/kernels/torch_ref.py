"""Plain torch implementation of the sift decode step (backend="torch").

This is the CPU path and the reference the Triton kernels are checked against. It
works on any device, accumulates in float32 and materialises the whole [B, Hq, S]
probability matrix, so it is simple rather than fast. Nothing here reads a tensor
value on the host, so it never synchronises with the device.

Valid keys of batch row b are the positions ``[starts[b], seq_lens[b])`` (``starts``
None means 0, ``seq_lens`` None means S_max); other keys count nowhere. A row without a
valid key has no probabilities: every step gives it zeros (output, kept count, quantile,
anchored gap), never NaN, as the other backends do.

``shared=True`` (``Sift(gqa="shared")``): the query heads of a KV group keep one set, the keys whose
largest probability over the group's heads exceeds the group's threshold (``group_keep``), and
the quantile is the tau-quantile of that group maximum (``group_quantile``), given to every head
of the group. Each head still keeps its own maximum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..powerlaw import masked_quantile


def valid_keys(
    B: int, S: int, device: torch.device, seq_lens: torch.Tensor | None, starts: torch.Tensor | None
) -> torch.Tensor | None:
    """[B, S] boolean mask of the valid keys, or None when every key is valid."""
    if seq_lens is None and starts is None:
        return None
    pos = torch.arange(S, device=device)[None, :]
    valid = torch.ones(B, S, dtype=torch.bool, device=device)
    if seq_lens is not None:
        valid &= pos < seq_lens.to(device)[:, None]
    if starts is not None:
        valid &= pos >= starts.to(device)[:, None]
    return valid


def _scores(
    q: torch.Tensor, k_cache: torch.Tensor, scale: float, seq_lens: torch.Tensor | None, starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled float32 scores [B, Hq, S] (invalid keys at -inf) and the validity mask [B, Hq, S]."""
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    acc = _acc_dtype(q)
    qf = q.to(acc).reshape(B, Hkv, G, D)
    s = torch.matmul(qf, k_cache.to(acc).transpose(-1, -2)).reshape(B, Hq, S) * scale
    valid = valid_keys(B, S, q.device, seq_lens, starts)
    if valid is None:
        return s, torch.ones(B, Hq, S, dtype=torch.bool, device=q.device)
    valid = valid[:, None, :]
    return s.masked_fill(~valid, float("-inf")), valid.expand(B, Hq, S)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 accumulation, float64 for float64 inputs (the references tests compare against)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _probs(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis (exp(-inf) = 0 for invalid keys); 0 on a row with no valid key."""
    p = torch.softmax(s, dim=-1)
    return p.masked_fill(s.amax(dim=-1, keepdim=True) == float("-inf"), 0.0)


def _apply_v(p: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    B, Hq, S = p.shape
    Hkv, D = v_cache.shape[1], v_cache.shape[3]
    G = Hq // Hkv
    out = torch.matmul(p.reshape(B, Hkv, G, S), v_cache.to(p.dtype))
    return out.reshape(B, Hq, D)


def keep_mask(p: torch.Tensor, s: torch.Tensor, valid: torch.Tensor, eta: torch.Tensor, on_scores: bool = False,
              groups: int = 1) -> torch.Tensor:
    """Keys kept: ``p > eta``, every valid key where ``eta <= 0``, and always the row maximum.

    (``eta <= 0`` is explicit: ``p > 0`` would drop keys whose float32 probability
    underflows to 0, where the logit test of the Triton kernels keeps them. ``eta >= 1``
    and NaN keep the maximum only, as ``p > eta`` says.) ``on_scores``: the threshold is on
    the scaled scores instead, ``s > eta`` (-inf keeps every valid key). ``groups`` > 1: the
    heads of each run of ``groups`` heads (heads on dimension 1) keep the keys any of them passes.
    """
    e = eta[..., None].float()
    keep = group_keep(s > e if on_scores else (p > e) | (e <= 0), groups)
    keep.scatter_(-1, s.argmax(dim=-1, keepdim=True), True)  # first maximum, as the kernels
    return keep & valid


def group_keep(keep: torch.Tensor, groups: int) -> torch.Tensor:
    """``keep`` [B, H, ...] with each KV group's heads (runs of ``groups`` on dimension 1) given the union of
    their keys: with one threshold per group, that is the keys whose group maximum passes it."""
    if groups == 1:
        return keep
    B, H = keep.shape[:2]
    union = keep.unflatten(1, (H // groups, groups)).any(2, keepdim=True)
    return union.expand(B, H // groups, groups, *keep.shape[2:]).flatten(1, 2).clone()


def group_quantile(p: torch.Tensor, valid: torch.Tensor, tau: float | torch.Tensor, groups: int,
                   host_sync: bool = True) -> torch.Tensor:
    """The tau-quantile [..., H] of each head's probabilities ``p`` [..., H, K] over its valid keys (``valid``
    broadcast against ``p``); ``groups`` > 1: of each KV group's maximum over its heads (runs of ``groups``
    heads), given to every head of the group. ``tau``: a float or a tensor [..., H]."""
    valid = valid.expand(p.shape)
    if groups == 1:
        return masked_quantile(p, valid, tau, host_sync=host_sync)
    top = p.unflatten(-2, (p.shape[-2] // groups, groups)).amax(-2)
    if isinstance(tau, torch.Tensor):
        tau = tau[..., ::groups]
    theta = masked_quantile(top, valid[..., ::groups, :], tau, host_sync=host_sync)
    return theta.repeat_interleave(groups, -1)


def sift_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eta: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    renormalize: bool,
    starts: torch.Tensor | None = None,
    value_sum: torch.Tensor | None = None,
    shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse step (module docstring); ``value_sum``: see ``value_mean_term``; ``shared``: one kept set per
    KV group (``eta`` equal over each group's heads)."""
    s, valid = _scores(q, k_cache, scale, seq_lens, starts)
    p = _probs(s)
    keep = keep_mask(p, s, valid, eta, groups=_groups(q, k_cache) if shared else 1)
    return _kept_output(p, keep, v_cache, renormalize, q.dtype, value_sum, valid)


def _groups(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Query heads per KV head."""
    return q.shape[1] // k_cache.shape[1]


def _kept_weights(p: torch.Tensor, keep: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The kept keys' probabilities (0 elsewhere), renormalised to their own mass if asked."""
    w = torch.where(keep, p, torch.zeros((), dtype=p.dtype, device=p.device))
    # A kept row's mass is at least its maximum's; only a row without keys has none (it stays 0).
    return w / w.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny) if renormalize else w


def _kept_output(p: torch.Tensor, keep: torch.Tensor, v_cache: torch.Tensor, renormalize: bool,
                 dtype: torch.dtype, value_sum: torch.Tensor | None = None,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output of the kept keys' probabilities (renormalised to their own mass if asked) and the kept counts;
    with ``value_sum`` (and the validity [B, Hq, S]) value-mean compensated (``value_mean_term``)."""
    w = _kept_weights(p, keep, renormalize)
    out = _apply_v(w, v_cache)
    if value_sum is not None:
        out = out + value_mean_term(w.sum(-1), value_sum, valid.sum(-1))
    return out.to(dtype), keep.sum(dim=-1, dtype=torch.int32)


def value_mean_term(mass: torch.Tensor, value_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Value-mean compensation of one decode step: ``(1 - mass) * value_sum / count`` per query head, [B, Hq, D].

    ``mass`` [B, Hq]: the kept probability; ``value_sum`` [B, Hkv, D]: the sum of each KV head's valid value
    rows; ``count`` [B, Hq]: how many valid keys. The pruned mass is spread evenly over the valid keys
    (``methods.base.compensate_value_mean``'s rule, with V read once for the sum); 0 on a row without keys.
    """
    G = mass.shape[1] // value_sum.shape[1]
    mean = value_sum.to(mass.dtype).repeat_interleave(G, 1) / count.clamp(min=1).to(mass.dtype)[..., None]
    return torch.where((count > 0)[..., None], (1.0 - mass)[..., None] * mean, 0.0)


def anchor_mask(valid: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """The anchor keys of each row: its first ``first`` and newest ``last`` valid keys (``valid`` [..., S])."""
    rank = valid.cumsum(-1)  # 1-based rank of each valid key
    n = rank[..., -1:]
    return valid & ((rank <= first) | (rank > n - last))


def _anchor_lse(s: torch.Tensor, valid: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """logsumexp of each row's scores over its anchor keys."""
    return torch.logsumexp(s.masked_fill(~anchor_mask(valid, first, last), float("-inf")), dim=-1)


def anchored_threshold(anchor_lse: torch.Tensor, gap: torch.Tensor, log_eta: torch.Tensor) -> torch.Tensor:
    """The score threshold of the anchored filter: ``anchor_lse + gap + log(eta)``, [B, Hq].

    ``anchor_lse + gap`` predicts the row's log-normaliser; a NaN gap (no step measured it
    yet) or ``log_eta = -inf`` (eta <= 0) keeps every key (-inf); ``log_eta >= 0`` (eta >= 1)
    keeps the row maximum only (+inf), as the exact filter does.
    """
    thr = anchor_lse + torch.where(torch.isnan(gap), float("-inf"), gap) + log_eta
    return torch.where(log_eta >= 0, float("inf"), thr)


def sift_anchored_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    log_eta: torch.Tensor,
    gap: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    renormalize: bool,
    starts: torch.Tensor | None,
    first: int,
    last: int,
    value_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sift with the anchored normaliser: keep keys with ``s > anchor_lse + gap + log(eta)``.

    ``log_eta`` [B, Hq] float32; ``gap`` [B, Hq] float32, the previous step's
    ``logsumexp(s) - anchor_lse`` (NaN: keep every key). The kept keys get the exact
    normaliser (or their own mass with ``renormalize``, or value-mean compensation with ``value_sum``,
    ``value_mean_term``); the row maximum is always kept.
    Returns out [B, Hq, D] in q's dtype, kept [B, Hq] int32 and this step's gap [B, Hq] float32.
    """
    s, valid = _scores(q, k_cache, scale, seq_lens, starts)
    lse = torch.logsumexp(s, dim=-1)
    anchor_lse = _anchor_lse(s, valid, first, last)
    thr = anchored_threshold(anchor_lse, gap.float(), log_eta.float())
    keep = s > thr[..., None]
    keep.scatter_(-1, s.argmax(dim=-1, keepdim=True), True)
    empty = lse == float("-inf")  # no valid key: nothing kept, output 0, gap 0
    p = torch.exp(s - lse[..., None]).masked_fill(empty[..., None], 0.0)
    out, kept = _kept_output(p, keep & valid, v_cache, renormalize, q.dtype, value_sum, valid)
    return out, kept, _gap(lse, anchor_lse)


def _gap(lse: torch.Tensor, anchor_lse: torch.Tensor) -> torch.Tensor:
    """The gap ``lse - anchor_lse``; 0 on a row with no valid key (all of its keys, none, are anchors)."""
    return torch.where(lse == float("-inf"), 0.0, lse - anchor_lse)


def anchor_gap_torch(
    q: torch.Tensor, k_cache: torch.Tensor, scale: float, seq_lens: torch.Tensor | None, starts: torch.Tensor | None,
    first: int, last: int,
) -> torch.Tensor:
    """``logsumexp(s) - logsumexp(s over the anchors)`` [B, Hq] float32: the gap an exact step leaves."""
    s, valid = _scores(q, k_cache, scale, seq_lens, starts)
    return _gap(torch.logsumexp(s, dim=-1), _anchor_lse(s, valid, first, last)).float()


def dense_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the valid keys through torch SDPA (a boolean mask only when needed);
    zeros for a row with no valid key (SDPA's result there depends on its kernel)."""
    B, Hq, D = q.shape
    mask = valid_keys(B, k_cache.shape[2], q.device, seq_lens, starts)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k_cache, v_cache, attn_mask=None if mask is None else mask[:, None, None, :],
        scale=scale, enable_gqa=Hq != k_cache.shape[1],
    )[:, :, 0]
    return out if mask is None else out.masked_fill(~mask.any(dim=-1)[:, None, None], 0.0)


def sift_warmup_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tau: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    starts: torch.Tensor | None = None,
    shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact output and theta [B, Hq], the tau-quantile of each head's probabilities (``shared``: of each KV
    group's maximum, ``group_quantile``)."""
    s, valid = _scores(q, k_cache, scale, seq_lens, starts)
    p = _probs(s)
    out = _apply_v(p, v_cache)
    # no host sync: a decode step
    theta = group_quantile(p, valid, tau, _groups(q, k_cache) if shared else 1, host_sync=False)
    return out.to(q.dtype), theta.float()


def group_quantile_of_scores(scores: torch.Tensor, tau: float | torch.Tensor, seq_lens: torch.Tensor | None,
                             starts: torch.Tensor | None, groups: int) -> torch.Tensor:
    """``group_quantile`` [B, Hq] from log2-domain scores [B, Hq, >= S] over each row's valid keys (what the
    Triton passes store; positions outside the range may hold anything)."""
    B, _, S = scores.shape
    valid = valid_keys(B, S, scores.device, seq_lens, starts)
    valid = torch.ones(B, S, dtype=torch.bool, device=scores.device) if valid is None else valid
    s = scores.masked_fill(~valid[:, None, :], float("-inf"))
    top = s.amax(-1, keepdim=True)
    e = torch.exp2(s - top.masked_fill(top == float("-inf"), 0.0))
    p = e / e.sum(-1, keepdim=True).clamp(min=torch.finfo(e.dtype).tiny)
    return group_quantile(p, valid[:, None, :], tau, groups, host_sync=False).float()
