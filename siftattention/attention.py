"""Reference attention with a method applied (plain torch, any device).

One call handles one layer: the scores of the query rows against the valid keys,
chunked over rows to bound memory, the method's selection, and the output
``sum_kept p_i v_i`` (divided by the kept mass when the method renormalises).
Every row is one generation step unless the caller marks it as prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right

from .methods.base import KeyRange, Method, Rows, compensate_value_mean

#: Soft bound on the elements of one chunk's [B, H, R, K] score block.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class LayerRecord:
    """Per-row record of one layer since the last reset: what realized sparsity is made of."""

    steps: list[torch.Tensor] = field(default_factory=list)  # [B, R] step S of each recorded row
    kept: list[torch.Tensor] = field(default_factory=list)  # [B, H, R] keys kept
    approx: list[torch.Tensor] = field(default_factory=list)  # [B, R] approximated (post-warmup) rows

    def add(self, steps: torch.Tensor, kept: torch.Tensor, approx: torch.Tensor | bool) -> None:
        """``steps`` [B, R], ``kept`` [B, H, R], ``approx`` [B, R] bool or one bool for every row."""
        if isinstance(approx, bool):
            approx = torch.full_like(steps, approx, dtype=torch.bool)
        # Kept on the tensors' device: a copy to the host here would stall every decode step.
        self.steps.append(steps.detach().int())
        self.kept.append(kept.detach().int())
        self.approx.append(approx.detach())

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder the sequences (beam search): row i's record becomes sequence ``index[i]``'s so far."""
        if not self.steps:
            return
        index = index.to(self.steps[0].device)
        self.steps = [torch.cat(self.steps, dim=1).index_select(0, index)]
        self.kept = [torch.cat(self.kept, dim=2).index_select(0, index)]
        self.approx = [torch.cat(self.approx, dim=1).index_select(0, index)]


class StepRecord:
    """One layer's record in a ``StepLog``: ``add`` keeps the step's tensors for the log's ``flush``."""

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor | bool] | None = None
        self.steps: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []
        self.approx: list[torch.Tensor] = []

    def add(self, steps: torch.Tensor, kept: torch.Tensor, approx: torch.Tensor | bool) -> None:
        """``steps`` [B, 1], ``kept`` [B, H, 1], ``approx`` [B, 1] bool or one bool for every row."""
        self.pending = (steps[:, 0], kept[:, :, 0], approx if isinstance(approx, bool) else approx[:, 0])


class StepLog:
    """Every layer's decode records of a captured loop, in preallocated buffers written once a step.

    Each layer's ``StepRecord`` only holds its call's tensors; ``flush``, run by the loop
    after the whole step, writes all layers' rows at the device index ``counter`` (a [1]
    int64 tensor the loop advances): a few launches a step instead of three per layer,
    and no host bookkeeping, so the step replays from a CUDA graph. ``finish(n)``
    exposes the first ``n`` steps through ``LayerRecord``'s lists.
    """

    def __init__(self, max_steps: int, counter: torch.Tensor) -> None:
        self.max_steps = max(1, max_steps)
        self.counter = counter
        self.records: dict[int, StepRecord] = {}
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # [T, L, B], [T, L, B, H], [T, L, B]
        self._rows: dict[tuple[bool, int], torch.Tensor] = {}  # constant approx rows

    def record(self, layer: int) -> StepRecord:
        record = self.records[layer] = StepRecord()
        return record

    def _approx_row(self, value: bool, like: torch.Tensor) -> torch.Tensor:
        # Both rows are formed by the loop's first (eager) step, so a phase whose first step is captured
        # finds its row made outside the graph.
        if (value, like.shape[0]) not in self._rows:
            for v in (False, True):
                self._rows[(v, like.shape[0])] = torch.full((like.shape[0],), v, dtype=torch.bool, device=like.device)
        return self._rows[(value, like.shape[0])]

    def flush(self) -> None:
        layers = [layer for layer in sorted(self.records) if self.records[layer].pending is not None]
        if not layers:
            return
        rows = [self.records[layer].pending for layer in layers]
        for layer in layers:
            self.records[layer].pending = None
        self._approx_row(True, rows[0][0])
        steps = torch.stack([r[0].int() for r in rows])
        kept = torch.stack([r[1].int() for r in rows])  # the layers of one model share B and H
        approx = torch.stack([self._approx_row(r[2], r[0]) if isinstance(r[2], bool) else r[2].bool() for r in rows])
        if self._buffers is None:  # sized by the first (eager) step, before any capture
            self._layers = layers
            self._buffers = tuple(torch.zeros(self.max_steps, *t.shape, dtype=t.dtype, device=t.device) for t in (steps, kept, approx))
        if layers != self._layers:
            raise RuntimeError(f"decode step recorded layers {layers}, the first step {self._layers}")
        for buffer, value in zip(self._buffers, (steps, kept, approx)):
            buffer.index_copy_(0, self.counter, value[None])

    def restart(self) -> None:
        """A new generation: the recorded rows back to zero, in place (a captured step writes them where they are)."""
        for buffer in self._buffers or ():
            buffer.zero_()

    def tensors(self) -> list[torch.Tensor]:
        """The buffers a decode step writes and the constant rows it reads."""
        return [*(self._buffers or ()), *self._rows.values()]

    def finish(self, n: int) -> None:
        """Expose the first ``n`` recorded steps of every layer as ``LayerRecord``-style lists."""
        for layer, record in self.records.items():
            if self._buffers is None or n <= 0 or layer not in self._layers:
                record.steps, record.kept, record.approx = [], [], []
                continue
            i = self._layers.index(layer)
            steps, kept, approx = (buffer[:n, i] for buffer in self._buffers)
            record.steps, record.kept, record.approx = [steps.T], [kept.permute(1, 2, 0)], [approx.T]


