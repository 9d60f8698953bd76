"""``Sift(gqa="shared")``: one kept set per KV group, against a float64 reference written here.

The rule: m_i = max over the group's query heads of p_{h,i}; a key is kept for every head of the group when
m_i > theta_g (plus each head's own first maximum); the calibration's quantile is the tau-quantile of m over
the valid keys. Checked on the torch and CPU backends, on Triton under its interpreter (this file run as a
script, ``--triton-worker``), through the prompt calibration, and end to end: the fast loop's tokens against
transformers' generate on the row-wise reference path.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import dtype_tolerance, run_interpreted_parts, tiny_llama
from siftattention.kernels import DecodeKernels
from siftattention.methods import Sift, SpecError, parse_method
from siftattention.methods.base import PromptChunk

# B, Hq, Hkv, S, D: GQA 1, 2, 4, 6 and 8, head dims 64 and 128, lengths that are no multiple of a block
CASES = [(3, 4, 4, 37, 64), (2, 4, 2, 53, 128), (3, 8, 2, 67, 64), (2, 12, 2, 45, 128), (2, 8, 1, 41, 64)]
TAU = 0.8


def make_inputs(B, Hq, Hkv, S, D, dtype, seed):
    """Peaky queries, ragged valid ranges [start, seq_len): a full row, a one-key row, random rows."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, D, generator=g) * 2.0).to(getattr(torch, dtype))
    k = torch.randn(B, Hkv, S, D, generator=g).to(q.dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(q.dtype)
    seq_lens = torch.randint(2, S + 1, (B,), generator=g)
    starts = (torch.rand(B, generator=g) * (seq_lens - 1)).long()
    seq_lens[0], starts[0] = S, 0
    starts[1] = seq_lens[1] - 1
    return q, k, v, seq_lens.int(), starts.int()


def group_probs(q, k, scale, seq_lens, starts):
    """float64 per (b, KV head g): p [G, n] over the row's valid keys, and their group max [n]."""
    B, Hq, _ = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = {}
    for b in range(B):
        lo, hi = int(starts[b]), int(seq_lens[b])
        for g in range(Hkv):
            s = (q[b, g * G:(g + 1) * G].double() @ k[b, g, lo:hi].double().t()) * scale  # [G, n]
            p = torch.softmax(s, -1)
            out[b, g] = (s, p, p.amax(0))
    return out


def group_thresholds(q, k, scale, seq_lens, starts, seed):
    """theta [B, Hq], equal over each group's heads: midway between two sorted group maxima, or an edge value."""
    B, Hq, _ = q.shape
    G = Hq // k.shape[1]
    gen = torch.Generator().manual_seed(seed)
    edges = (0.0, -1.0, 1.0, float("nan"))
    eta = torch.zeros(B, Hq)
    for (b, g), (_, _, top) in group_probs(q, k, scale, seq_lens, starts).items():
        i = b * k.shape[1] + g
        if i % 3 == 2:
            value = edges[(i // 3) % len(edges)]
        else:
            srt = torch.sort(top).values
            r = int(torch.randint(0, max(1, srt.numel() - 1), (1,), generator=gen))
            value = float((srt[r] + srt[min(r + 1, srt.numel() - 1)]) / 2) if srt.numel() > 1 else 0.5
        eta[b, g * G:(g + 1) * G] = value
    return eta


def reference(q, k, v, eta, scale, seq_lens, starts, value_sum=None):
    """float64 out [B, Hq, D] and kept [B, Hq] of the shared rule (module docstring), value-mean compensated
    where a value sum is given (the sum of the valid value rows, divided by their count)."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    kept = torch.zeros(B, Hq, dtype=torch.int32)
    for (b, g), (s, p, top) in group_probs(q, k, scale, seq_lens, starts).items():
        lo, hi = int(starts[b]), int(seq_lens[b])
        theta = float(eta[b, g * G])
        group = torch.ones_like(top, dtype=torch.bool) if theta <= 0 else top > theta  # NaN: none
        for j in range(G):
            keep = group.clone()
            keep[int(torch.argmax(s[j]))] = True
            h = g * G + j
            out[b, h] = (p[j] * keep) @ v[b, g, lo:hi].double()
            if value_sum is not None:
                out[b, h] += (1 - (p[j] * keep).sum()) * value_sum[b, g].double() / (hi - lo)
            kept[b, h] = int(keep.sum())
    return out, kept


def reference_quantile(q, k, scale, seq_lens, starts, tau):
    """[B, Hq] float64: torch.quantile of each group's max probability over its valid keys."""
    B, Hq, _ = q.shape
    G = Hq // k.shape[1]
    theta = torch.zeros(B, Hq, dtype=torch.float64)
    for (b, g), (_, _, top) in group_probs(q, k, scale, seq_lens, starts).items():
        theta[b, g * G:(g + 1) * G] = torch.quantile(top, tau)
    return theta


def value_sums(v, seq_lens, starts):
    pos = torch.arange(v.shape[2])
    valid = (pos >= starts[:, None].long()) & (pos < seq_lens[:, None].long())
    return (v.double() * valid[:, None, :, None]).sum(2).float()


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def backends():
    from siftattention.kernels import cpu_decode

    return ["torch", "cpu"] if cpu_decode.available() else ["torch"]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("case", range(len(CASES)))
def test_shared_step_keeps_the_group_set(case, backend):
    B, Hq, Hkv, S, D = CASES[case]
    q, k, v, sl, st = make_inputs(B, Hq, Hkv, S, D, "float32", 100 + case)
    scale = D**-0.5
    eta = group_thresholds(q, k, scale, sl, st, case)
    vs = value_sums(v, sl, st)
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=q.dtype, device="cpu",
                              scale=scale, backend=backend)
    for value_sum in (None, vs):
        out, kept = kern.sparse(q, k, v, eta, sl, st, value_sum, shared=True)
        ref, ref_kept = reference(q, k, v, eta, scale, sl, st, value_sum)
        assert torch.equal(kept, ref_kept) and rel(out, ref) < 1e-5
    out, kept, theta = kern.sparse_quantile(q, k, v, eta, TAU, sl, st, vs, shared=True)
    ref_theta = reference_quantile(q, k, scale, sl, st, TAU)
    assert torch.equal(kept, ref_kept) and rel(theta, ref_theta) < 1e-5
    _, theta = kern.warmup(q, k, v, TAU, sl, st, shared=True)
    assert rel(theta, ref_theta) < 1e-5
    # Every head of a group keeps the group's set, and at most its own maximum besides.
    spread = kept.view(B, Hkv, -1)
    assert ((spread.amax(-1) - spread.amin(-1)) <= 1).all()


def test_one_query_head_a_group_shares_nothing():
    """GQA ratio 1: the group is the head, so "shared" is "head" bit for bit."""
    B, Hq, Hkv, S, D = CASES[0]
    q, k, v, sl, st = make_inputs(B, Hq, Hkv, S, D, "float32", 7)
    eta = group_thresholds(q, k, D**-0.5, sl, st, 7)
    kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=q.dtype, device="cpu",
                              scale=D**-0.5, backend="torch")
    for a, b in zip(kern.sparse_quantile(q, k, v, eta, TAU, sl, st, shared=True),
                    kern.sparse_quantile(q, k, v, eta, TAU, sl, st, shared=False)):
        assert torch.equal(a, b)


def test_prompt_calibration_measures_the_group_quantile():
    """The sampled prompt rows' quantiles, on both of observe_prompt's paths (the rows deferred to the decode
    kernels at the prompt's end, and each chunk's own softmax, which a score bias forces), equal
    torch.quantile of the float64 group max, and the fit gives every head of a group the same line."""
    B, Hq, Hkv, P, D = 2, 12, 2, 40, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, P, D, generator=g) * 2
    k = torch.randn(B, Hkv, P, D, generator=g)
    valid = torch.ones(P, P, dtype=torch.bool).tril()[None, None].expand(B, 1, P, P).clone()
    steps = torch.full((B,), P)
    for bias in (None, torch.zeros(B, Hq, P, P)):
        method = Sift(tau=TAU, gqa="shared")
        state = method.new_state(B, Hq, torch.device("cpu"))
        method.observe_prompt(PromptChunk(q, k, valid, steps, D**-0.5, bias=bias, value=k), state)
        method.finish_prefill(state)
        assert bool(state.prompt_recorded.any())
        for b in range(B):
            for slot in state.prompt_recorded[b].nonzero()[:, 0].tolist():
                row = int(state.prompt_targets[b, slot]) - 1
                expect = reference_quantile(q[b:b + 1, :, row], k[b:b + 1], D**-0.5, torch.tensor([row + 1]),
                                            torch.tensor([0]), TAU)[0]
                assert rel(state.prompt_thetas[b, :, slot], expect) < 1e-5, (bias is None, b, slot)
        fit = torch.stack([state.log_alpha, state.beta], -1).view(B, Hkv, Hq // Hkv, 2)
        assert bool(state.fitted.all()) and torch.equal(fit, fit[:, :, :1].expand_as(fit))


def test_teacher_forced_rows_keep_one_set_per_group():
    """The reference path (``select``): every head of a group keeps the keys whose group max passes the group's
    threshold, and its own maximum."""
    from siftattention.methods.base import Rows

    B, H, R, K, G = 2, 6, 5, 9, 3
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(B, H, R, K, generator=g) * 2, -1)
    valid = torch.ones(B, 1, R, K, dtype=torch.bool)
    steps = torch.full((B, R), K)
    rows = Rows(probs, valid, steps, torch.ones(B, R, dtype=torch.bool), steps[:, -1], groups=G)
    method = Sift(tau=TAU, warmup=2, gqa="shared", recalibrate_every=0)
    state = method.new_state(B, H, torch.device("cpu"))
    state.fitted[:] = True
    state.log_alpha[:] = torch.tensor(0.15).log()
    state.count[:] = 2
    keep = method.select(rows, state).keep
    top = probs.view(B, H // G, G, R, K).amax(2, keepdim=True).expand(B, H // G, G, R, K).reshape(B, H, R, K)
    expect = (top > 0.15).scatter(-1, probs.argmax(-1, keepdim=True), True)
    assert torch.equal(keep, expect)


# ----------------------------------------------------------------------------- the method, end to end


def _prompts():
    """Three left-padded prompts of 13 to 22 real tokens (each at least 12: calibrated on)."""
    from test_generation import _left_padded_batch

    ids, mask = _left_padded_batch(seed=2)
    ids = torch.cat([ids, torch.randint(3, 96, (3, 9), generator=torch.Generator().manual_seed(9))], 1)
    return ids, torch.cat([mask, torch.ones(3, 9, dtype=mask.dtype)], 1)


def _generate_both(model, method, new=10, backend="auto"):
    from test_generation import _reference

    from siftattention.generation import generate

    ids, mask = _prompts()
    ref_seq, ref_logp, stats = _reference(model, ids, mask, method, new=new)
    res = generate(model, ids, mask, method, max_new_tokens=new, pad_token_id=0, eos_token_id=-1, output_scores=True,
                   decode_backend=backend)
    return res, ref_seq, ref_logp, stats


@pytest.mark.parametrize("method", [
    Sift(tau=0.6, warmup=4, gqa="shared", recalibrate_every=3),
    Sift(tau=0.6, warmup=4, gqa="shared", vmc=True, recalibrate_every=4),
    Sift(tau=0.6, warmup=4, gqa="shared", warmup_source="decode"),
], ids=["prompt-recal", "vmc", "decode-warmup"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_fast_loop_tokens_equal_the_reference_path(method, backend):
    from test_generation import _model

    model = _model(lambda: tiny_llama(heads=8, kv_heads=2))
    res, ref_seq, ref_logp, stats = _generate_both(model, method, backend=backend)
    assert res.fast and torch.equal(res.sequences, ref_seq)
    assert (res.scores.log_softmax(-1) - ref_logp).abs().max().item() <= 1e-4
    # A group's heads keep one set, each besides it at most its own maximum: one key in S (S >= 13 here).
    sparsity, selected = stats.rows(post_warmup=True)
    assert bool(selected.any())
    per_group = sparsity.unflatten(2, (2, 4))  # [L, B, Hkv, G, rows]
    assert (per_group.amax(3) - per_group.amin(3)).max() <= 1 / 13 + 1e-6


def test_transformers_generate_with_the_kernels_equals_the_reference_path():
    """``apply`` + ``model.generate``: decode steps through the kernels (transformers' growing cache)."""
    from test_generation import _model

    from siftattention import apply

    model = _model(lambda: tiny_llama(heads=8, kv_heads=2))
    method = Sift(tau=0.6, warmup=4, gqa="shared", vmc=True, recalibrate_every=3)
    _, ref_seq, ref_logp, _ = _generate_both(model, method)
    ids, mask = _prompts()
    with apply(model, method), torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref_seq)
    assert (torch.stack(out.scores, 1).log_softmax(-1) - ref_logp).abs().max().item() <= 1e-4


def test_shared_equals_head_with_one_query_head_a_group():
    from test_generation import _model

    model = _model(lambda: tiny_llama(heads=4, kv_heads=4))
    shared, _, _, _ = _generate_both(model, Sift(tau=0.6, warmup=4, gqa="shared", recalibrate_every=3))
    head, _, _, _ = _generate_both(model, Sift(tau=0.6, warmup=4, recalibrate_every=3))
    assert torch.equal(shared.sequences, head.sequences) and torch.equal(shared.scores, head.scores)


# ----------------------------------------------------------------------------- specs and errors


def test_spec_round_trip_and_default_spec_unchanged():
    assert Sift().spec() == "sift:tau=0.875,warmup=128,renormalize=False,warmup_source=prompt"
    method = parse_method("sift:tau=0.875,vmc=true,gqa=shared")
    assert method == Sift(tau=0.875, vmc=True, gqa="shared") and method.shared
    assert method.spec().endswith(",vmc=True,gqa=shared") and parse_method(method.spec()) == method
    assert parse_method("sift:gqa=head") == Sift()


@pytest.mark.parametrize("kwargs, message", [
    (dict(gqa="group"), "gqa must be 'head' or 'shared', got 'group'"),
    (dict(gqa="shared", normalizer="anchored"), "gqa='shared' needs normalizer='exact'"),
    (dict(gqa="shared", keybound="row"), "gqa='shared' does not run the key-bound step"),
])
def test_bad_combinations_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        Sift(**kwargs)
    assert "\n" not in str(err.value)
    spec = "sift:" + ",".join(f"{key}={value}" for key, value in kwargs.items())
    with pytest.raises(SpecError, match=message):
        parse_method(spec)


# ----------------------------------------------------------------------------- Triton (interpreter)

# (case index into CASES, dtype, config overrides): the gather forms of the filter pass (the packed scan and
# the scan of [heads, keys] tiles), streaming, the separate combine launch, half precision.
TRITON_CASES = [
    (0, "float32", {}),
    (1, "float16", {"compact": False}),
    (2, "float32", {"compact_weights": False, "scan_packed": False}),
    (3, "bfloat16", {"fused_combine": False}),
    (4, "float32", {"warmup_dense": False}),
]


def _triton_worker(part: str) -> dict:
    """Runs under TRITON_INTERPRET=1 on the TRITON_CASES listed in ``part`` ("0,2,4"): the shared sparse step (eta and
    a power law, with and without value-mean compensation), its group quantile and the warmup's, against float64;
    and "head" on a ratio-1 case."""
    from siftattention.kernels.plan import PowerLawThreshold
    from siftattention.kernels.triton_decode import KernelConfig
    from test_kernels import SMALL

    rows = []
    for case, dt, over in (TRITON_CASES[int(i)] for i in part.split(",")):
        B, Hq, Hkv, S, D = CASES[case]
        q, k, v, sl, st = make_inputs(B, Hq, Hkv, S, D, dt, 200 + case)
        scale = D**-0.5
        eta = group_thresholds(q, k, scale, sl, st, case)
        vs = value_sums(v, sl, st)
        kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=q.dtype,
                                  device="cpu", scale=scale, backend="triton", config=KernelConfig(**{**SMALL, **over}))
        ref, ref_kept = reference(q, k, v, eta, scale, sl, st)
        ref_vmc, _ = reference(q, k, v, eta, scale, sl, st, vs)
        out, kept = kern.sparse(q, k, v, eta, sl, st, shared=True)
        law = PowerLawThreshold(eta.clamp(min=0).log(), torch.zeros(B, Hq), torch.zeros(B))
        out_law, kept_law = kern.sparse(q, k, v, law, sl, st, shared=True)
        out_vmc, kept_vmc, theta = kern.sparse_quantile(q, k, v, eta, TAU, sl, st, vs, shared=True)
        _, theta_warm = kern.warmup(q, k, v, TAU, sl, st, shared=True)
        ref_theta = reference_quantile(q, k, scale, sl, st, TAU)
        head = kern.sparse(q, k, v, eta, sl, st, shared=False)[0] if Hq == Hkv else None
        rows.append(dict(case=case, dtype=dt, err=rel(out, ref), law_err=rel(out_law, ref), vmc_err=rel(out_vmc, ref_vmc),
                         kept_equal=all(torch.equal(x, ref_kept) for x in (kept, kept_law, kept_vmc)),
                         theta_err=rel(theta, ref_theta), warm_theta_err=rel(theta_warm, ref_theta),
                         head_equal=head is not None and bool(torch.equal(head, out)), groups=Hq // Hkv,
                         sync_zero=bool((kern.workspace.sync == 0).all())))
    return {"rows": rows}


PARTS = ["0,2,4", "1,3"]  # TRITON_CASES in two runs side by side


@pytest.mark.interpreted(*[("--triton-worker", part) for part in PARTS])
def test_triton_shared_step_matches_float64():
    pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")
    rows = [r for p in run_interpreted_parts(__file__, "--triton-worker", PARTS) for r in p["rows"]]
    assert sorted(r["case"] for r in rows) == [case for case, _, _ in TRITON_CASES]
    for r in rows:
        tol = dtype_tolerance(r["dtype"])
        assert r["kept_equal"] and r["sync_zero"], r
        assert r["err"] < tol and r["law_err"] < tol and r["vmc_err"] < tol, r
        assert r["theta_err"] < tol and r["warm_theta_err"] < tol, r
        if r["groups"] == 1:  # a group of one head: the shared step is the per-head step
            assert r["head_equal"], r


if __name__ == "__main__" and "--triton-worker" in sys.argv:
    print(json.dumps(_triton_worker(sys.argv[sys.argv.index("--triton-worker") + 1])))
