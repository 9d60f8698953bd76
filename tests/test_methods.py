import math
import pytest
import torch

from siftattention.attention import method_attention, valid_keys
from siftattention.methods import H2O, Full, Oracle, Sift, SpecError, TopK, parse_method


@pytest.mark.parametrize(
    "factory, param, allowed",
    [
        (lambda v: Sift(tau=v), "tau", "(0, 1)"),
        (lambda v: Oracle(tau=v), "tau", "(0, 1)"),
        (lambda v: TopK(k=v), "k", "(0, 1]"),
        (lambda v: H2O(k=v), "k", "(0, 1]"),
        (lambda v: H2O(heavy_ratio=v), "heavy_ratio", "[0, 1]"),
    ],
)
@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_fractions_outside_their_range_raise_naming_the_parameter(factory, param, allowed, value):
    with pytest.raises(ValueError, match=rf"{param} must be in {re_escape(allowed)}"):
        factory(value)


def re_escape(text):
    import re

    return re.escape(text)


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_tau_endpoints_are_rejected(value):
    with pytest.raises(ValueError, match=r"tau must be in \(0, 1\)"):
        Sift(tau=value)


@pytest.mark.parametrize("warmup", [1, 0, -5, 2.5])
def test_warmup_below_two_is_rejected(warmup):
    with pytest.raises(ValueError, match="warmup must be an integer >= 2"):
        Sift(warmup=warmup)


def test_k_zero_rejected_and_one_allowed():
    with pytest.raises(ValueError, match=r"k must be in \(0, 1\]"):
        TopK(k=0)
    assert TopK(k=1).k == 1.0


def test_spec_grammar_round_trip_and_errors():
    m = parse_method("sift:tau=0.9,warmup=64,renormalize=true")
    assert isinstance(m, Sift) and m.tau == 0.9 and m.warmup == 64 and m.renormalize is True
    assert parse_method(m.spec()) == m
    assert parse_method("full") == Full()
    assert parse_method("topk:k=0.25") == TopK(k=0.25)
    for bad, part in [
        ("nope", "unknown method 'nope'"),
        ("sift:tau", "'tau' is not key=value"),
        ("sift:beta=3", "unknown parameter 'beta'"),
        ("sift:tau=abc", "tau='abc' is not a number"),
        ("sift:warmup=1.5", "warmup='1.5' is not an integer"),
        ("topk:renormalize=maybe", "not a boolean"),
        ("sift:tau=1.2", "tau must be in (0, 1)"),
    ]:
        with pytest.raises(SpecError) as info:
            parse_method(bad)
        assert part in str(info.value)


def _random_rows(seed=0, B=2, Hq=4, Hkv=2, Q=37, D=16):
    torch.manual_seed(seed)
    q = torch.randn(B, Hq, Q, D) * 2
    k = torch.randn(B, Hkv, Q, D)
    v = torch.randn(B, Hkv, Q, D)
    valid, _ = valid_keys(None, Q, Q, B, q.device)
    return q, k, v, valid


def test_topk_realized_sparsity_equals_closed_form():
    from siftattention.attention import LayerRecord

    q, k, v, valid = _random_rows()
    for frac in (0.1, 0.125, 0.5, 0.9):
        method = TopK(k=frac)
        rec = LayerRecord()
        method_attention(method, None, q, k, v, valid, scaling=0.25, record=rec)
        kept = torch.cat(rec.kept, dim=2).double()
        steps = torch.arange(1, q.shape[2] + 1, dtype=torch.float64)
        closed = (1 - torch.ceil(frac * steps) / steps).mean()
        assert kept.shape == (2, 4, 37)
        assert (1 - kept / steps).mean().item() == pytest.approx(closed.item(), abs=1e-12)


