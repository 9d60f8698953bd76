"""The fast decode loop: a fixed-size cache, an exact prefill, then one captured step per token.

The shape of gpt-fast's ``generate.py``: ``prefill`` runs the prompt once; ``decode_one``
runs the whole model on one token per sequence and picks the next token, all on the
device (positions, cache write position, valid key ranges, the method's state and
the per-step statistics are device tensors it updates in place). On CUDA each
distinct method phase (for Sift: warmup, sparse) is captured once as
a CUDA graph and replayed, so a token costs no Python and no launch per layer; on the
CPU the same step runs eagerly. Work that follows a whole phase (Sift's fit after the
warmup) runs once after the phase's last step, eagerly, as one batched call.
Left-padded batches are served by per-row start offsets: every row writes its token
at the same cache position.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..attention import StepLog
from ..hf import SiftHandle, SiftStats, apply
from ..inputs import check_sampling, check_token_id, check_token_inputs, forward_kwargs
from ..methods import Full
from ..methods.base import KeyRange, Method, check_int, state_tensors
from ..models import warn_beyond_positions
from ..notices import FallbackWarning, SiftWarning
from ..parallel import device_map_devices
from .cache import FixedCache


@dataclass
class GenerationResult:
    """What ``generate`` returns.

    sequences:     [B, P + T] the prompt as given (left padding kept), then the new tokens
                   (``pad_token_id`` after a row's EOS).
    new_tokens:    [B, T] the new tokens alone.
    num_generated: [B] new tokens of each row, its EOS included.
    stats:         the method's statistics (realized sparsity, Sift's fit), as ``SiftHandle.stats``.
    fast:          whether the fixed-cache loop ran (else transformers' ``generate``, see ``fallback_reason``).
    timings:       seconds of prefill and decode, and the decode steps run.
    """

    sequences: torch.Tensor
    new_tokens: torch.Tensor
    num_generated: torch.Tensor
    stats: SiftStats
    fast: bool
    fallback_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    scores: torch.Tensor | None = None  # [B, T, V] float32 logits of every step (``output_scores=True``)


class DecodeContext:
    """The device-side position of the loop, read by the attention glue at every decode call.

    Its tensors are made once and set in place for each prompt (``start``): the graphs of a
    ``DecodeSession`` read them where they were at capture.
    """

    def __init__(self, batch: int, device: torch.device) -> None:
        self.step = 0  # host index of the decode step being run or captured (selects the method phase)
        self.starts = torch.zeros(batch, dtype=torch.int32, device=device)  # [B] first real token of each row (left padding)
        self.seq_lens = torch.zeros_like(self.starts)  # keys visible to the token being decoded
        self.write_pos = torch.zeros(1, dtype=torch.long, device=device)
        self.counter = torch.zeros(1, dtype=torch.long, device=device)  # decode steps done
        self.steps = torch.zeros_like(self.starts)  # S of every row (layers without a window)
        self.log_steps = torch.zeros(batch, dtype=torch.float32, device=device)
        # Per sliding window: (starts, steps, log steps), formed once a step for all its layers.
        self.windows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        #: The cache's int8 key copy of a layer, or None (set by the loop where the method reads one).
        self.key_copy: Any = lambda layer: None
        #: Whether the loop captures its steps in CUDA graphs (a new decode plan then launches its phases ahead).
        self.captures = False

    def start(self, starts: torch.Tensor, prompt_len: int) -> None:
        """A new prompt of ``prompt_len`` tokens, row b's first real one at ``starts[b]``: every tensor set in place."""
        self.step = 0
        self.starts.copy_(starts)
        self.seq_lens.fill_(prompt_len + 1)
        self.write_pos.fill_(prompt_len)
        self.counter.zero_()
        torch.sub(self.seq_lens, self.starts, out=self.steps)
        torch.log(self.steps.float(), out=self.log_steps)
        for window, ranges in self.windows.items():
            self._fill_window(window, *ranges)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads of the context."""
        return [self.starts, self.seq_lens, self.write_pos, self.counter, self.steps, self.log_steps,
                *(t for ranges in self.windows.values() for t in ranges)]

    def keys(self, window: int | None) -> KeyRange:
        if window is None:
            return KeyRange(self.seq_lens, self.starts, self.steps, self.log_steps)
        ranges = self.windows.get(window)
        if ranges is None:  # first (eager) step: buffers that later steps and graph replays update
            ranges = self.windows[window] = (torch.empty_like(self.starts), torch.empty_like(self.steps),
                                             torch.empty_like(self.log_steps))
            self._fill_window(window, *ranges)
        return KeyRange(self.seq_lens, *ranges, window=window)

    def _fill_window(self, window: int, starts: torch.Tensor, steps: torch.Tensor, log_steps: torch.Tensor) -> None:
        torch.maximum(self.starts, self.seq_lens - window, out=starts)
        torch.sub(self.seq_lens, starts, out=steps)
        torch.log(steps.float(), out=log_steps)

    def advance(self) -> None:
        self.seq_lens += 1
        self.write_pos += 1
        self.counter += 1
        self.steps += 1
        torch.log(self.steps.float(), out=self.log_steps)
        for window, ranges in self.windows.items():
            self._fill_window(window, *ranges)


def fast_path_problem(model: torch.nn.Module, method: Method) -> str | None:
    """Why the fixed-cache loop cannot serve this model and method, or None."""
    if method.decode_phase(0) is None:
        return f"{method.name} has no device-side decode step (its cache eviction needs host logic)"
    devices = device_map_devices(model)
    if len(devices) > 1:
        # One step is one CUDA graph, and a graph is captured on one device.
        return f"the model's device map spreads it over {', '.join(devices)}, the fixed-cache loop runs a model on one device"
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if config is not None and hasattr(config, "get_text_config") else config
    if text is None or getattr(text, "is_encoder_decoder", False):
        return "only decoder-only language models are supported"
    if getattr(text, "attn_logit_softcapping", None):
        return "attention logit soft-capping has no decode kernel"
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(kinds - {'full_attention', 'sliding_attention'})} need a cache of their own"
    return None


def _check_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The checks both generation paths make before any work; returns the attention mask as integers."""
    check_token_inputs(model, input_ids, attention_mask)
    if attention_mask is None:
        return torch.ones_like(input_ids)
    mask = attention_mask.long()
    # Left padding only: every row is zeros then ones, ending with a real token.
    if bool((mask[:, 1:] < mask[:, :-1]).any()) or not bool(mask[:, -1].all()):
        raise ValueError("attention_mask must describe left padding (zeros, then ones to the end of every row)")
    return mask


def _eos_tensor(eos_token_id: Any, device: torch.device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


class _Sampler:
    """Greedy or sampled next tokens, on the device."""

    def __init__(self, do_sample: bool, temperature: float, top_k: int | None) -> None:
        check_sampling(do_sample, temperature, top_k)
        self.do_sample, self.temperature, self.top_k = do_sample, temperature, top_k

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(torch.softmax(logits, dim=-1), 1)[:, 0]


def _compiled_forward(model: torch.nn.Module) -> Any:
    """``model.forward`` through torch.compile, compiled once per model and reused by later calls."""
    compiled = getattr(model, "_siftattention_compiled_forward", None)
    if compiled is None:
        import torch._dynamo

        # The attention is a graph break, so every decoder layer is its own compiled frame,
        # specialised on its layer index: allow one variant per layer (and phase).
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * layers + 8)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 16 * layers)
        compiled = torch.compile(model.forward, dynamic=False)
        model.__dict__["_siftattention_compiled_forward"] = compiled
    return compiled


