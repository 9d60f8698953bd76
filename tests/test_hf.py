import copy

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from siftattention import H2O, Full, Oracle, Sift, TopK, apply
from siftattention.generation.loop import _cache_kwarg
from siftattention.hf import UnsupportedModelError
from siftattention.inputs import forward_kwargs


class _KeepAllSift(Sift):
    """Sift whose fitted threshold is forced to ~0, so it keeps every key."""

    def _fit(self, state, which):
        super()._fit(state, which)
        state.log_alpha[which] = float("-inf")  # alpha = 0: the threshold is 0


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def _eager_logits(model, ids, **kwargs):
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return _logits(model, ids, **kwargs)
    finally:
        model.set_attn_implementation(previous)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_full_matches_transformers_eager_attention(factory):
    model = factory()
    ids = torch.randint(3, 97, (2, 45))
    ref = _eager_logits(model, ids)
    with apply(model, Full()):
        out = _logits(model, ids)
    assert (out - ref).abs().max().item() <= 1e-4


def test_method_path_matches_eager_on_the_embedded_model(embedded, wikitext_ids):
    """The library's own attention (scores, mask, selection, softmax, values) against transformers'
    eager attention on real text, through methods that keep every key. Full runs through
    transformers' SDPA; its distance to eager is the float32 noise floor the method path must meet."""
    model, _ = embedded
    ids = wikitext_ids[:, :200]
    ref = _eager_logits(model, ids)
    with apply(model, Full()):
        noise = (_logits(model, ids) - ref).abs().max().item()
    for method in (TopK(k=1.0, renormalize=True), _KeepAllSift(tau=0.875, warmup=16)):
        with apply(model, method) as handle:
            out = _logits(model, ids)
        assert handle.stats.step_count() == 200 and handle.stats.realized_sparsity() == 0.0
        assert (out - ref).abs().max().item() <= max(2e-4, 4 * noise), method


@pytest.mark.parametrize(
    "method", [_KeepAllSift(tau=0.5, warmup=4), TopK(k=1.0), H2O(k=1.0)], ids=["sift-keep-all", "topk-1", "h2o-1"]
)
def test_methods_that_keep_everything_reproduce_full(method):
    model = tiny_llama(seed=1)
    ids = torch.randint(3, 97, (2, 40))
    with apply(model, Full()):
        ref = _logits(model, ids)
    with apply(model, method) as handle:
        out = _logits(model, ids)
    assert (out - ref).abs().max().item() <= 1e-5
    assert handle.stats.realized_sparsity(post_warmup=True) == pytest.approx(0.0, abs=1e-12)
    if isinstance(method, Sift):
        assert handle.stats.step_count(post_warmup=True) == 2 * (40 - 4)  # the approximation did run


def _eager_layer0_probs(model, ids) -> torch.Tensor:
    """Layer 0's attention probabilities [H, T, T] from transformers' eager attention.

    Layer 0 sees only the token embeddings, so its probabilities are the same under any
    method applied to the model (later layers see the method's outputs).
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(ids, output_attentions=True).attentions[0][0].double()
    finally:
        model.set_attn_implementation(previous)


def _sift_layer0_reference(probs: torch.Tensor, tau: float, warmup: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha [H], beta [H], post-warmup realized sparsity [H]) of Sift on layer 0, from first principles.

    Rows S = 1..w record the tau-quantile (torch.quantile, linear interpolation) over the S
    valid keys; numpy's polyfit of log theta on log S gives the power law; rows S > w keep
    the keys with p > alpha * S^-beta, plus the row's largest.
    """
    import numpy as np

    H, T, _ = probs.shape
    steps = np.arange(1, warmup + 1, dtype=np.float64)
    alpha, beta, sparsity = [], [], []
    for h in range(H):
        thetas = np.array([torch.quantile(probs[h, s - 1, :s], tau).item() for s in range(1, warmup + 1)])
        slope, intercept = np.polyfit(np.log(steps), np.log(thetas), 1)
        alpha.append(np.exp(intercept))
        beta.append(-slope)
        per_row = []
        for s in range(warmup + 1, T + 1):
            row = probs[h, s - 1, :s]
            eta = alpha[-1] * s ** -beta[-1]
            kept = int((row > eta).sum()) + int(row.max() <= eta)
            per_row.append(1 - kept / s)
        sparsity.append(np.mean(per_row))
    return torch.tensor(alpha), torch.tensor(beta), torch.tensor(sparsity)


