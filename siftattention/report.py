"""Tables (rich / markdown), JSON results and matplotlib figures."""

from __future__ import annotations

import math
import platform
from pathlib import Path
from typing import Any, Sequence

from rich.table import Table

# Where results go (checked, claimed, written all or nothing) lives in .output; importable from here too.
from .output import OutputDirError, OutputWriteError, check_out_dir, claim_out_dir, save_figure, save_run, write_json  # noqa: F401


def versions() -> dict[str, str]:
    import torch
    import transformers

    from . import __version__

    return {
        "siftattention": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


PPL_COLUMNS = [
    ("method", "method"),
    ("ppl", "ppl"),
    ("ppl_post_warmup", "ppl (S>W)"),
    ("realized_sparsity", "sparsity"),
    ("realized_sparsity_post_warmup", "sparsity (S>W)"),
    ("tokens", "tokens"),
]


def results_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]] = PPL_COLUMNS, title: str | None = None) -> Table:
    table = Table(title=title)
    for key, header in columns:
        table.add_column(header, justify="left" if key == "method" else "right", no_wrap=key == "method")
    for row in rows:
        table.add_row(*(_fmt(row.get(key)) for key, _ in columns))  # a key a row lacks prints n/a
    return table


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]] = PPL_COLUMNS) -> str:
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[k]) for k, _ in columns) + " |")
    return "\n".join(lines)


def method_family(spec: str) -> str:
    """The line a method's point belongs to in a sweep plot: name plus the settings not swept."""
    from .methods import parse_method

    method = parse_method(spec)
    label = method.name
    if method.name == "sift":
        label += f" w={method.warmup}"
    if getattr(method, "renormalize", False) and method.name in ("sift", "oracle"):
        label += " renorm"
    if method.name == "topk" and not method.renormalize:
        label += " no-renorm"
    if method.name in ("sift", "oracle", "topk") and method.vmc:
        label += " vmc"
    if method.name == "toptheta":
        label += (" renorm" if method.renormalize else "") + ("" if method.vmc else " no-vmc")
    if method.name == "skipsoftmax":
        label += f" block={method.block}" + (" per-head" if method.per_head else "")
    return label


def plot_ppl_vs_sparsity(rows: Sequence[dict], path: Path, title: str) -> Path | None:
    """Perplexity against realized sparsity, one line per method family; None if nothing is swept."""
    families: dict[str, list[dict]] = {}
    for row in rows:
        families.setdefault(method_family(row["method"]), []).append(row)
    if all(len(points) < 2 for points in families.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    if len(families) > 10:  # more lines than the default colour cycle has colours
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for family, points in families.items():
        if family == "full":
            ax.axhline(points[0]["ppl"], color="black", linestyle="--", linewidth=1, label="full")
            continue
        points = sorted(points, key=lambda r: r["realized_sparsity"])
        ax.plot([p["realized_sparsity"] for p in points], [p["ppl"] for p in points], marker="o", label=family)
    ax.set_xlabel("realized sparsity (pruned / valid keys, all steps)")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
