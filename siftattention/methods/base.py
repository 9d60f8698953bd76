"""The interface every attention method implements.

A method has two entry points, one per mode (docs/design.md):

- ``select`` (teacher-forced rows, and the prompt of a decode): it sees a chunk of
  attention rows (probabilities over the causally valid keys, one row per
  generation step) and decides which keys each query head keeps; computing the
  probabilities and applying the selection live in ``siftattention.attention``.
- ``decode_step`` (one new token per sequence): it owns the whole step over the KV
  cache, through ``siftattention.kernels`` (Triton on CUDA, torch elsewhere). It
  must not synchronise with the host or change shapes, so a generation loop can
  capture it in a CUDA graph. ``decode_phase`` names what a given step does
  (steps with equal phases run the same code and can replay one graph).

State is per (sequence, layer), created by ``new_state`` and reset for every new
batch of sequences.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch


@dataclass
class Rows:
    """A chunk of attention rows of one layer.

    probs:   [B, H, R, K] float32 softmax over the valid keys (0 elsewhere).
    valid:   [B, 1, R, K] bool, the causally valid (non-padded) keys of each row.
    steps:   [B, R] int64, the generation step S of each row = number of valid keys.
    is_step: [B, R] bool, rows that are generation steps. False for padding rows and,
             in decode mode, for the prompt rows of the prefill (computed exactly).
    last_step: [B] int64, the largest step of the whole forward call (the prompt
             length during a prefill), which a chunk of rows cannot see by itself.
    scores:  [B, H, R, K] float32 scaled pre-softmax scores (-inf at invalid keys), for the
             rules stated on scores rather than probabilities (Top-theta, Skip-Softmax).
    groups:  query heads per KV head (GQA), for rules that decide per KV group.
    """

    probs: torch.Tensor
    valid: torch.Tensor
    steps: torch.Tensor
    is_step: torch.Tensor
    last_step: torch.Tensor
    scores: torch.Tensor | None = None
    groups: int = 1


@dataclass
class PromptChunk:
    """One layer's queries and keys of a prompt chunk, for a method that samples prompt rows itself.

    query: [B, Hq, Q, D] the chunk's queries; key, value: [B, Hkv, K, D] every key and value so far (the cache).
    valid: [B, 1, Q, K] bool, the causally valid keys of each query row.
    prompt_steps: [B] int64, each sequence's whole prompt length in real tokens (its last prompt
             row's step), known before the prompt's last chunk is.
    final: the prompt's last chunk (``key`` holds every prompt key).
    ranges: [B, Q, 2] int32 each row's valid keys ``[start, end)`` (none where ``start >= end``), where the attention
             glue knows the mask's structure (``attention.prompt_row_ranges``); None for a mask of another shape,
             whose rows are then read whole.
    The attention of the chunk itself is computed exactly elsewhere (SDPA); ``probs`` scores only
    the rows a method asks for.
    """

    query: torch.Tensor
    key: torch.Tensor
    valid: torch.Tensor
    prompt_steps: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None
    softcap: float | None = None
    value: torch.Tensor | None = None
    final: bool = True
    ranges: torch.Tensor | None = None

    @property
    def steps(self) -> torch.Tensor:
        """[B, Q] int32 the step S of each query row (its number of valid keys): from ``ranges`` in O(B * Q),
        else (no ranges: a mask of unknown structure) the mask's row sums, O(B * Q * K)."""
        if self.ranges is not None:
            return (self.ranges[..., 1] - self.ranges[..., 0]).clamp(min=0)
        # Summed as bytes: torch converts a bool tensor to the sum's dtype first (2x slower on a long prompt's mask).
        return self.valid[:, 0].view(torch.uint8).sum(-1, dtype=torch.int32)

    def value_sum(self) -> torch.Tensor:
        """[B, Hkv, D] float32 sum of the value rows the chunk's last row attends to: the prompt so far,
        without its left padding (and, on a sliding-window layer, only the window's rows)."""
        return sum_value_rows(self.value, self.valid[:, 0, -1])

    def probs(self, batch: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 softmax [Hq, n, K] of rows ``rows`` ([n] int64) of sequence ``batch`` over their valid keys,
        and the validity [1, n, K]: ``attention.method_attention``'s arithmetic for those rows."""
        q = self.query[batch, :, rows]  # [Hq, n, D]
        k = self.key[batch]
        groups = q.shape[0] // k.shape[0]
        n = rows.numel()
        # GQA: the query heads of one KV head side by side, so K is read once per KV head.
        q = q.reshape(k.shape[0], groups * n, q.shape[-1])
        scores = torch.matmul(q, k.transpose(1, 2)).float().reshape(-1, n, k.shape[1]) * self.scaling
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if self.bias is not None:
            scores = scores + self.bias[batch, :, rows]
        valid = self.valid[batch, :, rows]
        scores = scores.masked_fill(~valid, float("-inf"))
        return torch.softmax(scores, dim=-1).nan_to_num(0.0), valid


@dataclass
class KeyRange:
    """The valid keys of each sequence at one decode step: cache positions ``[starts, seq_lens)``.

    ``starts`` covers left padding and sliding windows (None: every row starts at 0).
    """

    seq_lens: torch.Tensor  # [B] int32
    starts: torch.Tensor | None = None  # [B] int32
    #: S and log S per row when the caller keeps them already (the fast loop updates them once a step).
    step_count: torch.Tensor | None = None  # [B] int32
    log_step_count: torch.Tensor | None = None  # [B] float32
    #: the layer's sliding window (its valid range is at most this many keys ending at seq_lens), or None
    window: int | None = None
    #: The layer's int8 key copy (``kernels.keybound.Int8Keys``) where one is kept (the fast loop's cache, or
    #: ``key_copy.KeyCopy`` beside transformers' under ``apply``, for ``Sift(keybound=True)``); None elsewhere.
    key_copy: Any = None

    def steps(self) -> torch.Tensor:
        """The generation step S of each row ([B] integers): the number of valid keys."""
        if self.step_count is not None:
            return self.step_count
        return self.seq_lens if self.starts is None else self.seq_lens - self.starts

    def log_steps(self) -> torch.Tensor:
        """log S per row, float32 [B]."""
        return self.log_step_count if self.log_step_count is not None else self.steps().float().log()


@dataclass
class DecodeOutput:
    """One decode step of one layer.

    out:    [B, Hq, D] attention output in the query's dtype.
    kept:   [B, Hq] int32 keys kept per head, or None when every valid key was used.
    approx: [B] bool, the rows the method approximated (post-warmup), or a Python bool for all rows.
    """

    out: torch.Tensor
    kept: torch.Tensor | None
    approx: torch.Tensor | bool


@dataclass
class Selection:
    """What a method keeps for a chunk of rows.

    keep:      [B, H, R, K] bool, or None to keep every valid key.
    approx:    [B, R] bool, rows the method approximated (after any warmup).
    probs:     optional replacement probabilities (H2O attends over its own cache).
    """

    keep: torch.Tensor | None
    approx: torch.Tensor
    probs: torch.Tensor | None = None


def real_scalar(value: object) -> int | float | None:
    """``value`` as a Python int or float where it is one real number, else None.

    Accepted: ``numbers.Real`` (int, float, numpy's scalars, Fraction) and zero-dimensional
    arrays or tensors of an integer or floating dtype. Not a number here: bool (and numpy's
    or torch's bools), strings, complex values, and arrays or tensors with any dimension.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and callable(getattr(value, "item", None)):
        item = value.item()  # a 0-d array or tensor: its element as a Python number
        return None if isinstance(item, bool) or not isinstance(item, numbers.Real) else real_scalar(item)
    return None


def describe(value: object) -> str:
    """A bad parameter value in one short line: its repr, or an array's or tensor's type and shape."""
    kind = type(value).__name__
    kind = ("an " if kind[:1].lower() in "aeiou" else "a ") + kind
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (str, bytes)) and tuple(shape) != ():
        return f"{kind} of shape {tuple(shape)}"
    text = repr(value)
    return text if len(text) <= 80 and "\n" not in text else kind


def check_fraction(name: str, value: object, *, low_open: bool = True, high_open: bool = True) -> float:
    """``value`` as a float, or ValueError naming ``name`` unless it is a real number in the interval."""
    interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
    x = real_scalar(value)
    if x is None:
        raise ValueError(f"{name} must be a number in {interval}, got {describe(value)}")
    lo_ok = x > 0 if low_open else x >= 0
    hi_ok = x < 1 if high_open else x <= 1
    if math.isnan(x) or not (lo_ok and hi_ok):
        raise ValueError(f"{name} must be in {interval}, got {x!r}")
    return float(x)


def check_real(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a float, or ValueError naming ``name`` unless it is a finite (and, if asked, positive) real number."""
    what = "a positive finite number" if positive else "a finite number"
    x = real_scalar(value)
    if x is None:
        raise ValueError(f"{name} must be {what}, got {describe(value)}")
    if not math.isfinite(x) or (positive and not x > 0):
        raise ValueError(f"{name} must be {what}, got {x!r}")
    return float(x)


def check_int(name: str, value: object, low: int) -> int:
    """``value`` as an int, or ValueError naming ``name`` unless it is an integer (a 0-d integer tensor too) >= ``low``."""
    x = real_scalar(value)
    if not isinstance(x, int) or x < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {describe(value) if x is None else repr(x)}")
    return x


def check_bool(name: str, value: object) -> bool:
    """``value`` as a bool, or ValueError naming ``name`` unless it is True or False (numpy's or a 0-d tensor's too)."""
    item = value.item() if tuple(getattr(value, "shape", (0,))) == () and callable(getattr(value, "item", None)) else value
    if not isinstance(item, bool):
        raise ValueError(f"{name} must be True or False, got {describe(value)}")
    return item


def check_vmc(vmc: object, renormalize: bool) -> bool:
    """``vmc`` as a bool; ValueError where it is set with ``renormalize``: the kept probabilities then sum
    to 1, so there is no pruned mass to compensate."""
    from ..kernels.arguments import check_compensation

    vmc = check_bool("vmc", vmc)
    check_compensation(vmc, renormalize)
    return vmc


def select_sequences(state: Any, index: torch.Tensor) -> Any:
    """A dataclass state whose tensors all have one row per sequence (None: not formed yet), with rows
    ``index`` ([B] int64) taken."""
    from dataclasses import fields, replace

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index.to(t.device))

    return replace(state, **{f.name: take(getattr(state, f.name)) for f in fields(state)})


