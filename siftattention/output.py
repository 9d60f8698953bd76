"""A command's output directory: checked and claimed before the work, written after it.

Every command that writes into ``--out`` goes through this module:

- ``claim_out_dir(out)`` checks, before any long work, that ``out`` can be created and
  written, and holds a lock on it for the whole run (``.sift.lock``, released and
  removed at the end), so a second run into the same directory stops at once in one
  line instead of overwriting the first one's results later;
- ``save_run(out, data, figures)`` writes the results: first the data files (JSON,
  arrays), each to a temporary file, then renamed into place together, so a full disk
  leaves the earlier run's files as they were; then the figures, after removing the
  earlier run's, so no figure ever sits beside results it does not show. A failure is
  an ``OutputWriteError`` naming the path and what was saved;
- every file is written through ``write_bytes``: a temporary file, fsync, rename, with
  the mode the user's umask gives (``tempfile`` would make it 0600).

JSON is strict: NaN and infinities are written as ``null``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import secrets
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

try:
    import fcntl
except ImportError:  # Windows: runs into one directory are not locked there
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".sift.lock"


class OutputDirError(ValueError):
    """An output directory that cannot be created, written into or claimed; the message is one line."""


class OutputWriteError(OSError):
    """Writing a result file failed (a full disk); the message is one line naming the path (and what was saved)."""

    def __init__(self, message: str, path: str | Path | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.path, self.reason = path, reason


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def _cannot_write(path: str | Path, err: OSError) -> OutputWriteError:
    return OutputWriteError(f"could not write {path} ({_reason(err)})", path, _reason(err))


# -- checking and claiming -------------------------------------------------------------------------


def check_out_dir(out: str | Path, option: str = "--out") -> Path:
    """Make sure ``out`` is a directory this process can write into, before any long work.

    Creates it (and missing parents) and writes and deletes a probe file; files already
    there are left untouched. Raises OutputDirError naming the path and the reason.
    """
    if isinstance(out, str) and not out.strip():
        # Path("") is the current directory: a run would scatter its files there.
        raise OutputDirError(f"{option} is empty; give a directory")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{option} {out} is a file, not a directory")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OutputDirError(f"{option} {out} cannot be created: {blocker} is a file")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        inside = next((p for p in out.parents if p.is_dir()), None)
        raise OutputDirError(f"{option} {out} cannot be created in {inside} ({_reason(err)})") from None
    probe = out / f".sift-write-check-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as err:
        raise OutputDirError(f"{option} {out} is not writable ({_reason(err)})") from None
    return out


# Directories this process holds, with how many claims: a command that runs another one
# (demo runs ppl, sweep runs eval) claims the same directory again.
_held: dict[Path, list[int]] = {}


@contextlib.contextmanager
def claim_out_dir(out: str | Path, option: str = "--out", *, lock: bool | None = None) -> Iterator[Path]:
    """``check_out_dir(out)``, then hold ``out`` for this run until the block ends.

    A directory another process holds raises OutputDirError at once ("in use by another
    sift run"). ``lock=None`` locks on the process that writes (rank 0 under torchrun).
    """
    out = check_out_dir(out, option)
    if lock is None:
        from .parallel import is_main_rank

        lock = is_main_rank()
    if not lock or fcntl is None:
        yield out
        return
    key = out.resolve()
    if key in _held:
        _held[key][1] += 1
    else:
        _held[key] = [_lock(key / LOCK_NAME, out, option), 1]
    try:
        yield out
    finally:
        _held[key][1] -= 1
        if _held[key][1] == 0:
            fd = _held.pop(key)[0]
            with contextlib.suppress(OSError):
                (key / LOCK_NAME).unlink()  # while still locked: a run waiting on this file sees it go
            os.close(fd)


def _lock(path: Path, out: Path, option: str) -> int:
    """An fd holding an exclusive flock on ``path``, with this process named in the file."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise OutputDirError(f"{option} {out} cannot be locked ({_reason(err)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "a process that has not said which"
            os.close(fd)
            raise OutputDirError(f"{option} {out} is in use by another sift run ({holder}); "
                                 f"wait for it to finish or give another {option}") from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # the holder removed the file between our open and our lock: take the new one
    with contextlib.suppress(OSError):  # who holds it is a courtesy to the next run: a full disk may refuse it
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    return fd


# -- writing ------------------------------------------------------------------------------------------

# The files written since ``save_run`` began (so a failure can say what was saved).
_written: ContextVar[list[Path] | None] = ContextVar("_written", default=None)


def _stage(path: Path, data: bytes) -> Path:
    """``data`` in a new temporary file beside ``path``, on disk; the file is removed if that fails."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
            break
        except FileExistsError:
            continue
        except OSError as err:
            raise _cannot_write(path, err) from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)  # a full disk can show only here (delayed allocation)
        finally:
            os.close(fd)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _cannot_write(path, err) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: an interrupted or failed write leaves an earlier file as it was."""
    path = Path(path)
    tmp = _stage(path, data)
    try:
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _cannot_write(path, err) from None
    written = _written.get()
    if written is not None:
        written.append(path)
    return path


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None, so the JSON is strict (JavaScript's JSON.parse reads it)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_bytes(payload: Any) -> bytes:
    """Indented strict JSON (NaN and infinities as null), with a final newline; other objects as ``str``."""
    return (json.dumps(_finite(payload), indent=2, allow_nan=False, default=str) + "\n").encode()


def json_line(payload: Any) -> str:
    """One line of strict JSON (NaN and infinities as null), for JSONL files."""
    return json.dumps(_finite(payload), ensure_ascii=False, allow_nan=False)


def write_json(path: str | Path, payload: Any) -> Path:
    return write_bytes(path, json_bytes(payload))


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode())


def figure_bytes(fig: Any, **kwargs: Any) -> bytes:
    """A matplotlib figure rendered as PNG in memory (it reaches the disk through ``write_bytes``)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **kwargs)
    return buffer.getvalue()


def save_figure(fig: Any, path: str | Path, **kwargs: Any) -> Path:
    """``fig`` as a PNG at ``path``, written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    try:
        data = figure_bytes(fig, **kwargs)
    except OSError as err:
        raise _cannot_write(path, err) from None
    finally:
        plt.close(fig)
    return write_bytes(path, data)


def save_run(out: Path, data: Mapping[str, bytes], figures: Callable[[], Any] | None = None,
             stale: Sequence[str] = ()) -> list[Path]:
    """Write one run's files into ``out``; returns the paths written.

    ``data``: file name -> content, written together (all or none). ``stale``: names of
    files an earlier run may have left (figures, reports) that this run's ``figures()``
    replaces or no longer draws; they go once the data is in place. ``figures()`` draws
    and writes the rest through ``write_bytes``/``save_figure``. Raises OutputWriteError,
    naming the path and what was saved, where the disk refuses a write.
    """
    out = Path(out)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, content in data.items():
            staged.append((_stage(out / name, content), out / name))
    except OutputWriteError as err:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise OutputWriteError(f"{err}; nothing was saved, {out} holds what it held before this run", err.path, err.reason) from None
    saved: list[Path] = []
    for tmp, path in staged:
        os.replace(tmp, path)  # renames need no room: none fails where the writes went through
        saved.append(path)
    for name in stale:
        (out / name).unlink(missing_ok=True)
    if figures is None:
        return saved
    written: list[Path] = []
    token = _written.set(written)
    try:
        figures()
    except OSError as err:
        message = str(err) if isinstance(err, OutputWriteError) else f"could not write a figure ({_reason(err)})"
        shown = ", ".join(str(p) for p in saved + written)
        raise OutputWriteError(f"{message}; saved: {shown}; the other figures were not written (run again to draw them)",
                               getattr(err, "path", None), getattr(err, "reason", _reason(err))) from None
    finally:
        _written.reset(token)
    return saved + written
