"""Generation-task evaluation: batched greedy decoding per method, per-sample JSONL, summaries, resume.

For one task and several methods, ``evaluate_generation`` prompts the model (chat template,
left padding), decodes greedily with each method in decode mode (exact prefill, then the
method's per-sequence warmup and thresholds), scores every response with the task's
checker and measures how far it stays with Full's response on the same prompt.

Layout of ``out/<task>/``:

- ``run.json``: what the results depend on (model, data digest, chat, generation cap, batch
  size); a later run into the same directory must match it, so resumed results never mix settings;
- ``<method>.jsonl``: one line per finished sample (prompt id, generated tokens and text,
  token count, realized sparsity, score fields, agreement with Full), appended batch by
  batch: an interrupted run loses at most the batch in flight, and a resumed run skips
  finished samples (batches are fixed chunks of the task's sample order, so a resumed run
  decodes exactly the batches an uninterrupted one would);
- ``<method>.summary.json`` and ``summary.json``: metrics over all samples and over the
  samples that generated at least ``min_new_tokens`` tokens (the paper drops the others),
  with how many were dropped.

Full always runs first (added when not asked for): agreement needs its tokens.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..methods import Full, Method, parse_method
from ..output import OutputWriteError, json_bytes, json_line, save_run, write_bytes, write_json
from .batching import left_pad
from .prompt_encoding import encode_prompt
from .tasks import Sample, Task, TaskData, agreement
from .tasks.base import mean

RUN_KEYS = ("task", "task_options", "model", "chat", "max_new_tokens", "batch_size", "data_sha256")


class RunMismatchError(ValueError):
    """The output directory holds results made with other settings."""


# -- prompts ------------------------------------------------------------------------------------
def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompts(tokenizer, samples: Sequence[Sample], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: the chat template with a generation prompt, or the plain text."""
    return [encode_prompt(tokenizer, s, chat) for s in samples]


END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<eos>")


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a reply: the generation config's EOS, the tokenizer's, and known end-of-turn tokens."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    ids.extend(vocab[t] for t in END_OF_TURN if t in vocab)
    return sorted(set(ids))


# -- generation ---------------------------------------------------------------------------------
@dataclass
class BatchOutput:
    tokens: list[list[int]]  # new tokens of each row, up to and including its EOS
    hit_eos: list[bool]
    sparsity: list[float]  # per row, over its decode steps (NaN where it has none)
    sparsity_post_warmup: list[float]
    fast: bool


def sequence_sparsity(stats, method: Method, num_generated: torch.Tensor, post_warmup: bool) -> list[float]:
    """Realized sparsity of each row over the decode steps that produced its tokens.

    Token ``t >= 1`` of a row is produced by decode step ``t - 1`` (token 0 by the prefill),
    so a row with ``n`` tokens (its EOS included) counts its first ``n - 1`` steps; steps run
    after its EOS, while other rows go on, do not count.
    """
    n = num_generated.cpu()
    if method.always_exact:
        return [0.0 if int(k) > 1 else float("nan") for k in n]
    sparsity, selected = stats.rows(post_warmup=post_warmup)
    if sparsity.numel() == 0:
        return [float("nan")] * len(n)
    steps = torch.arange(sparsity.shape[-1])
    within = steps[None, :] < (n[:, None] - 1)  # [B, N]
    weight = (selected & within[None, :, None, :]).expand_as(sparsity).double()
    total = weight.sum(dim=(0, 2, 3))
    value = (sparsity * weight).sum(dim=(0, 2, 3)) / total.clamp(min=1)
    return [float(v) if t > 0 else float("nan") for v, t in zip(value, total)]


