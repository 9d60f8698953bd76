"""Progress a person can follow: rich's live bars on a terminal, plain periodic lines elsewhere.

Rich draws nothing on a pipe or into a file until the end (and then a line of bars), so
a run whose output goes to a log (``make demo | tee log``) would say nothing for minutes.
Off a terminal, ``progress`` prints a line when a task starts, at most every
``INTERVAL_S`` seconds while it runs, and when it finishes; ``status`` prints its line once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, ContextManager, Sequence

from rich.console import Console

#: Seconds between two progress lines off a terminal.
INTERVAL_S = 10.0


def progress(console: Console, *, transient: bool = False, eta: bool = True) -> Any:
    """A ``rich.progress.Progress`` on a terminal, else a ``PlainProgress`` (the same calls)."""
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        if eta:
            columns += [TextColumn("ETA"), TimeRemainingColumn()]
        return Progress(*columns, console=console, transient=transient)
    return PlainProgress(console)


def status(console: Console, text: str) -> ContextManager[Any]:
    """A spinner with ``text`` on a terminal; elsewhere ``text`` printed once."""
    if console.is_terminal:
        return console.status(text)
    console.print(text, highlight=False, markup=False, soft_wrap=True)
    return contextlib.nullcontext()


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float = 0
    start: float = field(default_factory=time.monotonic)
    finished: bool = False


class PlainProgress:
    """The subset of ``rich.progress.Progress`` the commands use, as plain lines."""

    def __init__(self, console: Console, interval: float | None = None) -> None:
        self.console = console
        self.interval = INTERVAL_S if interval is None else interval
        self.tasks: dict[int, _Task] = {}
        self._last = time.monotonic()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **_: Any) -> int:
        task_id = len(self.tasks)
        self.tasks[task_id] = _Task(description, total, completed)
        self._print(self.tasks[task_id])
        return task_id

    def update(self, task_id: int, *, total: float | None = None, completed: float | None = None, advance: float | None = None,
               description: str | None = None, **_: Any) -> None:
        task = self.tasks[task_id]
        if description is not None:
            task.description = description
        if total is not None:
            task.total = total
        if completed is not None:
            if completed < task.completed:  # a task counted again from the start (the next window's layers)
                task.finished = False
            task.completed = completed
        if advance is not None:
            task.completed += advance
        done = task.total is not None and task.completed >= task.total
        if (done and not task.finished) or time.monotonic() - self._last >= self.interval:
            task.finished = done
            self._print(task)

    def _print(self, task: _Task) -> None:
        self._last = time.monotonic()
        seconds = int(self._last - task.start)
        count = f"{task.completed:g}" + ("" if task.total is None else f"/{task.total:g}")
        self.console.print(f"{task.description}: {count} ({seconds // 60}:{seconds % 60:02d} elapsed)",
                           highlight=False, markup=False, soft_wrap=True)


def prepare_methods(console: Console, model: Any, methods: Sequence[tuple[str, Any]]) -> None:
    """Each ``(spec, method)``'s once-per-model work before ``apply`` (Top-theta's calibration), with a bar per method that has some."""
    with progress(console, transient=True) as bars:
        for spec, method in methods:
            task = None

            def on_progress(done: int, total: int, spec: str = spec) -> None:
                nonlocal task
                if task is None:
                    task = bars.add_task(f"calibrating [{spec}]", total=total)
                bars.update(task, completed=done)

            method.prepare(model, on_progress)
