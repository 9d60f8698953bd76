"""Triton kernels for the sift decode step (backend="triton").

One query token per sequence, memory bound. Valid keys of batch row b are the
positions ``[starts[b], seq_lens[b])``; every kernel splits that range (not the
cache's whole length) into a fixed number of splits, so a short row in a long cache
keeps the chip busy and a launch plan made once per cache shape serves every step.

Sparse step (``sparse``):

1. ``_scores_kernel`` (split-K, one program per (split, batch, KV head), all query
   heads of the GQA group as one tile, so K is read once per group): writes float32
   scores in the log2 domain (``s2 = scale * log2(e) * q.k``, 4 bytes per key and
   query head, vs 2*D bytes of K per key) and per-split softmax statistics (max, sum
   of exp2, first argmax).
2. ``_filter_kernel`` (split-K): merges the split statistics into the row max ``M``
   and normaliser ``L``, turns eta into the log2-domain threshold
   ``M + log2(eta) + log2(L)`` (eta <= 0: keep every key; eta >= 1: the maximum
   only), compacts the positions of the rows that some head of the group keeps and
   gathers only those V rows (or streams with masked V loads when nothing is
   filtered). Partial outputs are already divided by ``L``, so splits add up: the
   last split program of each (batch, KV head) sums them, renormalises if asked and
   writes the output and the kept counts. On Hopper it is launched with programmatic
   dependent launch: it is dispatched during the scores kernel's tail and each
   program waits only for the splits of its own row (a counter the scores programs
   release), so the V gathers of finished rows overlap the last K reads.

Dense step (``dense``): ``_dense_kernel``, flash-decoding: one pass over K and V per
split with an online softmax, the last split program of each row combines.

Warmup step (``warmup``): the dense kernel also storing the scores, then the exact
tau-quantile of the probabilities from them (``triton_quantile``). (``warmup_dense=False``:
the scores kernel, the quantile, then the filter kernel keeping every key.)

K and V are loaded with an evict-first L2 policy and the scores stored evict-last,
so the filter pass tends to find them in L2. The counters that order the passes
(row arrivals, finished splits) live in a workspace buffer that the last program of
each row zeroes again, so a call launches no memset. No step reads a tensor value
on the host: every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .plan import PowerLawThreshold
from .triton_common import _INT_MAX, _dot, _row_ml, _row_range, _split_range, launch
from .triton_quantile import quantile_pass

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Programmatic dependent launch (Hopper+): the filter kernel is dispatched while the
# scores kernel drains, and each of its programs waits for its own row only.
try:
    from triton.language.extra.cuda import gdc_launch_dependents

    _HAS_PDL = True
except ImportError:  # older Triton
    _HAS_PDL = False


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters; the defaults come from the H200 grids in benchmarks/NOTES_kernels.md.

    ``config_for`` applies per-device overrides (``DEVICE_CONFIGS``) on top of them.
    """

    block_n1: int = 128  # keys per iteration in the scores pass
    warps1: int = 4
    stages1: int = 3
    programs1: int = 64  # target programs per SM for the scores pass (sets the split)
    min_split1: int = 1024  # fewest keys per split
    # Persistent scores pass: this many programs per SM (0: one program per split), each
    # scoring every n-th (split, row) item in row order, so rows finish one after another and
    # the filter pass (dispatched once every scores program has started, into the room the
    # two leave on each SM) filters the first rows while later ones are scored. Taken where
    # there are at least ``persist1_min_rows`` (batch, KV head) rows and enough items for
    # ``persist1_min_waves`` rounds of programs (H200, s = 0.875, ratio to SDPA planned /
    # persistent: GQA 32/8 B = 8 / 16, S = 32768 0.968 / 0.930, 0.949 / 0.901, heads of a
    # group correlated 0.879 / 0.817, 0.851 / 0.796; MHA B = 8, S = 32768 0.678 / 0.657;
    # losing at B <= 2, at B = 8, S = 8192 and by 0.02-0.05 at s = 0; decode_grid_persist*).
    persist1: int = 2
    persist1_min_rows: int = 32
    persist1_min_waves: int = 3
    block_n2: int = 32  # V rows per iteration of the filter pass's streaming loop
    warps2: int = 4
    stages2: int = 4
    programs2: int = 8
    min_split2: int = 2048
    # MHA: more, shorter filter splits (H200, B = 8, S = 32768, s = 0.875: 0.657 -> 0.643x SDPA,
    # B = 16 0.640 -> 0.635, B = 4 0.671 -> 0.658; as good or better at every sparsity).
    programs2_mha: int = 16
    # GQA beside a persistent scores pass: the filter grid is one wave of resident programs
    # (this many per SM), in splits of at most ``max_split2_persist_gqa`` keys (0: any). Where
    # this changes the plan it wins at s >= 0.875 and loses at s <= 0.75, where the step is
    # slower than SDPA either way (H200, ratio to SDPA at s = 0.875 / 0.5, former -> this:
    # GQA 32/8 B = 8, S = 32768 0.920 -> 0.890 / 1.29 -> 1.38; B = 16, S = 16384 0.918 -> 0.894;
    # B = 32, S = 8192 0.930 -> 0.900; decode_grid_filter_rule2*_h200.json).
    programs2_persist_gqa: int = 4
    max_split2_persist_gqa: int = 4096
    fill: int = 2  # fewest programs per SM, scores and quantile passes (overrides the minimum split length)
    # The filter pass at small B: at most one program per SM from the fill rule, and a grid
    # of less than one wave is not rounded up to a whole one (GQA B = 1, S = 32768: 528
    # programs 1.45x SDPA, 264 1.17x, 136 1.17x, 128 1.03x; see NOTES_kernels.md).
    fill2: int = 1
    whole_waves2: bool = False
    filld: int = 1  # the same two choices for the dense kernel (B = 1, S = 8192: 1.81x -> 1.05x SDPA)
    whole_wavesd: bool = False
    # Programs of each kernel resident on one SM at once (registers / shared memory of the
    # default fp16 builds): small grids are sized to whole waves of these.
    resident1: int = 2
    # Grids of at most this many waves are sized to a whole number of waves (``_splits``).
    waves1: int = 4
    resident2: int = 4
    residentd: int = 3
    wavesd: int = 4
    # Tensor-core dot for QK and PV (heads padded to 16). Triton pipelines the loads
    # that feed a dot through shared memory (cp.async), so this is the default even
    # for MHA; the elementwise path loads to registers without prefetch.
    use_dot: bool = True
    compact: bool = True  # filter pass: gather compacted kept rows (see _filter_kernel)
    compact_weights: bool = True  # the scan also writes the kept weights compacted (phase B: one indirection)
    block_nb: int = 128  # V rows per gather iteration with compact_weights (0: block_n2)
    stages_b: int = 0  # pipeline stages of the gather loop (0: stages2, the streaming loop's)
    # GQA (several query heads per KV head): the rows some head of a group keeps are several
    # times denser than one head's, and each gathered row feeds G heads, so longer gathers
    # and streaming tiles pay there; for MHA they cost occupancy (more registers).
    block_n2_gqa: int = 64
    block_nb_gqa: int = 256
    stages_b_gqa: int = 2
    stream_mask_v: bool = False  # streaming mode loads only the kept V rows (else every row of the tile)
    block_a: int = 1024  # fewest keys per iteration of the compaction scan
    scan_elems: int = 2048  # scan tile [G, keys] of at least this many elements (MHA: longer rows)
    dense_pct: int = 85  # stream instead of gather when more than this % of rows is kept
    # Filter pass: each split takes every NUM_SPLITS-th run of this many keys instead of one
    # contiguous range (0), so kept keys that cluster in position (attention sinks, recent
    # tokens, a topic) spread over all of a row's programs instead of lengthening a few.
    # H200, the 8B shape's captured decode calls whose kept rows crowd the first tenth of the
    # positions (one contiguous split gathering 2.5x the mean): filter pass 170 -> 112 us
    # with 256 (128, 512, 1024 gain less); on bench_decode's evenly spread keys it costs
    # 0.5-2.3% at s = 0.875 and 2-8% at s = 0 (replay_decode.py, BENCHMARKS.md).
    interleave2: int = 256
    # The run is halved until each split of a full-length row gets at least this many: at
    # B = 1, S = 8192 (16 splits of 512 keys) 256-key runs give a split 2 of them, too few to
    # spread the keys that crowd the first positions (H200, captured calls of the planted 8B
    # shape: filter pass 22 -> 14 us, 0.036 -> 0.029 ms a layer with 128-key runs, as shuffled
    # positions; 32 and 64 no better; unchanged where the splits are longer; replay_b1_*).
    interleave2_runs: int = 4
    fused_combine: bool = True  # last split program reduces (no separate combine launch)
    quantile_block: int = 2048
    quantile_warps: int = 8
    quantile_stages: int = 2
    # One quantile program per row: each pass loads its next tile before it histograms the
    # current one (H200, warmup step: GQA B = 8 / 16, S = 32768 1.82 -> 1.77x SDPA).
    quantile_prefetch: bool = True
    # Rows cut into chunks ("auto": when there are at most as many (batch, query head) rows
    # as SMs): each row's programs count their chunk into the row's histograms and meet at a
    # counter after each digit, all in one launch (H200, GQA B = 1, S = 32768: warmup 1.74 ->
    # 1.46x SDPA against one launch per digit). At most ``quantile_resident`` programs per SM,
    # so that every program of a row is resident at once (they wait for each other: raise it
    # only where that many fit), and chunks of at least ``min_splitq`` keys. Needs the sampled
    # bracket (quantile_sample > 0); never under the interpreter, which runs one program at a time.
    quantile_parallel: bool | str = "auto"
    quantile_resident: int = 1
    min_splitq: int = 4096
    # Radix passes from this one on (0-3; 4: none) count the keys still matching the digits
    # found so far with one atomic per key instead of a register histogram, which costs the
    # same per key whether it matches or not: after two 8-bit digits few keys are left.
    quantile_sparse_from: int = 2
    # ``quantile_sample`` evenly spaced keys of each row (a power of two;
    # 0: off), sorted, bracket the wanted rank within ``quantile_margin`` sample ranks either
    # side, and only the keys inside are radix-selected. A bracket that misses falls back to
    # the radix select over every key (exact either way).
    quantile_sample: int = 512
    quantile_margin: int = 32
    # Bits per radix digit inside the bracket (2**bits bins a pass): 12 takes 2 passes where 8
    # takes 3 (GQA B = 8 / 16, S = 32768: warmup 1.43 -> 1.38x SDPA), but reading back and
    # scanning 4096 bins costs more than a pass over a short row (MHA, S = 8192: 1.18 -> 1.20x),
    # so caches shorter than ``quantile_long_row`` keys use ``quantile_bracket_bits_short``
    # unless rows are cut into chunks, where every digit costs a meeting (GQA B = 1, S = 8192:
    # 1.86 -> 1.78x with 12 bits).
    quantile_bracket_bits: int = 12
    quantile_bracket_bits_short: int = 8
    quantile_long_row: int = 16384
    # Programmatic dependent launch (Hopper+): the filter kernel starts during the scores
    # kernel's tail and each of its programs waits for its own row only.
    pdl: bool = True
    # L2 policy: K and V rows are read once (evict first); the float32 scores are read
    # again by the filter pass (evict last), so they may still be in L2 then.
    evict: bool = True
    # Functional API: reuse one zeroed counter buffer per stream (the kernels zero it
    # again) instead of a memset per call; needs fused_combine.
    reuse_sync: bool = True
    # Warmup as the dense kernel storing the scores, then the quantile (two launches, one
    # pass over K and V); off: scores kernel, quantile, filter kernel keeping every key.
    warmup_dense: bool = True
    # Dense (flash-decoding) kernel.
    block_nd: int = 64
    warpsd: int = 4
    stagesd: int = 3
    programsd: int = 6
    # Fewest keys per dense split: 4096 instead of 2048 took B = 1, S = 131072 from 1.15 to
    # 1.07x SDPA and MHA B = 8, S = 8192 from 1.05 to 1.01x; no target shape lost.
    min_splitd: int = 4096
    # Register caps per thread (0: the compiler's choice) of the scores, filter, dense and
    # quantile kernels: a cap trades a few spills for one more resident program per SM.
    maxnreg1: int = 0
    maxnreg2: int = 0
    maxnregd: int = 0
    maxnregq: int = 0
    # Sift(normalizer="anchored"): its one-pass kernel (triton_onepass) where it beats these
    # two passes with the anchored threshold, i.e. grouped-query heads, at least this many
    # (batch, KV head) rows and caches of at least this many keys; the two passes elsewhere
    # (H200, s = 0.875, ratio to SDPA one-pass / two-pass: GQA 32/8 B = 8 and 16, S = 32768
    # 0.815-0.826 / 0.94-0.955; B = 4, S = 32768 0.96 / 0.955; B = 8, S = 16384 0.97 / 0.95;
    # B <= 2 1.16-1.36 / 0.96-1.08; MHA 32/32 B = 8 0.85-0.98 / 0.67-0.69;
    # decode_quick_anchored2_h200.json, decode_anchored_forms_h200.json).
    onepass_min_rows: int = 64
    onepass_min_len: int = 24576

    def __post_init__(self):
        # Tile sizes that become tl.arange lengths: a wrong one would fail deep in the compiler.
        for name in ("quantile_block", "quantile_sample"):
            v = getattr(self, name)
            if v < 0 or v & (v - 1) or (v == 0 and name == "quantile_block"):
                raise ValueError(f"KernelConfig.{name} must be a power of two{' or 0' if name == 'quantile_sample' else ''}, got {v}")
        for name in ("quantile_bracket_bits", "quantile_bracket_bits_short"):
            if not 4 <= getattr(self, name) <= 12:
                raise ValueError(f"KernelConfig.{name} must be in 4..12, got {getattr(self, name)}")
        for name, least in (("quantile_margin", 0), ("quantile_resident", 1), ("min_splitq", 1), ("interleave2_runs", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"KernelConfig.{name} must be >= {least}, got {getattr(self, name)}")
        for name in ("maxnreg1", "maxnreg2", "maxnregd", "maxnregq"):
            if not (getattr(self, name) == 0 or 24 <= getattr(self, name) <= 255):
                raise ValueError(f"KernelConfig.{name} must be 0 (no cap) or in 24..255, got {getattr(self, name)}")


# Per-device overrides of the defaults: the first entry whose key is in the device name
# wins. Empty: the defaults are the H200 tuning, and the new kernels were not re-tuned on
# another device.
DEVICE_CONFIGS: dict[str, dict] = {}
_DEFAULT = KernelConfig()


def config_for(device: torch.device) -> KernelConfig:
    """The launch parameters for a device (``_DEFAULT`` with its device overrides)."""
    if device.type != "cuda":
        return _DEFAULT
    name = _device_info(device)[2]
    for key, over in DEVICE_CONFIGS.items():
        if key in name:
            return replace(_DEFAULT, **over)
    return _DEFAULT


_DEVICES: dict[int, tuple[int, bool, str]] = {}


def _device_info(device: torch.device) -> tuple[int, bool, str]:
    """(SM count, Hopper or newer, name) of a device, read once."""
    if device.type != "cuda":
        return 4, False, "cpu"  # interpreter: a few splits so tests exercise the combine step
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICES:
        props = torch.cuda.get_device_properties(idx)
        _DEVICES[idx] = (props.multi_processor_count, props.major >= 9, props.name)
    return _DEVICES[idx]


def _regcap(n: int, interp: bool) -> dict:
    """Launch option capping registers per thread (compiled code only; 0: none)."""
    return {"maxnreg": n} if n and not interp else {}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 / triton.cdiv are @jit functions, slow to call on the host.
    return 1 << max(0, (n - 1).bit_length())


def _splits(s_max: int, rows: int, block_n: int, programs_per_sm: int, sms: int, min_len: int, fill: int,
            resident: int, whole_waves: bool = True, max_waves: int = 4, max_len: int = 0) -> int:
    """Number of splits per row for a cache of ``s_max`` keys.

    Aim for ``programs_per_sm`` programs per SM with splits of at least ``min_len``
    keys (and at most ``max_len``, if given), but never fewer than ``fill`` programs per
    SM while the sequence allows (few rows, i.e. small batch or few KV heads, need short
    splits to fill the chip).
    Grids of at most ``max_waves`` waves (``resident`` programs fit on an SM at once) are
    then sized to a whole number of waves: 1.3 waves of short programs cost about as much as 2.
    ``whole_waves=False`` (the filter and dense passes): the fill rule rounds down, and a
    grid of less than one wave stays as it is.
    The kernels divide each row's valid range into this many splits at run time.
    """
    n_blocks = _cdiv(s_max, block_n)
    want = min(_cdiv(programs_per_sm * sms, rows), _cdiv(s_max, min_len))
    if max_len:
        want = max(want, _cdiv(s_max, max_len))
    want = max(1, want, _cdiv(fill * sms, rows) if whole_waves else (fill * sms) // rows)
    n = min(want, n_blocks)
    slots = resident * sms
    if (whole_waves or rows * n >= slots) and rows * n <= max_waves * slots:
        waves = max(1, round(rows * n / slots))
        n = max(1, min(n_blocks, (waves * slots) // rows))
    return n


def _chunk(want: int, s_max: int, splits: int, runs: int = 1) -> int:
    """Keys per interleaved filter chunk: ``want`` (a power of two), halved until every split
    of a full-length row gets ``runs`` chunks (or chunks reach 8 keys); 0 (contiguous splits)
    where not every split gets one chunk of 8."""
    if want <= 0:
        return 0
    chunk = _pow2(want)
    while chunk > 8 and chunk * splits * runs > s_max:
        chunk //= 2
    return chunk if chunk * splits <= s_max else 0


@functools.lru_cache(maxsize=256)
def _plan(
    B: int, Hq: int, Hkv: int, S: int, D: int, dtype: torch.dtype, sms: int, hopper: bool, interp: bool, cfg: KernelConfig
) -> dict:
    """Launch geometry for one problem shape, computed once (host time matters at decode)."""
    G = Hq // Hkv
    rows = B * Hkv
    # The tuned tiles hold 256-byte rows (D = 128 in 16 bits); wider rows (D = 256, or float32)
    # get proportionally fewer keys per tile, so the pipelined K/V tiles fit in shared memory.
    shrink = max(1, (max(16, _pow2(D)) * dtype.itemsize) // 256)
    gqa = G > 1
    cfg_n2, cfg_nb = (cfg.block_n2_gqa, cfg.block_nb_gqa) if gqa else (cfg.block_n2, cfg.block_nb)
    block_n1, block_n2, block_nd = (max(16, n // shrink) for n in (cfg.block_n1, cfg_n2, cfg.block_nd))
    block_nb = max(16, (cfg_nb or cfg_n2) // shrink)
    stages_b = (cfg.stages_b_gqa if gqa else cfg.stages_b) or cfg.stages2
    ns1 = _splits(S, rows, block_n1, cfg.programs1, sms, cfg.min_split1, cfg.fill, cfg.resident1, max_waves=cfg.waves1)
    persistent = bool(cfg.persist1) and rows >= cfg.persist1_min_rows and (
        rows * ns1 >= cfg.persist1_min_waves * cfg.persist1 * sms)
    programs2 = (cfg.programs2_persist_gqa if persistent else cfg.programs2) if gqa else cfg.programs2_mha
    max_split2 = cfg.max_split2_persist_gqa if gqa and persistent else 0
    ns2 = _splits(S, rows, block_n2, programs2, sms, cfg.min_split2, cfg.fill2, cfg.resident2, cfg.whole_waves2,
                  max_len=max_split2)
    nsd = _splits(S, rows, block_nd, cfg.programsd, sms, cfg.min_splitd, cfg.filld, cfg.residentd, cfg.whole_wavesd,
                  max_waves=cfg.wavesd)
    parallel = (B * Hq <= sms) if cfg.quantile_parallel == "auto" else bool(cfg.quantile_parallel)
    bracket = cfg.quantile_sample > 0
    nq = max(1, min((sms * cfg.quantile_resident) // (B * Hq), S // cfg.min_splitq)) if (
        parallel and bracket and not interp) else 1
    qbits = cfg.quantile_bracket_bits if S >= cfg.quantile_long_row or nq > 1 else cfg.quantile_bracket_bits_short
    return dict(
        B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, G=G, dtype=dtype, use_dot=cfg.use_dot,
        BLOCK_N1=block_n1, BLOCK_N2=block_n2, BLOCK_ND=block_nd, BLOCK_NB=block_nb, STAGES_B=stages_b,
        BLOCK_G=max(16, _pow2(G)) if cfg.use_dot else _pow2(G),
        BLOCK_GA=_pow2(G),
        BLOCK_A=max(cfg.block_a, cfg.scan_elems // _pow2(G)),
        CHUNK2=_chunk(cfg.interleave2, S, ns2, cfg.interleave2_runs),
        BLOCK_D=max(16, _pow2(D)),
        prec="ieee" if dtype == torch.float32 else "tf32",
        upcast=dtype == torch.bfloat16 and interp,
        # The sampled bracket's digit histograms: per row, a slice of 2**bits bins per digit.
        QBITS=qbits, QBRACKET=(-(-32 // qbits) << qbits) if bracket else 0,
        NQ=nq,
        ns1=ns1, BLOCK_S1=_pow2(ns1), ns2=ns2, BLOCK_S2=_pow2(ns2), nsd=nsd, BLOCK_SD=_pow2(nsd),
        # Splits per load in the combine steps: a [CH, G, D] float32 tile of about 4096 elements.
        CH2=max(1, min(_pow2(ns2), 4096 // (_pow2(G) * max(16, _pow2(D))))),
        CHD=max(1, min(_pow2(nsd), 4096 // (_pow2(G) * max(16, _pow2(D))))),
        pdl=cfg.pdl and _HAS_PDL and hopper,
        fused=cfg.fused_combine,
        programs1=cfg.persist1 * sms if persistent else 0,
        # Register caps as launch options, formed once here rather than per launch.
        regs1=_regcap(cfg.maxnreg1, interp), regs2=_regcap(cfg.maxnreg2, interp),
        regsd=_regcap(cfg.maxnregd, interp), regsq=_regcap(cfg.maxnregq, interp),
    )


def anchored_onepass(geo: dict, cfg: KernelConfig) -> bool:
    """Whether ``Sift(normalizer="anchored")`` takes its one-pass kernel on this plan (see KernelConfig)."""
    one = geo["G"] > 1 and geo["B"] * geo["Hkv"] >= cfg.onepass_min_rows and geo["S"] >= cfg.onepass_min_len
    return one or not geo["fused"]  # the two-pass form writes the gap in the fused combine


def geometry(B: int, Hq: int, Hkv: int, S: int, D: int, dtype: torch.dtype, device: torch.device, cfg: KernelConfig) -> dict:
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    sms, hopper, _ = _device_info(device)
    return _plan(B, Hq, Hkv, S, D, dtype, sms, hopper, interp, cfg)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _split_span(begin, end, split, NUM_SPLITS, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """One filter split's keys as ``n`` virtual positions u, at ``base + (u // CHUNK) * stride + u % CHUNK``.

    Returns (lo, n, base, stride, hi): ``lo`` is where the split's compacted lists start
    (at most ``n`` entries; the splits' lists tile [begin, end) without overlap) and every
    key position is below ``hi``. CHUNK = 0: one contiguous range [lo, lo + n). CHUNK > 0:
    the chunks c0, c0 + NUM_SPLITS, ... of CHUNK keys; the last (partial) chunk goes to the
    last split, so every list ends by ``end``.
    """
    if CHUNK == 0:
        lo, hi = _split_range(begin, end, split, NUM_SPLITS, BLOCK)
        return lo, tl.maximum(hi - lo, 0), lo, lo * 0, hi
    else:
        n_chunks = tl.cdiv(tl.maximum(end - begin, 0), CHUNK)
        q = n_chunks // NUM_SPLITS
        r = n_chunks % NUM_SPLITS
        first = NUM_SPLITS - r  # splits from here on own one chunk more
        count = q + (split >= first).to(tl.int32)
        lo = begin + (split * q + tl.maximum(split - first, 0)) * CHUNK
        c0 = (n_chunks + split) % NUM_SPLITS
        return lo, count * CHUNK, begin + c0 * CHUNK, begin * 0 + NUM_SPLITS * CHUNK, end


@triton.jit
def _split_pos(u, base, stride, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Key positions of the virtual positions ``u``, a tile of TILE starting at a multiple of min(TILE, CHUNK)."""
    if CHUNK == 0:
        return base + u
    else:
        pos = base + (u // CHUNK) * stride + u % CHUNK
        return tl.max_contiguous(pos, CHUNK if CHUNK < TILE else TILE)


@triton.jit
def _group_query(Q, b, hkv, stride_qb, stride_qh, stride_qd, HQ: tl.constexpr, G: tl.constexpr,
                 BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The query rows of one (batch, KV head)'s group on a BLOCK_G x BLOCK_D tile (padding 0),
    their (batch, query head) row indices and the head and feature masks."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    h = hkv * G + offs_g
    row = b.to(tl.int64) * HQ + h
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    return q, row, g_mask, d_mask


@triton.jit
def _stored_run(s_base, lo, hi, g_mask, BLOCK: tl.constexpr):
    """Max and sum of exp2 over the stored scores of keys [lo, hi) (at most BLOCK keys), one load;
    (-inf, 0) for an empty run."""
    o = lo + tl.arange(0, BLOCK)
    s = tl.load(s_base + o[None, :], mask=g_mask[:, None] & (o < hi)[None, :], other=float("-inf"))
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.math.exp2(s - m_safe[:, None]), axis=1)


@triton.jit
def _anchor_stats(s_base, first_hi, last_lo, lo, hi, mask, FIRST: tl.constexpr, LAST: tl.constexpr,
                  BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr):
    """(max, sum of exp2) of the stored scores of the anchor keys within [lo, hi): the first
    run ends at ``first_hi``, the newest starts at ``last_lo``; (-inf, 0) where there is none."""
    m_a = tl.full(mask.shape, float("-inf"), tl.float32)
    l_a = tl.zeros(mask.shape, tl.float32)
    if FIRST > 0:
        m_a, l_a = _stored_run(s_base, lo, tl.minimum(hi, first_hi), mask, BLOCK_F)
    if LAST > 0:
        m2, l2 = _stored_run(s_base, tl.maximum(lo, last_lo), hi, mask, BLOCK_L)
        m_new = tl.maximum(m_a, m2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_a = l_a * tl.math.exp2(m_a - m_safe) + l2 * tl.math.exp2(m2 - m_safe)
        m_a = m_new
    return m_a, l_a


@triton.jit
def _score_split(
    split, bh,
    Q, K, Scores, Mst, Lst, Ast, Mas, Las, SeqLens, Starts, Arrive,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    qk_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    PDL: tl.constexpr, EVICT: tl.constexpr,
    ANCHORED: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """One split of one (batch, KV head) of pass 1 (see ``_scores_kernel``)."""
    b = bh // HKV
    hkv = bh % HKV
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    # row: the (batch, query head) row index into Scores / stats
    q, row, g_mask, d_mask = _group_query(Q, b, hkv, stride_qb, stride_qh, stride_qd, HQ, G, BLOCK_G, D, BLOCK_D)
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    lo, hi = _split_range(begin, end, split, NUM_SPLITS, BLOCK_N)

    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    s_base = Scores + row[:, None] * S_MAX
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    a_i = tl.zeros([BLOCK_G], tl.int32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        n_mask = offs < hi
        k = tl.load(
            k_base + offs[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
            mask=n_mask[:, None] & d_mask[None, :], other=0.0,
            eviction_policy="evict_first" if EVICT else "",
        )
        if USE_DOT:
            s = _dot(q, tl.trans(k), DOT_PREC, DOT_UPCAST)
        else:
            s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        # Scale after the fp32 dot: rounding a pre-scaled q to fp16 would cost accuracy.
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        tl.store(s_base + offs[None, :], s, mask=g_mask[:, None] & n_mask[None, :],
                 eviction_policy="evict_last" if EVICT else "")
        m_blk = tl.max(s, axis=1)
        a_blk = tl.argmax(s, axis=1).to(tl.int32) + n0
        a_i = tl.where(m_blk > m_i, a_blk, a_i)  # strict: keeps the first argmax
        m_new = tl.maximum(m_i, m_blk)
        l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new

    st = row * NUM_SPLITS + split
    tl.store(Mst + st, m_i, mask=g_mask)
    tl.store(Lst + st, l_i, mask=g_mask)
    tl.store(Ast + st, a_i, mask=g_mask)
    if ANCHORED:
        m_a = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_a = tl.zeros([BLOCK_G], tl.float32)
        last_lo = tl.maximum(begin + FIRST, end - LAST)
        if (lo < begin + FIRST) | (hi > last_lo):  # only the splits that hold anchors pay for them
            tl.debug_barrier()  # the split's scores, stored by every thread, read back below
            m_a, l_a = _anchor_stats(s_base, begin + FIRST, last_lo, lo, hi, g_mask, FIRST, LAST, BLOCK_F, BLOCK_L)
        tl.store(Mas + st, m_a, mask=g_mask)
        tl.store(Las + st, l_a, mask=g_mask)
    if PDL:
        tl.debug_barrier()  # every thread's scores and stats precede the release below
        tl.atomic_add(Arrive + bh, 1, sem="release", scope="gpu")


@triton.jit
def _scores_kernel(
    Q, K, Scores, Mst, Lst, Ast, Mas, Las, SeqLens, Starts, Arrive,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    qk_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    PDL: tl.constexpr, EVICT: tl.constexpr,
    ANCHORED: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr,
    NUM_ROWS, PERSIST: tl.constexpr,
):
    """Pass 1 over one split of one (batch, KV head): scores and split statistics.

    ANCHORED: also (max, sum of exp2) over the split's anchor keys (the row's first FIRST
    and newest LAST valid keys) into Mas / Las, so the filter pass merges them as it merges
    the split statistics, with no load that waits for the row's length.

    PERSIST: a grid of fewer programs than (split, row) items, each taking every
    num_programs-th item in row order, so that rows finish one after another from the
    start and the filter pass (launched once every program here has started) can filter
    the first rows while the later ones are still scored.
    """
    if PDL:
        # The filter kernel may be dispatched once every program here has started; its
        # programs then wait for their own row's counter (Arrive), not for this grid.
        gdc_launch_dependents()
    # Two call sites rather than one loop for both grids: a one-item loop costs the
    # one-program-per-split grid 1-2% at B = 1 (H200, GQA 32/8, S = 8192: 1.18 -> 1.20x SDPA).
    if PERSIST:
        for item in range(tl.program_id(0), NUM_SPLITS * NUM_ROWS, tl.num_programs(0)):
            _score_split(item % NUM_SPLITS, item // NUM_SPLITS,
                         Q, K, Scores, Mst, Lst, Ast, Mas, Las, SeqLens, Starts, Arrive,
                         stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd, qk_scale, S_MAX,
                         NUM_SPLITS, HQ, HKV, G, BLOCK_G, D, BLOCK_D, BLOCK_N, HAS_SEQ_LENS, HAS_STARTS, USE_DOT, DOT_PREC,
                         DOT_UPCAST, PDL, EVICT, ANCHORED, FIRST, LAST, BLOCK_F, BLOCK_L)
    else:
        _score_split(tl.program_id(0), tl.program_id(1),
                     Q, K, Scores, Mst, Lst, Ast, Mas, Las, SeqLens, Starts, Arrive,
                     stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd, qk_scale, S_MAX,
                     NUM_SPLITS, HQ, HKV, G, BLOCK_G, D, BLOCK_D, BLOCK_N, HAS_SEQ_LENS, HAS_STARTS, USE_DOT, DOT_PREC,
                     DOT_UPCAST, PDL, EVICT, ANCHORED, FIRST, LAST, BLOCK_F, BLOCK_L)


@triton.jit
def _row_stats(Mst, Lst, Ast, row, g_mask, NUM_SPLITS, BLOCK_S: tl.constexpr):
    """Row max M, normaliser L and first argmax from the per-split statistics."""
    m, l, mst, ptr, msk = _row_ml(Mst, Lst, row, g_mask, NUM_SPLITS, BLOCK_S)
    ast = tl.load(Ast + ptr, mask=msk, other=_INT_MAX)
    amax = tl.min(tl.where(mst == m[:, None], ast, _INT_MAX), axis=1)  # splits are in order
    return m, l, amax


@triton.jit
def _thresholds(Mst, Lst, Ast, Eta, Beta, LogSteps, row, b, g_mask, NUM_SPLITS1, BLOCK_S1: tl.constexpr,
                KEEP_ALL: tl.constexpr, POWER_LAW: tl.constexpr):
    """Row max M, normaliser L, log2-domain threshold and argmax per head of the tile.

    POWER_LAW: ``Eta`` holds log alpha, and log2(eta) = (log alpha - beta * log S) * log2(e).
    """
    m, l, amax = _row_stats(Mst, Lst, Ast, row, g_mask, NUM_SPLITS1, BLOCK_S1)
    if KEEP_ALL:
        thr = tl.full(m.shape, float("-inf"), tl.float32)
    else:
        # p > eta  <=>  s2 > M + log2(eta) + log2(L). eta <= 0 (log alpha = -inf: no fit) keeps
        # every key; eta >= 1 keeps none but the maximum (p <= 1), whatever the rounding of
        # log2(L); NaN keeps the maximum only, as p > NaN.
        if POWER_LAW:
            log_alpha = tl.load(Eta + row, mask=g_mask, other=0.0)
            beta = tl.load(Beta + row, mask=g_mask, other=0.0)
            log2_eta = (log_alpha - beta * tl.load(LogSteps + b)) * 1.4426950408889634
            at_least_one = log2_eta >= 0.0
        else:
            eta = tl.load(Eta + row, mask=g_mask, other=1.0)
            log2_eta = tl.where(eta <= 0.0, float("-inf"), tl.math.log2(eta))  # log2 of eta < 0 is NaN
            at_least_one = eta >= 1.0
        thr = tl.where(at_least_one, float("inf"), m + log2_eta + tl.math.log2(l))
    return m, l, thr, amax


@triton.jit
def _anchored_threshold(a2, Gap, LogAlpha, Beta, LogSteps, row, b, g_mask):
    """The anchored normaliser's log2-domain threshold ``A + gap_prev + log(eta)`` per head
    (``a2``: the anchors' log2-sum-exp2 A); a NaN gap or log(eta) = -inf keeps every key,
    log(eta) >= 0 the row maximum only, padded heads nothing. Shared by both anchored steps."""
    log_eta = tl.load(LogAlpha + row, mask=g_mask, other=0.0) - tl.load(Beta + row, mask=g_mask, other=0.0) * \
        tl.load(LogSteps + b)
    gap_prev = tl.load(Gap + row, mask=g_mask, other=0.0)
    thr = a2 + (gap_prev + log_eta) * 1.4426950408889634
    thr = tl.where((gap_prev != gap_prev) | (log_eta == float("-inf")), float("-inf"), thr)
    thr = tl.where(log_eta >= 0.0, float("inf"), thr)
    return tl.where(g_mask, thr, float("inf"))


@triton.jit
def _gap(m, l, a2):
    """The anchored normaliser's gap ``L - A`` in natural log, from the row's log2-domain maximum ``m``,
    sum ``l`` and anchor log-sum-exp ``a2``; 0 on a row without keys (l = 0: all of its keys, none, are anchors)."""
    return tl.where(l > 0.0, (m + tl.math.log2(l) - a2) * 0.6931471805599453, 0.0)


@triton.jit
def _narrow(x, offs_from, offs_to):
    """Re-lay a per-head vector onto another head tile, bit-exactly (one term per sum)."""
    sel = offs_to[:, None] == offs_from[None, :]
    return tl.sum(tl.where(sel, x[None, :], tl.zeros_like(x)[None, :]), axis=1)


@triton.jit
def _accumulate(acc, mass, s, idx, jm, thr, amax, m, g_mask, v_ptrs, vmask, DOT_PREC, DOT_UPCAST, USE_DOT, EVICT):
    """Add the kept keys of one tile (scores s [G, N] at positions idx [N]) to acc / mass."""
    keep = ((s > thr[:, None]) | (idx[None, :] == amax[:, None])) & jm[None, :] & g_mask[:, None]
    w = tl.where(keep, tl.math.exp2(s - m[:, None]), 0.0)
    v = tl.load(v_ptrs, mask=vmask, other=0.0, eviction_policy="evict_first" if EVICT else "")
    if USE_DOT:
        acc += _dot(w.to(v.dtype), v, DOT_PREC, DOT_UPCAST)
    else:
        acc += tl.sum(w[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    return acc, mass + tl.sum(w, axis=1), tl.sum(keep.to(tl.int32), axis=1)


@triton.jit
def _filter_kernel(
    V, Scores, Mst, Lst, Ast, Mas, Las, Eta, Beta, LogSteps, Gap, SeqLens, Starts, Idx, Wc, Part, Cnt, Mass, Sem,
    Arrive, Out, Kept,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh, stride_od,
    S_MAX, NUM_SPLITS1, NUM_SPLITS2,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_NB: tl.constexpr,
    BLOCK_S1: tl.constexpr, CH: tl.constexpr, COMPACT_W: tl.constexpr, STREAM_MASK_V: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KEEP_ALL: tl.constexpr, POWER_LAW: tl.constexpr, COMPACT: tl.constexpr, DENSE_PCT: tl.constexpr,
    STAGES_B: tl.constexpr, FUSED_COMBINE: tl.constexpr, RESET_SYNC: tl.constexpr, RENORMALIZE: tl.constexpr,
    WRITE_KEPT: tl.constexpr, PDL: tl.constexpr, EVICT: tl.constexpr, CHUNK: tl.constexpr,
    ANCHORED: tl.constexpr,
):
    """Pass 2 over one split of one (batch, KV head).

    ANCHORED (``Sift(normalizer="anchored")``; ``Eta`` holds log alpha): the threshold is
    the anchored normaliser's, from the scores pass's anchor statistics and the previous
    gap in ``Gap``, which the row's last program (FUSED_COMBINE) overwrites with this step's.

    Streaming mode reads the split's scores tile by tile and masks the V loads; its
    loop carries a score load -> dependent V load chain, so at high sparsity it is
    latency bound (few useful bytes per iteration). Compact mode first writes the
    positions of the rows some head keeps to ``Idx`` (prefix sum per tile, on a head
    tile of G rows, not the 16 the dot needs), then gathers only those V rows,
    BLOCK_N useful rows per iteration. Rows where every eta <= 0 (nothing to filter)
    and splits kept above DENSE_PCT percent stream.

    With FUSED_COMBINE the last split program of each (batch, KV head) to finish
    (a counter in ``Sem``) sums the split partials and writes the output, which
    saves the separate combine launch.
    """
    split = tl.program_id(0)
    bh = tl.program_id(1)
    if PDL:
        # Launched before the scores kernel ends (every scores program has started, so
        # this wait ends): filter this row as soon as all its splits are in.
        # Poll with plain volatile loads (polling with atomics from hundreds of waiting
        # programs contends in L2 with the scores kernel: GQA 2-3% slower), then acquire
        # once so that the row's scores and statistics are visible below.
        arrived = tl.load(Arrive + bh, volatile=True)
        while arrived < NUM_SPLITS1:
            arrived = tl.load(Arrive + bh, volatile=True)
        tl.atomic_add(Arrive + bh, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
    b = bh // HKV
    hkv = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_nb = tl.arange(0, BLOCK_NB)
    g_mask = offs_g < G
    d_mask = offs_d < D
    row = b.to(tl.int64) * HQ + hkv * G + offs_g

    begin, end_row = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    if ANCHORED:
        m, l, amax = _row_stats(Mst, Lst, Ast, row, g_mask, NUM_SPLITS1, BLOCK_S1)
        anc_m, anc_l, _, _, _ = _row_ml(Mas, Las, row, g_mask, NUM_SPLITS1, BLOCK_S1)  # the scores pass's anchor stats
        a2 = anc_m + tl.math.log2(anc_l)
        thr = _anchored_threshold(a2, Gap, Eta, Beta, LogSteps, row, b, g_mask)
    else:
        m, l, thr, amax = _thresholds(Mst, Lst, Ast, Eta, Beta, LogSteps, row, b, g_mask, NUM_SPLITS1, BLOCK_S1,
                                      KEEP_ALL, POWER_LAW)
    start, n_virt, base, stride, end = _split_span(begin, end_row, split, NUM_SPLITS2, BLOCK_N, CHUNK)

    v_base = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    s_base = Scores + row[:, None] * S_MAX
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    mass = tl.zeros([BLOCK_G], tl.float32)
    pst = row * NUM_SPLITS2 + split
    dense = True
    if COMPACT:
        dense = tl.max(tl.where(g_mask, thr, float("-inf")), axis=0) == float("-inf")
        if not dense:
            # Phase A: positions of the rows that some head of the group keeps, in order.
            offs_ga = tl.arange(0, BLOCK_GA)
            ga_mask = offs_ga < G
            row_a = b.to(tl.int64) * HQ + hkv * G + offs_ga
            # The scan's head tile has G rows (the dot's has >= 16): same decisions, exactly.
            thr_a = _narrow(thr, offs_g, offs_ga)
            amax_a = _narrow(amax, offs_g, offs_ga)
            sa_base = Scores + row_a[:, None] * S_MAX
            idx_ptr = Idx + bh.to(tl.int64) * S_MAX + start
            offs_a = tl.arange(0, BLOCK_A)
            cnt_a = tl.zeros([BLOCK_GA], tl.int32)
            n_kept = start * 0
            if COMPACT_W:
                m_a = _narrow(m, offs_g, offs_ga)
                mass_a = tl.zeros([BLOCK_GA], tl.float32)
                wa_base = Wc + row_a[:, None] * S_MAX + start
            # Not software-pipelined: prefetching the score tiles made GQA ~5% slower.
            for u0 in tl.range(0, n_virt, BLOCK_A, num_stages=1):
                offs = _split_pos(u0 + offs_a, base, stride, CHUNK, BLOCK_A)
                n_mask = (u0 + offs_a < n_virt) & (offs < end)
                s = tl.load(sa_base + offs[None, :], mask=ga_mask[:, None] & n_mask[None, :], other=float("-inf"))
                keep = ((s > thr_a[:, None]) | (offs[None, :] == amax_a[:, None])) & n_mask[None, :] & ga_mask[:, None]
                cnt_a += tl.sum(keep.to(tl.int32), axis=1)
                rk = tl.max(keep.to(tl.int32), axis=0)
                pos = tl.cumsum(rk, axis=0) - rk
                tl.store(idx_ptr + n_kept + pos, offs, mask=rk > 0)
                if COMPACT_W:
                    # The kept weights of every head of the group, compacted like the positions:
                    # phase B then reads them directly (one indirection, the V rows, per tile).
                    w_a = tl.where(keep, tl.math.exp2(s - m_a[:, None]), 0.0)
                    mass_a += tl.sum(w_a, axis=1)
                    tl.store(wa_base + (n_kept + pos)[None, :], w_a.to(Wc.dtype.element_ty),
                             mask=ga_mask[:, None] & (rk > 0)[None, :])
                n_kept += tl.sum(rk, axis=0)
            tl.debug_barrier()  # Idx (and Wc) written by this program's threads, read back below
            dense = n_kept * 100 > n_virt * DENSE_PCT
            if not dense:
                # Phase B: gather the kept rows, all useful, BLOCK_N per iteration.
                if COMPACT_W:
                    w_base = Wc + row[:, None] * S_MAX + start
                    for j in tl.range(0, n_kept, BLOCK_NB, num_stages=STAGES_B):
                        jj = j + offs_nb
                        jm = jj < n_kept
                        idx = tl.load(idx_ptr + jj, mask=jm, other=0)
                        w = tl.load(w_base + jj[None, :], mask=g_mask[:, None] & jm[None, :], other=0.0)
                        v = tl.load(v_base + idx[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd,
                                    mask=jm[:, None] & d_mask[None, :], other=0.0,
                                    eviction_policy="evict_first" if EVICT else "")
                        acc += _dot(w, v, DOT_PREC, DOT_UPCAST)
                    mass = _narrow(mass_a, offs_ga, offs_g)
                else:
                    for j in tl.range(0, n_kept, BLOCK_N, num_stages=STAGES_B):
                        jj = j + offs_n
                        jm = jj < n_kept
                        idx = tl.load(idx_ptr + jj, mask=jm, other=0)
                        s = tl.load(s_base + idx[None, :], mask=g_mask[:, None] & jm[None, :], other=float("-inf"))
                        v_ptrs = v_base + idx[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd
                        acc, mass, _ = _accumulate(
                            acc, mass, s, idx, jm, thr, amax, m, g_mask, v_ptrs, jm[:, None] & d_mask[None, :],
                            DOT_PREC, DOT_UPCAST, USE_DOT, EVICT,
                        )
                tl.store(Cnt + row_a * NUM_SPLITS2 + split, cnt_a, mask=ga_mask)
    if dense:
        # Streaming: every tile, V loads masked to the rows some head keeps.
        cnt = tl.zeros([BLOCK_G], tl.int32)
        for u0 in range(0, n_virt, BLOCK_N):
            offs = _split_pos(u0 + offs_n, base, stride, CHUNK, BLOCK_N)
            n_mask = (u0 + offs_n < n_virt) & (offs < end)
            s = tl.load(s_base + offs[None, :], mask=g_mask[:, None] & n_mask[None, :], other=float("-inf"))
            v_ptrs = v_base + offs[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd
            if STREAM_MASK_V:
                # Only the rows some head keeps (the V load then waits for the score load).
                row_kept = tl.max(((s > thr[:, None]) | (offs[None, :] == amax[:, None])).to(tl.int32), axis=0) > 0
                v_mask = (row_kept & n_mask)[:, None] & d_mask[None, :]
            else:
                # Every row of the tile: streaming runs where most rows are kept, and a V load
                # that does not wait for the scores keeps the loop pipelined.
                v_mask = n_mask[:, None] & d_mask[None, :]
            acc, mass, c = _accumulate(
                acc, mass, s, offs, n_mask, thr, amax, m, g_mask, v_ptrs, v_mask, DOT_PREC, DOT_UPCAST, USE_DOT, EVICT,
            )
            cnt += c
        tl.store(Cnt + pst, cnt, mask=g_mask)

    inv_l = tl.where(l > 0.0, 1.0 / l, 0.0)  # a row without keys (l = 0) contributes zeros
    tl.store(Part + pst[:, None] * BLOCK_D + offs_d[None, :], acc * inv_l[:, None], mask=g_mask[:, None])
    tl.store(Mass + pst, mass * inv_l, mask=g_mask)
    if FUSED_COMBINE:
        tl.debug_barrier()  # every thread's partial stores precede the release below
        done = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS2 - 1:
            if RESET_SYNC:
                # Every program of this row has passed its wait and its count: zero both
                # counters for the next call (saves a memset launch per call).
                tl.store(Sem + bh, 0)
                tl.store(Arrive + bh, 0)
            # Sum the split partials on a G-row head tile, CH splits per load (one dependent
            # load per split would serialise ~0.5 us each: most of the tail at small B).
            offs_ga = tl.arange(0, BLOCK_GA)
            ga_mask = offs_ga < G
            row_c = b.to(tl.int64) * HQ + hkv * G + offs_ga
            offs_c = tl.arange(0, CH)
            tot = tl.zeros([BLOCK_GA, BLOCK_D], tl.float32)
            tot_mass = tl.zeros([BLOCK_GA], tl.float32)
            kept = tl.zeros([BLOCK_GA], tl.int32)
            for j0 in range(0, NUM_SPLITS2, CH):
                js = j0 + offs_c
                pj = row_c[None, :] * NUM_SPLITS2 + js[:, None]  # [CH, GA]
                m2 = (js < NUM_SPLITS2)[:, None] & ga_mask[None, :]
                tot += tl.sum(tl.load(Part + pj[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=m2[:, :, None],
                                      other=0.0, cache_modifier=".cg"), axis=0)
                tot_mass += tl.sum(tl.load(Mass + pj, mask=m2, other=0.0, cache_modifier=".cg"), axis=0)
                kept += tl.sum(tl.load(Cnt + pj, mask=m2, other=0, cache_modifier=".cg"), axis=0)
            if RENORMALIZE:  # the kept mass is 0 only on a row without keys, whose output stays 0
                tot = tot / tl.where(ga_mask & (tot_mass > 0.0), tot_mass, 1.0)[:, None]
            h = hkv * G + offs_ga
            tl.store(
                Out + b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
                tot.to(Out.dtype.element_ty), mask=ga_mask[:, None] & d_mask[None, :],
            )
            if WRITE_KEPT:
                tl.store(Kept + row_c, kept, mask=ga_mask)
            if ANCHORED:  # every program of the row read the previous gap before it arrived
                tl.store(Gap + row, _gap(m, l, a2), mask=g_mask)


@triton.jit
def _combine_kernel(
    Part, Cnt, Mass, Out, Kept,
    stride_ob, stride_oh, stride_od,
    NUM_SPLITS2,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S2: tl.constexpr,
    RENORMALIZE: tl.constexpr, WRITE_KEPT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // HQ
    h = row % HQ
    offs_s = tl.arange(0, BLOCK_S2)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS2
    part = tl.load(
        Part + (row * NUM_SPLITS2 + offs_s[:, None]) * BLOCK_D + offs_d[None, :],
        mask=s_mask[:, None], other=0.0,
    )
    out = tl.sum(part, axis=0)
    if RENORMALIZE:  # the kept mass is 0 only on a row without keys, whose output stays 0
        mass = tl.sum(tl.load(Mass + row * NUM_SPLITS2 + offs_s, mask=s_mask, other=0.0), axis=0)
        out = out / tl.where(mass > 0.0, mass, 1.0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d * stride_od,
        out.to(Out.dtype.element_ty), mask=offs_d < D,
    )
    if WRITE_KEPT:
        kept = tl.sum(tl.load(Cnt + row * NUM_SPLITS2 + offs_s, mask=s_mask, other=0), axis=0)
        tl.store(Kept + row, kept)


@triton.jit
def _merge_chunk(Part, Mp, Lp, row_c, j0, m, l, tot, ga_mask, offs_d, NUM_SPLITS, BLOCK_D: tl.constexpr,
                 CH: tl.constexpr):
    """Fold splits [j0, j0 + CH) of the head rows ``row_c`` into the running (max, sum, output).

    Returns the chunk's [CH, GA] partial indices and mask, the new (m, l, tot), and the
    rescale of the old sums (alpha) and the splits' weights (w), for callers that merge more
    per-split sums the same way.
    """
    js = j0 + tl.arange(0, CH)
    pj = row_c[None, :] * NUM_SPLITS + js[:, None]  # [CH, GA]
    m2 = (js < NUM_SPLITS)[:, None] & ga_mask[None, :]
    mj = tl.load(Mp + pj, mask=m2, other=float("-inf"), cache_modifier=".cg")
    lj = tl.load(Lp + pj, mask=m2, other=0.0, cache_modifier=".cg")
    part = tl.load(Part + pj[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=m2[:, :, None], other=0.0,
                   cache_modifier=".cg")
    m_new = tl.maximum(m, tl.max(mj, axis=0))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.where(m > float("-inf"), tl.math.exp2(m - m_ref), 0.0)
    w = tl.where(mj > float("-inf"), tl.math.exp2(mj - m_ref[None, :]), 0.0)  # empty splits weigh 0
    l = l * alpha + tl.sum(w * lj, axis=0)
    tot = tot * alpha[:, None] + tl.sum(w[:, :, None] * part, axis=0)
    return pj, m2, m_new, l, tot, alpha, w


@triton.jit
def _merge_splits(Part, Mp, Lp, Out, b, hkv, stride_ob, stride_oh, stride_od, NUM_SPLITS,
                  HQ: tl.constexpr, G: tl.constexpr, BLOCK_GA: tl.constexpr, BLOCK_D: tl.constexpr,
                  CH: tl.constexpr, d_mask):
    """Flash-decoding's combine: merge one (batch, KV head)'s split partials (unnormalised
    outputs, maxima and sums, log2 domain) into the output, on a G-row head tile, CH splits per load."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_ga = tl.arange(0, BLOCK_GA)
    ga_mask = offs_ga < G
    row_c = b.to(tl.int64) * HQ + hkv * G + offs_ga
    m = tl.full([BLOCK_GA], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_GA], tl.float32)
    tot = tl.zeros([BLOCK_GA, BLOCK_D], tl.float32)
    for j0 in range(0, NUM_SPLITS, CH):
        _, _, m, l, tot, _, _ = _merge_chunk(Part, Mp, Lp, row_c, j0, m, l, tot, ga_mask, offs_d, NUM_SPLITS,
                                             BLOCK_D, CH)
    l = tl.where(ga_mask & (l > 0.0), l, 1.0)  # a row without keys: tot = 0, output 0
    h_c = hkv * G + offs_ga
    tl.store(
        Out + b.to(tl.int64) * stride_ob + h_c[:, None] * stride_oh + offs_d[None, :] * stride_od,
        (tot / l[:, None]).to(Out.dtype.element_ty), mask=ga_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _dense_kernel(
    Q, K, V, SeqLens, Starts, Part, Mp, Lp, Sem, Out, Scores,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_od,
    qk_scale, S_MAX, NUM_SPLITS,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GA: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, EVICT: tl.constexpr, STORE_SCORES: tl.constexpr,
):
    """Exact attention (flash-decoding): one split of one (batch, KV head), all heads of the group.

    One pass over the split's K and V with an online softmax (log2 domain); the split
    writes its unnormalised partial output, max and sum, and the last split program of
    the row (a counter in ``Sem``, zeroed again by it) merges them. With STORE_SCORES
    it also stores the log2-domain scores (the warmup's quantile reads them and the
    per-split max and sum).
    """
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q, row, g_mask, d_mask = _group_query(Q, b, hkv, stride_qb, stride_qh, stride_qd, HQ, G, BLOCK_G, D, BLOCK_D)
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    lo, hi = _split_range(begin, end, split, NUM_SPLITS, BLOCK_N)
    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    s_base = Scores + row[:, None] * S_MAX
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + offs_n
        n_mask = offs < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0, eviction_policy="evict_first" if EVICT else "")
        s = _dot(q, tl.trans(k), DOT_PREC, DOT_UPCAST)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        if STORE_SCORES:
            tl.store(s_base + offs[None, :], s, mask=g_mask[:, None] & n_mask[None, :],
                     eviction_policy="evict_last" if EVICT else "")
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        v = tl.load(v_base + offs[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0, eviction_policy="evict_first" if EVICT else "")
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, DOT_UPCAST)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    pst = row * NUM_SPLITS + split
    tl.store(Part + pst[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(Mp + pst, m_i, mask=g_mask)
    tl.store(Lp + pst, l_i, mask=g_mask)
    tl.debug_barrier()  # every thread's partial stores precede the release below
    done = tl.atomic_add(Sem + bh, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        tl.store(Sem + bh, 0)  # ready for the next call
        _merge_splits(Part, Mp, Lp, Out, b, hkv, stride_ob, stride_oh, stride_od, NUM_SPLITS,
                      HQ, G, BLOCK_GA, BLOCK_D, CH, d_mask)


# --------------------------------------------------------------------------- workspace


@triton.jit
def _warmup_gap_kernel(Scores, Mst, Lst, SeqLens, Starts, Gap, S_MAX, NUM_SPLITS,
                       HQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                       FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr,
                       HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """One batch row's gaps ``L - A`` (natural log) from an exact step's stored scores and split statistics."""
    b = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < HQ
    row = b.to(tl.int64) * HQ + offs_h
    m, l, _, _, _ = _row_ml(Mst, Lst, row, h_mask, NUM_SPLITS, BLOCK_S)
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    m_a, l_a = _anchor_stats(Scores + row[:, None] * S_MAX, begin + FIRST, tl.maximum(begin + FIRST, end - LAST),
                             begin, end, h_mask, FIRST, LAST, BLOCK_F, BLOCK_L)
    gap = (m + tl.math.log2(l) - m_a - tl.math.log2(l_a)) * 0.6931471805599453
    tl.store(Gap + row, tl.where(l > 0.0, gap, 0.0), mask=h_mask)  # no keys: 0, as _gap


class Workspace:
    """Every buffer the kernels write besides their outputs, for one launch geometry.

    ``sync`` holds three rows of per-(batch, KV head) counters: finished filter splits,
    arrived score splits, finished dense splits. They start at zero and the last program
    of each row sets them back to zero, so calls need no memset. Calls that share a
    workspace must run one after another (one stream, or a CUDA graph captured on one
    stream): the next call's first kernel starts only when the previous call's kernels
    have finished.
    """

    def __init__(self, geo: dict, device: torch.device, sync: torch.Tensor | None = None, dense_only: bool = False):
        B, Hq, Hkv, S = geo["B"], geo["Hq"], geo["Hkv"], geo["S"]
        f32, i32 = torch.float32, torch.int32
        self.sync = sync if sync is not None else torch.zeros(3, B * Hkv, device=device, dtype=i32)
        self.sem, self.arrive, self.dense_sem = self.sync
        if not dense_only:
            self.scores = torch.empty(B, Hq, S, device=device, dtype=f32)
            self.mst = torch.empty(B, Hq, geo["ns1"], device=device, dtype=f32)
            self.lst = torch.empty(B, Hq, geo["ns1"], device=device, dtype=f32)
            self.ast = torch.empty(B, Hq, geo["ns1"], device=device, dtype=i32)
            self.mas = torch.empty(B, Hq, geo["ns1"], device=device, dtype=f32)  # anchored: anchor statistics
            self.las = torch.empty(B, Hq, geo["ns1"], device=device, dtype=f32)
            self.idx = torch.empty(B * Hkv, S, device=device, dtype=i32)
            self.wc = torch.empty(B * Hq, S, device=device, dtype=geo["dtype"])  # compacted kept weights
            self.part = torch.empty(B, Hq, geo["ns2"], geo["BLOCK_D"], device=device, dtype=f32)
            self.cnt = torch.empty(B, Hq, geo["ns2"], device=device, dtype=i32)
            self.mass = torch.empty(B, Hq, geo["ns2"], device=device, dtype=f32)
        if not dense_only:
            # Per (batch, query head), set back by the quantile kernel for the next call: the full
            # radix select's 4 digit histograms, the sampled bracket's digit histograms, and
            # for rows cut into chunks the least key past the last bucket, the arrivals and
            # the keys below the bracket.
            self.qhist = torch.zeros(B * Hq, 4, 256, device=device, dtype=i32)
            self.qbracket = torch.zeros(B * Hq, geo["QBRACKET"], device=device, dtype=i32)
            self.qnext = torch.full((B * Hq,), 2**31 - 1, device=device, dtype=i32)
            self.qsync = torch.zeros(B * Hq, 2, device=device, dtype=i32)
        self.dpart = torch.empty(B, Hq, geo["nsd"], geo["BLOCK_D"], device=device, dtype=f32)
        self.dm = torch.empty(B, Hq, geo["nsd"], device=device, dtype=f32)
        self.dl = torch.empty(B, Hq, geo["nsd"], device=device, dtype=f32)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor) and t._base is None)


_SYNC: dict[tuple, torch.Tensor] = {}


def stream_counters(dev: torch.device, rows: int) -> torch.Tensor:
    """Zeroed [3, rows] int32 counters, one buffer per (device, stream, rows), for the functional API.

    The kernels set them back to zero, so a call needs no memset. Calls on one stream
    run in order; a buffer per stream keeps concurrent streams apart. A CUDA graph keeps
    the buffer of the stream it was captured on: graphs captured on one stream must be
    replayed one at a time.
    """
    key = (dev, torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0, rows)
    buf = _SYNC.get(key)
    if buf is None:
        buf = _SYNC[key] = torch.zeros(3, rows, device=dev, dtype=torch.int32)
    return buf


# --------------------------------------------------------------------------- launchers


def scores_pass(geo: dict, ws: Workspace, q, k_cache, scale: float, seq_lens, starts, cfg: KernelConfig, pdl: bool,
                anchors: tuple[int, int] | None = None) -> None:
    """Pass 1: float32 log2-domain scores and per-split softmax statistics into ``ws``
    (with ``anchors`` (first, last), the anchor keys' statistics too)."""
    first, last = anchors or (0, 0)
    B, Hq, Hkv, S = geo["B"], geo["Hq"], geo["Hkv"], geo["S"]
    has_sl, has_st = seq_lens is not None, starts is not None
    grid = (geo["programs1"],) if geo["programs1"] else (geo["ns1"], B * Hkv)
    launch(_scores_kernel, grid,
        q, k_cache, ws.scores, ws.mst, ws.lst, ws.ast, ws.mas, ws.las,
        seq_lens if has_sl else ws.ast, starts if has_st else ws.ast,
        ws.arrive,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        scale * LOG2E, S, geo["ns1"],
        HQ=Hq, HKV=Hkv, G=geo["G"], BLOCK_G=geo["BLOCK_G"], D=geo["D"], BLOCK_D=geo["BLOCK_D"],
        BLOCK_N=geo["BLOCK_N1"], HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st,
        USE_DOT=geo["use_dot"], DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"],
        PDL=pdl, EVICT=cfg.evict, ANCHORED=anchors is not None, FIRST=first, LAST=last, BLOCK_F=_pow2(first),
        BLOCK_L=_pow2(last), NUM_ROWS=B * Hkv, PERSIST=geo["programs1"] > 0,
        num_warps=cfg.warps1, num_stages=cfg.stages1, **geo["regs1"],
    )


def filter_pass(
    geo: dict, ws: Workspace, v_cache, eta, seq_lens, starts, cfg: KernelConfig, out_dtype: torch.dtype,
    renormalize: bool, want_kept: bool, pdl: bool, anchors: tuple[torch.Tensor, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pass 2: threshold, compaction, V gather and (fused) the output; ``eta`` None keeps every key.

    ``eta``: [B, Hq] probabilities, or a ``PowerLawThreshold`` the kernel evaluates itself.
    ``anchors`` (gap, first, last): the anchored normaliser's threshold (``eta`` a
    ``PowerLawThreshold``); the gap [B, Hq] float32 is overwritten with this step's.
    """
    B, Hq, Hkv, S, D = geo["B"], geo["Hq"], geo["Hkv"], geo["S"], geo["D"]
    power_law = isinstance(eta, PowerLawThreshold)
    if power_law:
        eta_arg, beta_arg, log_steps_arg = eta
    else:  # unused pointers get any float32 buffer
        eta_arg, beta_arg, log_steps_arg = (eta if eta is not None else ws.mst), ws.mst, ws.mst
    dev = v_cache.device
    compact = cfg.compact and eta is not None
    fused = geo["fused"]
    out = torch.empty(B, Hq, D, device=dev, dtype=out_dtype)
    kept = torch.empty(B, Hq, device=dev, dtype=torch.int32) if want_kept else None
    has_sl, has_st = seq_lens is not None, starts is not None
    gap = anchors[0] if anchors is not None else ws.mst
    launch(_filter_kernel, (geo["ns2"], B * Hkv),
        v_cache, ws.scores, ws.mst, ws.lst, ws.ast, ws.mas, ws.las, eta_arg, beta_arg, log_steps_arg, gap,
        seq_lens if has_sl else ws.ast, starts if has_st else ws.ast,
        ws.idx, ws.wc, ws.part, ws.cnt, ws.mass, ws.sem, ws.arrive,
        out, kept if kept is not None else ws.cnt,
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        S, geo["ns1"], geo["ns2"],
        HQ=Hq, HKV=Hkv, G=geo["G"], BLOCK_G=geo["BLOCK_G"], BLOCK_GA=geo["BLOCK_GA"], D=D, BLOCK_D=geo["BLOCK_D"],
        BLOCK_N=geo["BLOCK_N2"], BLOCK_A=geo["BLOCK_A"], BLOCK_NB=geo["BLOCK_NB"], BLOCK_S1=geo["BLOCK_S1"], CH=geo["CH2"],
        COMPACT_W=cfg.compact_weights and geo["use_dot"], STREAM_MASK_V=cfg.stream_mask_v,
        HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st,
        USE_DOT=geo["use_dot"], DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"], KEEP_ALL=eta is None,
        POWER_LAW=power_law, COMPACT=compact, DENSE_PCT=cfg.dense_pct, STAGES_B=geo["STAGES_B"],
        FUSED_COMBINE=fused, RESET_SYNC=fused, RENORMALIZE=renormalize, WRITE_KEPT=want_kept,
        PDL=pdl, EVICT=cfg.evict, CHUNK=geo["CHUNK2"], ANCHORED=anchors is not None,
        num_warps=cfg.warps2, num_stages=cfg.stages2, **geo["regs2"], **({"launch_pdl": True} if pdl else {}),
    )
    if not fused:
        launch(_combine_kernel, (B * Hq,),
            ws.part, ws.cnt, ws.mass, out, kept if kept is not None else ws.cnt,
            out.stride(0), out.stride(1), out.stride(2), geo["ns2"],
            HQ=Hq, D=D, BLOCK_D=geo["BLOCK_D"], BLOCK_S2=geo["BLOCK_S2"],
            RENORMALIZE=renormalize, WRITE_KEPT=want_kept, num_warps=4,
        )
        ws.sync[:2].zero_()  # no fused reduction to zero them (a test and tuning mode only)
    return out, kept


def _filter_or_reset(geo: dict, ws: Workspace, *args, **kwargs):
    """filter_pass; if it fails to launch, zero the counters the scores pass advanced."""
    try:
        return filter_pass(geo, ws, *args, **kwargs)
    except BaseException:
        ws.sync[:2].zero_()
        raise


def sparse(geo: dict, ws: Workspace, q, k_cache, v_cache, eta, scale: float, seq_lens, starts, renormalize: bool,
           cfg: KernelConfig, anchors: tuple[torch.Tensor, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sift decode step on prepared inputs: (out, kept). ``anchors``: see ``filter_pass``."""
    if anchors is not None and not (geo["fused"] and isinstance(eta, PowerLawThreshold)):
        raise ValueError("the anchored two-pass step needs fused_combine and a PowerLawThreshold")
    pdl = geo["pdl"]
    scores_pass(geo, ws, q, k_cache, scale, seq_lens, starts, cfg, pdl, None if anchors is None else anchors[1:])
    out, kept = _filter_or_reset(geo, ws, v_cache, eta, seq_lens, starts, cfg, q.dtype, renormalize, True, pdl,
                                 anchors)
    return out, kept


def warmup(geo: dict, ws: Workspace, q, k_cache, v_cache, tau, scale: float, seq_lens, starts,
           cfg: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact output plus theta; ``tau`` is a float64 [B, Hq] tensor."""
    if cfg.warmup_dense:
        out = dense(geo, ws, q, k_cache, v_cache, scale, seq_lens, starts, cfg, store_scores=True)
        return out, quantile_pass(geo, ws, tau, seq_lens, starts, cfg, from_dense=True)
    pdl = geo["pdl"]
    scores_pass(geo, ws, q, k_cache, scale, seq_lens, starts, cfg, pdl)
    try:
        theta = quantile_pass(geo, ws, tau, seq_lens, starts, cfg)
    except BaseException:
        ws.sync[:2].zero_()
        raise
    out, _ = _filter_or_reset(geo, ws, v_cache, None, seq_lens, starts, cfg, q.dtype, False, False, pdl)
    return out, theta


def warmup_gap(geo: dict, ws: Workspace, seq_lens, starts, first: int, last: int, cfg: KernelConfig) -> torch.Tensor:
    """The anchored normaliser's gap [B, Hq] of the warmup step just run on ``ws``: its exact
    log-sum-exp (from the split statistics) minus that of its anchor keys (read from the
    stored scores), in natural log. One small launch."""
    B, Hq = geo["B"], geo["Hq"]
    mst, lst, ns = (ws.dm, ws.dl, geo["nsd"]) if cfg.warmup_dense else (ws.mst, ws.lst, geo["ns1"])
    gap = torch.empty(B, Hq, device=ws.scores.device, dtype=torch.float32)
    has_sl, has_st = seq_lens is not None, starts is not None
    launch(_warmup_gap_kernel, (B,),
        ws.scores, mst, lst, seq_lens if has_sl else gap, starts if has_st else gap, gap, geo["S"], ns,
        HQ=Hq, BLOCK_H=_pow2(Hq), BLOCK_S=_pow2(ns), FIRST=first, LAST=last, BLOCK_F=_pow2(first),
        BLOCK_L=_pow2(last), HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st, num_warps=4,
    )
    return gap


def dense(geo: dict, ws: Workspace, q, k_cache, v_cache, scale: float, seq_lens, starts, cfg: KernelConfig,
          store_scores: bool = False) -> torch.Tensor:
    """Exact attention over the valid keys (flash-decoding split-K); optionally stores the scores."""
    B, Hq, Hkv, D = geo["B"], geo["Hq"], geo["Hkv"], geo["D"]
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    has_sl, has_st = seq_lens is not None, starts is not None
    launch(_dense_kernel, (geo["nsd"], B * Hkv),
        q, k_cache, v_cache, seq_lens if has_sl else ws.dm, starts if has_st else ws.dm,
        ws.dpart, ws.dm, ws.dl, ws.dense_sem, out, ws.scores if store_scores else ws.dm,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        scale * LOG2E, geo["S"], geo["nsd"],
        HQ=Hq, HKV=Hkv, G=geo["G"], BLOCK_G=max(16, geo["BLOCK_GA"]), BLOCK_GA=geo["BLOCK_GA"], D=D,
        BLOCK_D=geo["BLOCK_D"], BLOCK_N=geo["BLOCK_ND"], CH=geo["CHD"], HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st,
        DOT_PREC=geo["prec"], DOT_UPCAST=geo["upcast"], EVICT=cfg.evict, STORE_SCORES=store_scores,
        num_warps=cfg.warpsd, num_stages=cfg.stagesd, **geo["regsd"],
    )
    return out


# --------------------------------------------------------------------------- functional entry points


def _functional_setup(q, k_cache, cfg: KernelConfig | None, dense_only: bool = False):
    cfg = cfg or config_for(q.device)
    B, Hq, D = q.shape
    geo = geometry(B, Hq, k_cache.shape[1], k_cache.shape[2], D, q.dtype, q.device, cfg)
    sync = stream_counters(q.device, B * k_cache.shape[1]) if cfg.reuse_sync and geo["fused"] else None
    return cfg, geo, Workspace(geo, q.device, sync, dense_only)


def sift_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eta: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    renormalize: bool,
    cfg: KernelConfig | None = None,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs already validated by :func:`siftattention.kernels.sift_decode`."""
    cfg, geo, ws = _functional_setup(q, k_cache, cfg)
    return sparse(geo, ws, q, k_cache, v_cache, eta, scale, seq_lens, starts, renormalize, cfg)


def sift_warmup_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tau: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    cfg: KernelConfig | None = None,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact output plus theta; ``tau`` is a float64 [B, Hq] tensor."""
    cfg, geo, ws = _functional_setup(q, k_cache, cfg)
    return warmup(geo, ws, q, k_cache, v_cache, tau, scale, seq_lens, starts, cfg)


def dense_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    seq_lens: torch.Tensor | None,
    cfg: KernelConfig | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the valid keys, flash-decoding split-K."""
    cfg, geo, ws = _functional_setup(q, k_cache, cfg, dense_only=True)
    return dense(geo, ws, q, k_cache, v_cache, scale, seq_lens, starts, cfg)


__all__ = [
    "KernelConfig", "Workspace", "config_for", "geometry", "sparse", "dense", "warmup",
    "sift_decode_triton", "sift_warmup_decode_triton", "dense_decode_triton", "LOG2E",
]
