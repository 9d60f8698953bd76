"""``sift sweep CONFIG.toml``: a grid of tasks x methods x parameters, resumable, with the paper's figures.

A config (every key but ``[[task]]`` optional)::

    model = "smollm2-135m"
    out = "runs/sweep"
    batch_size = 8
    device = "auto"                  # dtype, chat, path as in `sift eval`
    methods = ["full", "topk:k=0.5"] # plain specs
    [grid.topk]                      # every combination of the listed values
    k = [0.5, 0.25, 0.125]
    [grid.sift]
    tau = [0.5, 0.75, 0.875, 0.95]
    warmup = [16, 32, 64]
    renormalize = [false, true]
    [[task]]
    name = "ifeval"
    limit = 541
    max_new_tokens = 512
    [[task]]
    name = "longgen"
    limit = 50
    options = { k = 20 }

Each cell (task, method) is ``sift eval``'s per-sample JSONL in ``out/<task>/``: a rerun skips
finished samples, so finished cells cost nothing. "Valid" samples generated at least the
largest warmup of the whole grid (the paper's rule), the same for every cell. Writes
``sweep.json`` (every cell's summary), ``sweep.md`` (tables) and per task
``score_vs_sparsity_<task>.png``, ``agreement_vs_sparsity_<task>.png`` and
``realized_vs_intended_<task>.png``.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..methods import METHODS, parse_method
from ..output import json_bytes, save_figure, save_run
from .tasks import get_task

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

TOP_KEYS = {"model", "out", "batch_size", "device", "dtype", "chat", "path", "score", "methods", "grid", "task"}
TASK_KEYS = {"name", "limit", "max_new_tokens", "batch_size", "options", "data_file", "data_dir"}


@dataclass
class SweepTask:
    name: str
    limit: int | None = None
    max_new_tokens: int | None = None
    batch_size: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    data_path: Path | None = None


@dataclass
class Sweep:
    model: str
    out: Path
    specs: list[str]
    tasks: list[SweepTask]
    batch_size: int = 8
    device: str = "auto"
    dtype: str = "float32"
    chat: bool = True
    path: str = "auto"
    score: bool = True  # false: decode only (no checkers on that machine); a later run scores and plots

    @property
    def min_new_tokens(self) -> int:
        return max(parse_method(s).warmup for s in self.specs)


def _spec(name: str, params: dict[str, Any]) -> str:
    def text(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    return name + (":" + ",".join(f"{k}={text(v)}" for k, v in params.items()) if params else "")


def expand_grid(grid: dict[str, dict[str, Any]]) -> list[str]:
    """Specs of every combination of the values listed per method (a scalar is a one-value list)."""
    specs = []
    for name, params in grid.items():
        if name not in METHODS:
            raise ValueError(f"sweep grid: unknown method {name!r}; known: {', '.join(METHODS)}")
        if not isinstance(params, dict):
            raise ValueError(f"sweep grid: [grid.{name}] must be a table of parameter lists")
        keys = list(params)
        values = [v if isinstance(v, list) else [v] for v in params.values()]
        for combo in itertools.product(*values):
            specs.append(_spec(name, dict(zip(keys, combo))))
    return specs


def load_sweep(path: Path) -> Sweep:
    """Parse and check a sweep config; every error is one line naming the key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sweep config not found: {path}")
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    unknown = set(config) - TOP_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown key {sorted(unknown)[0]!r}; allowed: {', '.join(sorted(TOP_KEYS))}")
    specs = list(config.get("methods", [])) + expand_grid(config.get("grid", {}))
    if not specs:
        raise ValueError(f"{path}: no methods (give methods = [...] or a [grid.NAME] table)")
    for spec in specs:
        parse_method(spec)  # a bad spec fails here, naming itself
    tasks = []
    for entry in config.get("task", []):
        bad = set(entry) - TASK_KEYS
        if bad:
            raise ValueError(f"{path}: [[task]] has unknown key {sorted(bad)[0]!r}; allowed: {', '.join(sorted(TASK_KEYS))}")
        if "name" not in entry:
            raise ValueError(f"{path}: a [[task]] has no name")
        get_task(entry["name"], **entry.get("options", {}))  # unknown task or option
        if entry.get("limit") is not None and int(entry["limit"]) < 1:
            raise ValueError(f"{path}: task {entry['name']}: limit must be >= 1, got {entry['limit']}")
        data = entry.get("data_file") or entry.get("data_dir")
        tasks.append(SweepTask(entry["name"], entry.get("limit"), entry.get("max_new_tokens"), entry.get("batch_size"),
                               dict(entry.get("options", {})), Path(data) if data else None))
    if not tasks:
        raise ValueError(f"{path}: no [[task]] tables")
    if not isinstance(config.get("out", "runs/sweep"), str) or not config.get("out", "runs/sweep").strip():
        raise ValueError(f"{path}: out must name a directory, got {config.get('out')!r}")  # Path("") is the current directory
    return Sweep(model=config.get("model", "smollm2-135m"), out=Path(config.get("out", "runs/sweep")), specs=specs, tasks=tasks,
                 batch_size=int(config.get("batch_size", 8)), device=config.get("device", "auto"), dtype=config.get("dtype", "float32"),
                 chat=bool(config.get("chat", True)), path=config.get("path", "auto"), score=bool(config.get("score", True)))


