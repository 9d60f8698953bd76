"""Value-mean compensation (``vmc``) on every path: the decode kernels' ``value_sum`` against float64 (torch, the
fused CPU kernel, Triton under its interpreter), the running value sum a threshold method keeps, and whole
generations of the fast loop and transformers' generate against the row-wise reference path.

The Triton cases run in one subprocess under TRITON_INTERPRET=1: this file run as a script (``--triton-worker``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest
import torch

from conftest import dtype_tolerance, tiny_llama, triton_worker
from test_kernels import SMALL, range_case, range_eta, rel, seed
from siftattention.kernels import DecodeKernels, sift_decode
from siftattention.methods import Oracle, Sift, SpecError, TopK, TopTheta, parse_method
from siftattention.methods.base import KeyRange, PromptChunk

# B, Hq, Hkv, S, D, dtype: GQA 1, 2, 4 and 8, head dims 64 and 128, lengths that are no multiple of a block
CASES = [
    (3, 4, 4, 37, 64, "float32"),
    (3, 8, 4, 101, 128, "float32"),
    (2, 8, 2, 53, 64, "float32"),
    (2, 16, 2, 67, 128, "float32"),
]


def _valid(seq_lens, starts, S):
    pos = torch.arange(S, device=seq_lens.device)
    return (pos >= starts[:, None].long()) & (pos < seq_lens[:, None].long())


def value_sums(v, seq_lens, starts):
    """float32 [B, Hkv, D]: the sum of each row's valid value rows, taken in float64."""
    return (v.double() * _valid(seq_lens, starts, v.shape[2])[:, None, :, None]).sum(2).float()


