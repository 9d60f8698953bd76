"""Teacher-forced perplexity of methods, reported against their realized sparsity."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from ..hf import apply
from ..methods import Method
from ..models import warn_beyond_positions


@dataclass
class PerplexityResult:
    method: str  # the spec as given
    ppl: float
    ppl_post_warmup: float
    realized_sparsity: float
    realized_sparsity_post_warmup: float
    tokens: int
    tokens_post_warmup: int

    def to_dict(self) -> dict:
        return asdict(self)


def post_warmup_from(methods: Sequence[Method]) -> int:
    """The common warmup W of a comparison: post-warmup means steps S > W for every method."""
    return max((m.warmup for m in methods), default=0)


def check_windows(methods: Sequence[tuple[str, Method]], seq_len: int) -> None:
    """Refuse, in one line naming the method, a warmup that leaves a window of ``seq_len`` tokens no
    approximated row whose prediction is scored: rows S = 1..w are exact, and a window's scored
    predictions are those of rows 1..seq_len - 1, so such a method would silently run as Full.
    Needs no model: callers check before loading one."""
    for spec, method in methods:
        if method.warmup and seq_len - 1 <= method.warmup:
            raise ValueError(
                f"{spec}: a warmup of {method.warmup} steps leaves no approximated row in a window of {seq_len} tokens "
                f"(its scored rows are steps 1..{seq_len - 1}), so it would run as Full; use a sequence length of at "
                f"least {method.warmup + 2} or a shorter warmup")


def check_prompt_len(prompt_len: int, seq_len: int) -> None:
    """Refuse, in one line, a prompt that leaves a window of ``seq_len`` tokens fewer than two decode steps to score."""
    if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 0:
        raise ValueError(f"prompt_len must be an integer >= 0, got {prompt_len!r}")
    if prompt_len and prompt_len > seq_len - 3:
        raise ValueError(f"a prompt of {prompt_len} tokens leaves no decode steps to score in a window of {seq_len} tokens; "
                         f"use a prompt of at most {seq_len - 3} tokens")


@torch.no_grad()
def token_nll(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of tokens 1..L-1 of ``window`` [L]; entry i is predicted by row i (step S = i+1)."""
    logits = model(window[None].to(model.device)).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, window[1:].to(logits.device), reduction="none").cpu()


@torch.no_grad()
def token_nll_after_prompt(model: torch.nn.Module, window: torch.Tensor, prompt_len: int, handle) -> torch.Tensor:
    """Negative log-likelihood of tokens P+1..L-1 of ``window`` [L] (P = ``prompt_len``), predicted by steps
    S = P+1..L-1 as decode steps: the first P tokens are prefilled as a prompt (exact, and what a method
    calibrates on), then the rest is teacher-forced in one pass over the cache. Entry i is step S = P+1+i."""
    window = window[None].to(model.device)
    handle.decoding, handle.prompt_len = True, prompt_len
    try:
        prompt = model(window[:, :prompt_len], use_cache=True)
    finally:
        handle.decoding, handle.prompt_len = False, None
    from ..generation.loop import _cache_kwarg
    from ..inputs import forward_kwargs

    cache = {_cache_kwarg(forward_kwargs(model)): prompt.past_key_values}
    logits = model(window[:, prompt_len:], use_cache=True, **cache).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, window[0, prompt_len + 1:], reduction="none").cpu()


def evaluate_perplexity(
    model: torch.nn.Module,
    windows: torch.Tensor,
    methods: Sequence[tuple[str, Method]],
    *,
    on_step: Callable[[str, int], None] | None = None,
    prompt_len: int = 0,
) -> tuple[list[PerplexityResult], int]:
    """Perplexity and realized sparsity of each (spec, method) over the token windows [N, L].

    ppl = exp(mean NLL over all predicted tokens of all windows); ``ppl_post_warmup`` uses
    the tokens predicted by steps S > W, with W the largest warmup among the methods,
    so every method's post-warmup figures cover the same tokens; they are NaN when the
    windows have no step after W. Returns (results, W). A method whose warmup covers every
    scored row is refused before any forward pass (``check_windows``).

    ``prompt_len`` P > 0 scores a window as a decode would run it: its first P tokens are a prompt
    (prefilled exactly; Sift calibrates on it), and the tokens predicted by steps S > P are scored,
    every one a decode step; "post-warmup" then means S > P + W.
    """
    check_windows(methods, windows.shape[-1])
    check_prompt_len(prompt_len, windows.shape[-1])
    warn_beyond_positions(model, windows.shape[-1], f"windows of {windows.shape[-1]} tokens")
    warm = post_warmup_from([m for _, m in methods])
    results = []
    for spec, method in methods:
        nll_sum = nll_post = 0.0
        n_tok = n_post = 0
        sparsity_sum = sparsity_post_sum = 0.0
        for i, window in enumerate(windows):
            with apply(model, method) as handle:
                nll = token_nll_after_prompt(model, window, prompt_len, handle) if prompt_len else token_nll(model, window)
                sparsity_sum += handle.stats.realized_sparsity()
                sparsity_post_sum += handle.stats.realized_sparsity(min_step=prompt_len + warm + 1)
            nll_sum += float(nll.double().sum())
            n_tok += nll.numel()
            nll_post += float(nll[warm:].double().sum())
            n_post += nll[warm:].numel()
            if on_step is not None:
                on_step(spec, i)
        n = len(windows)
        results.append(
            PerplexityResult(
                method=spec,
                ppl=math.exp(nll_sum / n_tok),
                ppl_post_warmup=math.exp(nll_post / n_post) if n_post else float("nan"),
                realized_sparsity=sparsity_sum / n,
                realized_sparsity_post_warmup=sparsity_post_sum / n if n_post else float("nan"),
                tokens=n_tok,
                tokens_post_warmup=n_post,
            )
        )
    return results, warm