def run_sweep(sweep: Sweep, *, plots_only: bool = False, decode: bool = True, loaded=None) -> dict[str, Any]:
    """Evaluate every cell not finished yet, then write sweep.json, sweep.md and the figures."""
    from .generation_eval import EvalSettings, check_run, run_key, with_full
    from .runner import console, load_for_eval, run_eval

    methods = with_full(sweep.specs)
    # Every task's data and settings are checked before the model loads or anything runs.
    checked = []
    for t in sweep.tasks:
        task = get_task(t.name, **t.options)
        task.for_model(sweep.model, sweep.chat)
        data = task.load(t.data_path)
        settings = EvalSettings(model=sweep.model, max_new_tokens=t.max_new_tokens or task.default_max_new_tokens,
                                batch_size=t.batch_size or sweep.batch_size, limit=t.limit, chat=sweep.chat,
                                min_new_tokens=sweep.min_new_tokens, path=sweep.path)
        check_run(sweep.out / task.name, run_key(task, data, settings))
        checked.append((t, task, settings))
    results: dict[str, Any] = {"model": sweep.model, "min_new_tokens": sweep.min_new_tokens, "tasks": {}}
    if not plots_only:
        if decode:
            loaded = loaded or load_for_eval(sweep.model, sweep.device, sweep.dtype)
        for t, task, settings in checked:
            run_eval(task.name, sweep.model, [s for s, _ in methods], out=sweep.out, limit=t.limit, max_new_tokens=settings.max_new_tokens,
                     batch_size=settings.batch_size, data_path=t.data_path, task_options=t.options, chat=sweep.chat,
                     min_new_tokens=sweep.min_new_tokens, device=sweep.device, dtype=sweep.dtype, path=sweep.path, score=sweep.score,
                     decode=decode, loaded=loaded)
        if not sweep.score:
            console.print("decoded without scoring: run the sweep again where lm-eval is installed to score it and draw the figures")
            return results
    for t, task, _ in checked:
        summary_path = sweep.out / task.name / "summary.json"
        if not summary_path.is_file():
            raise FileNotFoundError(f"no results for task {task.name} in {sweep.out} yet: run the sweep without --plots-only")
        cells = _cells(sweep.out / task.name, methods)
        results["tasks"][task.name] = {"headline": task.headline, "cells": cells,
                                       "figures": [str(sweep.out / name) for name in figure_names(task.name, cells)]}
    previous = sweep.out / "sweep.json"
    if previous.is_file():  # several configs may share one output directory: keep their other tasks
        try:
            earlier = json.loads(previous.read_text())
        except (OSError, json.JSONDecodeError):
            earlier = {}
        if earlier.get("model") == sweep.model:
            results["tasks"] = {**{k: v for k, v in earlier.get("tasks", {}).items() if k not in results["tasks"]}, **results["tasks"]}
    def draw() -> None:
        for _, task, _ in checked:
            plot_task(task.name, task.headline, results["tasks"][task.name]["cells"], sweep.out, sweep.model)

    # The tables first (both or neither), then this run's tasks' figures, their earlier ones gone first.
    stale = [name for _, task, _ in checked for name in figure_names(task.name)]
    save_run(sweep.out, {"sweep.json": json_bytes(results), "sweep.md": (sweep_markdown(results) + "\n").encode()},
             figures=draw, stale=stale)
    console.print(f"wrote {sweep.out / 'sweep.json'}, {sweep.out / 'sweep.md'} and the figures")
    return results


