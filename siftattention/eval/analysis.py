"""The paper's power-law analysis (Section 3, Appendix A) on real models and data.

For every (window, layer, head, tau) the tau-quantile series theta_S, S = 1..seq_len,
of the teacher-forced attention probabilities is recorded by a small ``Method``
(:class:`QuantileRecorder`) that returns exact attention, so no layer's full attention
matrix outlives its own row chunk. Each series is then fitted with the closed-form
log-log least squares of ``siftattention.powerlaw``:

- the full-series fit over S = 1..seq_len with its in-sample R^2 (log space);
- for every warmup w, the fit on S <= w evaluated over all S (out-of-sample R^2, which
  can be negative; kept raw).

Steps. S is the generation step (absolute position + 1), the paper's x axis. For a
causal layer it equals the number of keys the row attends to. A sliding-window layer
(Gemma-3) attends to min(S, window) keys: its quantiles are taken over exactly those
keys, plotted against the same generation step, and its statistics are reported
separately, with an extra fit restricted to S <= window (where sliding and global
attention see the same keys).

Quantiles. Linear interpolation between order statistics over the causally valid keys
(``torch.quantile``'s rule, interpolated by ``powerlaw.quantile_of_sorted``). All taus come
from one sort per row; rows are sorted in blocks cut to the keys that block can see,
with numpy's (SIMD) sort, which is several times faster than ``torch.sort`` on CPU.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..inputs import forward_kwargs
from ..methods.base import Method, Rows, Selection
from ..powerlaw import fit_power_law, quantile_of_sorted

#: Percentiles reported for every R^2 distribution (the paper's box plots: 5/25/50/75/95).
PERCENTILES = {"p5": 5.0, "p25": 25.0, "median": 50.0, "p75": 75.0, "p95": 95.0}


class AnalysisError(ValueError):
    """Bad analysis input (taus, warmups, lengths, an empty corpus); the message is one line."""


# -- input parsing ------------------------------------------------------------------------


def parse_taus(text: str | Sequence[float]) -> list[tuple[str, float]]:
    """``"0.5,0.75"`` -> ``[("0.5", 0.5), ("0.75", 0.75)]``; every tau must lie in (0, 1)."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else [str(t) for t in text]
    items = [t for t in items if t]
    if not items:
        raise AnalysisError("--taus is empty: give comma-separated quantile levels in (0, 1), e.g. 0.5,0.75,0.875")
    out: list[tuple[str, float]] = []
    for item in items:
        try:
            tau = float(item)
        except ValueError:
            raise AnalysisError(f"tau {item!r} is not a number") from None
        if not (0.0 < tau < 1.0) or math.isnan(tau):
            raise AnalysisError(f"tau must be in (0, 1), got {item}")
        if any(tau == t for _, t in out):
            raise AnalysisError(f"tau {item} is given twice")
        out.append((item, tau))
    return out