def test_approximating_methods_change_logits_and_restore_the_model():
    model = tiny_llama(seed=2)
    T = 60
    ids = torch.randint(3, 97, (1, T))
    previous = model.config._attn_implementation
    ref = _logits(model, ids)
    steps = torch.arange(1, T + 1, dtype=torch.float64)
    budget = torch.ceil(0.25 * steps)  # TopK and H2O keep ceil(k*S) keys at step S
    # Oracle: the keys strictly above the exact quantile at position tau*(S-1), at least the row max.
    oracle_kept = (steps - 1 - torch.floor(0.75 * (steps - 1))).clamp(min=1)
    expected = {"topk": (1 - budget / steps).mean().item(), "h2o": (1 - budget / steps).mean().item(),
                "oracle": (1 - oracle_kept / steps).mean().item()}
    probs = _eager_layer0_probs(model, ids)
    for method in (Sift(tau=0.75, warmup=8), TopK(k=0.25), H2O(k=0.25), Oracle(tau=0.75)):
        with apply(model, method) as handle:
            out = _logits(model, ids)
            assert model.config._attn_implementation == handle.name
        assert (out - ref).abs().max().item() > 1e-3
        if method.name == "sift":
            alpha, beta, sparsity = _sift_layer0_reference(probs, 0.75, 8)
            torch.testing.assert_close(handle.stats.alpha[0, 0].double(), alpha, rtol=1e-4, atol=1e-7)
            torch.testing.assert_close(handle.stats.beta[0, 0].double(), beta, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(handle.stats.per_head(post_warmup=True)[0, 0].double(), sparsity, rtol=0, atol=2e-3)
        else:
            assert handle.stats.realized_sparsity() == pytest.approx(expected[method.name], abs=1e-9)
        assert model.config._attn_implementation == previous
        assert "generate" not in model.__dict__
    torch.testing.assert_close(_logits(model, ids), ref)


def test_plain_call_returns_a_handle_with_remove():
    model = tiny_llama()
    handle = apply(model, Sift(tau=0.5, warmup=4))
    _logits(model, torch.randint(3, 97, (1, 20)))
    assert handle.stats.alpha.shape == (2, 1, 4) and handle.stats.thetas.shape == (2, 1, 4, 4)
    handle.remove()
    handle.remove()  # idempotent
    assert model.config._attn_implementation != handle.name


def test_causal_masking_is_kept():
    # Without the mask registration transformers would pass no mask: future tokens would leak.
    model = tiny_llama(seed=3)
    ids = torch.randint(3, 97, (1, 30))
    changed = ids.clone()
    changed[0, 20:] = (changed[0, 20:] + 7) % 90 + 3
    with apply(model, Sift(tau=0.5, warmup=4)):
        a, b = _logits(model, ids), _logits(model, changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])


@pytest.mark.parametrize("where", ["tiny", "embedded"])
def test_teacher_forced_equals_token_by_token_decode(where, request):
    from transformers import DynamicCache

    if where == "tiny":
        model, ids = tiny_llama(seed=4), torch.randint(3, 97, (1, 64))
    else:
        # float64: in float32 the two modes differ by ~3e-5 of rounding, enough to flip a
        # key sitting within 1e-7 of the threshold every few thousand rows on a real model.
        model = copy.deepcopy(request.getfixturevalue("embedded")[0]).double()
        ids = request.getfixturevalue("wikitext_ids")[:, :48]
    method = Sift(tau=0.75, warmup=16)
    with apply(model, method) as handle:
        full = torch.log_softmax(_logits(model, ids), -1)
        alpha_tf = handle.stats.alpha.clone()
        cache = DynamicCache(config=model.config)
        cache_arg = _cache_kwarg(forward_kwargs(model))
        steps = []
        with torch.no_grad():
            for i in range(ids.shape[1]):
                out = model(ids[:, i : i + 1], **{cache_arg: cache}, use_cache=True)
                cache = out[cache_arg]
                steps.append(torch.log_softmax(out.logits[:, -1], -1))
        alpha_dec = handle.stats.alpha
    stepwise = torch.stack(steps, dim=1)
    torch.testing.assert_close(alpha_dec, alpha_tf, rtol=1e-5, atol=1e-7)  # same warmup, same fit
    assert (stepwise - full).abs().max().item() <= 1e-4
    assert handle.stats.realized_sparsity(post_warmup=True) > 0.3