def _cells(task_dir: Path, methods) -> list[dict[str, Any]]:
    from .generation_eval import method_slug

    cells = []
    for _, method in methods:
        path = task_dir / f"{method_slug(method)}.summary.json"
        if path.is_file():
            cells.append(_with_nan(json.loads(path.read_text())))
    return cells


def _with_nan(cell: dict[str, Any]) -> dict[str, Any]:
    """A summary read back: its numbers written as null (NaN: no sample had any) are NaN again, for the plots and tables."""
    for part in ("all", "valid"):
        numbers = cell.get(part, {})
        for key in ("realized_sparsity", "realized_sparsity_post_warmup", "mean_new_tokens", "eos_rate"):
            if numbers.get(key, 0) is None:
                numbers[key] = math.nan
        for group in (numbers.get("metrics") or {}, numbers.get("agreement") or {}):
            group.update({k: math.nan for k, v in group.items() if v is None})
    return cell


# -- tables and figures ---------------------------------------------------------------------------
def family(cell: dict[str, Any]) -> str:
    """A line of the figures: method plus the settings not swept along the x axis."""
    name = cell["method_name"]
    if name == "sift":
        return f"sift w={cell['warmup']}" + (" renorm" if cell["renormalize"] else "")
    if name == "oracle":
        return "oracle" + (" renorm" if cell["renormalize"] else "")
    if name == "topk" and not cell["renormalize"]:
        return "topk no-renorm"
    return name


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _metric(cell: dict[str, Any], key: str) -> float:
    if key == "rouge_l":  # agreement with Full; Full agrees with itself
        return 1.0 if cell["method_name"] == "full" else (cell["all"]["agreement"] or {}).get("rouge_l", math.nan)
    return cell["all"]["metrics"].get(key, math.nan)


def interpolate_at(points: Sequence[tuple[float, float]], x: float) -> float:
    """Linear interpolation of sorted ``(x, y)`` points at ``x``; NaN outside their range."""
    if math.isnan(x) or not points or not points[0][0] <= x <= points[-1][0]:
        return math.nan
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def topk_at(cells: Sequence[dict[str, Any]], key: str, sparsity: float) -> float:
    """Top-k's ``key`` (a metric, or "rouge_l") interpolated at a realized sparsity (Full is its point at 0); NaN outside its range."""
    points = sorted((c["all"]["realized_sparsity"], _metric(c, key))
                    for c in cells if c["method_name"] in ("full", "topk") and c["renormalize"] == (c["method_name"] == "topk"))
    return interpolate_at(points, sparsity) if len(points) >= 2 else math.nan


