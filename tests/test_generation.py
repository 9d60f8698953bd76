"""The fast decode loop (siftattention.generation) against transformers and the row-wise reference."""

import os
import warnings

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from siftattention import H2O, AlreadyAppliedError, Full, Oracle, Sift, TopK, apply
from siftattention.generation import generate

NEW = 14


def _model(factory):
    model = factory()
    # The pad token's embedding row starts at zero (padding_idx): a generated pad token would then
    # attend uniformly, and exact probability ties make top-k's choice of keys arbitrary.
    with torch.no_grad():
        model.get_input_embeddings().weight[0].normal_()
    return model


def _left_padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _reference(model, ids, mask, method, new=NEW):
    """transformers' generate with the method's row-wise ``select`` path (an independent reference)."""
    with apply(model, method, decode_backend=None) as handle:
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
            eos_token_id=None, output_scores=True, return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.scores, 1).log_softmax(-1), handle.stats


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_dense_fast_path_equals_transformers_generate(factory):
    model = _model(factory)
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = generate(model, ids, mask, Full(), max_new_tokens=NEW, pad_token_id=0, eos_token_id=-1)
    assert res.fast
    assert torch.equal(res.sequences, ref)
    # The loop names the cache as this transformers' forward does (5.24 deprecates `past_key_values`).
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert model.config._attn_implementation == "sdpa" and "generate" not in model.__dict__


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize(
    "method",
    [Full(), TopK(k=0.3), Sift(tau=0.6, warmup=5), Sift(tau=0.7, warmup=4, renormalize=True), Oracle(tau=0.6),
     Sift(tau=0.7, warmup=5, normalizer="anchored", anchor_first=2, anchor_last=3),
     Sift(tau=0.7, warmup=4, renormalize=True, normalizer="anchored", anchor_first=1, anchor_last=4)],
    ids=["full", "topk", "sift", "sift-renorm", "oracle", "sift-anchored", "sift-anchored-renorm"],
)
def test_fast_path_matches_the_reference_path(factory, method):
    """Same tokens and per-step log-probs (fp32) for a left-padded batch; Sift's warmup ends mid-generation."""
    model = _model(factory)
    ids, mask = _left_padded_batch()
    ref_seq, ref_logp, ref_stats = _reference(model, ids, mask, method)
    res = generate(model, ids, mask, method, max_new_tokens=NEW, pad_token_id=0, eos_token_id=-1, output_scores=True)
    assert torch.equal(res.sequences, ref_seq)
    assert (res.scores.log_softmax(-1) - ref_logp).abs().max().item() <= 1e-4
    if not method.always_exact:
        assert res.stats.realized_sparsity() == pytest.approx(ref_stats.realized_sparsity(), abs=1e-12)
        post = res.stats.realized_sparsity(post_warmup=True)
        assert post == pytest.approx(ref_stats.realized_sparsity(post_warmup=True), abs=1e-12) and post > 0.05
        assert torch.allclose(res.stats.realized_sparsity(per_sequence=True), ref_stats.realized_sparsity(per_sequence=True))
    if isinstance(method, Sift):
        for attr in ("alpha", "beta", "thetas"):
            assert torch.allclose(getattr(res.stats, attr), getattr(ref_stats, attr), rtol=1e-5, atol=1e-7), attr
        # The fit runs once, after the last warmup step of every layer, and is timed apart.
        phases = res.timings["phases"]
        assert (phases["warmup"]["steps"], phases["after_warmup"]["steps"]) == (method.warmup, 1)
        assert phases["sparse"]["steps"] == NEW - 1 - method.warmup


@pytest.mark.parametrize("method", [Full(), Sift(tau=0.6, warmup=4)], ids=["full", "sift"])
def test_a_chunked_prefill_gives_the_unchunked_tokens(method):
    """Prompt chunks after the first run the lower-right causal kernel (no padding) or the mask (padding)."""
    model = _model(tiny_llama)
    ids, mask = _left_padded_batch(seed=7)
    for m in (mask, torch.ones_like(mask)):
        whole = generate(model, ids, m, method, max_new_tokens=8, eos_token_id=-1, output_scores=True)
        chunked = generate(model, ids, m, method, max_new_tokens=8, eos_token_id=-1, output_scores=True, prefill_chunk=4)
        assert torch.equal(chunked.sequences, whole.sequences)
        assert (chunked.scores.log_softmax(-1) - whole.scores.log_softmax(-1)).abs().max().item() <= 1e-4


