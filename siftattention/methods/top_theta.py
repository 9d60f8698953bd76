"""Top-theta attention (Berestizshevsky, Andri and Cavigelli, 2025): calibrated static thresholds.

A key is kept when its scaled pre-softmax score exceeds ``theta[layer, head, n]``, with n
the row's valid keys. The thresholds come from a calibration pass over text the method
never evaluates on, in a step of its own that runs before ``apply``: ``calibrate(model,
input_ids)`` on given token windows, or ``calibrate_on_corpus(model)`` (what ``prepare``, and so
the ``sift`` commands, run) on windows of the ``calibration`` corpus. ``apply`` only installs the
thresholds and refuses a method that has none for the model. For every calibration row with
n > k, the (k+1)-th largest score (the largest score top-k would drop), averaged over the
calibration sequences per (layer, query head, n) as ``mean + sigma * std``. A row of a length
the calibration never saw takes the nearest calibrated one (the longest, beyond it); rows with n <= k keep every key. Layers
below ``first_layers`` use ``first_k`` (the paper's setting: denser first layers). While
calibrating, each layer keeps exactly its top-k keys (top-k at calibration), so deeper
layers are calibrated on the inputs they will see. This follows the authors' released code.

Compensations: with ``renormalize=False`` (the default) the kept probabilities keep the
full softmax normaliser (the paper's exact softmax-denominator compensation); with
``renormalize=True`` the softmax runs over the kept keys only. ``vmc=True`` (the default)
adds the pruned probability mass times the mean of the row's valid value rows (V-mean
compensation). The row's largest score is always kept, so no row goes empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .base import KeyRange, Method, Rows, Selection, check_bool, check_int, check_real
from .threshold import RowThresholds, StepThreshold, ThresholdMethod


class CalibrationError(RuntimeError):
    """Top-theta has no thresholds for this model and cannot calibrate them."""


def _model_key(model: Any) -> tuple:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    # The tensor-parallel degree too: a rank's thresholds cover its own heads only.
    return (getattr(model.config, "_name_or_path", ""), config.num_hidden_layers, config.num_attention_heads,
            getattr(model, "_tp_size", None) or 1)


def _lookup(thresholds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """theta for rows of ``steps`` valid keys: ``thresholds`` [H, T + 1] -> [*steps.shape, H] (NaN: dense)."""
    index = steps.long().clamp(max=thresholds.shape[-1] - 1)
    return thresholds[:, index].movedim(0, -1)


@dataclass
class _Accumulator:
    """Sums over the calibration rows of one layer, per (query head, n)."""

    total: torch.Tensor  # [H, T + 1] float64
    total_sq: torch.Tensor  # [H, T + 1] float64
    count: torch.Tensor  # [T + 1] int64


@dataclass
class _CalibrationState:
    k: int
    acc: _Accumulator


class _Calibrator(Method):
    """Exact top-k attention that records each row's (k+1)-th largest score, for ``TopTheta.calibrate``."""

    name = "toptheta-calibration"

    def __init__(self, target: "TopTheta", length: int) -> None:
        self.target, self.length = target, length
        self.renormalize, self.vmc = target.renormalize, target.vmc
        self.layers: dict[int, _Accumulator] = {}

    def spec(self) -> str:
        return f"{self.name}({self.target.spec()})"

    def new_state(self, batch: int, heads: int, device: torch.device, layer: int = 0) -> _CalibrationState:
        acc = self.layers.get(layer)
        if acc is None:
            zeros = dict(dtype=torch.float64, device=device)
            acc = self.layers[layer] = _Accumulator(
                torch.zeros(heads, self.length + 1, **zeros), torch.zeros(heads, self.length + 1, **zeros),
                torch.zeros(self.length + 1, dtype=torch.long, device=device))
        return _CalibrationState(self.target.layer_k(layer), acc)

    def select(self, rows: Rows, state: _CalibrationState) -> Selection:
        k, K = state.k, rows.scores.shape[-1]
        record = rows.is_step & (rows.steps > k)  # [B, R]; steps <= the windows' length
        if K <= k or not bool(record.any()):
            return Selection(keep=None, approx=record)
        theta = rows.scores.topk(k + 1, dim=-1).values[..., k]  # [B, H, R]
        n = rows.steps[record]
        values = theta.permute(0, 2, 1)[record].double().T  # [H, rows]
        state.acc.total.index_add_(1, n, values)
        state.acc.total_sq.index_add_(1, n, values * values)
        state.acc.count.index_add_(0, n, torch.ones_like(n))
        keep = (rows.scores > theta[..., None]) | ~record[:, None, :, None]
        return Selection(keep=keep & rows.valid, approx=record)


@dataclass
class TopThetaState:
    thresholds: torch.Tensor  # [H, T + 1] float32 theta per row length n (NaN: keep every key)