def _tensor_fields(state: Any) -> dict[str, Any]:
    """The attributes of a state object (a dataclass's fields, else its ``__dict__``); {} for None."""
    from dataclasses import fields, is_dataclass

    if state is None:
        return {}
    if is_dataclass(state):
        return {f.name: getattr(state, f.name) for f in fields(state)}
    return dict(vars(state)) if hasattr(state, "__dict__") else {}


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor a method's state holds (a captured decode step may read any of them)."""
    return [t for t in _tensor_fields(state).values() if isinstance(t, torch.Tensor)]


def clone_state(state: Any) -> Any:
    """A copy of a state whose tensors are copies too: it keeps its values when the state is refilled."""
    import copy

    if state is None:
        return None
    twin = copy.copy(state)
    for name, value in _tensor_fields(state).items():
        if isinstance(value, torch.Tensor):
            object.__setattr__(twin, name, value.clone())
    return twin


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def put_in_place(state: Any, name: str, value: torch.Tensor) -> None:
    """``state.name = value``, written into the tensor already there where it has ``value``'s shape, dtype and
    device: a graph captured over that tensor reads the new value."""
    old = getattr(state, name)
    if isinstance(old, torch.Tensor) and _same_layout(old, value):
        old.copy_(value)
    else:
        setattr(state, name, value)


