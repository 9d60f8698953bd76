"""RULER (Hsieh et al. 2024): synthetic retrieval at a length in tokens, generated offline from a seed.

Categories (RULER's synthetic.yaml, qa left out): ``niah_single_1/2/3``, ``niah_multikey_1/2/3``,
``niah_multivalue``, ``niah_multiquery``, ``vt``, ``cwe``, ``fwe``; their text is built by
``siftattention.eval.ruler.categories``. For each category the haystack is grown to the largest
size whose prompt, through the model's chat template and with RULER's answer prefix opening the
reply, has at most ``length`` minus the category's generation cap tokens (RULER's rule), measured
with the model's own tokenizer; so the task needs the model's name (``for_model``) before ``load``.

Scoring is RULER's ``string_match_all`` per sample, on the reply cut to the category's cap
(RULER's ``tokens_to_generate``: niah 128, vt 30, cwe 120, fwe 50; the run decodes up to 128);
``score`` is the mean over categories of each category's mean, as RULER averages its tasks.

Options: ``categories`` (comma-separated, or ``all``), ``samples`` per category, ``seed``,
``depth`` (percent; -1 draws each needle's depth from RULER's 40), ``diagnose=1`` (the needle
probe: for each sample and method, which layers and heads kept the needle's keys at the first
decode step, on the reference path; one more prefill per sample), and, for ``ruler`` only,
``length``; ``ruler-4k``, ``ruler-8k``, ``ruler-16k`` and ``ruler-32k`` fix it, so that one sweep
keeps each length's results in its own directory.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any, ClassVar, Sequence

from ..prompt_encoding import encode_prompt, prompt_text
from ..ruler.categories import CATEGORIES, Category, Draft
from ..ruler.fitting import LengthError, largest_fitting
from ..ruler.scoring import matched
from .base import Sample, Task, TaskData, mean, prompts_digest

#: generated task data by settings and tokenizer (the tokenizer kept with it, so its id is not reused)
_GENERATED: dict[tuple, tuple[Any, TaskData]] = {}

#: the context each embedded model was trained for (a longer RULER length is refused before any work)
EMBEDDED_CONTEXT = {"smollm2-135m": 8192, "gemma3-270m": 32768, "qwen2.5-1.5b": 32768}


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_name: str) -> Any:
    """The tokenizer of an embedded model, a local directory or a hub id (no weights; kept: a GGUF takes seconds to read)."""
    from transformers import AutoTokenizer

    from ...models import EMBEDDED

    if model_name in EMBEDDED:
        directory, gguf_file = EMBEDDED[model_name].locate()
        return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(model_name)


def context_limit(model_name: str) -> int | None:
    """The model's trained context in tokens where it is known without loading weights, else None."""
    if model_name in EMBEDDED_CONTEXT:
        return EMBEDDED_CONTEXT[model_name]
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_name)
    except (OSError, ValueError):
        return None
    config = getattr(config, "text_config", config)
    return getattr(config, "max_position_embeddings", None)


def needle_positions(tokenizer: Any, text: str, special: bool, needles: Sequence[tuple[str, str]]) -> list[int]:
    """Token positions of the prompt whose characters overlap a needle's answer part."""
    spans = []
    for sentence, part in needles:
        start = text.find(sentence)
        if start < 0:
            raise AssertionError(f"needle {sentence[:40]!r} is not in the prompt")
        offset = start + sentence.find(part)
        spans.append((offset, offset + len(part)))
    encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    return [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if b > a and any(a < e and b > s for s, e in spans)]


#: The length below which RULER's generators use their short forms (cwe: a smaller example, 6 and 1 repeats).
SHORT_FORM_LENGTH = 4095

