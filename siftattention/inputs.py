"""Checks of what a caller hands to generation, made before any work, and what a model's forward takes.

``siftattention.generate``, ``reference_generate`` and ``model.generate`` under ``apply``
all call ``check_token_inputs`` (and the first two ``check_sampling``), so a bad input is
one ``ValueError`` naming the value, never an error from deep inside torch after the
model has run. Devices are checked before anything reads the tensors (a meta tensor
has no values to read, a CUDA tensor cannot be read without CUDA).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch


def forward_kwargs(model: torch.nn.Module) -> set[str]:
    """The keyword names ``model.forward`` takes (``logits_to_keep``, ``cache_position``, the cache's name)."""
    return set(inspect.signature(model.forward).parameters)


def _embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def vocab_size(model: torch.nn.Module) -> int | None:
    """The number of token ids the model embeds (the larger of its config's and its embedding's)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    sizes = [getattr(text, "vocab_size", None), getattr(_embeddings(model), "num_embeddings", None)]
    sizes = [int(s) for s in sizes if isinstance(s, int) and s > 0]
    return max(sizes) if sizes else None


def _check_device(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values; give it on the model's device")
    if tensor.device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} is on {tensor.device}, but no CUDA device is available here")


def check_token_inputs(model: torch.nn.Module, input_ids: Any, attention_mask: Any = None) -> None:
    """Raise ValueError unless ``input_ids`` [batch, prompt_len] are token ids the model can embed,
    on the model's device, with an ``attention_mask`` of zeros and ones of the same shape (or None)."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a tensor of token ids [batch, prompt_len], got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, prompt_len], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
        raise ValueError(f"input_ids must hold integer token ids, got {str(input_ids.dtype).removeprefix('torch.')}")
    if input_ids.shape[0] == 0:
        raise ValueError("the batch is empty (input_ids has 0 rows)")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    _check_device("input_ids", input_ids)
    weight = next(iter(model.parameters()), None)
    if weight is not None and weight.device.type == "meta":
        raise ValueError("the model's weights are on the meta device (not loaded); load them before generating")
    embedding = getattr(_embeddings(model), "weight", None)
    # Under an accelerate device map, hooks move the inputs to each layer's device themselves.
    if embedding is not None and not getattr(model, "hf_device_map", None) and embedding.device != input_ids.device:
        raise ValueError(f"input_ids are on {input_ids.device}, the model's embeddings on {embedding.device}; "
                         f"move them with .to({str(embedding.device)!r})")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
        _check_device("attention_mask", attention_mask)
        if attention_mask.device != input_ids.device:
            raise ValueError(f"attention_mask is on {attention_mask.device}, input_ids on {input_ids.device}")
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (a token)")
    vocab = vocab_size(model)
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low < 0:
        raise ValueError(f"input_ids hold the negative token id {low}")
    if vocab is not None and high >= vocab:
        raise ValueError(f"input_ids hold the token id {high}, outside the model's vocabulary of {vocab} (ids 0..{vocab - 1})")


def check_token_id(model: torch.nn.Module, name: str, value: Any, *, embedded: bool = True) -> None:
    """Raise ValueError unless ``value`` is None, a token id or a list of them, and with ``embedded`` (an id the
    model is fed) an id of the model's vocabulary. An id the model only has to produce may be any integer
    (an EOS of -1 never matches: generation runs to the end)."""
    if value is None:
        return
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}")
    vocab = vocab_size(model)
    for i in ids if embedded else ():
        if i < 0 or (vocab is not None and i >= vocab):
            raise ValueError(f"{name} {i} is not a token id of the model" + (f" (ids 0..{vocab - 1})" if vocab else ""))


def check_sampling(do_sample: Any, temperature: Any, top_k: Any) -> None:
    """Raise ValueError unless the sampling settings mean something (checked whether or not sampling is on)."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None (no limit) or an integer >= 1, got {top_k!r}")