def test_compiled_decode_steps_give_the_eager_tokens():
    """``compile=True`` runs the decode step's model code through torch.compile (the attention stays
    eager): the same tokens and, within float32 reassociation, the same log-probs as the eager loop,
    dense (Sift's warmup) steps and sparse steps alike."""
    import copy

    method = Sift(tau=0.6, warmup=4)
    model = _model(tiny_qwen2)
    ids, mask = _left_padded_batch(seed=3)
    eager = generate(model, ids, mask, copy.deepcopy(method), max_new_tokens=8, eos_token_id=-1, output_scores=True)
    compiled = generate(model, ids, mask, copy.deepcopy(method), max_new_tokens=8, eos_token_id=-1, output_scores=True,
                        compile=True)
    assert "_siftattention_compiled_forward" in model.__dict__  # the decode steps ran the compiled forward
    assert torch.equal(compiled.sequences, eager.sequences)
    assert (compiled.scores.log_softmax(-1) - eager.scores.log_softmax(-1)).abs().max().item() <= 1e-4
    assert compiled.stats.realized_sparsity() == pytest.approx(eager.stats.realized_sparsity(), abs=1e-12)
    assert compiled.stats.realized_sparsity(post_warmup=True) > 0.05


def test_compile_without_a_cpp_compiler_warns_once_and_decodes_eagerly(monkeypatch):
    """On the CPU torch.compile builds C++: with no compiler, one warning before the prefill, then the eager steps."""
    from siftattention.notices import SiftWarning

    model = _model(tiny_qwen2)
    ids, mask = _left_padded_batch(seed=5)
    eager = generate(model, ids, mask, Full(), max_new_tokens=4, eos_token_id=-1)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = generate(model, ids, mask, Full(), max_new_tokens=4, eos_token_id=-1, compile=True)
    said = [w for w in caught if issubclass(w.category, SiftWarning)]
    assert [str(w.message) for w in said] == [
        "siftattention.generate: compile=True is not used: torch.compile needs a C++ compiler on the CPU and found "
        "none (/nonexistent/c++); the decode steps run eagerly"]
    assert said[0].filename == __file__  # pointed at the caller's line
    assert "_siftattention_compiled_forward" not in model.__dict__
    assert torch.equal(res.sequences, eager.sequences)


class _KeepAllSift(Sift):
    """Sift whose fitted threshold is 0 (alpha = 0), so every key passes the filter."""

    def _fit(self, state, which):
        super()._fit(state, which)
        state.log_alpha.fill_(float("-inf"))  # alpha = 0: the threshold is 0


def test_sift_that_keeps_everything_generates_full_tokens():
    model = _model(tiny_llama)
    ids, mask = _left_padded_batch(seed=3)
    full = generate(model, ids, mask, Full(), max_new_tokens=NEW, eos_token_id=-1)
    keep_all = _KeepAllSift(tau=0.5, warmup=3)
    res = generate(model, ids, mask, keep_all, max_new_tokens=NEW, eos_token_id=-1)
    assert torch.equal(res.sequences, full.sequences)
    assert res.stats.realized_sparsity(post_warmup=True) == pytest.approx(0.0, abs=1e-12)
    assert res.stats.step_count(post_warmup=True) == 3 * (NEW - 1 - 3)


