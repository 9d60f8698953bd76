"""LongGenBench, Wu et al. 2024 ("Spinning the Golden Thread", arXiv 2409.02076), short set: completion rate.

Each of the 400 prompts (Week, Floor, Menu Week, Block x 100) asks for ``number`` blocks
(weekly diary entries, skyscraper floors, ...) separated by ``#*#`` and starting with
``#*# {type} {n}``; the prompt ends with the first block's header. The file
``Dataset_short.json`` carries no licence, so it is not shipped: it is read from
``--data-dir DIR`` (``DIR/spinning-golden-thread/Dataset_short.json``; ``--data-file`` names the
file itself), ``$SIFT_DATA_DIR/longgenbench/``.

Completion rate, as the authors parse blocks (``Evalution/eval.py``): the reply is split at
``#*#`` and a block counts when ``{type} (\\d+)`` in it names a requested block 1..number;
text of the reply before its first ``#*#`` continues the prompt's first block, whose header
(``prefix``) is then prepended. Accuracy (does the block at each checked position mention its event) needs a
judge model in the authors' setup; it is not computed here, and ``checks_present`` reports
how many checked blocks exist at all.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from ...data import DataNotFoundError, find_data_file
from .base import Sample, Task, TaskData, TaskDataError, mean, prompts_digest, read_json, require_fields

DATASET = "spinning-golden-thread/Dataset_short.json"


def found_blocks(reply: str, block_type: str, prefix: str) -> set[int]:
    """Block numbers present in a reply (the authors' ``parse_weeks`` over ``#*#``-separated blocks)."""
    header = re.compile(rf"{re.escape(block_type)} (\d+)")
    # Text before the reply's first separator continues the prompt's first block.
    text = prefix + reply if reply.split("#*#", 1)[0].strip() else reply
    found = set()
    for block in text.split("#*#"):
        match = header.search(block)
        if match:
            found.add(int(match.group(1)))
    return found


class LongGenWu(Task):
    name = "longgen-wu"
    description = "LongGenBench (Wu et al.) short set: completion rate of the requested blocks (judged accuracy not computed)"
    default_max_new_tokens = 4096
    headline = "completion_rate"

    def load(self, data_path: Path | None = None) -> TaskData:
        if data_path is not None:
            path = Path(data_path)
            path = path / DATASET if path.is_dir() else path
        else:
            path = find_data_file("longgenbench/" + DATASET)
            if path is None:
                raise DataNotFoundError(
                    "the Wu et al. LongGenBench set is not shipped (no licence): pass --data-dir DIR with "
                    f"DIR/{DATASET}, or set SIFT_DATA_DIR to a directory with longgenbench/{DATASET}"
                )
        records = read_json(path)
        if not isinstance(records, list) or not records:
            raise TaskDataError(f"cannot read {path}: expected a JSON list of prompts")
        require_fields(records, ("prompt", "type", "number", "prefix", "checks_once", "checks_range", "checks_periodic"), path)
        samples = [
            Sample(
                id=str(i),
                messages=({"role": "user", "content": r["prompt"]},),
                plain=r["prompt"],
                target={
                    "type": r["type"],
                    "number": int(r["number"]),
                    "prefix": r["prefix"],
                    "checks": sorted({int(k) for key in ("checks_once", "checks_range", "checks_periodic") for k in r[key]}),
                },
            )
            for i, r in enumerate(records)
        ]
        return TaskData(samples, f"file:{path}", prompts_digest(samples))

    def score(self, sample: Sample, response: str) -> dict[str, Any]:
        t = sample.target
        present = found_blocks(response, t["type"], t["prefix"]) & set(range(1, t["number"] + 1))
        checks = t["checks"]
        return {
            "blocks": len(present),
            "number": t["number"],
            "completion_rate": len(present) / t["number"],
            "checks_present": sum(c in present for c in checks) / len(checks) if checks else float("nan"),
        }

    def aggregate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        return {
            "completion_rate": mean([r["completion_rate"] for r in rows]),
            "checks_present": mean([r["checks_present"] for r in rows]),
        }

    def info(self) -> dict[str, Any]:
        return {"checker": "Wu et al. block parsing ('#*#' split, '{type} N' headers), reimplemented; no judge model"}
