"""Inputs that used to give silently wrong results, table-driven: each row is refused, warns, or
gives the result an independent reference gives.

A ``Refused`` row must raise the expected exception type with a one-line message containing
the expected text. A ``Warned`` row must emit the expected warning category with the expected
text. A ``Checked`` row runs and compares its result with a reference itself (float64 torch,
transformers' own outputs, a single-sequence replay, closed forms), returning a short
description of what it checked for the table.

``python tests/test_bad_input_semantics.py`` prints the table with each outcome (docs/bad-input.md).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_llama  # noqa: E402

import siftattention  # noqa: E402
from siftattention import H2O, Full, Oracle, Sift, SkipSoftmax, TopK, TopTheta  # noqa: E402


# -- the row kinds --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    """``call()`` must raise ``error`` with ``message`` in its one-line text."""

    label: str
    call: Callable[[], Any]
    error: type[BaseException]
    message: str


@dataclass(frozen=True)
class Warned:
    """``call()`` must emit a ``category`` warning with ``message`` in its text."""

    label: str
    call: Callable[[], Any]
    category: type[Warning]
    message: str


@dataclass(frozen=True)
class Checked:
    """``call()`` runs, asserts its result against a reference, and says what it checked."""

    label: str
    call: Callable[[], str]


Row = Refused | Warned | Checked


# -- numeric parameters: real scalars accepted, everything else refused in one line ------------------


def same_method(built: Any, reference: Any) -> Callable[[], str]:
    """A method built from numpy or torch scalars equals the one built from Python numbers, field
    for field (and in its spec), with Python numbers stored."""

    def check() -> str:
        method, want = built(), reference
        assert method == want and method.spec() == want.spec(), (method, want)
        from dataclasses import fields

        for f in fields(want):
            assert type(getattr(method, f.name)) is type(getattr(want, f.name)), f.name
        return f"accepted: {method.spec()}"

    return check


SCALAR_ROWS: list[Row] = [
    Checked("Sift(tau=np.float16(0.875))", same_method(lambda: Sift(tau=np.float16(0.875)), Sift(tau=0.875))),
    Checked("Sift(tau=np.float32(0.875))", same_method(lambda: Sift(tau=np.float32(0.875)), Sift(tau=0.875))),
    Checked("Sift(tau=np.float64(0.3))", same_method(lambda: Sift(tau=np.float64(0.3)), Sift(tau=0.3))),
    Checked("Sift(tau=torch.tensor(0.875))", same_method(lambda: Sift(tau=torch.tensor(0.875)), Sift(tau=0.875))),
    Checked("Sift(tau=torch.tensor(0.5, dtype=torch.bfloat16))",
            same_method(lambda: Sift(tau=torch.tensor(0.5, dtype=torch.bfloat16)), Sift(tau=0.5))),
    Checked("Sift(tau=np.array(0.75), warmup=np.int64(16))",
            same_method(lambda: Sift(tau=np.array(0.75), warmup=np.int64(16)), Sift(tau=0.75, warmup=16))),
    Checked("Sift(warmup=torch.tensor(8), anchor_last=np.uint16(32), renormalize=np.bool_(True))",
            same_method(lambda: Sift(warmup=torch.tensor(8), anchor_last=np.uint16(32), renormalize=np.bool_(True)),
                        Sift(warmup=8, anchor_last=32, renormalize=True))),
    Checked("TopK(k=np.float32(0.25), renormalize=torch.tensor(False))",
            same_method(lambda: TopK(k=np.float32(0.25), renormalize=torch.tensor(False)), TopK(k=0.25, renormalize=False))),
    Checked("H2O(k=torch.tensor(0.5, dtype=torch.float64), heavy_ratio=np.int8(1))",
            same_method(lambda: H2O(k=torch.tensor(0.5, dtype=torch.float64), heavy_ratio=np.int8(1)), H2O(k=0.5, heavy_ratio=1))),
    Checked("Oracle(tau=np.float64(0.9))", same_method(lambda: Oracle(tau=np.float64(0.9)), Oracle(tau=0.9))),
    Checked("SkipSoftmax(scale=np.int32(8), block=torch.tensor(64))",
            same_method(lambda: SkipSoftmax(scale=np.int32(8), block=torch.tensor(64)), SkipSoftmax(scale=8.0, block=64))),
    Checked("TopTheta(k=np.int64(8), sigma=torch.tensor(0.25))",
            same_method(lambda: TopTheta(k=np.int64(8), sigma=torch.tensor(0.25)), TopTheta(k=8, sigma=0.25))),
    Refused("Sift(tau=True)", lambda: Sift(tau=True), ValueError, "tau must be a number in (0, 1), got True"),
    Refused("Sift(tau=np.bool_(True))", lambda: Sift(tau=np.bool_(True)), ValueError, "tau must be a number in (0, 1)"),
    Refused("Sift(tau=torch.tensor(True))", lambda: Sift(tau=torch.tensor(True)), ValueError, "tau must be a number in (0, 1)"),
    Refused('Sift(tau="0.875")', lambda: Sift(tau="0.875"), ValueError, "tau must be a number in (0, 1), got '0.875'"),
    Refused("Sift(tau=float('nan'))", lambda: Sift(tau=float("nan")), ValueError, "tau must be in (0, 1), got nan"),
    Refused("Sift(tau=np.float32('nan'))", lambda: Sift(tau=np.float32("nan")), ValueError, "tau must be in (0, 1), got nan"),
    Refused("Sift(tau=torch.tensor([0.5, 0.9]))", lambda: Sift(tau=torch.tensor([0.5, 0.9])), ValueError,
            "tau must be a number in (0, 1), got a Tensor of shape (2,)"),
    Refused("Sift(tau=torch.tensor([0.5]))", lambda: Sift(tau=torch.tensor([0.5])), ValueError, "got a Tensor of shape (1,)"),
    Refused("Sift(tau=torch.full((64, 64), 0.5))", lambda: Sift(tau=torch.full((64, 64), 0.5)), ValueError,
            "got a Tensor of shape (64, 64)"),
    Refused("Oracle(tau=0.5 + 0j)", lambda: Oracle(tau=0.5 + 0j), ValueError, "tau must be a number in (0, 1), got (0.5+0j)"),
    Refused("Sift(warmup=16.0)", lambda: Sift(warmup=16.0), ValueError, "warmup must be an integer >= 2, got 16.0"),
    Refused("Sift(warmup=torch.tensor(16.0))", lambda: Sift(warmup=torch.tensor(16.0)), ValueError,
            "warmup must be an integer >= 2, got 16.0"),
    Refused("Sift(warmup=np.int64(1))", lambda: Sift(warmup=np.int64(1)), ValueError, "warmup must be an integer >= 2, got 1"),
    Refused('Sift(renormalize="false")', lambda: Sift(renormalize="false"), ValueError,
            "renormalize must be True or False, got 'false'"),
    Refused("TopK(k=np.float64(1.5))", lambda: TopK(k=np.float64(1.5)), ValueError, "k must be in (0, 1], got 1.5"),
    Refused("TopK(renormalize=1)", lambda: TopK(renormalize=1), ValueError, "renormalize must be True or False, got 1"),
    Refused("H2O(heavy_ratio=torch.tensor([0.5, 0.5]))", lambda: H2O(heavy_ratio=torch.tensor([0.5, 0.5])), ValueError,
            "heavy_ratio must be a number in [0, 1], got a Tensor of shape (2,)"),
    Refused("SkipSoftmax(scale=float('inf'))", lambda: SkipSoftmax(scale=float("inf")), ValueError,
            "scale must be a positive finite number, got inf"),
    Refused("SkipSoftmax(scale=torch.tensor(float('nan')))", lambda: SkipSoftmax(scale=torch.tensor(float("nan"))), ValueError,
            "scale must be a positive finite number, got nan"),
    Refused("SkipSoftmax(per_head='yes')", lambda: SkipSoftmax(per_head="yes"), ValueError, "per_head must be True or False"),
    Refused("TopTheta(sigma=float('-inf'))", lambda: TopTheta(sigma=float("-inf")), ValueError,
            "sigma must be a finite number, got -inf"),
    Refused("TopTheta(k=torch.tensor(8.0))", lambda: TopTheta(k=torch.tensor(8.0)), ValueError, "k must be an integer >= 1, got 8.0"),
]


# -- a decode row with an empty key range (start == seq_len): zeros on every backend, never NaN ------------

# Rows [start, seq_len): a full row, an empty one, a left-trimmed one. 4 query heads on 2 KV heads.
EMPTY_CASE = dict(B=3, Hq=4, Hkv=2, S=16, D=16, seq_lens=[12, 7, 10], starts=[0, 7, 3], first=2, last=2, tau=0.6)
# Small tiles so that the interpreter has little to run (as tests/test_kernels.py's SMALL), and the radix select
# over every key (the sampled bracket costs the interpreter half a minute).
TRITON_SMALL = dict(block_n1=16, block_n2=16, block_a=32, scan_elems=0, min_split1=16, min_split2=16, quantile_block=32,
                    block_nd=16, min_splitd=16, block_nb=16, block_n2_gqa=16, block_nb_gqa=32, quantile_parallel=False,
                    interleave2=0, interleave2_runs=1, quantile_sample=0, quantile_sparse_from=0)
EMPTY_OPS = ("sparse", "sparse renormalised", "sparse, power-law threshold", "sparse with its quantile", "anchored", "anchored renormalised",
             "dense", "warmup", "warmup gap")
TRITON_EXTRA_OPS = ("anchored one-pass", "warmup, scores-quantile-filter kernels", "sparse renormalised, combine kernel")


def _empty_inputs() -> tuple[torch.Tensor, ...]:
    c = EMPTY_CASE
    g = torch.Generator().manual_seed(7)
    q = torch.randn(c["B"], c["Hq"], c["D"], generator=g) * 2
    k = torch.randn(c["B"], c["Hkv"], c["S"], c["D"], generator=g)
    v = torch.randn(c["B"], c["Hkv"], c["S"], c["D"], generator=g)
    return q, k, v, torch.tensor(c["seq_lens"], dtype=torch.int32), torch.tensor(c["starts"], dtype=torch.int32)


def _float64_step(q, k, v, eta, gap_prev, renormalize, anchored):
    """The decode step in float64, one (row, head) at a time over its valid keys (docs/design.md):
    out, kept, theta, gap; an empty row gives zeros by the defined rule."""
    c = EMPTY_CASE
    B, Hq = q.shape[:2]
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, q.shape[-1], dtype=torch.float64)
    kept = torch.zeros(B, Hq, dtype=torch.int32)
    theta = torch.zeros(B, Hq, dtype=torch.float64)
    gap = torch.zeros(B, Hq, dtype=torch.float64)
    for b in range(B):
        lo, hi = c["starts"][b], c["seq_lens"][b]
        if hi == lo:
            continue
        for h in range(Hq):
            s = (k[b, h // G, lo:hi].double() @ q[b, h].double()) * c["D"] ** -0.5
            p = torch.softmax(s, 0)
            anchor = torch.zeros(hi - lo, dtype=torch.bool)
            anchor[: c["first"]] = True
            anchor[max(c["first"], hi - lo - c["last"]):] = True
            gap[b, h] = torch.logsumexp(s, 0) - torch.logsumexp(s[anchor], 0)
            threshold = float(eta[b, h]) * (math.exp(float(gap_prev[b, h]) - float(gap[b, h])) if anchored else 1.0)
            keep = p > threshold
            keep[int(p.argmax())] = True
            w = torch.where(keep, p, 0.0)
            out[b, h] = (w / w.sum() if renormalize else w) @ v[b, h // G, lo:hi].double()
            kept[b, h] = int(keep.sum())
            theta[b, h] = torch.quantile(p, c["tau"])
    return out, kept, theta, gap


def empty_range_results(backend: str) -> dict[str, dict]:
    """Every decode step of one backend on ``EMPTY_CASE``: the empty row's largest magnitude and kept
    count, whether anything is NaN, and the other rows' error against ``_float64_step``."""
    from siftattention.kernels import DecodeKernels
    from siftattention.kernels.plan import PowerLawThreshold

    c = EMPTY_CASE
    q, k, v, sl, st = _empty_inputs()
    B, Hq = c["B"], c["Hq"]
    g = torch.Generator().manual_seed(8)
    eta = torch.rand(B, Hq, generator=g) * 0.2
    log_alpha, beta = torch.log(eta * 4), torch.full((B, Hq), 0.5)  # eta = alpha * S^-beta at S = 16
    power = PowerLawThreshold(log_alpha, beta, torch.full((B,), math.log(16.0)))
    gap_prev = torch.rand(B, Hq, generator=g)

    def plan(renormalize, **over):
        config = None
        if backend == "triton":
            from siftattention.kernels.triton_decode import KernelConfig

            config = KernelConfig(**{**TRITON_SMALL, **over})
        return DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=c["Hkv"], max_len=c["S"], head_dim=c["D"], dtype=torch.float32,
                                  device="cpu", scale=c["D"] ** -0.5, renormalize=renormalize, backend=backend, config=config)

    def summary(name, out, kept=None, theta=None, gap=None, renormalize=False, anchored=False, threshold=eta):
        want_out, want_kept, want_theta, want_gap = _float64_step(q, k, v, threshold, gap_prev, renormalize, anchored)
        got = [t for t in (out, kept, theta, gap) if t is not None]
        full = [0, 2]
        res = dict(nan=any(bool(torch.isnan(t.double()).any()) for t in got),
                   empty=max(float(t[1].double().abs().max()) for t in got),
                   err=float((out[full].double() - want_out[full]).norm() / want_out[full].norm()))
        if kept is not None:
            res["kept_equal"] = bool(torch.equal(kept[full], want_kept[full]))
        if theta is not None:
            res["theta_err"] = float(((theta[full].double() - want_theta[full]) / want_theta[full]).abs().max())
        if gap is not None:
            res["gap_err"] = float((gap[full].double() - want_gap[full]).abs().max())
        results[name] = res

    results: dict[str, dict] = {}
    kern, kern_r = plan(False), plan(True)
    summary("sparse", *kern.sparse(q, k, v, eta, sl, st))
    summary("sparse renormalised", *kern_r.sparse(q, k, v, eta, sl, st), renormalize=True)
    summary("sparse, power-law threshold", *kern.sparse(q, k, v, power, sl, st), threshold=power.eta())
    out, kept, theta = kern.sparse_quantile(q, k, v, power, c["tau"], sl, st)
    summary("sparse with its quantile", out, kept, theta=theta, threshold=power.eta())
    onepass = {"onepass": False} if backend == "triton" else {}
    for name, kernels, renorm in (("anchored", kern, False), ("anchored renormalised", kern_r, True)):
        gap = gap_prev.clone()
        out, kept = kernels.sparse_anchored(q, k, v, power, gap, sl, st, c["first"], c["last"], **onepass)
        summary(name, out, kept, gap=gap, renormalize=renorm, anchored=True, threshold=power.eta())
    summary("dense", kern.dense(q, k, v, sl, st), threshold=torch.zeros(B, Hq))
    out, theta = kern.warmup(q, k, v, c["tau"], sl, st)
    summary("warmup", out, theta=theta, threshold=torch.zeros(B, Hq))
    summary("warmup gap", out, gap=kern.warmup_gap(q, k, sl, st, c["first"], c["last"]), threshold=torch.zeros(B, Hq))
    if backend == "triton":
        gap = gap_prev.clone()
        out, kept = kern.sparse_anchored(q, k, v, power, gap, sl, st, c["first"], c["last"], onepass=True)
        summary("anchored one-pass", out, kept, gap=gap, anchored=True, threshold=power.eta())
        out, theta = plan(False, warmup_dense=False).warmup(q, k, v, c["tau"], sl, st)
        summary("warmup, scores-quantile-filter kernels", out, theta=theta, threshold=torch.zeros(B, Hq))
        summary("sparse renormalised, combine kernel", *plan(True, fused_combine=False).sparse(q, k, v, eta, sl, st),
                renormalize=True)
    return results