def test_eos_stops_rows_and_pads_after_them():
    model = _model(tiny_llama)
    ids, mask = _left_padded_batch(seed=5)
    free = generate(model, ids, mask, Full(), max_new_tokens=NEW, eos_token_id=-1)
    eos = int(free.new_tokens[1, 3])  # row 1 emits it at step 3 at the latest
    res = generate(model, ids, mask, Full(), max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(res.sequences, ref)
    assert int(res.num_generated[1]) <= 4


def test_methods_without_a_device_step_fall_back_with_one_warning():
    model = _model(tiny_llama)
    ids, mask = _left_padded_batch(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = generate(model, ids, mask, H2O(k=0.5), max_new_tokens=6, eos_token_id=-1)
    messages = [str(w.message) for w in caught if "siftattention" in str(w.message)]
    assert len(messages) == 1 and "h2o" in messages[0] and "\n" not in messages[0]
    assert not res.fast and res.fallback_reason
    ref_seq, _, _ = _reference(model, ids, mask, H2O(k=0.5), new=6)
    assert torch.equal(res.sequences, ref_seq)


def test_models_without_a_fixed_cache_path_fall_back():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, attn_logit_softcapping=50.0, sliding_window=8, pad_token_id=0,
    )
    model = Gemma2ForCausalLM(cfg).eval()
    ids, mask = _left_padded_batch(seed=2)
    with pytest.warns(UserWarning, match="soft-capping"):
        res = generate(model, ids, mask, Sift(tau=0.6, warmup=3), max_new_tokens=5, eos_token_id=-1)
    assert not res.fast
    ref_seq, _, _ = _reference(model, ids, mask, Sift(tau=0.6, warmup=3), new=5)
    assert torch.equal(res.sequences, ref_seq)


def test_one_handle_per_model_also_on_the_fast_path():
    model = _model(tiny_llama)
    ids, mask = _left_padded_batch()
    previous = model.config._attn_implementation
    with apply(model, Sift(tau=0.6, warmup=4)) as outer:
        with pytest.raises(AlreadyAppliedError, match="remove that handle"):
            apply(model, TopK(k=0.5))
        with pytest.raises(AlreadyAppliedError):
            generate(model, ids, mask, Full(), max_new_tokens=3)
        assert model.config._attn_implementation == outer.name  # the first handle still runs
    assert model.config._attn_implementation == previous and "generate" not in model.__dict__
    res = generate(model, ids, mask, Full(), max_new_tokens=3, eos_token_id=-1)
    assert res.fast and model.config._attn_implementation == previous and "generate" not in model.__dict__


@pytest.mark.parametrize("method", [Full(), Sift(tau=0.6, warmup=4)], ids=["full", "sift"])
def test_the_cache_is_freed_when_generate_returns(method, monkeypatch):
    # Without reference cycles the buffers go with the last reference, not at the next
    # garbage collection: a batch's cache (tens of GB on a GPU) must not outlive the call.
    import gc
    import weakref

    from siftattention.generation import cache as cache_module

    caches = []
    init = cache_module.FixedCache.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    monkeypatch.setattr(cache_module.FixedCache, "__init__", spy)
    model = _model(tiny_llama)
    ids, mask = _left_padded_batch()
    gc.disable()
    try:
        res = generate(model, ids, mask, method, max_new_tokens=6, eos_token_id=-1)
        assert res.fast and len(caches) == 1
        assert caches[0]() is None
    finally:
        gc.enable()


def test_bad_inputs_fail_before_any_work():
    model = _model(tiny_llama)
    ids, mask = _left_padded_batch()
    right_padded = mask.flip(1)
    with pytest.raises(ValueError, match="left padding"):
        generate(model, ids, right_padded, Full(), max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, mask, Full(), max_new_tokens=0)
    with pytest.raises(TypeError, match="siftattention method"):
        generate(model, ids, mask, "sift", max_new_tokens=3)
    assert model.config._attn_implementation == "sdpa"


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=6, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM(cfg).eval()


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=7, pad_token_id=0)
    return MistralForCausalLM(cfg).eval()


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, pad_token_id=0)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("factory", [_gemma3, _mistral, _qwen3], ids=["gemma3-sliding", "mistral-window", "qwen3"])
def test_fast_path_serves_sliding_windows_and_other_families(factory):
    """Sliding-window layers (a start offset of the valid range) and qk-norm models, left-padded."""
    model = _model(factory)
    ids, mask = _left_padded_batch(seed=4)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(generate(model, ids, mask, Full(), max_new_tokens=12, eos_token_id=-1).sequences, ref)
    method = Sift(tau=0.6, warmup=4)
    ref_seq, _, ref_stats = _reference(model, ids, mask, method, new=12)
    res = generate(model, ids, mask, method, max_new_tokens=12, eos_token_id=-1)
    assert res.fast and torch.equal(res.sequences, ref_seq)
    assert res.stats.realized_sparsity(post_warmup=True) == pytest.approx(ref_stats.realized_sparsity(post_warmup=True), abs=1e-12)


