"""The warmup step's exact tau-quantile on the GPU (``quantile_pass``).

After an exact step has stored each row's float32 scores (log2 domain) and its per-split
softmax statistics, ``_quantile_kernel`` finds the tau-quantile of each (batch, query head)
row's probabilities, ``torch.quantile``'s linear rule, without sorting: the k-th smallest score
and the next are selected by radix select over the order-preserving 32-bit image of the scores,
and the probabilities at the two are interpolated (probabilities are monotone in the scores).
A sorted sample of each row brackets the wanted rank, and only the keys inside are selected, 8
or 12 bits a pass, counted with one atomic per key; the full four-digit select runs where the
bracket misses. One program per row, or, when rows are few, each row cut into chunks whose
programs meet at a counter after each digit, in the same launch. The histograms and counters
live in the caller's workspace and are set back to zero by the kernel, so a call needs no memset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .triton_common import _INT_MAX, _row_ml, _row_range, _split_range, launch

if TYPE_CHECKING:
    from .triton_config import KernelConfig, Workspace


@triton.jit
def _ukey(x):
    """Order-preserving map float32 -> uint32: flip all bits of negatives, the sign of positives."""
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    return tl.where(neg, ~bits, bits | 0x80000000)


@triton.jit
def _ukey_float(key):
    neg = (key >> 31) == 0
    return tl.where(neg, ~key, key & 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _first_tile(s_row, offs, n, PREFETCH: tl.constexpr):
    """The first tile of scores, loaded ahead (PREFETCH), else a placeholder."""
    if PREFETCH:
        return tl.load(s_row + offs, mask=offs < n, other=0.0)
    else:
        return tl.zeros(offs.shape, tl.float32)


@triton.jit
def _next_tile(s_row, idx, n, ahead, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """(tile loaded for the next iteration, this iteration's tile at ``idx``).

    PREFETCH: this iteration's tile was loaded one iteration earlier and the next one is
    issued before it is used, so the load's latency overlaps the histogram (Triton's
    pipeliner does not stage loads that feed no dot).
    """
    if PREFETCH:
        return tl.load(s_row + idx + BLOCK, mask=idx + BLOCK < n, other=0.0), ahead
    else:
        return ahead, tl.load(s_row + idx, mask=idx < n, other=0.0)


@triton.jit
def _quantile_kernel(
    Scores, Mst, Lst, Tau, SeqLens, Starts, Hist, BracketHist, Sync, Next, Theta,
    S_MAX, NUM_SPLITS1, NQ,
    HQ: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S1: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    SPARSE_FROM: tl.constexpr, SAMPLE: tl.constexpr, MARGIN: tl.constexpr, BITS: tl.constexpr,
    BRACKET_BINS: tl.constexpr, CHUNKED: tl.constexpr,
):
    """theta = tau-quantile of one row's probabilities, torch.quantile's 'linear' rule.

    The k-th smallest score (k = floor(tau * (n - 1))) and the next one are found exactly,
    without sorting the row. Probabilities are monotone in the scores, so interpolating
    exp2(s - M) / L at the two order statistics is the quantile of p.

    SAMPLE > 0: a sorted sample brackets rank k and only the keys inside are selected
    (``_bracket_select``); where the bracket misses, and for SAMPLE = 0, the radix select
    over every key runs (``_radix_select``, in the row's first program).

    CHUNKED: the row's keys are cut into NQ chunks, one program each (grid (rows, NQ), every
    program resident at once); they add their counts into the row's histograms and meet at
    a counter after each digit, so the row's passes run in one launch.
    """
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // HQ
    one = tl.full([1], 0, tl.int32) == 0  # [1]-shaped head mask for the shared helper
    begin, end, rank, frac = _qrank(Tau, SeqLens, Starts, row, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    n = end - begin
    s_row = Scores + row * S_MAX + begin
    miss = n >= 0  # without a sample, the full select
    t = (n * 0).to(tl.uint32)
    t_hi = t
    if SAMPLE > 0:
        c_lo, c_hi = _split_range(n * 0, n, chunk, NQ, BLOCK)
        miss, t, t_hi = _bracket_select(s_row, n, c_lo, c_hi, rank, BracketHist + row * BRACKET_BINS,
                                        Sync + row * 2, Next + row, NQ, SAMPLE, MARGIN, BITS, BLOCK, STAGES,
                                        PREFETCH, CHUNKED)
    if chunk == 0:
        if miss:
            t, t_hi = _radix_select(s_row, n, rank, Hist + row * 1024, BLOCK, STAGES, PREFETCH, SPARSE_FROM)
        m, l, _, _, _ = _row_ml(Mst, Lst, tl.full([1], 0, tl.int64) + row, one, NUM_SPLITS1, BLOCK_S1)
        tl.store(Theta + row, _interpolate(t, t_hi, frac, tl.sum(m, axis=0), tl.sum(l, axis=0)))


@triton.jit
def _row_meet(counter, target):
    """Arrive at the row's counter and wait until ``target`` arrivals: every program of the row
    has added its counts (released), and they are visible to this program's threads below.
    The last to arrive does not poll; the others poll with plain loads, then acquire once
    (polling with atomics measured the same)."""
    tl.debug_barrier()
    seen = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1
    if seen < target:
        while seen < target:
            seen = tl.load(counter, volatile=True)
        tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _radix_select(s_row, n, rank, h_rows, BLOCK: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
                  SPARSE_FROM: tl.constexpr):
    """(k-th key, next key) of a row of n scores streamed from memory, k = ``rank``.

    Radix select: 8 bits of the order-preserving 32-bit key per pass (MSB first); each
    pass histograms the next digit of the keys that share the digits found so far and
    picks the bucket holding rank k. The last pass also finds the least key above the
    k-th key's 24-bit bucket, so the next order statistic (a tie, a larger key of the same
    bucket, or that one) needs no fifth pass. Passes from SPARSE_FROM on count the few
    keys still matching with atomics into the row's slice of the histograms (read back
    and zeroed in the same pass) instead of a register histogram, whose cost is per key
    whether it matches or not.
    """
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = (n * 0).to(tl.uint32)
    above = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
    for p in tl.static_range(4):
        h_row = h_rows + p * 256
        hist = tl.zeros([256], tl.int32)
        x = _first_tile(s_row, offs, n, PREFETCH)
        for n0 in tl.range(0, n, BLOCK, num_stages=STAGES):
            idx = n0 + offs
            x, cur = _next_tile(s_row, idx, n, x, BLOCK, PREFETCH)
            hist, above = _count_digit(_ukey(cur), idx < n, prefix, hist, above, h_row, p, p >= SPARSE_FROM)
        if p >= SPARSE_FROM:
            tl.debug_barrier()  # every thread's counts are in before they are read
            hist = tl.atomic_xchg(h_row + bins, tl.zeros([256], tl.int32), sem="relaxed")
        prefix, rank, n_in = _pick_digit(hist, rank, prefix, 24 - 8 * p)
    return prefix, _next_key(prefix, rank, n_in, hist, tl.min(above, axis=0))


@triton.jit
def _bracket_select(s_row, n, c_lo, c_hi, rank, h_rows, r_sync, r_next, NQ, SAMPLE: tl.constexpr,
                    MARGIN: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                    PREFETCH: tl.constexpr, CHUNKED: tl.constexpr):
    """(missed, k-th key, next key) of a row of n scores, k = ``rank``, in fewer and cheaper passes.

    SAMPLE evenly spaced keys, sorted, give a bracket [lo, hi]: the sample keys MARGIN
    ranks below and above rank k's place in the sample. The radix select then runs on the
    offsets u - lo of the keys inside only, BITS bits a pass: as many digits as the
    bracket's width needs, each counted with one atomic per key still matching into the
    row's histograms at ``h_rows`` (2**BITS bins a pass). The first pass also counts the
    keys below the bracket; a miss (rank k outside it: a sample unlike the row) is
    returned, and the caller runs the full radix select instead.

    This program counts the keys [c_lo, c_hi) of the row. CHUNKED: the row's NQ programs add
    their counts, the keys below (``r_sync[1]``) and the least key past the last bucket
    (``r_next``) into the row's buffers, meet at ``r_sync[0]`` after each pass, and the last
    one to finish sets the buffers back to zero. Else the program owns the row: it reads
    each histogram back and zeroes it in one exchange.
    """
    NB: tl.constexpr = 1 << BITS
    js = tl.arange(0, SAMPLE)
    pos = (js.to(tl.int64) * n) // SAMPLE
    sample = tl.sort(_ukey(tl.load(s_row + pos, mask=pos < n, other=0.0)))
    at = (rank.to(tl.int64) * SAMPLE) // tl.maximum(n, 1)
    lo = tl.max(tl.where(js == at - MARGIN, sample, 0), axis=0)  # none below: the least key
    hi = tl.max(tl.where(js == at + MARGIN, sample, 0), axis=0)
    hi = tl.where(at + MARGIN < SAMPLE, hi, 0xFFFFFFFF)
    width = hi - lo
    digits = n * 0 + 1
    for j in tl.static_range(1, (32 + BITS - 1) // BITS):
        digits += ((width >> (BITS * j)) > 0).to(tl.int32)

    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, NB)
    c_row = s_row + c_lo
    c_n = c_hi - c_lo
    prefix = lo * 0
    n_in = n * 0
    hist = tl.zeros([NB], tl.int32)
    least = lo | 0xFFFFFFFF
    miss = n < 0
    for p in range(0, digits):
        shift = (BITS * (digits - 1 - p)).to(tl.uint32)
        # The digits above this one (none in the first pass: its bits above the bracket's
        # width are zero for every key inside).
        higher = ((tl.full([], 0xFFFFFFFF, tl.uint64) << (shift + BITS).to(tl.uint64)) & 0xFFFFFFFF).to(tl.uint32)
        h_row = h_rows + p * NB
        below = tl.zeros([BLOCK], tl.int32)
        above = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
        x = _first_tile(c_row, offs, c_n, PREFETCH)
        for n0 in tl.range(0, c_n, BLOCK, num_stages=STAGES):
            idx = n0 + offs
            x, cur = _next_tile(c_row, idx, c_n, x, BLOCK, PREFETCH)
            u = _ukey(cur)
            ok = idx < c_n
            below += (ok & (u < lo)).to(tl.int32)
            above = _bracket_digit(u, ok, lo, hi, prefix, above, h_row, shift, higher, NB - 1)
        last = p == digits - 1
        if CHUNKED:
            if p == 0:
                tl.atomic_add(r_sync + 1, tl.sum(below, axis=0), sem="relaxed")
            if last:
                tl.atomic_min(r_next, (tl.min(above, axis=0) ^ 0x80000000).to(tl.int32, bitcast=True), sem="relaxed")
            _row_meet(r_sync, (p + 1) * NQ)
            hist = tl.load(h_row + bins, cache_modifier=".cg")
            n_below = tl.load(r_sync + 1, cache_modifier=".cg")
            if last:
                least = tl.load(r_next, cache_modifier=".cg").to(tl.uint32, bitcast=True) ^ 0x80000000
        else:
            tl.debug_barrier()  # every thread's counts are in before they are read
            hist = tl.atomic_xchg(h_row + bins, tl.zeros([NB], tl.int32), sem="relaxed")
            n_below = tl.sum(below, axis=0)
            least = tl.min(above, axis=0)
        if p == 0:
            rank -= n_below
            miss = (rank < 0) | (rank >= tl.sum(hist, axis=0))
        if not miss:
            prefix, rank, n_in = _pick_digit(hist, rank, prefix, shift)
        # A miss skips the remaining passes (Triton has no break): they see an empty chunk.
        c_n = tl.where(miss, 0, c_n)
    if CHUNKED:
        tl.debug_barrier()  # this program's reads of the row's buffers are done
        done = tl.atomic_add(r_sync, 1, sem="acq_rel", scope="gpu")
        if done == (digits + 1) * NQ - 1:
            for p in range(0, digits):
                tl.store(h_rows + p * NB + bins, tl.zeros([NB], tl.int32))
            tl.store(r_sync + 1, 0)
            tl.store(r_next, _INT_MAX)
            tl.store(r_sync, 0)
    return miss, lo + prefix, lo + _next_key(prefix, rank, n_in, hist, least)


@triton.jit
def _bracket_digit(u, valid, lo, hi, prefix, above, h_row, shift, higher, MASK: tl.constexpr):
    """One radix pass over the offsets d = u - lo of the keys in [lo, hi]: one atomic per
    key whose ``higher`` digits equal ``prefix``'s, at the digit ``(d >> shift) & MASK``.
    Returns ``above`` lowered to the offsets of the keys past d's last-digit bucket or above
    hi (the next order statistic when no key inside the bracket follows the k-th in its
    bucket; used after the last pass).
    """
    valid = valid & (u >= lo)
    d = u - lo
    above = tl.minimum(above, tl.where(valid & ((d > (prefix | MASK)) | (u > hi)), d, 0xFFFFFFFF))
    valid = valid & (u <= hi) & ((d & higher) == (prefix & higher))
    tl.atomic_add(h_row + ((d >> shift) & MASK).to(tl.int32), 1, mask=valid, sem="relaxed")
    return above


@triton.jit
def _count_digit(u, valid, prefix, hist, above, h_row, PASS: tl.constexpr, SPARSE: tl.constexpr):
    """Count one tile's keys ``u`` for radix pass PASS: returns (hist, above).

    Keys that share the digits in ``prefix`` add their digit PASS to ``hist`` (a register
    histogram) or, SPARSE, with one atomic each to the row's histogram at ``h_row``. The
    last pass also lowers ``above`` to the least key above the chosen 24-bit bucket.
    """
    shift = 24 - 8 * PASS
    if PASS == 3:
        above = tl.minimum(above, tl.where(valid & (u > (prefix | 0xFF)), u, 0xFFFFFFFF))
    if PASS > 0:
        valid = valid & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
    digit = ((u >> shift) & 0xFF).to(tl.int32)
    if SPARSE:
        tl.atomic_add(h_row + digit, 1, mask=valid, sem="relaxed")
    else:
        hist += tl.histogram(digit, 256, mask=valid)
    return hist, above


@triton.jit
def _pick_digit(hist, rank, prefix, shift):
    """The bucket of a histogram of the digit at ``shift`` holding rank ``rank``: (prefix with
    that digit, rank left in it, its keys)."""
    bins = tl.arange(0, hist.shape[0])
    csum = tl.cumsum(hist, axis=0)
    d = tl.sum((csum <= rank).to(tl.int32), axis=0)  # first bucket whose cumsum passes rank
    rank -= tl.max(tl.where(csum <= rank, csum, 0), axis=0)
    n_in = tl.sum(tl.where(bins == d, hist, 0), axis=0)
    return prefix | (d.to(tl.uint32) << shift), rank, n_in


@triton.jit
def _interpolate(t, t_hi, frac, m, l):
    """theta: the probabilities exp2(s - m) / l of the two order statistics' keys, interpolated;
    0 on a row without keys (l = 0)."""
    inv_l = 1.0 / l
    p_lo = tl.math.exp2(_ukey_float(t) - m) * inv_l
    p_hi = tl.math.exp2(_ukey_float(t_hi) - m) * inv_l
    return tl.where(l > 0.0, p_lo + frac * (p_hi - p_lo), 0.0)


@triton.jit
def _next_key(t, rank, n_in, last_hist, above):
    """The (k+1)-th smallest key after the radix select found the k-th, ``t``.

    ``rank``: t's rank among the keys equal to it, ``n_in`` of them; ``last_hist``: the
    last digit's histogram of t's bucket (the keys sharing all of t's bits above that
    digit; its bins are exact keys); ``above``: the least key past that bucket (all ones:
    none). None at all (k = n - 1): t itself.
    """
    NB: tl.constexpr = last_hist.shape[0]
    bins = tl.arange(0, NB)
    nb = tl.min(tl.where((bins > (t & (NB - 1)).to(tl.int32)) & (last_hist > 0), bins, NB), axis=0)
    same_bucket = (t - (t & (NB - 1))) | nb.to(tl.uint32)
    later = tl.where(nb < NB, same_bucket, tl.where(above == 0xFFFFFFFF, t, above))
    return tl.where(rank + 1 < n_in, t, later)


@triton.jit
def _qrank(Tau, SeqLens, Starts, row, b, S_MAX, HAS_SEQ_LENS: tl.constexpr, HAS_STARTS: tl.constexpr):
    begin, end = _row_range(SeqLens, Starts, b, S_MAX, HAS_SEQ_LENS, HAS_STARTS)
    n = end - begin
    tau = tl.load(Tau + row)  # float64, so that tau * (n - 1) matches the reference
    pos = tau * (n - 1).to(tl.float64)
    kf = tl.floor(pos)
    return begin, end, kf.to(tl.int32), (pos - kf).to(tl.float32)


def quantile_pass(geo: dict, ws: Workspace, tau: torch.Tensor, seq_lens, starts, cfg: KernelConfig,
                  from_dense: bool = False) -> torch.Tensor:
    """Warmup: theta [B, Hq] from the stored scores (run right after them: L2-hot).

    ``from_dense``: the scores and split statistics come from the dense kernel.
    """
    theta = torch.empty(geo["B"], geo["Hq"], device=tau.device, dtype=torch.float32)
    has_sl, has_st = seq_lens is not None, starts is not None
    mst, lst, ns, block_s = (ws.dm, ws.dl, geo["nsd"], geo["BLOCK_SD"]) if from_dense else (
        ws.mst, ws.lst, geo["ns1"], geo["BLOCK_S1"])
    sl_arg, st_arg = seq_lens if has_sl else theta, starts if has_st else theta
    launch(_quantile_kernel, (geo["B"] * geo["Hq"], geo["NQ"]),
        ws.scores, mst, lst, tau, sl_arg, st_arg, ws.qhist, ws.qbracket, ws.qsync, ws.qnext, theta, geo["S"], ns,
        geo["NQ"], HQ=geo["Hq"], BLOCK=cfg.quantile_block, BLOCK_S1=block_s,
        HAS_SEQ_LENS=has_sl, HAS_STARTS=has_st, STAGES=cfg.quantile_stages,
        PREFETCH=cfg.quantile_prefetch, SPARSE_FROM=cfg.quantile_sparse_from,
        SAMPLE=cfg.quantile_sample, MARGIN=cfg.quantile_margin, BITS=geo["QBITS"], BRACKET_BINS=geo["QBRACKET"],
        CHUNKED=geo["NQ"] > 1, num_warps=cfg.quantile_warps, **geo["regsq"],
    )
    return theta
