"""Does a per-row covariate predict a decode row's tau-quantile better than log S alone? Real models, CPU.

Sift predicts, per (sequence, layer, head), ``log theta_hat = log alpha - beta log S`` and keeps the keys with
``p > theta_hat``. The exact decode step already has, before its filter pass, each row's maximum score and
log-sum-exp, hence ``log p_max = s_max - LSE``; and it knows how many keys the previous step kept. This
script fits conditioned predictors by least squares on the prompt's exact rows and compares them on the
decode rows that follow:

- ``plain``:     [1, log S]                     (Sift)
- ``pmax``:      [1, log S, log p_max]
- ``lse``:       [1, log S, LSE]
- ``pmax_lse``:  [1, log S, log p_max, LSE]
- ``fb``:        [1, log S, log f_prev]         f_prev: the previous row's kept fraction under ``plain``
- ``pmax_fb``:   [1, log S, log p_max, log f_prev]
- ``prev_exact`` (a reference, not cheap: the previous row's exact quantile as the prediction).

Each window of ``--seq-len`` tokens of WikiText-2 is one teacher-forced forward (``capture.capture_attention``
keeps every row's post-RoPE query and the K/V cache); the first ``3/4`` of its rows are the prompt, the rest
the decode. Scores, softmax, quantiles and everything after in float64; the quantile is the library's one
(``powerlaw.quantile_of_sorted``, linear interpolation at ``tau (n - 1)``). Two calibrations of every fit:

- ``sift``: the shipped prompt calibration, the 64 geometrically spaced prompt rows of
  ``PromptCalibration`` (weights scaled to 1 / (1 - 0.9) = 10 points), recalibrated every 64 decode rows with
  the row's exact point, earlier points weighted by 0.9 (``Sift.recalibrate_every`` / ``recalibrate_decay``);
- ``dense``: every prompt row with S >= 8, no recalibration;
- ``uniform``: as many prompt rows as ``sift`` samples, evenly spaced in S instead of geometrically, recalibrated
  as ``sift`` (plain law only);
- ``dense_recal``: every prompt row with S >= 8, recalibrated as ``sift`` (plain law only).

Keep rule as Sift's: ``p > eta`` and the row's maximum always kept. Pass 1 measures, over every decode row,
``log(theta_hat / theta)`` and the kept fraction, and the mean kept fraction / dropped mass on a grid of
intercept shifts. Each predictor's shift that makes its mean kept fraction equal the Oracle's is then
interpolated from that grid, and pass 2 (every ``--error-stride``-th decode row) measures at that shift
the dropped mass and the attention output's relative error ``||o_hat - o|| / ||o||`` without and with
value-mean compensation (dropped mass times the mean of the row's valid value rows), against the Oracle
(exact quantile per row) and Top-k (``ceil((1 - tau) S)`` keys).

    .venv/bin/python benchmarks/studies/row_covariate.py --model smollm2-135m --seq-len 4096 --windows 2 --out rc.json
    .venv/bin/python benchmarks/studies/row_covariate.py --model smollm2-135m --seq-len 2048 --windows 1 --taus 0.75,0.875 --out calib.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict

import numpy as np
import torch

from siftattention.capture import capture_attention
from siftattention.data import load_corpus, token_windows
from siftattention.methods.sift import PromptCalibration
from siftattention.models import load_model
from siftattention.powerlaw import quantile_of_sorted

PREDICTORS = {  # feature columns after [1, log S]
    "plain": (),
    "pmax": ("logpmax",),
    "lse": ("lse",),
    "pmax_lse": ("logpmax", "lse"),
    "fb": ("logfprev",),
    "pmax_fb": ("logpmax", "logfprev"),
}
CALIBS = ("sift", "dense", "uniform", "dense_recal")
RECAL_EVERY, DECAY = 64, 0.9
SHIFTS = np.round(np.arange(-1.2, 1.2001, 0.1), 6)  # intercept shifts (nats) of pass 1's grid
OFFSETS = (-0.1, -0.05, 0.0, 0.05, 0.1)  # pass 2: around pass 1's shift, to interpolate to equal sparsity exactly
BLOCK = 512


def head_rows(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int | None, rows: torch.Tensor):
    """Float64 probabilities of query rows ``rows`` (absolute positions) of one head: sorted ascending (+inf
    padded, width = the widest row), and per row n, log p_max, LSE, and the unsorted probs' key columns."""
    hi = int(rows.max()) + 1  # keys past the last row are never valid: cut them
    s = (q[rows] @ k[:hi].T) * scaling  # [r, hi]
    pos = torch.arange(hi)
    valid = pos[None, :] <= rows[:, None]
    if window:
        valid &= rows[:, None] - pos[None, :] < window
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(-1)
    p = torch.exp(s - m[:, None])  # 0 at invalid keys
    total = p.sum(-1)
    p /= total[:, None]
    lse = m + torch.log(total)
    return p, valid, lse, -torch.log(total)


