"""The calibration grid (siftattention.eval.calib_grid): its plan and configs, and its report checked against the
raw results of a tiny real run (tests/data/calib_grid: SmolLM2-135M on the CPU, 2 WikiText-2 windows of 256 tokens
scored after a 192-token prompt, and the first 4 IFEval prompts with 24 new tokens; Full, Top-k and Sift with
V-mean compensation; made by `python -m siftattention.eval.calib_grid run` on a plan of those two configs)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from siftattention.eval import calib_grid as cg
from siftattention.eval.generation_eval import method_slug, read_rows
from siftattention.eval.sweep import load_sweep
from siftattention.methods import parse_method

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "calib_grid"


def test_plan_covers_the_requirement_in_priority_order():
    cells = cg.plan_cells(ROOT / "configs" / "calib" / "plan.toml", root=ROOT)
    models = {"smollm2-135m", "gemma3-270m", "qwen2.5-1.5b"}
    # perplexity on all three models comes first, then IFEval's core cells
    first_eval = next(i for i, c in enumerate(cells) if c.kind != "ppl")
    assert {c.model for c in cells[:first_eval]} == models and all(c.kind == "ppl" for c in cells[:first_eval])
    assert cells[first_eval].kind == "ifeval"
    by_group: dict[tuple[str, str, int], set[str]] = {}
    for c in cells:
        by_group.setdefault((c.model, c.kind, c.seq_len), set()).add(parse_method(c.spec).spec())
    assert {(m, k) for m, k, _ in by_group} == {(m, k) for m in models for k in ("ppl", "ifeval", "longgen")}
    assert {L for m, k, L in by_group if k == "ppl"} == {2048, 4096}
    for group, specs in by_group.items():
        names = {parse_method(s).name for s in specs}
        assert {"full", "sift", "oracle", "topk", "toptheta", "skipsoftmax"} <= names, group
        for tau in cg.TAU_GRID:  # the candidate and today's defaults on the whole tau grid
            assert parse_method(f"sift:tau={tau},vmc=true").spec() in specs, (group, tau)
        for spec in ("sift:tau=0.875,warmup=16,warmup_source=decode", "sift:tau=0.875,vmc=true,recalibrate_every=0",
                     "oracle:tau=0.875,vmc=true", "topk:k=0.125,renormalize=false,vmc=true", "topk:k=0.05,renormalize=false,vmc=true"):
            assert parse_method(spec).spec() in specs, (group, spec)
    for cfg in (ROOT / "configs" / "calib").glob("ppl_*.toml"):
        ppl = cg.load_ppl_config(cfg)
        assert ppl.num_seqs >= 8 and [L for L, _, _ in ppl.lengths] == [2048, 4096]
        assert all(0 < P < L for L, P, _ in ppl.lengths)
    for cfg in (ROOT / "configs" / "calib").glob("*.toml"):
        if cfg.name.startswith(("ifeval_", "longgen_")):
            task = load_sweep(cfg).tasks[0]
            assert (task.name, task.limit) in (("ifeval", 541), ("longgen", 50))


def test_whole_run_sparsity_weights_every_decode_step():
    rows = [{"num_generated": 11, "realized_sparsity": 0.9}, {"num_generated": 3, "realized_sparsity": 0.5},
            {"num_generated": 1, "realized_sparsity": None}]
    assert cg.whole_run_sparsity(rows) == pytest.approx((0.9 * 10 + 0.5 * 2) / 12)


def test_at_sparsity_interpolates_from_full_and_says_how_far_the_nearest_point_is():
    full = {"realized": 0.0, "quality": 10.0}
    group = [{"realized": 0.5, "quality": 12.0}, {"realized": 0.9, "quality": 20.0}]
    assert cg.at_sparsity(full, group, 0.25) == (pytest.approx(11.0), pytest.approx(0.25))
    assert cg.at_sparsity(full, group, 0.8) == (pytest.approx(18.0), pytest.approx(0.1))
    assert math.isnan(cg.at_sparsity(full, group, 0.95)[0])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    results = tmp_path_factory.mktemp("calib") / "results"
    shutil.copytree(FIXTURE, results)
    return results, cg.summarize(results, plots=True)


def test_report_realized_and_perplexity_match_the_raw_json(report):
    results, rep = report
    raw = {r["method"]: r for f in (results / "ppl").rglob("results.json") for r in json.loads(f.read_text())["results"]}
    assert set(raw) == {"full", "topk:k=0.125,renormalize=false,vmc=true", "sift:tau=0.875,vmc=true"}
    group = rep["groups"]["smollm2-135m ppl-L256"]
    cells = {c["method"]: c for c in group["cells"]}
    for spec, r in raw.items():
        assert cells[spec]["realized"] == r["realized_sparsity"] and cells[spec]["quality"] == r["ppl"]
    sift, topk, full = raw["sift:tau=0.875,vmc=true"], raw["topk:k=0.125,renormalize=false,vmc=true"], raw["full"]
    [gap] = [r for r in group["realized"] if r["family"].startswith("sift")]
    assert gap["mean_abs_gap"] == pytest.approx(abs(sift["realized_sparsity"] - 0.875)) and not gap["complete_grid"]
    [row] = group["quality"]["sift:vmc=true"]
    assert row["increase"] == pytest.approx(sift["ppl"] - full["ppl"])
    s = sift["realized_sparsity"]
    assert s < topk["realized_sparsity"]  # Top-k is interpolated between Full (0) and its one point
    expect = full["ppl"] + (topk["ppl"] - full["ppl"]) * s / topk["realized_sparsity"]
    rival = row["rivals"]["topk"]
    assert rival["same_compensation"] and rival["quality"] == pytest.approx(expect)
    assert rival["nearest"] == pytest.approx(topk["realized_sparsity"] - s)
    md = (results / "report" / "calib_grid.md").read_text()
    assert f"{s:.3f} ({s - 0.875:+.3f})" in md and f"{sift['ppl'] - full['ppl']:.3f}" in md
    assert (results / "report" / "quality_smollm2-135m_ppl-L256.png").is_file()
    # the candidate "sift" (no compensation) has no cells in this run: its tables are empty, not wrong
    assert group["quality"]["sift"] == []


def test_report_generation_realized_and_rouge_match_the_jsonl(report):
    results, rep = report
    group = rep["groups"]["smollm2-135m ifeval"]
    cells = {c["method"]: c for c in group["cells"]}
    task_dir = results / "eval" / "smollm2-135m" / "ifeval"
    for spec in ("topk:k=0.125,renormalize=false,vmc=true", "sift:tau=0.875,vmc=true"):
        rows = read_rows(task_dir / f"{method_slug(parse_method(spec))}.jsonl")
        steps = [r["num_generated"] - 1 for r in rows]
        whole = sum(r["realized_sparsity"] * n for r, n in zip(rows, steps)) / sum(steps)
        assert cells[spec]["realized"] == pytest.approx(whole)
        assert cells[spec]["realized_sample_mean"] == pytest.approx(sum(r["realized_sparsity"] for r in rows) / len(rows))
        assert cells[spec]["quality"] == pytest.approx(sum(r["agreement"]["rouge_l"] for r in rows) / len(rows))
    assert cells["full"]["quality"] == 1.0 and cells["full"]["realized"] == 0.0
    [row] = group["quality"]["sift:vmc=true"]
    assert row["quality"] == cells["sift:tau=0.875,vmc=true"]["quality"]
    assert any(v.startswith("tau 0.875: ") and "topk" in v for v in group["verdicts"]["sift:vmc=true"])


def test_report_grows_from_new_results_and_an_earlier_report(report, tmp_path):
    """Cells missing from a results folder come from an earlier calib_grid.json; the report equals the one
    built from every raw file, and a cell present in both comes from the new results."""
    results, rep = report
    earlier = json.loads((results / "report" / "calib_grid.json").read_text())
    sift = method_slug(parse_method("sift:tau=0.875,vmc=true"))
    partial = tmp_path / "partial"
    shutil.copytree(FIXTURE, partial)
    shutil.rmtree(partial / "ppl" / "smollm2-135m" / "L256" / sift)
    for f in (partial / "eval" / "smollm2-135m" / "ifeval").glob(f"{sift}*"):
        f.unlink()
    alone = cg.build_report(partial)
    assert all("sift" not in c["method"] for g in alone["groups"].values() for c in g["cells"])
    merged = cg.summarize(partial, tmp_path / "report", plots=False, previous=results / "report" / "calib_grid.json")
    def text(rep):  # NaN compares unequal to itself: compare the JSON text, cells in one order
        rep = json.loads(json.dumps(rep, default=str))
        for g in rep["groups"].values():
            g["cells"].sort(key=lambda c: c["canonical"])
        return json.dumps(rep, sort_keys=True)

    assert text(merged) == text(earlier)
    # a stale earlier cell loses to the same cell in the results
    stale = json.loads(json.dumps(earlier))
    for g in stale["groups"].values():
        for c in g["cells"]:
            c["quality"] = -1.0
    fresh = cg.build_report(results, previous=stale)
    assert all(c["quality"] != -1.0 for g in fresh["groups"].values() for c in g["cells"])
    # ...unless only the earlier one is scored: the fixture's cells are decoded, not scored
    [full] = [c for c in stale["groups"]["smollm2-135m ifeval"]["cells"] if c["name"] == "full"]
    assert math.isnan(full["score"])
    full["score"] = 0.25
    fresh = cg.build_report(results, previous=stale)
    [full] = [c for c in fresh["groups"]["smollm2-135m ifeval"]["cells"] if c["name"] == "full"]
    assert full["score"] == 0.25 and full["quality"] == -1.0