def ref_compensated(q, k, v, keep_rule, scale, seq_lens, starts):
    """float64, one (batch, head) row at a time over its valid keys: ``keep_rule(s, p, b, h)`` -> kept keys (the
    first maximum added here), out = sum_kept p v + (1 - kept mass) * mean of the valid value rows."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    kept = torch.zeros(B, Hq, dtype=torch.int32)
    for b in range(B):
        lo, hi = int(starts[b]), int(seq_lens[b])
        if hi <= lo:
            continue  # no valid key: zeros
        for h in range(Hq):
            kk, vv = k[b, h // G, lo:hi].double(), v[b, h // G, lo:hi].double()
            s = (kk @ q[b, h].double()) * scale
            p = torch.softmax(s, 0)
            keep = keep_rule(s, p, b, h)
            keep[int(torch.argmax(s))] = True
            w = torch.where(keep, p, 0.0)
            out[b, h] = w @ vv + (1 - w.sum()) * vv.mean(0)
            kept[b, h] = int(keep.sum())
    return out, kept


def eta_rule(eta):
    def rule(s, p, b, h):
        e = float(eta[b, h])
        return (p > e) | torch.tensor(e <= 0)
    return rule


def compensated_case(case, tag):
    """Inputs with ragged [start, seq_len) (one row of one key, and the last row empty where B > 2), thresholds
    midway between probabilities or at the edges, the value sums and the float64 reference."""
    B, Hq, Hkv, S, D, dt = case
    gen = torch.Generator().manual_seed(seed("vmc", tag, *case[:5]))
    q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, getattr(torch, dt), gen)
    if B > 2:
        st[-1] = sl[-1]
    eta = range_eta(q, k, D**-0.5, sl, st, gen)
    vs = value_sums(v, sl, st)
    if B > 2:
        vs[-1] += 1.0  # an empty row stays zero, whatever its value sum holds
    ref, ref_kept = ref_compensated(q, k, v, eta_rule(eta), D**-0.5, sl, st)
    return q, k, v, sl, st, eta, vs, ref, ref_kept


def plain_output(q, k, v, eta, sl, st, backend):
    return sift_decode(q, k, v, eta, seq_lens=sl, starts=st, backend=backend)[0]


def checked_eta(eta):
    """``eta`` for the functional API, which refuses NaN: 1 keeps the maximum only, as NaN does."""
    return eta.nan_to_num(nan=1.0)


needs_cpu_kernel = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_cpu_kernel)])
@pytest.mark.parametrize("case", CASES, ids=[f"G{c[1] // c[2]}-S{c[3]}-D{c[4]}" for c in CASES])
def test_compensated_sparse_step_matches_float64(case, backend):
    q, k, v, sl, st, eta, vs, ref, ref_kept = compensated_case(case, "sparse")
    B, Hq, Hkv, S, D, _ = case
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=torch.float32,
                              device="cpu", scale=D**-0.5, backend=backend)
    assert kern.backend == backend
    out, kept = kern.sparse(q, k, v, eta, sl, st, vs)
    assert torch.equal(kept, ref_kept) and rel(out, ref) < 1e-5
    assert rel(plain_output(q, k, v, checked_eta(eta), sl, st, backend), ref) > 1e-3  # the compensation is there to see
    out_f, kept_f = sift_decode(q, k, v, checked_eta(eta), seq_lens=sl, starts=st, backend=backend, value_sum=vs)
    assert torch.equal(out_f, out) and torch.equal(kept_f, kept)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_cpu_kernel)])
def test_compensated_anchored_step_matches_float64(backend):
    from siftattention.kernels.plan import PowerLawThreshold
    from siftattention.kernels.torch_ref import _anchor_lse, _scores, anchored_threshold

    B, Hq, Hkv, S, D = 2, 8, 2, 59, 64
    gen = torch.Generator().manual_seed(seed("vmc-anchored"))
    q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, torch.float32, gen)
    gap = torch.rand(B, Hq, generator=gen) * 2
    log_eta = torch.log(torch.rand(B, Hq, generator=gen) * 0.2)
    s64, valid = _scores(q.double(), k.double(), D**-0.5, sl, st)
    thr = anchored_threshold(_anchor_lse(s64, valid, 3, 5), gap.double(), log_eta.double())
    ref, ref_kept = ref_compensated(q, k, v, lambda s, p, b, h: s > thr[b, h], D**-0.5, sl, st)
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=torch.float32,
                              device="cpu", scale=D**-0.5, backend=backend)
    law = PowerLawThreshold(log_eta, torch.zeros(B, Hq), torch.zeros(B))
    out, kept = kern.sparse_anchored(q, k, v, law, gap.clone(), sl, st, 3, 5, value_sum=value_sums(v, sl, st))
    assert torch.equal(kept, ref_kept) and rel(out, ref) < 1e-5
    assert int(kept.sum()) < int((sl - st).sum()) * Hq // 2  # it filters


def test_kernel_compensation_with_renormalisation_is_refused_in_one_line():
    q, k, v, sl, st = range_case(2, 4, 2, 20, 16, torch.float32, torch.Generator().manual_seed(1))
    vs = value_sums(v, sl, st)
    kern = DecodeKernels.plan(batch=2, q_heads=4, kv_heads=2, max_len=20, head_dim=16, dtype=torch.float32,
                              device="cpu", scale=0.25, renormalize=True, backend="torch")
    for call in (lambda: kern.sparse(q, k, v, torch.zeros(2, 4), sl, st, vs),
                 lambda: sift_decode(q, k, v, 0.1, seq_lens=sl, renormalize=True, value_sum=vs)):
        with pytest.raises(ValueError, match="needs renormalize=False") as err:
            call()
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"value_sum must be \[B, Hkv, D\]"):
        sift_decode(q, k, v, 0.1, seq_lens=sl, value_sum=vs[:, :1])


# ----------------------------------------------------------------------------- Triton (interpreter)

# (B, Hq, Hkv, S, D, dtype, config overrides): GQA 1, 2, 4, 8, both head dims, the filter pass's
# gather and streaming forms and the separate combine launch.
TRITON_CASES = [
    (3, 4, 4, 37, 64, "float32", {}),
    (3, 8, 4, 45, 128, "float16", {"compact": False}),
    (2, 8, 2, 29, 64, "bfloat16", {"compact_weights": False}),
    (3, 16, 2, 41, 64, "float32", {"fused_combine": False}),
]


def _sparse_rows(device: str) -> list[dict]:
    """Each case's compensated sparse step through the Triton kernels (eta, and as a power law) against float64."""
    from siftattention.kernels.plan import PowerLawThreshold
    from siftattention.kernels.triton_decode import KernelConfig

    rows = []
    for i, (B, Hq, Hkv, S, D, dt, over) in enumerate(TRITON_CASES):
        q, k, v, sl, st, eta, vs, ref, ref_kept = compensated_case((B, Hq, Hkv, S, D, dt), f"triton{i}")
        q, k, v, sl, st, eta, vs = (t.to(device) for t in (q, k, v, sl, st, eta, vs))
        kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=getattr(torch, dt),
                                  device=device, scale=D**-0.5, backend="triton", config=KernelConfig(**{**SMALL, **over}))
        out, kept = kern.sparse(q, k, v, eta, sl, st, vs)
        law = PowerLawThreshold(eta.clamp(min=0).log(), torch.zeros(B, Hq, device=device), torch.zeros(B, device=device))
        out_law, _ = kern.sparse(q, k, v, law, sl, st, vs)
        rows.append(dict(case=i, dtype=dt, err=rel(out.cpu(), ref), kept_equal=bool(torch.equal(kept.cpu(), ref_kept)),
                         law_err=rel(out_law.cpu(), ref), sync_zero=bool((kern.workspace.sync == 0).all())))
    return rows


