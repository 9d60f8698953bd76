"""Inputs that used to give silently wrong results, table-driven: each row is refused, warns, or
gives the result an independent reference gives.

A ``Refused`` row must raise the expected exception type with a one-line message containing
the expected text. A ``Warned`` row must emit the expected warning category with the expected
text. A ``Checked`` row runs and compares its result with a reference itself (float64 torch,
transformers' own outputs, a single-sequence replay, closed forms), returning a short
description of what it checked for the table.

``python tests/test_bad_input_semantics.py`` prints the table with each outcome (docs/bad-input.md).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_llama  # noqa: E402

import siftattention  # noqa: E402
from siftattention import H2O, Full, Oracle, Sift, SkipSoftmax, TopK, TopTheta  # noqa: E402


# -- the row kinds --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    """``call()`` must raise ``error`` with ``message`` in its one-line text."""

    label: str
    call: Callable[[], Any]
    error: type[BaseException]
    message: str


@dataclass(frozen=True)
class Warned:
    """``call()`` must emit a ``category`` warning with ``message`` in its text."""

    label: str
    call: Callable[[], Any]
    category: type[Warning]
    message: str


@dataclass(frozen=True)
class Checked:
    """``call()`` runs, asserts its result against a reference, and says what it checked."""

    label: str
    call: Callable[[], str]


Row = Refused | Warned | Checked


# -- numeric parameters: real scalars accepted, everything else refused in one line ------------------


def same_method(built: Any, reference: Any) -> Callable[[], str]:
    """A method built from numpy or torch scalars equals the one built from Python numbers, field
    for field (and in its spec), with Python numbers stored."""

    def check() -> str:
        method, want = built(), reference
        assert method == want and method.spec() == want.spec(), (method, want)
        from dataclasses import fields

        for f in fields(want):
            assert type(getattr(method, f.name)) is type(getattr(want, f.name)), f.name
        return f"accepted: {method.spec()}"

    return check


SCALAR_ROWS: list[Row] = [
    Checked("Sift(tau=np.float16(0.875))", same_method(lambda: Sift(tau=np.float16(0.875)), Sift(tau=0.875))),
    Checked("Sift(tau=np.float32(0.875))", same_method(lambda: Sift(tau=np.float32(0.875)), Sift(tau=0.875))),
    Checked("Sift(tau=np.float64(0.3))", same_method(lambda: Sift(tau=np.float64(0.3)), Sift(tau=0.3))),
    Checked("Sift(tau=torch.tensor(0.875))", same_method(lambda: Sift(tau=torch.tensor(0.875)), Sift(tau=0.875))),
    Checked("Sift(tau=torch.tensor(0.5, dtype=torch.bfloat16))",
            same_method(lambda: Sift(tau=torch.tensor(0.5, dtype=torch.bfloat16)), Sift(tau=0.5))),
    Checked("Sift(tau=np.array(0.75), warmup=np.int64(16))",
            same_method(lambda: Sift(tau=np.array(0.75), warmup=np.int64(16)), Sift(tau=0.75, warmup=16))),
    Checked("Sift(warmup=torch.tensor(8), anchor_last=np.uint16(32), renormalize=np.bool_(True))",
            same_method(lambda: Sift(warmup=torch.tensor(8), anchor_last=np.uint16(32), renormalize=np.bool_(True)),
                        Sift(warmup=8, anchor_last=32, renormalize=True))),
    Checked("TopK(k=np.float32(0.25), renormalize=torch.tensor(False))",
            same_method(lambda: TopK(k=np.float32(0.25), renormalize=torch.tensor(False)), TopK(k=0.25, renormalize=False))),
    Checked("H2O(k=torch.tensor(0.5, dtype=torch.float64), heavy_ratio=np.int8(1))",
            same_method(lambda: H2O(k=torch.tensor(0.5, dtype=torch.float64), heavy_ratio=np.int8(1)), H2O(k=0.5, heavy_ratio=1))),
    Checked("Oracle(tau=np.float64(0.9))", same_method(lambda: Oracle(tau=np.float64(0.9)), Oracle(tau=0.9))),
    Checked("SkipSoftmax(scale=np.int32(8), block=torch.tensor(64))",
            same_method(lambda: SkipSoftmax(scale=np.int32(8), block=torch.tensor(64)), SkipSoftmax(scale=8.0, block=64))),
    Checked("TopTheta(k=np.int64(8), sigma=torch.tensor(0.25))",
            same_method(lambda: TopTheta(k=np.int64(8), sigma=torch.tensor(0.25)), TopTheta(k=8, sigma=0.25))),
    Refused("Sift(tau=True)", lambda: Sift(tau=True), ValueError, "tau must be a number in (0, 1), got True"),
    Refused("Sift(tau=np.bool_(True))", lambda: Sift(tau=np.bool_(True)), ValueError, "tau must be a number in (0, 1)"),
    Refused("Sift(tau=torch.tensor(True))", lambda: Sift(tau=torch.tensor(True)), ValueError, "tau must be a number in (0, 1)"),
    Refused('Sift(tau="0.875")', lambda: Sift(tau="0.875"), ValueError, "tau must be a number in (0, 1), got '0.875'"),
    Refused("Sift(tau=float('nan'))", lambda: Sift(tau=float("nan")), ValueError, "tau must be in (0, 1), got nan"),
    Refused("Sift(tau=np.float32('nan'))", lambda: Sift(tau=np.float32("nan")), ValueError, "tau must be in (0, 1), got nan"),
    Refused("Sift(tau=torch.tensor([0.5, 0.9]))", lambda: Sift(tau=torch.tensor([0.5, 0.9])), ValueError,
            "tau must be a number in (0, 1), got a Tensor of shape (2,)"),
    Refused("Sift(tau=torch.tensor([0.5]))", lambda: Sift(tau=torch.tensor([0.5])), ValueError, "got a Tensor of shape (1,)"),
    Refused("Sift(tau=torch.full((64, 64), 0.5))", lambda: Sift(tau=torch.full((64, 64), 0.5)), ValueError,
            "got a Tensor of shape (64, 64)"),
    Refused("Oracle(tau=0.5 + 0j)", lambda: Oracle(tau=0.5 + 0j), ValueError, "tau must be a number in (0, 1), got (0.5+0j)"),
    Refused("Sift(warmup=16.0)", lambda: Sift(warmup=16.0), ValueError, "warmup must be an integer >= 2, got 16.0"),
    Refused("Sift(warmup=torch.tensor(16.0))", lambda: Sift(warmup=torch.tensor(16.0)), ValueError,
            "warmup must be an integer >= 2, got 16.0"),
    Refused("Sift(warmup=np.int64(1))", lambda: Sift(warmup=np.int64(1)), ValueError, "warmup must be an integer >= 2, got 1"),
    Refused('Sift(renormalize="false")', lambda: Sift(renormalize="false"), ValueError,
            "renormalize must be True or False, got 'false'"),
    Refused("TopK(k=np.float64(1.5))", lambda: TopK(k=np.float64(1.5)), ValueError, "k must be in (0, 1], got 1.5"),
    Refused("TopK(renormalize=1)", lambda: TopK(renormalize=1), ValueError, "renormalize must be True or False, got 1"),
    Refused("H2O(heavy_ratio=torch.tensor([0.5, 0.5]))", lambda: H2O(heavy_ratio=torch.tensor([0.5, 0.5])), ValueError,
            "heavy_ratio must be a number in [0, 1], got a Tensor of shape (2,)"),
    Refused("SkipSoftmax(scale=float('inf'))", lambda: SkipSoftmax(scale=float("inf")), ValueError,
            "scale must be a positive finite number, got inf"),
    Refused("SkipSoftmax(scale=torch.tensor(float('nan')))", lambda: SkipSoftmax(scale=torch.tensor(float("nan"))), ValueError,
            "scale must be a positive finite number, got nan"),
    Refused("SkipSoftmax(per_head='yes')", lambda: SkipSoftmax(per_head="yes"), ValueError, "per_head must be True or False"),
    Refused("TopTheta(sigma=float('-inf'))", lambda: TopTheta(sigma=float("-inf")), ValueError,
            "sigma must be a finite number, got -inf"),
    Refused("TopTheta(k=torch.tensor(8.0))", lambda: TopTheta(k=torch.tensor(8.0)), ValueError, "k must be an integer >= 1, got 8.0"),
]


# -- the table ------------------------------------------------------------------------------------------------

ROWS: list[Row] = [*SCALAR_ROWS]


def run_row(row: Row) -> str:
    """Run one row and assert its outcome; the outcome as the table shows it."""
    if isinstance(row, Refused):
        with pytest.raises(row.error) as info:
            row.call()
        message = str(info.value)
        assert "\n" not in message, message
        assert row.message in message, message
        return f"{type(info.value).__name__}: {message}"
    if isinstance(row, Warned):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row.call()
        hits = [w for w in caught if issubclass(w.category, row.category) and row.message in str(w.message)]
        assert hits, [str(w.message) for w in caught]
        assert "\n" not in str(hits[0].message)
        return f"{row.category.__name__}: {hits[0].message}"
    return row.call()


@pytest.mark.parametrize("row", ROWS, ids=[row.label for row in ROWS])
def test_row(row: Row) -> None:
    run_row(row)


def test_the_table_is_large_enough() -> None:
    assert len(ROWS) >= 30 and len({row.label for row in ROWS}) == len(ROWS)


# -- the table for the docs ------------------------------------------------------------------------------


def markdown_table() -> str:
    """Every row with its outcome, as docs/bad-input.md shows it."""
    lines = ["| input | outcome |", "|---|---|"]
    for row in ROWS:
        try:
            outcome = run_row(row)
        except BaseException as err:  # noqa: BLE001 - the table shows whatever happens
            outcome = f"FAILED ({type(err).__name__}: {err})"
        lines.append(f"| `{row.label}` | {outcome.replace('|', '/')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
