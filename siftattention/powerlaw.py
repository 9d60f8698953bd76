"""Quantiles of attention rows and the power law theta_S ~ alpha * S^-beta.

Everything here is batched over leading dimensions and works on any device.
The fit is the paper's closed-form least squares of ``log theta`` on ``log S``;
R^2 is measured in log space (paper, Section 3.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_quantile(values: torch.Tensor, valid: torch.Tensor | None, tau: float | torch.Tensor, *,
                    host_sync: bool = True) -> torch.Tensor:
    """tau-quantile of the last dimension over the entries where ``valid`` is True.

    Linear interpolation between order statistics at position ``tau * (n - 1)`` in ascending
    order (``torch.quantile``'s rule, the position in float64), so a row with one valid entry
    returns that entry; rows with no valid entry return 0. ``tau``: a float, or a tensor
    broadcastable to ``values.shape[:-1]`` (one level per row). The one quantile of the library:
    the methods, the analysis and the kernels' torch reference all take theirs here.

    With a float ``tau`` and ``host_sync`` it needs only the two order statistics around the
    position, so it takes a partial ``topk`` from the nearer end, whose depth it reads on the host
    (one synchronisation); otherwise a full sort, which reads nothing on the host (a decode step
    that a CUDA graph captures). Either way it has no 2^24-element limit.
    """
    if valid is None:
        valid = torch.ones_like(values, dtype=torch.bool)
    n = valid.sum(dim=-1)
    if not host_sync or isinstance(tau, torch.Tensor):
        return quantile_of_sorted(torch.sort(values.masked_fill(~valid, float("inf")), dim=-1).values, n, tau)
    if tau < 0.5:
        _, hi, _ = _positions(n, tau)
        depth = max(1, int(hi.max()) + 1) if n.numel() else 1
        low = torch.topk(values.masked_fill(~valid, float("inf")), min(depth, values.shape[-1]), dim=-1, largest=False,
                         sorted=True).values
        return quantile_of_sorted(low, n, tau)
    # Largest first: ascending index j is descending index n - 1 - j.
    lo, hi, frac = _positions(n, tau)
    depth = max(1, int((n - 1 - lo).max()) + 1) if n.numel() else 1
    top = torch.topk(values.masked_fill(~valid, float("-inf")), min(depth, values.shape[-1]), dim=-1, sorted=True).values
    return _interpolate(top, (n - 1 - lo).clamp(min=0), (n - 1 - hi).clamp(min=0), frac, n)


def quantile_of_sorted(ascending: torch.Tensor, n: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """``masked_quantile``'s interpolation on rows already sorted ascending along the last dimension,
    each row's ``n`` valid values first (``n`` and ``tau`` broadcast against ``ascending.shape[:-1]``)."""
    lo, hi, frac = _positions(n, tau)
    return _interpolate(ascending, lo, hi, frac, n)


def _positions(n: torch.Tensor, tau: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The order statistics around position ``tau * (n - 1)`` (ascending) and the weight of the upper one (float64)."""
    tau = tau.to(device=n.device, dtype=torch.float64) if isinstance(tau, torch.Tensor) else tau
    pos = tau * (n.clamp(min=1) - 1).to(torch.float64)
    lo = pos.floor()
    return lo.long(), pos.ceil().long(), pos - lo


def _interpolate(ordered: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, frac: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """torch.lerp (the two-sided formula torch.quantile and the kernels use) between ``ordered``'s entries
    at ``lo`` and ``hi``; 0 on rows without a valid entry."""
    shape = ordered.shape[:-1]
    a = ordered.gather(-1, lo.expand(shape).unsqueeze(-1)).squeeze(-1)
    b = ordered.gather(-1, hi.expand(shape).unsqueeze(-1)).squeeze(-1)
    out = torch.lerp(a, b, frac.expand(shape).to(ordered.dtype))
    return torch.where(n.expand(shape) > 0, out, torch.zeros_like(out))


def _safe_log(theta: torch.Tensor) -> torch.Tensor:
    """log of theta clamped to the dtype's smallest positive value; non-finite -> that floor."""
    tiny = torch.finfo(theta.dtype).tiny
    theta = torch.nan_to_num(theta, nan=tiny, posinf=1.0, neginf=tiny)
    return theta.clamp(min=tiny).log()


@dataclass
class PowerLawFit:
    """Batched fit results: ``theta_S ~ alpha * S^-beta`` with its in-sample R^2.

    The fit is kept as ``log alpha``: after a long prompt a short warmup spans a narrow
    range of ``log S``, its exponent can be large, and ``alpha`` itself then lies far
    outside the floating-point range while the thresholds it predicts near the warmup
    are ordinary numbers.
    """

    log_alpha: torch.Tensor
    beta: torch.Tensor
    r2: torch.Tensor

    @property
    def alpha(self) -> torch.Tensor:
        """``exp(log_alpha)`` (inf or 0 where it leaves the dtype's range)."""
        return self.log_alpha.exp()

    def r_squared(self, steps: torch.Tensor, thetas: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """R^2 of this fit over the given points (out of sample when they are not the fitted ones)."""
        return _r_squared_log(steps, thetas, self.log_alpha, self.beta, valid)

    def predict(self, steps: torch.Tensor | float) -> torch.Tensor:
        """Thresholds at ``steps`` ([..., n] against fits of shape [...])."""
        steps = torch.as_tensor(steps, dtype=self.log_alpha.dtype, device=self.log_alpha.device)
        if steps.dim() == 0:
            return predict_log(self.log_alpha, self.beta, steps)
        return predict_log(self.log_alpha.unsqueeze(-1), self.beta.unsqueeze(-1), steps)


def fit_power_law(
    steps: torch.Tensor, thetas: torch.Tensor, valid: torch.Tensor | None = None
) -> PowerLawFit:
    """Closed-form least squares of ``log theta`` on ``log S`` over the last dimension.

    ``steps`` broadcasts against ``thetas`` ([..., n]); ``valid`` masks out points.
    A degenerate fit (fewer than two distinct steps, or non-finite results) falls
    back to ``beta = 0`` and ``alpha`` = geometric mean of the points, so a
    prediction is always finite.
    """
    dtype = torch.float64
    thetas = thetas.to(dtype)
    x = torch.as_tensor(steps, dtype=dtype, device=thetas.device).clamp(min=1).log()
    x = x.expand_as(thetas)
    y = _safe_log(thetas)
    w = torch.ones_like(y) if valid is None else valid.to(dtype).expand_as(y)
    n = w.sum(-1)
    n_safe = n.clamp(min=1)
    x_mean = (w * x).sum(-1) / n_safe
    y_mean = (w * y).sum(-1) / n_safe
    dx = (x - x_mean.unsqueeze(-1)) * w
    dy = (y - y_mean.unsqueeze(-1)) * w
    sxx = (dx * dx).sum(-1)
    sxy = (dx * dy).sum(-1)
    ok = sxx > 1e-12
    slope = torch.where(ok, sxy / torch.where(ok, sxx, torch.ones_like(sxx)), torch.zeros_like(sxx))
    intercept = y_mean - slope * x_mean
    finite = torch.isfinite(slope) & torch.isfinite(intercept)
    slope = torch.where(finite, slope, torch.zeros_like(slope))
    intercept = torch.where(finite, intercept, torch.zeros_like(intercept))
    beta = -slope
    r2 = _r_squared_log(torch.as_tensor(steps, dtype=dtype, device=thetas.device), thetas, intercept, beta, valid)
    return PowerLawFit(log_alpha=intercept, beta=beta, r2=r2)


def r_squared(
    steps: torch.Tensor,
    thetas: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The paper's R^2 in log space: ``1 - sum (l - l_hat)^2 / sum (l - mean l)^2``.

    Evaluated over the points where ``valid`` holds, for any (alpha, beta), so it
    also gives the out-of-sample R^2 of a warmup fit (which can be negative). A
    constant series has R^2 = 1 if predicted exactly, else 0.
    """
    return _r_squared_log(steps, thetas, alpha.to(torch.float64).clamp(min=torch.finfo(torch.float64).tiny).log(), beta, valid)


def _r_squared_log(steps, thetas, log_alpha, beta, valid) -> torch.Tensor:
    dtype = torch.float64
    thetas = thetas.to(dtype)
    y = _safe_log(thetas)
    steps = torch.as_tensor(steps, dtype=dtype, device=y.device)
    y_hat = _safe_log(predict_log(log_alpha.to(dtype).unsqueeze(-1), beta.to(dtype).unsqueeze(-1), steps).expand_as(y))
    w = torch.ones_like(y) if valid is None else valid.to(dtype).expand_as(y)
    n = w.sum(-1).clamp(min=1)
    y_mean = (w * y).sum(-1, keepdim=True) / n.unsqueeze(-1)
    ss_res = (w * (y - y_hat) ** 2).sum(-1)
    ss_tot = (w * (y - y_mean) ** 2).sum(-1)
    flat = ss_tot <= 1e-12
    r2 = 1.0 - ss_res / torch.where(flat, torch.ones_like(ss_tot), ss_tot)
    return torch.where(flat, (ss_res <= 1e-12).to(dtype), r2)


def predict(alpha: torch.Tensor, beta: torch.Tensor, steps: torch.Tensor | float) -> torch.Tensor:
    """``alpha * S^-beta`` with ordinary broadcasting; always finite, never NaN."""
    return predict_log(alpha.clamp(min=torch.finfo(alpha.dtype).tiny).log(), beta, steps)


def predict_log(log_alpha: torch.Tensor, beta: torch.Tensor, steps: torch.Tensor | float) -> torch.Tensor:
    """``exp(log_alpha - beta * log S)`` with ordinary broadcasting; always finite, never NaN."""
    steps = torch.as_tensor(steps, dtype=log_alpha.dtype, device=log_alpha.device).clamp(min=1)
    out = torch.exp(log_alpha - beta * steps.log())
    return torch.nan_to_num(out, nan=0.0, posinf=torch.finfo(out.dtype).max, neginf=0.0)


@dataclass
class PowerLawSums:
    """Weighted least-squares sums of ``y = log theta`` on ``x = log S``, batched over any shape.

    A point is added in O(1) and every earlier weight can be multiplied by a forgetting
    factor first, so a fit follows a series as it goes (Sift's recalibration) without
    keeping its points. ``add`` updates the tensors in place: a captured CUDA graph that
    holds them keeps working. float64 throughout: ``sum x^2 - (sum x)^2 / n`` loses digits
    in raw sums.
    """

    weight: torch.Tensor  # sum w
    x: torch.Tensor  # sum w x
    y: torch.Tensor  # sum w y
    xx: torch.Tensor  # sum w x^2
    xy: torch.Tensor  # sum w x y
    yy: torch.Tensor  # sum w y^2

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str | None = None) -> "PowerLawSums":
        return cls(*(torch.zeros(shape, dtype=torch.float64, device=device) for _ in range(6)))

    @classmethod
    def of_points(cls, steps: torch.Tensor, thetas: torch.Tensor, valid: torch.Tensor | None = None) -> "PowerLawSums":
        """The sums over the last dimension of ``thetas`` ([..., n]; ``steps`` broadcasts against it)."""
        x, y, w = _points(steps, thetas, valid)
        return cls(w.sum(-1), (w * x).sum(-1), (w * y).sum(-1), (w * x * x).sum(-1), (w * x * y).sum(-1), (w * y * y).sum(-1))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.weight, self.x, self.y, self.xx, self.xy, self.yy

    def add(self, steps: torch.Tensor, thetas: torch.Tensor, where: torch.Tensor | None = None, decay: float = 1.0) -> None:
        """In place: every sum times ``decay``, then the point (steps, thetas) with weight 1, where ``where`` holds.

        ``steps`` and ``thetas`` broadcast against the sums; elsewhere the sums stay as they are.
        """
        x, y, _ = _points(steps, thetas, None)
        x, y = torch.broadcast_tensors(x, y)
        for total, term in zip(self.tensors(), (torch.ones_like(x), x, y, x * x, x * y, y * y)):
            updated = total * decay + term
            total.copy_(updated if where is None else torch.where(where, updated, total))

    def scaled_to(self, total: float) -> "PowerLawSums":
        """The same points with their weights scaled to sum to ``total`` (the same fit, more or less say
        against points added later); no point stays no point."""
        factor = total / self.weight.clamp(min=torch.finfo(torch.float64).tiny)
        return PowerLawSums(*(t * factor for t in self.tensors()))

    def copy_(self, other: "PowerLawSums", where: torch.Tensor | None = None) -> None:
        """In place: take ``other``'s sums (where ``where`` holds)."""
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs if where is None else torch.where(where, theirs, mine))

    def fit(self) -> PowerLawFit:
        """The least-squares fit of the summed points: ``fit_power_law``'s rule, degenerate cases included
        (fewer than two distinct steps: ``beta = 0`` and alpha the geometric mean; no point: ``log alpha = 0``)."""
        n = self.weight.clamp(min=torch.finfo(torch.float64).tiny)
        x_mean, y_mean = self.x / n, self.y / n
        sxx = (self.xx - n * x_mean * x_mean).clamp(min=0)
        sxy = self.xy - n * x_mean * y_mean
        syy = (self.yy - n * y_mean * y_mean).clamp(min=0)
        # Relative to the raw sum: the cancellation leaves ~1e-16 * xx even for equal steps.
        ok = sxx > 1e-12 * (1.0 + self.xx.abs())
        slope = torch.where(ok, sxy / torch.where(ok, sxx, torch.ones_like(sxx)), torch.zeros_like(sxx))
        intercept = y_mean - slope * x_mean
        finite = torch.isfinite(slope) & torch.isfinite(intercept)
        slope = torch.where(finite, slope, torch.zeros_like(slope))
        intercept = torch.where(finite, intercept, torch.zeros_like(intercept))
        flat = syy <= 1e-12 * (1.0 + self.yy.abs())
        ss_res = (syy - slope * sxy).clamp(min=0)  # the residual of the fitted line
        r2 = torch.where(flat, (ss_res <= 1e-12 * (1.0 + self.yy.abs())).to(syy.dtype),
                         1.0 - ss_res / torch.where(flat, torch.ones_like(syy), syy))
        return PowerLawFit(log_alpha=intercept, beta=-slope, r2=r2)


def _points(steps: torch.Tensor, thetas: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log S, log theta, weight) in float64, as ``fit_power_law`` takes them."""
    y = _safe_log(torch.as_tensor(thetas).to(torch.float64))
    x = torch.as_tensor(steps, dtype=torch.float64, device=y.device).clamp(min=1).log()
    w = torch.ones_like(y) if valid is None else valid.to(torch.float64).expand_as(y)
    return x, y, w