def sorted_rows(p: torch.Tensor, valid: torch.Tensor, width: int) -> np.ndarray:
    filled = np.where(valid.numpy(), p.numpy(), np.inf)
    filled.sort(axis=-1)
    if filled.shape[1] < width:
        filled = np.pad(filled, ((0, 0), (0, width - filled.shape[1])), constant_values=np.inf)
    return filled[:, :width]


def solve(G: np.ndarray, h: np.ndarray) -> np.ndarray:
    ridge = 1e-10 * np.diag(G).mean() * np.eye(G.shape[0])
    ridge[0, 0] = 0.0
    return np.linalg.solve(G + ridge, h)


def predict(Xp, yp, Xd, yd, recal: bool) -> np.ndarray:
    """Log thresholds of the decode rows: fit on (Xp, yp), refit with each 64th decode row's exact point (recal)."""
    scale = (1.0 / (1.0 - DECAY)) / Xp.shape[0] if recal else 1.0
    G, h = Xp.T @ Xp * scale, Xp.T @ yp * scale
    out = np.empty(Xd.shape[0])
    for s in range(0, Xd.shape[0], RECAL_EVERY if recal else Xd.shape[0]):
        e = min(Xd.shape[0], s + (RECAL_EVERY if recal else Xd.shape[0]))
        out[s:e] = Xd[s:e] @ solve(G, h)
        if recal and e - s == RECAL_EVERY:  # that row filtered with the fit before its own point
            x = Xd[e - 1]
            G, h = DECAY * G + np.outer(x, x), DECAY * h + x * yd[e - 1]
    return out


def kept_counts(asc: torch.Tensor, csum: torch.Tensor, n: torch.Tensor, log_eta: torch.Tensor):
    """Keys kept (p > eta, the row max always) and dropped mass, per row and column of ``log_eta`` [r, M];
    ``asc`` the rows sorted ascending (+inf padded), ``csum`` their cumulative sums, ``n`` the valid keys."""
    idx = torch.searchsorted(asc, torch.exp(log_eta), right=True)  # keys with p <= eta
    idx = torch.minimum(idx, (n - 1)[:, None])
    dropped = csum.gather(-1, (idx - 1).clamp(min=0))
    dropped[idx == 0] = 0.0
    return n[:, None] - idx, dropped