def _triton_worker() -> dict:
    """Runs under TRITON_INTERPRET=1: each case's compensated sparse step, the anchored two-pass step and the
    value-sum update, against float64."""
    from siftattention.kernels.plan import PowerLawThreshold
    from siftattention.kernels.triton_decode import KernelConfig

    rows = _sparse_rows("cpu")
    # The anchored step, on a plan that would take the one-pass kernel: with a value sum the two passes run
    # (the one-pass kernel has no compensation), and asking for one pass with it is refused.
    from siftattention.kernels.torch_ref import sift_anchored_decode_torch

    B, Hq, Hkv, S, D = 2, 8, 2, 47, 64
    q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, torch.float32, torch.Generator().manual_seed(61))
    gap, log_eta, vs = torch.full((B, Hq), 0.3), torch.full((B, Hq), -2.5), value_sums(v, sl, st)
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=torch.float32, device="cpu",
                              scale=D**-0.5, backend="triton",
                              config=KernelConfig(**{**SMALL, "onepass_min_rows": 1, "onepass_min_len": 1}))
    law = PowerLawThreshold(log_eta, torch.zeros(B, Hq), torch.zeros(B))
    out, kept = kern.sparse_anchored(q, k, v, law, gap.clone(), sl, st, 3, 5, value_sum=vs)
    ref, ref_kept, _ = sift_anchored_decode_torch(q.double(), k.double(), v.double(), log_eta.double(), gap.double(), D**-0.5,
                                                  sl, False, st, 3, 5, vs.double())
    try:
        kern.sparse_anchored(q, k, v, law, gap.clone(), sl, st, 3, 5, onepass=True, value_sum=vs)
        refused = ""
    except ValueError as err:
        refused = str(err)
    anchored = dict(err=rel(out, ref), kept_equal=bool(torch.equal(kept, ref_kept)), onepass=kern.anchored_onepass,
                    refused=refused)
    return {"sparse": rows, "anchored": anchored, "value_sum": _value_sum_steps()}


