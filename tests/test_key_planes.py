"""Keys as two byte planes (kernels/key_planes.py): the high plane's bound is sound for the stored keys, the
stored keys are within the stated distance of the keys quantised (and equal to bfloat16 / float16 keys in
their large elements), and the step keeps the float64 rule's keys on the stored keys outside epsilon."""

from __future__ import annotations

import pytest
import torch
from test_keybound import (PROMPT_CASES, STEP_CASES, beyond_prompt, check_step, checked_slack, extreme_keys,
                           fuzzed_query, planted_eta, scores64, seed, valid_of)
from test_kernels import range_case

from siftattention.kernels.key_planes import (KeyPlanes, grid_of, key_bytes_per_row, keybound_step_planes,
                                              quantize_planes, reconstruct_keys, reconstruction_bound)
from siftattention.kernels.keybound import channel_ranges, key_rows, keybound_bytes, keybound_step_torch

KINDS = PROMPT_CASES + ["one_hot"]


def fuzzed_keys(kind: str, B: int, Hkv: int, S: int, D: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``test_keybound.extreme_keys``, and rows with one nonzero channel (of any size) or none."""
    if kind != "one_hot":
        return extreme_keys(kind, B, Hkv, S, D, dtype, gen)
    k = torch.zeros(B, Hkv, S, D)
    idx = torch.randint(0, D, (B, Hkv, S, 1), generator=gen)
    size = torch.randn(B, Hkv, S, 1, generator=gen) * torch.exp(torch.randn(B, Hkv, S, 1, generator=gen) * 4)
    k.scatter_(-1, idx, size)
    k[:, :, ::4] = 0.0
    big = torch.finfo(dtype).max
    return k.clamp(-big, big).to(dtype)


def check_planes(k: torch.Tensor, planes: KeyPlanes, channel: bool) -> torch.Tensor:
    """The planes' ranges and the stored keys' distance to ``k``; returns the stored keys in float64."""
    assert planes.high.dtype == planes.low.dtype == torch.int8 and planes.scales.dtype == torch.float32
    assert int(planes.high.abs().max()) <= 127 and int(planes.low.min()) >= -128
    g = grid_of(planes.scales)
    m = planes.scales.double() / g
    assert bool((m == torch.round(m)).all() and (m >= 129).all() and (m <= 256).all())
    assert bool((planes.low.double().abs() <= m[..., None] / 2).all())
    _, least, _, _ = key_rows(k, planes.channel is not None and (planes.channel, planes.offset))
    assert bool((planes.scales.double() >= least.float().double()).all())
    assert bool((planes.scales.double() <= least.float().double() * (1 + 2.0**-7)).all())
    stored = reconstruct_keys(planes, torch.float64)
    assert bool(torch.isfinite(stored).all())
    err = (stored - k.double()).abs()
    assert bool((err <= reconstruction_bound(planes)).all()), float((err / reconstruction_bound(planes)).max())
    if not channel and k.dtype in (torch.bfloat16, torch.float16):  # large elements are stored exactly
        bits = 7 if k.dtype == torch.bfloat16 else 10
        large = k.double().abs() >= g[..., None] * 2**bits
        assert bool((err[large] == 0).all())
        assert bool((reconstruct_keys(planes) == stored).all())  # float32 reconstruction is exact per row
    return stored


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channel", [False, True])
def test_bound_is_sound_for_stored_keys(dtype, channel):
    """s_hat - e <= s <= s_hat + e for the float64 score of every stored key (the high plane's bound), and the
    stored keys within ``reconstruction_bound`` of the keys; per channel on prompt and decode keys."""
    worst = 0.0
    for i, kind in enumerate(KINDS):
        Hq, Hkv = [(4, 4), (4, 2), (8, 2), (6, 1), (8, 1)][i % 5]
        D = (64, 128, 256)[i % 3]
        gen = torch.Generator().manual_seed(seed("planes", D, str(dtype), kind, channel))
        k = fuzzed_keys(kind, 2, Hkv, 29, D, dtype, gen)
        cases = [(k, quantize_planes(k, channel or None))]
        if channel:
            decode = beyond_prompt(fuzzed_keys(kind, 2, Hkv, 23, D, dtype, gen), dtype, gen)
            cases.append((decode, quantize_planes(decode, channel_ranges(k))))
        for keys, planes in cases:
            stored = check_planes(keys, planes, channel)
            for q_size in (1.0, 300.0):
                q = fuzzed_query(kind, Hq, D, q_size, dtype, gen)
                worst = max(worst, checked_slack(q, stored, planes.high_keys(), kind))
    assert worst < 1.0


def test_planes_edges():
    k = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    k[0, 0, 1, 2] = 3.0e38  # near bfloat16's largest
    k[0, 0, 2] = -torch.finfo(torch.bfloat16).tiny
    k[0, 0, 3, 5] = 1.0  # one-hot: M = 1 / 127, g = 2^-14, m = 130 (c = 130 g), w = 16384 = 126 m + 4
    p = quantize_planes(k)
    stored = reconstruct_keys(p, torch.float64)
    assert bool((p.high[0, 0, 0] == 0).all() and (p.low[0, 0, 0] == 0).all())  # zero row: least scale, zeros
    assert float(p.scales[0, 0, 0]) >= 2.0**-126
    assert torch.equal(stored, k.double())  # every element here is stored exactly
    assert float(grid_of(p.scales[0, 0, 3])) == 2.0**-14 and float(p.scales[0, 0, 3]) == 130 * 2.0**-14
    assert int(p.high[0, 0, 3, 5]) == 126 and int(p.low[0, 0, 3, 5]) == 4
    assert p.nbytes() == 2 * 4 * 8 + 4 * 4 and p.high_keys().nbytes() == 4 * 8 + 4 * 4
    assert key_bytes_per_row(128) == dict(dense=512, int8_copy=644, planes=516)
    b = keybound_bytes(2, 4, 1000, 128, 2, candidate_rows=800, v_rows=400)
    c = keybound_bytes(2, 4, 1000, 128, 2, candidate_rows=800, v_rows=400, planes=True)
    assert c["candidate_k"] == 800 * 128 and c["total"] == b["total"] - 800 * 128 and c["dense"] == b["dense"]


@pytest.mark.parametrize("B,Hq,Hkv,S,D", STEP_CASES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_step_matches_float64_on_stored_keys(B, Hq, Hkv, S, D, per_channel):
    """Kept counts as the float64 rule's on the stored keys outside epsilon, the output as the exact step's on
    them, and the same candidates as ``keybound_step_torch`` with the high plane as the int8 copy."""
    gen = torch.Generator().manual_seed(seed("planes_step", B, Hq, Hkv, S, D, per_channel))
    for dtype, renorm in ((torch.bfloat16, False), (torch.float16, True), (torch.float32, False)):
        q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, dtype, gen)
        if per_channel:
            k[..., 2] += 8.0
            planes = quantize_planes(k, channel_ranges(k[:, :, : S // 3]))
        else:
            planes = quantize_planes(k)
        stored = reconstruct_keys(planes, torch.float64)
        valid = valid_of(B, S, sl, st)
        eta = planted_eta(scores64(q, stored, D**-0.5), valid, gen)
        eta[0, 1 % Hq] = 0.0
        eta[-1, -1] = 1.0
        r = keybound_step_planes(q, planes, v, eta, D**-0.5, sl, renorm, st)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        res = check_step(q, stored, v, eta, sl, st, renorm, r["out"], r["kept"], r["epsilon"], tol)
        assert res["kept_ok"] and res["err"] <= res["err_bound"], res
        if res["max_eps"] < 0.25:
            assert res["kept_equal"], res
        same = keybound_step_torch(q, stored.float(), v, planes.high_keys(), eta, D**-0.5, sl, renorm, st)
        assert torch.equal(same["candidates"], r["candidates"]) and torch.equal(same["kept"], r["kept"])
        assert bool((r["candidates"] & ~valid[:, None, :]).sum() == 0)
