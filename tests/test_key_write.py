"""The int8 key copy's Triton writer (kernels/triton_key_write.py) and C++ CPU writer (kernels/cpu/key_write.cpp)
against ``write_int8_keys``' torch form, bit for bit: both forms, writes at a start and at device positions, odd
shapes, strided keys, edge values.

The Triton kernel runs under Triton's CPU interpreter in a subprocess (this file as a script), so the interpreter
setting never leaks into this process; on a CUDA device the same checks run on the GPU. The C++ writer runs here,
float32 keys (the CPU kernel's dtype), where the extension builds."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch
from conftest import triton_worker

from siftattention.kernels import cpu_decode
from siftattention.kernels.key_write import write_int8_keys
from siftattention.kernels.keybound import CHANNEL_FLOOR, Int8Keys, channel_ranges, new_int8_keys

#: B, Hkv, n, D, dtype, form, where ("start" or "index"), layout of k (see ``strided_keys``).
CASES = [
    (1, 1, 1, 64, "float16", "row", "index", "channels"),
    (3, 2, 1, 128, "bfloat16", "channel", "index", "heads"),
    (3, 2, 1, 256, "float32", "row", "index", "contiguous"),
    (1, 2, 3, 256, "float32", "channel", "start", "channels"),
    (3, 1, 3, 128, "float16", "row", "start", "heads"),
    (3, 2, 37, 64, "bfloat16", "row", "start", "channels"),
    (1, 2, 37, 128, "float16", "channel", "index", "contiguous"),
    (3, 1, 37, 80, "float32", "channel", "start", "heads"),  # head_dim not a power of two
    (1, 1, 3, 80, "bfloat16", "row", "index", "contiguous"),
]


def strided_keys(B: int, H: int, n: int, D: int, dtype: torch.dtype, layout: str, gen: torch.Generator) -> torch.Tensor:
    """Keys [B, H, n, D] of rows of very different size with a few offset, wide channels, in a buffer with
    spare room: "heads", a transposed view of [B, n, H, D] (as attention's projections leave them);
    "channels", channels not adjacent; "contiguous"."""
    k = torch.randn(B, H, n, D, generator=gen, dtype=torch.float64)
    k = k * torch.exp(torch.randn(B, H, n, 1, generator=gen, dtype=torch.float64) * 2)
    k[..., 1] += 5.0
    k[..., D - 3] *= 30.0
    if layout == "contiguous":
        return k.to(dtype)
    if layout == "heads":
        out = torch.zeros(B, n, H, D + 8, dtype=dtype)[..., :D].transpose(1, 2)
    else:
        out = torch.zeros(B, H, D, n + 1, dtype=dtype)[..., :n].transpose(2, 3)
    out.copy_(k)
    assert out.shape == (B, H, n, D) and not out.is_contiguous()
    return out


def _copies(B: int, H: int, S: int, D: int, form: str, device: str, gen: torch.Generator) -> tuple[Int8Keys, Int8Keys]:
    """Two equal copies of S positions, written by torch before the checked write: random rows everywhere, and
    per channel the ranges of a random prompt (so untouched positions and the ranges are checked too)."""
    copy = new_int8_keys(B, H, S, D, device, per_channel=form == "channel")
    prompt = (torch.randn(B, H, S, D, generator=gen) * 2 + torch.randn(D, generator=gen) * 3).to(device)
    write_int8_keys(copy, prompt, start=0, fix_channel=True, backend="torch")
    return copy, Int8Keys(*(None if t is None else t.clone() for t in copy))


def same(a: Int8Keys, b: Int8Keys) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def _write_both(copies: tuple[Int8Keys, Int8Keys], k: torch.Tensor, where: str, gen: torch.Generator,
                fix_channel: bool = False, kernel: str = "triton") -> bool:
    """The same write by torch and by the kernel (backend ``kernel``) into the two copies; whether the copies are
    still equal."""
    S, n = copies[0].values.shape[2], k.shape[2]
    kw = dict(start=3) if where == "start" else dict(index=torch.randperm(S, generator=gen)[:n].to(k.device))
    for copy, backend in zip(copies, ("torch", kernel)):
        write_int8_keys(copy, k, fix_channel=fix_channel, backend=backend, **kw)
    return same(*copies)


def _case_rows(device: str) -> list[dict]:
    rows = []
    for i, (B, H, n, D, dt, form, where, layout) in enumerate(CASES):
        gen = torch.Generator().manual_seed(1000 + i)
        k = strided_keys(B, H, n, D, getattr(torch, dt), layout, gen).to(device)
        copies = _copies(B, H, n + 6, D, form, device, gen)
        rows.append(dict(case=i, same=_write_both(copies, k, where, gen)))
    # The prompt's write of a per-channel copy: ranges fixed in torch, then the kernel.
    gen = torch.Generator().manual_seed(7)
    k = strided_keys(3, 2, 5, 64, torch.float16, "heads", gen).to(device)
    rows.append(dict(case="fix_channel", same=_write_both(_copies(3, 2, 9, 64, "channel", device, gen), k, "start",
                                                         gen, fix_channel=True)))
    return rows


#: Quantised values that tie at .5 (scale 1: max|x| = 127) and their round-half-to-even results.
TIES = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 63.5, -64.5, 3.25, -3.75]
TIES_EVEN = [127, 0, 2, 2, 0, -2, -2, 126, -126, 64, -64, 3, -4]


def edge_keys(dtype: torch.dtype, chan: torch.Tensor, off: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [1, 1, 6, D], each the key ``off + chan * x`` of a row x: zeros, one nonzero channel, ties at .5
    after the division, the dtype's largest values, tiny ones (subnormal in float32), and a row whose largest
    value is a tie's 127. Also the ties row's x."""
    D = chan.numel()
    fin = torch.finfo(dtype)
    x = torch.zeros(6, D, dtype=torch.float64)
    x[1, 5] = -3.0
    x[2, : len(TIES)] = torch.tensor(TIES, dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(D // 2)
    x[4] = signs * torch.arange(1, D + 1, dtype=torch.float64) * (1e-44 if dtype == torch.float32 else fin.tiny)
    x[5, :4] = torch.tensor([127.0, -126.5, 0.5, 1.5])
    k = off.double() + chan.double() * x
    # The largest keys, at the dtype's limit; per channel below 2^116, where (k - o) / c stays finite (keybound).
    big = fin.max if not per_channel or dtype == torch.float16 else 2.0**100
    k[3] = signs * big * torch.linspace(1.0, 0.25, D, dtype=torch.float64)
    return k.to(dtype)[None, None], x[2]


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _edge_rows(device: str, kernel: str = "triton", dtypes: tuple[torch.dtype, ...] = _DTYPES) -> list[dict]:
    """Edge rows through both writes: equal copies, the ties rounded half to even, zero rows at the least scale."""
    rows = []
    D = 64
    for form in ("row", "channel"):
        for dt in dtypes:
            chan, off = torch.ones(D), torch.zeros(D)
            if form == "channel":  # powers of two; offsets off the ties' channels: their keys exact in every dtype
                chan = torch.tensor([1.0, 0.5, 0.25, 2.0, CHANNEL_FLOOR] * 13)[:D]
                off = torch.where(torch.arange(D) < 16, 0.0, torch.tensor([0.25, -3.0, 1.0, 0.0])[torch.arange(D) % 4])
            copy = new_int8_keys(1, 1, 10, D, device, per_channel=form == "channel")
            if form == "channel":
                copy.channel.copy_(chan)
                copy.offset.copy_(off)
            k, ties = edge_keys(dt, chan, off, form == "channel")
            xr = ((k[0, 0, 2].float() - off) / chan).double()  # x of the ties row, as both writes compute it
            copies = (copy, Int8Keys(*(None if t is None else t.clone() for t in copy)))
            gen = torch.Generator().manual_seed(3)
            equal = _write_both(copies, k.to(device), "start", gen, kernel=kernel)  # rows 0-5 at positions 3-8
            values, scales = copies[1].values.cpu(), copies[1].scales.cpu()
            least = 2.0**-116 if form == "channel" else 2.0**-126
            rows.append(dict(
                form=form, dtype=str(dt),
                same=equal and _write_both(copies, k.to(device)[:, :, 1:3], "index", gen, kernel=kernel),
                ties_exact=bool(torch.equal(xr[: len(TIES)], ties[: len(TIES)])),
                ties_even=values[0, 0, 5, : len(TIES)].tolist() == TIES_EVEN,
                tie_scale=float(scales[0, 0, 5]),
                zero_row=bool((values[0, 0, 3] == 0).all()) and float(scales[0, 0, 3]) == least,
                one_channel=values[0, 0, 4, 5].item() == -127 and int(values[0, 0, 4].abs().sum()) == 127,
                big_finite=bool(torch.isfinite(scales[0, 0, 6])) and int(values[0, 0, 6].abs().max()) == 127,
            ))
    return rows


def _worker(device: str = "cpu") -> dict:
    return {"cases": _case_rows(device), "edges": _edge_rows(device)}


def check_edges(rows: list[dict], count: int) -> None:
    assert len(rows) == count
    for r in rows:
        assert r["same"] and r["ties_exact"] and r["ties_even"] and r["tie_scale"] == 1.0, r
        assert r["zero_row"] and r["one_channel"] and r["big_finite"], r


def check_worker(res: dict) -> None:
    assert len(res["cases"]) == len(CASES) + 1
    for r in res["cases"]:
        assert r["same"], r
    check_edges(res["edges"], 6)


@pytest.mark.interpreted(("--triton-worker",))
def test_triton_key_write_matches_torch():
    check_worker(triton_worker(__file__))


def test_key_write_backend_choice():
    """"triton" is refused on the CPU without the interpreter; unknown backends are refused."""
    keys = new_int8_keys(1, 1, 4, 8, "cpu")
    write_int8_keys(keys, torch.ones(1, 1, 2, 8), start=1)
    assert bool((keys.values[0, 0, 1:3] == 127).all())
    with pytest.raises(ValueError, match="unknown backend"):
        write_int8_keys(keys, torch.ones(1, 1, 2, 8), start=1, backend="cuda")
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        write_int8_keys(keys, torch.ones(1, 1, 2, 8), start=1, backend="triton")


# ----------------------------------------------------------------------------- the C++ CPU writer


def needs_cpu_writer() -> None:
    if not cpu_decode.available():
        pytest.skip(f"the fused CPU kernel cannot be built here ({cpu_decode.build_problem()}): its key writer is not checked")


def test_cpu_key_write_matches_torch():
    """Every B 1/3, Hkv 1/2, n 1/3/37, D 64/80/128/256, in both forms, written at a start and at positions, keys in
    the three layouts of ``strided_keys`` in turn: the C++ writer's copy equals torch's, bit for bit (the positions
    it does not write and the channel ranges too)."""
    needs_cpu_writer()
    layouts = ("heads", "channels", "contiguous")
    failed = []
    shapes = itertools.product((1, 3), (1, 2), (1, 3, 37), (64, 80, 128, 256), ("row", "channel"), ("start", "index"))
    for i, (B, H, n, D, form, where) in enumerate(shapes):
        gen = torch.Generator().manual_seed(2000 + i)
        layout = layouts[i % 3] if B * H * n > 1 else "channels"  # a single row is contiguous but for its channels
        k = strided_keys(B, H, n, D, torch.float32, layout, gen)
        if not _write_both(_copies(B, H, n + 6, D, form, "cpu", gen), k, where, gen, kernel="cpu"):
            failed.append((B, H, n, D, form, where, layout))
    assert not failed
    # The prompt's write of a per-channel copy (ranges fixed in torch, then the kernel), into one batch row's views
    # of the copy as ``FixedLayer.finish_prompt`` writes it.
    gen = torch.Generator().manual_seed(7)
    k = strided_keys(3, 2, 5, 64, torch.float32, "heads", gen)
    copies = _copies(3, 2, 9, 64, "channel", "cpu", gen)
    rows = tuple(Int8Keys(*(t[1:2] for t in copy)) for copy in copies)
    assert _write_both(rows, k[1:2], "start", gen, fix_channel=True, kernel="cpu") and same(*copies)


def test_cpu_key_write_edges_and_positions():
    """The edge rows (zeros at the least scale, one nonzero channel, ties at .5 after the division rounded half to
    even, float32's largest values, subnormal ones) as torch writes them; non-finite keys too (NaN and infinite
    scales, zeros where the quotient is NaN, as torch); int32 positions as int64 ones; positions outside the copy
    refused."""
    needs_cpu_writer()
    check_edges(_edge_rows("cpu", "cpu", (torch.float32,)), 2)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 3, 80, generator=gen)
    k[0, 0, 0, 7] = float("nan")
    k[0, 1, 1, 3] = float("inf")
    k[1, 0, 2, :] = float("-inf")
    for form in ("row", "channel"):
        copies = _copies(2, 2, 8, 80, form, "cpu", gen)
        _write_both(copies, k, "start", gen, kernel="cpu")
        assert bool(copies[1].scales[0, 0, 3].isnan()) and float(copies[1].scales[0, 1, 4]) == float("inf")
        for copy, backend, dt in zip(copies, ("torch", "cpu"), (torch.int64, torch.int32)):  # torch takes int64 only
            write_int8_keys(copy, k[:, :, 1:], index=torch.tensor([7, 0], dtype=dt), backend=backend)
        assert same(*(Int8Keys(x.values, x.scales.view(torch.int32), x.channel, x.offset) for x in copies)), form
    for kw in (dict(index=torch.tensor([2, 8, 0])), dict(index=torch.tensor([-1, 0, 1])), dict(start=6), dict(start=-1)):
        with pytest.raises(RuntimeError, match="out of range|do not fit"):
            write_int8_keys(copies[1], k, backend="cpu", **kw)


def test_cpu_key_write_routing(monkeypatch):
    """"auto" writes float32 CPU keys (the CPU fast loop's and ``apply``'s) by the C++ writer and other dtypes by torch;
    "cpu" refuses other dtypes; where the extension cannot build, "auto" writes by torch and "cpu" is refused."""
    needs_cpu_writer()
    calls = []
    real = cpu_decode.write_int8_keys_cpu
    monkeypatch.setattr(cpu_decode, "write_int8_keys_cpu", lambda *a: calls.append(1) or real(*a))
    keys = new_int8_keys(1, 2, 6, 16, "cpu")
    write_int8_keys(keys, torch.randn(1, 2, 1, 16), index=torch.tensor([4]))
    assert calls == [1] and bool((keys.values[:, :, 4].abs().amax(-1) == 127).all())
    for dt in (torch.float64, torch.bfloat16):
        write_int8_keys(keys, torch.randn(1, 2, 1, 16).to(dt), start=0)
        with pytest.raises(ValueError, match="float32"):
            write_int8_keys(keys, torch.randn(1, 2, 1, 16).to(dt), start=0, backend="cpu")
    assert calls == [1]
    monkeypatch.setattr(cpu_decode, "_module", None)
    monkeypatch.setattr(cpu_decode, "_problem", "not built for this test")
    write_int8_keys(keys, torch.randn(1, 2, 1, 16), start=0)
    assert calls == [1]
    with pytest.raises(ValueError, match="cannot run here: not built for this test"):
        write_int8_keys(keys, torch.randn(1, 2, 1, 16), start=0, backend="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_key_write_matches_torch_and_captures():
    """On the GPU: the same checks; the copy equal to the CPU's torch write; the one-token write at a device
    position replayed from a CUDA graph; "auto" takes the kernel there."""
    check_worker(_worker("cuda"))
    gen = torch.Generator().manual_seed(11)
    for form in ("row", "channel"):
        k = strided_keys(2, 4, 29, 128, torch.bfloat16, "heads", gen)
        cpu = new_int8_keys(2, 4, 40, 128, "cpu", per_channel=form == "channel")
        dev = new_int8_keys(2, 4, 40, 128, "cuda", per_channel=form == "channel")
        write_int8_keys(cpu, k, start=2, fix_channel=True)
        write_int8_keys(dev, k.cuda(), start=2, fix_channel=True)
        assert same(cpu, Int8Keys(*(None if t is None else t.cpu() for t in dev))), form
        pos = torch.tensor([35], device="cuda")
        new = torch.empty(2, 4, 1, 128, dtype=torch.bfloat16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            write_int8_keys(dev, new.normal_(), index=pos)  # compiled before the capture
        torch.cuda.current_stream().wait_stream(side)
        write_int8_keys(cpu, new.cpu(), start=35)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            write_int8_keys(dev, new, index=pos)
        for step in range(3):
            new.copy_(torch.randn(2, 4, 1, 128, generator=gen).to(torch.bfloat16))
            pos.fill_(30 + step)
            graph.replay()
            write_int8_keys(cpu, new.cpu(), start=30 + step)
        torch.cuda.synchronize()
        assert same(cpu, Int8Keys(*(None if t is None else t.cpu() for t in dev))), form


if __name__ == "__main__" and "--triton-worker" in sys.argv:
    print(json.dumps(_worker()))