class Ruler(Task):
    name = "ruler"
    description = "RULER synthetic retrieval (niah, vt, cwe, fwe) at a length in tokens, generated offline; string match per needle"
    default_max_new_tokens = 128  # RULER's largest cap (niah); each category's reply is cut to its own cap for scoring
    headline = "score"
    options = {"length": 4096, "categories": "all", "samples": 4, "seed": 42, "depth": -1, "diagnose": 0}
    #: the length of a ``ruler-Nk`` task (None: the ``length`` option)
    fixed_length: ClassVar[int | None] = None

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        s = self.settings
        self.length = self.fixed_length or s["length"]
        for key in ("length", "samples", "seed", "depth", "diagnose"):
            if key in s and (isinstance(s[key], bool) or not isinstance(s[key], int)):
                raise ValueError(f"task {self.name}: {key} must be an integer, got {s[key]!r}")
        if not isinstance(self.length, int) or self.length < 256:
            raise ValueError(f"task {self.name}: length must be an integer >= 256 tokens, got {self.length!r}")
        if s["samples"] < 1:
            raise ValueError(f"task {self.name}: samples must be >= 1, got {s['samples']}")
        if not -1 <= s["depth"] <= 100:
            raise ValueError(f"task {self.name}: depth must be a percentage 0..100, or -1 for RULER's random depths, got {s['depth']}")
        if s["diagnose"] not in (0, 1):
            raise ValueError(f"task {self.name}: diagnose must be 0 or 1, got {s['diagnose']}")
        listed = s["categories"] if isinstance(s["categories"], (list, tuple)) else str(s["categories"]).split(",")  # a TOML list or "a,b"
        names = list(CATEGORIES) if s["categories"] == "all" else [str(c).strip() for c in listed if str(c).strip()]
        unknown = [c for c in names if c not in CATEGORIES]
        if unknown or not names:
            raise ValueError(f"task {self.name}: unknown category {(unknown or [s['categories']])[0]!r}; known: all, {', '.join(CATEGORIES)}")
        self.categories = [CATEGORIES[c] for c in dict.fromkeys(names)]
        self.tokenizer: Any = None
        self.chat = True

    # -- the model's tokens ------------------------------------------------------------------------
    def for_model(self, model_name: str, chat: bool) -> None:
        limit = context_limit(model_name)
        if limit is not None and self.length > limit:
            raise ValueError(f"task {self.name}: {self.length} tokens exceed the {limit}-token context of {model_name}")
        self.use_tokenizer(load_tokenizer(model_name), chat)

    def use_tokenizer(self, tokenizer: Any, chat: bool) -> None:
        """Measure prompts with ``tokenizer``, through its chat template when ``chat``."""
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"task {self.name}: the tokenizer has no chat template; pass --no-chat (chat = false in a sweep)")
        if self.settings["diagnose"] and not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"task {self.name}: diagnose=1 needs a fast tokenizer (character offsets of the needle)")
        self.tokenizer, self.chat = tokenizer, chat

    # -- samples -------------------------------------------------------------------------------------
    def draft(self, category: Category, index: int, units: int, form_length: int | None = None) -> Draft:
        """Sample ``index`` of ``category`` with a haystack of ``units``: a function of the seed alone. ``form_length``
        (default: the task's length) picks the length-dependent form RULER's generators use (cwe's short form)."""
        rng = random.Random(f"ruler:{self.settings['seed']}:{category.name}:{index}")
        return category.draft(rng, units, form_length or self.length, self.settings["depth"])

    def sample(self, category: Category, index: int, draft: Draft) -> Sample:
        user = draft.user
        return Sample(id=f"{category.name}-{index}", messages=({"role": "user", "content": user},), plain=user + draft.prefix,
                      reply_prefix=draft.prefix.lstrip(),
                      target={"category": category.name, "answers": list(draft.answers), "depths": list(draft.depths),
                              "max_new_tokens": category.max_new_tokens})

    def prompt_tokens(self, sample: Sample) -> int:
        return len(encode_prompt(self.tokenizer, sample, self.chat))

    def category_samples(self, category: Category) -> list[Sample]:
        """``samples`` prompts of ``category``, each with the largest haystack that fits (RULER: the size found
        for the first sample, shrunk by 1% steps for a sample whose random words take more tokens)."""
        budget = self.length - category.max_new_tokens
        limit = category.max_units() if category.max_units else None
        # A tokenizer that spends more tokens a word (Gemma's splits numbers into digits) may not fit the fixed text
        # of a category's form for this length (cwe's worked example and 30 repeats at 4096): then the form RULER
        # uses below 4096 tokens.
        for form in dict.fromkeys((self.length, min(self.length, SHORT_FORM_LENGTH))):
            try:
                units = largest_fitting(lambda n: self.prompt_tokens(self.sample(category, 0, self.draft(category, 0, n, form))),
                                        budget, start=max(16, budget // 64), limit=limit)
                break
            except LengthError as err:
                problem = err
        else:
            raise ValueError(f"task {self.name}: {category.name} does not fit {self.length} tokens ({problem})") from None
        samples = []
        for index in range(self.settings["samples"]):
            n = units
            while True:
                draft = self.draft(category, index, n, form)
                sample = self.sample(category, index, draft)
                if self.prompt_tokens(sample) <= budget or n == 1:
                    break
                n = max(1, n - max(1, n // 100))
            text, special = prompt_text(self.tokenizer, sample, self.chat)
            positions = needle_positions(self.tokenizer, text, special, draft.needles) if self.settings["diagnose"] and draft.needles else []
            sample.target.update(units=n, prompt_tokens=self.prompt_tokens(sample), needle_positions=positions,
                                 short_form=form < self.length)
            samples.append(sample)
        return samples

    def load(self, data_path: Path | None = None) -> TaskData:
        if data_path is not None:
            raise ValueError(f"task {self.name} generates its prompts; it reads no data file")
        if self.tokenizer is None:
            raise ValueError(f"task {self.name} measures its prompts in the model's tokens: call for_model() or use_tokenizer() first")
        # A sweep loads every task to check it before the model loads, then again to run it: fit the haystacks once.
        key = (self.length, tuple(c.name for c in self.categories), tuple(sorted(self.settings.items())), id(self.tokenizer), self.chat)
        if key not in _GENERATED:
            samples = [s for category in self.categories for s in self.category_samples(category)]
            source = (f"generated (seed {self.settings['seed']}, {self.length} tokens, chat {self.chat}): haystacks WikiText-2 "
                      "(siftattention/resources) and RULER's noise sentences")
            _GENERATED[key] = (self.tokenizer, TaskData(samples, source, prompts_digest(samples)))
        return _GENERATED[key][1]

    # -- scoring ---------------------------------------------------------------------------------------
    def cut_reply(self, reply: str, max_new_tokens: int) -> str:
        """The reply's first ``max_new_tokens`` tokens (the category's cap); as it is without a tokenizer."""
        if self.tokenizer is None:
            return reply
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
        return reply if len(ids) <= max_new_tokens else self.tokenizer.decode(ids[:max_new_tokens])

    def score(self, sample: Sample, response: str) -> dict[str, Any]:
        t = sample.target
        found = matched(self.cut_reply(response, t["max_new_tokens"]), t["answers"])
        return {"category": t["category"], "string_match": sum(found) / len(found), "matched": found}

    def probe(self, model: Any, sample: Sample, prompt: list[int], method: Any) -> dict[str, Any]:
        if not self.settings["diagnose"] or not sample.target.get("needle_positions"):
            return {}
        from ..ruler.needle_probe import probe_needle

        return {"needle": probe_needle(model, prompt, method, sample.target["needle_positions"])}

    def aggregate(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        per_category = {c: mean([r["string_match"] for r in rows if r["category"] == c]) for c in dict.fromkeys(r["category"] for r in rows)}
        metrics = {"score": mean(list(per_category.values())), **per_category}
        probed = [r["needle"] for r in rows if r.get("needle", {}).get("decode_step") and r["needle"].get("kept_all_fraction") is not None]
        if probed:
            metrics["needle_kept_all"] = mean([p["kept_all_fraction"] for p in probed])
            metrics["needle_dropped"] = mean([p["kept_all_fraction"] < 1.0 for p in probed])
        return metrics

    def info(self) -> dict[str, Any]:
        return {"checker": "RULER string_match_all per sample (reimplemented), reply cut to the category's tokens_to_generate"}


def ruler_at(length: int) -> type[Ruler]:
    """The RULER task at a fixed length, named ``ruler-Nk``."""
    return type(f"Ruler{length // 1024}K", (Ruler,), {
        "name": f"ruler-{length // 1024}k",
        "description": f"RULER synthetic retrieval at {length} tokens (the ruler task with length={length})",
        "options": {k: v for k, v in Ruler.options.items() if k != "length"},
        "fixed_length": length,
    })


RULER_TASKS: tuple[type[Ruler], ...] = (Ruler, *(ruler_at(n) for n in (4096, 8192, 16384, 32768)))
