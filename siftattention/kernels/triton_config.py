"""Launch parameters, launch geometry and scratch buffers of the Triton decode kernels.

``KernelConfig`` holds the tuned launch parameters (``config_for`` picks a device's);
``geometry`` turns a problem shape into the tile sizes and split counts of every pass,
computed once per shape; ``Workspace`` allocates every buffer the passes write besides
their outputs. The passes (``triton_scores``, ``triton_filter``, ``triton_dense``,
``triton_warmup``, ``triton_quantile``, ``triton_onepass``) import these; none of them
is imported here, so this module is the bottom of the Triton layer.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

LOG2E = 1.4426950408889634
# Programmatic dependent launch (Hopper+): the filter kernel is dispatched while the
# scores kernel drains, and each of its programs waits for its own row only.
try:
    from triton.language.extra.cuda import gdc_launch_dependents  # noqa: F401

    _HAS_PDL = True
except ImportError:  # older Triton
    _HAS_PDL = False


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters; the defaults come from the H200 grids summarised in docs/kernels.md.

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
    # programs 1.45x SDPA, 264 1.17x, 136 1.17x, 128 1.03x; docs/kernels.md).
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
    # Where a KV group has more than 4 query heads the scan tile pads to 8 heads and the filter
    # pass takes 255 registers: 2 programs fit on an SM, not 4, so a grid planned for 4 ran in
    # two waves (ncu, H200, GQA 12/2, B = 16, S = 32768: 512 programs, 1.94 waves, DRAM 43%).
    # Planned as one wave of 2 (with the persistent scores pass): sparse step 1.36 -> 1.22x
    # SDPA at s = 0.875, 1.16 -> 1.07x at 0.95; GQA 32/8 unchanged (tune_grid_filter_wide_h200.json).
    resident2_wide: int = 2
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
    # The compaction scan a key at a time with its heads in one thread (``_scan_packed``; G <= 8):
    # in-thread head bits and vector weight records instead of per-tile reductions and layout
    # conversions through shared memory; 2.1k -> 1.2k instructions a 1024-key tile and 255 ->
    # 206 registers, no spills (GQA 12/2). H100, real Qwen2.5-1.5B decode (compiled, tau 0.875):
    # 16 x 32768 1.111 -> 1.151x dense, 8 x 16384 0.894 -> 0.953x; on SmolLM2 within run-to-run spread.
    scan_packed: bool = True
    scan_stages: int = 2  # the packed scan's score loads prefetched a tile ahead
    scan_elems: int = 2048  # scan tile [G, keys] of at least this many elements (MHA: longer rows)
    dense_pct: int = 85  # stream instead of gather when more than this % of rows is kept
    # Filter pass: each split takes every NUM_SPLITS-th run of this many keys instead of one
    # contiguous range (0), so kept keys that cluster in position (attention sinks, recent
    # tokens, a topic) spread over all of a row's programs instead of lengthening a few.
    # H200, the 8B shape's captured decode calls whose kept rows crowd the first tenth of the
    # positions (one contiguous split gathering 2.5x the mean): filter pass 170 -> 112 us
    # with 256 (128, 512, 1024 gain less); on bench_decode's evenly spread keys it costs
    # 0.5-2.3% at s = 0.875 and 2-8% at s = 0 (benchmarks/studies/replay_decode.py).
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
    # The same for heads of at most 64 channels, whose splits move half the bytes a key: at 4096 keys a
    # split, SmolLM2's 48 rows of 8192 keys made 96 programs for 132 SMs (H100, GQA 9/3, D = 64, ratio
    # to SDPA 4096 -> 1024: B = 16, S = 8192 1.233 -> 1.033; B = 32, S = 4096 1.183 -> 0.966; B = 8,
    # S = 8192 1.187 -> 1.042; B = 4, S = 32768 1.098 -> 1.062; B = 1 unchanged; dense_split_rules_d64*_h100.json).
    min_splitd_narrow: int = 1024
    # Filter and dense grids of heads of at least 128 channels: fewer splits where the last
    # programs would crowd a few SMs. A grid of P programs leaves its busiest SM ceil(P / SMs)
    # of them, each 1/n of a row; where fewer splits cut that by at least a tenth they are
    # taken (H100, planted, ratio to SDPA: GQA 12/2 B = 8, 16640 keys, 9 -> 8 filter splits
    # (144 -> 128 programs) Sift step 1.110 -> 0.992; dense kernel B = 16, 33024 keys 1.157 ->
    # 1.045, B = 32, 8448 keys 1.077 -> 0.986; GQA 32/8 B = 4, 33024 keys 1.101 -> 1.013; GQA
    # 4/1, D = 256 1.000 -> 0.951). The filter only at more than 4 heads a group, whose
    # programs fit 2 a SM (GQA 32/8, B = 8, 8448 keys: 5 -> 4 splits 0.786 -> 0.809); 64-channel
    # heads keep their splits (GQA 9/3, B = 8, 8192 keys: dense 8 -> 5 splits 1.026 -> 1.171;
    # tune_grid_balance_d*_h100.json).
    balance_splits: bool = True
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
    # decode_quick_anchored2_h200.json, decode_anchored_forms_h200.json). At 32 rows the real
    # Qwen2.5-1.5B (GQA 12/2, B = 16, S = 32768, compiled loop, H100) decodes 1.112x dense with
    # the one-pass kernel and 0.973x with the two passes (real_qwen_anchored_*onepass_compile_h100.json);
    # SmolLM2's short caches (S <= 8192) lose with it (0.73x against 1.02x), below onepass_min_len.
    onepass_min_rows: int = 32
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
            resident: int, whole_waves: bool = True, max_waves: int = 4, max_len: int = 0, balance: bool = False) -> int:
    """Number of splits per row for a cache of ``s_max`` keys.

    Aim for ``programs_per_sm`` programs per SM with splits of at least ``min_len``
    keys (and at most ``max_len``, if given), but never fewer than ``fill`` programs per
    SM while the sequence allows (few rows, i.e. small batch or few KV heads, need short
    splits to fill the chip).
    Grids of at most ``max_waves`` waves (``resident`` programs fit on an SM at once) are
    then sized to a whole number of waves: 1.3 waves of short programs cost about as much as 2.
    ``whole_waves=False`` (the filter and dense passes): the fill rule rounds down, and a
    grid of less than one wave stays as it is. ``balance``: then fewer splits where the busiest SM's
    load falls by at least a tenth (``_balanced``).
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
    return _balanced(n, rows, sms) if balance else n


