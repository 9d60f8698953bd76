"""The key-bound sift step in the fused C++ CPU kernel (kernels/cpu/keybound_decode.cpp): its kept sets
equal the float64 rule's outside epsilon, its output, kept counts and candidates equal the torch
reference's, on odd shapes and extreme keys in both forms of the int8 copy; the planned step runs it on
the CPU (the fast loop through it: ``test_keybound.test_sift_keybound_generates_through_the_fast_loop``)."""

from __future__ import annotations

import pytest
import torch
from test_kernels import range_case
from test_keybound import check_step, extreme_keys, planted_eta, scores64, seed, valid_of

from siftattention.kernels import cpu_decode
from siftattention.kernels.arguments import PowerLawThreshold
from siftattention.kernels.keybound import Int8Keys, channel_ranges, keybound_step_torch, quantize_keys

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="the fused CPU kernel cannot be built here")

FORMS = ["row", "channel"]


def int8_copy(k: torch.Tensor, form: str, prompt: int) -> Int8Keys:
    """The copy of ``k`` in ``form``; per channel with the ranges of the first ``prompt`` keys (the rest as decode keys)."""
    return quantize_keys(k, channel_ranges(k[:, :, :prompt])) if form == "channel" else quantize_keys(k)


def checked(q, k, v, keys, eta, sl, st, renorm) -> dict:
    """The C++ step against float64 (``check_step``; the output within float32 rounding of scores as large as the
    largest, as the exact step's) and against the torch reference: kept counts and candidates equal, the output
    within float32 rounding of the reference's."""
    D = q.shape[-1]
    tol = 1e-5 + float(scores64(q, k, D**-0.5).abs().max()) * 2.0**-20
    out, kept, cand = cpu_decode.keybound_decode_cpu(q, k, v, keys, eta, D**-0.5, sl, renorm, st)
    r = keybound_step_torch(q, k, v, keys, eta, D**-0.5, sl, renorm, st)
    res = check_step(q, k, v, eta, sl, st, renorm, out, kept, r["epsilon"], tol)
    assert res["kept_ok"] and res["err"] <= res["err_bound"], res
    assert torch.equal(kept, r["kept"]), (kept, r["kept"])
    assert torch.equal(cand, r["candidates"].sum(-1, dtype=torch.int32)), (cand, r["candidates"].sum(-1))
    scale = r["out"].norm(dim=-1, keepdim=True).clamp_min(1e-30)
    assert float(((out - r["out"]) / scale).abs().max()) <= 2 * tol
    assert out.dtype == torch.float32 and kept.dtype == cand.dtype == torch.int32
    return dict(res, out=out, kept=kept, cand=cand)


# B, Hq, Hkv, S, D, keys: GQA 1/2/4/6/8, head_dim 64/128/256, lengths off every block (32 rows, 8 channels).
CASES = [
    (3, 4, 4, 37, 64, "random"),
    (2, 8, 4, 101, 128, "huge_channel"),
    (2, 8, 2, 129, 256, "zeros"),
    (2, 12, 2, 1031, 128, "random"),
    (2, 6, 1, 67, 64, "huge_channel"),
    (1, 8, 1, 257, 128, "zeros"),
    (2, 24, 2, 45, 64, "mixed"),
]