def test_generate_with_left_padding_matches_each_prompt_alone():
    model = tiny_llama(seed=5)
    torch.manual_seed(5)
    short, long = torch.randint(3, 95, (1, 7)), torch.randint(3, 95, (1, 13))
    method = Sift(tau=0.6, warmup=4, warmup_source="decode")
    gen = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=None)
    alone, alone_fit = [], []
    with apply(model, method) as handle:
        for ids in (short, long):
            alone.append(model.generate(ids, attention_mask=torch.ones_like(ids), **gen)[0, ids.shape[1] :])
            alone_fit.append((handle.stats.thetas[:, 0].clone(), handle.stats.alpha[:, 0].clone(), handle.stats.beta[:, 0].clone()))
        alone_sparsity = handle.stats.realized_sparsity(post_warmup=True)
        batch = torch.zeros(2, 13, dtype=torch.long)
        mask = torch.zeros(2, 13, dtype=torch.long)
        batch[0, 6:], mask[0, 6:] = short[0], 1  # left padding
        batch[1], mask[1] = long[0], 1
        out = model.generate(batch, attention_mask=mask, **gen)[:, 13:]
        assert handle.stats.step_count() == 2 * (14 - 1)  # decode steps only, padding excluded
        assert handle.stats.realized_sparsity(post_warmup=True) > 0.2
        # Steps count real positions only (P = 7 and 13), and each sequence's warmup
        # quantiles and fit equal its solo run's: padded keys never enter a quantile.
        assert handle.stats.state(0).theta_steps.tolist() == [[8.0, 9.0, 10.0, 11.0], [14.0, 15.0, 16.0, 17.0]]
        for b in range(2):
            torch.testing.assert_close(handle.stats.thetas[:, b], alone_fit[b][0], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(handle.stats.alpha[:, b], alone_fit[b][1], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(handle.stats.beta[:, b], alone_fit[b][2], rtol=1e-4, atol=1e-6)
    assert torch.equal(out[0], alone[0]) and torch.equal(out[1], alone[1])
    assert alone_sparsity > 0.2


def test_generate_prefills_exactly_and_counts_warmup_from_decoded_tokens():
    model = tiny_llama(seed=6)
    ids = torch.randint(3, 95, (1, 30))
    with apply(model, Sift(tau=0.75, warmup=5, warmup_source="decode")) as handle:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        state = handle.stats.state(0)
        # Warmup steps are the first 5 decoded tokens: S = P+1 .. P+5 with P = 30.
        assert state.theta_steps[0].tolist() == [31.0, 32.0, 33.0, 34.0, 35.0]
        assert handle.stats.step_count() == 11 and handle.stats.step_count(post_warmup=True) == 6
    with apply(model, Sift(tau=0.75, warmup=5, warmup_source="prefill")) as handle:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        state = handle.stats.state(0)
        assert state.theta_steps[0].tolist() == [26.0, 27.0, 28.0, 29.0, 30.0]  # the last prompt rows
        assert handle.stats.step_count(post_warmup=True) == 11  # approximation from the first decoded token


def test_model_without_the_attention_interface_is_refused_by_name():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=50, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="BloomForCausalLM"):
        apply(model, Sift())
    with pytest.raises(TypeError, match="method must be"):
        apply(tiny_llama(), "sift")


@pytest.mark.parametrize("source", ["decode", "prefill"])
def test_kernel_decode_path_matches_the_reference_path(source):
    """generate() through siftattention.kernels (torch backend on CPU) = the reference attention."""
    model = tiny_llama(seed=7, heads=8, kv_heads=2)
    ids = torch.randint(3, 95, (2, 21))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    results = {}
    for backend in (None, "torch"):
        with apply(model, Sift(tau=0.7, warmup=6, warmup_source=source), decode_backend=backend) as handle:
            tokens = model.generate(ids, **gen)
            results[backend] = (tokens, handle.stats.realized_sparsity(post_warmup=True), handle.stats.alpha.clone())
    assert torch.equal(results[None][0], results["torch"][0])
    assert results["torch"][1] == pytest.approx(results[None][1], abs=1e-12) and results[None][1] > 0.2
    torch.testing.assert_close(results["torch"][2], results[None][2], rtol=1e-5, atol=1e-7)


def test_decode_backend_is_validated():
    with pytest.raises(ValueError, match="decode_backend"):
        apply(tiny_llama(), Sift(), decode_backend="cuda")


@pytest.mark.parametrize("padded", [False, True])
def test_decode_mode_prefill_equals_transformers(padded):
    """The prompt of a decode runs exactly: the causal kernel without a mask where the mask is
    plain causal, the masked one with left padding; both give transformers' own logits."""
    model = tiny_llama(seed=8, heads=8, kv_heads=2)
    ids = torch.randint(3, 95, (2, 19))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
    gen = dict(attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None,
               output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **gen).logits[0]
    with apply(model, Sift(tau=0.7, warmup=6)):
        out = model.generate(ids, **gen).logits[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_is_causal_block():
    from siftattention.attention import is_causal_block

    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    assert is_causal_block(causal)
    padded = causal.clone()
    padded[1, :, :, 0] = False
    assert not is_causal_block(padded)
    chunk = torch.ones(5, 7, dtype=torch.bool).tril(2)[None, None]  # a chunk of 5 after a prefix of 2
    assert is_causal_block(chunk)
    assert not is_causal_block(torch.ones(5, 7, dtype=torch.bool).tril(1)[None, None])  # misaligned
    assert not is_causal_block(torch.ones(7, 5, dtype=torch.bool).tril()[None, None])
    window = causal & ~torch.ones(5, 5, dtype=torch.bool).tril(-3)  # a sliding window of 3
    assert not is_causal_block(window)


def test_exact_attention_of_a_causal_chunk_matches_float64():
    """A chunk of queries after earlier keys: the lower-right causal kernel against a float64 masked softmax."""
    from siftattention.attention import exact_attention

    g = torch.Generator().manual_seed(4)
    B, Hq, Hkv, Q, K, D = 2, 4, 2, 5, 13, 16
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, Q), (Hkv, K), (Hkv, K)))
    valid = torch.ones(Q, K, dtype=torch.bool).tril(K - Q)
    out = exact_attention(q, k, v, valid[None, None], scaling=0.3, causal=True)
    k64, v64 = (t.double().repeat_interleave(Hq // Hkv, 1) for t in (k, v))
    p = (0.3 * q.double() @ k64.transpose(-1, -2)).masked_fill(~valid, float("-inf")).softmax(-1)
    torch.testing.assert_close(out.double(), p @ v64, rtol=1e-5, atol=1e-6)


def test_plan_capacity_is_the_next_power_of_two_from_128():
    from siftattention.hf import plan_capacity

    assert [plan_capacity(n) for n in (1, 127, 128, 129, 255, 256, 257, 1000, 1024, 1025)] == \
        [128, 128, 128, 256, 256, 256, 512, 1024, 1024, 2048]


def test_generate_plans_decode_kernels_once_per_capacity():
    # transformers' cache grows a key a step; one plan per power-of-two capacity serves it,
    # so a Triton launch plan (and the kernel variants compiled for it) changes only when the length doubles.
    model = tiny_llama(seed=9)
    ids = torch.randint(3, 97, (2, 100))
    with apply(model, Sift(tau=0.5, warmup=4)) as handle, torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False, min_new_tokens=40)
        capacities = sorted({sig[3] for sig in handle._plans})
        decoded = handle.stats.step_count()
    assert out.shape[1] == 140 and decoded > 0
    assert capacities == [128, 256]  # keys 100 to 139: two capacities, not 39 lengths


def test_sliding_window_layers_get_plans_sized_for_their_window():
    # Gemma-3's local layers read at most their window however long the cache: their plan's grids follow the
    # window (DecodeKernels.plan's max_range); the global layer keeps the cache-wide plan.
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, sliding_window=6, pad_token_id=0,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(3, 97, (2, 20))
    with apply(model, Sift(tau=0.5, warmup=4)) as handle, torch.no_grad():
        model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        plans = {sig[3:5]: plan.max_range for sig, plan in handle._plans.items()}
    assert plans == {(128, None): None, (128, 6): 6}


def test_new_plans_compile_their_phases_ahead_on_a_scratch_state(monkeypatch):
    # A new decode plan compiles the kernels of each phase the method names, at once, on a
    # scratch state: the generation, its statistics and the method's state are those of a run
    # that compiles nothing ahead. (The CPU backends compile nothing, so the dry run is forced
    # here and runs the torch kernels; tests/sm90_compile.py checks what Triton is asked for.)
    from siftattention.kernels import DecodeKernels

    model = tiny_llama(seed=9)
    ids = torch.randint(3, 97, (2, 100))
    real, real_compiling = Sift.decode_step, DecodeKernels.compiling

    def run(ahead: bool):
        monkeypatch.setattr(DecodeKernels, "compiles_ahead", property(lambda self: ahead))
        phases = []
        monkeypatch.setattr(Sift, "decode_step", lambda self, *a: (phases.append(a[5]), real(self, *a))[1])
        compiling = []
        monkeypatch.setattr(DecodeKernels, "compiling", lambda self: compiling.append(self) or real_compiling(self))
        with apply(model, Sift(tau=0.5, warmup=4, warmup_source="decode"), decode_backend="torch") as handle, torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False, min_new_tokens=40)
            stats = (handle.stats.realized_sparsity(per_sequence=True), handle.stats.beta, handle.stats.thetas)
            plans = list(handle._plans.values())
        return out, stats, phases, compiling, plans

    out, stats, phases, compiling, plans = run(True)
    out0, stats0, phases0, compiling0, _ = run(False)
    assert torch.equal(out, out0) and all(torch.equal(a, b) for a, b in zip(stats, stats0))
    assert compiling0 == [] and len(plans) == 2 and compiling == plans  # one dry run per plan (capacity)
    layers = len(model.model.layers)
    extra = len(phases) - len(phases0)
    # The first plan (step 0) compiles the warmup and sparse phases; the second (keys past 128, after
    # the 4-step warmup) only the sparse one.
    assert extra == 3 and phases0.count("warmup") == 4 * layers