def analyze_head(q, k, scaling, window, P, taus, calib_rows):
    """Pass 1 for one (window, layer, head)."""
    T = k.shape[0]
    width = min(T, window or T)
    asc = np.empty((T, width))
    lse = np.empty(T)
    lpm = np.empty(T)
    for r0 in range(0, T, BLOCK):
        rows = torch.arange(r0, min(T, r0 + BLOCK))
        p, valid, l, lp = head_rows(q, k, scaling, window, rows)
        asc[r0:r0 + rows.numel()] = sorted_rows(p, valid, width)
        lse[r0:r0 + rows.numel()], lpm[r0:r0 + rows.numel()] = l.numpy(), lp.numpy()
    n_np = np.minimum(np.arange(1, T + 1), window or T)
    csum = np.cumsum(np.where(np.arange(width)[None, :] < n_np[:, None], asc, 0.0), -1)
    asc_t, csum_t, n = torch.from_numpy(asc), torch.from_numpy(csum), torch.from_numpy(n_np)
    S = n.double().numpy()
    theta = torch.stack([quantile_of_sorted(asc_t, n, t) for t in taus], -1).numpy()  # [T, taus]
    logtheta = np.log(np.maximum(theta, np.finfo(np.float64).tiny))
    logS = np.log(S)
    D = T - P
    dec = np.arange(P, T)
    prompt_rows = np.flatnonzero((S >= 8) & (np.arange(T) < P))
    uniform = np.unique(np.round(np.linspace(prompt_rows[0], prompt_rows[-1], len(calib_rows))).astype(int))
    fit_rows = {"sift": calib_rows, "dense": prompt_rows, "uniform": uniform, "dense_recal": prompt_rows}
    out = {"logtheta": logtheta[dec], "S": S[dec], "pred": {}}
    for ti, tau in enumerate(taus):
        y = logtheta[:, ti]
        for calib in CALIBS:
            fr, recal = fit_rows[calib], calib != "dense"
            base = {"logpmax": lpm, "lse": lse}
            X0 = np.stack([np.ones(T), logS], -1)
            plain = predict(X0[fr], y[fr], X0[dec], y[dec], recal)
            # The plain predictor's kept fraction, row by row: in the prompt under its prompt fit (the
            # prompt rows' feature), in the decode as it runs (recalibrated).
            coef0 = solve(X0[fr].T @ X0[fr], X0[fr].T @ y[fr])
            log_eta_all = X0 @ coef0
            log_eta_all[dec] = plain
            kept, _ = kept_counts(asc_t, csum_t, n, torch.from_numpy(log_eta_all)[:, None])
            f = kept[:, 0].double().numpy() / S
            fprev = np.concatenate([[1.0], f[:-1]])
            base["logfprev"] = np.log(fprev)
            preds = {"plain": plain}
            for name, cols in PREDICTORS.items():
                if name == "plain" or calib not in ("sift", "dense"):
                    continue
                X = np.stack([np.ones(T), logS] + [base[c] for c in cols], -1)
                preds[name] = predict(X[fr], y[fr], X[dec], y[dec], recal)
            for name, v in preds.items():
                out["pred"][(calib, name, tau)] = v
        out["pred"][("ref", "prev_exact", tau)] = logtheta[dec - 1, ti]
        out["pred"][("ref", "oracle", tau)] = logtheta[dec, ti]
    # Kept fraction and dropped mass of every predictor on the shift grid, and unshifted.
    keys = list(out["pred"])
    L = torch.from_numpy(np.stack([out["pred"][key] for key in keys], -1))  # [D, M]
    asc_d, csum_d, n_d = asc_t[P:], csum_t[P:], n[P:]
    grid = (L[:, :, None] + torch.from_numpy(SHIFTS)[None, None, :]).reshape(D, -1)
    kept_g, drop_g = kept_counts(asc_d, csum_d, n_d, grid)
    Sd = n_d.double()[:, None]
    out["grid_kept"] = (kept_g / Sd).reshape(D, len(keys), len(SHIFTS)).sum(0).numpy()
    out["grid_drop"] = drop_g.reshape(D, len(keys), len(SHIFTS)).sum(0).numpy()
    kept0, drop0 = kept_counts(asc_d, csum_d, n_d, L)
    out["kept0"] = (kept0 / Sd).numpy()  # [D, M]
    out["drop0"] = drop0.numpy()
    out["keys"] = keys
    # Top-k: ceil((1 - tau) S) keys.
    for tau in taus:
        kk = torch.ceil(n_d.double() * (1 - tau)).clamp(min=1).long()
        ndrop = n_d - kk
        drop = torch.where(ndrop > 0, csum_d.gather(-1, (ndrop - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        out.setdefault("topk", {})[tau] = ((kk / n_d.double()).sum().item(), drop.sum().item())
    return out


def output_errors(q, k, v, scaling, window, rows, log_etas, topk_taus, block=64):
    """Pass 2: relative output error without / with V-mean compensation, kept fraction and dropped mass, for
    thresholds ``log_etas`` [r, M] (and Top-k at each tau): arrays [r, M + len(topk_taus)] each."""
    parts = []
    for r0 in range(0, rows.numel(), block):
        rr, le = rows[r0:r0 + block], log_etas[r0:r0 + block]
        p, valid, _, _ = head_rows(q, k, scaling, window, rr)
        n = valid.sum(-1)
        ps, order = torch.sort(p, -1, descending=True)
        # Keys kept per method: a prefix of the descending order (p > eta, the row maximum always).
        above = ps.shape[-1] - torch.searchsorted(ps.flip(-1), torch.exp(le), right=True)
        topk = [torch.ceil(n.double() * (1 - t)).clamp(min=1).long() for t in topk_taus]
        C = torch.cat([above.clamp(min=1), torch.stack(topk, -1)], -1)  # [r, M']
        kmax = int(C.max())
        pref = torch.cumsum(ps[:, :kmax, None] * v[order[:, :kmax]], 1)  # [r, kmax, D]
        v_ = v[:p.shape[1]]
        o = p @ v_  # [r, D]
        vmean = (valid.double() @ v_) / n[:, None]
        kept_o = pref.gather(1, (C - 1)[:, :, None].expand(-1, -1, v.shape[1]))  # [r, M', D]
        kept_mass = torch.cumsum(ps[:, :kmax], 1).gather(1, C - 1)  # [r, M']
        on = o.norm(dim=-1)[:, None]
        err = (kept_o - o[:, None]).norm(dim=-1) / on
        err_vmc = (kept_o + (1 - kept_mass)[..., None] * vmean[:, None] - o[:, None]).norm(dim=-1) / on
        parts.append((err.numpy(), err_vmc.numpy(), (C / n[:, None].double()).numpy(), (1 - kept_mass).numpy()))
    return tuple(np.concatenate(x) for x in zip(*parts))


def pct(x, qs=(50, 90, 99)):
    return {f"p{q}": float(np.percentile(x, q)) for q in qs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--taus", default="0.75,0.875,0.95")
    ap.add_argument("--layers", default="all")
    ap.add_argument("--error-stride", type=int, default=4, help="pass 2 measures every N-th decode row")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    taus = [float(t) for t in args.taus.split(",")]
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=torch.float32, device="cpu")
    corpus = load_corpus("wikitext2")
    ids = token_windows(corpus.text, tok, args.seq_len, args.windows)
    T = args.seq_len
    P = 3 * T // 4
    n_layers = model.config.get_text_config().num_hidden_layers
    layers = list(range(n_layers)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    targets = PromptCalibration().targets(torch.tensor([P]))[0].numpy()
    targets = targets[targets > 0]

    caps, results = [], []  # results: (window, layer, head, sliding, out)
    for w in range(args.windows):
        cap = capture_attention(model, ids[w:w + 1], layers=layers, positions=range(T), source=corpus.source)
        caps.append(cap)
        for layer in layers:
            q = cap.query[layer][0].double()
            k, v = cap.key[layer][0].double(), cap.value[layer][0].double()
            window = cap.sliding_window.get(layer)
            window = int(window) if window and window < T else None
            G = q.shape[0] // k.shape[0]
            steps = np.minimum(np.arange(T) + 1, window or T)
            # Sift's sampled rows: the first row with each target step (a full sliding window shares its step).
            calib_rows = np.array(sorted({int(np.flatnonzero(steps == s)[0]) for s in targets if (steps == s).any()}))
            for h in range(q.shape[0]):
                res = analyze_head(q[h], k[h // G], cap.scaling, window, P, taus, calib_rows)
                results.append((w, layer, h, window is not None, res))
            print(f"window {w} layer {layer} done {time.perf_counter() - t0:.0f}s", flush=True)
    t1 = time.perf_counter()

    keys = results[0][4]["keys"]
    nrows = sum(r[4]["S"].size for r in results)
    grid_kept = sum(r[4]["grid_kept"] for r in results) / nrows  # [M, G]
    grid_drop = sum(r[4]["grid_drop"] for r in results) / nrows
    kept0 = np.concatenate([r[4]["kept0"] for r in results])  # [rows, M]
    drop0 = np.concatenate([r[4]["drop0"] for r in results])
    oracle_kept = {tau: kept0[:, keys.index(("ref", "oracle", tau))].mean() for tau in taus}
    shifts = {}
    for j, key in enumerate(keys):
        target = oracle_kept[key[2]]
        # kept fraction falls as the shift grows
        xs, ys = SHIFTS[::-1], grid_kept[j][::-1]
        shifts[key] = float(np.interp(target, ys, xs)) if key[1] != "oracle" else 0.0
        if not ys[0] <= target <= ys[-1]:
            print(f"warning: {key} target {target:.4f} outside the grid's kept range {ys[0]:.4f}..{ys[-1]:.4f}")

    # Pass 2: output errors at equal mean kept fraction, on every error_stride-th decode row. Each predictor at
    # its pass-1 shift plus OFFSETS; its metrics are interpolated to the Oracle's mean kept fraction on these rows.
    err = defaultdict(list)
    cols = [(key, off) for key in keys for off in (OFFSETS if key[1] != "oracle" else (0.0,))]
    for w, layer, h, sliding, res in results:
        cap = caps[w]
        q = cap.query[layer][0].double()
        k, v = cap.key[layer][0].double(), cap.value[layer][0].double()
        G = q.shape[0] // k.shape[0]
        window = cap.sliding_window.get(layer)
        window = int(window) if window and window < T else None
        sel = np.arange(0, T - P, args.error_stride)
        L = np.stack([res["pred"][key][sel] + shifts[key] + off for key, off in cols], -1)
        e, ev, kf, dm = output_errors(q[h], k[h // G], v[h // G], cap.scaling, window, torch.from_numpy(P + sel),
                                      torch.from_numpy(L), taus)
        for name, a in (("err", e), ("err_vmc", ev), ("kept", kf), ("drop", dm)):
            err[name].append(a)
        err["sliding"].append(np.full(sel.size, sliding))
    err = {k_: np.concatenate(v_) for k_, v_ in err.items()}
    col_of = {c: i for i, c in enumerate(cols)}
    eq_target = {tau: err["kept"][:, col_of[(("ref", "oracle", tau), 0.0)]].mean() for tau in taus}

    def at_equal(key, metric, rows=slice(None)):
        """Mean of ``metric`` over pass-2 rows, interpolated in the offset to the Oracle's mean kept fraction."""
        if key[1] == "oracle":
            return float(err[metric][rows, col_of[(key, 0.0)]].mean())
        kept = np.array([err["kept"][:, col_of[(key, o)]].mean() for o in OFFSETS])[::-1]
        vals = np.array([err[metric][rows, col_of[(key, o)]].mean() for o in OFFSETS])[::-1]
        if not kept[0] <= eq_target[key[2]] <= kept[-1]:
            print(f"warning: pass 2 {key} kept {kept[0]:.4f}..{kept[-1]:.4f} misses {eq_target[key[2]]:.4f}")
        return float(np.interp(eq_target[key[2]], kept, vals))

    t2 = time.perf_counter()

    # Summaries.
    logtheta = {tau: np.concatenate([r[4]["logtheta"][:, i] for r in results]) for i, tau in enumerate(taus)}
    layer_of = np.concatenate([np.full(r[4]["S"].size, r[1]) for r in results])
    sliding_of = np.concatenate([np.full(r[4]["S"].size, r[3]) for r in results])
    pred = {key: np.concatenate([r[4]["pred"][key] for r in results]) for key in keys}
    summary = {}
    for j, key in enumerate(keys):
        calib, name, tau = key
        resid = pred[key] - logtheta[tau]
        a = np.abs(resid)
        entry = {
            "abs_log_ratio": {"median": float(np.median(a)), **{k_: v_ for k_, v_ in pct(a, (90, 99)).items()}},
            "log_ratio_mean": float(resid.mean()), "log_ratio_std": float(resid.std()),
            "kept_unshifted": {"mean": float(kept0[:, j].mean()), "std": float(kept0[:, j].std()),
                               "p5": float(np.percentile(kept0[:, j], 5)), "p1": float(np.percentile(kept0[:, j], 1))},
            "drop_unshifted_mean": float(drop0[:, j].mean()),
            "shift": shifts[key],
            "grid_drop_at_shift": float(np.interp(shifts[key], SHIFTS, grid_drop[j])) if name != "oracle" else float(drop0[:, j].mean()),
            "equal_sparsity": {
                "kept_mean": at_equal(key, "kept"), "drop_mean": at_equal(key, "drop"),
                "err_mean": at_equal(key, "err"), "err_vmc_mean": at_equal(key, "err_vmc"),
                # per-row spread at pass 1's shift (offset 0)
                "kept_std": float(err["kept"][:, col_of[(key, 0.0)]].std()),
                "kept_p5": float(np.percentile(err["kept"][:, col_of[(key, 0.0)]], 5)),
                "kept_p1": float(np.percentile(err["kept"][:, col_of[(key, 0.0)]], 1)),
                "err_vmc_p99": float(np.percentile(err["err_vmc"][:, col_of[(key, 0.0)]], 99)),
            },
            "per_layer_median_abs": {int(l): float(np.median(a[layer_of == l])) for l in np.unique(layer_of)},
        }
        if sliding_of.any():
            for kind, m in (("sliding", sliding_of), ("global", ~sliding_of)):
                me = err["sliding"] if kind == "sliding" else ~err["sliding"]
                entry[kind] = {"abs_log_ratio_median": float(np.median(a[m])),
                               "abs_log_ratio_p90": float(np.percentile(a[m], 90)),
                               "kept_unshifted_mean": float(kept0[m, j].mean()), "kept_unshifted_std": float(kept0[m, j].std()),
                               "drop_eq_mean": at_equal(key, "drop", me),
                               "err_vmc_eq_mean": at_equal(key, "err_vmc", me)}
        summary["/".join([calib, name, str(tau)])] = entry
    M = len(cols)
    for i, tau in enumerate(taus):
        c = M + i
        summary[f"ref/topk/{tau}"] = {
            "kept_mean_all_rows": sum(r[4]["topk"][tau][0] for r in results) / nrows,
            "drop_mean_all_rows": sum(r[4]["topk"][tau][1] for r in results) / nrows,
            "equal_sparsity": {"kept_mean": float(err["kept"][:, c].mean()), "kept_std": float(err["kept"][:, c].std()),
                               "drop_mean": float(err["drop"][:, c].mean()), "err_mean": float(err["err"][:, c].mean()),
                               "err_vmc_mean": float(err["err_vmc"][:, c].mean()),
                               "err_vmc_p99": float(np.percentile(err["err_vmc"][:, c], 99))},
        }
    doc = {
        "model": args.model, "data": corpus.source, "seq_len": T, "windows": args.windows, "prompt_rows": P,
        "decode_rows": T - P, "layers": layers, "taus": taus, "heads": int(results[-1][2]) + 1,
        "error_stride": args.error_stride, "pass2_rows": int(err["err"].shape[0]), "pass1_rows": int(nrows),
        "predictors": {k_: ["1", "logS", *v_] for k_, v_ in PREDICTORS.items()},
        "calibrations": {"sift": "64 geometric prompt rows (PromptCalibration), recalibrated every 64 decode rows, decay 0.9",
                         "dense": "every prompt row with S >= 8, no recalibration",
                         "uniform": "as many prompt rows as sift, evenly spaced in S, recalibrated as sift",
                         "dense_recal": "every prompt row with S >= 8, recalibrated as sift"},
        "oracle_kept_mean": {str(t): float(v_) for t, v_ in oracle_kept.items()},
        "oracle_kept_mean_pass2": {str(t): float(v_) for t, v_ in eq_target.items()},
        "timing_s": {"pass1": round(t1 - t0, 1), "pass2": round(t2 - t1, 1)},
        "results": summary,
    }
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f}s")


def report(paths: list[str], calib: str = "sift") -> None:
    """Markdown tables of finished runs (``--report A.json B.json``)."""
    names = ["plain", "pmax", "lse", "pmax_lse", "fb", "pmax_fb"]
    print(f"calibration: {calib}\n")
    print("| model | tau | predictor | median abs log(theta_hat/theta) | p90 | p99 | kept mean | std | p5 | p1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        d = json.load(open(path))
        for tau in d["taus"]:
            for name in names + ["prev_exact"]:
                key = f"{'ref' if name == 'prev_exact' else calib}/{name}/{tau}"
                r = d["results"][key]
                a, k = r["abs_log_ratio"], r["kept_unshifted"]
                print(f"| {d['model']} | {tau} | {name} | {a['median']:.3f} | {a['p90']:.3f} | {a['p99']:.3f} | "
                      f"{k['mean']:.4f} | {k['std']:.4f} | {k['p5']:.4f} | {k['p1']:.4f} |")
    print("\nAt equal mean kept fraction (the Oracle's), pass-2 rows:\n")
    print("| model | tau | method | kept | dropped mass | rel. error | rel. error, vmc | vmc p99 |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        d = json.load(open(path))
        for tau in d["taus"]:
            for name in ["oracle", "topk"] + names + ["prev_exact"]:
                key = f"{'ref' if name in ('oracle', 'topk', 'prev_exact') else calib}/{name}/{tau}"
                e = d["results"][key]["equal_sparsity"]
                print(f"| {d['model']} | {tau} | {name} | {e['kept_mean']:.4f} | {e['drop_mean']:.4f} | "
                      f"{e['err_mean']:.4f} | {e['err_vmc_mean']:.4f} | {e['err_vmc_p99']:.3f} |")


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "--report":
        calib = "dense" if "--dense" in sys.argv else "sift"
        report([a for a in sys.argv[2:] if a != "--dense"], calib)
    else:
        main()