_EMPTY_RESULTS: dict[str, dict] = {}


def _empty_results(backend: str) -> dict[str, dict]:
    """``empty_range_results`` once per backend: Triton's in a subprocess under its CPU interpreter."""
    if backend not in _EMPTY_RESULTS:
        if backend == "triton":
            pytest.importorskip("triton", reason="triton is not installed: its kernels cannot be checked")
            from conftest import run_interpreted

            _EMPTY_RESULTS[backend] = run_interpreted(__file__, "--empty-range", "triton")
        else:
            if backend == "cpu":
                from siftattention.kernels import cpu_decode

                if not cpu_decode.available():
                    pytest.skip(f"the fused CPU kernel cannot be built here: {cpu_decode.build_problem()}")
            _EMPTY_RESULTS[backend] = empty_range_results(backend)
    return _EMPTY_RESULTS[backend]


def empty_row(backend: str, op: str) -> Callable[[], str]:
    def check() -> str:
        res = _empty_results(backend)[op]
        assert not res["nan"], res
        assert res["empty"] == 0.0, res  # output, kept count, theta and gap all exactly 0
        assert res["err"] < 1e-5 and res.get("kept_equal", True), res
        assert res.get("theta_err", 0.0) < 1e-5 and res.get("gap_err", 0.0) < 1e-5, res
        zeros = ["output"] + [name for name, key in (("kept", "kept_equal"), ("theta", "theta_err"), ("gap", "gap_err"))
                              if key in res]
        return f"empty row: {', '.join(zeros)} 0, no NaN; the other rows equal float64"

    return check


