"""transformers integration: ``apply(model, method)``.

Registers an attention function through ``AttentionInterface`` and a mask builder
through ``AttentionMaskInterface`` under a name unique to the handle, then switches
the model to it. The mask registration matters: transformers builds no mask at all
(so no causal masking) for an attention name it does not know.

This module only routes; it never names a method (docs/design.md, "Two modes"):

- rows of a forward pass with no decoding under way are teacher-forced steps and go
  to ``attention.method_attention`` (the method's ``select``);
- inside ``generate`` (or the fast loop in ``siftattention.generation``) the prompt is
  prefilled exactly, and each one-token query is a decode step that goes to the
  method's ``decode_step`` over the KV cache, with kernels planned once per shape;
- methods that never prune (``always_exact``) run through transformers' own SDPA
  attention and mask, so ``Full()`` costs what transformers costs.

State is per (sequence, layer, head) and is reset whenever a forward pass starts
with no past keys, and at the start of every ``generate``. One handle per model at a
time: a second ``apply`` raises ``AlreadyAppliedError``.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import (LayerRecord, exact_attention, is_causal_block, method_attention, prompt_row_ranges,
                        rows_are_ranges, valid_keys)
from .inputs import check_token_inputs
from .kernels.keybound import Int8Keys
from .kernels.plan import BACKENDS
from .key_copy import KeyCopy, cache_windows
from .methods.base import KeyRange, Method, PromptChunk, clone_state, refill_state
from .models import warn_beyond_positions
from .parallel import gather_heads, tensor_parallel_group

_HANDLE_ATTR = "_siftattention_handle"


class UnsupportedModelError(TypeError):
    """The model's attention does not go through transformers' AttentionInterface."""


class AlreadyAppliedError(RuntimeError):
    """The model already runs a siftattention method; remove that handle first."""


def _boolean_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    # Always materialise the mask: the method needs the valid keys of every row.
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


class SiftStats:
    """Realized sparsity and method state per (sequence, layer, head) since the last reset.

    Under tensor parallelism every rank reports every head of the model (gathered over
    the ranks), so each statistic is a collective that all ranks call in the same order.
    """

    def __init__(self, handle: "SiftHandle | _StatsCopy") -> None:
        self._handle = handle

    def frozen(self) -> "SiftStats":
        """These statistics as they are now, kept when the handle's state moves on (a ``DecodeSession``'s next call)."""
        return SiftStats(_StatsCopy(self._handle))

    @property
    def layers(self) -> list[int]:
        return sorted(self._handle.records)

    def state(self, layer: int) -> Any:
        """The method's state of one layer (for Sift: thetas, theta_steps, alpha, beta, r2).

        Under tensor parallelism, the state of this rank's heads only.
        """
        return self._handle.states.get(layer)

    def _stack(self, attr: str) -> torch.Tensor:
        states = self._handle.states
        if not states or any(s is None or not hasattr(s, attr) for s in states.values()):
            raise RuntimeError(
                f"no statistics yet: {attr} exists once a forward pass or generate() has run with {self._handle.method.name} applied"
                if not states
                else f"{self._handle.method.name} keeps no {attr}"
            )
        # To the host layer by layer: under a device map the layers' states live on different devices.
        local = torch.stack([getattr(states[layer], attr).cpu() for layer in sorted(states)])
        return gather_heads(local, self._handle.tp_group, dim=2)

    @property
    def thetas(self) -> torch.Tensor:
        """[L, B, H, w] recorded warmup quantiles (Sift)."""
        return self._stack("thetas")

    @property
    def alpha(self) -> torch.Tensor:
        """[L, B, H] fitted alpha (Sift)."""
        return self._stack("alpha")

    @property
    def beta(self) -> torch.Tensor:
        """[L, B, H] fitted beta (Sift)."""
        return self._stack("beta")

    def rows(self, *, post_warmup: bool = False, min_step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Per layer, per (sequence, head, row) sparsity and a row-selection mask.

        Returns ``sparsity`` [L, B, H, N] and ``selected`` [L, B, 1, N] bool, the rows
        that count: real steps with S >= ``min_step``, approximated rows only when
        ``post_warmup``.
        """
        sparsity, selected = [], []
        for layer in self.layers:
            rec = self._handle.records[layer]
            if not rec.steps:
                continue
            steps = torch.cat(rec.steps, dim=1).cpu().double()
            kept = torch.cat(rec.kept, dim=2).cpu().double()
            approx = torch.cat(rec.approx, dim=1).cpu()
            sel = (steps >= max(1, min_step)) & (approx if post_warmup else torch.ones_like(approx))
            sparsity.append(1.0 - kept / steps.clamp(min=1)[:, None, :])
            selected.append(sel[:, None, :])
        if not sparsity:
            return torch.zeros(0, 0, 0, 0, dtype=torch.float64), torch.zeros(0, 0, 1, 0, dtype=torch.bool)
        return gather_heads(torch.stack(sparsity), self._handle.tp_group, dim=2), torch.stack(selected)

    def realized_sparsity(self, *, post_warmup: bool = False, min_step: int = 1, per_sequence: bool = False) -> Any:
        """Pruned keys / valid keys, averaged over steps, heads, layers (and sequences).

        A float, or with ``per_sequence`` a float64 tensor [B]. Where no step counts (no
        post-warmup step yet), NaN; an exact method (Full) is 0 by definition.
        """
        sparsity, selected = self.rows(post_warmup=post_warmup, min_step=min_step)
        if self._handle.method.always_exact:
            return torch.zeros(self._handle.last_batch, dtype=torch.float64) if per_sequence else 0.0
        weight = selected.expand_as(sparsity).double()
        if per_sequence:
            total = weight.sum(dim=(0, 2, 3))
            return (sparsity * weight).sum(dim=(0, 2, 3)) / total.where(total > 0, torch.full_like(total, float("nan")))
        total = weight.sum()
        return float((sparsity * weight).sum() / total) if total > 0 else float("nan")

    def per_head(self, *, post_warmup: bool = False) -> torch.Tensor:
        """[L, B, H] realized sparsity of every (layer, sequence, head)."""
        sparsity, selected = self.rows(post_warmup=post_warmup)
        weight = selected.expand_as(sparsity).double()
        return (sparsity * weight).sum(-1) / weight.sum(-1).clamp(min=1)

    def step_count(self, *, post_warmup: bool = False) -> int:
        """Number of (sequence, row) steps recorded in the first layer."""
        _, selected = self.rows(post_warmup=post_warmup)
        return int(selected[0].sum()) if selected.numel() else 0


