"""Did the method keep the needle? Its kept keys at the answer's first decode step, per layer and query head.

The fast path reports only how many keys each head kept; the reference path's row-wise
attention (``apply(..., decode_backend=None)``) asks the method's ``select`` for the kept set
itself. The probe prefills the prompt exactly (as the run does), decodes one step with a
copy of the method whose ``select`` also records what it kept, and checks, for every
(layer, query head), whether every key position of the needle was kept.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch


def kept_sets(model: Any, prompt: Sequence[int], method: Any) -> tuple[list[torch.Tensor], list[bool]]:
    """Per layer, in call order: [Hq, K] bool, the keys each query head kept at the first decode step, and whether it approximated.

    Empty when the method computes every step exactly, or when the answer ended with its first token.
    """
    from ...generation import reference_generate

    kept: list[torch.Tensor] = []
    approximated: list[bool] = []
    probe = copy.copy(method)
    select = type(method).select

    def recording_select(rows, state):
        selection = select(probe, rows, state)
        valid = rows.valid[0, 0, -1]
        keep = selection.keep[0, :, -1] & valid if selection.keep is not None else valid.expand(rows.probs.shape[1], -1)
        kept.append(keep.cpu())
        approximated.append(bool(selection.approx[0, -1]))
        return selection

    probe.select = recording_select
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    # Two new tokens: the prefill gives the first, one decode step (every layer once) the second.
    reference_generate(model, ids, torch.ones_like(ids), probe, max_new_tokens=2, decode_backend=None)
    return kept, approximated


def needle_report(kept: Sequence[torch.Tensor], approximated: Sequence[bool], positions: Sequence[int],
                  total: int | None = None) -> dict[str, Any]:
    """A compact summary: the share of (layer, head) that kept every needle key, the share of needle keys kept,
    that share of heads per layer, and the layers where no head kept the whole needle."""
    if not positions:
        return {"needle_tokens": 0}
    if not kept:
        return {"needle_tokens": len(positions), "decode_step": False}
    # The decode step's keys are the prompt's and the first answer token's. A sliding-window layer holds only the
    # newest of them: its key j is position ``total - K + j``, and a layer whose window misses part of the needle
    # is left out (Full cannot see it there either).
    total = total or max(int(k.shape[1]) for k in kept)  # the prompt and the first answer token
    needle = torch.tensor(list(positions), dtype=torch.long)
    per_head: dict[int, torch.Tensor] = {}  # layer -> [Hq, N]
    for layer, k in enumerate(kept):
        index = needle - (total - k.shape[1])
        if bool((index >= 0).all()):
            per_head[layer] = k[:, index]
    whole = {layer: h.all(dim=1) for layer, h in per_head.items()}  # [Hq] per layer: this head kept every needle key
    heads = sum(int(w.numel()) for w in whole.values())
    return {
        "needle_tokens": len(positions),
        "decode_step": True,
        "approximated": any(approximated),
        "kept_all_fraction": sum(int(w.sum()) for w in whole.values()) / heads if heads else None,
        "kept_token_fraction": sum(float(h.float().sum()) for h in per_head.values()) / (heads * len(positions)) if heads else None,
        "layer_kept_all": [round(float(whole[layer].float().mean()), 3) if layer in whole else None for layer in range(len(kept))],
        "layers_dropped": [layer for layer, w in whole.items() if not bool(w.any())],
        "layers_out_of_window": [layer for layer in range(len(kept)) if layer not in whole],
    }


def probe_needle(model: Any, prompt: Sequence[int], method: Any, positions: Sequence[int]) -> dict[str, Any]:
    """``needle_report`` of ``method`` on one prompt; a method that is always exact keeps every key without a probe."""
    if getattr(method, "always_exact", False):
        return {"needle_tokens": len(positions), "decode_step": True, "approximated": False, "kept_all_fraction": 1.0,
                "kept_token_fraction": 1.0, "layer_kept_all": None, "layers_dropped": []}
    kept, approximated = kept_sets(model, prompt, method)
    return needle_report(kept, approximated, positions, len(prompt) + 1)
