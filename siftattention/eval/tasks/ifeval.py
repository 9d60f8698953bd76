"""IFEval (Zhou et al. 2023): verifiable instructions, scored by lm-eval's copy of the official checker.

Prompts: the package data ``siftattention/resources/ifeval/input_data.jsonl`` (541 prompts,
Apache-2.0), else ``$SIFT_DATA_DIR/ifeval/input_data.jsonl``, else the
hub's ``google/IFEval``; ``--data-file`` overrides all. The prompt goes to the chat template as
one user turn, as lm-eval's ``ifeval`` task does.

Scoring: ``lm_eval.tasks.ifeval.utils.process_results`` (prompt- and instruction-level
accuracy, strict and loose). Two of its instructions need NLTK's ``punkt_tab`` data
(sentence counts, and the word tokenizer of the capital-word count), which NLTK downloads
at import time. Offline, when ``punkt_tab`` is not installed, the checker module's own
regex sentence splitter (``instructions_util.split_into_sentences``, from the official
IFEval code) stands in for punkt, the download is not attempted, and ``info()`` records
which splitter scored the run. ``langdetect`` is seeded so language checks repeat.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import random
import types
from pathlib import Path
from typing import Any, Sequence

from ...data import find_data_file, resource_file
from .base import Sample, Task, TaskData, TaskDataError, load_records, mean, prompts_digest, require_fields

FALLBACK_SPLITTER = "instructions_util.split_into_sentences (regex; NLTK punkt_tab not installed)"
PUNKT_SPLITTER = "nltk punkt_tab"


def _punkt_available() -> bool:
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return True
    except LookupError:
        return False


@contextlib.contextmanager
def _no_nltk_download():
    """lm-eval's checker calls nltk.download('punkt_tab') on import; offline that only prints errors."""
    import nltk

    original = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints "Downloaded punkt_tab" regardless
            yield
    finally:
        nltk.download = original


class _FallbackSentenceTokenizer:
    def __init__(self, split) -> None:
        self._split = split

    def tokenize(self, text: str) -> list[str]:
        return self._split(text)


@functools.lru_cache(maxsize=1)
def checker() -> tuple[types.ModuleType, str]:
    """lm-eval's IFEval ``utils`` module, made to work offline; and the sentence splitter in use."""
    try:
        import langdetect
        import nltk
    except ImportError as err:
        raise ImportError(f"IFEval scoring needs lm-eval's ifeval extra: pip install 'siftattention[eval]' ({err})") from None
    langdetect.DetectorFactory.seed = 0
    # The checker logs a warning for every response whose language cannot be detected (empty ones): not news.
    logging.getLogger("lm_eval.tasks.ifeval.instructions").setLevel(logging.ERROR)
    punkt = _punkt_available()
    try:
        if punkt:
            from lm_eval.tasks.ifeval import instructions_util, utils
        else:
            with _no_nltk_download():
                from lm_eval.tasks.ifeval import instructions_util, utils
    except ImportError as err:
        raise ImportError(f"IFEval scoring needs lm-eval with its ifeval extra: pip install 'siftattention[eval]' ({err})") from None
    if punkt:
        return utils, PUNKT_SPLITTER
    split = instructions_util.split_into_sentences
    # count_sentences() looks the sentence tokenizer up through this module-level function.
    instructions_util._get_sentence_tokenizer = lambda: _FallbackSentenceTokenizer(split)
    # nltk.word_tokenize = punkt sentences + the Treebank word tokenizer; keep the latter.
    words = nltk.tokenize.NLTKWordTokenizer()
    proxy = types.SimpleNamespace(**{name: getattr(nltk, name) for name in ("tokenize", "data")})
    proxy.word_tokenize = lambda text, *a, **k: [w for s in split(text) for w in words.tokenize(s)]
    instructions_util.nltk = proxy
    return utils, FALLBACK_SPLITTER


class IFEval(Task):
    name = "ifeval"
    description = "IFEval: 541 prompts with verifiable instructions (prompt/instruction-level accuracy, strict/loose)"
    default_max_new_tokens = 1280  # lm-eval's ifeval generation cap
    headline = "prompt_level_strict_acc"

    def load(self, data_path: Path | None = None) -> TaskData:
        records, source = load_records(
            data_path, lambda: resource_file("ifeval/input_data.jsonl") or find_data_file("ifeval/input_data.jsonl"), "file",
            ("google/IFEval", "train"),
            "IFEval prompts not found: pass --data-file input_data.jsonl, set SIFT_DATA_DIR, "
            "or install `datasets` with a reachable hub (google/IFEval)",
        )
        require_fields(records, ("key", "prompt", "instruction_id_list", "kwargs"), source)
        samples = []
        for r in records:
            if len(r["instruction_id_list"]) != len(r["kwargs"]):
                raise TaskDataError(f"cannot read {source}: prompt {r['key']} has {len(r['instruction_id_list'])} instructions but {len(r['kwargs'])} kwargs")
            samples.append(
                Sample(
                    id=str(r["key"]),
                    messages=({"role": "user", "content": r["prompt"]},),
                    plain=r["prompt"],
                    target={"key": r["key"], "instruction_id_list": list(r["instruction_id_list"]), "kwargs": list(r["kwargs"])},
                )
            )
        return TaskData(samples, source, prompts_digest(samples))

    def score(self, sample: Sample, response: str) -> dict[str, Any]:
        utils, _ = checker()
        doc = {**sample.target, "prompt": sample.plain}
        # Some instructions draw a random letter where the prompt's is not one (letter_frequency
        # with "#" or "!"): seed it per call, so a verdict repeats and every method faces the same draw.
        saved = random.getstate()
        random.seed(0)
        try:
            result = utils.process_results(doc, [response])
        finally:
            random.setstate(saved)
        return {
            "prompt_level_strict_acc": bool(result["prompt_level_strict_acc"]),
            "inst_level_strict_acc": [bool(x) for x in result["inst_level_strict_acc"]],
            "prompt_level_loose_acc": bool(result["prompt_level_loose_acc"]),
            "inst_level_loose_acc": [bool(x) for x in result["inst_level_loose_acc"]],
        }

    def aggregate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        def flat(key: str) -> list[bool]:
            return [x for r in rows for x in r[key]]

        return {
            "prompt_level_strict_acc": mean([r["prompt_level_strict_acc"] for r in rows]),
            "inst_level_strict_acc": mean(flat("inst_level_strict_acc")),
            "prompt_level_loose_acc": mean([r["prompt_level_loose_acc"] for r in rows]),
            "inst_level_loose_acc": mean(flat("inst_level_loose_acc")),
        }

    def info(self) -> dict[str, Any]:
        from importlib.metadata import version

        try:
            _, splitter = checker()
        except ImportError:
            return {"checker": "lm-eval not installed: not scored"}
        return {"checker": f"lm_eval {version('lm_eval')} tasks/ifeval (official IFEval code)", "sentence_splitter": splitter,
                "langdetect_seed": 0, "random_seed": 0}
