"""The key-bound sift step (kernels/keybound.py): the int8 bound is sound, and the step keeps the
float64 rule's keys (except keys within its epsilon of the threshold) with the exact step's output.

The Triton kernels run under Triton's CPU interpreter in a subprocess (this file as a script),
so the interpreter setting never leaks into this process."""

from __future__ import annotations

import json
import math
import sys
import zlib

import pytest
import torch
from conftest import run_interpreted_parts
from test_kernels import range_case

from siftattention.kernels.keybound import (CHANNEL_FLOOR, MAX_HEAD_DIM, channel_ranges, keybound_bytes,
                                            keybound_step_torch, quantize_keys, score_bounds)


def seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def extreme_keys(kind: str, B: int, Hkv: int, S: int, D: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Key caches that stress the per-row scale: random, one huge channel, zero rows, the dtype's limits."""
    k = torch.randn(B, Hkv, S, D, generator=gen)
    big = torch.finfo(dtype).max
    if kind == "huge_channel":
        k[..., 3] = torch.sign(k[..., 3]) * min(big, 3e4)
    elif kind == "zeros":
        k[:, :, ::3] = 0.0
    elif kind == "limits":
        k = torch.sign(k) * 65504.0  # every channel at float16's largest finite value
        k[:, :, 1::2] *= torch.rand(B, Hkv, (S + 0) // 2, D, generator=gen) if S > 1 else 1
    elif kind == "tiny":
        k = k * torch.finfo(dtype).tiny * 4  # near the normal / subnormal edge of the dtype
    elif kind == "mixed":
        k = k * torch.exp(torch.randn(B, Hkv, S, 1, generator=gen) * 3)  # rows of very different size
    elif kind == "outliers":  # a few channels with a large offset (a key bias), others spread over decades
        k = k * torch.exp(torch.randn(D, generator=gen) * 2)
        k[..., [3, D - 5]] += 60.0
    elif kind == "offsets":  # every channel off zero by far more than it varies
        k = k + torch.randn(D, generator=gen) * 1e3
    return k.clamp(-big, big).to(dtype)


def scores64(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    s = torch.matmul(q.double().reshape(B, Hkv, Hq // Hkv, D), k.double().transpose(-1, -2))
    return s.reshape(B, Hq, -1) * scale


def fuzzed_query(kind: str, Hq: int, D: int, q_size: float, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    q = (torch.randn(2, Hq, D, generator=gen) * q_size).to(dtype)
    if kind == "limits" and dtype == torch.float16:
        q = q.clamp(-1, 1)  # q . k stays finite in float32
    return q


def checked_slack(q: torch.Tensor, k: torch.Tensor, keys, kind: str) -> float:
    """Assert s_hat - e <= s <= s_hat + e (float64 s of the stored key); the largest |s - s_hat| / e."""
    D = q.shape[-1]
    s_hat, e = score_bounds(q, keys, D**-0.5)
    s = scores64(q, k, D**-0.5)
    assert bool(torch.isfinite(s_hat).all() and torch.isfinite(e).all()), kind
    lo, hi = s_hat.double() - e.double(), s_hat.double() + e.double()
    assert bool((lo <= s).all() and (s <= hi).all()), (kind, float((s - hi).max()), float((lo - s).max()))
    return float(((s - s_hat.double()).abs() / e.double().clamp_min(1e-300)).max())


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bound_is_sound_on_fuzzed_keys(D, dtype):
    """s_hat - e <= s <= s_hat + e (float64 s of the stored key) on every key of every kind, GQA 1-8."""
    assert D <= MAX_HEAD_DIM
    worst = 0.0
    for (Hq, Hkv), kind in zip([(4, 4), (4, 2), (8, 2), (6, 1), (8, 1)] * 2,
                               ["random", "huge_channel", "zeros", "limits", "tiny", "mixed"] * 2):
        gen = torch.Generator().manual_seed(seed(D, str(dtype), Hq, Hkv, kind))
        k = extreme_keys(kind, 2, Hkv, 37, D, dtype, gen)
        keys = quantize_keys(k)
        for q_size in (1.0, 300.0):
            worst = max(worst, checked_slack(fuzzed_query(kind, Hq, D, q_size, dtype, gen), k, keys, kind))
    # And not loose: the slack used is at most the bound, which is 1/254 of the largest |s_hat| possible.
    assert worst < 1.0


PROMPT_CASES = ["random", "huge_channel", "zeros", "limits", "tiny", "mixed", "outliers", "offsets"]


def beyond_prompt(k: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Decode keys after the prompt's: channels far beyond the prompt's ranges, one it never used, zero rows."""
    k = k.float().clone()
    big = min(torch.finfo(dtype).max, 6e4)
    k[:, :, :, 1] *= 1e3
    k[:, :, ::2, 7] = torch.randn(k.shape[0], k.shape[1], (k.shape[2] + 1) // 2, generator=gen) * 50
    k[:, :, 1::5] = 0.0
    return k.clamp(-big, big).to(dtype)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_channel_bound_is_sound_on_fuzzed_keys(D, dtype):
    """Per-channel scales and offsets: s_hat - e <= s <= s_hat + e on the prompt's keys and on decode keys
    quantised with the prompt's, whatever their range (channel 0 of every prompt is zero)."""
    worst = 0.0
    for i, kind in enumerate(PROMPT_CASES):
        Hq, Hkv = [(4, 4), (4, 2), (8, 2), (6, 1), (8, 1)][i % 5]
        gen = torch.Generator().manual_seed(seed("channel", D, str(dtype), kind))
        prompt = extreme_keys(kind, 2, Hkv, 29, D, dtype, gen)
        prompt[..., 0] = 0.0
        decode = beyond_prompt(extreme_keys(kind, 2, Hkv, 23, D, dtype, gen), dtype, gen)
        decode[..., 0] = torch.randn(decode.shape[:-1], generator=gen).to(dtype)
        channel = channel_ranges(prompt)
        assert bool((channel[0] >= CHANNEL_FLOOR).all() and (channel[0] <= 1).all())
        for k, keys in ((prompt, quantize_keys(prompt, True)), (decode, quantize_keys(decode, channel))):
            assert torch.equal(keys.channel, channel[0]) and torch.equal(keys.offset, channel[1])
            for q_size in (1.0, 300.0):
                worst = max(worst, checked_slack(fuzzed_query(kind, Hq, D, q_size, dtype, gen), k, keys, kind))
    assert worst < 1.0


def test_channel_bound_is_tighter_on_outlier_channels():
    """Where a few channels carry a large offset the per-row bound grows with them; the per-channel one does not
    (nor does it for channels whose ranges differ by decades)."""
    gen = torch.Generator().manual_seed(11)
    D = 128
    k = extreme_keys("outliers", 1, 2, 512, D, torch.bfloat16, gen)
    q = torch.randn(1, 8, D, generator=gen).to(torch.bfloat16)
    _, e_row = score_bounds(q, quantize_keys(k), D**-0.5)
    _, e_chan = score_bounds(q, quantize_keys(k, True), D**-0.5)
    assert float(e_chan.mean()) < 0.3 * float(e_row.mean())


def test_quantize_keys_edges():
    k = torch.zeros(1, 1, 3, 8, dtype=torch.float16)
    k[0, 0, 1, 2] = 65504.0
    k[0, 0, 2] = -torch.finfo(torch.float16).tiny
    kq = quantize_keys(k)
    assert kq.values.dtype == torch.int8 and kq.scales.dtype == torch.float32
    assert int(kq.values[0, 0, 1, 2]) == 127 and int(kq.values.abs().max()) <= 127
    assert bool((kq.scales >= 2.0**-126).all())  # zero rows keep a normal scale
    assert bool((kq.values[0, 0, 0] == 0).all())
    assert kq.nbytes() == 3 * 8 + 3 * 4 and kq.channel is None
    kc = quantize_keys(k, True)
    assert kc.channel.shape == kc.offset.shape == (1, 1, 8) and float(kc.channel[0, 0, 2]) == 1.0
    assert float(kc.offset[0, 0, 2]) == 65504.0 / 2
    assert bool((kc.channel[0, 0, :2] == CHANNEL_FLOOR).all())  # near-constant channels keep the floor
    assert abs(int(kc.values[0, 0, 1, 2])) == 127 and int(kc.values.abs().max()) <= 127
    assert bool((kc.scales >= 2.0**-116).all())
    step = kc.scales.double()[..., None] * kc.channel.double()[:, :, None, :]
    err = (k.double() - kc.offset.double()[:, :, None, :] - step * kc.values.double()).abs()
    assert bool((err <= step / 2 * (1 + 2.0**-14)).all())
    assert kc.nbytes() == 3 * 8 + 3 * 4 + 2 * 8 * 4
    zero = quantize_keys(torch.zeros(2, 1, 4, 8), True)  # no range at all: every channel scale 1, offset 0
    assert bool((zero.channel == 1).all()) and bool((zero.offset == 0).all()) and bool((zero.values == 0).all())


# ----------------------------------------------------------------------------- the step against float64


def planted_eta(s64: torch.Tensor, valid: torch.Tensor, gen: torch.Generator, width: float = 0.5) -> torch.Tensor:
    """Per head: eta between two sorted probabilities at a random rank whose log-gap is at least ``width``
    (else the widest), so a threshold off by less than half of it decides every key as the float64 rule."""
    B, Hq, _ = s64.shape
    eta = torch.zeros(B, Hq)
    for b in range(B):
        for h in range(Hq):
            s = s64[b, h][valid[b]]
            if s.numel() < 2:
                eta[b, h] = 0.5
                continue
            srt = torch.sort(s).values
            gaps = srt[1:] - srt[:-1]
            ok = (gaps >= width).nonzero()[:, 0]
            r = int(ok[torch.randint(0, ok.numel(), (1,), generator=gen)]) if ok.numel() else int(gaps.argmax())
            mid = (srt[r] + srt[r + 1]) / 2
            eta[b, h] = float(torch.exp(mid - torch.logsumexp(s, 0)))
    return eta


def ref_keep64(s64: torch.Tensor, valid: torch.Tensor, eta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 rule: T = logsumexp + log(eta) (edges as the kernels), kept = s > T or the first maximum."""
    s = s64.masked_fill(~valid[:, None, :], float("-inf"))
    e = eta.double()
    log_eta = torch.where(e <= 0, float("-inf"), torch.log(e.clamp_min(1e-300)))
    log_eta = torch.where((e >= 1) | torch.isnan(e), float("inf"), log_eta)
    t = torch.logsumexp(s, -1) + log_eta
    t = torch.where(torch.isinf(log_eta), log_eta, t)
    keep = s > t[..., None]
    keep.scatter_(-1, s.argmax(-1, keepdim=True), True)
    return keep & valid[:, None, :], t


def out64(s64, valid, keep, v, renormalize):
    B, Hq, S = s64.shape
    Hkv, D = v.shape[1], v.shape[3]
    s = s64.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    w = torch.where(keep, p, 0.0)
    if renormalize:
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.matmul(w.reshape(B, Hkv, Hq // Hkv, S), v.double()).reshape(B, Hq, D)


def valid_of(B, S, seq_lens, starts):
    pos = torch.arange(S, device=seq_lens.device)[None, :]
    return (pos < seq_lens[:, None]) & (pos >= starts[:, None])


def check_step(q, k, v, eta, sl, st, renorm, out, kept, eps, tol) -> dict:
    """Kept counts against float64 outside epsilon, and the output against the exact step's."""
    B, Hq, D = q.shape
    S = k.shape[2]
    scale = D**-0.5
    valid = valid_of(B, S, sl, st)
    s64 = scores64(q, k, scale)
    keep, t = ref_keep64(s64, valid, eta)
    ref_kept = keep.sum(-1).int()
    near = (s64 - t[..., None]).abs() <= eps.double()[..., None] + 1e-4  # keys the epsilon may decide otherwise
    near &= valid[:, None, :]
    slack = near.sum(-1).int()
    kept_ok = bool(((kept - ref_kept).abs() <= slack).all())
    exact_rows = (kept == ref_kept) & (slack == 0)
    ref = out64(s64, valid, keep, v, renorm)
    scale_err = 0.0 if renorm else float(torch.expm1(eps.double()).max())
    err = float(((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30))[exact_rows].max()) \
        if bool(exact_rows.any()) else 0.0
    return dict(kept_ok=kept_ok, kept_equal=bool(torch.equal(kept, ref_kept)), err=err, err_bound=scale_err + tol,
                max_eps=float(eps.max()))


STEP_CASES = [  # B, Hq, Hkv, S, D
    (3, 4, 4, 37, 64),
    (2, 8, 2, 101, 128),
    (2, 12, 2, 67, 64),
    (1, 8, 1, 129, 256),
    (2, 6, 1, 53, 64),
]


@pytest.mark.parametrize("B,Hq,Hkv,S,D", STEP_CASES)
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
def test_torch_step_matches_float64(B, Hq, Hkv, S, D, renorm, per_channel):
    gen = torch.Generator().manual_seed(seed(B, Hq, Hkv, S, D, renorm) + per_channel)
    for dtype in (torch.float32, torch.float16):
        q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, dtype, gen)
        if per_channel:  # an offset channel; the ranges from the first third, the rest as decode keys
            k[..., 2] += 8.0
            keys = quantize_keys(k, channel_ranges(k[:, :, : S // 3]))
        else:
            keys = quantize_keys(k)
        valid = valid_of(B, S, sl, st)
        eta = planted_eta(scores64(q, k, D**-0.5), valid, gen)
        eta[0, 1 % Hq] = 0.0  # keep every key
        eta[-1, -1] = 1.0  # the maximum only
        r = keybound_step_torch(q, k, v, keys, eta, D**-0.5, sl, renorm, st)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        res = check_step(q, k, v, eta, sl, st, renorm, r["out"], r["kept"], r["epsilon"], tol)
        assert res["kept_ok"] and res["err"] <= res["err_bound"], res
        # The thresholds are planted in log-gaps of 0.5: kept sets are exact wherever epsilon < 0.25.
        if res["max_eps"] < 0.25:
            assert res["kept_equal"], res
        # Fewer key rows read than there are valid keys, none outside the valid range.
        cand = r["candidates"]
        assert bool((cand & ~valid[:, None, :]).sum() == 0)


def test_epsilon_is_small_and_candidates_few_on_peaky_rows():
    """At a typical sift threshold (~12% kept) most keys are never read in full and epsilon stays small."""
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, S, D = 2, 8, 2, 2048, 128
    q = (torch.randn(B, Hq, D, generator=gen) * 2.0).to(torch.float16)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(torch.float16)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(torch.float16)
    s64 = scores64(q, k, D**-0.5)
    p = torch.softmax(s64, -1)
    eta = torch.quantile(p, 0.875, dim=-1).float()
    r = keybound_step_torch(q, k, v, quantize_keys(k), eta, D**-0.5, None, False)
    frac = float(r["candidates"].double().mean())
    assert frac < 0.6, frac
    assert float(r["epsilon"].max()) < 0.05, r["epsilon"]
    res = check_step(q, k, v, eta, torch.full((B,), S), torch.zeros(B, dtype=torch.int32), False, r["out"], r["kept"],
                     r["epsilon"], 1e-2)
    assert res["kept_ok"] and res["err"] <= res["err_bound"], res


def test_keybound_bytes():
    b = keybound_bytes(2, 4, 1000, 128, 2, candidate_rows=800, v_rows=400)
    assert b["scan"] == 2 * 4 * 1000 * 132 and b["candidate_k"] == 800 * 256 and b["kept_v"] == 400 * 256
    assert b["dense"] == 2 * 2 * 4 * 1000 * 256 and math.isclose(b["vs_dense"], b["total"] / b["dense"])
    c = keybound_bytes(2, 4, 1000, 128, 2, candidate_rows=800, v_rows=400, per_channel=True)
    assert c["scan"] == b["scan"] + 2 * 4 * 128 * 8 and c["total"] == b["total"] + 2 * 4 * 128 * 8
    assert b["scores"] == 0 and b["total_with_scores"] == b["total"]
    g = keybound_bytes(2, 4, 1000, 128, 2, candidate_rows=800, v_rows=400, group=6)
    # Estimates written once and read twice for every key and head; the candidates' exact scores written over
    # them, their positions written and read back.
    assert g["scores"] == 3 * 2 * 4 * 1000 * 6 * 4 + 800 * (6 * 4 + 2 * 4)
    assert g["total"] == b["total"] and g["total_with_scores"] == g["total"] + g["scores"]


# ----------------------------------------------------------------------------- Triton, under the interpreter

#: Splits of up to 48 keys (blocks of 16) and peakier scores (q x 4, no keep-all head): a split's candidates,
#: a proper subset of its keys, span several of refine's tiles.
LONG_SPLITS = dict(min_split1=48, fill=0, waves1=0)
TRITON_CASES = [  # B, Hq, Hkv, S, D, dtype, power law, per-channel scales[, config]: GQA 1, 2, 4, 6, 8; odd lengths
    (2, 4, 4, 37, 64, "float32", False, False),
    (2, 8, 2, 53, 64, "float16", True, False),
    (2, 6, 1, 29, 64, "bfloat16", False, False),
    (1, 8, 2, 45, 128, "float16", False, False),
    (2, 8, 2, 41, 64, "float16", False, True),  # q' split into two bf16 terms
    (1, 6, 1, 33, 128, "bfloat16", True, True),
    (2, 4, 4, 23, 64, "float32", False, True),  # q' in float32
    (1, 4, 2, 75, 256, "float16", False, True, LONG_SPLITS),
    (1, 8, 1, 99, 128, "bfloat16", True, False, LONG_SPLITS),
]


def _triton_case(i: int) -> list[dict]:
    """The planned key-bound step on TRITON_CASES[i] against float64 and the torch reference."""
    from test_kernels import SMALL, power_law_for, workspace_at_rest

    from siftattention.kernels import DecodeKernels
    from siftattention.kernels.plan import PowerLawThreshold
    from siftattention.kernels.triton_decode import KernelConfig

    B, Hq, Hkv, S, D, dt, law, per_channel, *config = TRITON_CASES[i]
    dtype = getattr(torch, dt)
    gen = torch.Generator().manual_seed(seed("triton", i))
    q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, dtype, gen)
    if config:
        q = q * 4
    if per_channel:  # outlier channels; the ranges from the first half, the rest quantised as decode keys
        k[..., 1] += 6.0
        k[..., D - 3] *= 20.0
    eta = planted_eta(scores64(q, k, D**-0.5), valid_of(B, S, sl, st), gen)
    if not config:
        eta[0, 1] = 0.0  # every key
    eta[-1, -1] = 1.0  # the maximum only
    if i == 2:
        eta[0, 2] = float("nan")  # the maximum only
    keys = quantize_keys(k, channel_ranges(k[:, :, : S // 2])) if per_channel else quantize_keys(k)
    rows = []
    for renorm in (False, True):
        kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=dtype, device="cpu",
                                  scale=D**-0.5, renormalize=renorm, backend="triton",
                                  config=KernelConfig(**(SMALL | (config[0] if config else {}))))
        arg = power_law_for(eta, sl, st, gen) if law else eta
        eta_used = arg.eta() if law else eta
        out, kept = kern.sparse_keybound(q, k, v, keys, arg if not law else PowerLawThreshold(*arg), sl, st)
        r = keybound_step_torch(q, k, v, keys, eta_used, D**-0.5, sl, renorm, st)
        res = check_step(q, k, v, eta_used, sl, st, renorm, out, kept, r["epsilon"], 1e-5 if dt == "float32" else 1e-2)
        res.update(case=i, renorm=renorm, kept_equal_torch=bool(torch.equal(kept, r["kept"])),
                   cand=kern.keybound_candidates().tolist(), cand_torch=r["candidates"].sum(-1).tolist(),
                   at_rest=workspace_at_rest(kern.workspace), out_dtype=str(out.dtype).removeprefix("torch."), dtype=dt)
        rows.append(res)
    return rows


def _triton_worker(part: str) -> dict:
    return {"rows": [r for i in map(int, part.split(",")) for r in _triton_case(i)]}


PARTS = ["0,2,4,7", "1,3,5,6,8"]  # TRITON_CASES in two halves of about equal cost


@pytest.fixture(scope="module")
def triton_rows():
    pytest.importorskip("triton")
    parts = run_interpreted_parts(__file__, "--triton-worker", PARTS)
    return [r for p in parts for r in p["rows"]]


@pytest.mark.interpreted(*[("--triton-worker", part) for part in PARTS])
def test_triton_step_matches_float64(triton_rows):
    assert len(triton_rows) == 2 * len(TRITON_CASES)
    for r in triton_rows:
        assert r["kept_ok"] and r["err"] <= r["err_bound"], r
        assert r["kept_equal_torch"] and r["at_rest"] and r["out_dtype"] == r["dtype"], r
        # Candidates decided on float32 bounds computed in another order: equal on these rows.
        assert r["cand"] == r["cand_torch"], r


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("per_channel", [False, True])
def test_cuda_keybound_matches_float64_and_captures(per_channel):
    """The planned key-bound step on the GPU with the device's own launch plan, eager and replayed from a CUDA
    graph; per channel with an offset channel and the ranges of the first half of the keys."""
    from siftattention.kernels import DecodeKernels

    dev = torch.device("cuda")
    for B, Hq, Hkv, S, D, dt in [(2, 32, 8, 4099, 128, torch.float16), (3, 9, 3, 2051, 64, torch.bfloat16),
                                 (1, 12, 2, 8193, 128, torch.bfloat16), (2, 4, 1, 1031, 256, torch.float32)]:
        gen = torch.Generator().manual_seed(seed("cuda", B, Hq, S))
        q, k, v, sl, st = range_case(B, Hq, Hkv, S, D, dt, gen)
        if per_channel:
            k[..., 5] += 30.0
        eta = planted_eta(scores64(q, k, D**-0.5), valid_of(B, S, sl, st), gen)
        keys = quantize_keys(k, channel_ranges(k[:, :, : S // 2])) if per_channel else quantize_keys(k)
        kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=dt, device=dev,
                                  scale=D**-0.5)
        args = [x.to(dev) for x in (q, k, v)] + [type(keys)(*(x if x is None else x.to(dev) for x in keys)),
                                                  eta.to(dev), sl.to(dev), st.to(dev)]
        out, kept = kern.sparse_keybound(*args)
        r = keybound_step_torch(q, k, v, keys, eta, D**-0.5, sl, False, st)
        res = check_step(q, k, v, eta, sl, st, False, out.cpu(), kept.cpu(), r["epsilon"],
                         1e-5 if dt == torch.float32 else 1e-2)
        assert res["kept_ok"] and res["err"] <= res["err_bound"], res
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            kern.sparse_keybound(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            g_out, g_kept = kern.sparse_keybound(*args)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_kept, kept) and torch.equal(g_out, out)
        assert int(kern.workspace.sync.abs().sum()) == 0



# ----------------------------------------------------------------------------- the fast loop's cache and Sift


def test_fixed_cache_keeps_the_int8_copy():
    """After a prompt and one-token writes at device positions, the copy is a fresh quantisation of the keys."""
    from conftest import tiny_llama

    from siftattention.generation.cache import FixedCache

    cache = FixedCache(tiny_llama().config, 12, int8_keys=True)
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randn(2, 2, 7, 16, generator=gen)
    prompt[1, :, :3] = 0.0  # a left-padded row's positions
    layer.update(prompt, prompt)
    assert layer.key_copy.values.shape == (2, 2, 12, 16)
    cache.position.tensor = torch.tensor([7])
    for _ in range(3):
        k = torch.randn(2, 2, 1, 16, generator=gen) * 5
        layer.update(k, k)
        cache.position.tensor += 1
    fresh = quantize_keys(layer.keys[:, :, :10])
    assert torch.equal(layer.key_copy.values[:, :, :10], fresh.values)
    assert torch.equal(layer.key_copy.scales[:, :, :10], fresh.scales)
    assert cache.key_copy_bytes() == 2 * 2 * 12 * (16 + 4)
    assert FixedCache(tiny_llama().config, 12).key_copy(0) is None


def test_per_channel_copy_keeps_the_prompts_ranges():
    """A per-channel copy takes its ranges from the prompt's write and quantises later writes (at host or
    device positions) with them, as ``quantize_keys`` with the prompt's ranges does."""
    from siftattention.kernels.key_write import write_int8_keys
    from siftattention.kernels.keybound import new_int8_keys

    gen = torch.Generator().manual_seed(4)
    keys = new_int8_keys(2, 2, 12, 16, "cpu", per_channel=True)
    assert bool((keys.channel == 1).all() and (keys.offset == 0).all())
    prompt = torch.randn(2, 2, 7, 16, generator=gen) + torch.linspace(-30, 30, 16)
    write_int8_keys(keys, prompt, start=0, fix_channel=True)
    ranges = channel_ranges(prompt)
    assert torch.equal(keys.channel, ranges[0]) and torch.equal(keys.offset, ranges[1])
    later = torch.randn(2, 2, 3, 16, generator=gen) * 40  # beyond the prompt's ranges
    write_int8_keys(keys, later[:, :, :2], start=7)
    write_int8_keys(keys, later[:, :, 2:], index=torch.tensor([9]))
    fresh = quantize_keys(torch.cat([prompt, later], 2), ranges)
    assert torch.equal(keys.values[:, :, :10], fresh.values) and torch.equal(keys.scales[:, :, :10], fresh.scales)
    assert torch.equal(keys.channel, ranges[0])


def prompt_ranges(k: torch.Tensor, starts: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``channel_ranges`` of each batch row's valid prompt keys ``k[b, :, starts[b]:length]``, row by row."""
    parts = [channel_ranges(k[b:b + 1, :, int(starts[b]):length]) for b in range(k.shape[0])]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_per_channel_cache_copy_is_fixed_by_the_prompts_valid_keys():
    """A "channel" cache copy: after a prompt written in chunks (left padding, an offset channel) its ranges are
    the valid prompt keys' and the prompt is quantised with them; each later write at a device position (keys
    beyond those ranges too) is a fresh quantisation with the same ranges."""
    from conftest import tiny_llama

    from siftattention.generation.cache import FixedCache

    cache = FixedCache(tiny_llama().config, 14, int8_keys="channel")
    layer = cache.layers[1]
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randn(3, 2, 8, 16, generator=gen) * torch.linspace(0.1, 3, 16)
    prompt[..., 3] += 20.0
    prompt[1, :, :2] = 50.0  # padding: far outside the valid keys, must not widen their ranges
    prompt[2, :, :5] = -7.0
    starts = torch.tensor([0, 2, 5], dtype=torch.int32)
    for a, b in ((0, 3), (3, 8)):
        layer.update(prompt[:, :, a:b], prompt[:, :, a:b])
    cache.finish_prompt(starts)
    ranges = prompt_ranges(prompt, starts, 8)
    assert torch.equal(layer.key_copy.channel, ranges[0]) and torch.equal(layer.key_copy.offset, ranges[1])
    assert not torch.equal(ranges[1], channel_ranges(prompt)[1])
    cache.position.tensor = torch.tensor([8])
    for n in range(8, 15):
        fresh = quantize_keys(layer.keys[:, :, :n], ranges)
        assert torch.equal(layer.key_copy.values[:, :, :n], fresh.values), n
        assert torch.equal(layer.key_copy.scales[:, :, :n], fresh.scales), n
        if n < 14:
            k = torch.randn(3, 2, 1, 16, generator=gen) * (1 + 10 * (n % 2))
            layer.update(k, k)
            cache.position.tensor += 1
    assert cache.key_copy_bytes() == layer.key_copy.nbytes() == 3 * 2 * (14 * (16 + 4) + 16 * 8)
    with pytest.raises(ValueError, match="int8_keys must be False, True, 'row' or 'channel'"):
        FixedCache(tiny_llama().config, 4, int8_keys="col")


def _biased_qwen2():
    """A tiny Qwen2 (GQA 4/2) whose key bias makes two channels offsets far larger than the rest, as Qwen's."""
    from conftest import tiny_qwen2
    from test_generation import _model

    model = _model(lambda: tiny_qwen2(kv_heads=2))
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(2, -1)
            bias[:, 1] += 6.0
            bias[:, 9] -= 4.0
    return model


def loop_step_check(q, k, v, keys, eta, scale, seq_lens, renormalize, starts, kept) -> tuple[dict, dict]:
    """A fast-loop step's inputs (caches and copy longer than its valid keys) through the reference: its terms, and
    whether it keeps the float64 rule's keys outside its epsilon (``same``) and the step's kept counts are its own."""
    L = int(seq_lens.max())
    sliced = type(keys)(keys.values[:, :, :L], keys.scales[:, :, :L], keys.channel, keys.offset)
    r = keybound_step_torch(q, k[:, :, :L], v[:, :, :L], sliced, eta, scale, seq_lens, renormalize, starts)
    valid = valid_of(q.shape[0], L, seq_lens, starts)
    s64 = scores64(q, k[:, :, :L], scale)
    keep64, t = ref_keep64(s64, valid, eta)
    near = (s64 - t[..., None]).abs() <= r["epsilon"].double()[..., None] + 1e-4
    return r, dict(same=bool(((r["keep"] != keep64) & ~near).sum() == 0), kept=torch.equal(kept, r["kept"]))


@pytest.mark.parametrize("form", [True, "channel"])
def test_sift_keybound_generates_through_the_fast_loop(monkeypatch, form):
    """Sift(keybound=...) decodes left-padded rows (the prompt in chunks) with the key-bound step over the
    loop's int8 copy, which equals a fresh quantisation of every written key (per channel: with the ranges
    of each row's valid prompt keys); every step keeps the float64 rule's keys except those within its
    epsilon of the threshold, and the tokens are the exact step's. Where the fused CPU kernel builds, every
    step runs its C++ key-bound step, with the reference's kept counts and candidates."""
    from test_generation import _left_padded_batch

    from siftattention import Sift
    from siftattention.generation import generate, loop
    from siftattention.kernels import DecodeKernels, cpu_decode

    model = _biased_qwen2()
    ids, mask = _left_padded_batch()
    caches, steps, fused = [], [], []
    real_cache, real_step, real_cpu = loop.FixedCache, DecodeKernels.sparse_keybound, cpu_decode.keybound_decode_cpu

    def checked_step(self, q, k, v, keys, eta, seq_lens, starts=None):
        out, kept = real_step(self, q, k, v, keys, eta, seq_lens, starts)
        r, record = loop_step_check(q, k, v, keys, eta.eta() if hasattr(eta, "eta") else eta, self.scale, seq_lens,
                                    False, starts, kept)
        steps.append(dict(record, cand=torch.equal(self.keybound_candidates(), r["candidates"].sum(-1, dtype=torch.int32))))
        return out, kept

    monkeypatch.setattr(loop, "FixedCache", lambda *a, **kw: caches.append(real_cache(*a, **kw)) or caches[-1])
    monkeypatch.setattr(DecodeKernels, "sparse_keybound", checked_step)
    monkeypatch.setattr(cpu_decode, "keybound_decode_cpu", lambda *a, **kw: fused.append(1) or real_cpu(*a, **kw))
    kw = dict(max_new_tokens=10, eos_token_id=-1, pad_token_id=0, prefill_chunk=5)
    method = dict(tau=0.5, warmup=4, warmup_source="decode")
    res = generate(model, ids, mask, Sift(keybound=form, **method), **kw)
    exact = generate(model, ids, mask, Sift(**method), **kw)
    assert res.fast and torch.equal(res.sequences, exact.sequences)
    assert len(steps) == 2 * 5 and all(s["same"] and s["kept"] and s["cand"] for s in steps), steps
    assert len(fused) == (len(steps) if cpu_decode.available() else 0)
    assert res.timings["key_copy_bytes"] == caches[0].key_copy_bytes() > 0 and "key_copy_bytes" not in exact.timings
    written = 13 + 9  # the prompt, then every decode step's token
    starts = 13 - mask.sum(1)
    for layer in caches[0].layers:
        k = layer.keys[:, :, :written]
        ranges = prompt_ranges(k, starts, 13) if form == "channel" else None
        fresh = quantize_keys(k, ranges)
        assert (layer.key_copy.channel is None) == (form is True)
        assert torch.equal(layer.key_copy.values[:, :, :written], fresh.values)
        assert torch.equal(layer.key_copy.scales[:, :, :written], fresh.scales)
    with pytest.raises(ValueError, match="keybound needs normalizer='exact'"):
        Sift(keybound=form, normalizer="anchored")


@needs_cuda
@pytest.mark.parametrize("form", ["row", "channel"])
def test_cuda_sift_keybound_fast_loop_captures(monkeypatch, form):
    """On CUDA the key-bound step and the copy's one-token writes run inside the loop's graphs: the copy is
    still a fresh quantisation of every written key, and the tokens are the exact step's."""
    from test_generation import _left_padded_batch

    from siftattention import Sift
    from siftattention.generation import generate, loop

    model = _biased_qwen2().cuda()
    ids, mask = (x.cuda() for x in _left_padded_batch())
    caches = []
    real_cache = loop.FixedCache
    monkeypatch.setattr(loop, "FixedCache", lambda *a, **kw: caches.append(real_cache(*a, **kw)) or caches[-1])
    kw = dict(max_new_tokens=12, eos_token_id=-1, pad_token_id=0, prefill_chunk=5, cuda_graphs=True)
    method = dict(tau=0.5, warmup=4, warmup_source="decode")
    res = generate(model, ids, mask, Sift(keybound=form, **method), **kw)
    exact = generate(model, ids, mask, Sift(**method), **kw)
    assert res.fast and torch.equal(res.sequences, exact.sequences)
    written, starts = 13 + 11, 13 - mask.sum(1)
    for layer in caches[0].layers:
        k = layer.keys[:, :, :written]
        fresh = quantize_keys(k, prompt_ranges(k, starts, 13) if form == "channel" else None)
        assert torch.equal(layer.key_copy.values[:, :, :written], fresh.values)
        assert torch.equal(layer.key_copy.scales[:, :, :written], fresh.scales)


def test_sift_keybound_option_values():
    """keybound takes False, True (= "row"), "row" or "channel", in code and in a method spec."""
    from siftattention import Sift
    from siftattention.methods import SpecError, parse_method

    assert Sift(keybound=True) == Sift(keybound="row") and Sift(keybound=True).keybound == "row"
    assert Sift().keybound is False and "keybound" not in Sift().spec()
    assert parse_method(Sift(keybound="channel").spec()) == Sift(keybound="channel")
    assert parse_method("sift:keybound=true").keybound == "row"
    for bad in ("col", 2, None):
        with pytest.raises(ValueError, match="keybound must be False, True, 'row' or 'channel'"):
            Sift(keybound=bad)
    with pytest.raises(SpecError, match="is not one of true/false/row/channel"):
        parse_method("sift:keybound=col")


if __name__ == "__main__" and "--triton-worker" in sys.argv:
    print(json.dumps(_triton_worker(sys.argv[sys.argv.index("--triton-worker") + 1])))
