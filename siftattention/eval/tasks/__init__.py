"""Generation tasks, one file each: IFEval, MATH-Hard, LongGenBench (GSM8K variant and Wu et al.), RULER."""

from __future__ import annotations

from typing import Any

from .base import Sample, Task, TaskData, TaskDataError, agreement, common_prefix, lcs_length, rouge_l
from .ifeval import IFEval
from .longgen import LongGenGSM8K
from .longgen_wu import LongGenWu
from .math_hard import MathHard
from .ruler import RULER_TASKS

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (IFEval, MathHard, LongGenGSM8K, LongGenWu, *RULER_TASKS)}


def parse_options(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``key=value`` task options; integers stay integers."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"task option {pair!r} is not key=value")
        value = value.strip()
        options[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return options


def get_task(name: str, **options: Any) -> Task:
    """A task by name; unknown names and options are one-line ValueErrors."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name](**options)


__all__ = ["TASKS", "Sample", "Task", "TaskData", "TaskDataError", "agreement", "common_prefix", "get_task", "lcs_length",
           "parse_options", "rouge_l"]