def valid_keys(mask: torch.Tensor | None, q_len: int, k_len: int, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean [B, 1, Q, K] validity and an optional float bias from an attention mask.

    Accepts the boolean masks our mask function registers, and additive float masks
    (0 = attend, very negative = masked) that callers may pass directly.
    """
    if mask is None:
        rows = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        valid = (torch.arange(k_len, device=device)[None, :] <= rows)[None, None].expand(batch, 1, q_len, k_len)
        return valid, None
    mask = mask[..., :k_len]
    if mask.dtype == torch.bool:
        return mask.expand(batch, 1, q_len, k_len), None
    valid = mask > torch.finfo(mask.dtype).min / 2
    bias = torch.where(valid, mask, torch.zeros_like(mask)).float()
    return valid.expand(batch, 1, q_len, k_len), bias


def exact_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    *,
    scaling: float,
    bias: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Exact attention through torch's fused SDPA, for rows no method needs to see.

    Rows without any valid key (left padding) attend to every key instead of producing
    NaN; their outputs are never attended to by real tokens. ``causal=True`` says that
    ``valid`` is exactly the causal mask, aligned to the last key (``is_causal_block``,
    checked by the caller): SDPA then runs its causal kernel with no mask, which is
    faster than a masked one; a chunk of a prompt after earlier chunks (fewer queries
    than keys) runs the lower-right causal variant.
    """
    gqa = query.shape[1] != key.shape[1]
    if causal:
        Q, K = query.shape[-2], key.shape[-2]
        mask = None if Q == K else causal_lower_right(Q, K)
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                                                scale=scaling, enable_gqa=gqa)
    mask = valid | ~valid.any(dim=-1, keepdim=True)
    if bias is not None:
        mask = torch.where(mask, bias.to(query.dtype), torch.finfo(query.dtype).min)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def is_causal_block(valid: torch.Tensor) -> bool:
    """Whether a [B, 1, Q, K] validity mask is exactly causal, aligned to the last key: query i
    sees keys ``<= K - Q + i`` (the last Q rows of a causal K x K block; no padding, no window).
    One host sync."""
    Q, K = valid.shape[-2:]
    if Q > K:
        return False
    causal = torch.ones(Q, K, dtype=torch.bool, device=valid.device).tril(K - Q)
    return bool((valid == causal).all())


