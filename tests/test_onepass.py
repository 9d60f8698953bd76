"""Tests for siftattention.kernels.triton_onepass (the one-pass anchored sift step).

The kernel runs under Triton's CPU interpreter (TRITON_INTERPRET=1) in subprocesses, so
that the interpreter setting never leaks into this process; each subprocess is this file
run as a script on half of the cases and returns its measurements as JSON. The reference is
``sift_anchored_decode_torch`` on float64 copies of the inputs.

Kept counts are compared exactly: each head's threshold is placed at least 1e-3 away from
every one of its scores (midway between two sorted scores at least 4e-3 apart, checked
against the float64 scores), far beyond the float32 scoring error.

``make test`` runs every case, both forms and both renormalize settings; the repeat call (the
counters a step leaves must let the next call repeat it) runs in the one-pass form with
renormalize=False, and ``SIFT_FULL_KERNEL_TESTS=1`` adds it with renormalize=True and in the
two-pass form (its filter pass's counters are checked in tests/test_kernels.py, where each plan
is called several times against float64).
"""

from __future__ import annotations

import json
import math
import sys
import zlib

import pytest
import torch
from conftest import full_kernel_tests, run_interpreted_parts

MODES = ("some", "nan", "all", "top_eta", "top_gap")
# The one-pass step is called twice from the same gap (the counters it leaves must let the next call repeat it)
# with renormalize=False; under SIFT_FULL_KERNEL_TESTS=1 every step is, in both forms; each call's counters are checked.
REPEAT_ALL = full_kernel_tests()
# name, B, Hq, Hkv, S, D, dtype, OnePassConfig overrides, first, last, cache layout, key range
CASES = [
    ("mha", 3, 4, 4, 53, 64, "float32", dict(block_n=16, splits=3), 4, 8, "slice", "starts"),
    ("g2", 2, 8, 4, 77, 128, "float16", dict(block_n=16, splits=4), 3, 16, "bshd", "starts"),
    ("g4", 2, 8, 2, 61, 64, "bfloat16", dict(block_n=16, splits=2), 8, 8, "slice", "starts"),
    ("g8", 2, 16, 2, 45, 128, "float16", dict(block_n=16, splits=3), 2, 5, "contig", "lens"),
    ("g8_defaults", 1, 8, 1, 150, 64, "float32", dict(), 16, 32, "slice", "full"),
    ("g2_last_only", 2, 4, 2, 99, 128, "bfloat16", dict(block_n=32, splits=3), 0, 20, "bshd", "starts"),
    ("g4_fp32_d128", 2, 4, 1, 70, 128, "float32", dict(block_n=32, splits=2), 4, 4, "contig", "starts"),
    # Integer inputs, exact ties of the row maximum across splits, every head on the fallback.
    ("ties", 3, 8, 2, 130, 64, "float16", dict(block_n=16, splits=2), 2, 2, "slice", "starts"),
]


def seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def key_range(kind: str, B: int, S: int, gen: torch.Generator):
    """(seq_lens, starts) int32 or None: ragged lengths with left padding, a full row, a one-key row."""
    if kind == "full":
        return None, None
    seq_lens = torch.randint(2, S + 1, (B,), generator=gen)
    seq_lens[0] = S
    starts = (torch.rand(B, generator=gen) * (seq_lens - 1)).long()
    starts[0] = 0
    if B > 1:
        starts[1] = seq_lens[1] - 1  # one valid key: shorter than first + last
    if B > 2:
        starts[2] = max(0, int(seq_lens[2]) - 5)
    if kind == "lens":
        return seq_lens.int(), None
    return seq_lens.int(), starts.int()


