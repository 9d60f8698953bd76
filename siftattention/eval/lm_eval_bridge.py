"""lm-evaluation-harness on a model with a method applied: ``HFLM(pretrained=model, ...)``.

``apply(model, method)`` patches the model in place, so lm-eval's ``HFLM`` wrapped around
the patched model runs any lm-eval task through the method: ``generate_until`` tasks call
``model.generate`` (decode mode: exact prefill, then the method per decoded token, its
warmup per sequence), loglikelihood tasks call ``model(...)`` (teacher-forced: every row is a
step, as in ``sift ppl``). After every call the bridge adds that call's realized sparsity
(all recorded rows, warmup rows counting as 0, steps run after a row stopped included) to a
step-weighted mean, reported beside lm-eval's metrics.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Sequence


class SparsityMeter:
    """Step-weighted realized sparsity over many forward / generate calls."""

    def __init__(self, exact: bool = False) -> None:
        self.exact = exact  # Full: sparsity 0 by definition (its rows are not recorded)
        self.calls = 0
        self.pruned = 0.0
        self.weight = 0.0
        self.pruned_post = 0.0
        self.weight_post = 0.0

    def add(self, stats) -> None:
        self.calls += 1
        if self.exact:
            return
        for post in (False, True):
            sparsity, selected = stats.rows(post_warmup=post)
            if sparsity.numel() == 0:
                continue
            w = selected.expand_as(sparsity).double()
            if post:
                self.pruned_post += float((sparsity * w).sum())
                self.weight_post += float(w.sum())
            else:
                self.pruned += float((sparsity * w).sum())
                self.weight += float(w.sum())

    def result(self) -> dict[str, float]:
        if self.exact:
            return {"realized_sparsity": 0.0, "realized_sparsity_post_warmup": 0.0, "steps": None, "calls": self.calls}
        nan = float("nan")
        return {
            "realized_sparsity": self.pruned / self.weight if self.weight else nan,
            "realized_sparsity_post_warmup": self.pruned_post / self.weight_post if self.weight_post else nan,
            "steps": self.weight,
            "calls": self.calls,
        }


def metered_lm(handle, meter: SparsityMeter, **kwargs: Any):
    """An lm-eval ``HFLM`` around ``handle.model`` that records realized sparsity after every call."""
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as err:
        raise ImportError(f"sift lm-eval needs lm-eval: pip install 'siftattention[eval]' ({err})") from None

    class MeteredHFLM(HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            out = super()._model_call(inps, attn_mask=attn_mask, labels=labels)
            meter.add(handle.stats)
            return out

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
            meter.add(handle.stats)
            return out

    return MeteredHFLM(pretrained=handle.model, **kwargs)


@functools.lru_cache(maxsize=4)
def _manager(include_path: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def task_manager(tasks: Sequence[str], include_path: Path | None):
    """lm-eval's task index; only the include path's when it has every task (indexing lm-eval's own takes ~15 s)."""
    path = str(include_path) if include_path else None
    if path is not None:
        local = _manager(path, False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = _manager(path, True)
    for name in tasks:
        if name not in manager.all_tasks:
            raise ValueError(f"unknown lm-eval task {name!r}" + (f" (also looked in {include_path})" if include_path else ""))
    return manager


def evaluate_lm_eval(model, tokenizer, method, tasks: Sequence[str], *, limit: int | None = None, batch_size: int = 8,
                     num_fewshot: int | None = None, include_path: Path | None = None, apply_chat_template: bool = False) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on ``model`` with ``method`` applied (prepared: see ``Method.prepare``); its results plus realized sparsity."""
    import lm_eval

    from ..hf import apply

    manager = task_manager(tasks, include_path)
    meter = SparsityMeter(exact=method.always_exact)
    with apply(model, method) as handle:
        lm = metered_lm(handle, meter, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                          apply_chat_template=apply_chat_template, log_samples=False)
        elapsed = time.perf_counter() - start
    return {"results": results["results"], "n_samples": results.get("n-samples", {}), "versions": results.get("versions", {}),
            **meter.result(), "elapsed_s": round(elapsed, 1)}


def run_lm_eval(tasks: str, model_name: str, specs: Sequence[str], *, limit: int | None, batch_size: int, num_fewshot: int | None,
                include_path: Path | None, apply_chat_template: bool, out: Path, device: str, dtype: str, console) -> list[dict[str, Any]]:
    """``sift lm-eval``: one lm-eval run per method; writes ``out/<method>.json`` and prints a table."""
    from ..methods import parse_methods
    from ..output import OutputWriteError, write_json
    from ..report import versions
    from .generation_eval import method_slug
    from .runner import load_for_eval

    methods = parse_methods(specs)
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ValueError("--tasks names no task")
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise ImportError(f"sift lm-eval needs lm-eval: pip install 'siftattention[eval]' ({err})") from None
    model, tokenizer = load_for_eval(model_name, device, dtype)
    rows, payloads = [], []
    for spec, method in methods:
        method.prepare(model)  # Top-theta's calibration on its corpus; apply only installs
        result = evaluate_lm_eval(model, tokenizer, method, names, limit=limit, batch_size=batch_size, num_fewshot=num_fewshot,
                                  include_path=include_path, apply_chat_template=apply_chat_template)
        payload = {"model": model_name, "method": spec, "tasks": names, "limit": limit, "versions": versions(), **result}
        try:
            write_json(out / f"{method_slug(method)}.json", payload)
        except OutputWriteError as err:
            saved = ", ".join(str(out / f"{method_slug(m)}.json") for _, m in methods[: len(payloads)]) or "nothing"
            raise OutputWriteError(f"{err}; saved: {saved}", err.path, err.reason) from None
        payloads.append(payload)
        for task, metrics in result["results"].items():
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not key.endswith("_stderr,none") and "stderr" not in key:
                    rows.append({"method": spec, "task": task, "metric": key, "value": float(value),
                                 "sparsity": result["realized_sparsity"]})
    from ..report import results_table

    console.print(results_table(rows, [("method", "method"), ("task", "task"), ("metric", "metric"), ("value", "value"), ("sparsity", "sparsity")],
                                title=f"lm-eval on {model_name}"))
    console.print(f"wrote {out}/")
    return payloads
