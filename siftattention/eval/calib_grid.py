"""The calibration grid: the runs that decide Sift's recommended settings, and their report.

``configs/calib/plan.toml`` lists steps in priority order; each names a perplexity config
(``configs/calib/ppl_*.toml``, this module's format) or a ``sift sweep`` config (IFEval,
LongGenBench), optionally only its first ``first`` methods (the core cells) or the methods from
``skip`` on (the rest). ``run`` decodes cell by cell in that order until a time budget is spent,
never starting a cell whose estimated time no longer fits, loads each model once per run of
consecutive steps, skips every cell already finished under ``--out`` (so a later call with the
earlier results carried back in resumes), and writes::

    OUT/ppl/<model>/L<seq_len>/<method slug>/results.json   one `sift ppl --prompt-len` run per method
    OUT/eval/<model>/<task>/<method slug>.jsonl, *.summary.json   `sift eval` cells (decoded, not scored)
    OUT/timing.jsonl                                          seconds per cell and model load
    OUT/status.json                                           cells done, left, and their estimates

``summarize`` reads such a directory (scored or not) and writes ``calib_grid.md``,
``calib_grid.json`` and the figures: realized against intended sparsity per model and task (mean
|gap| over the tau grid, over the whole run), and quality at equal realized sparsity (perplexity
increase over Full; ROUGE-L against Full), each rival interpolated along its own points at the
candidate's realized sparsity. docs/eval.md, "The calibration grid", has the commands.

Perplexity config (``kind = "ppl"``)::

    model = "smollm2-135m"
    dtype = "float32"
    num_seqs = 8
    methods = ["full", "sift:tau=0.5", ...]        # every length, first
    variants = ["sift:tau=0.875,warmup=16,warmup_source=decode"]   # every length, last
    [[length]]
    seq_len = 2048
    prompt_len = 1536                              # scored: the decode steps after the prompt
    methods = ["toptheta:k=224,calib_len=2048"]    # this length only (between the two)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .sweep import interpolate_at

#: The parameter each method family is swept along (its x in the figures and tables).
SWEPT = {"sift": "tau", "oracle": "tau", "topk": "k", "h2o": "k", "toptheta": "k", "skipsoftmax": "scale"}
TAU_GRID = (0.5, 0.75, 0.875, 0.95)
#: A rival's point counts as at equal realized sparsity within this distance.
MATCH = 0.02


# -- the plan -----------------------------------------------------------------------------------
@dataclass
class Cell:
    """One unit of work: a method on a (model, task) or a (model, perplexity length)."""

    step: int
    model: str
    kind: str  # "ppl" or a task name
    spec: str
    est_s: float
    config: Path
    seq_len: int = 0
    prompt_len: int = 0

    @property
    def label(self) -> str:
        where = f"ppl L={self.seq_len}" if self.kind == "ppl" else self.kind
        return f"{self.model} {where} {self.spec}"


@dataclass
class PplConfig:
    model: str
    dtype: str
    num_seqs: int
    lengths: list[tuple[int, int, list[str]]]  # (seq_len, prompt_len, methods)
    device: str = "auto"
    dataset: str = "wikitext2"


def load_ppl_config(path: Path) -> PplConfig:
    from ..methods import parse_method

    config = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    if config.get("kind") != "ppl":
        raise ValueError(f"{path}: not a perplexity config (kind = \"ppl\")")
    common = list(config.get("methods", []))
    variants = list(config.get("variants", []))
    lengths = []
    for entry in config.get("length", []):
        methods = list(dict.fromkeys(common + list(entry.get("methods", [])) + variants))
        for spec in methods:
            parse_method(spec)
        lengths.append((int(entry["seq_len"]), int(entry.get("prompt_len", 0)), methods))
    if not lengths:
        raise ValueError(f"{path}: no [[length]] tables")
    return PplConfig(config["model"], config.get("dtype", "float32"), int(config.get("num_seqs", 8)), lengths,
                     config.get("device", "auto"), config.get("dataset", "wikitext2"))


def is_ppl_config(path: Path) -> bool:
    return tomllib.loads(Path(path).read_text(encoding="utf-8")).get("kind") == "ppl"


def _slice(items: list, step: dict) -> list:
    first, skip = step.get("first"), step.get("skip", 0)
    return items[skip:first] if first is not None else items[skip:]


def plan_cells(plan_path: Path, root: Path | None = None) -> list[Cell]:
    """Every cell of the plan, in priority order (a cell listed twice runs once, at its first place)."""
    from ..eval.sweep import load_sweep
    from ..methods import parse_method

    root = Path(root) if root is not None else Path.cwd()
    plan = tomllib.loads(Path(plan_path).read_text(encoding="utf-8"))
    cells, seen = [], set()
    for i, step in enumerate(plan.get("step", [])):
        path = root / step["config"]
        est = float(step.get("est_s", 10))

        def factor(spec: str) -> float:
            return float(step.get("topk_factor", 1.0)) if parse_method(spec).name in ("topk", "toptheta") else 1.0

        if is_ppl_config(path):
            cfg = load_ppl_config(path)
            for seq_len, prompt_len, methods in cfg.lengths:
                for spec in _slice(methods, step):
                    cells.append(Cell(i, cfg.model, "ppl", spec, est * factor(spec) * seq_len / 2048, path, seq_len, prompt_len))
        else:
            sweep = load_sweep(path)
            for task in sweep.tasks:
                for spec in _slice(sweep.specs, step):
                    cells.append(Cell(i, sweep.model, task.name, spec, est * factor(spec), path))
    unique = []
    for c in cells:
        key = (c.model, c.kind, c.seq_len, parse_method(c.spec).spec())
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


# -- running ------------------------------------------------------------------------------------
def _ppl_dir(out: Path, cell: Cell) -> Path:
    from ..eval.generation_eval import method_slug
    from ..methods import parse_method

    return out / "ppl" / cell.model / f"L{cell.seq_len}" / method_slug(parse_method(cell.spec))


def cell_done(out: Path, cell: Cell) -> bool:
    from ..eval.generation_eval import method_slug
    from ..methods import parse_method

    if cell.kind == "ppl":
        return (_ppl_dir(out, cell) / "results.json").is_file()
    return (out / "eval" / cell.model / cell.kind / f"{method_slug(parse_method(cell.spec))}.summary.json").is_file()


def _run_cell(cell: Cell, out: Path, loaded, device: str) -> None:
    from ..cli import run_ppl
    from ..eval.runner import run_eval
    from ..eval.sweep import load_sweep

    if cell.kind == "ppl":
        cfg = load_ppl_config(cell.config)
        run_ppl(cell.model, cfg.dataset, None, cell.seq_len, cfg.num_seqs, (cell.spec,), _ppl_dir(out, cell), loaded=loaded,
                device=device, dtype=cfg.dtype, prompt_len=cell.prompt_len)
        return
    sweep = load_sweep(cell.config)
    task = next(t for t in sweep.tasks if t.name == cell.kind)
    run_eval(task.name, sweep.model, [cell.spec], out=out / "eval" / sweep.model, limit=task.limit,
             max_new_tokens=task.max_new_tokens, batch_size=task.batch_size or sweep.batch_size, data_path=task.data_path,
             task_options=task.options, chat=sweep.chat, min_new_tokens=sweep.min_new_tokens, device=device, dtype=sweep.dtype,
             path=sweep.path, score=False, loaded=loaded)


def _dtype(cell: Cell) -> str:
    if cell.kind == "ppl":
        return load_ppl_config(cell.config).dtype
    from ..eval.sweep import load_sweep

    return load_sweep(cell.config).dtype


def copy_previous(prev: Path, out: Path) -> int:
    """Copy earlier results into ``out`` (files already there win); returns the number of files copied."""
    n = 0
    for src in Path(prev).rglob("*"):
        if src.is_file():
            dst = out / src.relative_to(prev)
            if not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
                n += 1
    return n


def run_plan(plan: Path, out: Path, budget_s: float, *, device: str = "auto", load_s: dict[str, float] | None = None,
             prev: Sequence[Path] = (), dry_run: bool = False, only_steps: Sequence[int] | None = None) -> dict[str, Any]:
    """Run the plan's unfinished cells in order until ``budget_s`` would be exceeded; returns the status."""
    import gc

    start = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for p in prev:
        print(f"restored {copy_previous(Path(p), out)} files from {p}", flush=True)
    cells = [c for c in plan_cells(plan) if only_steps is None or c.step in only_steps]
    load_s = {"qwen2.5-1.5b": 60.0, **(load_s or {})}
    measured: dict[tuple[int, str], float] = {}
    loaded, loaded_name = None, None
    done, ran, left = [], [], []
    stopped = None
    timing = out / "timing.jsonl"
    for cell in cells:
        if cell_done(out, cell):
            done.append(cell)
            continue
        if stopped is not None:
            left.append(cell)
            continue
        key = (cell.step, cell.seq_len, "torch" if cell.spec.startswith(("topk", "toptheta")) else "other")
        est = max(cell.est_s, measured.get(key, 0.0))
        model_key = (cell.model, _dtype(cell))
        need = est + (0.0 if loaded_name == model_key else load_s.get(cell.model, 20.0))
        elapsed = time.monotonic() - start
        if dry_run or elapsed + need > budget_s:
            stopped = stopped or ("dry run" if dry_run else f"{cell.label}: needs ~{need:.0f} s, {budget_s - elapsed:.0f} s left")
            left.append(cell)
            continue
        if loaded_name != model_key:
            loaded = None
            gc.collect()
            _empty_cache()
            from ..eval.runner import load_for_eval

            t0 = time.monotonic()
            loaded = load_for_eval(cell.model, device, model_key[1])
            loaded_name = model_key
            _log(timing, {"event": "load", "model": cell.model, "dtype": model_key[1], "seconds": round(time.monotonic() - t0, 1)})
        print(f"== [{time.monotonic() - start:5.0f} s] {cell.label} (est {est:.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            _run_cell(cell, out, loaded, device)
        except Exception as err:  # noqa: BLE001 - one failing cell must not stop the grid
            print(f"!! {cell.label}: {type(err).__name__}: {err}", flush=True)
            _log(timing, {"event": "error", "cell": cell.label, "error": f"{type(err).__name__}: {err}"})
            left.append(cell)
            continue
        seconds = time.monotonic() - t0
        measured[key] = seconds
        ran.append(cell)
        _log(timing, {"event": "cell", "step": cell.step, "model": cell.model, "kind": cell.kind, "seq_len": cell.seq_len,
                      "spec": cell.spec, "seconds": round(seconds, 1), "est_s": round(est, 1)})
    status = {"budget_s": budget_s, "elapsed_s": round(time.monotonic() - start, 1), "stopped": stopped,
              "done_before": len(done), "ran": [c.label for c in ran],
              "left": [{"cell": c.label, "est_s": round(c.est_s, 1)} for c in left],
              "left_est_s": round(sum(c.est_s for c in left), 0)}
    (out / "status.json").write_text(json.dumps(status, indent=1) + "\n")
    print(f"ran {len(ran)} cells ({len(done)} finished before), {len(left)} left (~{status['left_est_s']:.0f} s); "
          f"stopped: {stopped}", flush=True)
    return status


def _empty_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _log(path: Path, entry: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


# -- reading results ----------------------------------------------------------------------------
def _family(method) -> tuple[str, float]:
    """(family, x): the method's canonical spec without its swept parameter, and that parameter."""
    name = method.name
    if name == "full":
        return "full", 0.0
    swept = SWEPT.get(name)
    parts = method.spec().split(":", 1)
    params = [p for p in (parts[1].split(",") if len(parts) > 1 else []) if not p.startswith(f"{swept}=")]
    return name + (":" + ",".join(params) if params else ""), float(getattr(method, swept)) if swept else 0.0


def intended(method) -> float | None:
    if method.name in ("sift", "oracle"):
        return float(method.tau)
    if method.name in ("topk", "h2o"):
        return 1.0 - float(method.k)
    return None


def _nan(v: Any) -> float:
    return math.nan if v is None else float(v)


def read_ppl(out: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Perplexity cells per (model, "ppl-L<seq_len>"), from every results.json under ``out/ppl``
    (one run per method, or one run with several)."""
    from ..methods import parse_method

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in sorted((Path(out) / "ppl").rglob("results.json")):
        payload = json.loads(path.read_text())
        for r in payload["results"]:
            m = parse_method(r["method"])
            fam, x = _family(m)
            groups.setdefault((payload["model"], f"ppl-L{payload['seq_len']}"), []).append({
                "method": r["method"], "canonical": m.spec(), "name": m.name, "family": fam, "x": x,
                "renormalize": bool(getattr(m, "renormalize", False)), "vmc": bool(getattr(m, "vmc", False)),
                "intended": intended(m), "realized": _nan(r["realized_sparsity"]),
                "realized_post_warmup": _nan(r.get("realized_sparsity_post_warmup")),
                "quality": _nan(r["ppl"]), "tokens": r["tokens"], "prompt_len": payload.get("prompt_len", 0),
                "num_seqs": payload["num_seqs"], "source": str(path.relative_to(out))})
    return groups


def whole_run_sparsity(rows: Sequence[dict[str, Any]]) -> float:
    """Realized sparsity over the whole run: every decode step of every sample weighs the same
    (a sample of n tokens ran n - 1 decode steps; its row holds the mean over them)."""
    num = den = 0.0
    for r in rows:
        steps = r["num_generated"] - 1
        if steps > 0 and r["realized_sparsity"] is not None and not math.isnan(r["realized_sparsity"]):
            num += r["realized_sparsity"] * steps
            den += steps
    return num / den if den else math.nan


def read_eval(out: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Generation cells per (model, task), from the per-sample JSONL under ``out/eval``."""
    from ..eval.generation_eval import read_rows
    from ..methods import parse_method

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for summary_path in sorted((Path(out) / "eval").glob("*/*/*.summary.json")):
        s = json.loads(summary_path.read_text())
        rows = read_rows(summary_path.with_name(summary_path.name.replace(".summary.json", ".jsonl")))
        if not rows:
            continue
        m = parse_method(s["method"])
        fam, x = _family(m)
        agree = [r["agreement"]["rouge_l"] for r in rows if r.get("agreement")]
        scores = s["all"]["metrics"] or {}
        groups.setdefault((s["model"], s["task"]), []).append({
            "method": s["method"], "canonical": m.spec(), "name": m.name, "family": fam, "x": x,
            "renormalize": bool(getattr(m, "renormalize", False)), "vmc": bool(getattr(m, "vmc", False)),
            "intended": intended(m), "realized": 0.0 if m.name == "full" else whole_run_sparsity(rows),
            "realized_sample_mean": _nan(s["all"]["realized_sparsity"]),
            "realized_post_warmup": _nan(s["all"]["realized_sparsity_post_warmup"]),
            "quality": 1.0 if m.name == "full" else (sum(agree) / len(agree) if agree else math.nan),
            "headline": s["headline"], "score": _nan(scores.get(s["headline"])), "n": len(rows),
            "mean_new_tokens": sum(r["num_generated"] for r in rows) / len(rows),
            "generation_s": s.get("generation_s"), "source": str(summary_path.relative_to(out))})
    return groups


# -- the report ---------------------------------------------------------------------------------
def families(cells: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault(c["family"], []).append(c)
    for g in groups.values():
        g.sort(key=lambda c: c["x"] if c["name"] not in ("topk", "h2o", "toptheta") else -c["x"])
    return groups


def realized_rows(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per family with an intended sparsity: realized and gap at each tau of the grid, mean |gap|."""
    rows = []
    for fam, group in families(cells).items():
        points = [c for c in group if c["intended"] is not None]
        if not points:
            continue
        gaps = {c["intended"]: c["realized"] - c["intended"] for c in points}
        grid = [t for t in TAU_GRID if t in gaps] if points[0]["name"] in ("sift", "oracle") else sorted(gaps)
        finite = [abs(gaps[t]) for t in grid if not math.isnan(gaps[t])]
        rows.append({"family": fam, "points": {t: (gaps[t] + t, gaps[t]) for t in sorted(gaps)},
                     "mean_abs_gap": sum(finite) / len(finite) if finite else math.nan, "n": len(finite),
                     "complete_grid": points[0]["name"] not in ("sift", "oracle") or all(t in gaps for t in TAU_GRID)})
    return rows


def at_sparsity(full: dict[str, Any] | None, group: Sequence[dict[str, Any]], s: float) -> tuple[float, float]:
    """A family's quality at realized sparsity ``s``: linear between its two points around ``s``
    (Full is every family's point at 0), NaN outside its range; and the distance from ``s`` to its
    nearest real point (Full excluded)."""
    pts = sorted((c["realized"], c["quality"]) for c in group if not math.isnan(c["realized"]) and not math.isnan(c["quality"]))
    nearest = min((abs(x - s) for x, _ in pts), default=math.nan)
    if full is not None:
        pts = sorted([(0.0, full["quality"])] + pts)
    return interpolate_at(pts, s), nearest


def _matches(candidate: dict[str, Any], cell: dict[str, Any]) -> bool:
    return candidate["renormalize"] == cell["renormalize"] and candidate["vmc"] == cell["vmc"]


def rival_family(cells: Sequence[dict[str, Any]], name: str, candidate: dict[str, Any]) -> tuple[str | None, bool]:
    """The rival's family with the candidate's compensation (renormalize, vmc), else its first family; and
    whether the compensation matches."""
    fams = families(cells)
    named = [f for f, g in fams.items() if g[0]["name"] == name]
    same = [f for f in named if _matches(candidate, fams[f][0])]
    if same:
        return same[0], True
    return (named[0], False) if named else (None, False)


def quality_rows(cells: Sequence[dict[str, Any]], candidate_family: str, ppl: bool,
                 rivals: Sequence[str] = ("topk", "oracle", "toptheta", "skipsoftmax")) -> list[dict[str, Any]]:
    """Per candidate cell: its quality, and each rival's at the same realized sparsity."""
    fams = families(cells)
    full = next((c for c in cells if c["name"] == "full"), None)
    rows = []
    for c in fams.get(candidate_family, []):
        row = {"tau": c["x"], "realized": c["realized"], "quality": c["quality"], "rivals": {}}
        if ppl and full is not None:
            row["increase"] = c["quality"] - full["quality"]
        for name in rivals:
            fam, same = rival_family(cells, name, c)
            if fam is None:
                continue
            q, nearest = at_sparsity(full, fams[fam], c["realized"])
            entry = {"family": fam, "same_compensation": same, "quality": q, "nearest": nearest,
                     "matched": not math.isnan(nearest) and nearest <= MATCH}
            if ppl and full is not None:
                entry["increase"] = q - full["quality"]
            row["rivals"][name] = entry
        rows.append(row)
    return rows


def verdicts(kind: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """The requirement's quality targets, checked on one (model, task)."""
    out = []
    for r in rows:
        if kind.startswith("ppl"):
            if r["tau"] not in (0.75, 0.875):
                continue
            checks = [("topk", lambda a, b: a <= b, "<="), ("toptheta", lambda a, b: a < b, "<"), ("skipsoftmax", lambda a, b: a < b, "<")]
            mine, key = r.get("increase", math.nan), "increase"
        else:
            checks = [("topk", lambda a, b: a >= b, ">="), ("toptheta", lambda a, b: a >= b, ">=")]
            mine, key = r["quality"], "quality"
        for name, ok, sign in checks:
            rival = r["rivals"].get(name)
            if rival is None or math.isnan(rival[key]) or math.isnan(mine):
                out.append(f"tau {r['tau']}: vs {name}: n/a (no {name} point around {r['realized']:.3f})")
                continue
            how = "matched" if rival["matched"] else f"interpolated, nearest point {rival['nearest']:.3f} away"
            comp = "" if rival["same_compensation"] else ", compensation differs"
            out.append(f"tau {r['tau']}: {mine:.3f} {sign} {name} {rival[key]:.3f} ({how}{comp}): "
                       f"{'PASS' if ok(mine, rival[key]) else 'FAIL'}")
    return out


def _f(v: Any, d: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{d}f}" if isinstance(v, float) else str(v)


def merge_previous(groups: dict[tuple[str, str], list[dict[str, Any]]],
                   previous: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """``groups`` with the cells of an earlier report (its ``calib_grid.json``) that ``groups`` lacks, so a
    report grows from new results without the raw files of earlier ones. A cell in both comes from ``groups``
    unless only the earlier one is scored (results restored from resume files hold unscored summaries)."""
    merged = {k: list(v) for k, v in groups.items()}
    for key, entry in previous.get("groups", {}).items():
        model, kind = key.split(" ", 1)
        cells = merged.setdefault((model, kind), [])
        index = {c["canonical"]: i for i, c in enumerate(cells)}
        for c in entry["cells"]:
            i = index.get(c["canonical"])
            if i is None:
                cells.append(c)
            elif math.isnan(_nan(cells[i].get("score"))) and not math.isnan(_nan(c.get("score"))):
                cells[i] = c
        cells.sort(key=lambda c: c["source"])  # the order reading every raw file gives (stable within a file)
    return merged


def build_report(out: Path, candidates: Sequence[str] = ("sift", "sift:vmc=true"),
                 previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every table of the report as data: per (model, kind) the cells, the realized rows and per candidate
    the quality rows and verdicts; ``previous``, an earlier report, supplies the cells ``out`` lacks."""
    from ..methods import parse_method

    groups = {**read_ppl(out), **read_eval(out)}
    if previous is not None:
        groups = merge_previous(groups, previous)
    report: dict[str, Any] = {"candidates": {}, "groups": {}}
    for cand in candidates:
        fam, _ = _family(parse_method(cand + (",tau=0.5" if ":" in cand else ":tau=0.5")))
        report["candidates"][cand] = fam
    for (model, kind), cells in sorted(groups.items()):
        ppl = kind.startswith("ppl")
        entry = {"cells": cells, "realized": realized_rows(cells), "quality": {}, "verdicts": {}}
        for cand, fam in report["candidates"].items():
            rows = quality_rows(cells, fam, ppl)
            entry["quality"][cand] = rows
            entry["verdicts"][cand] = verdicts(kind, rows)
        report["groups"][f"{model} {kind}"] = entry
    return report


def report_markdown(report: dict[str, Any]) -> str:
    lines = ["# Calibration grid", "",
             "Realized sparsity is over the whole run: perplexity, every scored decode step after the prompt (a decode "
             "warmup's dense steps count as 0); generation, every decode step of every sample weighted equally "
             "(`sample mean` is the mean over samples). Quality: perplexity (its increase over Full) or ROUGE-L against "
             f"Full. Rivals are interpolated along their own points (Full at 0) at the candidate's realized sparsity; "
             f"'matched' = a real point within {MATCH}.", ""]
    # 1. realized against intended, every (model, kind), every family with an intended sparsity
    lines += ["## Realized against intended sparsity (mean |gap| over the tau grid)", "",
              "| model / task | family | " + " | ".join(f"tau {t}" for t in TAU_GRID) + " | mean abs gap |", "|---|---|" + "---|" * (len(TAU_GRID) + 1)]
    for name, g in report["groups"].items():
        for r in g["realized"]:
            if not r["family"].startswith(("sift", "oracle")):
                continue
            cols = [f"{r['points'][t][0]:.3f} ({r['points'][t][1]:+.3f})" if t in r["points"] else "" for t in TAU_GRID]
            gap = _f(r["mean_abs_gap"]) + ("" if r["complete_grid"] else f" (n={r['n']})")
            lines.append(f"| {name} | {r['family']} | " + " | ".join(cols) + f" | {gap} |")
    lines.append("")
    # 2. per candidate: the target
    for cand, fam in report["candidates"].items():
        lines += [f"## Candidate `{cand}` (family `{fam}`)", "", "| model / task | mean abs gap | within 0.03 |", "|---|---|---|"]
        for name, g in report["groups"].items():
            r = next((r for r in g["realized"] if r["family"] == fam), None)
            if r is not None:
                ok = "yes" if r["complete_grid"] and r["mean_abs_gap"] <= 0.03 else ("no" if r["complete_grid"] else "grid incomplete")
                lines.append(f"| {name} | {_f(r['mean_abs_gap'])} | {ok} |")
        lines.append("")
        for name, g in report["groups"].items():
            rows = g["quality"][cand]
            if not rows:
                continue
            ppl = name.split()[-1].startswith("ppl")
            rivals = sorted({k for r in rows for k in r["rivals"]})
            unit = "ppl increase over Full" if ppl else "ROUGE-L vs Full"
            lines += [f"### {name}: {unit} at equal realized sparsity", "",
                      "| tau | realized | candidate | " + " | ".join(rivals) + " |", "|---|---|---|" + "---|" * len(rivals)]
            for r in rows:
                key = "increase" if ppl else "quality"
                cells = []
                for k in rivals:
                    e = r["rivals"].get(k)
                    cells.append("" if e is None else f"{_f(e[key])}{'' if e['matched'] else '*'}{'' if e['same_compensation'] else ' (other comp.)'}")
                lines.append(f"| {r['tau']} | {_f(r['realized'])} | {_f(r.get(key))} | " + " | ".join(cells) + " |")
            lines += ["", "\\* interpolated: no point of that rival within 0.02.", ""]
            lines += [f"- {v}" for v in g["verdicts"][cand]] + [""]
    # 3. every cell
    lines += ["## Every cell", ""]
    for name, g in report["groups"].items():
        ppl = name.split()[-1].startswith("ppl")
        head = ["method", "intended", "realized", "post-warmup"] + (["ppl"] if ppl else ["sample mean", "ROUGE-L", "headline", "tokens", "s"])
        lines += [f"### {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in g["cells"]:
            row = [c["method"], _f(c["intended"]), _f(c["realized"]), _f(c["realized_post_warmup"])]
            row += [_f(c["quality"])] if ppl else [_f(c["realized_sample_mean"]), _f(c["quality"]), _f(c["score"]),
                                                     _f(c["mean_new_tokens"], 1), _f(c["generation_s"], 1)]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..output import save_figure

    paths = []
    for name, g in report["groups"].items():
        slug = name.replace(" ", "_").replace("/", "_")
        ppl = name.split()[-1].startswith("ppl")
        fams = families(g["cells"])
        full = next((c for c in g["cells"] if c["name"] == "full"), None)
        fig, ax = plt.subplots(figsize=(7.2, 4.6))
        for fam, group in fams.items():
            if fam == "full":
                continue
            pts = sorted((c["realized"], c["quality"]) for c in group)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        if full is not None:
            ax.axhline(full["quality"], color="black", linestyle="--", linewidth=1, label="full")
        ax.set_xlabel("realized sparsity (whole run)")
        ax.set_ylabel("perplexity" if ppl else "ROUGE-L vs Full")
        if ppl:
            ax.set_yscale("log")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        paths.append(save_figure(fig, out / f"quality_{slug}.png", dpi=110))
        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        for fam, group in fams.items():
            pts = sorted((c["intended"], c["realized"]) for c in group if c["intended"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("intended sparsity (tau, 1 - k)")
        ax.set_ylabel("realized sparsity (whole run)")
        ax.set_xlim(0.4, 1.0)
        ax.set_ylim(0.0, 1.0)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        paths.append(save_figure(fig, out / f"realized_{slug}.png", dpi=110))
    return paths


def summarize(results: Path, report_dir: Path | None = None, candidates: Sequence[str] = ("sift", "sift:vmc=true"),
              plots: bool = True, previous: Path | None = None) -> dict[str, Any]:
    results = Path(results)
    report_dir = Path(report_dir) if report_dir is not None else results / "report"
    prev = json.loads(Path(previous).read_text()) if previous is not None else None
    report_dir.mkdir(parents=True, exist_ok=True)
    report = build_report(results, candidates, prev)
    (report_dir / "calib_grid.md").write_text(report_markdown(report) + "\n")
    (report_dir / "calib_grid.json").write_text(json.dumps(report, indent=1, default=str, allow_nan=True) + "\n")
    if plots:
        plot_report(report, report_dir)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m siftattention.eval.calib_grid", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the plan's unfinished cells in priority order within a time budget")
    r.add_argument("--plan", type=Path, default=Path("configs/calib/plan.toml"))
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--budget", type=float, required=True, help="seconds; no cell starts that its estimate says would end later")
    r.add_argument("--device", default="auto")
    r.add_argument("--prev", type=Path, action="append", default=[], help="earlier results to copy in first (repeatable)")
    r.add_argument("--steps", type=int, nargs="*", default=None, help="only these plan steps (0-based)")
    r.add_argument("--dry-run", action="store_true", help="list the cells left and their estimates; run nothing")
    s = sub.add_parser("summarize", help="tables and figures from a results directory")
    s.add_argument("results", type=Path)
    s.add_argument("--report", type=Path, default=None, help="where to write (default RESULTS/report)")
    s.add_argument("--candidate", action="append", default=None,
                   help="a Sift family to check against the targets, a spec without tau (repeatable; default: sift, sift:vmc=true)")
    s.add_argument("--no-plots", action="store_true")
    s.add_argument("--previous", type=Path, default=None,
                   help="an earlier calib_grid.json: its cells that RESULTS lacks join the report")
    args = p.parse_args(argv)
    if args.cmd == "run":
        status = run_plan(args.plan, args.out, args.budget, device=args.device, prev=args.prev, dry_run=args.dry_run,
                          only_steps=args.steps)
        if args.dry_run:
            for c in status["left"]:
                print(f"{c['est_s']:7.1f} s  {c['cell']}")
        return 0
    if args.previous is not None and not args.previous.is_file():
        p.error(f"--previous {args.previous}: no such file")
    summarize(args.results, args.report, args.candidate or ("sift", "sift:vmc=true"), plots=not args.no_plots,
              previous=args.previous)
    print(f"wrote {(args.report or args.results / 'report')}/calib_grid.md, calib_grid.json and the figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