def place(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` [B, Hkv, S, D] as a view of a larger buffer (NaN elsewhere), as a StaticCache slice."""
    B, H, S, D = x.shape
    if layout == "slice":
        buf = torch.full((B, H, S + 5, D), float("nan"), dtype=x.dtype, device=x.device)
        buf[:, :, 2 : S + 2] = x
        return buf[:, :, 2 : S + 2]
    if layout == "bshd":
        buf = torch.full((B, S, H, D + 8), float("nan"), dtype=x.dtype, device=x.device)
        buf[..., :D] = x.permute(0, 2, 1, 3)
        return buf[..., :D].permute(0, 2, 1, 3)
    return x.contiguous()


def make_case(name, B, Hq, Hkv, S, D, dt, first, last, layout, kind, gen, dev="cpu"):
    """Inputs, per-head modes and the float64 reference inputs of one case."""
    from siftattention.kernels.plan import PowerLawThreshold
    from siftattention.kernels.torch_ref import anchor_mask, valid_keys

    dtype = getattr(torch, dt)
    G = Hq // Hkv
    ties = name == "ties"
    if ties:
        q = torch.randint(-1, 2, (B, Hq, D), generator=gen).to(dtype)
        k = torch.randint(-1, 2, (B, Hkv, S, D), generator=gen).to(dtype)
    else:
        q = (torch.randn(B, Hq, D, generator=gen) * 2).to(dtype)
        k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    seq_lens, starts = key_range(kind, B, S, gen)
    valid = valid_keys(B, S, torch.device("cpu"), seq_lens, starts)
    if valid is None:
        valid = torch.ones(B, S, dtype=torch.bool)
    scale = D**-0.5

    def scores64():
        return (q.double().reshape(B, Hkv, G, D) @ k.double().transpose(-1, -2)).reshape(B, Hq, S) * scale

    if ties:
        # Copies of head 0's maximum key: row 0 at its first two keys, at a key in a later tile
        # of the first split and at its newest key (the first argmax moves to the first key);
        # the other rows after the maximum only (it stays).
        for b in range(B):
            pos = valid[b].nonzero()[:, 0]
            p1 = int(pos[int(torch.argmax(scores64()[b, 0, pos]))])
            later = [int(pos[-1])] + [int(p) for p in pos[(pos > p1).nonzero()[:, 0][:1]]]
            for p in ([int(pos[0]), int(pos[1]), int(pos[20]), int(pos[-1])] if b == 0 else later):
                k[b, 0, p] = k[b, 0, p1]
    s = scores64()
    s_valid = s.masked_fill(~valid[:, None, :], float("-inf"))
    anchor = anchor_mask(valid[:, None, :].expand(B, Hq, S), first, last)
    a = torch.logsumexp(s.masked_fill(~anchor, float("-inf")), dim=-1)
    n_valid = valid.sum(-1)

    log_steps = torch.log(n_valid.float() + 1.0)
    beta = torch.rand(B, Hq, generator=gen) * 0.7 + 0.3
    log_alpha = (torch.rand(B, Hq, generator=gen) * -4.0 - 1.0) + beta * log_steps[:, None]
    gap = torch.rand(B, Hq, generator=gen) * 2.0
    if ties:
        modes = [["top_eta" if (b + h) % 2 else "top_gap" for h in range(Hq)] for b in range(B)]
    else:
        weighted = ("some",) * 3 + MODES  # every mode once, then mostly filtered heads
        pool = list(MODES) + [weighted[int(i)] for i in torch.randint(0, len(weighted), (B * Hq,), generator=gen)]
        pool = pool[: B * Hq]
        perm = torch.randperm(B * Hq, generator=gen).tolist()
        modes = [[pool[perm[b * Hq + h]] for h in range(Hq)] for b in range(B)]
    for b in range(B):
        for h in range(Hq):
            mode = modes[b][h]
            log_eta = float(log_alpha[b, h] - beta[b, h] * log_steps[b])  # float32, as the kernel forms it
            u = torch.sort(s_valid[b, h][valid[b]]).values
            if mode == "some":
                cand = ((u[1:] - u[:-1]) > 4e-3).nonzero()[:, 0]
                if len(cand) == 0:
                    mode = modes[b][h] = "nan"
                else:
                    r = int(cand[int(torch.randint(0, len(cand), (1,), generator=gen))])
                    gap[b, h] = float((u[r] + u[r + 1]) / 2 - a[b, h] - log_eta)
            if mode == "nan":
                gap[b, h] = float("nan")
            elif mode == "all":
                log_alpha[b, h] = float("-inf")
            elif mode == "top_eta":
                log_alpha[b, h] = float(beta[b, h] * log_steps[b]) + 0.5
            elif mode == "top_gap":
                gap[b, h] = float(u[-1] - a[b, h] - log_eta) + 1.0
    log_eta = log_alpha - beta * log_steps[:, None]
    # The reference's threshold (float64) and its distance to the nearest valid score.
    thr = a + torch.where(torch.isnan(gap), float("-inf"), gap).double() + log_eta.double()
    thr = torch.where(log_eta >= 0, float("inf"), thr)
    dist = (s - thr[..., None]).abs().masked_fill(~valid[:, None, :], float("inf")).amin(-1)
    margin = float(dist[torch.isfinite(thr)].min()) if bool(torch.isfinite(thr).any()) else math.inf
    assert all(log_eta[b, h] >= 0 for b in range(B) for h in range(Hq) if modes[b][h] == "top_eta")

    # The kernel reads NaN wherever it must not read: invalid positions and the buffer around the cache.
    poison = torch.where(valid[:, None, :, None], 0.0, float("nan")).to(dtype)
    k_dev = place((k + poison).to(dev), layout)
    v_dev = place((v + poison).to(dev), layout)
    q_dev = torch.cat([q, torch.zeros_like(q)], dim=-1)[..., :D].to(dev) if layout == "bshd" else q.to(dev)
    todev = (lambda t: None if t is None else t.to(dev))  # noqa: E731
    th = PowerLawThreshold(log_alpha.to(dev), beta.to(dev), log_steps.to(dev))
    return dict(
        kernel_args=(q_dev, k_dev, v_dev, th, gap.to(dev), scale, todev(seq_lens), todev(starts)),
        ref_args=(q.double(), k.double(), v.double(), log_eta, gap, scale, seq_lens),
        starts=starts, modes=modes, n_valid=n_valid, margin=margin, dtype=dtype,
    )


# The two-pass form's tiles for these short rows: several splits, compacting and streaming filter splits.
TWO_PASS_SMALL = dict(block_n1=16, block_n2=16, block_a=32, scan_elems=0, min_split1=16, min_split2=16, block_nd=16,
                      min_splitd=16, block_nb=16, block_n2_gqa=16, block_nb_gqa=32, interleave2=0)


def run_case(case, gen, dev="cpu", config=None, two_pass=False, repeat_all=REPEAT_ALL) -> list[dict]:
    """Both renormalize settings of one case: errors against float64, the edge modes, a repeat call
    (one-pass with renormalize=False; in both forms with both where ``repeat_all``).

    ``two_pass``: the step as ``DecodeKernels.sparse_anchored`` runs it in two passes (the
    scores kernel, then the filter kernel with the anchored threshold) instead of ``OnePassPlan``.
    """
    from siftattention.kernels import DecodeKernels
    from siftattention.kernels.torch_ref import sift_anchored_decode_torch
    from siftattention.kernels.triton_decode import KernelConfig
    from siftattention.kernels.triton_onepass import OnePassConfig, OnePassPlan

    name, B, Hq, Hkv, S, D, dt, over, first, last, layout, kind = case
    c = make_case(name, B, Hq, Hkv, S, D, dt, first, last, layout, kind, gen, dev)
    q, k, v, th, gap0, scale, sl, st = c["kernel_args"]
    q64, k64, v64, log_eta, gap_ref, _, sl_ref = c["ref_args"]
    rows = []
    for renorm in (False, True):
        if two_pass:
            kern = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=S, head_dim=D, dtype=c["dtype"],
                                      device=dev, scale=scale, renormalize=renorm, backend="triton",
                                      config=config or KernelConfig(**TWO_PASS_SMALL))
            step = lambda gap: kern.sparse_anchored(q, k, v, th, gap, sl, st, first, last, onepass=False)  # noqa: E731
            splits = kern.geometry["ns2"]
            counters = kern.workspace.sync
        else:
            plan = OnePassPlan(B, Hq, Hkv, S, D, c["dtype"], dev, first, last, config or OnePassConfig(**over))
            step = lambda gap: plan(q, k, v, th, gap, scale, sl, st, renorm)  # noqa: E731
            splits = plan.geometry["splits"]
            counters = plan.sem
        results, at_rest = [], True
        # A second call from the same gap: the counters must be reset.
        for _ in range(2 if repeat_all or not (renorm or two_pass) else 1):
            gap = gap0.clone()
            out, kept = step(gap)
            results.append((out.cpu(), kept.cpu(), gap.cpu()))
            at_rest &= int(counters.count_nonzero()) == 0
        out, kept, gap = results[0]
        ref, ref_kept, ref_gap = sift_anchored_decode_torch(q64, k64, v64, log_eta, gap_ref, scale, sl_ref, renorm,
                                                            c["starts"], first, last)
        edge_bad = 0
        for b in range(B):
            for h in range(Hq):
                mode = c["modes"][b][h]
                if mode in ("nan", "all") and int(kept[b, h]) != int(c["n_valid"][b]):
                    edge_bad += 1
                if mode in ("top_eta", "top_gap") and int(kept[b, h]) != 1:
                    edge_bad += 1
        rows.append(dict(
            case=name, renorm=renorm, dtype=dt, splits=splits, two_pass=two_pass,
            err=rel(out, ref), kept_equal=bool(torch.equal(kept, ref_kept)),
            gap_err=float((gap.double() - ref_gap).abs().max()), margin=c["margin"], edge_bad=edge_bad,
            modes=sorted({m for r in c["modes"] for m in r}), out_dtype=str(out.dtype),
            fallback_heads=sum(m in ("top_eta", "top_gap") for r in c["modes"] for m in r),
            repeat_equal=all(torch.equal(x, y) for r in results[1:] for x, y in zip(results[0], r)),
            sem_zero=at_rest, calls=len(results),
        ))
    return rows


def _worker(part: int) -> dict:
    """Runs in a subprocess with TRITON_INTERPRET=1 on every other case from ``part`` (0 or 1:
    halves of about equal cost); returns the measurements as JSON."""
    res = {"rows": [], "two_pass": []}
    for case in CASES[part::2]:
        res["rows"] += run_case(case, torch.Generator().manual_seed(seed(*case[:7])))
        res["two_pass"] += run_case(case, torch.Generator().manual_seed(seed(*case[:7])), two_pass=True)
    return res


HALVES = ["0", "1"]
interpreted_halves = pytest.mark.interpreted(*[("--onepass-worker", half) for half in HALVES])


@pytest.fixture(scope="module")
def onepass_results():
    pytest.importorskip("triton")
    halves = run_interpreted_parts(__file__, "--onepass-worker", HALVES)
    return {key: halves[0][key] + halves[1][key] for key in halves[0]}


def check_rows(rows: list[dict], n: int) -> None:
    assert len(rows) == n
    for r in rows:
        tol = 1e-5 if r["dtype"] == "float32" else 1e-2
        assert r["margin"] > 1e-4, r  # no score near its threshold: kept is decided the same way
        assert r["err"] < tol, r
        assert r["kept_equal"], r
        assert r["gap_err"] < 1e-4, r
        assert r["edge_bad"] == 0, r
        assert r["out_dtype"] == "torch." + r["dtype"], r
        assert r["repeat_equal"] and r["sem_zero"] and r["calls"] >= (1 if r["renorm"] or r["two_pass"] else 2), r


@interpreted_halves
def test_onepass_matches_float64(onepass_results):
    check_rows(onepass_results["rows"], 2 * len(CASES))


@interpreted_halves
def test_two_pass_anchored_matches_float64(onepass_results):
    """The same cases through the two-pass form (scores kernel, filter kernel with the anchored threshold)."""
    rows = onepass_results["two_pass"]
    check_rows(rows, 2 * len(CASES))
    assert all(r["two_pass"] for r in rows)


@interpreted_halves
def test_onepass_cases_cover_the_edges(onepass_results):
    """Several splits everywhere, every threshold mode somewhere, the fallback on every tie case head."""
    rows = onepass_results["rows"]
    assert all(r["splits"] >= 2 for r in rows + onepass_results["two_pass"]), rows
    assert set().union(*(r["modes"] for r in rows)) == set(MODES)
    ties = [r for r in rows if r["case"] == "ties"]
    assert ties and all(r["modes"] == ["top_eta", "top_gap"] for r in ties)


def test_onepass_geometry():
    pytest.importorskip("triton")
    from siftattention.kernels import triton_decode as td
    from siftattention.kernels.triton_onepass import OnePassConfig, OnePassPlan, onepass_geometry

    cpu = torch.device("cpu")
    for (B, Hq, Hkv, S, D, dt) in ((1, 32, 8, 32768, 128, torch.float16), (16, 32, 8, 8192, 128, torch.bfloat16),
                                   (2, 8, 2, 100, 64, torch.float32)):
        geo = onepass_geometry(B, Hq, Hkv, S, D, dt, cpu, OnePassConfig())
        nsd = td.geometry(B, Hq, Hkv, S, D, dt, cpu, td.config_for(cpu))["nsd"]
        tiles = -(-S // geo["BLOCK_N"])
        assert geo["BLOCK_N"] == (64 if dt.itemsize * D <= 256 else 32)
        assert geo["splits"] == min(nsd * (2 if B * Hkv < 16 else 1), tiles)
        assert geo["BLOCK_G"] == max(16, geo["G"]) and geo["BLOCK_GA"] == geo["G"]
    # float16 kept counts: at most 2048 tiles per split, more splits where needed
    geo = onepass_geometry(1, 8, 8, 2048 * 64 * 2 + 1, 128, torch.float16, cpu, OnePassConfig(splits=1))
    assert geo["splits"] == 3
    plan = OnePassPlan(2, 8, 2, 100, 64, torch.float16, cpu, 4, 8, td.KernelConfig())
    assert plan.grid == (plan.geometry["splits"], 4) and int(plan.sem.count_nonzero()) == 0
    with pytest.raises(ValueError, match="multiple"):
        OnePassPlan(2, 6, 4, 100, 64, torch.float16, cpu, 4, 8)
    with pytest.raises(ValueError, match="first"):
        OnePassPlan(2, 8, 4, 100, 64, torch.float16, cpu, -1, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_onepass_matches_float64():
    from siftattention.kernels.triton_decode import KernelConfig

    case = ("cuda", 2, 32, 8, 4099, 128, "float16", {}, 64, 256, "slice", "starts")
    rows = run_case(case, torch.Generator().manual_seed(seed(*case[:7])), dev="cuda", repeat_all=True)
    rows += run_case(case, torch.Generator().manual_seed(seed(*case[:7])), dev="cuda", two_pass=True, repeat_all=True,
                     config=KernelConfig())
    check_rows(rows, 4)


if __name__ == "__main__" and "--onepass-worker" in sys.argv:
    print(json.dumps(_worker(int(sys.argv[sys.argv.index("--onepass-worker") + 1]))))
