"""Sift's calibration: the O(1) least-squares sums, prompt calibration, recalibration and the adaptive warmup."""

import math

import pytest
import torch

from conftest import tiny_llama
from siftattention import Sift, apply
from siftattention.attention import prompt_row_ranges, rows_are_ranges
from siftattention.generation import generate
from siftattention.methods.base import PromptChunk
from siftattention.methods.sift import AdaptiveWarmup, PromptCalibration
from siftattention.powerlaw import PowerLawSums, fit_power_law, masked_quantile


def _weighted_lstsq(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """(log alpha, beta) of the weighted least squares y = log alpha - beta x, by torch.linalg.lstsq."""
    root = w.sqrt()[:, None]
    design = torch.stack([torch.ones_like(x), -x], dim=1) * root
    solution = torch.linalg.lstsq(design, y[:, None] * root).solution[:, 0]
    return float(solution[0]), float(solution[1])


@pytest.mark.parametrize("decay", [1.0, 0.9, 0.5])
def test_the_o1_refit_equals_a_batch_weighted_least_squares(decay):
    g = torch.Generator().manual_seed(0)
    steps = torch.cat([torch.tensor([16.0, 40.0, 100.0, 400.0, 1000.0]), 1000.0 + torch.arange(1, 41, dtype=torch.float64) * 16])
    thetas = 0.3 * steps ** -0.8 * torch.exp(0.2 * torch.randn(steps.shape, generator=g, dtype=torch.float64))
    sums = PowerLawSums.of_points(steps[:5], thetas[:5])
    for step, theta in zip(steps[5:], thetas[5:]):
        sums.add(step, theta, decay=decay)
    # Point i was added n - 1 - i updates before the end (the first five together, before every update).
    n = len(steps)
    weights = torch.tensor([decay ** (n - 5)] * 5 + [decay ** (n - 1 - i) for i in range(5, n)], dtype=torch.float64)
    log_alpha, beta = _weighted_lstsq(steps.log(), thetas.log(), weights)
    fit = sums.fit()
    assert float(fit.log_alpha) == pytest.approx(log_alpha, abs=1e-6)
    assert float(fit.beta) == pytest.approx(beta, abs=1e-6)
    if decay == 1.0:  # unweighted: the batch fit Sift's warmup makes, R^2 included
        batch = fit_power_law(steps, thetas)
        assert float(fit.r2) == pytest.approx(float(batch.r2), abs=1e-9)


def test_sums_update_in_place_only_where_asked_and_scale_without_changing_the_fit():
    sums = PowerLawSums.zeros((2,))
    sums.add(torch.tensor([10.0, 10.0]), torch.tensor([0.1, 0.1]), where=torch.tensor([True, False]))
    assert sums.weight.tolist() == [1.0, 0.0]
    sums.add(torch.tensor([100.0, 100.0]), torch.tensor([0.01, 0.01]), where=torch.tensor([True, False]), decay=0.5)
    fit, scaled = sums.fit(), sums.scaled_to(10.0).fit()
    assert float(sums.weight[0]) == 1.5 and float(fit.beta[0]) == pytest.approx(1.0)
    assert torch.allclose(fit.beta, scaled.beta) and torch.allclose(fit.log_alpha, scaled.log_alpha)
    # No point: beta 0, log alpha 0 (alpha 1), like fit_power_law's degenerate fit; one step: the geometric mean.
    assert float(fit.beta[1]) == 0.0 and float(fit.log_alpha[1]) == 0.0
    one = PowerLawSums.of_points(torch.tensor([7.0, 7.0]), torch.tensor([0.1, 0.4])).fit()
    assert float(one.beta) == 0.0 and float(one.log_alpha) == pytest.approx(math.log(0.2))


def test_prompt_rows_are_spaced_geometrically_over_the_whole_prompt():
    calibration = PromptCalibration()
    f, n, least = calibration.first, calibration.rows, calibration.min_prompt
    targets = calibration.targets(torch.tensor([4096, least, 20]))
    first = targets[0]
    assert int(first[0]) == f and int(first[-1]) == 4096 and (first[1:] > first[:-1]).all()
    spacing = torch.linspace(0, 1, n, dtype=torch.float64)
    assert (first.double().log() - (f * (4096.0 / f) ** spacing).log()).abs().max() < 0.04  # rounded to whole steps
    short = targets[1][targets[1] > 0]
    assert int(short[0]) == f and int(short[-1]) == least and len(short.unique()) == len(short) < n  # repeats dropped
    assert len(short) >= 5  # the shortest prompt that calibrates still gives a fit 5 points
    assert calibration.usable(torch.tensor([least, 100])).all() and not calibration.usable(torch.tensor([least - 1, 100])).any()


def test_prompt_calibration_recovers_a_noisy_power_law():
    """alpha within 10% and beta within 0.03 from 64 rows of a power law with 10% log-normal noise."""
    g = torch.Generator().manual_seed(1)
    targets = PromptCalibration().targets(torch.tensor([8192]))[0].double()
    alpha, beta = 0.4, 0.9
    thetas = alpha * targets ** -beta * torch.exp(0.1 * torch.randn(targets.shape, generator=g, dtype=torch.float64))
    fit = PowerLawSums.of_points(targets, thetas).fit()
    assert float(fit.log_alpha.exp()) == pytest.approx(alpha, rel=0.1)
    assert float(fit.beta) == pytest.approx(beta, abs=0.03)


def test_sampled_prompt_rows_get_the_exact_quantile_of_their_causal_softmax():
    """observe_prompt's thetas are masked_quantile of each sampled row's own softmax over its key prefix
    (GQA, left padding: steps counted from each sequence's first real token)."""
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, P, D = 2, 4, 2, 90, 8
    q = torch.randn(B, Hq, P, D, generator=g)
    k = torch.randn(B, Hkv, P, D, generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[1, :20] = 0  # a 70-token prompt behind 20 pads
    valid = (torch.ones(P, P, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :])[:, None]
    method = Sift(tau=0.8)
    state = method.new_state(B, Hq, q.device)
    method.observe_prompt(PromptChunk(q, k, valid, valid[:, 0, -1].sum(-1), 0.5), state)
    method.finish_prefill(state)
    probs = torch.softmax((q @ k.repeat_interleave(2, dim=1).transpose(2, 3) * 0.5).masked_fill(~valid, float("-inf")), -1)
    for b, prompt in enumerate([90, 70]):
        targets = state.prompt_targets[b]
        assert int(targets.max()) == prompt and bool(state.prompt_recorded[b][targets > 0].all())
        for slot in (targets > 0).nonzero()[:, 0].tolist():
            row = P - prompt + int(targets[slot]) - 1  # the row whose step is the target
            expected = masked_quantile(probs[b, :, row], valid[b, :, row].expand(Hq, P), 0.8)
            torch.testing.assert_close(state.prompt_thetas[b, :, slot], expected)
    assert bool(state.fitted.all()) and method.decode_phase(0) == "sparse"


@pytest.mark.parametrize("layout", ["window", "holes"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_sampled_rows_get_their_quantile_under_any_valid_mask(layout, chunks):
    """observe_prompt's thetas equal masked_quantile of each sampled row's float64 softmax, prefilled whole or in
    chunks, both where the decode kernel measures them at the prompt's end (each row's keys one range: a sliding
    window) and where it cannot (a mask with holes)."""
    g = torch.Generator().manual_seed(5)
    Hq, Hkv, P, D = 6, 2, 77, 16
    q, k = torch.randn(1, Hq, P, D, generator=g), torch.randn(1, Hkv, P, D, generator=g)
    valid = torch.ones(P, P, dtype=torch.bool).tril()
    if layout == "window":
        valid &= ~torch.ones(P, P, dtype=torch.bool).tril(-20)
    else:
        valid[:, 3::7] = False
        valid |= torch.eye(P, dtype=torch.bool)
    valid = valid[None, None]
    method = Sift(tau=0.9)
    state = method.new_state(1, Hq, q.device)
    bounds = torch.linspace(0, P, chunks + 1).long().tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        # As the attention glue says: a sliding layer's prompt ends at its window's number of keys.
        method.observe_prompt(PromptChunk(q[:, :, a:b], k[:, :, :b], valid[:, :, a:b, :b], valid[:, 0, -1].sum(-1), 0.25,
                                          final=b == P), state)
        method.finish_prefill(state)
    targets = state.prompt_targets[0]
    steps = valid[0, 0].sum(-1)
    rows = torch.stack([(steps == t).nonzero()[0, 0] for t in targets[targets > 0]])  # the first row at each step
    assert bool(state.prompt_recorded[0][targets > 0].all()) and not bool(state.prompt_pending.any())
    scores = (q.double()[0, :, rows] @ k.double()[0].repeat_interleave(3, 0).transpose(1, 2)) * 0.25
    probs = torch.softmax(scores.masked_fill(~valid[0, :, rows], float("-inf")), -1)
    expected = masked_quantile(probs, valid[0, :, rows].expand_as(probs), 0.9)
    torch.testing.assert_close(state.prompt_thetas[0][:, targets > 0].double(), expected, rtol=1e-5, atol=1e-7)


def _prompt_mask(pads, a, b, window=None):
    """[B, 1, b - a, b] validity of prompt rows a..b-1 (the rows of one chunk) as transformers builds it: causal,
    left padding of ``pads`` [B] tokens, a sliding window of ``window`` keys."""
    q, k = torch.arange(a, b)[:, None], torch.arange(b)[None]
    valid = (k <= q) & (k >= pads[:, None, None])
    if window is not None:
        valid &= k > q - window
    return valid[:, None]


@pytest.mark.parametrize("window", [None, 1, 6, 23, 300])
def test_the_structural_row_ranges_count_the_masks_rows(window):
    """prompt_row_ranges reads a chunk's ranges off its structure: their steps are the mask's row sums, and
    rows_are_ranges accepts them, for causal, left-padded, chunked and sliding-window prompts of odd lengths."""
    pads = torch.tensor([0, 7, 30, 83])  # the last row all padding up to the last chunk
    for a, b in [(0, 87), (0, 29), (29, 58), (58, 87), (3, 8), (30, 31), (31, 44), (84, 87)]:
        valid = _prompt_mask(pads, a, b, window)
        ranges = prompt_row_ranges(valid, window)
        assert ranges.dtype == torch.int32 and ranges.shape == (4, b - a, 2)
        steps = PromptChunk(torch.zeros(4, 1, b - a, 2), torch.zeros(4, 1, b, 2), valid, valid[:, 0, -1].sum(-1), 1.0,
                            ranges=ranges).steps
        assert torch.equal(steps, valid[:, 0].sum(-1, dtype=torch.int32)), (a, b)
        assert rows_are_ranges(valid, ranges, elements=97)  # in slices of a row or two


def test_rows_are_ranges_refuses_a_mask_of_another_structure():
    pads = torch.tensor([0, 5])
    valid = _prompt_mask(pads, 10, 41)
    for change in ("hole", "window", "padding"):
        other = valid.clone()
        if change == "hole":
            other[:, :, 20:, 12] = False
        elif change == "window":  # ranges read with a window the mask does not have
            assert not rows_are_ranges(other, prompt_row_ranges(other, 9))
            continue
        else:  # padding that differs between rows
            other[1, :, 25:, 5:8] = False
        assert not rows_are_ranges(other, prompt_row_ranges(other))


def test_the_glue_checks_a_mask_once_and_reads_a_custom_one_whole():
    """The handle's ranges: those of transformers' masks, checked once per mask; None (PromptChunk sums the mask's
    rows) for a custom 4-D mask with holes."""
    model = tiny_llama()
    valid = _prompt_mask(torch.tensor([0, 4]), 0, 37)
    holes = valid.clone()
    holes[..., 3::5] = False
    with apply(model, Sift()) as handle:
        checks = []
        real = rows_are_ranges
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("siftattention.hf.rows_are_ranges", lambda *a: checks.append(1) or real(*a))
            for layer in (0, 1):  # one forward: each mask checked by the first layer that gets it
                assert torch.equal(handle._prompt_ranges(2 * layer, valid, valid, None), prompt_row_ranges(valid))
                assert handle._prompt_ranges(2 * layer + 1, holes, holes, None) is None
            assert len(checks) == 2
            handle._prompt_ranges(0, valid, valid, None)  # the next forward checks its mask again
            assert len(checks) == 3
        assert torch.equal(handle._prompt_ranges(0, None, valid, None), prompt_row_ranges(valid))


def _gemma3_sliding():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, sliding_window=21, pad_token_id=0,
                           layer_types=["sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg).eval()


def _padded_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 96, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _model():
    model = tiny_llama()
    with torch.no_grad():
        model.get_input_embeddings().weight[0].normal_()
    return model


def test_the_reference_path_and_the_fast_loop_calibrate_alike_on_a_left_padded_prompt():
    model = _model()
    ids, mask = _padded_prompts([100, 80, 66])
    method = Sift(tau=0.7, warmup=4)
    with apply(model, method, decode_backend=None) as handle:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
        reference = handle.stats
    fast = generate(model, ids, mask, method, max_new_tokens=3, pad_token_id=0, eos_token_id=-1)
    chunked = generate(model, ids, mask, method, max_new_tokens=3, pad_token_id=0, eos_token_id=-1, prefill_chunk=24)
    assert fast.fast and "warmup" not in fast.timings["phases"]  # sparse from the first decoded token
    for res in (fast, chunked):
        torch.testing.assert_close(res.stats.alpha, reference.alpha, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(res.stats.beta, reference.beta, rtol=1e-5, atol=1e-6)
    # Left padding changes nothing: sequence 1 alone, unpadded, gets the same fit.
    alone = generate(model, ids[1:2, 20:], mask[1:2, 20:], method, max_new_tokens=2, pad_token_id=0, eos_token_id=-1)
    torch.testing.assert_close(alone.stats.alpha[:, 0], reference.alpha[:, 1], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(alone.stats.beta[:, 0], reference.beta[:, 1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3-sliding"])
def test_calibration_from_the_structural_ranges_is_bit_identical_to_summing_the_mask(family, monkeypatch):
    """Both loops (the fast one whole and in chunks), left-padded prompts of odd lengths: every sampled step, theta
    and fit is the same bit for bit whether the glue gives each row's keys from the mask's structure or the
    method reads them off the mask (the glue's fallback for a mask of unknown structure)."""
    model = _model() if family == "llama" else _gemma3_sliding()
    ids, mask = _padded_prompts([101, 77, 45])
    method = Sift(tau=0.8, warmup=4, normalizer="anchored" if family == "llama" else "exact", anchor_first=2, anchor_last=8)
    fields = ("prompt_targets", "prompt_recorded", "prompt_thetas", "log_alpha", "beta", "fit_sums", "gap")

    def calibrate() -> list[torch.Tensor]:
        states = []
        with apply(model, method, decode_backend=None) as handle:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
            states.append(handle.states)
        for chunk in (None, 29):
            states.append(generate(model, ids, mask, method, max_new_tokens=1, pad_token_id=0, eos_token_id=-1,
                                   prefill_chunk=chunk).stats._handle.states)
        return [getattr(s[layer], f) for s in states for layer in sorted(s) for f in fields]

    structural = calibrate()
    monkeypatch.setattr("siftattention.hf.SiftHandle._prompt_ranges", lambda *args: None)
    for ours, summed in zip(structural, calibrate(), strict=True):
        assert torch.equal(ours.nan_to_num(7.0), summed.nan_to_num(7.0))


def test_a_short_prompt_calibrates_its_batch_on_the_rows_it_has():
    """A prompt of min_prompt tokens (far below 4 * first) costs its batch nothing: every row fits on its own
    prompt rows, decoding is sparse from the first token and recalibrates."""
    model = _model()
    least = PromptCalibration.min_prompt
    ids, mask = _padded_prompts([100, least])
    method = Sift(tau=0.7, warmup=4, recalibrate_every=2)
    res = generate(model, ids, mask, method, max_new_tokens=8, pad_token_id=0, eos_token_id=-1)
    assert "warmup" not in res.timings["phases"] and "recalibrate" in res.timings["phases"]
    states = res.stats._handle.states
    assert all(bool(s.calibrated.all() and s.fitted.all()) for s in states.values())
    short = states[0].prompt_targets[1]
    assert short[short > 0].tolist() == list(range(PromptCalibration.first, least + 1))
    alone = generate(model, ids[1:, -least:], None, method, max_new_tokens=1, pad_token_id=0, eos_token_id=-1)
    for layer, state in alone.stats._handle.states.items():
        torch.testing.assert_close(state.prompt_thetas[0], states[layer].prompt_thetas[1], rtol=1e-4, atol=1e-6)


def test_a_too_short_prompt_falls_back_to_the_decode_warmup():
    model = _model()
    ids, mask = _padded_prompts([100, PromptCalibration.min_prompt - 1])  # one prompt too short: the whole batch warms up
    method = Sift(tau=0.7, warmup=4)
    res = generate(model, ids, mask, method, max_new_tokens=8, pad_token_id=0, eos_token_id=-1)
    assert res.timings["phases"]["warmup"]["steps"] == 4 and method.decode_phase(0) == "warmup"
    one = generate(model, ids[:1, -1:], None, method, max_new_tokens=8, pad_token_id=0, eos_token_id=-1)
    assert one.timings["phases"]["warmup"]["steps"] == 4
    long = generate(model, ids[:1], None, method, max_new_tokens=8, pad_token_id=0, eos_token_id=-1)
    assert "warmup" not in long.timings["phases"] and method.decode_phase(0) == "sparse"


@pytest.mark.parametrize("normalizer", ["exact", "anchored"])
def test_recalibration_runs_alike_in_the_fast_loop_and_the_reference_path(normalizer):
    """Every 4th sparse step measures its exact quantile: same tokens, fits and sparsity on the reference
    path (``select``) and in the fast loop (anchored: the first decoded token filters with the last prompt row's gap)."""
    model = _model()
    ids, mask = _padded_prompts([90, 70])
    method = Sift(tau=0.7, warmup=4, recalibrate_every=4, recalibrate_decay=0.8, normalizer=normalizer, anchor_first=2,
                  anchor_last=8)
    results = []
    for backend in (None,):
        with apply(model, method, decode_backend=backend) as handle:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
            results.append((out, handle.stats.alpha, handle.stats.beta, handle.stats.realized_sparsity()))
    fast = generate(model, ids, mask, method, max_new_tokens=14, pad_token_id=0, eos_token_id=-1)
    results.append((fast.sequences, fast.stats.alpha, fast.stats.beta, fast.stats.realized_sparsity()))
    assert fast.timings["phases"]["recalibrate"]["steps"] == 3  # sparse steps 4, 8, 12 of 13
    for seq, alpha, beta, sparsity in results[1:]:
        assert torch.equal(seq, results[0][0])
        torch.testing.assert_close(alpha, results[0][1], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(beta, results[0][2], rtol=1e-4, atol=1e-5)
        assert sparsity == pytest.approx(results[0][3], abs=1e-9)
    with apply(model, Sift(tau=0.7, warmup=4, recalibrate_every=0, normalizer=normalizer, anchor_first=2, anchor_last=8)) as handle:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert not torch.allclose(handle.stats.beta, results[0][2])  # the measurements did move the fit


def _planted_series(plant: int, length: int = 40, seed: int = 3):
    """Steps 1..length whose first plant - 1 quantiles are noise and the rest lie exactly on the fit of
    those: adding a point on the least-squares line leaves the fit unchanged, so it settles at ``plant``."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.arange(1, length + 1, dtype=torch.float64)
    thetas = (0.5 * steps ** -0.7 * torch.exp(torch.randn(length, generator=g, dtype=torch.float64)))[None]
    fit = fit_power_law(steps[: plant - 1], thetas[:, : plant - 1])
    thetas[:, plant - 1:] = fit.predict(steps[plant - 1:])
    return steps, thetas


@pytest.mark.parametrize("bounds,expected", [((4, 30), 12), ((15, 30), 15), ((4, 9), 9)], ids=["planted", "minimum", "maximum"])
def test_the_adaptive_warmup_stops_where_the_prediction_settles_within_its_bounds(bounds, expected):
    steps, thetas = _planted_series(plant=12)
    rule = AdaptiveWarmup(*bounds, tolerance=1e-6)
    assert rule.stop_step(steps, thetas) == expected


def test_the_adaptive_warmup_ends_the_decode_warmup_alike_on_both_loops():
    model = _model()
    ids, mask = _padded_prompts([20, 13])
    method = Sift(tau=0.7, warmup=12, warmup_source="decode", warmup_tolerance=50.0, warmup_min=5)
    fast = generate(model, ids, mask, method, max_new_tokens=14, pad_token_id=0, eos_token_id=-1)
    assert fast.timings["phases"]["warmup"]["steps"] == 5  # a tolerance nothing exceeds: the minimum
    with apply(model, method) as handle:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        assert torch.equal(out, fast.sequences)
        torch.testing.assert_close(handle.stats.beta, fast.stats.beta, rtol=1e-5, atol=1e-6)
        assert int(handle.states[0].count[0]) == 5
    strict = Sift(tau=0.7, warmup=12, warmup_source="decode", warmup_tolerance=1e-12, warmup_min=5)
    res = generate(model, ids, mask, strict, max_new_tokens=14, pad_token_id=0, eos_token_id=-1)
    assert res.timings["phases"]["warmup"]["steps"] == 12  # never settles: the maximum


def test_calibration_options_are_checked_and_spelled_only_when_changed():
    assert Sift().warmup_source == "prompt" and "recalibrate" not in Sift().spec()
    assert "recalibrate_every=0" in Sift(recalibrate_every=0).spec()
    for kwargs, message in [({"warmup_source": "pre"}, "warmup_source must be 'prompt', 'decode' or 'prefill'"),
                            ({"recalibrate_every": -1}, "recalibrate_every must be an integer >= 0"),
                            ({"recalibrate_decay": 0.0}, "recalibrate_decay must be in (0, 1]"),
                            ({"warmup_tolerance": -1.0}, "warmup_tolerance must be >= 0"),
                            ({"warmup_min": 1}, "warmup_min must be an integer >= 2")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            Sift(**kwargs)


def test_perplexity_after_a_prompt_scores_decode_steps_only():
    from siftattention.eval.perplexity import evaluate_perplexity

    model = _model()
    windows = torch.randint(3, 96, (1, 100), generator=torch.Generator().manual_seed(5))
    methods = [("paper", Sift(tau=0.7, warmup=8, warmup_source="decode", recalibrate_every=0)), ("prompt", Sift(tau=0.7, warmup=8))]
    results, warm = evaluate_perplexity(model, windows, methods, prompt_len=70)
    paper, prompt = results
    assert (paper.tokens, paper.tokens_post_warmup, warm) == (29, 21, 8)  # steps 71..99; post-warmup S > 78
    # The paper's 8 dense decode steps count as 0 in its realized sparsity; the prompt fit is sparse throughout.
    assert paper.realized_sparsity < paper.realized_sparsity_post_warmup
    assert prompt.realized_sparsity == pytest.approx(prompt.realized_sparsity_post_warmup, abs=0.05) and prompt.realized_sparsity > 0.3
    with pytest.raises(ValueError, match="a prompt of 98 tokens leaves no decode steps to score in a window of 100 tokens"):
        evaluate_perplexity(model, windows, methods, prompt_len=98)
