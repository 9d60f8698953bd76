"""The raw material of RULER's prompts, all offline: haystack prose, noise, and word lists.

RULER's "essay" haystack is Paul Graham's essays, downloaded at run time by its scripts; this
library never downloads, so the prose haystack is the WikiText-2 test split shipped in the
package (its wiki-tokenised spacing undone). The noise haystack is RULER's own repeated
sentences. RULER draws needle keys and CWE words from the ``wonderwords`` lists (not a
dependency here); the words here are the WikiText-2 vocabulary (lower-case alphabetic words
of 3 to 12 letters seen at least twice), the same kind of plain English words.
"""

from __future__ import annotations

import functools
import re

from ...data import load_corpus

#: RULER's noise haystack, one unit (niah_single_1, vt).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_WIKI_SPACING = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" 's", "'s"), (" n't", "n't"), (" ,", ","), (" .", "."),
                 (" ;", ";"), (" :", ":"), (" )", ")"), ("( ", "("), (" !", "!"), (" ?", "?"))


@functools.lru_cache(maxsize=1)
def prose_words() -> tuple[str, ...]:
    """The shipped WikiText-2 test text as words (headings dropped, spacing undone), RULER's haystack unit."""
    corpus = load_corpus("wikitext2")
    lines = [line.strip() for line in corpus.text.split("\n")]
    body = " ".join(line for line in lines if line and not line.startswith("="))
    for wiki, plain in _WIKI_SPACING:
        body = body.replace(wiki, plain)
    return tuple(re.sub(r"\s+", " ", body).strip().split(" "))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def split_sentences(text: str) -> list[str]:
    """Sentences, split after . ! ? before a capital, digit or quote (RULER uses NLTK's Punkt; no data download here)."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Plain English words (sorted): the WikiText-2 vocabulary, lower-case alphabetic, 3-12 letters, seen twice or more."""
    counts: dict[str, int] = {}
    for word in prose_words():
        if word.isalpha() and word.islower() and word.isascii() and 3 <= len(word) <= 12:
            counts[word] = counts.get(word, 0) + 1
    return tuple(sorted(w for w, n in counts.items() if n >= 2))
