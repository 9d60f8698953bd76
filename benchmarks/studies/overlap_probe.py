"""Does running one chunk's filter pass beside the next chunk's scores pass pay?

The shipped sift step is two kernels in a row (scores, then filter); with programmatic
dependent launch the filter overlaps only the scores kernel's last wave. Here the step is
cut into C chunks of KV heads (or batch rows), each with its own plan, and captured in one
CUDA graph on two streams: the scores passes run one after another on the main stream,
and chunk c's filter pass runs on a side stream as soon as chunk c's scores are in (a graph
edge, no spin-wait), beside chunk c + 1's scores pass. The same chunks run on one stream
for comparison, so the effect of cutting and the effect of overlapping are told apart.

    PYTHONPATH=. python3 benchmarks/studies/overlap_probe.py --out overlap_probe_h200.json

Every form's output is checked against float64 and its kept counts against the exact
ones before it is timed; ratios are to SDPA measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for bench_decode
from bench_decode import (DEV, bench_graph, copy_bandwidth, make_inputs, planned, ref_out64, rel_err,  # noqa: E402
                          sdpa_decode, thresholds, full_lens)

from siftattention.kernels import triton_decode as td  # noqa: E402


class ChunkedStep:
    """The sift step on C chunks of KV heads ("heads") or batch rows ("batch")."""

    def __init__(self, q, k, chunks: int, axis: str, overlap: bool, cfg: td.KernelConfig):
        B, Hq, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        self.G, self.axis, self.overlap, self.cfg = Hq // Hkv, axis, overlap, cfg
        n = Hkv if axis == "heads" else B
        assert n % chunks == 0, (n, chunks)
        self.bounds = [(i * n // chunks, (i + 1) * n // chunks) for i in range(chunks)]
        self.scale = D**-0.5
        self.parts = []
        for lo, hi in self.bounds:
            cb, ch = (B, hi - lo) if axis == "heads" else (hi - lo, Hkv)
            geo = td.geometry(cb, ch * self.G, ch, S, D, q.dtype, q.device, cfg)
            self.parts.append((geo, td.Workspace(geo, q.device)))
        self.side = torch.cuda.Stream() if DEV == "cuda" else None

    def _slice(self, i, q, k, v, eta, sl):
        lo, hi = self.bounds[i]
        if self.axis == "heads":
            g = self.G
            return q[:, lo * g : hi * g], k[:, lo:hi], v[:, lo:hi], eta[i], sl
        return q[lo:hi], k[lo:hi], v[lo:hi], eta[i], sl[lo:hi]

    def split_eta(self, eta):
        """Per-chunk contiguous eta (the kernels index eta as a dense [B, Hq]), made outside the graph."""
        g = self.G
        if self.axis == "heads":
            return [eta[:, lo * g : hi * g].contiguous() for lo, hi in self.bounds]
        return [eta[lo:hi].contiguous() for lo, hi in self.bounds]

    def scores_only(self, q, k, v, eta, sl):
        """Every chunk's scores pass, one after another (fills the workspaces for ``filters_only``)."""
        for i, (geo, ws) in enumerate(self.parts):
            qi, ki, _, _, si = self._slice(i, q, k, v, eta, sl)
            td.scores_pass(geo, ws, qi, ki, self.scale, si, None, self.cfg, False)

    def filters_only(self, q, k, v, eta, sl):
        """Every chunk's filter pass on the scores already in the workspaces."""
        for i, (geo, ws) in enumerate(self.parts):
            _, _, vi, ei, si = self._slice(i, q, k, v, eta, sl)
            td.filter_pass(geo, ws, vi, ei, si, None, self.cfg, q.dtype, False, True, False)

    def __call__(self, q, k, v, eta, sl):
        outs, kepts = [], []
        main = torch.cuda.current_stream() if DEV == "cuda" else None
        for i, (geo, ws) in enumerate(self.parts):
            qi, ki, vi, ei, si = self._slice(i, q, k, v, eta, sl)
            td.scores_pass(geo, ws, qi, ki, self.scale, si, None, self.cfg, False)
            if self.overlap and main is not None:
                ev = torch.cuda.Event()
                ev.record(main)
                self.side.wait_event(ev)
                with torch.cuda.stream(self.side):
                    o, kp = td.filter_pass(geo, ws, vi, ei, si, None, self.cfg, q.dtype, False, True, False)
            else:
                o, kp = td.filter_pass(geo, ws, vi, ei, si, None, self.cfg, q.dtype, False, True, False)
            outs.append(o)
            kepts.append(kp)
        if self.overlap and main is not None:
            main.wait_stream(self.side)
        dim = 1 if self.axis == "heads" else 0
        return torch.cat(outs, dim), torch.cat(kepts, dim)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8,32,8,32768", "16,32,8,32768", "8,32,32,8192", "1,32,8,8192",
                                                     "1,32,8,32768", "8,32,8,8192"])
    ap.add_argument("--forms", nargs="+", default=["heads:2", "heads:4", "heads:8", "batch:2", "batch:4"])
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--group-corr", type=float, nargs="+", default=[0.0, 0.9])
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(11)
    cfg = td.config_for(torch.device(DEV))
    bw = copy_bandwidth()
    rows = []
    for shape in args.shapes:
        B, Hq, Hkv, S = map(int, shape.split(","))
        D = 128
        for corr in args.group_corr:
            sets = [make_inputs(B, Hq, Hkv, S, D, torch.float16, 3.0, corr, gen) for _ in range(args.sets)]
            sl = full_lens(B, S)
            ths = [thresholds(q, k, [args.sparsity])[0] for q, k, _ in sets]
            t_sdpa = bench_graph(sdpa_decode, sets)
            kern = planned(sets[0][0], sets[0][1])
            q, k, v = sets[0]
            eta, kept_ref, union = ths[0]
            kern_nopdl = planned(q, k, td.KernelConfig(**{**cfg.__dict__, "pdl": False}))
            forms = [("planned", None), ("planned:nopdl", kern_nopdl)]
            for f in args.forms:
                axis, c = f.split(":")
                n = Hkv if axis == "heads" else B
                if int(c) <= n and n % int(c) == 0:
                    forms += [(f"{f}:serial", ChunkedStep(q, k, int(c), axis, False, cfg)),
                              (f"{f}:overlap", ChunkedStep(q, k, int(c), axis, True, cfg))]
            res = dict(B=B, Hq=Hq, Hkv=Hkv, S=S, group_corr=corr, union=union, sdpa_ms=t_sdpa, forms={})
            for name, step in forms:
                if step is None or not isinstance(step, ChunkedStep):
                    kn = kern if step is None else step
                    fn, prep = (lambda q, k, v, e, kn=kn: kn.sparse(q, k, v, e, sl)), (lambda e: e)
                else:
                    fn, prep = (lambda q, k, v, e, st=step: st(q, k, v, e, sl)), step.split_eta
                out, kept = fn(q, k, v, prep(eta))
                if DEV == "cuda":
                    torch.cuda.synchronize()
                err = max(rel_err(out[b], ref_out64(q, k, v, eta, b)) for b in range(B))
                ok = bool(torch.equal(kept, kept_ref)) and err < 1e-2
                ms = bench_graph(fn, [s + (prep(t[0]),) for s, t in zip(sets, ths)])
                res["forms"][name] = dict(ok=ok, err=err, ms=ms, ratio=ms / t_sdpa)
            # The two passes of the serial chunks timed apart: how much of the smaller one the
            # two-stream form hides (1: all of it, 0: none).
            for name, step in forms[2:]:
                if name.endswith(":overlap"):
                    continue
                args2 = [s + (step.split_eta(t[0]),) for s, t in zip(sets, ths)]
                t_s = bench_graph(lambda q, k, v, e, st=step: st.scores_only(q, k, v, e, sl), args2)
                step.scores_only(*args2[0], sl)
                t_f = bench_graph(lambda q, k, v, e, st=step: st.filters_only(q, k, v, e, sl), args2)
                t_o = res["forms"][name.replace(":serial", ":overlap")]["ms"]
                res["forms"][name].update(scores_ms=t_s, filters_ms=t_f, hidden=(t_s + t_f - t_o) / min(t_s, t_f))
            rows.append(res)
            hid = " ".join(f"{n.split(':serial')[0]}:S{r['scores_ms'] / t_sdpa:.2f}+F{r['filters_ms'] / t_sdpa:.2f}"
                           f"/hid{r['hidden']:.2f}" for n, r in res["forms"].items() if "hidden" in r)
            print("   ", hid, flush=True)
            cells = "  ".join(f"{n}:{r['ratio']:.3f}{'' if r['ok'] else '!'}" for n, r in res["forms"].items())
            print(f"B={B} H={Hq}/{Hkv} S={S} corr={corr} union={union:.3f} sdpa {t_sdpa:.4f} ms  {cells}", flush=True)
            del sets
            if DEV == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_bandwidth=bw, device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                           torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
