"""What every ``sift`` command shares: its ``--out`` type, the errors a user can cause, warnings in one line."""

from __future__ import annotations

import contextlib
import sys
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


def resolve_device(device: str) -> str:
    """A --device option's value: auto (CUDA where there is one), cpu, cuda or cuda:N; one-line errors."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available")
    return device


@contextlib.contextmanager
def one_line_warnings(console: Console) -> Iterator[None]:
    """Show each warning as one line ``sift: warning: ...`` on ``console`` (Python's form takes two, with a path)."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        console.print(f"sift: warning: {' '.join(str(message).split())}", highlight=False, markup=False, soft_wrap=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _error_line(console: Console, message: str) -> None:
    line = " ".join(message.split()) or "unknown error"
    console.print(f"sift: error: {line}", highlight=False, markup=False, soft_wrap=True)


def run_command(command: click.Command, argv: list[str] | None, prog_name: str, err_console: Console) -> None:
    """Run a click command as ``sift`` does: a user error is one line on stderr and exit status 2; a warning is one line too."""
    try:
        with one_line_warnings(err_console):
            command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as err:  # plain `sift`: the help, not an error
        click.echo(err.ctx.get_help())
        sys.exit(0)
    except click.ClickException as err:
        context = getattr(err, "ctx", None)
        hint = f" (see '{context.command_path} --help')" if isinstance(err, click.UsageError) and context else ""
        _error_line(err_console, err.format_message() + hint)
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        err_console.print("sift: aborted")
        sys.exit(130)
    except user_errors() as err:
        _error_line(err_console, str(err) or type(err).__name__)
        sys.exit(2)