def _balanced(n: int, rows: int, sms: int) -> int:
    """At most ``n`` splits a row, fewer where that cuts the busiest SM's work by at least a tenth.

    ``rows * m`` programs put ``ceil(rows * m / sms)`` on the busiest SM, each a ``1/m`` share of
    a row; the least such load wins (ties: more splits, whose programs hide each other's latency)."""
    def load(m: int) -> float:
        return _cdiv(rows * m, sms) / m

    best = min(range(n, 0, -1), key=load)  # min keeps the first, so the largest m of equal load
    return best if load(best) <= 0.9 * load(n) else n


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
    B: int, Hq: int, Hkv: int, S: int, D: int, dtype: torch.dtype, sms: int, hopper: bool, interp: bool, cfg: KernelConfig,
    span: int | None = None,
) -> dict:
    """Launch geometry for one problem shape, computed once (host time matters at decode).

    ``S``: the cache's positions (scratch is indexed by position); ``span``: the longest valid range a
    call will have (a sliding window), which sizes the splits: a 512-key window cut into a 33k-key
    row's splits leaves each program a few keys while every pass still pays its fixed cost (None: ``S``)."""
    R = min(S, span) if span else S
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
    ns1 = _splits(R, rows, block_n1, cfg.programs1, sms, cfg.min_split1, cfg.fill, cfg.resident1, max_waves=cfg.waves1)
    persistent = bool(cfg.persist1) and rows >= cfg.persist1_min_rows and (
        rows * ns1 >= cfg.persist1_min_waves * cfg.persist1 * sms)
    resident2 = cfg.resident2_wide if G > 4 else cfg.resident2
    programs2 = (min(cfg.programs2_persist_gqa, resident2) if persistent else cfg.programs2) if gqa else cfg.programs2_mha
    max_split2 = cfg.max_split2_persist_gqa if gqa and persistent else 0
    balance = cfg.balance_splits and D >= 128
    ns2 = _splits(R, rows, block_n2, programs2, sms, cfg.min_split2, cfg.fill2, resident2, cfg.whole_waves2,
                  max_len=max_split2, balance=balance and G > 4)
    min_splitd = cfg.min_splitd_narrow if D <= 64 else cfg.min_splitd
    nsd = _splits(R, rows, block_nd, cfg.programsd, sms, min_splitd, cfg.filld, cfg.residentd, cfg.whole_wavesd,
                  max_waves=cfg.wavesd, balance=balance)
    parallel = (B * Hq <= sms) if cfg.quantile_parallel == "auto" else bool(cfg.quantile_parallel)
    bracket = cfg.quantile_sample > 0
    nq = max(1, min((sms * cfg.quantile_resident) // (B * Hq), R // cfg.min_splitq)) if (
        parallel and bracket and not interp) else 1
    qbits = cfg.quantile_bracket_bits if R >= cfg.quantile_long_row or nq > 1 else cfg.quantile_bracket_bits_short
    return dict(
        B=B, Hq=Hq, Hkv=Hkv, S=S, span=R, D=D, G=G, dtype=dtype, use_dot=cfg.use_dot,
        BLOCK_N1=block_n1, BLOCK_N2=block_n2, BLOCK_ND=block_nd, BLOCK_NB=block_nb, STAGES_B=stages_b,
        BLOCK_G=max(16, _pow2(G)) if cfg.use_dot else _pow2(G),
        BLOCK_GA=_pow2(G),
        # Packed: a kept key's word holds its position (< 2**24) and its heads' bits (G <= 8).
        PACKED=cfg.scan_packed and cfg.use_dot and G <= 8 and S < 2**24,
        BLOCK_A=max(cfg.block_a, cfg.scan_elems // _pow2(G)),
        CHUNK2=_chunk(cfg.interleave2, R, ns2, cfg.interleave2_runs),
        BLOCK_D=max(16, _pow2(D)),
        prec="ieee" if dtype == torch.float32 else "tf32",
        upcast=dtype == torch.bfloat16 and interp,
        interp=interp,
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
    one = geo["G"] > 1 and geo["B"] * geo["Hkv"] >= cfg.onepass_min_rows and geo["span"] >= cfg.onepass_min_len
    return one or not geo["fused"]  # the two-pass form writes the gap in the fused combine


def geometry(B: int, Hq: int, Hkv: int, S: int, D: int, dtype: torch.dtype, device: torch.device, cfg: KernelConfig,
             span: int | None = None) -> dict:
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    sms, hopper, _ = _device_info(device)
    return _plan(B, Hq, Hkv, S, D, dtype, sms, hopper, interp, cfg, span)


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
            # Compacted kept weights: [B * Hq, S], or packed [B * Hkv, S, BLOCK_GA] (padded heads' too).
            self.wc = torch.empty(B * Hkv * geo["BLOCK_GA"], S, device=device, dtype=geo["dtype"])
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
