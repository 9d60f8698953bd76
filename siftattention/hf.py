"""transformers integration: ``apply(model, method)``.

Registers an attention function through ``AttentionInterface`` and a boolean mask
builder through ``AttentionMaskInterface`` under a name unique to the handle, then
switches the model to it. The mask registration matters: transformers builds no
mask at all (so no causal masking) for an attention name it does not know.

Two modes, one rule (DESIGN.md): in ``model(...)`` every query row is a generation
step; inside ``model.generate(...)`` the prompt is prefilled exactly and each new
token is a step. State is per (sequence, layer, head) and is reset whenever a
forward pass starts with no past keys, and at the start of every ``generate``.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import LayerRecord, exact_attention, method_attention, valid_keys
from .methods.base import Method

_ids = itertools.count()


class UnsupportedModelError(TypeError):
    """The model's attention does not go through transformers' AttentionInterface."""


def _boolean_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    # Always materialise the mask: the method needs the valid keys of every row.
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


class SiftStats:
    """Realized sparsity and method state per (sequence, layer, head) since the last reset."""

    def __init__(self, handle: "SiftHandle") -> None:
        self._handle = handle

    @property
    def layers(self) -> list[int]:
        return sorted(self._handle.records)

    def state(self, layer: int) -> Any:
        """The method's state of one layer (for Sift: thetas, theta_steps, alpha, beta, r2)."""
        return self._handle.states.get(layer)

    def _stack(self, attr: str) -> torch.Tensor:
        return torch.stack([getattr(self._handle.states[layer], attr).cpu() for layer in self.layers])

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
        return torch.stack(sparsity), torch.stack(selected)

    def realized_sparsity(self, *, post_warmup: bool = False, min_step: int = 1) -> float:
        """Pruned keys / valid keys, averaged over steps, heads, layers and sequences."""
        sparsity, selected = self.rows(post_warmup=post_warmup, min_step=min_step)
        weight = selected.expand_as(sparsity).double()
        total = weight.sum()
        return float((sparsity * weight).sum() / total) if total > 0 else 0.0

    def per_head(self, *, post_warmup: bool = False) -> torch.Tensor:
        """[L, B, H] realized sparsity of every (layer, sequence, head)."""
        sparsity, selected = self.rows(post_warmup=post_warmup)
        weight = selected.expand_as(sparsity).double()
        return (sparsity * weight).sum(-1) / weight.sum(-1).clamp(min=1)

    def step_count(self, *, post_warmup: bool = False) -> int:
        """Number of (sequence, row) steps recorded in the first layer."""
        _, selected = self.rows(post_warmup=post_warmup)
        return int(selected[0].sum()) if selected.numel() else 0