class _StatsCopy:
    """What ``SiftStats`` reads of a handle, copied: its method, states and records at one moment."""

    def __init__(self, handle: "SiftHandle | _StatsCopy") -> None:
        self.method, self.last_batch, self.tp_group = handle.method, handle.last_batch, handle.tp_group
        self.states = {layer: clone_state(state) for layer, state in handle.states.items()}
        self.records = {layer: LayerRecord([t.clone() for t in r.steps], [t.clone() for t in r.kept],
                                           [t.clone() for t in r.approx]) for layer, r in handle.records.items()}


class SiftHandle:
    """An applied method. Use as a context manager, or call ``remove()``."""

    def __init__(self, model: PreTrainedModel, method: Method, decode_backend: str | None = "auto") -> None:
        if decode_backend is not None and decode_backend not in BACKENDS:
            raise ValueError(f"decode_backend must be None or one of {BACKENDS}, got {decode_backend!r}")
        self.model = model
        self.method = method
        self.decode_backend = decode_backend
        # One name per model (a handle at a time), so code compiled around the attention
        # (the fast loop's compile=True) stays valid for the next handle on the model.
        self.name = f"siftattention_{id(model):x}"
        self.states: dict[int, Any] = {}
        self.records: dict[int, Any] = {}
        self.decoding = False
        self.last_batch = 0
        #: Set by ``siftattention.generation`` around its loop: the valid key range and step of every decode call.
        self.context: Any = None
        #: Tokens of the prompt of the generation under way (padding included), set by either loop; None: unknown.
        self.prompt_len: int | None = None
        self.stats = SiftStats(self)
        self._layer_ids: dict[int, int] = {}
        self._batch: dict[int, int] = {}
        self._decoded: dict[int, int] = {}  # decode steps per layer since the prefill (host-side)
        self._fed: dict[int, int] = {}  # tokens per layer since the sequences started (host-side)
        self._range_ok: dict[int, bool] = {}  # valid keys of every row form one contiguous range
        self._causal_mask: tuple[weakref.ref, bool] | None = None  # the last prompt mask checked, and its verdict
        self._plans: dict[tuple, Any] = {}
        self._launched: dict[int, set[str]] = {}  # id of a plan -> the phases launched ahead on it
        self._refill = False  # a new prompt refills each layer's state in place (``reset(keep_states=True)``)
        #: Inside ``generate`` for a method that reads an int8 key copy: the sliding window of each layer of the
        #: cache (``key_copy.cache_windows``), and each layer's copy beside it. None: no copy is kept.
        self._copy_windows: dict[int, int] | None = None
        self._key_copies: dict[int, KeyCopy] = {}
        self._keys: dict[tuple, tuple] = {}  # this forward's decode key ranges: (mask id, keys, batch, device) -> (mask, KeyRange)
        self._keys_layer = -1  # the layer that formed or read them last
        self._ranges: dict[tuple, tuple] = {}  # this forward's prompt row ranges: (mask id, window, shape, device) -> (mask ref, ranges or None)
        self._ranges_layer = -1
        #: Every config's attention implementation as it was, written back by ``remove`` as is: going
        #: through ``set_attn_implementation`` would re-check it (flash_attention_2 without flash-attn fails).
        self._restore = _attention_settings(model)
        #: The process group sharding the heads under tensor parallelism (statistics gather over it), else None.
        self.tp_group = tensor_parallel_group(model)
        self._installed = False
        self._install()

    # -- installation ---------------------------------------------------------------
    def _install(self) -> None:
        cls = type(self.model)
        if not isinstance(self.model, PreTrainedModel) or not cls._can_set_attn_implementation():
            raise UnsupportedModelError(
                f"{cls.__name__} does not route its attention through transformers' AttentionInterface, "
                "so SiftAttention cannot be applied to it"
            )
        current = getattr(self.model, _HANDLE_ATTR, None)
        if current is not None:
            raise AlreadyAppliedError(
                f"{cls.__name__} already runs {current.method.spec()} ({current.name}); remove that handle before applying another method"
            )
        AttentionInterface.register(self.name, _model_attention(self.model))
        AttentionMaskInterface.register(self.name, sdpa_mask if self.method.always_exact else _boolean_mask)
        try:
            self.model.set_attn_implementation(self.name)
        except Exception:
            self._unregister()
            raise
        if self.model.config._attn_implementation != self.name:
            self._unregister()
            raise UnsupportedModelError(f"{cls.__name__} refused the attention implementation {self.name!r}")
        original = self.model.generate

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
            if isinstance(ids, torch.Tensor):
                check_token_inputs(self.model, ids, kwargs.get("attention_mask"))
            # The row-wise reference path (decode_backend None) reads no copy.
            copied = self.method.key_copy_form is not None and self.decode_backend is not None
            windows = cache_windows(self.model, kwargs, self.method.spec()) if copied else None
            self.reset()
            self.decoding = True
            self._copy_windows = windows
            self.prompt_len = _prompt_length(args, kwargs)
            if self.prompt_len is not None:
                new = _new_tokens(self.model, self.prompt_len, kwargs)
                warn_beyond_positions(self.model, self.prompt_len + max(new or 1, 1) - 1,
                                      f"a prompt of {self.prompt_len} tokens" + (f" and {new} new tokens" if new else ""))
            try:
                return original(*args, **kwargs)
            finally:
                self.decoding = False
                self.prompt_len = None
                self._copy_windows = None
                self._key_copies.clear()  # the generation's cache goes too; a later call quantises its own keys

        self.model.generate = generate  # type: ignore[method-assign]
        self.model.__dict__["_reorder_cache"] = self._reorder_hook(getattr(self.model, "_reorder_cache", None))
        setattr(self.model, _HANDLE_ATTR, self)
        self._installed = True

    def _unregister(self) -> None:
        AttentionInterface._global_mapping.pop(self.name, None)
        AttentionMaskInterface._global_mapping.pop(self.name, None)

    def remove(self) -> None:
        """Restore the model's previous attention implementation and ``generate``, and forget the method.

        Never fails: it writes back what ``apply`` found, checking nothing.
        """
        if not self._installed:
            return
        for config, attr, value in self._restore:
            setattr(config, attr, value)
        self.model.__dict__.pop("generate", None)
        self.model.__dict__.pop("_reorder_cache", None)
        self.model.__dict__.pop(_HANDLE_ATTR, None)
        self._unregister()
        self._installed = False

    def __enter__(self) -> "SiftHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _reorder_hook(self, model_reorder: Any) -> Any:
        """The model's ``_reorder_cache``, which transformers' beam search calls after every step with
        ``beam_idx`` (new sequence i continues sequence ``beam_idx[i]``): the cache is reordered as
        transformers would (the model class's own hook, else the cache's ``reorder_cache``), and the
        method's per-sequence state and records with it, so each beam keeps its own statistics."""

        def reorder_cache(cache: Any, beam_idx: torch.Tensor) -> Any:
            if model_reorder is not None:
                cache = model_reorder(cache, beam_idx)
            elif hasattr(cache, "reorder_cache"):
                cache.reorder_cache(beam_idx)
            else:
                raise ValueError(f"{type(self.model).__name__} cannot use beam search with a cache currently, "
                                 "as the cache cannot be reordered")
            self.reorder(beam_idx)
            return cache

        return reorder_cache

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder the sequences: new sequence i continues sequence ``index[i]`` (beam search), its
        state and its recorded rows alike."""
        for layer, state in self.states.items():
            self.states[layer] = self.method.reorder_state(state, index)
        for record in self.records.values():
            record.reorder(index)
        for copy in self._key_copies.values():
            copy.reorder(index)

    def reset(self, keep_states: bool = False) -> None:
        """Forget all per-sequence state and records (a new batch of sequences starts).

        ``keep_states``: each layer's state object stays, and the next prompt refills it in place
        (``methods.base.refill_state``) instead of making a new one, so the CUDA graphs of a
        ``DecodeSession`` read the new sequences' state where they read the last ones'.
        """
        self._refill = keep_states
        layers = list(self.records) if keep_states else []
        if not keep_states:
            self.states.clear()
        # A kept layer starts empty records now: a session's replayed step never reaches the attention glue.
        self.records = {layer: LayerRecord() for layer in layers}
        self._decoded = {layer: 0 for layer in layers}
        self._fed.clear()
        self._range_ok.clear()
        self._key_copies.clear()

    # -- the attention function ---------------------------------------------------------
    def _layer_index(self, module: torch.nn.Module) -> int:
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            idx = self._layer_ids.setdefault(id(module), len(self._layer_ids))
        return int(idx)

    def _attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            raise UnsupportedModelError(f"{type(module).__name__} uses attention sinks, which SiftAttention does not support")
        B, Hq, Q, D = query.shape
        scaling = D**-0.5 if scaling is None else scaling
        decoding = self.decoding or self.context is not None
        layer = self._layer_index(module)
        if key.shape[2] == Q:  # no past keys: the sequences start here
            self._fed[layer] = 0
        fed = self._fed.get(layer, 0)
        self._fed[layer] = fed + Q
        in_prompt = is_prompt(fed, Q, self.prompt_len)
        self.last_batch = B
        if self.method.always_exact and not (self.context is not None and not in_prompt):
            if self._causal_chunk(attention_mask, query, key, dropout, kwargs):
                return exact_attention(query, key, value, attention_mask, scaling=scaling, causal=True).transpose(1, 2).contiguous(), None
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if key.shape[2] == Q or layer not in self.records or self._batch.get(layer) != B:
            # No past keys: a new batch of sequences starts in this layer.
            fresh = self.method.new_state(B, Hq, query.device, layer=layer)
            kept = self.states.get(layer) if self._refill and self._batch.get(layer) == B else None
            self.states[layer] = fresh if kept is None else refill_state(kept, fresh)
            self.records[layer] = LayerRecord()
            self._batch[layer] = B
            self._decoded[layer] = 0
            self._key_copies.pop(layer, None)
        state = self.states[layer]
        if decoding and not in_prompt:
            out = self._decode(layer, module, state, query, key, value, attention_mask, scaling, kwargs)
            if out is not None:
                return out
        K = key.shape[2]
        valid, bias = valid_keys(attention_mask, Q, K, B, query.device)
        prefill = decoding and in_prompt
        softcap = kwargs.get("softcap")
        if prefill:
            # One sync per layer and prompt: can later steps describe their keys as one range per row?
            last = valid[:, 0, -1]
            span = K - last.int().flip(-1).argmax(-1) - last.int().argmax(-1)
            self._range_ok[layer] = bias is None and bool((span == last.sum(-1)).all())
        if prefill and softcap is None and not self.method.observes_prefill():
            causal = bias is None and self._is_causal(attention_mask, valid)
            out = exact_attention(query, key, value, valid, scaling=scaling, bias=bias, causal=causal)
        else:
            out = method_attention(
                self.method, state, query, key, value, valid,
                scaling=scaling, bias=bias, softcap=softcap, prefill=prefill, record=self.records[layer],
            )
        if prefill:
            if self.method.observes_prompt():
                prompt_steps = valid[:, 0, -1].sum(-1)
                if self.prompt_len is not None:  # the prompt's later chunks are real tokens (padding is on the left)
                    prompt_steps = prompt_steps + max(0, self.prompt_len - fed - Q)
                final = self.prompt_len is None or fed + Q >= self.prompt_len
                window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
                ranges = self._prompt_ranges(layer, attention_mask, valid, window)
                self.method.observe_prompt(PromptChunk(query, key, valid, prompt_steps, scaling, bias, softcap, value, final,
                                                       ranges), state)
            self.method.finish_prefill(state)
            if self._copy_windows is not None and (self.prompt_len is None or fed + Q >= self.prompt_len):
                # Once the whole prompt is in: a per-channel copy's ranges come from its valid keys.
                self._follow_keys(layer, key, Q, lambda: valid[:, 0].any(1).int().argmax(-1))
        elif decoding:
            self._decoded[layer] += 1
        return out.transpose(1, 2).contiguous(), None

    def _causal_chunk(self, attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> bool:
        """A prompt chunk after earlier chunks whose mask is plain causal: transformers would
        materialise it for SDPA's masked kernel, the lower-right causal kernel needs none."""
        Q, K = query.shape[2], key.shape[2]
        if not 1 < Q < K or dropout or kwargs.get("softcap") is not None or attention_mask is None:
            return False
        if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[-2:] != (Q, K):
            return False
        return self._is_causal(attention_mask, attention_mask)

    def _is_causal(self, attention_mask: torch.Tensor | None, valid: torch.Tensor) -> bool:
        """``is_causal_block(valid)``, checked once per mask: every layer of a forward gets the same mask tensor."""
        if attention_mask is None:
            return valid.shape[-2] == valid.shape[-1]  # valid_keys built the causal mask itself
        if self._causal_mask is None or self._causal_mask[0]() is not attention_mask:
            self._causal_mask = (weakref.ref(attention_mask), is_causal_block(valid))
        return self._causal_mask[1]

    def _prompt_ranges(self, layer: int, attention_mask: torch.Tensor | None, valid: torch.Tensor,
                       window: int | None) -> torch.Tensor | None:
        """Each prompt row's valid keys ``[start, end)`` from the mask's structure (``attention.prompt_row_ranges``:
        causal, left padding, the layer's sliding window), or None where the mask has another (a custom 4-D mask):
        ``PromptChunk`` then reads the mask's rows. A mask is checked against its ranges once (``rows_are_ranges``,
        one pass over it) for all the layers of a forward that get it, as transformers builds one per layer type;
        every layer's own work is then O(B * Q)."""
        if attention_mask is None:  # valid_keys built the causal mask itself
            return prompt_row_ranges(valid)
        if layer <= self._ranges_layer:  # a new forward
            self._ranges = {}
        self._ranges_layer = layer
        sig = (id(attention_mask), window, valid.shape, valid.device)
        entry = self._ranges.get(sig)
        if entry is None or entry[0]() is not attention_mask:
            ranges = prompt_row_ranges(valid, window)
            # A weak reference: a long prompt's mask (GBs) is not kept past its forward.
            entry = self._ranges[sig] = (weakref.ref(attention_mask), ranges if rows_are_ranges(valid, ranges) else None)
        return entry[1]

    def _step_keys(self, layer: int, mask: torch.Tensor | None, k_len: int, batch: int, device: torch.device,
                   window: int | None = None) -> KeyRange:
        """The key range of a decode step's mask, with S and log S, formed once for all the layers of
        one forward that get that mask (one, or two where sliding-window layers have their own).

        Kept for one forward only (a layer at or below the last one starts the next), so a mask
        a caller reuses and changes in place between forwards is always read again.
        """
        if layer <= self._keys_layer:
            self._keys = {}
        self._keys_layer = layer
        sig = (id(mask), k_len, batch, device, window)  # the entry holds the mask, so its id stays its own
        if sig not in self._keys:
            keys = _key_range(mask, k_len, batch, device)
            steps = keys.steps()
            self._keys[sig] = (mask, KeyRange(keys.seq_lens, keys.starts, steps, steps.float().log(), window))
        return self._keys[sig][1]

    def _decode(self, layer, module, state, query, key, value, attention_mask, scaling, kwargs) -> tuple[torch.Tensor, None] | None:
        """One decode step through the method's ``decode_step``; None where only ``select`` can serve it."""
        step = self.context.step if self.context is not None else self._decoded[layer]
        phase = self.method.decode_phase(step)
        if phase is None or self.decode_backend is None or kwargs.get("softcap") is not None:
            return None
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if self.context is not None:
            keys = self.context.keys(window)
            keys.key_copy = self.context.key_copy(layer)
        else:
            if not self._range_ok.get(layer, False) or (attention_mask is not None and attention_mask.dtype != torch.bool):
                return None
            keys = self._step_keys(layer, attention_mask, key.shape[2], query.shape[0], query.device, window)
            if self._copy_windows is not None:  # a copy of its own: the range is shared by the forward's layers
                keys = dataclasses.replace(keys, key_copy=self._follow_keys(layer, key, 1, lambda: keys.starts))
        kernels, planned = self._plan(query, key, scaling, window)
        if planned and kernels.compiles_ahead:
            self._compile_ahead(kernels, layer, step, query, key, value, keys)
            if self.context is not None and self.context.captures:
                self._launch_ahead(kernels, layer, step, query, key, value, keys)
        res = self.method.decode_step(query[:, :, 0], key, value, keys, state, phase, kernels)
        if self.context is None:  # the fast loop ends steps and phases for all layers itself
            last = layer == max(self.states)
            if last:
                self.after_decode_step(step, phase)
            if self.method.decode_phase(step + 1) != phase:
                # A phase the step's last layer ended early: every layer's work for it now.
                self.method.end_decode_phase(phase, self._ordered_states() if last else [state])
        B, Hq = query.shape[:2]
        steps = keys.steps()
        kept = res.kept if res.kept is not None else steps[:, None].expand(B, Hq)
        approx = res.approx[:, None] if isinstance(res.approx, torch.Tensor) else bool(res.approx)
        if not self.method.always_exact:
            self.records[layer].add(steps[:, None], kept[:, :, None], approx)
        self._decoded[layer] += 1
        return res.out[:, None], None

    def _follow_keys(self, layer: int, key: torch.Tensor, new: int,
                     starts: Callable[[], torch.Tensor | None]) -> Int8Keys:
        """The layer's int8 key copy after a call that received ``key`` with ``new`` new tokens
        (``key_copy.KeyCopy.follow``); ``starts()`` gives the first valid key of each row, asked for only
        where a per-channel copy takes its ranges."""
        copy = self._key_copies.get(layer)
        if copy is None:
            copy = self._key_copies[layer] = KeyCopy(self.method.key_copy_form, self._copy_windows.get(layer))
        return copy.follow(key, new, starts() if copy.needs_ranges else None)

    def _ordered_states(self) -> list[Any]:
        return [self.states[layer] for layer in sorted(self.states)]

    def after_decode_step(self, step: int, phase: str) -> None:
        """The method's host work after decode step ``step`` ran in every layer."""
        self.method.after_decode_step(step, phase, self._ordered_states())

    def end_decode_phase(self, phase: str) -> None:
        """The method's work after the last step of ``phase`` in every layer (the fast loop calls it)."""
        self.method.end_decode_phase(phase, self._ordered_states())

    def _compile_ahead(self, kernels: Any, layer: int, step: int, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, keys: KeyRange) -> None:
        """Compile the kernels of every phase the method names for a plan new at ``step``, side by
        side, on a scratch state: otherwise the first step of each phase compiles its kernels one by one."""
        if not self.method.phases_to_compile(step):
            return
        with kernels.compiling():
            self._run_phases_ahead(kernels, layer, step, query, key, value, keys)

    def _launch_ahead(self, kernels: Any, layer: int, step: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, keys: KeyRange) -> None:
        """Run each phase compiled ahead once, for real, on a scratch state: a kernel's first launch loads its
        module (``cuModuleLoadData``, refused while a stream is captured) and a plan makes some buffers on its
        first call (the tau tensor, the one-pass and key-bound workspaces), so afterwards the phase's first
        step can be captured as a CUDA graph directly (``ready_to_capture``). The plan's workspace counters
        set themselves back, so the real step that follows sees what it would have seen."""
        phases = self._run_phases_ahead(kernels, layer, step, query, key, value, keys)
        self._launched.setdefault(id(kernels), set()).update(phases)

    def _run_phases_ahead(self, kernels: Any, layer: int, step: int, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, keys: KeyRange) -> list[str]:
        """One decode step of every phase still to come (``Method.phases_to_compile``) on a new scratch state;
        returns those phases."""
        phases = self.method.phases_to_compile(step)
        if phases:
            scratch = self.method.new_state(query.shape[0], query.shape[1], query.device, layer=layer)
            for phase in phases:
                self.method.decode_step(query[:, :, 0], key, value, keys, scratch, phase, kernels)
        return list(phases)

    def plans(self) -> list[Any]:
        """The decode plans made so far (``kernels.DecodeKernels``), one per shape."""
        return list(self._plans.values())

    def ready_to_capture(self, phase: str) -> bool:
        """Whether every decode plan has launched ``phase``'s kernels ahead (``_launch_ahead``), so the fast
        loop may capture the phase's first step in a CUDA graph instead of running it eagerly first."""
        return bool(self._plans) and all(phase in self._launched.get(id(plan), ()) for plan in self._plans.values())

    def _plan(self, query: torch.Tensor, key: torch.Tensor, scaling: float,
              window: int | None = None) -> tuple[Any, bool]:
        """The kernels for this shape, planned once (scratch buffers and launch plan) and reused;
        and whether they were planned by this call. A sliding-window layer gets a plan of its own, its
        grids sized for the window rather than the cache."""
        from .kernels import DecodeKernels

        B, Hq, _, D = query.shape
        # transformers' cache grows a key a step: plan for a power-of-two capacity, so the launch plan
        # (and the kernel variants Triton compiles for it) changes only when the length doubles.
        capacity = key.shape[2] if self.context is not None else plan_capacity(key.shape[2])
        span = window if window and window < capacity else None
        sig = (B, Hq, key.shape[1], capacity, span, D, query.dtype, query.device, float(scaling))
        plan = self._plans.get(sig)
        if plan is None:
            plan = DecodeKernels.plan(
                batch=B, q_heads=Hq, kv_heads=key.shape[1], max_len=capacity, head_dim=D, dtype=query.dtype,
                device=query.device, scale=float(scaling), renormalize=self.method.renormalize, backend=self.decode_backend,
                max_range=span,
            )
            self._plans[sig] = plan
            return plan, True
        return plan, False


