"""The published rivals, Top-theta and Skip-Softmax, against float64 references written from their rules."""

import math

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from siftattention import SkipSoftmax, TopTheta, apply
from siftattention.attention import LayerRecord, method_attention
from siftattention.generation import generate
from siftattention.methods import CalibrationError, SpecError, parse_method
from siftattention.methods.base import KeyRange
from siftattention.report import method_family


def _gqa_inputs(B, Hq, Hkv, K, D, seed, pad=(0, 0)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, K, D, generator=g) * 1.5
    k = torch.randn(B, Hkv, K, D, generator=g)
    v = torch.randn(B, Hkv, K, D, generator=g)
    valid = torch.ones(K, K, dtype=torch.bool).tril()[None, None].repeat(B, 1, 1, 1)
    for b, p in enumerate(pad):  # left padding
        valid[b, :, :, :p] = False
    return q, k, v, valid


def _scores64(q, k, valid, scale):
    G = q.shape[1] // k.shape[1]
    s = torch.matmul(q.double(), k.double().repeat_interleave(G, 1).transpose(-1, -2)) * scale
    return s.masked_fill(~valid, float("-inf"))


def _attend64(s, keep, v, valid, renormalize, vmc=False):
    """float64 output of the kept keys, with the full or the kept normaliser and optional V-mean compensation."""
    G = s.shape[1] // v.shape[1]
    v64 = v.double().repeat_interleave(G, 1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    w = torch.where(keep, p, 0.0)
    if renormalize:
        w = w / w.sum(-1, keepdim=True).clamp(min=1e-300)
    out = w @ v64
    if vmc:
        n = valid.sum(-1, keepdim=True).clamp(min=1).double()
        out = out + (1 - w.sum(-1, keepdim=True)) * ((valid.double() / n) @ v64)
    return out


# -- Skip-Softmax -----------------------------------------------------------------------------


def _skip_reference(s, steps, scale, block, groups):
    """Block by block, one running maximum per row, in float64; a group skips a block only when all its heads would."""
    B, H, R, K = s.shape
    keep = torch.zeros(B, H, R, K, dtype=torch.bool)
    for b in range(B):
        for r in range(R):
            if int(steps[b, r]) == 0:  # a padding row: no valid key
                continue
            lam = scale / int(steps[b, r])
            for h0 in range(0, H, groups):
                running = [-math.inf] * groups
                for j0 in range(0, K, block):
                    skips = []
                    for i in range(groups):
                        m = max(s[b, h0 + i, r, j0:j0 + block].tolist())
                        skips.append(lam < 1 and running[i] > -math.inf and m - running[i] < math.log(lam))
                    if not all(skips):
                        keep[b, h0:h0 + groups, r, j0:j0 + block] = True
                    for i in range(groups):  # the running maximum sees every block, skipped or not
                        running[i] = max(running[i], max(s[b, h0 + i, r, j0:j0 + block].tolist()))
    return keep


@pytest.mark.parametrize("Hkv,block,scale,per_head", [(8, 16, 4.0, False), (4, 7, 2.5, False), (2, 32, 9.0, False),
                                                       (1, 16, 3.0, False), (2, 16, 3.0, True), (4, 16, 500.0, False)])
def test_skip_softmax_keeps_the_blocks_of_a_float64_block_loop(Hkv, block, scale, per_head):
    q, k, v, valid = _gqa_inputs(2, 8, Hkv, 75, 16, seed=Hkv * 100 + block, pad=(0, 11))
    method = SkipSoftmax(scale=scale, block=block, per_head=per_head)
    s = _scores64(q, k, valid, 0.25)
    steps = valid[:, 0].sum(-1)
    ref_keep = _skip_reference(s, steps, scale, block, 1 if per_head else 8 // Hkv) & valid
    record = LayerRecord()
    out = method_attention(method, None, q, k, v, valid, scaling=0.25, record=record)
    kept = record.kept[0]
    assert torch.equal(kept, ref_keep.sum(-1).int())
    ref = _attend64(s, ref_keep, v, valid, renormalize=True)
    rows = valid[:, 0].any(-1)
    assert (out - ref.float())[rows[:, None].expand(-1, 8, -1)].abs().max() < 1e-4
    if scale < 100 and Hkv > 1:  # lambda < 1 somewhere: some blocks go (eight heads voting together skip none here)
        assert ref_keep.sum() < valid.expand_as(ref_keep).sum()


def test_skip_softmax_decode_step_keeps_what_select_keeps():
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, L, D = 3, 8, 2, 90, 16
    q = torch.randn(B, Hq, D, generator=g) * 2
    kc, vc = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    seq_lens, starts = torch.tensor([90, 61, 77], dtype=torch.int32), torch.tensor([0, 5, 30], dtype=torch.int32)
    method = SkipSoftmax(scale=3.0, block=16)
    kernels = type("K", (), {"scale": 0.25})()
    res = method.decode_step(q, kc, vc, KeyRange(seq_lens, starts), None, "sparse", kernels)
    pos = torch.arange(L)
    valid = ((pos >= starts[:, None].long()) & (pos < seq_lens[:, None].long()))[:, None, None, :]  # [B, 1, 1, L]
    s = _scores64(q[:, :, None], kc, valid, 0.25)
    ref_keep = _skip_reference(s, (seq_lens - starts)[:, None], 3.0, 16, Hq // Hkv) & valid
    assert torch.equal(res.kept, ref_keep[:, :, 0].sum(-1).int())
    ref = _attend64(s, ref_keep, vc, valid, renormalize=True)[:, :, 0]
    assert (res.out - ref.float()).abs().max() < 1e-4


# -- Top-theta ---------------------------------------------------------------------------------


def _calibrated(thresholds, **kw):
    method = TopTheta(**kw)
    method.thresholds = thresholds
    return method


@pytest.mark.parametrize("Hkv,renormalize,vmc", [(8, False, True), (4, True, False), (2, False, False), (1, True, True)])
def test_top_theta_keeps_scores_above_the_threshold_of_the_row_length(Hkv, renormalize, vmc):
    q, k, v, valid = _gqa_inputs(2, 8, Hkv, 70, 16, seed=Hkv, pad=(0, 9))
    T = 50  # calibrated lengths 1..50: longer rows take n = 50's threshold
    g = torch.Generator().manual_seed(7)
    thresholds = torch.randn(1, 8, T + 1, generator=g) * 0.5 + 1.0
    thresholds[:, :, :6] = float("nan")  # rows of <= 5 keys keep every key
    thresholds[0, 3, 20:30] = 100.0  # no score passes: the row maximum stays
    method = _calibrated(thresholds, k=5, renormalize=renormalize, vmc=vmc)
    state = method.new_state(2, 8, torch.device("cpu"), layer=0)
    s = _scores64(q, k, valid, 0.3)
    steps = valid[:, 0].sum(-1)  # [B, R]
    theta = thresholds[0][:, steps.clamp(max=T)].permute(1, 0, 2)[..., None].double()  # [B, H, R, 1]
    ref_keep = (s > theta) | theta.isnan()
    ref_keep.scatter_(-1, s.argmax(-1, keepdim=True), True)
    ref_keep &= valid
    record = LayerRecord()
    out = method_attention(method, state, q, k, v, valid, scaling=0.3, record=record)
    assert torch.equal(record.kept[0], ref_keep.sum(-1).int())
    ref = _attend64(s, ref_keep, v, valid, renormalize, vmc)
    rows = valid[:, 0].any(-1)[:, None].expand(-1, 8, -1)
    assert (out - ref.float())[rows].abs().max() < 1e-4

    # The decode step of the last row of each sequence agrees with the teacher-forced row.
    kernels = type("K", (), {"scale": 0.3})()
    seq_lens = torch.full((2,), 70, dtype=torch.int32)
    res = method.decode_step(q[:, :, -1], k, v, KeyRange(seq_lens, torch.tensor([0, 9], dtype=torch.int32)), state, "sparse", kernels)
    assert torch.equal(res.kept, ref_keep[:, :, -1].sum(-1).int())
    assert (res.out - ref[:, :, -1].float()).abs().max() < 1e-4


def _layer0_scores(model, ids):
    """The scaled scores layer 0's attention receives, from transformers' own query and key states."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def spy(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if module.layer_idx == 0:
            G = query.shape[1] // key.shape[1]
            seen["s"] = (query.double() @ key.double().repeat_interleave(G, 1).transpose(-1, -2)) * scaling
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("layer0_spy", spy)
    previous = model.config._attn_implementation
    model.set_attn_implementation("layer0_spy")
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        model.set_attn_implementation(previous)
    return seen["s"][0]  # [H, T, T]


def test_top_theta_calibration_averages_the_k_plus_first_score_per_row_length():
    model = tiny_llama(seed=2, layers=2, heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (3, 40), generator=g)
    k, sigma = 6, 0.5
    method = TopTheta(k=k, first_layers=0, sigma=sigma).calibrate(model, ids)
    assert method.thresholds.shape == (2, 4, 41)
    # Layer 0 sees the embeddings whatever later layers keep: its thresholds have a closed form.
    per_seq = []
    for window in ids:
        s = _layer0_scores(model, window)  # [H, T, T]
        causal = torch.ones(40, 40, dtype=torch.bool).tril()
        s = s.masked_fill(~causal, float("-inf"))
        per_seq.append(s.topk(k + 1, dim=-1).values[..., k])  # [H, T]; row i has n = i + 1 keys
    x = torch.stack(per_seq)  # [N, H, T]
    expected = x.mean(0) + sigma * x.std(0, unbiased=False)
    got = method.thresholds[0, :, 1:]  # n = 1..40
    assert got[:, :k].isnan().all()  # rows of <= k keys: dense
    assert torch.allclose(got[:, k:].double(), expected[:, k:], rtol=1e-5, atol=1e-5)
    assert method.thresholds[1, :, k + 1:].isfinite().all()


def test_top_theta_prepare_calibrates_once_per_model_and_refuses_without_a_tokenizer():
    model = tiny_llama(seed=1)
    method = TopTheta(k=4, first_layers=0)
    with pytest.raises(CalibrationError, match="no tokenizer"):
        method.prepare(model)
    with pytest.raises(CalibrationError, match="not calibrated"):  # apply installs only: no calibration behind it
        with apply(model, method):
            pass
    assert model.config._attn_implementation != "siftattention" and "generate" not in model.__dict__
    with pytest.raises(CalibrationError, match="not calibrated"):
        method.new_state(1, 4, torch.device("cpu"))
    method.calibrate(model, torch.randint(3, 96, (2, 16)))
    before = method.thresholds
    method.prepare(model)  # calibrated for this model: prepare keeps the thresholds
    with apply(model, method) as handle, torch.no_grad():
        model(torch.randint(3, 96, (1, 20)))
        assert 0 < handle.stats.realized_sparsity() < 1
        with pytest.raises(RuntimeError, match="toptheta keeps no thetas"):
            handle.stats.thetas
    assert method.thresholds is before
    with pytest.raises(CalibrationError, match="calibrated for 2 layers x 4 heads"):
        method.new_state(1, 8, torch.device("cpu"), layer=0)


def test_rival_specs_parse_and_bad_values_fail_in_one_line():
    assert parse_method("skipsoftmax:scale=8,block=64,per_head=true") == SkipSoftmax(scale=8.0, block=64, per_head=True)
    assert parse_method("toptheta:k=32,vmc=false,calib_len=512") == TopTheta(k=32, vmc=False, calib_len=512)
    assert TopTheta(k=32).spec() == "toptheta:k=32,renormalize=False,vmc=True"
    for bad, msg in [("skipsoftmax:scale=0", "scale must be a positive"), ("skipsoftmax:block=0", "block must be"),
                     ("toptheta:k=0", "k must be an integer >= 1"), ("toptheta:calibration=books", "calibration must be one of"),
                     ("toptheta:sigma=nan", "sigma must be a finite number")]:
        with pytest.raises(SpecError, match=msg) as err:
            parse_method(bad)
        assert "\n" not in str(err.value)
    # A sweep plot draws one line per setting that is not swept.
    assert method_family("toptheta:k=32") == method_family("toptheta:k=128") == "toptheta"
    assert method_family("toptheta:k=32,renormalize=true,vmc=false") == "toptheta renorm no-vmc"
    assert method_family("skipsoftmax:scale=4,block=32,per_head=true") == "skipsoftmax block=32 per-head"


# -- generation: the decode steps against the row-wise reference ----------------------------


def _sharp(factory):
    model = factory()
    with torch.no_grad():
        model.get_input_embeddings().weight[0].normal_()
        for layer in model.model.layers:  # peaked attention, so blocks differ in their maxima
            layer.self_attn.q_proj.weight.mul_(12.0)
    return model


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("make", [lambda m: SkipSoftmax(scale=16.0, block=2), lambda m: SkipSoftmax(scale=16.0, block=4, per_head=True),
                                  lambda m: TopTheta(k=4, first_layers=1, first_k=8).calibrate(m, torch.randint(3, 96, (2, 20))),
                                  lambda m: TopTheta(k=3, renormalize=True, vmc=False, first_layers=0).calibrate(m, torch.randint(3, 96, (2, 30)))],
                         ids=["skipsoftmax", "skipsoftmax-per-head", "toptheta", "toptheta-renorm"])
def test_rivals_fast_path_matches_the_reference_path(factory, make):
    from test_generation import NEW, _left_padded_batch, _reference

    model = _sharp(factory)
    torch.manual_seed(5)
    method = make(model)
    ids, mask = _left_padded_batch()
    ref_seq, ref_logp, ref_stats = _reference(model, ids, mask, method)
    res = generate(model, ids, mask, method, max_new_tokens=NEW, pad_token_id=0, eos_token_id=-1, output_scores=True)
    assert res.fast
    assert torch.equal(res.sequences, ref_seq)
    assert (res.scores.log_softmax(-1) - ref_logp).abs().max().item() <= 1e-4
    sparsity = res.stats.realized_sparsity()
    assert sparsity == pytest.approx(ref_stats.realized_sparsity(), abs=1e-12) and sparsity > 0.02


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("make", [lambda m: SkipSoftmax(scale=16.0, block=4),
                                  lambda m: TopTheta(k=4, first_layers=1, first_k=8).calibrate(m, torch.randint(3, 96, (2, 20), device="cuda"))],
                         ids=["skipsoftmax", "toptheta"])
def test_cuda_rivals_in_captured_decode_steps_match_the_reference_path(make):
    """On a GPU the fast loop replays each decode step from a CUDA graph: no host synchronisation inside."""
    from test_generation import NEW, _left_padded_batch, _reference

    model = _sharp(tiny_llama).cuda()
    torch.manual_seed(5)
    method = make(model)
    ids, mask = (t.cuda() for t in _left_padded_batch())
    ref_seq, ref_logp, ref_stats = _reference(model, ids, mask, method)
    res = generate(model, ids, mask, method, max_new_tokens=NEW, pad_token_id=0, eos_token_id=-1, output_scores=True,
                   cuda_graphs=True)
    assert res.fast
    assert torch.equal(res.sequences, ref_seq)
    assert (res.scores.log_softmax(-1) - ref_logp).abs().max().item() <= 1e-3
    assert res.stats.realized_sparsity() == pytest.approx(ref_stats.realized_sparsity(), abs=1e-9)
