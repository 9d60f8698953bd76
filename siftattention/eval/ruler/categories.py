"""RULER's synthetic task definitions (NVIDIA/RULER ``scripts/synthetic.yaml``, ``scripts/data/synthetic/*.py``), rewritten.

Each category turns a seeded random source and a haystack size (``units``: words of prose,
noise sentences, distractor needles, listed words or coded words) into a ``Draft``: the user
text, the words the answer starts with (RULER's ``answer_prefix``) and the gold answers.
Templates, answer prefixes, needle formats and generation caps are RULER's. Where this code
differs from RULER's scripts:

- the prose haystack is WikiText-2, not Paul Graham's essays (see ``texts``);
- a needle goes at a depth drawn from RULER's 40 depths (or the one asked for) in every
  haystack, where RULER's noise and distractor haystacks draw a random sentence index;
- the one-shot example of ``vt`` has a fixed number of noise sentences (15, fewer for short
  lengths) where RULER fits it to 500 tokens.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from dataclasses import dataclass
from typing import Callable

from .texts import NOISE, prose_words, split_sentences, vocabulary

#: RULER's needle depths in percent: 40 points from 0 to 100.
DEPTHS = tuple(int(math.floor(100 * i / 39 + 0.5)) for i in range(40))

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
                 "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: "
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
                "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared "
                "coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                "most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class Draft:
    """One sample's text before the chat template.

    ``needles``: (a unique sentence of the prompt, the part of it the answer is read from), for
    the needle probe; ``depths``: the depth in percent each needle was planted at.
    """

    user: str
    prefix: str
    answers: tuple[str, ...]
    needles: tuple[tuple[str, str], ...] = ()
    depths: tuple[int, ...] = ()


@dataclass(frozen=True)
class Category:
    name: str
    max_new_tokens: int  # RULER's tokens_to_generate
    draft: Callable[[random.Random, int, int, int], Draft]  # (rng, units, length, depth or -1) -> Draft
    #: the most haystack units a prompt can hold (word lists cannot repeat), None: no limit
    max_units: Callable[[], int] | None = None


# -- needles in a haystack --------------------------------------------------------------------------
def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    words = vocabulary()
    return f"{rng.choice(words)}-{rng.choice(words)}"  # RULER: an adjective-noun pair


def _prose(units: int) -> str:
    words = prose_words()
    repeats = -(-units // len(words))
    return " ".join((words * repeats)[:units]) if repeats > 1 else " ".join(words[:units])


def insert_at_depths(pieces: list[str], needles: list[str], depths: list[int]) -> list[str]:
    """``pieces`` with each needle inserted before piece ``int(len(pieces) * depth / 100)`` (RULER's placement)."""
    out = list(pieces)
    for index, needle in sorted(((int(len(pieces) * d / 100), n) for d, n in zip(depths, needles)), key=lambda t: -t[0]):
        out.insert(index, needle)
    return out


def _depths(rng: random.Random, count: int, depth: int) -> list[int]:
    return [depth] * count if depth >= 0 else sorted(rng.sample(DEPTHS, count))


def niah(haystack: str, key_kind: str, value_kind: str, num_k: int = 1, num_v: int = 1, num_q: int = 1) -> Callable[..., Draft]:
    """RULER's ``niah.py`` with one configuration of synthetic.yaml."""
    num_k = max(num_k, num_q)

    def draft(rng: random.Random, units: int, length: int, depth: int) -> Draft:
        keys, values, needles = [], [], []
        for _ in range(num_k):
            keys.append(_random_value(rng, key_kind))
            values.append([_random_value(rng, value_kind) for _ in range(num_v)])
            needles += [(NEEDLE.format(type_needle_v=value_kind, key=keys[-1], value=v), v) for v in values[-1]]
        rng.shuffle(needles)
        depths = _depths(rng, len(needles), depth)
        sentences = [n for n, _ in needles]
        if haystack == "prose":
            context = " ".join(insert_at_depths(split_sentences(_prose(units)), sentences, depths))
        else:
            if haystack == "noise":
                pieces = [NOISE] * units
            else:  # distractor needles: other keys with other values
                pieces = [NEEDLE.format(type_needle_v=value_kind, key=_random_value(rng, key_kind), value=_random_value(rng, value_kind))
                          for _ in range(units)]
            context = "\n".join(insert_at_depths(pieces, sentences, depths))
        asked = rng.sample(range(num_k), num_q)
        queries = [keys[i] for i in asked]
        answers = tuple(v for i in asked for v in values[i])
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, type_v = NIAH_TEMPLATE, NIAH_PREFIX, value_kind
        if num_q * num_v == 1:  # RULER's singular wording, replaced in the template as its script does
            template, prefix = (t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
                                for t in (template, prefix))
            type_v = value_kind[:-1]
        planted = {v: n for n, v in needles}
        return Draft(template.format(type_needle_v=type_v, context=context, query=query), prefix.format(type_needle_v=type_v, query=query),
                     answers, tuple((planted[a], a) for a in answers), tuple(depths))

    return draft


# -- variable tracking ---------------------------------------------------------------------------------
def _chain(rng: random.Random, hops: int, letters: int) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    chain = [f"VAR {names[0]} = {rng.randint(10000, 99998)}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, chain


def _vt_text(rng: random.Random, noises: int, names: list[str], chain: list[str]) -> tuple[str, str]:
    sentences = [NOISE] * noises
    positions = sorted(rng.sample(range(len(sentences)), len(chain)))
    for j, p in enumerate(positions):
        sentences.insert(p + j, chain[j])
    context = "\n".join(sentences).replace(". \n", ".\n")
    value = chain[0].split("=")[-1].strip()
    return VT_TEMPLATE.format(context=context, query=value), VT_PREFIX.format(num_v=len(names), query=value)


def variable_tracking(hops: int = 4) -> Callable[..., Draft]:
    """RULER's ``variable_tracking.py`` (one chain, noise haystack, a one-shot example first)."""

    def draft(rng: random.Random, units: int, length: int, depth: int) -> Draft:
        example_names, example_chain = _chain(rng, hops, 3)
        example_noise = max(len(example_chain), min(15, length // 300))
        text, prefix = _vt_text(rng, example_noise, example_names, example_chain)
        example = text + prefix + " " + " ".join(example_names) + "\n"
        names, chain = _chain(rng, hops, 5)
        text, prefix = _vt_text(rng, max(units, len(chain)), names, chain)
        return Draft(example + "\n" + text, prefix, tuple(names), tuple((c.strip(), c.strip()) for c in chain))

    return draft


# -- word extraction -------------------------------------------------------------------------------------
def _cwe_example(rng: random.Random, num_words: int, common_repeats: int, uncommon_repeats: int, common: int) -> tuple[str, list[str]]:
    words = rng.sample(vocabulary(), num_words)
    top, rest = words[:common], words[common:]
    listed = top * common_repeats + rest * uncommon_repeats
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top


def common_words(freq_cw: int = 30, freq_ucw: int = 3, num_cw: int = 10) -> Callable[..., Draft]:
    """RULER's ``common_words_extraction.py``: one worked example, then the list (6 and 1 repeats below 4096 tokens)."""

    def draft(rng: random.Random, units: int, length: int, depth: int) -> Draft:
        short = length < 4096
        context, answer = _cwe_example(rng, 20, 3, 1, num_cw) if short else _cwe_example(rng, 40, 10, 3, num_cw)
        shot = CWE_TEMPLATE.format(context=context) + CWE_PREFIX + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer))
        context, answer = _cwe_example(rng, max(units, num_cw), *((6, 1) if short else (freq_cw, freq_ucw)), num_cw)
        return Draft(shot + "\n" + CWE_TEMPLATE.format(context=context), CWE_PREFIX, tuple(answer))

    return draft


def _zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1: a partial sum plus the integral of the tail (scipy's ``zeta`` in RULER)."""
    n = 10000
    return sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha


def frequent_words(alpha: float = 2.0, coded_wordlen: int = 6) -> Callable[..., Draft]:
    """RULER's ``freq_words_extraction.py``: coded words drawn with Zipf frequencies, the top one being '...' (noise)."""

    def draft(rng: random.Random, units: int, length: int, depth: int) -> Draft:
        size = max(4, (length - 50) // 50)  # RULER: vocab_size = (max_seq_length - tokens_to_generate) // 50
        vocab: set[str] = set()
        while len(vocab) < size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
        words = sorted(vocab)
        rng.shuffle(words)
        words[0] = "..."
        z = _zeta(alpha)
        listed = [w for k, w in enumerate(words, start=1) for _ in range(int(units * k ** -alpha / z))]
        rng.shuffle(listed)
        return Draft(FWE_TEMPLATE.format(context=" ".join(listed)), FWE_PREFIX, tuple(words[1:4]))

    return draft


CATEGORIES: dict[str, Category] = {c.name: c for c in (
    Category("niah_single_1", 128, niah("noise", "words", "numbers")),
    Category("niah_single_2", 128, niah("prose", "words", "numbers")),
    Category("niah_single_3", 128, niah("prose", "words", "uuids")),
    Category("niah_multikey_1", 128, niah("prose", "words", "numbers", num_k=4)),
    Category("niah_multikey_2", 128, niah("needle", "words", "numbers")),
    Category("niah_multikey_3", 128, niah("needle", "uuids", "uuids")),
    Category("niah_multivalue", 128, niah("prose", "words", "numbers", num_v=4)),
    Category("niah_multiquery", 128, niah("prose", "words", "numbers", num_q=4)),
    Category("vt", 30, variable_tracking()),
    Category("cwe", 120, common_words(), max_units=lambda: len(vocabulary())),
    Category("fwe", 50, frequent_words()),
)}