def prompt_row_ranges(valid: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, Q, 2] int32 ``[start, end)`` of each row's valid keys in a prompt chunk's [B, 1, Q, K] validity,
    read off the mask's structure rather than its rows: causal with the chunk's keys last (row i's last key
    ``K - Q + i``), left padding, and a sliding window of ``window`` keys. A row with no valid key (padding)
    has ``start >= end``.

    Reads O(B * (Q + K)) of the mask (its diagonal and the chunk's first row), so it describes the mask only
    where the mask has that structure; ``rows_are_ranges`` checks it."""
    B, _, Q, K = valid.shape
    ends = torch.arange(K - Q + 1, K + 1, device=valid.device, dtype=torch.int32)  # [Q]
    # The chunk's own keys on the diagonal: the first valid one is the first real token, where it lies in the chunk.
    diagonal = valid[:, 0].diagonal(offset=K - Q, dim1=-2, dim2=-1)  # [B, Q]
    first_real = diagonal.to(torch.uint8).argmax(-1).int()
    # Otherwise padding ended before the chunk: the first row's first valid key is its start (from the padding,
    # or from the window, whose start then binds every later row too).
    first_row = valid[:, 0, 0].to(torch.uint8).argmax(-1).int()
    first = torch.where(first_real > 0, first_real + (K - Q), first_row)
    first = torch.where(diagonal.any(-1), first, K)  # every row padding
    starts = first[:, None].expand(B, Q)
    if window is not None:
        starts = torch.maximum(starts, ends - window)
    return torch.stack([starts, ends.expand(B, Q)], -1)


def rows_are_ranges(valid: torch.Tensor, ranges: torch.Tensor, elements: int = 1 << 26) -> bool:
    """Whether every row of the validity [B, 1, Q, K] is exactly its range of ``ranges`` [B, Q, 2] (an empty
    one where ``start >= end``): one pass over the mask, in slices of about ``elements``, and one host sync."""
    B, _, Q, K = valid.shape
    keys = torch.arange(K, device=valid.device)
    step = max(1, elements // max(1, B * K))
    differs = torch.zeros((), dtype=torch.bool, device=valid.device)
    for r0 in range(0, Q, step):
        starts, ends = ranges[:, r0:r0 + step, None].unbind(-1)  # [B, n, 1]
        differs |= (valid[:, 0, r0:r0 + step] != ((keys >= starts) & (keys < ends))).any()
    return not bool(differs)


def decode_probs(query: torch.Tensor, k_cache: torch.Tensor, keys: KeyRange, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 softmax [B, Hq, L] of one query token over the valid keys of a cache, and the validity.

    The reference for methods without a kernel of their own: the torch kernel backend's
    scoring over every cache position (fixed shapes, no host synchronisation);
    invalid positions get probability 0.
    """
    from .kernels.torch_ref import _probs, _scores

    scores, valid = _scores(query, k_cache, scaling, keys.seq_lens, keys.starts)
    return _probs(scores), valid


def weighted_values(weights: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_i w_i v_i`` per query head: weights [B, Hq, L], cache [B, Hkv, L, D] -> [B, Hq, D]."""
    from .kernels.torch_ref import _apply_v

    return _apply_v(weights, v_cache).to(dtype)


def method_attention(
    method: Method,
    state: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    *,
    scaling: float,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    prefill: bool = False,
    record: LayerRecord | None = None,
) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Q, D] over ``key``/``value`` [B, Hkv, K, D] with ``method``.

    ``valid`` [B, 1, Q, K] marks the causally valid keys of each row. With ``prefill``
    the rows are computed exactly and only shown to the method (decode mode's prompt).
    Returns [B, Hq, Q, D] in the query's dtype.
    """
    B, Hq, Q, D = query.shape
    K = key.shape[2]
    groups = Hq // key.shape[1]
    # GQA: selection is per query head, so expand the KV heads to the query heads.
    k_rep = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v_rep = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    steps_all = valid[:, 0].sum(-1)  # [B, Q]
    last_step = steps_all.amax(dim=1)
    out = query.new_empty(B, Hq, Q, value.shape[-1])
    chunk = max(1, CHUNK_ELEMENTS // max(1, B * Hq * K))
    for r0 in range(0, Q, chunk):
        r1 = min(Q, r0 + chunk)
        # Causal rows see only a prefix of the keys: work on [0, kmax) to skip the rest.
        row_valid = valid[:, :, r0:r1]
        seen = row_valid.any(dim=2).any(dim=1).any(dim=0).nonzero()
        kmax = int(seen[-1]) + 1 if seen.numel() else 1
        row_valid = row_valid[..., :kmax]
        scores = torch.matmul(query[:, :, r0:r1], k_rep[:, :, :kmax].transpose(2, 3)).float() * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:
            scores = scores + bias[:, :, r0:r1, :kmax]
        scores = scores.masked_fill(~row_valid, float("-inf"))
        # Rows with no valid key (left padding) get zeros rather than NaN.
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        steps = steps_all[:, r0:r1]
        is_step = (steps > 0) & (not prefill)
        rows = Rows(probs=probs, valid=row_valid, steps=steps, is_step=is_step, last_step=last_step, scores=scores,
                    groups=groups)
        if prefill:
            method.observe_prefill(rows, state)
            weights = probs
        else:
            sel = method.select(rows, state)
            weights = sel.probs if sel.probs is not None else probs
            if sel.keep is not None:
                weights = weights * sel.keep
                if method.renormalize:
                    weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
            if record is not None:
                kept = (sel.keep & row_valid).sum(-1) if sel.keep is not None else steps[:, None, :].expand(B, Hq, -1)
                record.add(steps, kept, sel.approx & is_step)
        if method.vmc and not prefill:
            weights = compensate_value_mean(weights, row_valid, steps[:, None, :, None])
        out[:, :, r0:r1] = torch.matmul(weights.to(v_rep.dtype), v_rep[:, :, :kmax])
    return out
