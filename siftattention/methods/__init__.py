"""Attention methods: Full, TopK, H2O, Sift, Oracle, the published rivals TopTheta and SkipSoftmax, and the ``name:key=value`` spec grammar."""

from __future__ import annotations

from dataclasses import fields
from typing import Sequence

from .base import Method, Rows, Selection
from .full import Full
from .h2o import H2O
from .oracle import Oracle
from .sift import Sift
from .skip_softmax import SkipSoftmax
from .threshold import ThresholdMethod
from .top_theta import CalibrationError, TopTheta
from .topk import TopK

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (Full, TopK, H2O, Sift, Oracle, TopTheta, SkipSoftmax)}

SPEC_HELP = """Method spec grammar: NAME[:KEY=VALUE[,KEY=VALUE...]]
  full
  topk:k=0.125[,renormalize=true][,vmc=false]   keep the ceil(k*S) largest scores
  h2o:k=0.125[,heavy_ratio=0.5]            heavy-hitter + recent eviction, budget k
  sift:tau=0.875,warmup=128[,renormalize=false][,warmup_source=prompt|decode|prefill]
       [,recalibrate_every=64][,recalibrate_decay=0.9][,warmup_tolerance=0][,warmup_min=16]
       [,normalizer=exact|anchored][,anchor_first=64][,anchor_last=256][,vmc=false]
       [,keybound=false|row|channel]   (keybound: the key-bound step, int8 key copy)
       [,gqa=head|shared]   (shared: one kept set per KV group, on its heads' largest probability)
  oracle:tau=0.875[,renormalize=false][,vmc=false]   exact per-step tau-quantile threshold
  toptheta:k=64[,renormalize=false][,vmc=true][,first_layers=2][,first_k=512][,sigma=0.1]
       [,calibration=c4][,calib_seqs=8][,calib_len=1024]   calibrated score thresholds (Top-theta)
  skipsoftmax:scale=16[,block=128][,per_head=false]   skip blocks far below the running max (BLASST)
vmc=true: V-mean compensation (the pruned probability mass times the mean of the valid value rows;
  needs renormalize=false). Booleans: true/false/1/0/yes/no."""


class SpecError(ValueError):
    """A method spec that cannot be parsed; the message names the bad part."""


def _convert(method: str, key: str, text: str, default: object, words: tuple[str, ...] = ()) -> object:
    if isinstance(default, bool):
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        if low in words:  # a boolean option with named settings too (Sift's keybound)
            return low
        if words:
            raise SpecError(f"{method}: {key}={text!r} is not one of true/false/{'/'.join(words)}")
        raise SpecError(f"{method}: {key}={text!r} is not a boolean (true/false)")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise SpecError(f"{method}: {key}={text!r} is not an integer") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise SpecError(f"{method}: {key}={text!r} is not a number") from None
    return text


def parse_method(spec: str) -> Method:
    """Build a method from ``name:key=value,...``; raises SpecError naming the bad part."""
    spec = spec.strip()
    name, _, args = spec.partition(":")
    name = name.strip().lower()
    if name not in METHODS:
        raise SpecError(f"unknown method {name!r} in {spec!r}; known: {', '.join(METHODS)}")
    cls = METHODS[name]
    defaults = {f.name: f.default for f in fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq:
            raise SpecError(f"{name}: {part!r} is not key=value")
        if key not in defaults:
            raise SpecError(f"{name}: unknown parameter {key!r}; allowed: {', '.join(defaults) or 'none'}")
        if key in kwargs:
            raise SpecError(f"{spec!r} gives {key} more than once")
        kwargs[key] = _convert(name, key, value.strip(), defaults[key], cls.spec_words.get(key, ()))
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise SpecError(f"{name}: {err}") from None


def parse_methods(specs: Sequence[str], option: str = "--method") -> list[tuple[str, Method]]:
    """Each spec with its method; a method given twice (in any spelling) is a SpecError.

    Two runs of one method would print two identical rows, and their results would share
    one file name where files are named by method.
    """
    methods: list[tuple[str, Method]] = []
    seen: dict[str, str] = {}
    for spec in specs:
        method = parse_method(spec)
        earlier = seen.get(method.spec())
        if earlier is not None:
            same = "is given twice" if earlier == spec else f"is the same method as {option} {earlier}"
            raise SpecError(f"{option} {spec} {same}")
        seen[method.spec()] = spec
        methods.append((spec, method))
    return methods


__all__ = ["METHODS", "SPEC_HELP", "CalibrationError", "Full", "H2O", "Method", "Oracle", "Rows", "Selection", "Sift", "SkipSoftmax",
           "SpecError", "ThresholdMethod", "TopK", "TopTheta", "parse_method", "parse_methods"]