def generate_batch(model, input_ids: torch.Tensor, mask: torch.Tensor, method: Method, max_new_tokens: int, eos_ids: list[int],
                   pad_id: int, path: str = "auto") -> BatchOutput:
    """Greedy generation of one left-padded batch with ``method``.

    ``path``: "fast" and "auto" are ``siftattention.generation.generate`` (fixed cache, CUDA
    graphs on CUDA; it falls back to transformers' generate itself where it cannot serve a
    method), "reference" is ``reference_generate`` (transformers' ``generate`` under
    ``apply``). Both give the same tokens.
    """
    import warnings

    from ..generation import generate, reference_generate
    from ..notices import FallbackWarning

    if path not in ("auto", "fast", "reference"):
        raise ValueError(f"path must be auto, fast or reference, got {path!r}")
    run = reference_generate if path == "reference" else generate
    with warnings.catch_warnings():
        # The fast path's fallback notice: `fast` is recorded per sample. Every other warning shows.
        warnings.filterwarnings("ignore", category=FallbackWarning)
        res = run(model, input_ids, mask, method, max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id)
    num = res.num_generated.cpu()
    new = res.new_tokens.cpu()
    tokens = [new[b, : int(num[b])].tolist() for b in range(new.shape[0])]
    eos = set(eos_ids)
    output = BatchOutput(
        tokens=tokens,
        hit_eos=[bool(t) and t[-1] in eos for t in tokens],
        sparsity=sequence_sparsity(res.stats, method, num, post_warmup=False),
        sparsity_post_warmup=sequence_sparsity(res.stats, method, num, post_warmup=True),
        fast=bool(res.fast),
    )
    if input_ids.is_cuda:
        # generate() frees its cache and graphs on return; hand the cached blocks back too, so the
        # next method's batch (another shape) does not fragment around them.
        del res
        torch.cuda.empty_cache()
    return output


# -- results on disk ----------------------------------------------------------------------------
def method_slug(method: Method) -> str:
    """A file name for a method, from its canonical spec (so spellings of one method share it)."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", method.spec()).strip("_")


def intended_sparsity(method: Method) -> float:
    if method.name in ("sift", "oracle"):
        return float(method.tau)
    if method.name in ("topk", "h2o"):
        return 1.0 - float(method.k)
    return 0.0


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Finished samples of a method; a torn last line (an interrupted write) is dropped from the file."""
    if not path.is_file():
        return []
    rows, good = [], 0
    # Split on "\n" only: str.splitlines() also splits at U+2028 and other separators a generated text can hold.
    lines = path.read_text(encoding="utf-8").split("\n")
    lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    for line in lines:
        try:
            rows.append(json.loads(line))
            good += len(line.encode("utf-8"))
        except json.JSONDecodeError:
            break
    if len(rows) < len(lines):
        with path.open("r+b") as f:
            f.truncate(good)
    return rows


