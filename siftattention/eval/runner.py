"""Evaluation runs as the command line starts them: load the model, evaluate with a progress bar, print the table.

``sift eval``, ``sift sweep`` and ``sift lm-eval`` call these; so do the sweep and the
lm-eval bridge, which run the same steps for each cell of a grid.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console

from ..cli_common import DTYPES, resolve_device
from ..progress import progress, status
from ..report import claim_out_dir

console = Console(width=None if sys.stdout.isatty() else 160)


def load_for_eval(model_name: str, device: str, dtype: str):
    import torch

    from ..models import load_model

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    with status(console, f"loading {model_name} ..."):
        start = time.perf_counter()
        model, tokenizer = load_model(model_name, dtype=getattr(torch, dtype), device=resolve_device(device))
    console.print(f"model: {model_name} ({type(model).__name__}, {dtype}, {model.device}) loaded in {time.perf_counter() - start:.1f} s")
    return model, tokenizer


def load_tokenizer(model_name: str):
    """The tokenizer alone (for scoring and summarising without decoding)."""
    from transformers import AutoTokenizer

    from ..models import EMBEDDED

    with status(console, f"loading the tokenizer of {model_name} ..."):
        if model_name in EMBEDDED:
            directory, gguf_file = EMBEDDED[model_name].locate()
            return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(model_name)


def progress_bar():
    return progress(console)


def run_eval(task_name: str, model_name: str, specs: Sequence[str], *, out: Path, limit: int | None, max_new_tokens: int | None,
             batch_size: int, data_path: Path | None, task_options: dict[str, Any], chat: bool, min_new_tokens: int | None,
             device: str, dtype: str, path: str, score: bool = True, decode: bool = True, loaded=None) -> list[dict]:
    """Check everything cheap, load the model, evaluate with a progress bar, print the table."""
    from .generation_eval import EvalSettings, check_settings, with_full
    from .tasks import get_task

    methods = with_full(specs)  # a bad spec fails before anything else
    task = get_task(task_name, **task_options)
    task.for_model(model_name, chat)
    settings = EvalSettings(model=model_name, max_new_tokens=max_new_tokens or task.default_max_new_tokens, batch_size=batch_size,
                            limit=limit, chat=chat, min_new_tokens=min_new_tokens, path=path, score=score, decode=decode)
    check_settings(settings)
    if decode and loaded is None:
        resolve_device(device)
    with claim_out_dir(out):  # held until the summaries are written: one run at a time appends to the samples
        return _eval(task, model_name, methods, out, data_path, settings, device, dtype, decode, loaded)


def _eval(task, model_name: str, methods: list, out: Path, data_path: Path | None, settings, device: str, dtype: str,
          decode: bool, loaded) -> list[dict]:
    from .generation_eval import check_run, evaluate_generation, run_key

    data = task.load(data_path)
    check_run(out / task.name, run_key(task, data, settings))
    n = min(settings.limit or len(data.samples), len(data.samples))
    console.print(f"task: {task.name}, {n} of {len(data.samples)} samples from {data.source}; methods: {', '.join(s for s, _ in methods)}")
    if decode:
        model, tokenizer = loaded or load_for_eval(model_name, device, dtype)
    else:  # scoring finished samples needs the tokenizer's prompts only, never the weights
        model, tokenizer = loaded or (None, load_tokenizer(model_name))
    start = time.perf_counter()
    with progress_bar() as bars:
        bar = bars.add_task(task.name, total=len(methods) * n)
        offsets: dict[str, int] = {}

        def on_progress(spec: str, done: int, total: int) -> None:
            if spec not in offsets:
                offsets[spec] = len(offsets) * total
            bars.update(bar, completed=offsets[spec] + done, description=f"{task.name} [{spec}]")

        summaries = evaluate_generation(model, tokenizer, task, data, [s for s, _ in methods], out, settings, on_progress=on_progress)
    print_summaries(task.name, summaries, title=f"{model_name} / {task.name} ({n} samples, max {settings.max_new_tokens} new tokens)")
    console.print(f"wrote {out / task.name}/ (per-sample JSONL, summary.json) in {time.perf_counter() - start:.0f} s")
    return summaries


def print_summaries(task_name: str, summaries: Sequence[dict], title: str) -> None:
    from .generation_eval import summary_table_rows
    from ..report import results_table

    rows = summary_table_rows(summaries)
    # Rows may differ in keys (scored and unscored runs, different warmups): every key, first seen first.
    columns = [(key, key) for key in dict.fromkeys(k for row in rows for k in row)]
    console.print(results_table(rows, columns, title=title))
