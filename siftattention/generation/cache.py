"""A fixed-size KV cache for the fast decode loop.

Every layer holds ``[B, Hkv, max_len, D]`` key and value buffers allocated once (at
the prompt's first write), so their addresses never change and a decode step can be
replayed from a CUDA graph. The prompt is written like a dynamic cache (the attention
sees only the prompt's keys); from then on a one-token write goes to the device
position ``write_pos`` and the attention sees the whole buffer, with the valid range
of each row given by the loop (``KeyRange``), not by a mask. Sliding-window layers
keep every position too: their window is a start offset of the valid range.

With ``int8_keys`` every layer also keeps an int8 copy of its keys (``kernels.keybound``: int8
values and a float32 scale per key row, +25% of a bf16 KV cache at D = 128), written with each
key, for the key-bound sift step. Its ``"channel"`` form adds per-channel scales and offsets per
(batch row, KV head), fixed by the prompt's valid keys once the whole prompt is in (``finish_prompt``):
the prompt is quantised then, and every later key with those ranges.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..kernels.key_write import write_int8_keys
from ..kernels.keybound import Int8Keys, clear_int8_keys, key_copy_form, new_int8_keys


class WritePosition:
    """The device position of the next one-token write, shared by a cache and its layers.

    A holder rather than a reference to the cache: layers pointing back at their cache
    would make a cycle, and the buffers (tens of GB for a large batch) would then wait for
    the garbage collector instead of being freed when ``generate`` returns.
    """

    def __init__(self) -> None:
        #: [1] int64 cache position; None while the prompt is written.
        self.tensor: torch.Tensor | None = None


class FixedLayer(CacheLayerMixin):
    """One layer's preallocated keys and values."""

    is_compileable = True

    def __init__(self, position: WritePosition, max_len: int, sliding: bool, int8_keys: bool | str = False) -> None:
        super().__init__()
        self.position = position
        self.max_len = max_len
        self.is_sliding = sliding
        self.length = 0  # keys written by the prompt (host-side; decode writes are counted on the device)
        self.int8_keys = None if int8_keys is None else key_copy_form(int8_keys, "int8_keys")
        self.key_copy: Int8Keys | None = None  # allocated with the buffers where int8_keys

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any) -> None:
        B, H, _, Dk = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(B, H, self.max_len, Dk)
        self.values = value_states.new_zeros(B, H, self.max_len, value_states.shape[-1])
        if self.int8_keys:
            self.key_copy = new_int8_keys(B, H, self.max_len, Dk, self.device, per_channel=self.int8_keys == "channel")
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos = self.position.tensor
        if pos is not None and key_states.shape[2] == 1:
            self.keys.index_copy_(2, pos, key_states)
            self.values.index_copy_(2, pos, value_states)
            if self.key_copy is not None:
                write_int8_keys(self.key_copy, key_states, index=pos)
            return self.keys, self.values
        n = key_states.shape[2]
        if self.length + n > self.max_len:
            raise ValueError(f"the prompt needs {self.length + n} cache positions, the cache holds {self.max_len}")
        self.keys[:, :, self.length : self.length + n] = key_states
        self.values[:, :, self.length : self.length + n] = value_states
        if self.key_copy is not None and self.key_copy.channel is None:  # per channel: at finish_prompt
            write_int8_keys(self.key_copy, key_states, start=self.length)
        self.length += n
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def finish_prompt(self, starts: torch.Tensor) -> None:
        """A per-channel copy: its ranges from the prompt's keys at or after ``starts`` [B] (left padding
        left out), then the whole prompt quantised with them."""
        copy = self.key_copy
        if copy is None or copy.channel is None or not self.length:
            return
        for b in range(copy.values.shape[0]):  # a row at a time: float32 temporaries of one row's prompt
            row = Int8Keys(*(t[b:b + 1] for t in copy))  # views: the writes land in the copy
            write_int8_keys(row, self.keys[b:b + 1, :, : self.length], start=0, fix_channel=True, starts=starts[b:b + 1])

    def restart(self, prompt_len: int) -> None:
        """A new prompt of ``prompt_len`` tokens: nothing written yet, and every position past it back to a new
        cache's zeros, so the valid keys of a decode step see the cache a fresh generation would. The buffers
        keep their addresses (a session's CUDA graphs read them)."""
        self.length = 0
        if not self.is_initialized:
            return
        self.keys[:, :, prompt_len:].zero_()
        self.values[:, :, prompt_len:].zero_()
        if self.key_copy is not None:
            clear_int8_keys(self.key_copy, prompt_len)

    def tensors(self) -> list[torch.Tensor]:
        """The layer's buffers (none before the first prompt's write)."""
        if not self.is_initialized:
            return []
        return [self.keys, self.values, *(t for t in self.key_copy or () if t is not None)]

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self, *args: Any) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_len

    def get_max_cache_shape(self) -> int:
        return self.max_len


def layer_kinds(config: Any) -> list[str]:
    """The attention kind of each decoder layer of a model config ("full_attention", "sliding_attention", ...)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)


class FixedCache(Cache):
    """transformers ``Cache`` of ``FixedLayer``s: one per decoder layer of ``config`` (``int8_keys``: each
    with an int8 copy of its keys, ``"row"`` (or True) or ``"channel"``)."""

    def __init__(self, config: Any, max_len: int, int8_keys: bool | str = False) -> None:
        self.position = WritePosition()
        super().__init__(layers=[FixedLayer(self.position, max_len, kind == "sliding_attention", int8_keys)
                                 for kind in layer_kinds(config)])
        self.max_len = max_len

    def finish_prompt(self, starts: torch.Tensor) -> None:
        """After the prompt's last write: fix every per-channel key copy's ranges (``FixedLayer.finish_prompt``)."""
        for layer in self.layers:
            layer.finish_prompt(starts)

    def restart(self, prompt_len: int) -> None:
        """A new prompt of ``prompt_len`` tokens on the same buffers (``FixedLayer.restart``)."""
        self.position.tensor = None
        for layer in self.layers:
            layer.restart(prompt_len)

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's buffers."""
        return [t for layer in self.layers for t in layer.tensors()]

    def key_copy(self, layer: int) -> Int8Keys | None:
        """The int8 key copy of ``layer`` (None without ``int8_keys``)."""
        return self.layers[layer].key_copy

    def key_copy_bytes(self) -> int:
        """Memory of every layer's int8 key copy."""
        return sum(layer.key_copy.nbytes() for layer in self.layers if layer.key_copy is not None)