def sweep_markdown(results: dict[str, Any]) -> str:
    lines = [f"# Sweep on {results['model']}", "",
             f"'valid' = samples that generated at least {results['min_new_tokens']} tokens (the largest warmup); "
             "sparsity = mean over samples of each sample's realized sparsity over its decode steps (warmup steps count as 0; "
             "'post-w': after the warmup only); 'top-k at same sparsity' = Top-k's headline metric (and ROUGE-L) "
             "interpolated linearly between its points (Full at 0) at the method's realized sparsity.", ""]
    for name, entry in results["tasks"].items():
        cells = entry["cells"]
        if not cells:
            continue
        metrics = list(cells[0]["all"]["metrics"])
        head = ["method", *metrics, f"{entry['headline']} (valid)", "valid n (dropped)", "sparsity", "sparsity post-w", "intended",
                "LCP", "ROUGE-L", "tokens", "top-k at same sparsity", "top-k ROUGE-L at same sparsity"]
        lines += [f"## {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in cells:
            a, v = c["all"], c["valid"]
            agree = a["agreement"] or {}
            row = [c["method"], *(_fmt(a["metrics"].get(m)) for m in metrics), _fmt(v["metrics"].get(entry["headline"])),
                   f"{v['n']} ({v['dropped']})", _fmt(a["realized_sparsity"]), _fmt(a["realized_sparsity_post_warmup"]),
                   _fmt(c["intended_sparsity"]), _fmt(agree.get("lcp_tokens"), 1), _fmt(agree.get("rouge_l")), _fmt(a["mean_new_tokens"], 1),
                   *((_fmt(topk_at(cells, entry["headline"], a["realized_sparsity"])), _fmt(topk_at(cells, "rouge_l", a["realized_sparsity"])))
                     if c["method_name"] not in ("full", "topk") else ("", ""))]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def _families(cells: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault(family(c), []).append(c)
    return groups


def figure_names(task: str, cells: Sequence[dict[str, Any]] | None = None) -> list[str]:
    """The figures ``plot_task`` draws for ``task`` from ``cells`` (without cells: every one it may draw)."""
    names = [f"score_vs_sparsity_{task}.png", f"agreement_vs_sparsity_{task}.png"]
    if cells is None or any(name.startswith("sift") for name in _families(cells)):
        names.append(f"realized_vs_intended_{task}.png")
    return names


def plot_task(task: str, headline: str, cells: Sequence[dict[str, Any]], out: Path, model: str) -> list[Path]:
    """The paper's figures for one task: score and agreement against realized sparsity; realized against intended."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    groups = _families(cells)
    full = groups.get("full", [None])[0]
    for key, ylabel, fname in ((headline, headline, "score_vs_sparsity"), ("rouge_l", "ROUGE-L vs Full (tokens)", "agreement_vs_sparsity")):
        fig, ax = plt.subplots(figsize=(7.2, 4.6))
        for name, group in groups.items():
            if name == "full":
                full_score = (full["all"]["metrics"] or {}).get(headline) if full is not None else None
                if key == headline and full_score is not None:  # unscored cells (decoded elsewhere) are left out
                    ax.axhline(full_score, color="black", linestyle="--", linewidth=1, label="full")
                continue
            group = sorted(group, key=lambda c: c["intended_sparsity"])  # along tau / k, as the paper's lines run
            ys = [(c["all"]["metrics"] or {}).get(headline, math.nan) if key == headline else (c["all"]["agreement"] or {}).get("rouge_l", math.nan) for c in group]
            ax.plot([c["all"]["realized_sparsity"] for c in group], ys, marker="o", label=name)
        ax.set_xlabel("realized sparsity (pruned / valid keys, all decode steps)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{model}: {task}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        path = out / f"{fname}_{task}.png"
        paths.append(save_figure(fig, path, dpi=120))
    sift = {n: g for n, g in groups.items() if n.startswith("sift")}
    if sift:
        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        for name, group in sift.items():
            group = sorted(group, key=lambda c: c["intended_sparsity"])
            ax.plot([c["intended_sparsity"] for c in group], [c["all"]["realized_sparsity"] for c in group], marker="o", label=name)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1, label="realized = intended")
        ax.set_xlabel("intended sparsity (tau)")
        ax.set_ylabel("realized sparsity (all decode steps)")
        ax.set_xlim(0.4, 1.0)
        ax.set_ylim(0.0, 1.0)
        ax.set_title(f"{model}: {task}, Sift realized vs intended")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"realized_vs_intended_{task}.png"
        paths.append(save_figure(fig, path, dpi=120))
    return paths
