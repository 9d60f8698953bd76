"""What every ``sift`` command shares: its ``--out`` type, the errors a user can cause, warnings in one line."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator

import click
from rich.console import Console


#: The weights' precisions ``--dtype`` takes.
DTYPES = ("float32", "bfloat16", "float16")


class OutDir(click.Path):
    """``--out``: a directory path; an empty one is refused (it would mean the current directory)."""

    def __init__(self) -> None:
        super().__init__(file_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("the path is empty; give a directory (an empty path would write into the current directory)", param, ctx)
        return super().convert(value, param, ctx)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a user's input or machine causes: one line ``sift: error: ...`` and exit status 2, no traceback.

    ValueError covers SpecError, OutputDirError, DataFormatError, AnalysisError, RunMismatchError,
    TaskDataError and the input checks; FileNotFoundError covers DataNotFoundError.
    """
    from .hf import AlreadyAppliedError, UnsupportedModelError
    from .methods import CalibrationError
    from .models import ModelNotFoundError
    from .output import OutputWriteError

    return (ValueError, FileNotFoundError, ModelNotFoundError, UnsupportedModelError, AlreadyAppliedError, CalibrationError,
            OutputWriteError)


@contextlib.contextmanager
def one_line_warnings(console: Console) -> Iterator[None]:
    """Show each warning as one line ``sift: warning: ...`` on ``console`` (Python's form takes two, with a path)."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        console.print(f"sift: warning: {' '.join(str(message).split())}", highlight=False, markup=False, soft_wrap=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
