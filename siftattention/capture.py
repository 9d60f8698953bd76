"""Real attention, saved: post-RoPE queries and the key/value caches of a model run on real text.

Kernels and thresholds behave differently on real attention than on random or planted
inputs (heavy tails, heads of a group that agree, keys that stay relevant for thousands of
steps), so benchmarks and tests replay what a real model produced. One forward pass over
a prompt of N tokens yields, for every layer, the keys and values a decode step at
position ``p`` attends to (the first ``p + 1`` rows) and the query of that step (row ``p``):
the same tensors the attention function receives, after rotary embeddings and before the
key/value heads are repeated for grouped queries.

>>> cap = capture_attention(model, input_ids, layers=[0, 15], positions=[4095])
>>> cap.save("smollm2_4096.pt"); CapturedAttention.load("smollm2_4096.pt").key[15].shape
torch.Size([1, 3, 4096, 64])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .inputs import forward_kwargs


@dataclass
class CapturedAttention:
    """What a decode step of each captured layer reads: ``query[l]`` ``[B, Hq, len(positions), D]``
    (the rows at ``positions``), ``key[l]`` / ``value[l]`` ``[B, Hkv, N, D]`` (the whole prompt's cache)."""

    model: str
    positions: list[int]
    scaling: float
    query: dict[int, torch.Tensor] = field(default_factory=dict)
    key: dict[int, torch.Tensor] = field(default_factory=dict)
    value: dict[int, torch.Tensor] = field(default_factory=dict)
    sliding_window: dict[int, int | None] = field(default_factory=dict)
    source: str = ""  # where the text came from

    @property
    def layers(self) -> list[int]:
        return sorted(self.key)

    def step(self, layer: int, index: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [B, Hq, D], k, v [B, Hkv, S, D])`` of the decode step at ``positions[index]`` (S = position + 1)."""
        position = self.positions[index]
        return (self.query[layer][:, :, index], self.key[layer][:, :, : position + 1],
                self.value[layer][:, :, : position + 1])

    def save(self, path: str | os.PathLike) -> None:
        """One ``torch.save`` file, written to a temporary name and renamed (never half-written)."""
        path = Path(path)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            torch.save(self.__dict__, partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> "CapturedAttention":
        return cls(**torch.load(path, map_location=device, weights_only=True))


def capture_attention(
    model: PreTrainedModel, input_ids: torch.Tensor, *, layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None, source: str = "",
) -> CapturedAttention:
    """Run ``model`` once over ``input_ids`` ``[B, N]`` (no padding) and keep the attention inputs.

    ``layers``: which layers (default all); ``positions``: the query rows kept (default the
    last, N - 1). The model's attention implementation is restored afterwards, whatever happens.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch, tokens] with at least one token, got shape {tuple(input_ids.shape)}")
    n_layers = model.config.get_text_config().num_hidden_layers
    length = input_ids.shape[1]
    wanted = list(range(n_layers)) if layers is None else sorted(set(int(layer) for layer in layers))
    bad = [layer for layer in wanted if not 0 <= layer < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has {n_layers} layers (0..{n_layers - 1})")
    rows = [length - 1] if positions is None else sorted(set(int(p) for p in positions))
    bad = [p for p in rows if not 0 <= p < length]
    if bad:
        raise ValueError(f"positions {bad} out of range for a prompt of {length} tokens (0..{length - 1})")

    captured = CapturedAttention(model=getattr(model.config, "_name_or_path", "") or type(model).__name__,
                                 positions=rows, scaling=float("nan"), source=source)
    index = torch.tensor(rows, device=input_ids.device)

    def record(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        layer = int(module.layer_idx)
        if layer in wanted:
            captured.query[layer] = query.index_select(2, index).detach().clone()
            captured.key[layer] = key.detach().clone()
            captured.value[layer] = value.detach().clone()
            captured.sliding_window[layer] = kwargs.get("sliding_window")
            captured.scaling = float(kwargs.get("scaling") or module.scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"siftattention_capture_{id(model):x}"
    previous = model.config._attn_implementation
    AttentionInterface.register(name, record)
    AttentionMaskInterface.register(name, sdpa_mask)
    try:
        model.set_attn_implementation(name)
        # Only the attention is wanted: logits for every position would be [B, N, vocab] (34 GB at Gemma-3's
        # 262k vocabulary and 32768 tokens).
        logits = {"logits_to_keep": 1} if "logits_to_keep" in forward_kwargs(model) else {}
        with torch.no_grad():
            model(input_ids, use_cache=False, **logits)
    finally:
        model.set_attn_implementation(previous)
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
    return captured