class SiftHandle:
    """An applied method. Use as a context manager, or call ``remove()``."""

    def __init__(self, model: PreTrainedModel, method: Method, decode_backend: str | None = "auto") -> None:
        if decode_backend not in (None, "auto", "torch", "triton"):
            raise ValueError(f"decode_backend must be None, 'auto', 'torch' or 'triton', got {decode_backend!r}")
        self.model = model
        self.method = method
        self.decode_backend = decode_backend
        self.name = f"sift_{next(_ids)}"
        self.states: dict[int, Any] = {}
        self.records: dict[int, LayerRecord] = {}
        self.decoding = False
        self.stats = SiftStats(self)
        self._layer_ids: dict[int, int] = {}
        self._batch: dict[int, int] = {}
        self._decoded: dict[int, int] = {}  # decode steps per layer since the prefill (host-side)
        self._prefix_ok: dict[int, bool] = {}  # valid keys form a prefix (kernel path possible)
        self._previous = model.config._attn_implementation
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
        AttentionInterface.register(self.name, self._attention)
        AttentionMaskInterface.register(self.name, _boolean_mask)
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
            self.reset()
            self.decoding = True
            try:
                return original(*args, **kwargs)
            finally:
                self.decoding = False

        self.model.generate = generate  # type: ignore[method-assign]
        self._installed = True

    def _unregister(self) -> None:
        AttentionInterface._global_mapping.pop(self.name, None)
        AttentionMaskInterface._global_mapping.pop(self.name, None)

    def remove(self) -> None:
        """Restore the model's previous attention implementation and forget the method."""
        if not self._installed:
            return
        self.model.set_attn_implementation(self._previous)
        self.model.__dict__.pop("generate", None)
        self._unregister()
        self._installed = False

    def __enter__(self) -> "SiftHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def reset(self) -> None:
        """Forget all per-sequence state and records (a new batch of sequences starts)."""
        self.states.clear()
        self.records.clear()
        self._decoded.clear()
        self._prefix_ok.clear()

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
        K = key.shape[2]
        layer = self._layer_index(module)
        state = self.states.get(layer)
        if K == Q or layer not in self.records or self._batch.get(layer) != B:
            # No past keys: a new batch of sequences starts in this layer.
            self.states[layer] = state = self.method.new_state(B, Hq, query.device)
            self.records[layer] = LayerRecord()
            self._batch[layer] = B
        valid, bias = valid_keys(attention_mask, Q, K, B, query.device)
        prefill = self.decoding and Q > 1
        scaling = D**-0.5 if scaling is None else scaling
        if prefill:
            # One sync per layer and prompt: may later steps use the kernels' prefix layout?
            self._prefix_ok[layer] = bias is None and bool(valid[:, 0, -1].all())
            self._decoded[layer] = 0
        elif self._use_decode_kernels(layer, query, Q, bias, kwargs):
            return self._kernel_decode_step(layer, state, query, key, value, valid, scaling)
        softcap = kwargs.get("softcap")
        record = self.records[layer]
        if softcap is None and (self.method.always_exact or (prefill and not self.method.observes_prefill())):
            # Rows nobody needs to see go through torch's fused attention.
            out = exact_attention(query, key, value, valid, scaling=scaling, bias=bias)
            if not prefill:
                steps = valid[:, 0].sum(-1)
                record.add(steps, steps[:, None, :].expand(B, Hq, Q), steps > 0)
        else:
            out = method_attention(
                self.method, state, query, key, value, valid,
                scaling=scaling, bias=bias, softcap=softcap, prefill=prefill, record=record,
            )
        if prefill:
            self.method.finish_prefill(state)
        elif self.decoding and layer in self._decoded:
            self._decoded[layer] += 1
        return out.transpose(1, 2).contiguous(), None

    def _use_decode_kernels(self, layer: int, query: torch.Tensor, q_len: int, bias: torch.Tensor | None, kwargs: dict) -> bool:
        from .methods.sift import Sift

        if self.decode_backend is None or not self.decoding or q_len != 1 or not isinstance(self.method, Sift):
            return False
        if bias is not None or kwargs.get("softcap") is not None or not self._prefix_ok.get(layer, False):
            return False
        return self.decode_backend != "auto" or query.is_cuda

    def _kernel_decode_step(self, layer, state, query, key, value, valid, scaling) -> tuple[torch.Tensor, None]:
        from .fast_decode import sift_decode_step

        seq_lens = valid[:, 0, 0].sum(-1)  # valid keys form a prefix: its length, on the device
        out, kept, approx = sift_decode_step(
            self.method, state, query, key, value, seq_lens, scaling=scaling, decoded=self._decoded[layer], backend=self.decode_backend
        )
        self._decoded[layer] += 1
        B = query.shape[0]
        self.records[layer].add(seq_lens[:, None], kept[:, :, None], torch.full((B, 1), approx, device=query.device))
        return out.transpose(1, 2).contiguous(), None


def apply(model: PreTrainedModel, method: Method, *, decode_backend: str | None = "auto") -> SiftHandle:
    """Run ``model``'s attention through ``method`` until the handle is removed.

    ``decode_backend`` picks the decode-step path of Sift inside ``generate``: "auto"
    uses the fused kernels (``siftattention.kernels``) on CUDA and the reference
    attention elsewhere; "torch"/"triton" force the kernel entry points with that
    backend; None always uses the reference attention.

    >>> with apply(model, Sift(tau=0.875, warmup=128)) as handle:
    ...     out = model.generate(**inputs, max_new_tokens=256)
    ...     print(handle.stats.realized_sparsity())
    """
    if not isinstance(method, Method):
        raise TypeError(f"method must be a siftattention method (Full, TopK, H2O, Sift, Oracle), got {type(method).__name__}")
    return SiftHandle(model, method, decode_backend)