@dataclass
class TopTheta(ThresholdMethod):
    """Keep keys whose score exceeds a threshold calibrated to keep about ``k`` keys per row."""

    k: int = 64
    renormalize: bool = False
    vmc: bool = True
    first_layers: int = 2
    first_k: int = 512
    sigma: float = 0.1
    calibration: str = "c4"
    calib_seqs: int = 8
    calib_len: int = 1024
    name = "toptheta"
    threshold_space = "score"
    spec_optional: ClassVar[tuple[str, ...]] = ("first_layers", "first_k", "sigma", "calibration", "calib_seqs", "calib_len")

    def __post_init__(self) -> None:
        self.k = check_int("k", self.k, 1)
        self.first_layers = check_int("first_layers", self.first_layers, 0)
        self.first_k = check_int("first_k", self.first_k, 1)
        self.calib_seqs = check_int("calib_seqs", self.calib_seqs, 1)
        self.calib_len = check_int("calib_len", self.calib_len, 2)
        self.sigma = check_real("sigma", self.sigma)
        self.renormalize = check_bool("renormalize", self.renormalize)
        self.vmc = check_bool("vmc", self.vmc)
        from ..data import DATASETS

        if self.calibration not in DATASETS:
            raise ValueError(f"calibration must be one of {', '.join(DATASETS)}, got {self.calibration!r}")
        #: [L, H, T + 1] float32 thresholds once calibrated (``calibrate`` or ``calibrate_on_corpus``), or set by hand
        self.thresholds: torch.Tensor | None = None
        self._calibrated_for: tuple | None = None

    def layer_k(self, layer: int) -> int:
        return self.first_k if layer < self.first_layers else self.k

    # -- calibration -----------------------------------------------------------------
    def calibrate(self, model: Any, input_ids: torch.Tensor, *, on_window: Callable[[int], None] | None = None) -> "TopTheta":
        """Set the thresholds from teacher-forced passes of ``model`` over ``input_ids`` [N, T]; returns self."""
        from ..hf import apply

        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be [N, T] with T >= 2, got {tuple(input_ids.shape)}")
        key = _model_key(model)
        calibrator = _Calibrator(self, input_ids.shape[1])
        with apply(model, calibrator), torch.inference_mode():
            for i, window in enumerate(input_ids):
                model(window[None].to(model.device))
                if on_window is not None:
                    on_window(i)
        if sorted(calibrator.layers) != list(range(key[1])):
            raise CalibrationError(f"calibration saw layers {sorted(calibrator.layers)} of {key[1]}")
        layers = []
        for layer in range(key[1]):
            acc = calibrator.layers[layer]
            count = acc.count.double()
            mean = acc.total / count
            std = (acc.total_sq / count - mean * mean).clamp(min=0).sqrt()
            theta = torch.where(acc.count > 0, mean + self.sigma * std, float("nan"))
            layers.append(theta.float().cpu())
        self.thresholds = torch.stack(layers)
        self._calibrated_for = key
        return self

    def calibrate_on_corpus(self, model: Any, on_progress: Callable[[int, int], None] | None = None) -> "TopTheta":
        """Calibrate on ``calib_seqs`` windows of ``calib_len`` tokens of the ``calibration`` corpus
        (read from disk, tokenized with the model's tokenizer); returns self."""
        from ..data import load_corpus, token_windows
        from ..models import tokenizer_for

        tokenizer = tokenizer_for(model)
        if tokenizer is None:
            raise CalibrationError(
                f"{self.spec()} needs thresholds for this model and found no tokenizer to calibrate with: "
                "call method.calibrate(model, input_ids) first")
        windows = token_windows(load_corpus(self.calibration).text, tokenizer, self.calib_len, self.calib_seqs)
        report = None if on_progress is None else (lambda i: on_progress(i + 1, len(windows)))
        return self.calibrate(model, windows, on_window=report)

    def _calibrated_for_model(self, model: Any) -> bool:
        # Thresholds set by hand carry no model key: their shape is checked per layer in new_state.
        return self.thresholds is not None and self._calibrated_for in (None, _model_key(model))

    def prepare(self, model: Any, on_progress: Callable[[int, int], None] | None = None) -> None:
        """``calibrate_on_corpus``, unless the thresholds already fit this model."""
        if not self._calibrated_for_model(model):
            self.calibrate_on_corpus(model, on_progress)

    def check_prepared(self, model: Any) -> None:
        if not self._calibrated_for_model(model):
            state = "is not calibrated" if self.thresholds is None else "was calibrated for another model"
            raise CalibrationError(
                f"{self.spec()} {state}: call method.prepare(model) (calibrates on {self.calibration}) or "
                "method.calibrate(model, input_ids) before apply()")

    # -- the method ------------------------------------------------------------------
    def new_state(self, batch: int, heads: int, device: torch.device, layer: int = 0) -> TopThetaState:
        if self.thresholds is None:
            raise CalibrationError(f"{self.spec()} is not calibrated: call method.prepare(model) or method.calibrate(model, input_ids)")
        if not (layer < self.thresholds.shape[0] and heads == self.thresholds.shape[1]):
            raise CalibrationError(
                f"{self.spec()} was calibrated for {self.thresholds.shape[0]} layers x {self.thresholds.shape[1]} heads, "
                f"asked for layer {layer} with {heads} heads")
        return TopThetaState(self.thresholds[layer].to(device))

    def reorder_state(self, state: TopThetaState, index: torch.Tensor) -> TopThetaState:
        return state  # the thresholds belong to the model, not to a sequence

    def row_thresholds(self, rows: Rows, state: TopThetaState) -> RowThresholds:
        theta = _lookup(state.thresholds, rows.steps).permute(0, 2, 1)  # [B, H, R]
        # A row whose every head is uncalibrated (NaN: n <= k) is exact; a NaN head keeps every key.
        return RowThresholds(_dense_where_nan(theta), rows.is_step & ~theta.isnan().all(1))

    def decode_phase(self, step: int) -> str:
        return "sparse"

    def step_threshold(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRange,
                       state: TopThetaState, phase: str, kernels: Any) -> StepThreshold:
        return StepThreshold(_dense_where_nan(_lookup(state.thresholds, keys.steps())))


def _dense_where_nan(theta: torch.Tensor) -> torch.Tensor:
    """The calibrated thresholds with NaN (no calibration: keep every key) as -inf, which keeps every key."""
    return theta.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))

__all__ = ["CalibrationError", "TopTheta"]
