"""What every generation task shares: samples, the task interface, data-file reading, agreement with Full.

A task turns its data into ``Sample`` objects (a chat message list and the same prompt as
plain text), scores one response with the task's established checker, and aggregates the
per-sample score fields into its metrics. Generation, batching and bookkeeping live in
``siftattention.eval.generation_eval``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

from ...data import DataNotFoundError


class TaskDataError(ValueError):
    """A data file that exists but cannot be read as the task's data (one-line message)."""


@dataclass(frozen=True)
class Sample:
    """One prompt of a task.

    ``messages`` is the chat form (system/user turns) given to the chat template;
    ``plain`` is the prompt as plain text for models without a chat template (``--no-chat``);
    ``target`` holds what the scorer needs (gold answers, instruction ids), never the prompt;
    ``reply_prefix`` opens the assistant's turn after the chat template (``plain`` already ends with it).
    """

    id: str
    messages: tuple[dict[str, str], ...]
    plain: str
    target: dict[str, Any] = field(default_factory=dict)
    reply_prefix: str = ""


@dataclass(frozen=True)
class TaskData:
    samples: list[Sample]
    source: str  # where the data came from: package data, a file, the hub
    sha256: str  # of the prompts as built (changes when the data or the prompt format changes)


def prompts_digest(samples: Sequence[Sample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        fields = [s.id, list(s.messages), s.plain] + ([s.reply_prefix] if s.reply_prefix else [])
        h.update(json.dumps(fields, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


class Task:
    """The interface of a generation task (one subclass per file in this package)."""

    name: ClassVar[str] = "task"
    description: ClassVar[str] = ""
    #: the generation cap the task's reference setup uses
    default_max_new_tokens: ClassVar[int] = 512
    #: text after any of these is cut before scoring (the reference harness's stop sequences)
    stop: ClassVar[tuple[str, ...]] = ()
    #: the metric a plot or a short table shows first
    headline: ClassVar[str] = ""
    #: task options (``--task-option key=value``) and their defaults
    options: ClassVar[dict[str, Any]] = {}
    #: options that change only the scoring, not the decoded text (kept out of the run key)
    scoring_options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - set(self.options)
        if unknown:
            allowed = ", ".join(self.options) or "none"
            raise ValueError(f"task {self.name}: unknown option {sorted(unknown)[0]!r}; allowed: {allowed}")
        self.settings = {**self.options, **options}

    def load(self, data_path: Path | None = None) -> TaskData:
        raise NotImplementedError

    def score(self, sample: Sample, response: str) -> dict[str, Any]:
        """Score fields of one response (booleans, numbers or lists of booleans)."""
        raise NotImplementedError

    def stale(self, scores: dict[str, Any]) -> bool:
        """Whether a stored score needs scoring again (a scoring option added since)."""
        return False

    def aggregate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        """Metrics over the score fields of several responses (NaN when there are none)."""
        raise NotImplementedError

    def for_model(self, model_name: str, chat: bool) -> None:
        """Settings that depend on the model, called before ``load`` (prompts measured in its tokens); most tasks need none."""

    def probe(self, model: Any, sample: Sample, prompt: list[int], method: Any) -> dict[str, Any]:
        """Score fields measured on the model itself (a costly check behind a task option); none by default."""
        return {}

    def info(self) -> dict[str, Any]:
        """How this task scores (checker package and version, fallbacks in use): recorded in results."""
        return {}

    def cut_at_stop(self, text: str) -> str:
        cut = len(text)
        for s in self.stop:
            pos = text.find(s)
            if pos >= 0:
                cut = min(cut, pos)
        return text[:cut]


# -- data files ------------------------------------------------------------------------------
def _check_file(path: Path) -> None:
    if path.is_dir():
        raise DataNotFoundError(f"{path} is a directory, not a data file")
    if not path.is_file():
        raise DataNotFoundError(f"data file not found: {path}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a missing file or a bad line is a one-line error."""
    path = Path(path)
    _check_file(path)
    records = []
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise TaskDataError(f"cannot read {path}: line {number} is not JSON") from None
                if not isinstance(record, dict):
                    raise TaskDataError(f"cannot read {path}: line {number} is not a JSON object")
                records.append(record)
    except (OSError, UnicodeDecodeError) as err:
        raise TaskDataError(f"cannot read {path}: {type(err).__name__}: {err}") from None
    if not records:
        raise TaskDataError(f"cannot read {path}: no records")
    return records


def read_json(path: Path) -> Any:
    path = Path(path)
    _check_file(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TaskDataError(f"cannot read {path}: {type(err).__name__}: {str(err).splitlines()[0]}") from None


def hub_records(path: str, split: str) -> list[dict[str, Any]] | None:
    """A hub dataset split as records, or None when ``datasets`` or the hub is unavailable."""
    import importlib.util
    import os

    if os.environ.get("HF_HUB_OFFLINE") == "1" or importlib.util.find_spec("datasets") is None:
        return None
    try:
        import datasets

        return [dict(r) for r in datasets.load_dataset(path, split=split)]
    except Exception:  # unreachable hub, unknown split: the caller reports that no source was found
        return None


def load_records(data_path: Path | None, find_local: Callable[[], Path | None], local_label: str, hub: tuple[str, str],
                 missing: str) -> tuple[list[dict[str, Any]], str]:
    """Records and their source: ``data_path`` if given, else the JSONL ``find_local()`` finds, else the hub split.

    Raises DataNotFoundError with ``missing`` when none of them is there.
    """
    if data_path is not None:
        return read_jsonl(data_path), f"file:{data_path}"
    local = find_local()
    if local is not None:
        return read_jsonl(local), f"{local_label}:{local}"
    records = hub_records(*hub)
    if records is None:
        raise DataNotFoundError(missing)
    return records, f"hub:{hub[0]}/{hub[1]}"


def require_fields(records: Sequence[dict], fields: Sequence[str], path: Path | str) -> None:
    for i, record in enumerate(records):
        missing = [f for f in fields if f not in record]
        if missing:
            raise TaskDataError(f"cannot read {path}: record {i} has no field {missing[0]!r}")


def mean(values: Sequence[float]) -> float:
    values = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


# -- agreement with Full -----------------------------------------------------------------------
def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence (bit-parallel, Crochemore et al. 2001).

    ROUGE-L's dynamic programme is O(len(a) * len(b)) in Python, minutes for two 4096-token
    generations; with one Python integer as a bit vector over ``b`` it is len(a) big-int steps.
    """
    if not a or not b:
        return 0
    masks: dict[int, int] = {}
    for i, token in enumerate(b):
        masks[token] = masks.get(token, 0) | (1 << i)
    full = (1 << len(b)) - 1
    v = full
    for token in a:
        u = v & masks.get(token, 0)
        v = ((v + u) | (v - u)) & full
    return len(b) - bin(v).count("1")


def rouge_l(reference: Sequence[int], candidate: Sequence[int]) -> float:
    """ROUGE-L F1 of two token sequences (rouge_score's definition; 1.0 when both are empty)."""
    if not reference and not candidate:
        return 1.0
    lcs = lcs_length(reference, candidate)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def agreement(full_tokens: Sequence[int], tokens: Sequence[int]) -> dict[str, float]:
    """How far a method's generation stays with Full's on the same prompt."""
    prefix = common_prefix(full_tokens, tokens)
    return {
        "lcp_tokens": prefix,
        "lcp_fraction": prefix / len(full_tokens) if full_tokens else 1.0,
        "rouge_l": rouge_l(full_tokens, tokens),
        "identical": list(full_tokens) == list(tokens),
    }
