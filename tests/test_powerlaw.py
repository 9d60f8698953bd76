import math

import pytest
import torch

from siftattention.powerlaw import fit_power_law, masked_quantile, predict, r_squared


def test_fit_recovers_planted_power_law_exactly():
    torch.manual_seed(0)
    alpha = torch.rand(3, 5, dtype=torch.float64) * 2 + 0.1
    beta = torch.rand(3, 5, dtype=torch.float64) * 1.5 + 0.05
    steps = torch.arange(1, 301, dtype=torch.float64)
    thetas = alpha[..., None] * steps ** (-beta[..., None])
    fit = fit_power_law(steps, thetas)
    torch.testing.assert_close(fit.alpha, alpha, rtol=1e-9, atol=0)
    torch.testing.assert_close(fit.beta, beta, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(fit.r2, torch.ones_like(fit.r2), rtol=0, atol=1e-12)


def test_r2_matches_the_papers_definition_on_noisy_data():
    torch.manual_seed(1)
    steps = torch.arange(1, 201, dtype=torch.float64)
    log_theta = math.log(0.3) - 0.7 * steps.log() + 0.2 * torch.randn(200, dtype=torch.float64)
    fit = fit_power_law(steps, log_theta.exp())
    # Independent reference: numpy-free least squares via torch.linalg.lstsq.
    design = torch.stack([torch.ones_like(steps), steps.log()], dim=1)
    coef = torch.linalg.lstsq(design, log_theta[:, None]).solution[:, 0]
    assert fit.beta.item() == pytest.approx(-coef[1].item(), rel=1e-9)
    resid = log_theta - design @ coef
    r2 = 1 - (resid**2).sum() / ((log_theta - log_theta.mean()) ** 2).sum()
    assert fit.r2.item() == pytest.approx(r2.item(), rel=1e-9)


def test_zeros_and_non_finite_values_give_finite_thresholds():
    steps = torch.arange(1, 11, dtype=torch.float64)
    series = torch.tensor(
        [[0.0] * 10, [float("nan")] * 10, [1.0, 0.5, 0.0, float("inf"), 0.2, 0.1, 0.0, 0.05, 0.04, 0.03], [0.5] * 10]
    )
    fit = fit_power_law(steps, series)
    eta = predict(fit.alpha[:, None], fit.beta[:, None], torch.arange(11, 5000, dtype=torch.float64))
    assert torch.isfinite(fit.alpha).all() and torch.isfinite(fit.beta).all() and torch.isfinite(fit.r2).all()
    assert torch.isfinite(eta).all() and (eta >= 0).all()
    # A single point or a constant step axis cannot fix a slope: beta falls back to 0.
    single = fit_power_law(torch.tensor([5.0]), torch.tensor([0.2]))
    assert single.beta.item() == 0 and single.alpha.item() == pytest.approx(0.2)


def test_steep_fit_after_a_long_prompt_predicts_near_its_points():
    # A 16-step warmup after a 2048-token prompt spans log S by 0.008; its exponent can be
    # large, and alpha = theta * S^beta then lies far outside float64 (exp(907) here).
    steps = torch.arange(2049, 2065, dtype=torch.float64)
    for beta in (120.0, -90.0):
        theta = 1e-4 * (steps / 2064) ** -beta
        fit = fit_power_law(steps, theta)
        assert fit.beta.item() == pytest.approx(beta, rel=1e-9)
        assert fit.log_alpha.item() == pytest.approx(math.log(1e-4) + beta * math.log(2064), rel=1e-12)
        later = torch.tensor([2064.0, 2100.0, 2300.0], dtype=torch.float64)
        torch.testing.assert_close(fit.predict(later), 1e-4 * (later / 2064) ** -beta, rtol=1e-8, atol=0)
        assert fit.r2.item() == pytest.approx(1.0, abs=1e-9)


def test_out_of_sample_r2_goes_negative_when_the_series_bends():
    steps = torch.arange(1, 1001, dtype=torch.float64)
    theta = torch.where(steps <= 100, steps**-0.5, 100**-0.5 * (steps / 100) ** 1.0)  # decays, then rises
    warm = fit_power_law(steps[:100], theta[:100])
    assert warm.r2.item() == pytest.approx(1.0)
    assert r_squared(steps, theta, warm.alpha, warm.beta).item() < 0


@pytest.mark.parametrize("tau", [0.1, 0.5, 0.75, 0.875, 0.95])
def test_masked_quantile_equals_torch_quantile_over_valid_entries(tau):
    torch.manual_seed(2)
    values = torch.rand(4, 3, 53)
    valid = torch.rand(4, 3, 53) > 0.4
    valid[0, 0] = False
    valid[0, 0, 7] = True  # one valid entry: the quantile is that entry
    got = masked_quantile(values, valid, tau)
    ref = torch.stack([torch.quantile(values[i, j][valid[i, j]], tau) for i in range(4) for j in range(3)]).view(4, 3)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-7)
    assert got[0, 0] == values[0, 0, 7]
    assert masked_quantile(values, torch.zeros_like(valid), tau).eq(0).all()


def test_every_quantile_of_the_library_is_one_computation():
    """The methods' (partial top-k, both ends), the decode steps' torch reference (a full sort, tau per row) and
    the analysis' (numpy sort, all taus at once) give the same bits, within one float32 rounding of float64."""
    from siftattention.eval.analysis import row_quantiles
    from siftattention.kernels.torch_ref import _probs, _scores, sift_warmup_decode_torch

    g = torch.Generator().manual_seed(4)
    B, H, R, K = 2, 3, 31, 90
    probs = torch.softmax(torch.randn(B, H, R, K, generator=g) * 3, -1)
    n = torch.randint(0, K + 1, (B, 1, R), generator=g)
    n[0, 0, :3] = torch.tensor([0, 1, 2])
    valid = torch.arange(K) < n[..., None]
    taus = (0.1, 0.3, 0.5, 0.7, 0.875, 0.99, 1.0)
    analysis = row_quantiles(probs, valid, taus, block_rows=7)
    for t, tau in enumerate(taus):
        mask = valid.expand_as(probs)
        partial = masked_quantile(probs, mask, tau)
        assert torch.equal(partial, masked_quantile(probs, mask, tau, host_sync=False))
        assert torch.equal(partial, masked_quantile(probs, mask, torch.full((B, H, R), tau, dtype=torch.float64)))
        assert torch.equal(partial, analysis[..., t])
        want = torch.zeros(B, H, R, dtype=torch.float64)
        for b, r in ((b, r) for b in range(B) for r in range(R)):
            if n[b, 0, r]:
                want[b, :, r] = torch.quantile(probs[b, :, r, : n[b, 0, r]].double(), tau, dim=-1)
        ulps = (partial.double() - want).abs() / (want.abs() * torch.finfo(torch.float32).eps).clamp_min(1e-300)
        assert float(ulps.max()) <= 1.0, (tau, float(ulps.max()))
    # A decode step's quantile (one tau per row, no host sync) is the same function on its rows.
    q, k = torch.randn(B, H, 16, generator=g), torch.randn(B, H, K, 16, generator=g)
    tau = torch.rand(B, H, generator=g, dtype=torch.float64)
    seq_lens, starts = torch.tensor([K, 40], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    _, theta = sift_warmup_decode_torch(q, k, k, tau, 0.25, seq_lens, starts)
    scores, keys = _scores(q, k, 0.25, seq_lens, starts)
    p = _probs(scores)
    for b in range(B):
        for h in range(H):
            row = p[b, h, keys[b, h]]
            assert torch.equal(theta[b, h], masked_quantile(row, None, float(tau[b, h])))
