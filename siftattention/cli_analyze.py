"""``sift analyze``: the paper's power-law analysis of attention quantiles (Section 3, Appendix A).

Registered in the ``sift`` group with ``cli.add_command(analyze)``; also runnable alone as
``python -m siftattention.cli_analyze`` (the same one-line errors as ``sift``).
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import click
from rich.console import Console

from .cli_common import DTYPES, OutDir, resolve_device, run_command, user_errors
from .progress import progress
from .report import claim_out_dir

out_console = Console()
err_console = Console(stderr=True)


class AnalyzeError(click.ClickException):
    """A user error: one line ``sift: error: ...`` on stderr, exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # noqa: ARG002 - click's signature
        err_console.print(f"sift: error: {self.message}", highlight=False, markup=False, soft_wrap=True)


def _command_line(params: dict) -> str:
    parts = ["sift", "analyze"]
    for name in ("model", "dataset", "data_file", "seq_len", "num_seqs", "taus", "warmups", "out", "device", "dtype"):
        value = params.get(name)
        if value is not None:
            parts += [f"--{name.replace('_', '-')}", str(value)]
    return " ".join(shlex.quote(p) for p in parts)


@click.command(
    name="analyze",
    help="Power-law analysis of attention quantiles (paper Sec. 3): for every window, layer, head and tau, the "
    "tau-quantile series theta_S of the teacher-forced attention probabilities, its power-law fit "
    "(alpha, beta, log-space R^2) and warmup fits (fit on S <= w, R^2 over all S). Writes summary.json, "
    "series.npz, PNG figures and report.md into --out. The defaults take about 4-5 min on 2 CPU cores.",
    short_help="The paper's power-law analysis of attention quantiles (Section 3).",
)
@click.option("--model", default="smollm2-135m", show_default=True, help="embedded name (smollm2-135m, gemma3-270m), local directory or hub id")
@click.option("--dataset", default="wikitext2", show_default=True, help="wikitext2, c4 or wiki (the name recorded with --data-file)")
@click.option("--data-file", type=click.Path(dir_okay=False), default=None, help="read this text file whole instead")
@click.option("--seq-len", default=2048, show_default=True, type=int, help="tokens per window (steps S = 1..seq-len)")
@click.option("--num-seqs", default=8, show_default=True, type=int, help="number of windows")
@click.option("--taus", default="0.5,0.75,0.875", show_default=True, help="comma-separated quantile levels in (0, 1)")
@click.option("--warmups", default="64,128,256,512", show_default=True, help="comma-separated warmup lengths (<= seq-len)")
@click.option("--out", type=OutDir(), default=None, help="output directory [default: runs/analysis/MODEL-DATASET]")
@click.option("--figures/--no-figures", default=True, show_default=True, help="write the PNG figures and report.md")
@click.option("--device", default="cpu", show_default=True, help="auto, cpu, cuda or cuda:N")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
              help="the weights' precision (the quantiles are taken in float32 either way)")
def analyze(model: str, dataset: str, data_file: str | None, seq_len: int, num_seqs: int, taus: str, warmups: str,
            out: Path | None, figures: bool, device: str, dtype: str) -> None:
    from .eval.analysis import check_lengths, load_analysis_corpus, parse_taus, parse_warmups

    if out is None:
        out = Path("runs") / "analysis" / f"{Path(model).name}-{dataset}"
    try:
        # Cheap checks first: a bad tau or warmup must not wait for the model to load.
        check_lengths(seq_len, num_seqs)
        device = resolve_device(device)
        parse_taus(taus)
        parse_warmups(warmups, seq_len)
        corpus = load_analysis_corpus(dataset, data_file)
        with claim_out_dir(out) as out:  # held until every file is written
            _analyze(model, dataset, data_file, seq_len, num_seqs, taus, warmups, corpus, out, figures, device, dtype)
    except user_errors() as err:
        raise AnalyzeError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None