def append_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Add finished samples to ``path``, all of them or (the disk refusing) none: the file is cut back."""
    data = "".join(json_line(r) + "\n" for r in rows).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as err:
            os.ftruncate(fd, size)
            reason = err.strerror or type(err).__name__
            raise OutputWriteError(f"could not write {path} ({reason})", path, reason) from None
    finally:
        os.close(fd)


def run_key(task: Task, data: TaskData, settings: "EvalSettings") -> dict[str, Any]:
    """What the results in a task directory depend on (``run.json``)."""
    return {
        "task": task.name,
        # files: data_sha256 covers them; scoring options do not change the decoded text
        "task_options": {k: v for k, v in task.settings.items() if not k.endswith("_file") and k not in task.scoring_options},
        "model": settings.model,
        "chat": settings.chat,
        "max_new_tokens": settings.max_new_tokens,
        "batch_size": settings.batch_size,
        "data_sha256": data.sha256,
    }


def rescore(task: Task, samples: dict[str, Sample], path: Path, rows: dict[str, dict[str, Any]]) -> None:
    """Score the finished samples that were decoded with scoring off, and rewrite their file."""
    for row in rows.values():
        if row["scores"] is None or task.stale(row["scores"]):
            row["scores"] = task.score(samples[row["id"]], task.cut_at_stop(row["text"]))
    everything = read_rows(path)  # rows outside this run's limit stay as they are
    for row in everything:
        if row["id"] in rows:
            row["scores"] = rows[row["id"]]["scores"]
    write_bytes(path, "".join(json_line(r) + "\n" for r in everything).encode("utf-8"))


def check_run(task_dir: Path, run: dict[str, Any]) -> None:
    """Refuse to mix results of different settings in one directory (before any work)."""
    path = task_dir / "run.json"
    if not path.is_file():
        return
    try:
        previous = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise RunMismatchError(f"{path} is unreadable; use another --out") from None
    for key in RUN_KEYS:
        if previous.get(key) != run.get(key):
            raise RunMismatchError(
                f"{task_dir} holds results made with {key}={previous.get(key)!r}, not {run.get(key)!r}; use another --out to start afresh"
            )


# -- summaries ----------------------------------------------------------------------------------
def summarize_rows(task: Task, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    agree = [r["agreement"] for r in rows if r.get("agreement") is not None]
    return {
        "n": len(rows),
        "metrics": task.aggregate([r["scores"] for r in rows]) if rows and all(r["scores"] is not None for r in rows) else {},
        "realized_sparsity": mean([r["realized_sparsity"] for r in rows]),
        "realized_sparsity_post_warmup": mean([r["realized_sparsity_post_warmup"] for r in rows]),
        "mean_new_tokens": mean([r["num_generated"] for r in rows]),
        "eos_rate": mean([r["hit_eos"] for r in rows]),
        "agreement": {
            key: mean([a[key] for a in agree]) for key in ("lcp_tokens", "lcp_fraction", "rouge_l", "identical")
        } if agree else None,
    }


def summarize(task: Task, spec: str, method: Method, rows: Sequence[dict[str, Any]], min_new_tokens: int, context: dict[str, Any]) -> dict[str, Any]:
    """Metrics over all samples and over those that generated >= ``min_new_tokens`` tokens."""
    valid = [r for r in rows if r["num_generated"] >= min_new_tokens]
    return {
        **context,
        "task": task.name,
        "method": spec,
        "method_canonical": method.spec(),
        "method_name": method.name,
        "warmup": int(getattr(method, "warmup", 0)),
        "renormalize": bool(getattr(method, "renormalize", False)),
        "intended_sparsity": intended_sparsity(method),
        "headline": task.headline,
        "all": summarize_rows(task, rows),
        "valid": {"min_new_tokens": min_new_tokens, "dropped": len(rows) - len(valid), **summarize_rows(task, valid)},
        "fast_path": any(r.get("fast") for r in rows),
        "decoded_on": sorted({r.get("device", "not recorded") for r in rows}),
        "generation_s": round(sum(r.get("seconds", 0.0) for r in rows), 2),
    }


# -- the runner ---------------------------------------------------------------------------------
@dataclass
class EvalSettings:
    model: str
    max_new_tokens: int
    batch_size: int = 8
    limit: int | None = None
    chat: bool = True
    min_new_tokens: int | None = None  # default: the largest warmup among the methods
    path: str = "auto"
    #: score responses now; False leaves ``scores`` null (a machine without the checkers), and a
    #: later run with scoring on fills them in without decoding again
    score: bool = True
    #: False: decode nothing, only score and summarise what is finished (methods with missing samples are skipped)
    decode: bool = True


def with_full(specs: Sequence[str]) -> list[tuple[str, Method]]:
    """Parsed methods with Full first (added when missing); duplicates of one canonical method dropped."""
    methods, seen = [], set()
    for spec in specs:
        method = parse_method(spec)
        if method.spec() not in seen:
            seen.add(method.spec())
            methods.append((spec, method))
    fulls = [m for m in methods if m[1].name == "full"]
    rest = [m for m in methods if m[1].name != "full"]
    return (fulls or [("full", Full())]) + rest


def check_settings(settings: EvalSettings) -> None:
    if settings.limit is not None and settings.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {settings.limit}")
    if settings.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {settings.max_new_tokens}")
    if settings.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {settings.batch_size}")
    if settings.min_new_tokens is not None and settings.min_new_tokens < 0:
        raise ValueError(f"--min-new-tokens must be >= 0, got {settings.min_new_tokens}")


def evaluate_generation(
    model,
    tokenizer,
    task: Task,
    data: TaskData,
    specs: Sequence[str],
    out: Path,
    settings: EvalSettings,
    *,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) every method on the task's samples; returns one summary per method, Full first.

    ``on_progress(spec, done, total)`` is called once per method at its start (with the samples
    already finished) and after every batch.
    """
    check_settings(settings)
    methods = with_full(specs)
    if settings.chat and not has_chat_template(tokenizer):
        raise ValueError(f"the tokenizer of {settings.model} has no chat template; pass --no-chat to prompt with plain text")
    samples = data.samples[: settings.limit] if settings.limit else list(data.samples)
    if not samples:
        raise ValueError(f"task {task.name} has no samples ({data.source})")
    run = run_key(task, data, settings)
    task_dir = Path(out) / task.name
    check_run(task_dir, run)
    task_dir.mkdir(parents=True, exist_ok=True)
    try:
        write_json(task_dir / "run.json", {**run, "data_source": data.source})
    except OutputWriteError as err:
        raise OutputWriteError(f"{err}; nothing was decoded or saved", err.path, err.reason) from None
    min_new = settings.min_new_tokens if settings.min_new_tokens is not None else max(m.warmup for _, m in methods)

    if model is None and settings.decode:
        raise ValueError("decoding needs the model")
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    eos_ids = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    prompts = encode_prompts(tokenizer, samples, settings.chat)
    batches = [list(range(i, min(i + settings.batch_size, len(samples)))) for i in range(0, len(samples), settings.batch_size)]
    wanted = {s.id for s in samples}
    context = {"model": settings.model, "data_source": data.source, "chat": settings.chat, "max_new_tokens": settings.max_new_tokens,
               "batch_size": settings.batch_size, "limit": len(samples), "scorer": task.info()}

    full_tokens: dict[str, list[int]] = {}
    summaries = []
    files: dict[str, bytes] = {}  # the summaries, written together at the end
    for spec, method in methods:
        path = task_dir / f"{method_slug(method)}.jsonl"
        rows = {r["id"]: r for r in read_rows(path) if r["id"] in wanted}
        if settings.score and any(r["scores"] is None or task.stale(r["scores"]) for r in rows.values()):
            rescore(task, {s.id: s for s in samples}, path, rows)
        if on_progress:
            on_progress(spec, len(rows), len(samples))
        for batch in batches:
            todo = [i for i in batch if samples[i].id not in rows]
            if not todo or not settings.decode:
                continue
            method.prepare(model)  # a no-op once done: Top-theta calibrates on its corpus before its first batch
            ids, mask = left_pad([prompts[i] for i in batch], pad_id, device)
            start = time.perf_counter()
            output = generate_batch(model, ids, mask, method, settings.max_new_tokens, eos_ids, pad_id, settings.path)
            seconds = (time.perf_counter() - start) / len(batch)
            new_rows = []
            for j, i in enumerate(batch):
                sample = samples[i]
                if sample.id in rows:
                    continue
                tokens = output.tokens[j]
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                row = {
                    "id": sample.id,
                    "prompt_tokens": len(prompts[i]),
                    "num_generated": len(tokens),
                    "hit_eos": output.hit_eos[j],
                    "realized_sparsity": output.sparsity[j],
                    "realized_sparsity_post_warmup": output.sparsity_post_warmup[j],
                    "scores": {**task.score(sample, task.cut_at_stop(text)), **task.probe(model, sample, prompts[i], method)}
                    if settings.score else None,
                    "agreement": None if method.name == "full" else agreement(full_tokens[sample.id], tokens),
                    "fast": output.fast,
                    "device": device_name,
                    "seconds": round(seconds, 4),
                    "text": text,
                    "tokens": tokens,
                }
                rows[sample.id] = row
                new_rows.append(row)
            try:
                append_rows(path, new_rows)
            except OutputWriteError as err:
                raise OutputWriteError(f"{err}; saved: {len(rows) - len(new_rows)} finished samples of {spec} in that file "
                                       "and the methods before it; the same command resumes from there", path, err.reason) from None
            if on_progress:
                on_progress(spec, len(rows), len(samples))
        if len(rows) < len(samples):  # only without decoding: an unfinished cell is left out
            continue
        ordered = [rows[s.id] for s in samples]
        if method.name == "full":
            full_tokens = {r["id"]: r["tokens"] for r in ordered}
        summaries.append(summarize(task, spec, method, ordered, min_new, context))
        files[f"{method_slug(method)}.summary.json"] = json_bytes(summaries[-1])
    combined = {**context, "task": task.name, "min_new_tokens": min_new, "methods": summaries}
    try:
        save_run(task_dir, {**files, "summary.json": json_bytes(combined)})
    except OutputWriteError as err:
        raise OutputWriteError(f"could not write {err.path} ({err.reason}); the summaries were not written, every finished "
                               f"sample is saved in {task_dir}/*.jsonl, and the same command writes them without decoding "
                               "again", err.path, err.reason) from None
    return summaries


def short_metric(name: str) -> str:
    """Column titles that fit a terminal: prompt_level_strict_acc -> prompt strict."""
    return name.replace("_level_", " ").replace("_acc", "").replace("exact_match", "em").replace("_", " ")


def summary_table_rows(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows for a table: the task's metrics (all samples), sparsity, agreement, drops."""
    rows = []
    for s in summaries:
        row: dict[str, Any] = {"method": s["method"]}
        row.update({short_metric(k): v for k, v in s["all"]["metrics"].items()})
        row["sparsity"] = s["all"]["realized_sparsity"]
        row["sparsity (post-w)"] = s["all"]["realized_sparsity_post_warmup"]
        agree = s["all"]["agreement"]
        row["LCP"] = agree["lcp_tokens"] if agree else float("nan")
        row["ROUGE-L"] = agree["rouge_l"] if agree else float("nan")
        row["tokens"] = s["all"]["mean_new_tokens"]
        row[f"n >= {s['valid']['min_new_tokens']} tok"] = f"{s['valid']['n']}/{s['all']['n']}"
        rows.append(row)
    return rows

