"""``sift eval``, ``sift sweep`` and ``sift lm-eval``: generation tasks with the methods applied.

Registered in the ``sift`` group with ``cli.add_command``; bad input is one line on stderr
(``sift: error: ...``) and exit status 2, checked before the model loads where possible.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from .cli_common import DTYPES, OutDir, user_errors
from .eval.runner import console, run_eval
from .methods import SPEC_HELP, parse_methods
from .report import claim_out_dir

err_console = Console(stderr=True)


class EvalError(click.ClickException):
    """A user error: one line ``sift: error: ...`` on stderr, exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # noqa: ARG002 - click's signature
        err_console.print(f"sift: error: {self.message}", highlight=False, markup=False, soft_wrap=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    return (*user_errors(), ImportError)  # ImportError: lm-eval, the checkers' package, is not installed


def _wrap_user_errors(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except _user_errors() as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise EvalError(message) from None


@click.command(
    name="eval",
    help="Evaluate methods on a generation task (ifeval, math-hard, longgen, longgen-wu, ruler, ruler-4k/8k/16k/32k): batched greedy decoding with "
    "the chat template, per-sample JSONL and a summary per method in OUT/TASK/, resumable.\n\n\b\n" + SPEC_HELP,
    short_help="Methods on a generation task (ifeval, math-hard, longgen, ruler).",
)
@click.argument("task_name", metavar="TASK")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True, help="embedded name, local directory or hub id")
@click.option("--method", "specs", multiple=True, required=True, help="method spec, repeatable, each method once; Full always runs (agreement)")
@click.option("--limit", type=int, default=None, help="the first N samples [default: all]")
@click.option("--max-new-tokens", type=int, default=None, help="generation cap [default: the task's: ifeval 1280, math-hard 1024, longgen 4096]")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--out", type=OutDir(), default=Path("runs/eval"), show_default=True, help="directory for OUT/TASK/ (created if missing)")
@click.option("--data-file", type=click.Path(path_type=Path), default=None, help="the task's data file (JSONL, or the LongGenBench file)")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None, help="a directory with the LongGenBench files (gsm8k/, spinning-golden-thread/)")
@click.option("--task-option", "task_options", multiple=True, help="KEY=VALUE, repeatable: longgen k=35, math-hard fewshot=4, ruler length=8192 samples=4 diagnose=1")
@click.option("--chat/--no-chat", default=True, show_default=True, help="prompt through the tokenizer's chat template")
@click.option("--min-new-tokens", type=int, default=None, help="'valid' samples generated at least this many tokens [default: the largest warmup]")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True, help="the weights' precision")
@click.option("--path", "gen_path", type=click.Choice(["auto", "fast", "reference"]), default="auto", show_default=True,
              help="decode path: the fast loop (siftattention.generation) or transformers' generate")
@click.option("--score/--no-score", default=True, show_default=True,
              help="--no-score decodes only (a machine without lm-eval); a later run with scoring fills the scores in")
def eval_command(task_name: str, model_name: str, specs: tuple[str, ...], limit: int | None, max_new_tokens: int | None, batch_size: int,
                 out: Path, data_file: Path | None, data_dir: Path | None, task_options: tuple[str, ...], chat: bool,
                 min_new_tokens: int | None, device: str, dtype: str, gen_path: str, score: bool) -> None:
    from .eval.tasks import parse_options

    def run() -> None:
        if data_file is not None and data_dir is not None:
            raise ValueError("give --data-file or --data-dir, not both")
        if limit is not None and limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        parse_methods(specs)
        run_eval(task_name, model_name, specs, out=out, limit=limit, max_new_tokens=max_new_tokens, batch_size=batch_size,
                 data_path=data_file or data_dir, task_options=parse_options(task_options), chat=chat, min_new_tokens=min_new_tokens,
                 device=device, dtype=dtype, path=gen_path, score=score)

    _wrap_user_errors(run)


@click.command(name="sweep", help="Run a grid of tasks x methods x parameters from a TOML file (see docs/eval.md); "
               "resumable (finished samples and cells are skipped); writes sweep.json, sweep.md and the paper's figures.",
               short_help="A grid of tasks x methods from a TOML file, with figures.")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", type=OutDir(), default=None, help="overrides the config's out")
@click.option("--plots-only", is_flag=True, help="redraw the figures and tables from the finished cells, decode nothing")
@click.option("--score-only", is_flag=True, help="score and summarise the finished samples (decoded elsewhere), decode nothing")
@click.option("--score/--no-score", "score", default=None, help="override the config's score")
def sweep_command(config: Path, out: Path | None, plots_only: bool, score_only: bool, score: bool | None) -> None:
    from .eval.sweep import load_sweep, run_sweep

    def run() -> None:
        sweep = load_sweep(config)
        if out is not None:
            sweep.out = out
        if score is not None:
            sweep.score = score
        with claim_out_dir(sweep.out):
            run_sweep(sweep, plots_only=plots_only, decode=not score_only)

    _wrap_user_errors(run)


@click.command(name="lm-eval", help="Run lm-evaluation-harness tasks on the model with a method applied (HFLM on the patched "
               "model): generation tasks decode with the method in decode mode, loglikelihood tasks run teacher-forced.\n\n\b\n" + SPEC_HELP,
               short_help="lm-evaluation-harness tasks on the model with a method applied.")
@click.option("--tasks", required=True, help="comma-separated lm-eval task names")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True, help="embedded name, local directory or hub id")
@click.option("--method", "specs", multiple=True, default=("full",), show_default=True,
              help="method spec, repeatable, each method once: one lm-eval run each")
@click.option("--limit", type=int, default=None, help="samples per task")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--num-fewshot", type=int, default=None)
@click.option("--include-path", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None, help="extra task YAML directory")
@click.option("--apply-chat-template/--no-apply-chat-template", default=False, show_default=True)
@click.option("--out", type=OutDir(), default=Path("runs/lm-eval"), show_default=True, help="directory for one METHOD.json per method")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True, help="the weights' precision")
def lm_eval_command(tasks: str, model_name: str, specs: tuple[str, ...], limit: int | None, batch_size: int, num_fewshot: int | None,
                    include_path: Path | None, apply_chat_template: bool, out: Path, device: str, dtype: str) -> None:
    from .eval.lm_eval_bridge import run_lm_eval

    def run() -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        parse_methods(specs)
        with claim_out_dir(out):
            run_lm_eval(tasks, model_name, specs, limit=limit, batch_size=batch_size, num_fewshot=num_fewshot, include_path=include_path,
                        apply_chat_template=apply_chat_template, out=out, device=device, dtype=dtype, console=console)

    _wrap_user_errors(run)


commands = [eval_command, sweep_command, lm_eval_command]
