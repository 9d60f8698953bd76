"""RULER (Hsieh et al. 2024, NVIDIA/RULER), generated offline: synthetic long-context retrieval at a length in tokens.

- ``texts``: the haystacks (WikiText-2 prose, RULER's noise sentences) and word lists;
- ``categories``: RULER's 11 synthetic task definitions (niah_*, vt, cwe, fwe), each a generator
  of one sample's text from a seeded random source and a haystack size;
- ``fitting``: the largest haystack whose prompt, chat template included, fits the length;
- ``scoring``: RULER's ``string_match_all``;
- ``needle_probe``: which layers and heads kept the needle's keys at the first decode step.

The task itself (``sift eval ruler``) is ``siftattention.eval.tasks.ruler``.
"""