def _reference_output(q, k, v, keep, renormalize):
    """float64 attention with an explicit keep mask (independent of method_attention)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, 1)
    v = v.double().repeat_interleave(groups, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * 0.25
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) * keep
    if renormalize:
        p = p / p.sum(-1, keepdim=True)
    return p @ v, p


@pytest.mark.parametrize("renormalize", [False, True])
def test_oracle_output_matches_float64_reference(renormalize):
    q, k, v, valid = _random_rows(seed=3)
    out = method_attention(Oracle(tau=0.75, renormalize=renormalize), None, q, k, v, valid, scaling=0.25)
    # Reference keep set: p > exact quantile (torch.quantile over the valid keys) or the row max.
    _, p = _reference_output(q, k, v, torch.ones(1, dtype=torch.bool), False)
    keep = torch.zeros_like(p, dtype=torch.bool)
    for b in range(p.shape[0]):
        for h in range(p.shape[1]):
            for r in range(p.shape[2]):
                row = p[b, h, r, : r + 1]
                keep[b, h, r, : r + 1] = row > torch.quantile(row, 0.75)
                keep[b, h, r, int(row.argmax())] = True
    ref, _ = _reference_output(q, k, v, keep, renormalize)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_h2o_keeps_its_budget_and_evicts_permanently():
    from siftattention.attention import LayerRecord

    q, k, v, valid = _random_rows(seed=4, Q=60)
    method = H2O(k=0.25, heavy_ratio=0.5)
    state = method.new_state(2, 4, q.device)
    rec = LayerRecord()
    method_attention(method, state, q, k, v, valid, scaling=0.25, record=rec)
    kept = torch.cat(rec.kept, dim=2)
    steps = torch.arange(1, 61)
    budget = torch.ceil(0.25 * steps.double()).long()
    # The cache at step S holds the survivors of step S-1 plus the new key, cut to the budget.
    assert torch.equal(kept, torch.minimum(budget, steps).expand_as(kept).int())
    # Evicted keys never come back: every key's eviction flag is set at most once and stays.
    assert state.evicted.sum(-1).eq(60 - budget[-1]).all()


def test_full_and_keep_all_methods_are_exact_on_random_rows():
    q, k, v, valid = _random_rows(seed=5)
    ref, _ = _reference_output(q, k, v, torch.ones(1, dtype=torch.bool), False)
    from siftattention.attention import LayerRecord

    steps = torch.arange(1, q.shape[2] + 1, dtype=torch.int32)
    for method in (Full(), TopK(k=1.0), H2O(k=1.0)):
        state = method.new_state(2, 4, q.device)
        rec = LayerRecord()
        out = method_attention(method, state, q, k, v, valid, scaling=0.25, record=rec)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
        # Every head of every row keeps all S valid keys: realized sparsity exactly 0.
        assert torch.equal(torch.cat(rec.kept, dim=2), steps.expand(2, 4, -1)), method
        assert torch.equal(torch.cat(rec.steps, dim=1), steps.expand(2, -1)), method


def test_sift_threshold_after_a_long_prompt_follows_a_steep_fit():
    # float32 state: log alpha (about 907 and -696 here) is kept, never alpha itself,
    # which float32 (and for the first head float64) cannot hold.
    method = Sift(tau=0.875, warmup=16)
    state = method.new_state(1, 2, torch.device("cpu"))
    steps = torch.arange(2049, 2065, dtype=torch.float64)
    betas = torch.tensor([120.0, -90.0], dtype=torch.float64)
    state.thetas[0] = (1e-4 * (steps[None, :] / 2064) ** -betas[:, None]).float()
    state.theta_steps[0] = steps.float()
    state.count.fill_(16)
    method._fit(state, torch.tensor([True]))
    later = torch.tensor([2065.0, 2100.0, 2300.0], dtype=torch.float64)
    eta = torch.exp(state.log_alpha[0, :, None] - state.beta[0, :, None] * later.float().log())  # the decode step's arithmetic
    torch.testing.assert_close(eta.double(), 1e-4 * (later[None, :] / 2064) ** -betas[:, None], rtol=5e-3, atol=0)


@pytest.mark.parametrize("renormalize", [False, True])
def test_sift_anchored_normaliser_matches_a_float64_row_loop(renormalize):
    """Keep p > eta * exp(g_{t-1} - g_t), g = -log(sum of p over the first 3 and newest 5 keys), or the row max."""
    q, k, v, valid = _random_rows(seed=6)
    warmup = 6
    exact = Sift(tau=0.7, warmup=warmup, renormalize=renormalize)
    anchored = Sift(tau=0.7, warmup=warmup, renormalize=renormalize, normalizer="anchored", anchor_first=3, anchor_last=5)
    fitted = exact.new_state(2, 4, q.device)
    method_attention(exact, fitted, q, k, v, valid, scaling=0.25)
    state = anchored.new_state(2, 4, q.device)
    out = method_attention(anchored, state, q, k, v, valid, scaling=0.25)
    # The warmup is exact and recorded alike, so both fit the same power law.
    torch.testing.assert_close(state.log_alpha, fitted.log_alpha)
    _, p = _reference_output(q, k, v, torch.ones(1, dtype=torch.bool), False)
    keep = torch.ones_like(p, dtype=torch.bool).tril()
    B, H, R, _ = p.shape
    for b in range(B):
        for h in range(H):
            prev = None
            for r in range(R):
                row = p[b, h, r, : r + 1]
                anchors = [i for i in range(r + 1) if i < 3 or i > r - 5]
                gap = -torch.log(row[anchors].sum())
                if r + 1 > warmup:
                    eta = torch.exp(fitted.log_alpha[b, h].double() - fitted.beta[b, h].double() * math.log(r + 1))
                    keep[b, h, r, : r + 1] = row > eta * torch.exp(prev - gap)
                    keep[b, h, r, int(row.argmax())] = True
                prev = gap
    ref, _ = _reference_output(q, k, v, keep, renormalize)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert 0.1 < 1 - keep[..., warmup:, :].sum() / valid.expand_as(keep)[..., warmup:, :].sum()  # it does sift
    steps = torch.arange(1, R + 1, dtype=torch.float64)
    eta = torch.exp(fitted.log_alpha.double()[..., None] - fitted.beta.double()[..., None] * steps.log())
    exact_keep = (p > eta[..., None]).tril() | (p == p.amax(-1, keepdim=True))
    assert (keep != exact_keep)[..., warmup:, :].any()  # the predicted normaliser moves the kept set
    torch.testing.assert_close(state.gap.double(), -torch.log(p[:, :, -1, list(range(3)) + list(range(R - 5, R))].sum(-1)),
                               rtol=1e-5, atol=1e-6)


def test_sift_anchored_with_every_key_an_anchor_is_sift():
    q, k, v, valid = _random_rows(seed=7)
    outs = [method_attention(m, m.new_state(2, 4, q.device), q, k, v, valid, scaling=0.25)
            for m in (Sift(tau=0.7, warmup=4), Sift(tau=0.7, warmup=4, normalizer="anchored", anchor_first=64, anchor_last=0))]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_sift_anchored_options_are_checked_and_spelled_only_when_used():
    assert "normalizer" not in Sift().spec()
    spec = Sift(normalizer="anchored", anchor_last=128).spec()
    assert spec.endswith("normalizer=anchored,anchor_last=128")
    assert parse_method(spec) == Sift(normalizer="anchored", anchor_last=128)
    with pytest.raises(ValueError, match="normalizer must be"):
        Sift(normalizer="guess")
    with pytest.raises(ValueError, match="anchor_first must be"):
        Sift(anchor_first=-1)
    with pytest.raises(ValueError, match="at least 1"):
        Sift(anchor_first=0, anchor_last=0)
