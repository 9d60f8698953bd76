"""ThresholdMethod: a method that supplies only its threshold gets the filter, the row maximum and the output
on the reference path and the decode path alike."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import tiny_llama
from siftattention.attention import LayerRecord, method_attention
from siftattention.generation import generate
from siftattention.kernels import DecodeKernels
from siftattention.methods import Oracle, Sift, TopTheta
from siftattention.methods.base import KeyRange
from siftattention.methods.threshold import RowThresholds, StepThreshold, ThresholdMethod


@dataclass
class AboveUniform(ThresholdMethod):
    """Keep the keys at least ``c`` times more probable than the uniform 1/S."""

    c: float = 2.0
    renormalize: bool = False
    name = "above-uniform"

    def row_thresholds(self, rows, state):
        return RowThresholds(self.c / rows.steps[:, None, :].float().expand(rows.probs.shape[:3]), rows.is_step)

    def decode_phase(self, step):
        return "sparse"

    def step_threshold(self, query, k_cache, v_cache, keys, state, phase, kernels):
        return StepThreshold((self.c / keys.steps().float())[:, None].expand(query.shape[:2]).contiguous())


@dataclass
class PositiveScores(ThresholdMethod):
    """Keep the keys whose scaled score exceeds ``theta`` (a threshold on scores)."""

    theta: float = 0.5
    name = "positive-scores"
    threshold_space = "score"

    def row_thresholds(self, rows, state):
        return RowThresholds(torch.full(rows.probs.shape[:3], self.theta), rows.is_step)

    def decode_phase(self, step):
        return "sparse"

    def step_threshold(self, query, k_cache, v_cache, keys, state, phase, kernels):
        return StepThreshold(torch.full(query.shape[:2], self.theta))


def test_the_family_is_sift_oracle_and_top_theta():
    assert all(issubclass(cls, ThresholdMethod) for cls in (Sift, Oracle, TopTheta))
    assert AboveUniform().spec() == "above-uniform:c=2.0,renormalize=False"


@pytest.mark.parametrize("method", [AboveUniform(), AboveUniform(c=1.5, renormalize=True), PositiveScores()],
                         ids=["prob", "prob-renorm", "score"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_new_threshold_method_keeps_the_same_keys_on_both_paths(method, backend):
    """Every row of a teacher-forced chunk against a decode step over the same keys (ragged starts, GQA 2)."""
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, L, D = 2, 4, 2, 45, 16
    q = torch.randn(B, Hq, L, D, generator=g) * 2
    k, v = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    starts = torch.tensor([0, 7], dtype=torch.int32)
    valid = torch.ones(L, L, dtype=torch.bool).tril()[None, None].repeat(B, 1, 1, 1)
    valid[1, :, :, :7] = False
    record = LayerRecord()
    ref = method_attention(method, None, q, k, v, valid, scaling=0.25, record=record)
    kernels = DecodeKernels.plan(batch=B, q_heads=Hq, kv_heads=Hkv, max_len=L, head_dim=D, dtype=torch.float32,
                                 device="cpu", scale=0.25, renormalize=method.renormalize, backend=backend)
    sparse = 0
    for r in range(8, L):  # rows with a valid key in both sequences
        seq_lens = torch.full((B,), r + 1, dtype=torch.int32)
        res = method.decode_step(q[:, :, r], k, v, KeyRange(seq_lens, starts), None, "sparse", kernels)
        assert torch.equal(res.kept, record.kept[0][:, :, r]), r
        torch.testing.assert_close(res.out, ref[:, :, r], rtol=1e-5, atol=1e-5)
        sparse += int((res.kept < (seq_lens - starts)[:, None]).sum())
    assert sparse > 20  # it does filter


def test_a_new_threshold_method_generates_as_the_reference_path():
    from test_generation import NEW, _left_padded_batch, _model, _reference

    model = _model(tiny_llama)
    ids, mask = _left_padded_batch()
    method = AboveUniform(c=1.5)
    ref_seq, ref_logp, ref_stats = _reference(model, ids, mask, method)
    res = generate(model, ids, mask, method, max_new_tokens=NEW, pad_token_id=0, eos_token_id=-1, output_scores=True)
    assert res.fast and torch.equal(res.sequences, ref_seq)
    assert (res.scores.log_softmax(-1) - ref_logp).abs().max().item() <= 1e-4
    assert res.stats.realized_sparsity() == pytest.approx(ref_stats.realized_sparsity(), abs=1e-12)
    assert res.stats.realized_sparsity() > 0.2