def test_decode_key_range_is_formed_once_per_step_and_mask(monkeypatch):
    import siftattention.hf as hf

    calls = []
    real = hf._key_range
    monkeypatch.setattr(hf, "_key_range", lambda *a: calls.append(a[1]) or real(*a))
    model = tiny_llama(seed=10)
    ids = torch.randint(3, 97, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: row 1 starts at key 7
    with apply(model, Sift(tau=0.5, warmup=4)) as handle, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        stats = handle.stats.step_count()
    assert out.shape[1] == 42 and stats > 0
    assert calls == list(range(31, 42))  # one range per decode step (11 of them), not one per layer

    # The layers of one forward share the range; the next forward reads its mask again, so a mask a
    # caller changes in place between forwards (inference tensors have no version counter) is seen.
    handle = apply(model, Sift(tau=0.5, warmup=4))
    try:
        cpu = torch.device("cpu")
        with torch.inference_mode():
            valid = torch.ones(2, 1, 1, 20, dtype=torch.bool)
            first = handle._step_keys(0, valid, 20, 2, cpu)
            assert handle._step_keys(1, valid, 20, 2, cpu) is first
            valid[1, ..., :5] = False
            again = handle._step_keys(0, valid, 20, 2, cpu)
        assert again is not first and again.starts.tolist() == [0, 5] and again.steps().tolist() == [20, 15]
        assert torch.allclose(again.log_steps(), torch.tensor([20.0, 15.0]).log())
    finally:
        handle.remove()