def parse_warmups(text: str | Sequence[int], seq_len: int) -> list[tuple[str, int]]:
    """``"64,128"`` -> ``[("64", 64), ("128", 128)]``; each warmup must be in [2, seq_len]."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else [str(t) for t in text]
    items = [t for t in items if t]
    out: list[tuple[str, int]] = []
    for item in items:
        try:
            w = int(item)
        except ValueError:
            raise AnalysisError(f"warmup {item!r} is not an integer") from None
        if w < 2:
            raise AnalysisError(f"a warmup needs at least 2 steps to fit a power law, got {item}")
        if w > seq_len:
            raise AnalysisError(f"warmup {w} is longer than the sequence length {seq_len}")
        if any(w == v for _, v in out):
            raise AnalysisError(f"warmup {item} is given twice")
        out.append((item, w))
    return out


#: Shortest window analysed: a power law through two points fits them exactly (R^2 = 1 by construction).
MIN_SEQ_LEN = 3
#: Below this many steps R^2 says little about a power law; the CLI warns.
FEW_STEPS = 16


def check_lengths(seq_len: int, num_seqs: int) -> None:
    if seq_len < MIN_SEQ_LEN:
        raise AnalysisError(
            f"--seq-len must be at least {MIN_SEQ_LEN}, got {seq_len}: a power law through {max(seq_len, 0)} "
            "point(s) fits exactly, so its R^2 would be 1 by construction"
        )
    if num_seqs < 1:
        raise AnalysisError(f"--num-seqs must be at least 1, got {num_seqs}")


# -- quantiles of attention rows ----------------------------------------------------------


def _sorted_block_quantiles(probs: np.ndarray, valid: np.ndarray, taus: Sequence[float]) -> np.ndarray:
    """Quantiles [B, H, r, T] of a block [B, H, r, k] over its valid keys (valid [B, 1|H, r, k])."""
    filled = np.where(valid, probs, np.float32(np.inf))  # invalid keys sort to the end
    filled.sort(axis=-1, kind="quicksort")  # numpy's SIMD sort for float32
    ascending, n = torch.from_numpy(filled), torch.from_numpy(valid.sum(-1))
    # The interpolation of every other quantile in the library (powerlaw.masked_quantile).
    return torch.stack([quantile_of_sorted(ascending, n, tau) for tau in taus], -1).numpy()


def row_quantiles(
    probs: torch.Tensor,
    valid: torch.Tensor,
    taus: Sequence[float],
    *,
    block_rows: int = 128,
) -> torch.Tensor:
    """tau-quantiles of each row over its valid keys: probs [B, H, R, K], valid [B, 1|H, R, K] -> [B, H, R, T].

    Equal to ``torch.quantile`` over the valid entries of each row (linear
    interpolation), with all taus from one sort. Rows are handled in blocks of
    ``block_rows``, each cut to the key columns that block can see (a causal prefix or
    a sliding-window band), which halves the sorting work of a causal matrix. Rows
    with no valid key give 0.
    """
    p = probs.detach().to("cpu", torch.float32).numpy()
    v = valid.detach().to("cpu", torch.bool).numpy()
    B, H, R, K = p.shape
    out = np.zeros((B, H, R, len(taus)), dtype=np.float32)
    taus = [float(t) for t in taus]

    def block(r0: int) -> None:
        r1 = min(R, r0 + block_rows)
        vb = v[:, :, r0:r1]
        cols = np.flatnonzero(vb.any(axis=(0, 1, 2)))
        if cols.size == 0:
            return
        k0, k1 = int(cols[0]), int(cols[-1]) + 1
        out[:, :, r0:r1] = _sorted_block_quantiles(p[:, :, r0:r1, k0:k1], vb[..., k0:k1], taus)

    for r0 in range(0, R, max(1, block_rows)):
        block(r0)
    return torch.from_numpy(out)


# -- the recorder method ---------------------------------------------------------------------


@dataclass
class RecorderState:
    """Per-layer record of one forward pass: theta chunks [B, H, r, T] in row order."""

    thetas: list[np.ndarray] = field(default_factory=list)
    key_counts: list[np.ndarray] = field(default_factory=list)  # [B, r] valid keys of each row

    def series(self) -> np.ndarray:
        """[B, H, Q, T] float32, every row of the forward pass in order."""
        return np.concatenate(self.thetas, axis=2)

    def counts(self) -> np.ndarray:
        """[B, Q] number of valid keys of each row."""
        return np.concatenate(self.key_counts, axis=1)


@dataclass
class QuantileRecorder(Method):
    """Exact attention that records theta_S[tau] of every (sequence, head, row) of each layer.

    Use it in a teacher-forced forward pass with no past keys (``apply(model,
    QuantileRecorder(taus))`` then ``model(ids)``); afterwards ``handle.states[layer]``
    holds the layer's :class:`RecorderState`.
    """

    taus: tuple[float, ...] = (0.5, 0.75, 0.875)
    block_rows: int = 128
    name = "quantile-recorder"

    def __post_init__(self) -> None:
        self.taus = tuple(tau for _, tau in parse_taus(list(self.taus)))

    def new_state(self, batch: int, heads: int, device: torch.device, layer: int = 0) -> RecorderState:
        return RecorderState()

    def select(self, rows: Rows, state: RecorderState) -> Selection:
        theta = row_quantiles(rows.probs, rows.valid, self.taus, block_rows=self.block_rows)
        state.thetas.append(theta.numpy())
        state.key_counts.append(rows.steps.detach().to("cpu", torch.int32).numpy())
        return Selection(keep=None, approx=rows.is_step)


# -- running it on a model ------------------------------------------------------------------


def text_config(model: torch.nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(model: torch.nn.Module) -> list[str] | None:
    """``config.layer_types`` (e.g. Gemma-3's ``sliding_attention`` / ``full_attention``), or None."""
    types = getattr(text_config(model), "layer_types", None)
    return list(types) if types else None


def _decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    for path in ("model.layers", "model.language_model.layers", "transformer.h", "model.decoder.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []


def record_series(
    model: torch.nn.Module,
    windows: torch.Tensor,
    taus: Sequence[float],
    *,
    on_window: Callable[[int], None] | None = None,
    on_layer: Callable[[int], None] | None = None,
    block_rows: int = 128,
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced quantile series of ``windows`` [N, T] (one window per forward pass).

    Returns ``thetas`` [N, L, H, T, len(taus)] float32 and ``key_counts`` [L, T], the
    number of keys each row of each layer attends to (identical for every window).
    ``on_window(i)`` / ``on_layer(l)`` report progress.
    """
    from ..hf import apply

    if windows.dim() != 2 or windows.shape[1] < 2:
        raise AnalysisError(f"windows must be [N, T] with T >= 2, got {tuple(windows.shape)}")
    recorder = QuantileRecorder(taus=tuple(taus), block_rows=block_rows)
    hooks = []
    if on_layer is not None:
        for i, layer in enumerate(_decoder_layers(model)):
            hooks.append(layer.register_forward_hook(lambda *_, i=i: on_layer(i)))
    device = next(model.parameters()).device
    logits = {"logits_to_keep": 1} if "logits_to_keep" in forward_kwargs(model) else {}  # the last position's only
    per_window: list[np.ndarray] = []
    counts: np.ndarray | None = None
    try:
        with apply(model, recorder) as handle, torch.inference_mode():
            for i in range(windows.shape[0]):
                ids = windows[i : i + 1].to(device)
                model(input_ids=ids, use_cache=False, **logits)
                layers = sorted(handle.states)
                per_window.append(np.stack([handle.states[l].series()[0] for l in layers]))  # [L, H, T, taus]
                if counts is None:
                    counts = np.stack([handle.states[l].counts()[0] for l in layers])
                handle.reset()
                if on_window is not None:
                    on_window(i)
    finally:
        for h in hooks:
            h.remove()
    assert counts is not None
    return np.stack(per_window), counts


# -- fits -------------------------------------------------------------------------------------


@dataclass
class SeriesFits:
    """Fits of series [..., T]: full-series and per-warmup (alpha, beta fitted on S <= w, R^2 over all S)."""

    alpha: np.ndarray  # [...]
    beta: np.ndarray
    r2: np.ndarray
    warmup_alpha: np.ndarray  # [W, ...]
    warmup_beta: np.ndarray
    warmup_r2: np.ndarray


def fit_series(steps: np.ndarray, thetas: np.ndarray, warmups: Sequence[int]) -> SeriesFits:
    """Power-law fits of ``thetas`` [..., T] at ``steps`` [T] (float64 throughout)."""
    s = torch.as_tensor(np.asarray(steps), dtype=torch.float64)
    th = torch.as_tensor(np.asarray(thetas)).to(torch.float64)
    full = fit_power_law(s, th)
    wa, wb, wr = [], [], []
    for w in warmups:
        if not 2 <= w <= s.shape[0]:
            raise AnalysisError(f"warmup {w} must be in [2, {s.shape[0]}]")
        fit = fit_power_law(s[:w], th[..., :w])
        wa.append(fit.alpha)
        wb.append(fit.beta)
        wr.append(fit.r_squared(s, th))  # out of sample: over every step
    stack = lambda xs: torch.stack(xs).numpy() if xs else np.zeros((0,) + tuple(th.shape[:-1]))  # noqa: E731
    return SeriesFits(full.alpha.numpy(), full.beta.numpy(), full.r2.numpy(), stack(wa), stack(wb), stack(wr))


def distribution(values: np.ndarray, *, negative: bool = False) -> dict[str, float]:
    """The box-plot statistics of ``values`` (flattened, finite ones only)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        out = {k: float("nan") for k in PERCENTILES}
    else:
        out = {k: float(np.percentile(v, q)) for k, q in PERCENTILES.items()}
    out = {"median": out["median"], **{k: out[k] for k in ("p5", "p25", "p75", "p95")}}
    if negative:
        out["frac_negative"] = float((v < 0).mean()) if v.size else float("nan")
    out["n"] = int(v.size)
    return out


# -- the whole analysis -----------------------------------------------------------------------


@dataclass
class AnalysisResult:
    """Everything one analysis produced; ``summary()`` is the JSON, ``save()`` writes it and the arrays."""

    model: str
    dataset: str
    data_source: str
    seq_len: int
    num_seqs: int
    tau_keys: list[str]
    taus: list[float]
    warmup_keys: list[str]
    warmups: list[int]
    thetas: np.ndarray  # [N, L, H, T, taus] float32
    key_counts: np.ndarray  # [L, T] keys attended by each row of each layer
    alpha: np.ndarray  # [taus, N, L, H]
    beta: np.ndarray
    r2: np.ndarray
    warmup_alpha: np.ndarray  # [taus, W, N, L, H]
    warmup_beta: np.ndarray
    warmup_r2: np.ndarray
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    window_r2: np.ndarray | None = None  # [taus, N, L, H] fit on S <= sliding_window (sliding models only)
    timing: dict[str, Any] = field(default_factory=dict)
    command: str | None = None

    @property
    def steps(self) -> np.ndarray:
        return np.arange(1, self.seq_len + 1, dtype=np.float64)

    @property
    def num_layers(self) -> int:
        return int(self.thetas.shape[1])

    @property
    def num_heads(self) -> int:
        return int(self.thetas.shape[2])

    def layers_of_type(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types or []) if t == kind]

    def _stats(self, layers: Sequence[int] | None = None) -> dict[str, Any]:
        sel = slice(None) if layers is None else list(layers)
        r2 = {tk: distribution(self.r2[t][:, sel]) for t, tk in enumerate(self.tau_keys)}
        warm = {
            tk: {wk: distribution(self.warmup_r2[t, w][:, sel], negative=True) for w, wk in enumerate(self.warmup_keys)}
            for t, tk in enumerate(self.tau_keys)
        }
        return {"r2": r2, "warmup_r2": warm}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "dataset": self.dataset,
            "data_source": self.data_source,
            "seq_len": self.seq_len,
            "num_seqs": self.num_seqs,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "steps": "S = generation step = absolute position + 1 (1..seq_len); quantiles over the keys each row attends to",
            **self._stats(),
            "per_layer": {
                tk: {
                    str(layer): {
                        "alpha_median": float(np.median(self.alpha[t][:, layer])),
                        "beta_median": float(np.median(self.beta[t][:, layer])),
                        "r2_median": float(np.median(self.r2[t][:, layer])),
                    }
                    for layer in range(self.num_layers)
                }
                for t, tk in enumerate(self.tau_keys)
            },
            "zero_thetas": {tk: int((self.thetas[..., t] <= 0).sum()) for t, tk in enumerate(self.tau_keys)},
        }
        if self.layer_types:
            by_type: dict[str, Any] = {}
            for kind in dict.fromkeys(self.layer_types):
                layers = self.layers_of_type(kind)
                entry = {"layers": layers, **self._stats(layers)}
                if self.window_r2 is not None and self.sliding_window:
                    # Sliding layers: the steps where they see the same keys as global layers;
                    # global layers: the same steps, as the like-for-like control.
                    entry["sliding_window"] = self.sliding_window
                    entry["r2_within_window"] = {
                        tk: distribution(self.window_r2[t][:, layers]) for t, tk in enumerate(self.tau_keys)
                    }
                by_type[kind] = entry
            out["by_layer_type"] = by_type
        if self.timing:
            out["timing"] = self.timing
        if self.command:
            out["command"] = self.command
        return out

    def files(self) -> dict[str, bytes]:
        """``summary.json`` and ``series.npz``, as the bytes ``save`` writes."""
        import io

        from ..output import json_bytes

        arrays = dict(
            thetas=self.thetas,
            steps=self.steps,
            key_counts=self.key_counts,
            taus=np.asarray(self.taus),
            tau_keys=np.asarray(self.tau_keys),
            warmups=np.asarray(self.warmups),
            warmup_keys=np.asarray(self.warmup_keys),
            alpha=self.alpha,
            beta=self.beta,
            r2=self.r2,
            warmup_alpha=self.warmup_alpha,
            warmup_beta=self.warmup_beta,
            warmup_r2=self.warmup_r2,
            layer_types=np.asarray(self.layer_types or []),
        )
        if self.window_r2 is not None:
            arrays["window_r2"] = self.window_r2
        series = io.BytesIO()
        np.savez(series, **arrays)
        return {"summary.json": json_bytes(self.summary()), "series.npz": series.getvalue()}

    def save(self, out_dir) -> dict[str, Any]:
        """Write ``summary.json`` and ``series.npz`` into ``out_dir`` (both or neither); returns the summary."""
        from pathlib import Path

        from ..output import save_run

        save_run(Path(out_dir), self.files())
        return self.summary()


def fit_all(
    thetas: np.ndarray, taus: Sequence[float], warmups: Sequence[int], sliding_window: int | None = None
) -> tuple[SeriesFits, np.ndarray | None]:
    """Fits of every tau of ``thetas`` [N, L, H, T, taus]; arrays come back tau-major."""
    steps = np.arange(1, thetas.shape[3] + 1, dtype=np.float64)
    fits, window = [], []
    for t in range(len(taus)):
        series = thetas[..., t]
        fits.append(fit_series(steps, series, warmups))
        if sliding_window is not None and 2 <= sliding_window < steps.size:
            window.append(fit_series(steps[:sliding_window], series[..., :sliding_window], []).r2)
    stacked = SeriesFits(*(np.stack([getattr(f, name) for f in fits]) for name in SeriesFits.__dataclass_fields__))
    return stacked, (np.stack(window) if window else None)


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB, macOS bytes)."""
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def load_analysis_corpus(dataset: str, data_file: str | None = None):
    """``data.load_corpus`` that also refuses an empty corpus (before any model is loaded)."""
    from ..data import load_corpus

    corpus = load_corpus(dataset, data_file)
    if not corpus.text.strip():
        raise AnalysisError(f"the corpus is empty ({corpus.source})")
    return corpus


def run_analysis(
    model_name: str,
    dataset: str,
    *,
    data_file: str | None = None,
    seq_len: int = 2048,
    num_seqs: int = 8,
    taus: str | Sequence[float] = "0.5,0.75,0.875",
    warmups: str | Sequence[int] = "64,128,256,512",
    loaded: tuple[Any, Any] | None = None,
    corpus: Any = None,
    on_loaded: Callable[[Any, torch.Tensor, str], None] | None = None,
    on_window: Callable[[int], None] | None = None,
    on_layer: Callable[[int], None] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> AnalysisResult:
    """Validate, load corpus then model, record, fit. Cheap checks run before any slow work."""
    from ..data import token_windows
    from ..models import load_model

    start = time.perf_counter()
    check_lengths(seq_len, num_seqs)
    tau_items = parse_taus(taus)
    warm_items = parse_warmups(warmups, seq_len)
    corpus = corpus if corpus is not None else load_analysis_corpus(dataset, data_file)
    model, tokenizer = loaded if loaded is not None else load_model(model_name, dtype=dtype, device=device)
    loaded_at = time.perf_counter()
    try:
        windows = token_windows(corpus.text, tokenizer, seq_len, num_seqs)
    except ValueError as err:
        raise AnalysisError(f"{err} ({corpus.source})") from None
    if on_loaded is not None:
        on_loaded(model, windows, corpus.source)
    tau_vals = [t for _, t in tau_items]
    thetas, counts = record_series(model, windows, tau_vals, on_window=on_window, on_layer=on_layer)
    recorded_at = time.perf_counter()
    types = layer_types(model)
    window = getattr(text_config(model), "sliding_window", None) if types and "sliding_attention" in types else None
    fits, window_r2 = fit_all(thetas, tau_vals, [w for _, w in warm_items], window)
    done = time.perf_counter()
    return AnalysisResult(
        model=model_name,
        dataset=dataset,
        data_source=corpus.source,
        seq_len=seq_len,
        num_seqs=num_seqs,
        tau_keys=[k for k, _ in tau_items],
        taus=tau_vals,
        warmup_keys=[k for k, _ in warm_items],
        warmups=[w for _, w in warm_items],
        thetas=thetas,
        key_counts=counts,
        alpha=fits.alpha,
        beta=fits.beta,
        r2=fits.r2,
        warmup_alpha=fits.warmup_alpha,
        warmup_beta=fits.warmup_beta,
        warmup_r2=fits.warmup_r2,
        layer_types=types,
        sliding_window=int(window) if window else None,
        window_r2=window_r2,
        timing={
            "load_s": round(loaded_at - start, 1),
            "record_s": round(recorded_at - loaded_at, 1),
            "fit_s": round(done - recorded_at, 1),
            "total_s": round(done - start, 1),
            "peak_rss_mb": round(peak_rss_mb(), 0),
            "torch_threads": torch.get_num_threads(),
        },
    )


def load_result(out_dir) -> AnalysisResult:
    """Read back what ``AnalysisResult.save`` wrote (to redraw figures or re-summarise)."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    summary = json.loads((out / "summary.json").read_text())
    with np.load(out / "series.npz") as z:
        arrays = {k: z[k] for k in z.files}
    by_type = summary.get("by_layer_type", {})
    window = by_type.get("sliding_attention", {}).get("sliding_window")
    return AnalysisResult(
        model=summary["model"],
        dataset=summary["dataset"],
        data_source=summary["data_source"],
        seq_len=int(summary["seq_len"]),
        num_seqs=int(summary["num_seqs"]),
        tau_keys=[str(k) for k in arrays["tau_keys"]],
        taus=[float(t) for t in arrays["taus"]],
        warmup_keys=[str(k) for k in arrays["warmup_keys"]],
        warmups=[int(w) for w in arrays["warmups"]],
        thetas=arrays["thetas"],
        key_counts=arrays["key_counts"],
        alpha=arrays["alpha"],
        beta=arrays["beta"],
        r2=arrays["r2"],
        warmup_alpha=arrays["warmup_alpha"],
        warmup_beta=arrays["warmup_beta"],
        warmup_r2=arrays["warmup_r2"],
        layer_types=[str(t) for t in arrays["layer_types"]] or None,
        sliding_window=window,
        window_r2=arrays.get("window_r2"),
        timing=summary.get("timing", {}),
        command=summary.get("command"),
    )
