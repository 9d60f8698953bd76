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
(``prefix``) is then prepended. ``checks_present`` reports how many checked blocks exist at all.

Accuracy (does the block at each checked position mention its event: a birthday, a trip, a
periodic activity) needs a judge model, as in the authors' setup (they use GPT-4o). With the
task option ``judge=MODEL`` (an embedded name, a local directory or a hub id) a local model
answers Yes or No for each (block, event) pair and ``judged_accuracy`` is the share of Yes,
a missing block counting as No. The judge only scores: it is not part of the run key, so the
same ``sift eval`` run again with it (or ``sift sweep --score-only``) judges replies decoded
earlier without decoding them again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ...data import DataNotFoundError, find_data_file
from ..batching import left_pad
from .base import Sample, Task, TaskData, TaskDataError, mean, prompts_digest, read_json, require_fields

DATASET = "spinning-golden-thread/Dataset_short.json"


def reply_blocks(reply: str, block_type: str, prefix: str) -> dict[int, str]:
    """Block number -> text (its first occurrence), parsed like the authors' ``parse_weeks``."""
    header = re.compile(rf"{re.escape(block_type)} (\d+)")
    # Text before the reply's first separator continues the prompt's first block.
    text = prefix + reply if reply.split("#*#", 1)[0].strip() else reply
    blocks: dict[int, str] = {}
    for block in text.split("#*#"):
        match = header.search(block)
        if match:
            blocks.setdefault(int(match.group(1)), block.strip())
    return blocks


JUDGE_PROMPT = (
    "Here is one entry of a longer text:\n\n{block}\n\n"
    "Does this entry mention the following: {event}? Answer with Yes or No."
)


class YesNoJudge:
    """A local causal LM that answers a yes/no question: Yes when its next-token logit for
    "Yes" beats the one for "No" (each the best of its spellings with and without a space)."""

    def __init__(self, name: str, max_block_tokens: int = 1024, batch_size: int = 8) -> None:
        from ...models import load_model

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self.tokenizer = load_model(name, device=device)
        self.max_block_tokens, self.batch_size = max_block_tokens, batch_size
        self.yes = self._token_ids(("Yes", " Yes"))
        self.no = self._token_ids(("No", " No"))

    def _token_ids(self, spellings: tuple[str, ...]) -> list[int]:
        return sorted({self.tokenizer.encode(s, add_special_tokens=False)[0] for s in spellings})

    def _prompt(self, block: str, event: str) -> list[int]:
        ids = self.tokenizer.encode(block, add_special_tokens=False)[: self.max_block_tokens]
        text = JUDGE_PROMPT.format(block=self.tokenizer.decode(ids), event=event)
        if getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))
        return self.tokenizer.encode(text + "\nAnswer:", add_special_tokens=True)

    @torch.inference_mode()
    def margins(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Best "Yes" logit minus best "No" logit for each (block, event), batched with left padding."""
        out: list[float] = []
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for a in range(0, len(pairs), self.batch_size):
            ids, mask = left_pad([self._prompt(b, e) for b, e in pairs[a : a + self.batch_size]], pad, self.model.device)
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
            out += (logits[:, self.yes].max(1).values - logits[:, self.no].max(1).values).tolist()
        return out

    def __call__(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        return [m > 0 for m in self.margins(pairs)]


class LongGenWu(Task):
    name = "longgen-wu"
    description = "LongGenBench (Wu et al.) short set: completion rate of the requested blocks; judged accuracy with judge=MODEL"
    default_max_new_tokens = 4096
    headline = "completion_rate"
    options = {"judge": ""}
    scoring_options = ("judge",)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._judge: Callable[[Sequence[tuple[str, str]]], list[bool]] | None = None

    def judge(self) -> Callable[[Sequence[tuple[str, str]]], list[bool]] | None:
        """The judge model, loaded at its first use (None without ``judge=MODEL``)."""
        if self._judge is None and self.settings["judge"]:
            self._judge = YesNoJudge(self.settings["judge"])
        return self._judge

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
        samples = []
        for i, r in enumerate(records):
            # (block number, event) of every check; the checked blocks are their numbers.
            events = [[int(k), v] for key in ("checks_once", "checks_range", "checks_periodic") for k, v in r[key].items()]
            target = {"type": r["type"], "number": int(r["number"]), "prefix": r["prefix"],
                      "checks": sorted({n for n, _ in events}), "events": events}
            samples.append(Sample(id=str(i), messages=({"role": "user", "content": r["prompt"]},), plain=r["prompt"],
                                  target=target))
        self.judge()  # a judge that cannot load fails here, before any decoding
        return TaskData(samples, f"file:{path}", prompts_digest(samples))

    def score(self, sample: Sample, response: str) -> dict[str, Any]:
        t = sample.target
        blocks = {n: b for n, b in reply_blocks(response, t["type"], t["prefix"]).items() if 1 <= n <= t["number"]}
        checks = t["checks"]
        scores: dict[str, Any] = {
            "blocks": len(blocks),
            "number": t["number"],
            "completion_rate": len(blocks) / t["number"],
            "checks_present": sum(c in blocks for c in checks) / len(checks) if checks else float("nan"),
        }
        judge = self.judge()
        if judge is not None and t.get("events"):
            asked = [(blocks[n], event) for n, event in t["events"] if n in blocks]
            verdicts = iter(judge(asked))
            judged = [bool(next(verdicts)) if n in blocks else False for n, _ in t["events"]]
            scores["judged"] = judged
            scores["judged_accuracy"] = sum(judged) / len(judged)
        return scores

    def stale(self, scores: dict[str, Any]) -> bool:
        # Replies scored before a judge was named are judged on the next scoring pass.
        return bool(self.settings["judge"]) and "judged_accuracy" not in scores

    def aggregate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        metrics = {
            "completion_rate": mean([r["completion_rate"] for r in rows]),
            "checks_present": mean([r["checks_present"] for r in rows]),
        }
        if self.settings["judge"]:
            metrics["judged_accuracy"] = mean([r["judged_accuracy"] for r in rows if "judged_accuracy" in r])
        return metrics

    def info(self) -> dict[str, Any]:
        judge = self.settings["judge"]
        return {"checker": "Wu et al. block parsing ('#*#' split, '{type} N' headers), reimplemented; "
                + (f"judged accuracy by {judge!r} (Yes/No next-token logits)" if judge else "no judge model")}
