"""Figures and ``report.md`` of a power-law analysis (``siftattention.eval.analysis``).

Figures (PNG, each readable on its own):

- ``series_samples.png``: sample quantile series with their power-law fits, log y axis,
  every 10th step (the paper's Figure 2, left), at several R^2 percentiles;
- ``r2_box.png``: R^2 of the full-series fit per tau (box 25-75, median, whiskers 5-95);
- ``warmup_r2_box.png``: out-of-sample R^2 of the warmup fits per w and tau (raw, with
  the lower axis clipped where the whiskers go far below zero, which the figure says);
- ``beta_heatmap.png``: layer x head median beta per tau;
- ``r2_box_by_layer_type.png`` (models with sliding-window layers): global vs sliding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..output import save_figure, write_text
from .analysis import AnalysisResult

#: What the paper reports (Section 3, Figures 2-3; Appendix A), for side-by-side tables.
PAPER = {
    "r2_median": "0.6-0.8",
    "r2_p5": "~0.4",
    "warmup_512_median": ">= ~0.6",
    "warmup_trend": "rises with w; many < 0 at w = 64",
    "setup": "Llama-3.1 8B/70B, Llama-3.2 3B, Mistral 7B, Qwen2.5 7B; WikiText-2 and C4; 4096-token sequences",
}

#: Lower y limit of the warmup box plot; whiskers below it are cut (and the figure says so).
WARMUP_YMIN = -1.0

TYPE_LABELS = {"full_attention": "global", "sliding_attention": "sliding-window"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _box_stats(values: np.ndarray, label: str) -> dict[str, Any]:
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    p5, p25, p50, p75, p95 = np.percentile(v, [5, 25, 50, 75, 95]) if v.size else [np.nan] * 5
    return {"label": label, "whislo": p5, "q1": p25, "med": p50, "q3": p75, "whishi": p95, "fliers": []}


def _title(result: AnalysisResult) -> str:
    return f"{result.model} on {result.dataset}, {result.num_seqs} x {result.seq_len} tokens"


def _colors(n: int) -> list:
    plt = _plt()
    cmap = plt.get_cmap("viridis")
    return [cmap(x) for x in np.linspace(0.1, 0.8, max(n, 1))]


def pick_samples(result: AnalysisResult, percentiles: Sequence[float] = (90, 50, 25, 10)) -> list[tuple[float, tuple[int, int, int]]]:
    """(percentile, (window, layer, head)) whose mean-over-taus R^2 sits at each percentile."""
    mean_r2 = result.r2.mean(axis=0)  # [N, L, H]
    flat = mean_r2.ravel()
    order = np.argsort(flat, kind="stable")
    picks = []
    for q in percentiles:
        idx = order[min(len(order) - 1, int(round(q / 100 * (len(order) - 1))))]
        picks.append((q, tuple(int(i) for i in np.unravel_index(idx, mean_r2.shape))))
    return picks


def plot_series_samples(result: AnalysisResult, path: Path, every: int = 10) -> Path:
    plt = _plt()
    picks = pick_samples(result)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    steps = result.steps
    shown = np.arange(0, result.seq_len, every)
    colors = _colors(len(result.taus))
    for ax, (q, (n, layer, head)) in zip(axes.ravel(), picks):
        for t, (tk, color) in enumerate(zip(result.tau_keys, colors)):
            theta = result.thetas[n, layer, head, :, t].astype(np.float64)
            ax.scatter(steps[shown], theta[shown], s=6, color=color, alpha=0.6, label=f"τ={tk} quantile")
            fit = result.alpha[t, n, layer, head] * steps ** (-result.beta[t, n, layer, head])
            ax.plot(steps, fit, color=color, lw=1.6,
                    label=f"fit {result.alpha[t, n, layer, head]:.2g}·S^-{result.beta[t, n, layer, head]:.2f} (R²={result.r2[t, n, layer, head]:.2f})")
        kind = ""
        if result.layer_types:
            kind = f", {TYPE_LABELS.get(result.layer_types[layer], result.layer_types[layer])}"
        ax.set_title(f"p{q:g} of R² (mean over τ): window {n}, layer {layer}{kind}, head {head}", fontsize=9)
        ax.set_yscale("log")
        ax.set_xlabel("generation step S")
        ax.set_ylabel("τ-quantile of attention probs θ_S (log)")
        ax.legend(fontsize=6.5, loc="upper right")
        if result.sliding_window and result.layer_types and result.layer_types[layer] == "sliding_attention":
            ax.axvline(result.sliding_window, color="grey", ls=":", lw=1)
    fig.suptitle(f"Attention quantiles and power-law fits (every {every}th step shown): {_title(result)}", fontsize=10)
    return save_figure(fig, path, dpi=110)


def plot_r2_box(result: AnalysisResult, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.2), constrained_layout=True)
    stats = [_box_stats(result.r2[t], f"τ={tk}") for t, tk in enumerate(result.tau_keys)]
    ax.axhspan(0.6, 0.8, color="tab:orange", alpha=0.15, label="paper: medians 0.6-0.8")
    ax.axhline(0.4, color="tab:orange", ls="--", lw=1, label="paper: p5 ~0.4")
    bp = ax.bxp(stats, showfliers=False, patch_artist=True, medianprops={"color": "black"})
    for patch, color in zip(bp["boxes"], _colors(len(stats))):
        patch.set_facecolor(color)
        patch.set_alpha(0.7)
    for i, s in enumerate(stats, start=1):
        ax.text(i + 0.27, s["med"], f"{s['med']:.2f}", fontsize=8, va="center")
    ax.set_ylabel("R² of the power-law fit over S = 1..seq-len")
    ax.set_xlabel("quantile level τ")
    ax.set_title(f"R² over windows × layers × heads\n{_title(result)}\nbox 25-75%, line median, whiskers 5-95%", fontsize=9)
    ax.set_ylim(min(0.0, min(s["whislo"] for s in stats) - 0.05), 1.02)
    ax.legend(fontsize=7, loc="lower left")
    return save_figure(fig, path, dpi=110)


def plot_warmup_box(result: AnalysisResult, path: Path, ymin: float = WARMUP_YMIN, layer_kind: str | None = None) -> Path:
    """Warmup R^2 per w and tau; ``layer_kind`` restricts it to one layer type (e.g. "full_attention")."""
    plt = _plt()
    layers = result.layers_of_type(layer_kind) if layer_kind else list(range(result.num_layers))
    warmup_r2 = result.warmup_r2[:, :, :, layers]
    n_t, n_w = len(result.taus), len(result.warmups)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * n_w + 2), 4.6), constrained_layout=True)
    width = 0.8 / max(n_t, 1)
    colors = _colors(n_t)
    clipped = False
    for t, (tk, color) in enumerate(zip(result.tau_keys, colors)):
        stats, pos = [], []
        for w, wk in enumerate(result.warmup_keys):
            s = _box_stats(warmup_r2[t, w], "")
            clipped |= bool(s["whislo"] < ymin)
            stats.append(s)
            pos.append(w + (t - (n_t - 1) / 2) * width)
            frac = float((warmup_r2[t, w] < 0).mean())
            ax.text(pos[-1], 1.04, f"{frac:.0%}", ha="center", va="center", fontsize=7)
        bp = ax.bxp(stats, positions=pos, widths=width * 0.85, showfliers=False, patch_artist=True,
                    medianprops={"color": "black"}, manage_ticks=False)
        for patch in bp["boxes"]:
            patch.set_facecolor(color)
            patch.set_alpha(0.7)
        bp["boxes"][0].set_label(f"τ={tk}")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.axhline(0.6, color="tab:orange", ls="--", lw=1, label="paper: median ~0.6 at w=512")
    ax.set_xticks(range(n_w), [f"w={wk}" for wk in result.warmup_keys])
    ax.set_xlabel("warmup length w (fit on S ≤ w, R² over all S)")
    ax.set_ylabel("out-of-sample R² (log space)")
    ax.set_ylim(ymin, 1.09)
    note = "numbers on top: fraction of fits with R² < 0"
    if clipped:
        note += f"; axis cut at {ymin:g}, lower whiskers run below it (raw values in summary.json)"
    which = f", {TYPE_LABELS.get(layer_kind, layer_kind)} layers only ({len(layers)})" if layer_kind else ""
    ax.set_title(f"Warmup-fit R² (box 25-75%, median, whiskers 5-95%)\n{_title(result)}{which}\n{note}", fontsize=8.5)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return save_figure(fig, path, dpi=110)


def plot_beta_heatmap(result: AnalysisResult, path: Path) -> Path:
    plt = _plt()
    beta = np.median(result.beta, axis=1)  # [taus, L, H]
    n_t = len(result.taus)
    fig, axes = plt.subplots(1, n_t, figsize=(1.5 + n_t * (0.25 * result.num_heads + 0.8), 1.5 + 0.2 * result.num_layers),
                             constrained_layout=True, squeeze=False)
    lo, hi = float(np.min(beta)), float(np.max(beta))
    labels = [str(i) for i in range(result.num_layers)]
    if result.layer_types:
        labels = [f"{i} {'G' if t == 'full_attention' else 'S' if t == 'sliding_attention' else t}"
                  for i, t in enumerate(result.layer_types)]
    for t, ax in enumerate(axes[0]):
        im = ax.imshow(beta[t], aspect="auto", cmap="magma", vmin=lo, vmax=hi, origin="upper")
        ax.set_title(f"τ={result.tau_keys[t]}", fontsize=9)
        ax.set_xlabel("head")
        ax.set_xticks(range(result.num_heads))
        ax.set_yticks(range(result.num_layers), labels, fontsize=7)
        if t == 0:
            ax.set_ylabel("layer" + (" (G global, S sliding)" if result.layer_types else ""))
    fig.colorbar(im, ax=axes[0].tolist(), label="median β over windows (θ_S ≈ α·S^-β)")
    fig.suptitle(f"Power-law exponent β per layer and head: {_title(result)}", fontsize=9)
    return save_figure(fig, path, dpi=110)


def plot_r2_by_layer_type(result: AnalysisResult, path: Path) -> Path | None:
    if not result.layer_types:
        return None
    plt = _plt()
    kinds = list(dict.fromkeys(result.layer_types))
    groups: list[tuple[str, np.ndarray]] = []
    for kind in kinds:
        layers = result.layers_of_type(kind)
        name = TYPE_LABELS.get(kind, kind)
        where = f"layers {', '.join(map(str, layers))}" if len(layers) <= 4 else f"{len(layers)} layers"
        groups.append((f"{name}\n({where})", result.r2[:, :, layers]))
    if result.window_r2 is not None:
        for kind in kinds:
            layers = result.layers_of_type(kind)
            name = TYPE_LABELS.get(kind, kind)
            groups.append((f"{name}\nrefit on S ≤ {result.sliding_window}", result.window_r2[:, :, layers]))
    n_t = len(result.taus)
    fig, ax = plt.subplots(figsize=(2.4 * len(groups) + 2, 4.4), constrained_layout=True)
    width = 0.8 / n_t
    for t, (tk, color) in enumerate(zip(result.tau_keys, _colors(n_t))):
        stats = [_box_stats(values[t], "") for _, values in groups]
        pos = [g + (t - (n_t - 1) / 2) * width for g in range(len(groups))]
        bp = ax.bxp(stats, positions=pos, widths=width * 0.85, showfliers=False, patch_artist=True,
                    medianprops={"color": "black"}, manage_ticks=False)
        for patch in bp["boxes"]:
            patch.set_facecolor(color)
            patch.set_alpha(0.7)
        bp["boxes"][0].set_label(f"τ={tk}")
    ax.axhspan(0.6, 0.8, color="tab:orange", alpha=0.15, label="paper: medians 0.6-0.8")
    ax.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=8)
    ax.set_ylabel("R² of the power-law fit (log space)")
    ax.set_title(f"R² by layer type (box 25-75%, median, whiskers 5-95%)\n{_title(result)}; S = generation step", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return save_figure(fig, path, dpi=110)


#: Every file this module may write; ``warmup_r2_box_<layer type>.png`` come on top.
OUTPUT_NAMES = ("series_samples.png", "r2_box.png", "warmup_r2_box.png", "beta_heatmap.png", "r2_box_by_layer_type.png", "report.md")


def output_files(out_dir: Path) -> list[str]:
    """Names of the figure and report files of an analysis present in ``out_dir`` (from any run)."""
    out_dir = Path(out_dir)
    per_type = sorted(p.name for p in out_dir.glob("warmup_r2_box_*.png"))
    return [name for name in OUTPUT_NAMES if (out_dir / name).is_file()] + per_type


def write_figures(result: AnalysisResult, out_dir: Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {
        "series_samples": plot_series_samples(result, out_dir / "series_samples.png"),
        "r2_box": plot_r2_box(result, out_dir / "r2_box.png"),
        "warmup_r2_box": plot_warmup_box(result, out_dir / "warmup_r2_box.png"),
        "beta_heatmap": plot_beta_heatmap(result, out_dir / "beta_heatmap.png"),
    }
    by_type = plot_r2_by_layer_type(result, out_dir / "r2_box_by_layer_type.png")
    if by_type is not None:
        figures["r2_box_by_layer_type"] = by_type
        for kind in dict.fromkeys(result.layer_types or []):
            figures[f"warmup_r2_box_{kind}"] = plot_warmup_box(result, out_dir / f"warmup_r2_box_{kind}.png", layer_kind=kind)
    return figures


# -- markdown -----------------------------------------------------------------------------------


def _f(x: float) -> str:
    return "nan" if x != x else f"{x:.2f}"


def r2_table(summary: dict[str, Any], label: str = "") -> str:
    """Markdown: full-series R^2 per tau, ours beside the paper's."""
    lines = [
        "| tau | median R^2 | p5 | p25 | p75 | p95 | paper median | paper p5 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tk, s in summary["r2"].items():
        lines.append(f"| {label}{tk} | **{_f(s['median'])}** | {_f(s['p5'])} | {_f(s['p25'])} | {_f(s['p75'])} | {_f(s['p95'])} "
                     f"| {PAPER['r2_median']} | {PAPER['r2_p5']} |")
    return "\n".join(lines)


def warmup_table(summary: dict[str, Any]) -> str:
    """Markdown: median (p5, fraction < 0) of the warmup R^2 per tau and w."""
    warm = summary["warmup_r2"]
    wkeys = list(next(iter(warm.values())).keys()) if warm else []
    lines = ["| tau | " + " | ".join(f"w={w}" for w in wkeys) + " | paper |", "|---|" + "---|" * (len(wkeys) + 1)]
    for tk, per_w in warm.items():
        cells = [f"**{_f(s['median'])}** (p5 {_f(s['p5'])}, {s['frac_negative']:.0%} < 0)" for s in per_w.values()]
        lines.append(f"| {tk} | " + " | ".join(cells) + f" | {PAPER['warmup_trend']}; w=512: {PAPER['warmup_512_median']} |")
    return "\n".join(lines)


def layer_type_table(summary: dict[str, Any]) -> str:
    """Markdown: R^2 medians and warmup medians split by layer type (models with layer_types)."""
    by_type = summary.get("by_layer_type")
    if not by_type:
        return ""
    wkeys = list(next(iter(summary["warmup_r2"].values())).keys())
    lines = [
        "| layers | tau | median R^2 | p5 | " + " | ".join(f"w={w} median" for w in wkeys) + " | median R^2, S <= window |",
        "|---|---|---|---|" + "---|" * len(wkeys) + "---|",
    ]
    for kind, entry in by_type.items():
        name = f"{TYPE_LABELS.get(kind, kind)} ({len(entry['layers'])})"
        for tk, s in entry["r2"].items():
            warm = " | ".join(_f(entry["warmup_r2"][tk][w]["median"]) for w in wkeys)
            within = entry.get("r2_within_window", {}).get(tk)
            lines.append(f"| {name} | {tk} | **{_f(s['median'])}** | {_f(s['p5'])} | {warm} | {_f(within['median']) if within else '-'} |")
    return "\n".join(lines)


def write_report(result: AnalysisResult, out_dir: Path, figures: dict[str, Path] | None = None) -> Path:
    out_dir = Path(out_dir)
    summary = result.summary()
    figures = figures if figures is not None else write_figures(result, out_dir)
    timing = summary.get("timing", {})
    lines = [
        f"# Power-law analysis: {result.model} on {result.dataset}",
        "",
        f"- data: `{result.data_source}`, {result.num_seqs} windows x {result.seq_len} tokens, teacher-forced",
        f"- {result.num_layers} layers x {result.num_heads} query heads; taus {', '.join(result.tau_keys)}; "
        f"warmups {', '.join(result.warmup_keys)}",
        "- theta_S = tau-quantile (linear interpolation) of the attention probabilities over the keys row S attends to; "
        "S = generation step = position + 1. Fit: least squares of log theta on log S; R^2 in log space (paper, Sec. 3.1).",
        f"- paper setup (for comparison): {PAPER['setup']}",
    ]
    if result.command:
        lines.append(f"- command: `{result.command}`")
    if timing:
        lines.append(f"- wall time {timing.get('total_s')} s (load {timing.get('load_s')} s, record {timing.get('record_s')} s, "
                     f"fit {timing.get('fit_s')} s), peak RSS {timing.get('peak_rss_mb')} MB, {timing.get('torch_threads')} torch threads")
    zeros = summary.get("zero_thetas", {})
    if any(zeros.values()):
        lines.append(f"- quantiles that underflowed to 0 (clamped before the log): {zeros}")
    lines += ["", "## R^2 of the full-series fit (ours vs paper)", "", r2_table(summary), ""]
    lines += ["## Warmup fits: fit on S <= w, R^2 over all S (median, p5, fraction negative)", "", warmup_table(summary), "",
              f"The paper's sequences have 4096 tokens, so its w = 512 is 12.5% of a sequence; here the longest warmup, "
              f"w = {max(result.warmups)}, is {max(result.warmups) / result.seq_len:.1%} of {result.seq_len} steps. "
              "Negative values are kept raw (the paper's plot truncates to [0, 1]).", ""]
    if summary.get("by_layer_type"):
        lines += [
            "## By layer type",
            "",
            f"Sliding-window layers attend to min(S, {result.sliding_window}) keys: past S = {result.sliding_window} the number "
            "of keys is constant, so their quantiles are taken over the window and still plotted against the generation "
            f"step S. The last column refits on S <= {result.sliding_window}, where sliding and global layers see the same keys "
            "(for global layers it is the like-for-like control).",
            "",
            layer_type_table(summary),
            "",
        ]
    lines += ["## Figures", ""]
    captions = {
        "series_samples": "Sample quantile series (every 10th step) with their power-law fits, at the 90th/50th/25th/10th percentile of R^2",
        "r2_box": "R^2 distribution per tau (box 25-75, median, whiskers 5-95)",
        "warmup_r2_box": "Out-of-sample R^2 of warmup fits per w",
        "r2_box_by_layer_type": "R^2 by layer type",
    }
    for kind in dict.fromkeys(result.layer_types or []):
        captions[f"warmup_r2_box_{kind}"] = f"Out-of-sample R^2 of warmup fits, {TYPE_LABELS.get(kind, kind)} layers only"
    for key in captions:
        if key in figures:
            lines += [f"### {captions[key]}", "", f"![{captions[key]}]({Path(figures[key]).name})", ""]
    if "beta_heatmap" in figures:
        lines += ["### Median beta per layer and head", "", f"![Median beta per layer and head]({Path(figures['beta_heatmap']).name})", ""]
    lines += ["## Per layer (median over windows x heads)", "", "| layer | " + " | ".join(
        f"beta tau={tk} | R^2 tau={tk}" for tk in result.tau_keys) + " |", "|---|" + "---|---|" * len(result.tau_keys)]
    for layer in range(result.num_layers):
        kind = f" ({TYPE_LABELS.get(result.layer_types[layer], '')})" if result.layer_types else ""
        cells = []
        for tk in result.tau_keys:
            entry = summary["per_layer"][tk][str(layer)]
            cells += [f"{entry['beta_median']:.3f}", _f(entry["r2_median"])]
        lines.append(f"| {layer}{kind} | " + " | ".join(cells) + " |")
    return write_text(out_dir / "report.md", "\n".join(lines) + "\n")