def _analyze(model: str, dataset: str, data_file: str | None, seq_len: int, num_seqs: int, taus: str, warmups: str, corpus,
             out: Path, figures: bool, device: str = "cpu", dtype: str = "float32") -> None:
    import torch

    from .eval.analysis import FEW_STEPS, run_analysis
    from .eval.analysis_report import output_files, write_figures, write_report
    from .output import save_run

    command = _command_line(dict(model=model, dataset=dataset, data_file=data_file, seq_len=seq_len, num_seqs=num_seqs,
                                 taus=taus, warmups=warmups, out=out,
                                 **({} if device == "cpu" else {"device": device}),
                                 **({} if dtype == "float32" else {"dtype": dtype})))
    start = time.perf_counter()
    if seq_len < FEW_STEPS:
        err_console.print(f"sift: warning: --seq-len {seq_len}: R^2 over fewer than {FEW_STEPS} steps says little about a power law",
                          highlight=False, markup=False, soft_wrap=True)
    with progress(out_console) as bars:
        load_task = bars.add_task(f"loading {model}", total=None)
        tasks: dict[str, int] = {}

        def on_loaded(loaded_model, windows, source: str) -> None:
            bars.update(load_task, total=1, completed=1, description=f"loaded {model}; data {source}")
            from .eval.analysis import text_config

            layers = int(getattr(text_config(loaded_model), "num_hidden_layers", 0)) or None
            tasks["windows"] = bars.add_task("windows", total=int(windows.shape[0]))
            tasks["layers"] = bars.add_task("  layers", total=layers)

        def on_layer(i: int) -> None:
            bars.update(tasks["layers"], completed=i + 1)

        def on_window(i: int) -> None:
            bars.update(tasks["windows"], completed=i + 1)
            bars.update(tasks["layers"], completed=0)

        result = run_analysis(model, dataset, data_file=data_file, seq_len=seq_len, num_seqs=num_seqs, taus=taus,
                              warmups=warmups, corpus=corpus, on_loaded=on_loaded, on_window=on_window, on_layer=on_layer,
                              device=device, dtype=getattr(torch, dtype))
    result.command = command

    def draw() -> None:
        write_report(result, out, write_figures(result, out))

    # The data first, both files or neither; then the figures, an earlier run's gone first.
    save_run(out, result.files(), figures=draw if figures else None, stale=output_files(out))
    summary = result.summary()
    summary.setdefault("timing", {})["with_outputs_s"] = round(time.perf_counter() - start, 1)
    _print_summary(summary, out, figures)


def _print_summary(summary: dict, out: Path, figures: bool) -> None:
    from rich.table import Table

    table = Table(title=f"{summary['model']} / {summary['dataset']}: R^2 of power-law fits (median \\[p5, p95])")
    table.add_column("tau")
    table.add_column("full series")
    warm_keys = list(next(iter(summary["warmup_r2"].values())).keys())
    for w in warm_keys:
        table.add_column(f"w={w}")
    for tk, s in summary["r2"].items():
        cells = [f"{s['median']:.2f} \\[{s['p5']:.2f}, {s['p95']:.2f}]"]
        cells += [f"{summary['warmup_r2'][tk][w]['median']:.2f}" for w in warm_keys]
        table.add_row(tk, *cells)
    out_console.print(table)
    timing = summary.get("timing", {})
    out_console.print(f"paper: median R^2 0.6-0.8, p5 ~0.4; warmup medians rise with w, ~0.6 or above at w=512")
    if timing:
        out_console.print(f"wall {timing.get('with_outputs_s', timing.get('total_s'))} s, peak RSS {timing.get('peak_rss_mb')} MB")
    written = "summary.json, series.npz" + (", report.md and figures" if figures else "")
    out_console.print(f"wrote {written} to {out}")


if __name__ == "__main__":
    run_command(analyze, sys.argv[1:], "sift analyze", err_console)