@pytest.mark.parametrize("B,Hq,Hkv,S,D,kind", CASES)
@pytest.mark.parametrize("form", FORMS)
def test_cpu_keybound_matches_float64_and_reference(B, Hq, Hkv, S, D, kind, form):
    """Ragged [start, seq_len) rows (a full row, a one-key row), planted thresholds with eta 0 and 1 in some heads,
    with and without renormalisation; per channel with an offset channel and ranges from the first third."""
    for renorm in (False, True):
        gen = torch.Generator().manual_seed(seed("cpu", B, Hq, S, D, kind, form, renorm))
        q, _, v, sl, st = range_case(B, Hq, Hkv, S, D, torch.float32, gen)
        k = extreme_keys(kind, B, Hkv, S, D, torch.float32, gen)
        if form == "channel":
            k[..., 2] += 8.0
        keys = int8_copy(k, form, max(1, S // 3))
        eta = planted_eta(scores64(q, k, D**-0.5), valid_of(B, S, sl, st), gen)
        eta[0, 1 % Hq] = 0.0  # every key
        eta[-1, -1] = 1.0  # the maximum only
        res = checked(q, k, v, keys, eta, sl, st, renorm)
        if res["max_eps"] < 0.25:  # thresholds planted in log-gaps of 0.5
            assert res["kept_equal"], res


@pytest.mark.parametrize("form", FORMS)
def test_cpu_keybound_edges(form):
    """eta <= 0 keeps every valid key, eta >= 1 and NaN the first maximum; a row of equal (zero) keys keeps its first
    key at a threshold above its uniform probability; an empty row gives zeros."""
    gen = torch.Generator().manual_seed(seed("edges", form))
    B, Hq, Hkv, S, D = 4, 8, 2, 70, 64
    q = torch.randn(B, Hq, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    k[2] = 0.0  # every score 0: ties everywhere
    sl = torch.tensor([S, 50, S, 9], dtype=torch.int32)
    st = torch.tensor([0, 3, 0, 9], dtype=torch.int32)  # row 3 has no valid key
    eta = torch.tensor([-1.0, 0.0, 1.0, 2.5, float("nan"), 0.5, 1e-30, 0.999]).repeat(B, 1)
    eta[2] = torch.tensor([1 / 70 * 1.01, 1 / 70 * 0.99] * 4)  # above and below the uniform probability
    keys = int8_copy(k, form, S)
    out, kept, cand = cpu_decode.keybound_decode_cpu(q, k, v, keys, eta, D**-0.5, sl, False, st)
    r = keybound_step_torch(q, k, v, keys, eta, D**-0.5, sl, False, st)
    assert torch.equal(kept, r["kept"]) and torch.equal(cand, r["candidates"].sum(-1, dtype=torch.int32))
    n = (sl - st)[:2, None]
    assert torch.equal(kept[:2, :2], n.expand(2, 2).int()) and bool((kept[:2, 2:5] == 1).all())
    assert kept[2].tolist() == [1, 70] * 4
    torch.testing.assert_close(out[2, ::2], v[2, :, 0].repeat_interleave(4, 0)[::2] / 70)  # p = 1/70 on key 0
    assert bool((out[3] == 0).all() and (kept[3] == 0).all() and (cand[3] == 0).all())
    torch.testing.assert_close(out, r["out"].float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_cpu_keybound_reads_strided_caches(form):
    """The fast loop's layout: caches and copy longer than the valid keys (seq_lens), and a cache stored
    [B, S, Hkv, D] and transposed, give the bits of contiguous inputs."""
    gen = torch.Generator().manual_seed(seed("strided", form))
    B, Hq, Hkv, S, D, max_len = 3, 12, 2, 203, 128, 256
    big_k = torch.randn(B, max_len, Hkv, D, generator=gen).transpose(1, 2)
    big_v = torch.randn(B, Hkv, max_len, D, generator=gen)
    q = torch.randn(B, Hq, D, generator=gen) * 2
    sl = torch.tensor([S, 150, 99], dtype=torch.int32)
    st = torch.tensor([0, 20, 98], dtype=torch.int32)
    keys = int8_copy(big_k, form, 64)
    eta = torch.full((B, Hq), 0.01)
    strided = cpu_decode.keybound_decode_cpu(q, big_k[:, :, :S], big_v[:, :, :S], keys, eta, D**-0.5, sl, False, st)
    short = Int8Keys(keys.values[:, :, :S].contiguous(), keys.scales[:, :, :S].contiguous(), keys.channel, keys.offset)
    dense = cpu_decode.keybound_decode_cpu(q, big_k[:, :, :S].contiguous(), big_v[:, :, :S].contiguous(), short, eta,
                                           D**-0.5, sl, False, st)
    for a, b in zip(strided, dense):
        assert torch.equal(a, b)
    checked(q, big_k[:, :, :S], big_v[:, :, :S], short, eta, sl, st, False)


@pytest.mark.parametrize("form", FORMS)
def test_planned_cpu_step_runs_the_fused_kernel(monkeypatch, form):
    """``DecodeKernels.sparse_keybound`` on the "cpu" backend runs the C++ step (a power-law threshold too) and
    ``keybound_candidates`` reports its candidate rows; the torch backend still runs the reference."""
    from siftattention.kernels import DecodeKernels

    gen = torch.Generator().manual_seed(seed("plan", form))
    B, Hq, Hkv, S, D = 2, 12, 2, 300, 128
    q = torch.randn(B, Hq, D, generator=gen) * 2
    k, v = torch.randn(B, Hkv, S, D, generator=gen), torch.randn(B, Hkv, S, D, generator=gen)
    sl, st = torch.tensor([S, 200], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    keys = int8_copy(k, form, 100)
    law = PowerLawThreshold(torch.full((B, Hq), -1.0), torch.full((B, Hq), 0.5), (sl - st).float().log())
    calls = []
    real = cpu_decode.keybound_decode_cpu
    monkeypatch.setattr(cpu_decode, "keybound_decode_cpu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    plans = {name: DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=torch.float32,
                                      device="cpu", scale=D**-0.5, backend=name) for name in ("cpu", "torch")}
    res = {name: plan.sparse_keybound(q, k, v, keys, law, sl, st) for name, plan in plans.items()}
    assert len(calls) == 1 and plans["cpu"].backend == "cpu"
    assert torch.equal(res["cpu"][1], res["torch"][1])
    torch.testing.assert_close(res["cpu"][0], res["torch"][0], rtol=1e-5, atol=1e-6)
    assert torch.equal(plans["cpu"].keybound_candidates(), plans["torch"].keybound_candidates())
    direct = real(q, k, v, keys, law.eta(), D**-0.5, sl, False, st)
    assert torch.equal(direct[0], res["cpu"][0]) and torch.equal(direct[2], plans["cpu"].keybound_candidates())


def test_build_name_follows_every_source(monkeypatch, tmp_path):
    """A change to any C++ source or header of the kernel gives another build (its name hashes them all)."""
    names = {cpu_decode.build_name()}
    for path in cpu_decode.SOURCES + cpu_decode.HEADERS:
        changed = tmp_path / path.name
        changed.write_bytes(path.read_bytes() + b"\n// changed\n")
        with monkeypatch.context() as mp:
            for attr in ("SOURCES", "HEADERS"):
                mp.setattr(cpu_decode, attr, [changed if p == path else p for p in getattr(cpu_decode, attr)])
            names.add(cpu_decode.build_name())
    assert len(names) == 1 + len(cpu_decode.SOURCES) + len(cpu_decode.HEADERS)