EMPTY_RANGE_ROWS: list[Row] = [
    Checked(f"{backend}: {op} with seq_lens == starts", empty_row(backend, op))
    for backend in ("torch", "cpu", "triton") for op in EMPTY_OPS + (TRITON_EXTRA_OPS if backend == "triton" else ())
]


# -- generation: which tokens are the prompt and which are decode steps, on both paths ----------------------

NEW = 10


def _tiny() -> torch.nn.Module:
    model = tiny_llama()
    with torch.no_grad():  # the pad token's row starts at zero: a generated pad would attend uniformly
        model.get_input_embeddings().weight[0].normal_()
    return model


def _prompt(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of these real lengths (ids, mask)."""
    width = max(lengths)
    ids = torch.randint(3, 96, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def prompt_paths(lengths: list[int], warmup_source: str = "decode") -> Callable[[], str]:
    """The fast loop and transformers' generate under ``apply`` on prompts of these lengths: the same
    tokens and the same Sift statistics, and the recorded steps the closed form docs/design.md gives
    (decode warmup: steps P+1..P+w of a P-token row; prefill warmup: its last min(w, P) prompt rows)."""

    def check() -> str:
        model, method = _tiny(), Sift(tau=0.75, warmup=4, warmup_source=warmup_source)
        ids, mask = _prompt(lengths, seed=len(lengths) * 10 + max(lengths))
        fast = siftattention.generate(model, ids, mask, method, max_new_tokens=NEW, eos_token_id=-1, pad_token_id=0)
        with siftattention.apply(model, method) as handle, torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert fast.fast and torch.equal(ref, fast.sequences)
        w = method.warmup
        real = torch.tensor(lengths, dtype=torch.float32)[:, None]
        for layer in handle.stats.layers:
            a, b = handle.stats.state(layer), fast.stats.state(layer)
            assert torch.equal(a.count, b.count) and torch.equal(a.fitted, b.fitted) and torch.equal(a.theta_steps, b.theta_steps)
            assert torch.allclose(a.thetas, b.thetas, rtol=1e-5, atol=0)
            assert torch.allclose(a.beta, b.beta, rtol=1e-4, atol=1e-5)
            if warmup_source == "decode":
                assert torch.equal(a.theta_steps, real + torch.arange(1, w + 1)), a.theta_steps  # S = P+1..P+w
            else:
                n = real.clamp(max=w)
                assert torch.equal(a.count, n[:, 0].long())
                steps = real - n + torch.arange(1, w + 1)  # the last min(w, P) prompt rows, then unused slots
                assert torch.equal(torch.where(torch.arange(w) < n, a.theta_steps, 0), torch.where(torch.arange(w) < n, steps, 0))
                assert torch.equal(a.fitted, n[:, 0] >= 2)  # a one-token prompt gives no fit
        assert handle.stats.step_count() == fast.stats.step_count() == len(lengths) * (NEW - 1)
        assert handle.stats.realized_sparsity() == pytest.approx(fast.stats.realized_sparsity(), abs=1e-9)
        return "both paths: same tokens, steps, thetas and fit (closed-form steps)"

    return check


PROMPT_ROWS: list[Row] = [
    Checked("1-token prompt: fast loop vs generate under apply", prompt_paths([1])),
    Checked("2-token prompt: fast loop vs generate under apply", prompt_paths([2])),
    Checked("3-token prompt: fast loop vs generate under apply", prompt_paths([3])),
    Checked("left-padded prompts of 1, 2, 3 tokens: both paths", prompt_paths([1, 2, 3])),
    Checked("1-token prompt, warmup_source='prefill': both paths", prompt_paths([1], "prefill")),
    Checked("2-token prompt, warmup_source='prefill': both paths", prompt_paths([2], "prefill")),
]


# -- beam search: the method's state follows the cache's reorder -------------------------------------------


def beam_search(method: Any, beams: int, decode_backend: str | None = "auto") -> Callable[[], str]:
    """Beam search under ``apply``: each returned beam's score (length_penalty 0: its summed log
    probabilities) equals the score of the same tokens forced through a single-sequence generation,
    which has no beams to reorder. A method state left in the slot of another beam changes them."""

    def check() -> str:
        model = _tiny()
        P = 5
        ids = torch.randint(3, 96, (1, P), generator=torch.Generator().manual_seed(3))
        common = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        with siftattention.apply(model, method, decode_backend=decode_backend), torch.no_grad():
            out = model.generate(input_ids=ids, num_beams=beams, num_return_sequences=beams, length_penalty=0.0,
                                 early_stopping=True, output_scores=True, return_dict_in_generate=True, **common)
        for seq, score in zip(out.sequences, out.sequences_scores):
            with siftattention.apply(model, method, decode_backend=decode_backend), torch.no_grad():
                one = model.generate(input_ids=seq[None, :P], output_logits=True, return_dict_in_generate=True,
                                     prefix_allowed_tokens_fn=lambda _, x, seq=seq: [int(seq[x.shape[0]])], **common)
            assert torch.equal(one.sequences[0], seq)
            logp = sum(float(torch.log_softmax(step[0].double(), -1)[seq[P + t]]) for t, step in enumerate(one.logits))
            assert logp == pytest.approx(float(score), abs=1e-4), (logp, float(score))
        return f"{beams} beams: every beam's score = its tokens replayed as one sequence"

    return check


BEAM_ROWS: list[Row] = [
    Checked("Sift, num_beams=2", beam_search(Sift(tau=0.75, warmup=4), 2)),
    Checked("Sift, num_beams=3", beam_search(Sift(tau=0.75, warmup=4), 3)),
    Checked("Sift renormalised, num_beams=2, decode_backend=None (row-wise select)",
            beam_search(Sift(tau=0.9, warmup=4, renormalize=True), 2, decode_backend=None)),
    Checked("Sift anchored, num_beams=2", beam_search(Sift(tau=0.75, warmup=4, normalizer="anchored", anchor_first=2,
                                                           anchor_last=4), 2)),
    Checked("H2O, num_beams=2", beam_search(H2O(k=0.25), 2)),
    Checked("TopK (no state), num_beams=3", beam_search(TopK(k=0.25), 3)),
]


# -- generation lengths: positions beyond the model's warn, max_new_tokens as any integer -----------------


def _positions_model() -> torch.nn.Module:
    model = _tiny()
    model.config.max_position_embeddings = 16
    return model


def _apply_generate(**kwargs: Any) -> Callable[[], Any]:
    def call() -> Any:
        model = _positions_model()
        ids, mask = _prompt([12])
        with siftattention.apply(model, Sift(tau=0.75, warmup=4)), torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)

    return call


def _within_positions() -> str:
    """12 + 5 tokens run the model at 16 positions: no warning (transformers' limit, as transformers counts);
    nor with transformers' default length, which stops at the model's positions."""
    ids, mask = _prompt([12])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        siftattention.generate(_positions_model(), ids, mask, Sift(tau=0.75, warmup=2), max_new_tokens=5, eos_token_id=-1)
        _apply_generate(max_new_tokens=5)()
        assert _apply_generate()().shape[1] == 16
    assert not [w for w in caught if "max_position_embeddings" in str(w.message)], [str(w.message) for w in caught]
    return "no warning at the model's positions"


def _numpy_max_new_tokens() -> str:
    ids, mask = _prompt([3, 2])
    a = siftattention.generate(_tiny(), ids, mask, Sift(tau=0.75, warmup=2), max_new_tokens=np.int64(5), eos_token_id=-1)
    b = siftattention.generate(_tiny(), ids, mask, Sift(tau=0.75, warmup=2), max_new_tokens=5, eos_token_id=-1)
    assert torch.equal(a.sequences, b.sequences) and a.new_tokens.shape[1] == 5
    return "the same tokens as max_new_tokens=5"


POSITION_ROWS: list[Row] = [
    Warned("siftattention.generate: 12-token prompt + 8 new tokens, 16 positions",
           lambda: siftattention.generate(_positions_model(), *_prompt([12]), Sift(tau=0.75, warmup=4), max_new_tokens=8,
                                          eos_token_id=-1),
           UserWarning, "a prompt of 12 tokens and 8 new tokens: 19 positions, more than the model's 16 (max_position_embeddings)"),
    Warned("reference_generate: 12-token prompt + 8 new tokens, 16 positions",
           lambda: siftattention.generation.reference_generate(_positions_model(), *_prompt([12]), TopK(k=0.5),
                                                               max_new_tokens=8, eos_token_id=None),
           UserWarning, "a prompt of 12 tokens and 8 new tokens: 19 positions, more than the model's 16"),
    Warned("apply + model.generate(max_new_tokens=8): 12-token prompt, 16 positions", _apply_generate(max_new_tokens=8),
           UserWarning, "a prompt of 12 tokens and 8 new tokens: 19 positions, more than the model's 16"),
    Warned("apply + model.generate(max_length=20): 12-token prompt, 16 positions", _apply_generate(max_length=20),
           UserWarning, "a prompt of 12 tokens and 8 new tokens: 19 positions, more than the model's 16"),
    Checked("generate: 12-token prompt + 5 new tokens (or the default length), 16 positions", _within_positions),
    Checked("generate(max_new_tokens=np.int64(5))", _numpy_max_new_tokens),
    Refused("generate(max_new_tokens=5.0)",
            lambda: siftattention.generate(_tiny(), *_prompt([3]), Full(), max_new_tokens=5.0), ValueError,
            "max_new_tokens must be an integer >= 1, got 5.0"),
]


# -- a warmup that leaves no approximated row: refused before any forward pass ---------------------------


def _ppl(seq_len: int, specs: list[str], model: Callable[[], torch.nn.Module] = _tiny) -> Callable[[], Any]:
    """``evaluate_perplexity`` on windows of ``seq_len`` tokens; a refusal must come before the model runs."""

    def call() -> Any:
        from siftattention import parse_method
        from siftattention.eval.perplexity import evaluate_perplexity

        net, calls = model(), []
        forward = net.forward
        net.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
        windows = torch.randint(3, 96, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
        try:
            return evaluate_perplexity(net, windows, [(s, parse_method(s)) for s in specs])
        except ValueError:
            assert not calls, "refused after the model ran"
            raise

    return call


def _ppl_post_warmup(seq_len: int, spec: str) -> Callable[[], str]:
    def check() -> str:
        (full, method), warm = _ppl(seq_len, ["full", spec])()
        assert method.tokens_post_warmup == 2 * (seq_len - 1 - warm) >= 2 and math.isfinite(method.ppl_post_warmup)
        assert 0 < method.realized_sparsity_post_warmup <= 1 and full.realized_sparsity_post_warmup == 0
        return f"accepted: {method.tokens_post_warmup} scored tokens after the warmup, finite ppl and sparsity"

    return check


WARMUP_ROWS: list[Row] = [
    Refused("evaluate_perplexity: sift:tau=0.875,warmup=64, windows of 32 tokens",
            _ppl(32, ["sift:tau=0.875,warmup=64"]), ValueError,
            "sift:tau=0.875,warmup=64: a warmup of 64 steps leaves no approximated row in a window of 32 tokens"),
    Refused("evaluate_perplexity: sift:warmup=32, windows of 32 tokens", _ppl(32, ["full", "sift:warmup=32"]), ValueError,
            "sift:warmup=32: a warmup of 32 steps leaves no approximated row in a window of 32 tokens"),
    Refused("evaluate_perplexity: sift:warmup=31, windows of 32 tokens (no scored row after it)",
            _ppl(32, ["full", "topk:k=0.5", "sift:warmup=31"]), ValueError, "use a sequence length of at least 33"),
    Checked("evaluate_perplexity: sift:warmup=30, windows of 32 tokens", _ppl_post_warmup(32, "sift:warmup=30")),
    Checked("evaluate_perplexity: sift:warmup=2, windows of 4 tokens", _ppl_post_warmup(4, "sift:warmup=2")),
    Refused("check_windows (no model): sift:tau=0.875,warmup=64 at seq_len 32",
            lambda: __import__("siftattention.eval.perplexity").eval.perplexity.check_windows(
                [("sift:tau=0.875,warmup=64", Sift(tau=0.875, warmup=64))], 32),
            ValueError, "leaves no approximated row in a window of 32 tokens"),
    Refused("parse_warmups('64,128', seq_len=100) (sift analyze)",
            lambda: __import__("siftattention.eval.analysis").eval.analysis.parse_warmups("64,128", 100), ValueError,
            "warmup 128 is longer than the sequence length 100"),
    Warned("evaluate_perplexity: windows of 20 tokens, 16 positions",
           _ppl(20, ["full"], _positions_model), UserWarning,
           "windows of 20 tokens: 20 positions, more than the model's 16 (max_position_embeddings)"),
]


# -- the table ------------------------------------------------------------------------------------------------

ROWS: list[Row] = [*SCALAR_ROWS, *EMPTY_RANGE_ROWS, *PROMPT_ROWS, *BEAM_ROWS, *POSITION_ROWS, *WARMUP_ROWS]


def run_row(row: Row) -> str:
    """Run one row and assert its outcome; the outcome as the table shows it."""
    if isinstance(row, Refused):
        with pytest.raises(row.error) as info:
            row.call()
        message = str(info.value)
        assert "\n" not in message, message
        assert row.message in message, message
        return f"{type(info.value).__name__}: {message}"
    if isinstance(row, Warned):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row.call()
        hits = [w for w in caught if issubclass(w.category, row.category) and row.message in str(w.message)]
        assert hits, [str(w.message) for w in caught]
        assert "\n" not in str(hits[0].message)
        return f"{row.category.__name__}: {hits[0].message}"
    return row.call()


def _param(row: Row):
    """The row as a test case; Triton's empty-range rows read one interpreted run, started ahead (conftest)."""
    triton = row in EMPTY_RANGE_ROWS and row.label.startswith("triton: ")
    return pytest.param(row, id=row.label, marks=[pytest.mark.interpreted(("--empty-range", "triton"))] if triton else [])


@pytest.mark.parametrize("row", [_param(row) for row in ROWS])
def test_row(row: Row) -> None:
    run_row(row)


def test_the_table_is_large_enough() -> None:
    assert len(ROWS) >= 30 and len({row.label for row in ROWS}) == len(ROWS)


# -- the table for the docs ------------------------------------------------------------------------------


def markdown_table() -> str:
    """Every row with its outcome, as docs/bad-input.md shows it."""
    lines = ["| input | outcome |", "|---|---|"]
    for row in ROWS:
        try:
            outcome = run_row(row)
        except BaseException as err:  # noqa: BLE001 - the table shows whatever happens
            outcome = f"FAILED ({type(err).__name__}: {err})"
        lines.append(f"| `{row.label}` | {outcome.replace('|', '/')} |")
    return "\n".join(lines)


if __name__ == "__main__" and "--empty-range" in sys.argv:  # the Triton rows' subprocess
    import json

    print(json.dumps(empty_range_results(sys.argv[sys.argv.index("--empty-range") + 1])))
elif __name__ == "__main__":
    print(markdown_table())