def _value_sum_steps(device: str = "cpu") -> list[dict]:
    """The value-sum update's Triton launch against its torch form (bit for bit) and a float64 sum of the valid
    rows afresh, step after step: left padding, a sliding window that passes the padding, odd head_dim and
    strides (a cache with room beyond the rows used), bf16 and float32 caches."""
    from siftattention.kernels.value_sum import add_step_value_rows

    rows = []
    for B, Hkv, L, D, P, window, dt in [(3, 2, 37, 40, 9, None, torch.float32), (3, 1, 29, 64, 7, 5, torch.bfloat16),
                                         (2, 3, 33, 128, 6, 11, torch.float32)]:
        g = torch.Generator().manual_seed(B * 100 + D)
        v = torch.randn(B, Hkv, L + 3, D, generator=g).to(dt)[:, :, :L]  # a strided view: the cache's spare room
        pads = torch.tensor([0, 2, 5][:B], dtype=torch.int32)
        v, pads = v.to(device), pads.to(device)
        starts_at = lambda n: pads if window is None else torch.maximum(pads, torch.tensor(n - window, dtype=torch.int32,
                                                                                           device=device))
        sums = {name: value_sums(v, torch.full((B,), P, device=device), starts_at(P)) for name in ("torch", "triton")}
        begin = {name: starts_at(P).clone() for name in sums}
        worst, same = 0.0, True
        for n in range(P + 1, L + 1):
            for name in sums:
                add_step_value_rows(sums[name], begin[name], v, torch.full((B,), n, dtype=torch.int32, device=device),
                                    starts_at(n) if window else None, backend=name)
            same &= torch.equal(sums["torch"], sums["triton"]) and torch.equal(begin["torch"], begin["triton"])
            fresh = value_sums(v.double(), torch.full((B,), n, device=device), starts_at(n))
            worst = max(worst, rel(sums["triton"].cpu(), fresh.cpu().double()))
        rows.append(dict(shape=[B, Hkv, L, D], window=window, dtype=str(dt), same=same, err=worst))
    return rows


@pytest.fixture(scope="module")
def triton_results():
    return triton_worker(__file__)


@pytest.mark.interpreted(("--triton-worker",))
def test_triton_compensated_sparse_step_matches_float64(triton_results):
    rows = triton_results["sparse"]
    assert len(rows) == len(TRITON_CASES)
    for r in rows:
        tol = dtype_tolerance(r["dtype"])
        assert r["kept_equal"] and r["err"] < tol and r["law_err"] < tol and r["sync_zero"], r
    a = triton_results["anchored"]
    assert a["onepass"] and a["kept_equal"] and a["err"] < 1e-5, a
    assert "no value-mean compensation" in a["refused"], a


# ----------------------------------------------------------------------------- the methods' option


def test_vmc_is_an_option_of_sift_oracle_and_topk_named_only_when_set():
    assert Sift().spec() == "sift:tau=0.875,warmup=128,renormalize=False,warmup_source=prompt"
    assert Oracle().spec() == "oracle:tau=0.875,renormalize=False" and TopK().spec() == "topk:k=0.125,renormalize=True"
    for method in (Sift(vmc=True), Oracle(tau=0.5, vmc=True), TopK(k=0.25, renormalize=False, vmc=True)):
        assert method.spec().endswith(",vmc=True") and parse_method(method.spec()) == method
    for make in (lambda: Sift(renormalize=True, vmc=True), lambda: Oracle(renormalize=True, vmc=True),
                 lambda: TopK(vmc=True)):
        with pytest.raises(ValueError, match="needs renormalize=False") as err:
            make()
        assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match="needs renormalize=False"):
        parse_method("topk:k=0.25,vmc=true")
    with pytest.raises(ValueError, match="vmc must be True or False"):
        Sift(vmc="yes")
    assert TopTheta(renormalize=True).vmc  # Top-theta's default: accepted, and compensates nothing after renormalising


# ----------------------------------------------------------------------------- the running value sum


def check_value_sum_rows(rows: list[dict]) -> None:
    assert len(rows) == 3 and any(r["window"] for r in rows)
    for r in rows:
        assert r["same"] and r["err"] < 1e-5, r