def _compile_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot build the decode step for ``device``, or None: on the CPU its backend (Inductor)
    compiles C++ with ``$CXX``, else g++ (its default search)."""
    if device.type != "cpu":
        return None
    name = os.environ.get("CXX", "g++")
    if shutil.which(name):
        return None
    return f"torch.compile needs a C++ compiler on the CPU and found none ({name})"


def _cache_kwarg(accepts: set[str]) -> str:
    """The forward's name for the cache: ``cache`` from transformers 5.24 (the old name warns)."""
    return "cache" if "cache" in accepts else "past_key_values"


class _Loop:
    """Generations of one batch shape: a fixed cache of ``max_len`` positions, the decode context, the
    step's buffers and a CUDA graph per method phase, made once and reset in place for each prompt
    (``start``), so graphs captured for one generation replay for the next (``DecodeSession``)."""

    def __init__(self, model, handle: SiftHandle, batch: int, max_len: int, max_new_tokens: int, device: torch.device,
                 sampler, eos, pad_token_id, use_graphs, output_scores=False, compile=False, keep=False) -> None:
        self.model, self.handle, self.sampler = model, handle, sampler
        problem = _compile_problem(device) if compile else None
        if problem:  # said before the prefill; the steps then run as they would uncompiled
            warnings.warn(f"siftattention.generate: compile=True is not used: {problem}; the decode steps run eagerly",
                          SiftWarning, stacklevel=3)
            compile = False
        # torch.compile fuses the model's small ops around the attention (which stays eager).
        self.forward = _compiled_forward(model) if compile else model.forward
        self.B, self.max_len, self.max_new = batch, max_len, max_new_tokens
        self.P, self.T = 0, max_new_tokens  # the generation under way: its prompt length and new tokens
        self.device = device
        self.eos, self.pad = eos, pad_token_id
        self.use_graphs = use_graphs
        #: Whether generations follow one another on these buffers (a session): method states are then
        #: refilled in place, and results copy what the next generation overwrites.
        self.keep = keep
        self.cache = FixedCache(model.config, max_len, int8_keys=handle.method.key_copy_form)
        self.ctx = DecodeContext(batch, device)
        self.ctx.key_copy = self.cache.key_copy
        self.ctx.captures = use_graphs
        self.accepts = forward_kwargs(model)
        self.cache_arg = _cache_kwarg(self.accepts)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.finished_at = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
        # A 4-D mask makes transformers skip its mask construction: the valid keys come from the context.
        self.no_mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=device)
        self.scores: torch.Tensor | None = None
        if output_scores:
            vocab = model.get_output_embeddings().weight.shape[0]
            self.scores = torch.zeros(batch, max_new_tokens, vocab, dtype=torch.float32, device=device)
        self.log = StepLog(max_new_tokens - 1, self.ctx.counter)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.seen: set[str] = set()
        self.addresses: tuple[int, ...] | None = None  # where the tensors the graphs read lived at their capture
        self.dropped: set[str] = set()  # phases whose graph this generation dropped (an address had changed)

    def start(self, input_ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> None:
        """A new generation: every buffer back to a fresh loop's values, in place (no tensor changes address),
        and the handle attached to this loop until ``detach``."""
        self.P, self.T = input_ids.shape[1], max_new_tokens
        self.handle.reset(keep_states=self.keep)
        self.cache.restart(self.P)
        self.ctx.start(self.P - mask.sum(1), self.P)
        self.out.fill_(self.pad)
        self.done.zero_()
        self.finished_at.fill_(max_new_tokens)
        if self.scores is not None:
            self.scores.zero_()
        self.log.restart()
        self.dropped = set()
        self.handle.context = self.ctx
        self.handle.prompt_len = self.P  # the prompt's chunks are exact attention, every later token a decode step

    def detach(self) -> None:
        """The handle back to plain forward passes (no loop context, no prompt length)."""
        self.handle.context = None
        self.handle.prompt_len = None

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, chunk: int | None) -> None:
        """The prompt, exactly, in chunks of ``chunk`` tokens (bounds the activations of long prompts)."""
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        chunk = self.P if not chunk or self.handle.method.observes_prefill() else chunk
        for a in range(0, self.P, chunk):
            b = min(self.P, a + chunk)
            kwargs: dict[str, Any] = {"attention_mask": mask[:, :b], "position_ids": positions[:, a:b], self.cache_arg: self.cache, "use_cache": True}
            if "logits_to_keep" in self.accepts:
                kwargs["logits_to_keep"] = 1
            if "cache_position" in self.accepts:
                kwargs["cache_position"] = torch.arange(a, b, device=self.device)
            logits = self.model(input_ids=input_ids[:, a:b], **kwargs).logits[:, -1]
        self.cache.finish_prompt(self.ctx.starts)
        self.positions.copy_(positions[:, -1] + 1)
        self._emit(logits, torch.zeros(1, dtype=torch.long, device=self.device))
        self.cache.position.tensor = self.ctx.write_pos
        for layer in self.handle.records:
            self.handle.records[layer] = self.log.record(layer)

    def _emit(self, logits: torch.Tensor, index: torch.Tensor) -> None:
        """Pick and store the new token of every row at ``index`` (device); after a row's EOS the pad token."""
        if self.scores is not None:
            self.scores.index_copy_(1, index, logits.float()[:, None])
        token = self.sampler(logits)
        token = torch.where(self.done, torch.full_like(token, self.pad), token)
        self.out.index_copy_(1, index, token[:, None])
        self.tokens.copy_(token)
        if self.eos is not None:
            hit = torch.isin(token, self.eos) & ~self.done
            self.finished_at.copy_(torch.where(hit, index.expand_as(self.finished_at), self.finished_at))
            self.done |= hit

    def _step(self) -> None:
        """One token for every row: the model, the next token, the loop's device counters."""
        kwargs: dict[str, Any] = {"attention_mask": self.no_mask, "position_ids": self.positions[:, None], self.cache_arg: self.cache, "use_cache": True}
        if "cache_position" in self.accepts:
            kwargs["cache_position"] = self.ctx.write_pos
        logits = self.forward(input_ids=self.tokens[:, None], **kwargs).logits[:, -1]
        self.log.flush()
        self._emit(logits, self.ctx.counter + 1)
        self.positions += 1
        self.ctx.advance()

    def decode(self, step: int, clock: "_PhaseClock | None" = None) -> None:
        """Decode step ``step`` (its phase's graph); after a phase's last step, the method's work for it."""
        self.ctx.step = step
        method = self.handle.method
        phase = method.decode_phase(step)
        if clock is not None:
            clock.mark(phase)
        how = self._run(phase)
        if clock is not None:
            clock.ran(how)
        self.handle.after_decode_step(step, phase)
        if method.decode_phase(step + 1) != phase:
            # Work that follows a whole phase (Sift's fit after its warmup) runs once, eagerly, timed apart.
            if clock is not None:
                clock.mark(f"after_{phase}")
            self.handle.end_decode_phase(phase)

    def generate(self, input_ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, prefill_chunk: int | None,
                 check_every: int) -> GenerationResult:
        """One generation on these buffers (inputs checked, ``P + max_new_tokens <= max_len``)."""
        P = input_ids.shape[1]
        # stacklevel 4: the warning names the line that called generate (or a session's generate).
        warn_beyond_positions(self.model, P + max_new_tokens - 1, f"a prompt of {P} tokens and {max_new_tokens} new tokens",
                              stacklevel=4)
        handle = self.handle
        cuda = self.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        try:
            with torch.inference_mode():
                self.start(input_ids, mask, max_new_tokens)
                start = time.perf_counter()
                self.prefill(input_ids, mask, prefill_chunk)
                sync()
                prefill_s = time.perf_counter() - start
                self.check_graphs()
                steps = 0
                clock = _PhaseClock(cuda)
                for step in range(max_new_tokens - 1):
                    if self.eos is not None and step % check_every == 0 and bool(self.done.all()):
                        break
                    self.decode(step, clock)
                    steps += 1
                clock.mark(None)
                sync()
                decode_s = time.perf_counter() - start - prefill_s
        finally:
            self.detach()
        num = torch.minimum(self.finished_at + 1, torch.full_like(self.finished_at, max_new_tokens))
        # Steps after every row had finished are not part of the result (transformers stops there too).
        used = int(num.max()) - 1
        self.log.finish(min(steps, used))
        new = self.out[:, : used + 1]
        scores = None if self.scores is None else self.scores[:, : used + 1]
        if self.keep:  # the next generation overwrites the buffers and the states
            new, scores = new.clone(), None if scores is None else scores.clone()
        key_copy = self.cache.key_copy_bytes()
        return GenerationResult(
            sequences=torch.cat([input_ids, new], dim=1), new_tokens=new, num_generated=num,
            stats=handle.stats.frozen() if self.keep else handle.stats, fast=True,
            timings={"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps, "phases": clock.totals(),
                     "captures": clock.captures, "recaptures": len(clock.captured & self.dropped),
                     **({"key_copy_bytes": key_copy} if key_copy else {})},
            scores=scores,
        )

    def _addresses(self) -> tuple[int, ...]:
        """Where every tensor a captured step reads from outside its own memory pool lives: the model's
        weights, the cache, the context, the loop's buffers, the step log and the method's states."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *self.cache.tensors(), *self.ctx.tensors(),
                   self.tokens, self.positions, self.out, self.done, self.finished_at, self.no_mask, self.scores,
                   self.eos, *self.log.tensors()]
        for layer in sorted(self.handle.states):
            tensors += state_tensors(self.handle.states[layer])
        plans = [id(plan) for plan in self.handle.plans()]
        return (*plans, *(t.data_ptr() for t in tensors if t is not None))

    def check_graphs(self) -> None:
        """Before a generation's first replay: drop every graph if a tensor it reads has moved (a model
        moved or reloaded, a state made anew by a forward pass between generations), for its phase to be
        captured again rather than replay over freed memory."""
        if self.graphs and self._addresses() != self.addresses:
            self.dropped = set(self.graphs)
            self.graphs.clear()

    def _run(self, phase: str) -> str:
        """Run the step of ``phase``; returns how: "replay", "capture" (captured, then replayed) or "eager"."""
        graph = self.graphs.get(phase)
        if graph is not None:
            graph.replay()
            return "replay"
        # A phase's first step runs eagerly where its kernels may still compile or load, or, for the loop's
        # first step, where the model makes what it makes on its first call (torch.compile's frames, library
        # handles); after one eager step, a phase whose plan launched its kernels ahead is captured directly.
        if self.use_graphs and (phase in self.seen or (self.seen and self.handle.ready_to_capture(phase))):
            if not self.graphs:
                self.addresses = self._addresses()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step()
            self.graphs[phase] = graph
            self.seen.add(phase)
            graph.replay()
            return "capture"
        self.seen.add(phase)
        self._step()
        return "eager"


class _PhaseClock:
    """Seconds and steps spent in each method phase, from a device event per step on CUDA (no sync in the loop).

    ``steady_ms`` is the median step of a phase among its graph replays (all its steps where none
    replayed: eager steps on the CPU), without the eager steps that compile kernels and the captures;
    ``eager`` and ``captures`` count those of a decode phase.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[str | None, Any]] = []
        self.how: dict[int, str] = {}  # mark index -> how its step ran ("eager", "capture", "replay")

    def mark(self, phase: str | None) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        self.marks.append((phase, event))

    def ran(self, how: str) -> None:
        """How the step marked last ran."""
        self.how[len(self.marks) - 1] = how

    @property
    def captures(self) -> int:
        return sum(how == "capture" for how in self.how.values())

    @property
    def captured(self) -> set[str]:
        """The phases whose graph was captured."""
        return {str(self.marks[i][0]) for i, how in self.how.items() if how == "capture"}

    def totals(self) -> dict[str, dict[str, float]]:
        steps: dict[str, list[float]] = {}
        replays: dict[str, list[float]] = {}
        for i, ((phase, a), (_, b)) in enumerate(zip(self.marks, self.marks[1:])):
            seconds = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            steps.setdefault(str(phase), []).append(seconds)
            if self.how.get(i) == "replay":
                replays.setdefault(str(phase), []).append(seconds)
        ran: dict[str, list[str]] = {}
        for i, how in self.how.items():
            ran.setdefault(str(self.marks[i][0]), []).append(how)
        out = {}
        for phase, seconds in steps.items():
            steady = sorted(replays.get(phase) or seconds)
            out[phase] = {"steps": len(seconds), "seconds": sum(seconds), "steady_ms": steady[len(steady) // 2] * 1e3}
            if phase in ran:  # a decode phase (not the work after one)
                out[phase].update(eager=ran[phase].count("eager"), captures=ran[phase].count("capture"))
        return out


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    method: Method | None = None,
    *,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    cuda_graphs: bool | None = None,
    decode_backend: str = "auto",
    check_every: int = 16,
    output_scores: bool = False,
    prefill_chunk: int | None = None,
    compile: bool = False,
) -> GenerationResult:
    """Generate with ``method`` through the fast decode loop (docs/fast-decode.md).

    The prompt (left-padded batches allowed) is prefilled exactly into a fixed-size
    cache; each new token is one step of the whole model, replayed from a CUDA graph
    per method phase on CUDA (``cuda_graphs=None``: on CUDA) and run eagerly on the
    CPU. ``Full()`` (the default) is the dense baseline on the same path.
    ``prefill_chunk`` splits a long prompt's prefill into chunks of that many tokens;
    ``compile=True`` runs the decode step's model code through ``torch.compile``
    (fused norms, rotary embeddings and activations; the first call compiles). Where the
    model or method cannot use this path (for example ``H2O``), a one-line warning
    says why and transformers' ``generate`` with ``apply`` runs instead.

    >>> res = generate(model, ids, mask, Sift(tau=0.875, warmup=16), max_new_tokens=128)
    >>> res.sequences, res.stats.realized_sparsity(post_warmup=True)
    """
    method = _check_method(method)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    mask = _check_inputs(model, input_ids, attention_mask)
    eos_token_id, pad_token_id = _special_tokens(model, eos_token_id, pad_token_id)
    sampler = _Sampler(do_sample, temperature, top_k)
    prefill_chunk = None if prefill_chunk is None else check_int("prefill_chunk", prefill_chunk, 1)
    check_every = check_int("check_every", check_every, 1)
    problem = fast_path_problem(model, method)
    if problem is not None:
        warnings.warn(f"siftattention.generate: using transformers' generate ({problem})", FallbackWarning, stacklevel=2)
        return reference_generate(model, input_ids, mask, method, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                  temperature=temperature, top_k=top_k, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                  decode_backend=decode_backend, fallback_reason=problem)
    use_graphs = _use_graphs(cuda_graphs, input_ids.device, "the inputs")
    handle = apply(model, method, decode_backend=decode_backend)
    try:
        B, P = input_ids.shape
        loop = _Loop(model, handle, B, P + max_new_tokens, max_new_tokens, input_ids.device, sampler,
                     _eos_tensor(eos_token_id, input_ids.device), pad_token_id, use_graphs, output_scores, compile)
        return loop.generate(input_ids, mask, max_new_tokens, prefill_chunk, check_every)
    finally:
        handle.remove()


def _use_graphs(cuda_graphs: bool | None, device: torch.device, what: str) -> bool:
    """Whether the loop captures CUDA graphs: ``cuda_graphs``, or on CUDA where it is None."""
    use = device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
    if use and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs {what} on a CUDA device")
    return use


def _check_method(method: Method | None) -> Method:
    method = Full() if method is None else method
    if not isinstance(method, Method):
        raise TypeError(f"method must be a siftattention method (Full, TopK, H2O, Sift, Oracle, ...), got {type(method).__name__}")
    return method


def _special_tokens(model: torch.nn.Module, eos_token_id: Any, pad_token_id: int | None) -> tuple[Any, int]:
    """EOS and padding ids: the ones given, else the model's generation config first, as transformers' generate reads it."""
    configs = [c for c in (getattr(model, "generation_config", None), getattr(model, "config", None)) if c is not None]
    if eos_token_id is None:
        eos_token_id = next((c.eos_token_id for c in configs if getattr(c, "eos_token_id", None) is not None), None)
    if pad_token_id is None:
        pad_token_id = next((c.pad_token_id for c in configs if getattr(c, "pad_token_id", None) is not None), None)
        pad_token_id = (eos_token_id if isinstance(eos_token_id, int) else 0) if pad_token_id is None else pad_token_id
    check_token_id(model, "eos_token_id", eos_token_id, embedded=False)
    check_token_id(model, "pad_token_id", pad_token_id)  # fed back to the model after a row's EOS
    return eos_token_id, pad_token_id


def reference_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    method: Method | None = None,
    *,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    decode_backend: str = "auto",
    fallback_reason: str | None = None,
) -> GenerationResult:
    """transformers' ``generate`` with ``method`` applied, as ``generate``'s result (``fast=False``,
    ``timings["total_s"]``): the reference path, and ``generate``'s fallback (``fallback_reason``)."""
    method = _check_method(method)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    mask = _check_inputs(model, input_ids, attention_mask)
    eos_token_id, pad_token_id = _special_tokens(model, eos_token_id, pad_token_id)
    check_sampling(do_sample, temperature, top_k)
    kwargs = dict(do_sample=do_sample, pad_token_id=pad_token_id, eos_token_id=eos_token_id, max_new_tokens=max_new_tokens, min_new_tokens=0)
    if do_sample:
        kwargs.update(temperature=temperature, top_k=top_k or 0, top_p=1.0)
    sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
    with apply(model, method, decode_backend=decode_backend) as handle, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
        sync()
        elapsed = time.perf_counter() - start
    new = out[:, input_ids.shape[1] :]
    eos = _eos_tensor(eos_token_id, new.device)
    num = torch.full((new.shape[0],), new.shape[1], dtype=torch.long, device=new.device)
    if eos is not None and new.numel():
        hit = torch.isin(new, eos)
        num = torch.where(hit.any(1), hit.int().argmax(1) + 1, num)
    return GenerationResult(out, new, num, handle.stats, fast=False, fallback_reason=fallback_reason, timings={"total_s": elapsed})