_COMPILE_AHEAD_SCRIPT = '''
import json, torch
from triton.runtime.jit import JITFunction
from conftest import tiny_llama
from siftattention import Sift, apply
from siftattention.generation import generate

calls = []
real = JITFunction._do_compile
def spy(self, key, signature, device, constexprs, options, attrs, warmup):
    calls.append([self.__name__, bool(warmup)])
    return real(self, key, signature, device, constexprs, options, attrs, warmup)
JITFunction._do_compile = spy
model = tiny_llama(seed=4).cuda()
ids = torch.randint(3, 96, (2, 150), device="cuda")
mask = torch.ones_like(ids)
res = generate(model, ids, mask, Sift(tau=0.5, warmup=4, warmup_source="decode"), max_new_tokens=10)
with apply(model, Sift(tau=0.5, warmup=4, warmup_source="decode")), torch.no_grad():
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, min_new_tokens=10)
print(json.dumps(dict(calls=calls, fast=res.sequences.tolist(), reference=out.tolist())))
'''


def test_cuda_new_plans_compile_their_kernels_ahead(tmp_path, monkeypatch):
    # On a GPU every kernel of Sift's warmup and sparse steps is compiled ahead, side by side,
    # when the decode plan is made (fast loop, and each capacity of transformers' generate):
    # a fresh Triton cache, and no kernel compiles at its launch. The paper's decode warmup, so that
    # no kernel runs before the first decode plan (prompt calibration launches the warmup kernels
    # at the prefill, where they are first needed).
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from conftest import run_json_script

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.abspath(__file__)) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = tmp_path / "compile_ahead.py"
    script.write_text(_COMPILE_AHEAD_SCRIPT)
    res = run_json_script(str(script), interpret=False)
    kernels = {name for name, _ in res["calls"]}
    assert {"_dense_kernel", "_quantile_kernel", "_scores_kernel", "_filter_kernel"} <= kernels
    assert [c for c in res["calls"] if not c[1]] == []  # nothing compiled at a launch
    assert res["fast"] == res["reference"]


@pytest.mark.parametrize("method", [Sift(tau=0.5, recalibrate_every=4), Sift(tau=0.5, warmup=4, warmup_source="decode")],
                         ids=["recalibrate", "decode-warmup"])
def test_cuda_later_phases_are_captured_without_an_eager_step(method):
    # After the loop's first (eager) step, a phase whose kernels the plan compiled and launched ahead
    # is captured on its first step: Sift's recalibration steps and its sparse steps after a decode
    # warmup. Tokens and statistics are those of the eager loop.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (CUDA graphs)")
    model = tiny_llama(seed=4).cuda()
    ids = torch.randint(3, 96, (2, 150), device="cuda")
    mask = torch.ones_like(ids)
    eager = generate(model, ids, mask, method, max_new_tokens=20, eos_token_id=-1, cuda_graphs=False)
    res = generate(model, ids, mask, method, max_new_tokens=20, eos_token_id=-1)
    phases = res.timings["phases"]
    first, later = ("sparse", "recalibrate") if method.warmup_source == "prompt" else ("warmup", "sparse")
    assert (phases[first]["eager"], phases[first]["captures"]) == (1, 1)
    assert (phases[later]["eager"], phases[later]["captures"]) == (0, 1)
    assert res.timings["captures"] == 2
    assert torch.equal(res.sequences, eager.sequences)
    assert torch.equal(res.stats.per_head(), eager.stats.per_head())
    assert torch.equal(res.stats.beta, eager.stats.beta)
