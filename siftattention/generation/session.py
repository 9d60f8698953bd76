"""``DecodeSession``: generations of one batch size that keep their cache and CUDA graphs (gpt-fast style).

``generate`` makes a fixed cache and a CUDA graph per method phase for every call and releases
them at return, so each call pays each phase's first eager step and capture. A session makes
them once and keeps them until ``close()``: each call resets the cache, the decode context, the
method's states and the step log in place (no tensor changes address), prefills its prompt
eagerly and replays the graphs captured by earlier calls. The graphs take every row's valid key
range from device tensors, so one session serves any prompt length ``P`` with
``P + max_new_tokens <= max_len``.
"""

from __future__ import annotations

import torch

from ..hf import apply
from ..methods.base import Method, check_int
from .loop import (GenerationResult, _check_inputs, _check_method, _eos_tensor, _Loop, _Sampler, _special_tokens,
                   _use_graphs, fast_path_problem)


class DecodeSession:
    """Generations of ``batch_size`` rows through the fast decode loop, on one cache of ``max_len`` positions
    and the CUDA graphs captured by earlier calls (docs/fast-decode.md, "Sessions").

    Every call takes ``batch_size`` rows with ``prompt length + max_new_tokens <= max_len`` and at most
    the session's ``max_new_tokens``; another shape raises one ``ValueError`` line. What a graph bakes in
    is fixed for the session: the method, sampling, EOS and pad tokens, ``output_scores``, ``compile``.
    The method stays applied to the model (as under ``apply``) until ``close()``, which releases the
    cache and graphs; a call's result (tokens, scores, statistics) is its own copy.

    >>> with DecodeSession(model, Sift(tau=0.875), batch_size=16, max_len=4096, max_new_tokens=256) as session:
    ...     for ids, mask in batches:
    ...         res = session.generate(ids, mask)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        method: Method | None = None,
        batch_size: int = 1,
        max_len: int = 2048,
        *,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        cuda_graphs: bool | None = None,
        decode_backend: str = "auto",
        output_scores: bool = False,
        compile: bool = False,
    ) -> None:
        method = _check_method(method)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.max_len = check_int("max_len", max_len, 2)
        self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        if self.max_new_tokens >= self.max_len:
            raise ValueError(f"max_new_tokens must be below max_len ({self.max_len}) to leave a prompt token, "
                             f"got {self.max_new_tokens}")
        problem = fast_path_problem(model, method)
        if problem is not None:
            raise ValueError(f"DecodeSession runs the fast decode loop, which cannot serve here: {problem}")
        eos_token_id, pad_token_id = _special_tokens(model, eos_token_id, pad_token_id)
        sampler = _Sampler(do_sample, temperature, top_k)
        self.model = model
        self.device = next(model.parameters()).device
        use_graphs = _use_graphs(cuda_graphs, self.device, "the model")
        self._handle = apply(model, method, decode_backend=decode_backend)
        try:
            self._loop: _Loop | None = _Loop(
                model, self._handle, self.batch_size, self.max_len, self.max_new_tokens, self.device, sampler,
                _eos_tensor(eos_token_id, self.device), pad_token_id, use_graphs, output_scores, compile, keep=True)
        except BaseException:
            self._handle.remove()
            raise

    @property
    def closed(self) -> bool:
        return self._loop is None

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int | None = None, prefill_chunk: int | None = None,
                 check_every: int = 16) -> GenerationResult:
        """``generate(model, input_ids, attention_mask, method, ...)``'s result for this batch, on the session's
        cache and graphs (``max_new_tokens``: the session's by default). ``res.timings["captures"]`` counts
        the graphs this call captured (0 once every phase has one) and ``"recaptures"`` those captured again
        because a tensor they read had moved since (the model's weights, a method state made anew)."""
        if self._loop is None:
            raise RuntimeError("this DecodeSession is closed")
        mask = _check_inputs(self.model, input_ids, attention_mask)
        new = self.max_new_tokens if max_new_tokens is None else check_int("max_new_tokens", max_new_tokens, 1)
        prefill_chunk = None if prefill_chunk is None else check_int("prefill_chunk", prefill_chunk, 1)
        check_every = check_int("check_every", check_every, 1)
        B, P = input_ids.shape
        if B != self.batch_size or P + new > self.max_len or new > self.max_new_tokens:
            raise ValueError(f"this DecodeSession serves {self.batch_size} rows with prompt + new tokens <= {self.max_len} "
                             f"and at most {self.max_new_tokens} new tokens, got {B} rows, a prompt of {P} and {new} new tokens")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids are on {input_ids.device}, the session's model on {self.device}")
        return self._loop.generate(input_ids, mask, new, prefill_chunk, check_every)

    def close(self) -> None:
        """Remove the method from the model and release the cache and the graphs (idempotent)."""
        if self._loop is not None:
            self._loop = None
            self._handle.remove()
            self._handle.reset()  # the states go with the session's last reference; the plans with the handle

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