@pytest.mark.interpreted(("--triton-worker",))
def test_triton_value_sum_update_equals_the_torch_form_and_a_float64_sum(triton_results):
    check_value_sum_rows(triton_results["value_sum"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compensation_and_value_sum_match_float64():
    """On the GPU: the compensated sparse step (both combine forms) and the value-sum launch, as under the
    interpreter."""
    pytest.importorskip("triton")
    rows = _sparse_rows("cuda")
    for r in rows:
        tol = 1e-5 if r["dtype"] == "float32" else 1e-2
        assert r["kept_equal"] and r["err"] < tol and r["law_err"] < tol and r["sync_zero"], r
    check_value_sum_rows(_value_sum_steps("cuda"))


def _prompt_mask(B, P, pads, window=None):
    i = torch.arange(P)[:, None]
    j = torch.arange(P)[None, :]
    rows = []
    for pad in pads:
        m = (j <= i) & (j >= pad)
        if window is not None:
            m &= j > i - window
        rows.append(m)
    return torch.stack(rows)[:, None]  # [B, 1, P, P]


@pytest.mark.parametrize("cache", ["full", "window", "window-only"])
@pytest.mark.parametrize("make", [lambda: Sift(tau=0.6, warmup=3, warmup_source="decode", vmc=True),
                                  lambda: Sift(tau=0.6, warmup=3, warmup_source="decode", vmc=True, normalizer="anchored",
                                               anchor_first=1, anchor_last=2),
                                  lambda: Oracle(tau=0.6, vmc=True)], ids=["sift", "sift-anchored", "oracle"])
def test_running_value_sum_is_the_sum_of_the_valid_rows_after_the_prompt_and_every_step(make, cache):
    """Left-padded rows; exact (warmup) steps count too. A sliding-window layer (window 5) on a cache that keeps
    every position (the fast loop's: the row leaving the window is subtracted) or only the window's rows
    (transformers' sliding cache, whose positions shift every step: the window is summed afresh)."""
    method = make()
    window = None if cache == "full" else 5
    B, Hq, Hkv, L, P, D = 3, 4, 2, 30, 9, 16
    pads = torch.tensor([0, 2, 6], dtype=torch.int32)
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(B, Hq, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    state = method.new_state(B, Hq, torch.device("cpu"))
    valid = _prompt_mask(B, P, pads.tolist(), window)
    chunk = PromptChunk(q[:, :, :P], k[:, :, :P], valid, valid[:, 0, -1].sum(-1), 0.25, value=v[:, :, :P])
    assert method.observes_prompt()
    method.observe_prompt(chunk, state)
    method.finish_prefill(state)

    def starts_at(n):
        return pads if window is None else torch.maximum(pads, torch.tensor(n - window, dtype=torch.int32))

    torch.testing.assert_close(state.value_sum, value_sums(v, torch.full((B,), P), starts_at(P)), rtol=1e-5, atol=1e-5)
    kernels = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=L, head_dim=D, dtype=torch.float32,
                                 device="cpu", scale=0.25, backend="torch")
    for step in range(L - P):
        n = P + step + 1
        # The cache's positions: all of them, or the window's rows only (position 0 is the window's first row).
        lo, hi = (max(0, n - window), n) if cache == "window-only" else (0, L)
        keys = KeyRange(torch.full((B,), n - lo, dtype=torch.int32), starts_at(n) - lo, window=window)
        phase = method.decode_phase(step)
        method.decode_step(q[:, :, n - 1], k[:, :, lo:hi], v[:, :, lo:hi], keys, state, phase, kernels)
        if method.decode_phase(step + 1) != phase:
            method.end_decode_phase(phase, [state])
        torch.testing.assert_close(state.value_sum, value_sums(v, torch.full((B,), n), starts_at(n)), rtol=1e-5, atol=1e-5)
    beams = method.reorder_state(state, torch.tensor([2, 2, 0]))
    assert torch.equal(beams.value_sum, state.value_sum[[2, 2, 0]])


def test_a_state_without_a_prompt_sums_the_cache_on_its_first_step():
    """The scratch state a plan compiles its kernels on has seen no prompt: its first step sums the valid rows."""
    method = Oracle(tau=0.5, vmc=True)
    q, k, v, sl, st = range_case(2, 4, 2, 23, 16, torch.float32, torch.Generator().manual_seed(2))
    state = method.new_state(2, 4, torch.device("cpu"))
    kernels = DecodeKernels.plan(batch=2, q_heads=4, kv_heads=2, max_len=23, head_dim=16, dtype=torch.float32,
                                 device="cpu", scale=0.25, backend="torch")
    method.decode_step(q, k, v, KeyRange(sl, st), state, "sparse", kernels)
    torch.testing.assert_close(state.value_sum, value_sums(v, sl, st), rtol=1e-5, atol=1e-5)
    assert method.new_state(2, 4, torch.device("cpu")) is not None and Oracle().new_state(2, 4, torch.device("cpu")) is None


# ----------------------------------------------------------------------------- whole generations


@pytest.mark.parametrize("method", [Sift(tau=0.6, warmup=5, vmc=True),
                                    Sift(tau=0.7, warmup=5, vmc=True, normalizer="anchored", anchor_first=2, anchor_last=3),
                                    Oracle(tau=0.6, vmc=True), TopK(k=0.3, renormalize=False, vmc=True)],
                         ids=["sift", "sift-anchored", "oracle", "topk"])
def test_fast_loop_with_vmc_generates_as_the_reference_path(method):
    """Left-padded batch, Sift's warmup ending mid-generation; the reference path is transformers' generate with
    the row-wise ``select`` and ``attention.method_attention``'s compensation of the weights."""
    from test_generation import NEW, _left_padded_batch, _model, _reference

    model = _model(tiny_llama)
    ids, mask = _left_padded_batch()
    ref_seq, ref_logp, ref_stats = _reference(model, ids, mask, method)
    res = generate_scores(model, ids, mask, method, NEW)
    assert res.fast and torch.equal(res.sequences, ref_seq)
    assert (res.scores.log_softmax(-1) - ref_logp).abs().max().item() <= 1e-4
    assert res.stats.realized_sparsity() == pytest.approx(ref_stats.realized_sparsity(), abs=1e-12)
    plain = generate_scores(model, ids, mask, dataclasses.replace(method, vmc=False), NEW)
    assert (plain.scores.log_softmax(-1) - ref_logp).abs().max().item() > 1e-2  # compensation moves the logits


def generate_scores(model, ids, mask, method, new, **kwargs):
    from siftattention.generation import generate

    return generate(model, ids, mask, method, max_new_tokens=new, pad_token_id=0, eos_token_id=-1, output_scores=True,
                    **kwargs)


def test_vmc_on_sliding_windows_through_both_decode_loops():
    """A sliding-window model (Mistral, window 7 < the prompt): the fast loop (one prompt chunk or several) and
    transformers' generate with the kernels, whose sliding cache drops the rows that leave the window."""
    from siftattention import apply
    from test_generation import _left_padded_batch, _mistral, _model, _reference

    model = _model(_mistral)
    ids, mask = _left_padded_batch(seed=4)
    method = Sift(tau=0.6, warmup=4, vmc=True)
    ref_seq, ref_logp, _ = _reference(model, ids, mask, method, new=12)
    for chunk in (None, 5):
        res = generate_scores(model, ids, mask, method, 12, prefill_chunk=chunk)
        assert res.fast and torch.equal(res.sequences, ref_seq)
        assert (res.scores.log_softmax(-1) - ref_logp).abs().max().item() <= 1e-4
    with apply(model, method), torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref_seq)
    assert (torch.stack(out.scores, 1).log_softmax(-1) - ref_logp).abs().max().item() <= 1e-4


if __name__ == "__main__" and "--triton-worker" in sys.argv:
    print(json.dumps(_triton_worker()))