def _attention_settings(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
    """(config, attribute, value) of the attention implementation of every config of ``model``:
    its own, its sub-configs' (at any depth) and its sub-models'."""
    configs: dict[int, Any] = {}
    pending = [getattr(model, "config", None)] + [getattr(m, "config", None) for m in model.modules() if m is not model]
    while pending:
        config = pending.pop()
        if config is None or id(config) in configs or not hasattr(config, "_attn_implementation"):
            continue
        configs[id(config)] = config
        pending += [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    # transformers keeps the value in ``_attn_implementation_internal`` behind a property that resolves defaults
    attr = "_attn_implementation_internal"
    return [(c, attr, vars(c)[attr]) if attr in vars(c) else (c, "_attn_implementation", c._attn_implementation)
            for c in configs.values()]


def _model_attention(model: PreTrainedModel) -> Any:
    """The model's attention entry point: calls whichever handle is applied to it now.

    Made once per model and opaque to torch.compile (the method's routing and kernels
    stay eager; the fast loop compiles the model code around them).
    """
    fn = model.__dict__.get("_siftattention_attention")
    if fn is None or fn.owner() is not model:  # none yet, or copied along with a deep-copied model
        owner = weakref.ref(model)

        def attention(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
            return owner().__dict__[_HANDLE_ATTR]._attention(module, *args, **kwargs)

        fn = torch.compiler.disable(attention)
        fn.owner = owner
        model.__dict__["_siftattention_attention"] = fn
    return fn


def is_prompt(fed: int, queries: int, prompt_len: int | None) -> bool:
    """Whether a decode-mode forward of ``queries`` tokens, after ``fed`` tokens of the same sequences,
    belongs to the prompt (prefilled exactly, never a recorded step); both generation loops ask this.

    The first ``prompt_len`` tokens are the prompt, however they are chunked, so a one-token prompt is
    a prompt too; every later one-token forward is a decode step. A forward of several tokens after the
    prompt (assisted decoding's check of a draft) is computed as prompt rows. Where the prompt's length
    is unknown, the first forward is the prompt.
    """
    if queries > 1:
        return True
    return fed == 0 if prompt_len is None else fed < prompt_len


def _prompt_length(args: tuple, kwargs: dict) -> int | None:
    """The prompt length of a ``generate(...)`` call: its ``input_ids`` (``inputs``) or ``inputs_embeds``."""
    for ids in (kwargs.get("input_ids"), kwargs.get("inputs"), args[0] if args else None, kwargs.get("inputs_embeds")):
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            return int(ids.shape[1])
    return None


def _new_tokens(model: PreTrainedModel, prompt_len: int, kwargs: dict) -> int | None:
    """The most tokens a ``generate(...)`` call asks for: ``max_new_tokens`` (of the call, else of its
    generation config), else the call's ``max_length`` less the prompt; None where neither is set
    (transformers' default then stops at the model's positions)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is None and kwargs.get("max_length") is not None:
        new = kwargs["max_length"] - prompt_len
    return None if new is None else int(new)


def plan_capacity(length: int) -> int:
    """The cache capacity the reference path plans a decode step for: a power of two, at least 128."""
    return max(128, 1 << (length - 1).bit_length())


def _key_range(mask: torch.Tensor | None, k_len: int, batch: int, device: torch.device) -> KeyRange:
    """The [first, last + 1) range of valid keys of a one-token query's boolean mask (no host sync)."""
    if mask is None:
        return KeyRange(torch.full((batch,), k_len, dtype=torch.int32, device=device))
    row = mask[:, 0, -1, :k_len].expand(batch, k_len).int()
    starts = row.argmax(-1)
    seq_lens = k_len - row.flip(-1).argmax(-1)
    return KeyRange(seq_lens.int(), starts.int())


def apply(model: PreTrainedModel, method: Method, *, decode_backend: str | None = "auto") -> SiftHandle:
    """Run ``model``'s attention through ``method`` until the handle is removed.

    ``decode_backend`` picks how decode steps inside ``generate`` run: "auto" uses the
    method's ``decode_step`` with the Triton kernels on CUDA, the fused C++ kernel for
    float32 on the CPU (torch where it cannot be built) and the torch kernels elsewhere;
    "torch"/"triton"/"cpu" force that kernel backend; None always uses the
    row-wise reference attention (``select``), an independent reference for tests.

    ``apply`` only installs: a method that needs work on data first (Top-theta's calibration)
    is refused with a one-line ``CalibrationError`` until ``method.prepare(model)`` (or
    ``TopTheta.calibrate``) has run. ``Sift(keybound=...)`` keeps its int8 key copy beside
    transformers' ``DynamicCache`` inside ``generate`` (``key_copy.py``); ``generate`` refuses,
    in one line, a cache the copy cannot follow (a static or quantized cache, for one).

    >>> with apply(model, Sift(tau=0.875, warmup=128)) as handle:
    ...     out = model.generate(**inputs, max_new_tokens=256)
    ...     print(handle.stats.realized_sparsity())
    """
    if not isinstance(method, Method):
        raise TypeError(f"method must be a siftattention method (Full, TopK, H2O, Sift, Oracle, ...), got {type(method).__name__}")
    if getattr(model, _HANDLE_ATTR, None) is None:
        method.check_prepared(model)  # before installing, so a refused method leaves the model as it was
    return SiftHandle(model, method, decode_backend)
