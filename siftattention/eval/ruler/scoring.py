"""RULER's scoring (``scripts/eval/evaluate.py`` and ``scripts/eval/synthetic/constants.py``), rewritten."""

from __future__ import annotations

import re
from typing import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: stripped, control characters turned into newlines."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def matched(prediction: str, answers: Sequence[str]) -> list[bool]:
    """For each gold answer, whether it occurs in the prediction, ignoring case."""
    text = postprocess(prediction).lower()
    return [a.lower() in text for a in answers]


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's per-sample ``string_match_all``: the share of the gold answers found in the prediction (0..1)."""
    found = matched(prediction, answers)
    return sum(found) / len(found)
