"""The int8 key copy beside transformers' own cache, for a key-bound Sift under ``apply``.

transformers' ``DynamicCache`` keeps no int8 copy of its keys, and the attention function never sees the
cache, only the keys it returns. So each layer's copy (``KeyCopy``) follows those keys: a call with ``Q``
new tokens receiving ``n`` keys found ``n - Q`` in the cache, and the copy knows what that means for the
layer's kind of cache (``cache_windows``):

- as many as the copy covers: the cache only grew, the new rows are quantised and appended;
- fewer, where the layer keeps every key (``DynamicLayer``) or its window has not filled yet: the cache was
  cropped (``crop`` keeps the first keys), the copy is cut to match;
- ``window - 1`` where a ``DynamicSlidingWindowLayer`` held more: its window slid, the copy keeps its last rows;
- anything else (a cache filled elsewhere, a window cropped after it filled): the copy is quantised again
  from all the keys received, which is always right, at the cost of reading them once.

Beam search's reorder goes through the handle (``KeyCopy.reorder``); a new ``generate`` call, a new batch of
sequences and a reset cache (which starts with no past keys) start new copies. A per-channel copy takes its
ranges from the prompt's valid keys, once the whole prompt is in, as the fast loop's cache does.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .kernels.key_write import write_int8_keys
from .kernels.keybound import Int8Keys, new_int8_keys

#: Static caches are written in place (their key length never grows), quantized ones change their keys.
_FOLLOWED_IMPLEMENTATIONS = (None, "dynamic", "offloaded")
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


class KeyCopy:
    """One layer's int8 key copy, following the keys transformers' cache returns to the attention.

    ``window``: the sliding window of the layer's cache (a ``DynamicSlidingWindowLayer`` keeps its last
    ``window - 1`` keys), None where it keeps every key. Rows are kept in a buffer that doubles as it fills,
    so an append quantises only the new keys.
    """

    def __init__(self, form: str, window: int | None = None) -> None:
        self.form = form
        self.window = window
        self.buffer: Int8Keys | None = None
        self.length = 0  # rows of the buffer that mirror the keys the attention received last

    @property
    def needs_ranges(self) -> bool:
        """Whether the next ``follow`` fixes a per-channel copy's ranges (it has none yet)."""
        return self.form == "channel" and self.buffer is None

    def follow(self, key: torch.Tensor, new: int, starts: torch.Tensor | None = None) -> Int8Keys:
        """The copy of ``key`` [B, Hkv, n, D], the keys a layer's attention receives with ``new`` new tokens
        (its last ``new`` rows), after updating it; rows ``[0, n)`` of the result. ``starts`` [B]: where a
        copy without ranges yet takes them from (each row's keys at or after ``starts[b]``; left padding)."""
        B, H, n, D = key.shape
        old = n - new
        if not self._fits(key) or not self._align(old):
            old = self.length = 0  # quantised again from every key received
        if self.buffer is not None and self.buffer.values.shape[2] < n:
            self._grow(max(n, 2 * self.buffer.values.shape[2]))
        fix = self.needs_ranges
        if self.buffer is None:
            self.buffer = new_int8_keys(B, H, n, D, key.device, per_channel=self.form == "channel")
        write_int8_keys(self.buffer, key[:, :, old:], start=old, fix_channel=fix, starts=starts)
        self.length = n
        values, scales, channel, offset = self.buffer
        return Int8Keys(values[:, :, :n], scales[:, :, :n], channel, offset)

    def reorder(self, index: torch.Tensor) -> None:
        """New sequence i continues sequence ``index[i]`` (beam search), its rows and ranges alike."""
        if self.buffer is not None:
            self.buffer = Int8Keys(*(None if t is None else t.index_select(0, index.to(t.device)) for t in self.buffer))

    def _fits(self, key: torch.Tensor) -> bool:
        """Whether the buffer serves keys of this batch, heads, head size and device (else a new copy starts)."""
        if self.buffer is None:
            return False
        values = self.buffer.values
        if values.shape[:2] == key.shape[:2] and values.shape[3] == key.shape[3] and values.device == key.device:
            return True
        self.buffer, self.length = None, 0
        return False

    def _align(self, old: int) -> bool:
        """Cut or shift the copy to the ``old`` keys the cache held before this call; False where its rows
        cannot say which keys those are."""
        if old == self.length:
            return True
        if old < self.length and (self.window is None or self.length < self.window):
            self.length = old  # cropped: the first keys stay
            return True
        if self.window is not None and old == self.window - 1 < self.length:
            drop = self.length - old  # the window slid: the last keys stay
            for t in self.buffer[:2]:
                t[:, :, :old] = t[:, :, drop:self.length].clone()
            self.length = old
            return True
        return False

    def _grow(self, rows: int) -> None:
        values, scales, channel, offset = self.buffer
        B, H, _, D = values.shape
        grown = new_int8_keys(B, H, rows, D, values.device, per_channel=channel is not None)
        grown.values[:, :, :self.length] = values[:, :, :self.length]
        grown.scales[:, :, :self.length] = scales[:, :, :self.length]
        self.buffer = grown._replace(channel=channel, offset=offset)


def cache_windows(model: Any, kwargs: dict[str, Any], what: str) -> dict[int, int]:
    """The sliding window of each layer of the cache a ``model.generate(**kwargs)`` call decodes with (the layers
    absent keep every key), for ``KeyCopy``: the cache given (``cache``, or ``past_key_values``), else the
    ``DynamicCache`` transformers makes for the model. Raises a one-line ValueError naming ``what`` before any work
    where a copy cannot follow that cache from the keys it returns."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def setting(name: str) -> Any:
        return kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)

    def refuse(why: str) -> ValueError:
        return ValueError(f"{what} keeps an int8 copy of the keys beside transformers' cache, which it cannot follow "
                          f"here: {why}")

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        if setting("use_cache") is False:
            return {}
        implementation = setting("cache_implementation")
        if implementation not in _FOLLOWED_IMPLEMENTATIONS:
            raise refuse(f"cache_implementation={implementation!r} (use the default dynamic cache)")
        supports = getattr(model, "_supports_default_dynamic_cache", None)
        if supports is not None and not supports():
            raise refuse(f"{type(model).__name__} makes a cache of its own")
        text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        cache = DynamicCache(config=text)  # no tensors: the layout transformers will make
    layers = getattr(cache, "layers", None)
    replicated = getattr(cache, "layer_class_to_replicate", None)
    odd = [type(layer).__name__ for layer in layers or () if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)]
    if layers is None or odd or replicated not in (None, DynamicLayer):
        kinds = ", ".join(sorted(set(odd))) or type(cache).__name__
        raise refuse(f"{kinds} (a DynamicCache of full and sliding-window layers is followed)")
    windows = {i: layer.sliding_window for i, layer in enumerate(layers) if isinstance(layer, DynamicSlidingWindowLayer)}
    if windows and any(setting(name) for name in _ASSISTED):
        # Assisted decoding crops a full window by a count the keys' length does not show.
        raise refuse("assisted decoding crops the sliding-window layers' caches")
    return windows