def refill_state(state: Any, fresh: Any) -> Any:
    """``fresh``'s values (a new sequence's state, ``Method.new_state``) in ``state``'s tensors, which keep their
    addresses, so the CUDA graphs captured over them stay valid; returns ``state``, or ``fresh`` where the two
    are not states of one kind.

    A tensor of ``fresh`` is copied into ``state``'s tensor of its shape, dtype and device. Where ``fresh``
    leaves a tensor unformed (None, or empty: one the prompt forms or sizes, as the value sum of value-mean
    compensation), ``state``'s tensor is kept, zeroed, and the prompt writes it in place (``put_in_place``):
    only a loop that prefills every prompt may refill. Any other attribute is ``fresh``'s.
    """
    old_fields, new_fields = _tensor_fields(state), _tensor_fields(fresh)
    if state is None or type(state) is not type(fresh) or not old_fields:
        return fresh
    for name, new in new_fields.items():
        old = old_fields.get(name)
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and _same_layout(old, new):
            old.copy_(new)
        elif isinstance(old, torch.Tensor) and (new is None or (isinstance(new, torch.Tensor) and new.numel() == 0)):
            old.zero_()
        else:
            object.__setattr__(state, name, new)
    return state


def keep_row_max(probs: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Add each row's largest probability (one key: the first argmax) so no row goes empty."""
    top = torch.zeros_like(keep).scatter_(-1, probs.argmax(dim=-1, keepdim=True), True)
    return (keep | top) & valid


#: Keys per slice of ``sum_value_rows``: bounds the float32 copy of a long cache's values.
VALUE_SUM_SLICE = 8192


def sum_value_rows(value: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[b, k] * value[b, h, k]`` in float32, [B, Hkv, D] (``value`` [B, Hkv, K, D], ``weights``
    [B, K], a validity mask as such), a slice of keys at a time."""
    B, H, K, D = value.shape
    total = torch.zeros(B, H, 1, D, dtype=torch.float32, device=value.device)
    for a in range(0, K, VALUE_SUM_SLICE):
        w = weights[:, None, None, a:a + VALUE_SUM_SLICE].float()
        total += torch.matmul(w, value[:, :, a:a + VALUE_SUM_SLICE].float())
    return total[:, :, 0]


def compensate_value_mean(weights: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Value-mean compensation: the pruned probability mass ``1 - sum(weights)`` spread as an equal
    share over the ``counts`` valid keys of each row (``counts`` broadcast against ``weights``), so
    the output gains that mass times the mean of the valid value rows while V is read once."""
    return weights + (1.0 - weights.sum(-1, keepdim=True)) * valid / counts.clamp(min=1)


class Method:
    """Base class of the attention methods (each one a small dataclass)."""

    name: ClassVar[str] = "method"
    #: the method never prunes (Full): its rows can run through a fused exact kernel.
    always_exact: ClassVar[bool] = False
    renormalize: bool = False
    #: rows with S <= warmup (teacher-forced) or the first ``warmup`` decoded tokens are exact.
    warmup: int = 0
    #: value-mean compensation: the pruned probability mass times the mean of the row's valid value rows
    #: is added to the output (docs/design.md, "Value-mean compensation").
    vmc: bool = False
    #: parameters ``spec()`` names only where they differ from their defaults (options added later
    #: keep the specs, and the result file names made from them, of the methods that do not use them)
    spec_optional: ClassVar[tuple[str, ...]] = ()
    #: words a boolean field also takes in a spec, besides true/false (``keybound=channel``)
    spec_words: ClassVar[dict[str, tuple[str, ...]]] = {}

    def new_state(self, batch: int, heads: int, device: torch.device, layer: int = 0) -> Any:
        """Per-(sequence, head) state for layer ``layer``; None when the method keeps none."""
        return None

    def prepare(self, model: Any, on_progress: Callable[[int, int], None] | None = None) -> None:
        """The work a method needs once per model before ``apply`` (Top-theta's calibration, which reads
        its corpus), reporting ``on_progress(done, total)``. The caller runs it: ``apply`` only installs."""

    def check_prepared(self, model: Any) -> None:
        """Raise a one-line error naming the call to make if ``apply(model, self)`` lacks what ``prepare`` gives."""

    @property
    def key_copy_form(self) -> str | None:
        """The form of the int8 key copy the decode step reads ("row" or "channel", ``kernels.keybound``), kept
        beside the cache where keys are written; None where it reads none."""
        return None

    def decode_phase(self, step: int) -> str | None:
        """What decode step ``step`` (0 = the first decoded token) does, or None without a decode step.

        Steps with equal phases run the same device code; a method with no
        ``decode_step`` (its decode needs host logic) returns None and is served by
        ``select`` instead.
        """
        return None

    def phases_to_compile(self, step: int) -> tuple[str, ...]:
        """The decode phases from step ``step`` on whose kernels a decode plan made at that step
        compiles ahead, all at once and side by side: those of a method whose steps launch several
        of the plan's Triton kernels. None by default (one kernel compiles as fast at its launch)."""
        return ()

    def decode_step(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange, state: Any, phase: str, kernels: Any) -> DecodeOutput:
        """One decode step over the cache: ``query`` [B, Hq, D], caches [B, Hkv, L, D].

        ``kernels`` is a planned ``siftattention.kernels.DecodeKernels`` for these shapes.
        No host synchronisation and no shape that depends on tensor values.
        """
        raise NotImplementedError(f"{self.name} has no decode step")

    def reorder_state(self, state: Any, index: torch.Tensor) -> Any:
        """The state with its sequences reordered: new sequence i continues sequence ``index[i]``
        (transformers' beam search, after every step). A method without state needs nothing; one whose
        state holds per-sequence tensors says how to select them (``select_sequences``)."""
        if state is None:
            return None
        raise NotImplementedError(f"{self.name} does not say how to reorder its per-sequence state, so it cannot follow beam search")

    def after_decode_step(self, step: int, phase: str, states: list[Any]) -> None:
        """Called on the host after decode step ``step`` (of ``phase``) has run in every layer, with those
        layers' states: a method may end a phase early here (Sift's adaptive warmup), so the loops ask
        ``decode_phase(step + 1)`` only after it."""

    def end_decode_phase(self, phase: str, states: list[Any]) -> None:
        """Called once the last step of decode phase ``phase`` has run in every layer, with those layers' states.

        Work that follows a whole phase rather than one layer's step (Sift fits its power
        law after its warmup) runs here, on the device, without a host synchronisation.
        """

    def select(self, rows: Rows, state: Any) -> Selection:
        raise NotImplementedError

    def observes_prefill(self) -> bool:
        """Whether ``observe_prefill`` needs the prompt's attention probabilities."""
        return False

    def observe_prefill(self, rows: Rows, state: Any) -> None:
        """Called, in decode mode, with the prompt rows that are computed exactly."""

    def observes_prompt(self) -> bool:
        """Whether ``observe_prompt`` wants each prompt chunk's queries and keys."""
        return False

    def observe_prompt(self, chunk: PromptChunk, state: Any) -> None:
        """Called, in decode mode, with each prompt chunk's queries and keys (its attention runs exactly)."""

    def finish_prefill(self, state: Any) -> None:
        """Called after a prompt was prefilled in decode mode."""

    def spec(self) -> str:
        """The method as a CLI spec, ``name:key=value,...``."""
        from dataclasses import fields

        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)  # type: ignore[arg-type]
                 if f.name not in self.spec_optional or getattr(self, f.name) != f.default]
        return self.name + (":" + ",".join(parts) if parts else "")
