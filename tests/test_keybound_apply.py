"""The key-bound Sift step under ``apply``: the int8 key copy kept beside transformers' ``DynamicCache``
(``siftattention/key_copy.py``) and the decode steps of ``model.generate()`` that read it."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_llama, tiny_qwen2
from test_generation import _left_padded_batch, _model
from test_keybound import _biased_qwen2, loop_step_check, prompt_ranges

from siftattention import Sift, apply
from siftattention.hf import SiftHandle
from siftattention.kernels import DecodeKernels
from siftattention.kernels.keybound import channel_ranges, quantize_keys
from siftattention.key_copy import KeyCopy, cache_windows

METHOD = dict(tau=0.5, warmup=4, warmup_source="decode")
NEW = 10


def _generate(model, ids, mask, method, **kw):
    with apply(model, method) as handle, torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_scores=True, return_dict_in_generate=True, **kw)
    return out, handle


class Follows:
    """Checks every ``KeyCopy.follow``: the copy it returns equals a fresh ``quantize_keys`` of the keys the
    layer's attention received (transformers' cache's keys), per channel with the ranges of each row's valid
    prompt keys (``starts``: the first real token of each row, set per generation)."""

    def __init__(self, monkeypatch) -> None:
        self.starts: torch.Tensor | None = None
        self.calls: list[dict] = []
        real = KeyCopy.follow

        def follow(copy, key, new, starts=None):
            first = copy.buffer is None
            out = real(copy, key, new, starts)
            if copy.form == "channel" and first:
                copy.expected_ranges = prompt_ranges(key, self.starts, key.shape[2])
            fresh = quantize_keys(key, copy.expected_ranges if copy.form == "channel" else None)
            same = torch.equal(out.values, fresh.values) and torch.equal(out.scales, fresh.scales)
            if copy.form == "channel":
                same = same and torch.equal(out.channel, fresh.channel) and torch.equal(out.offset, fresh.offset)
            self.calls.append(dict(new=new, keys=key.shape[2], same=same))
            return out

        monkeypatch.setattr(KeyCopy, "follow", follow)


class Steps:
    """Checks every key-bound step (``DecodeKernels.sparse_keybound``) against the reference and the float64 rule
    (``test_keybound.loop_step_check``): the float64 rule's keys outside its epsilon, the reference's kept counts."""

    def __init__(self, monkeypatch) -> None:
        self.checks: list[dict] = []
        self.ahead = False
        real, real_ahead = DecodeKernels.sparse_keybound, SiftHandle._run_phases_ahead

        def step(kernels, q, k, v, keys, eta, seq_lens, starts=None):
            out, kept = real(kernels, q, k, v, keys, eta, seq_lens, starts)
            if not self.ahead:
                eta = eta.eta() if hasattr(eta, "eta") else eta
                self.checks.append(loop_step_check(q, k, v, keys, eta, kernels.scale, seq_lens, False, starts, kept)[1])
            return out, kept

        def ahead(handle, *args, **kwargs):
            # A new plan on CUDA runs each phase once on a scratch state (its fit not yet made) to load its
            # kernels: not a decode step.
            self.ahead = True
            try:
                return real_ahead(handle, *args, **kwargs)
            finally:
                self.ahead = False

        monkeypatch.setattr(DecodeKernels, "sparse_keybound", step)
        monkeypatch.setattr(SiftHandle, "_run_phases_ahead", ahead)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton key-bound step)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("form", ["row", "channel"])
def test_generate_keeps_the_copy_and_equals_exact_sift_and_the_fast_loop(monkeypatch, form, device):
    """Left-padded rows through ``model.generate()``: the copy is a fresh quantisation of the cache's keys after the
    prefill and after every append, every sparse step is the key-bound step (the float64 rule's keys outside its
    epsilon), and the tokens are exact Sift's under ``apply`` and the fast loop's key-bound Sift's (logits within
    the step's factor). A forward pass outside ``generate`` is Sift's teacher-forced one."""
    from siftattention.generation import generate

    model = _biased_qwen2().to(device)
    ids, mask = (t.to(device) for t in _left_padded_batch())
    follows, steps = Follows(monkeypatch), Steps(monkeypatch)
    follows.starts = ids.shape[1] - mask.sum(1)
    out, handle = _generate(model, ids, mask, Sift(keybound=form, **METHOD))
    layers = len(model.model.layers)
    assert [c["new"] for c in follows.calls] == [ids.shape[1]] * layers + [1] * (NEW - 1) * layers
    assert all(c["same"] for c in follows.calls), follows.calls
    sparse = NEW - 1 - METHOD["warmup"]
    assert len(steps.checks) == sparse * layers and all(s["same"] and s["kept"] for s in steps.checks), steps.checks
    assert not handle._key_copies  # freed with the generation's cache
    exact, _ = _generate(model, ids, mask, Sift(**METHOD))
    assert torch.equal(out.sequences, exact.sequences)
    for a, b in zip(out.scores, exact.scores):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
    monkeypatch.undo()  # the checks sync with the host: not inside the fast loop's CUDA graphs
    fast = generate(model, ids, mask, Sift(keybound=form, **METHOD), max_new_tokens=NEW, eos_token_id=-1, pad_token_id=0,
                    output_scores=True)
    assert fast.fast and torch.equal(fast.sequences, out.sequences)
    torch.testing.assert_close(fast.scores, torch.stack(out.scores, 1), atol=1e-3, rtol=0)
    with torch.no_grad():
        with apply(model, Sift(keybound=form, **METHOD)):
            logits = model(input_ids=ids, attention_mask=mask).logits
        with apply(model, Sift(**METHOD)):
            assert torch.equal(logits, model(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("form", ["row", "channel"])
def test_beam_search_reorders_the_copy(monkeypatch, form):
    """num_beams=2 over two left-padded prompts: the copy follows every reorder of the cache (a fresh quantisation
    of its keys at every call), and the beams and their scores are exact Sift's."""
    model = _biased_qwen2()
    ids, mask = (t[1:] for t in _left_padded_batch())
    follows, steps = Follows(monkeypatch), Steps(monkeypatch)
    follows.starts = (ids.shape[1] - mask.sum(1)).repeat_interleave(2)
    kw = dict(num_beams=2, num_return_sequences=2, length_penalty=0.0, min_new_tokens=NEW)
    out, _ = _generate(model, ids, mask, Sift(keybound=form, **METHOD), **kw)
    exact, _ = _generate(model, ids, mask, Sift(**METHOD), **kw)
    assert len(follows.calls) == NEW * len(model.model.layers) and all(c["same"] for c in follows.calls)
    assert steps.checks and all(s["same"] and s["kept"] for s in steps.checks)
    assert torch.equal(out.sequences, exact.sequences)
    torch.testing.assert_close(out.sequences_scores, exact.sequences_scores, atol=1e-3, rtol=0)


def test_a_second_generate_and_a_reset_cache_start_new_copies(monkeypatch):
    """A second ``generate`` on the same handle, and one on a cache that was reset, quantise their own keys (the
    prompt in chunks: the copy and its ranges from the whole prompt once it is in): each equals a generation on a
    freshly applied model."""
    from transformers import DynamicCache

    model = _biased_qwen2()
    (ids, mask), (other, other_mask) = _left_padded_batch(0), _left_padded_batch(1)
    follows = Follows(monkeypatch)
    method = Sift(keybound="channel", **METHOD)
    common = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None, prefill_chunk_size=5)
    cache = DynamicCache(config=model.config)
    with apply(model, method), torch.no_grad():
        follows.starts = ids.shape[1] - mask.sum(1)
        first = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **common)
        cache.reset()
        again = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **common)
        follows.starts = other.shape[1] - other_mask.sum(1)
        second = model.generate(input_ids=other, attention_mask=other_mask, **common)
    assert all(c["same"] for c in follows.calls) and len(follows.calls) == 3 * NEW * len(model.model.layers)
    assert torch.equal(first, again)
    alone, _ = _generate(model, other, other_mask, method)
    assert torch.equal(second, alone.sequences)


def _sliding_qwen2():
    """A tiny Qwen2 whose second layer has a sliding window of 6 keys (transformers' cache keeps its last 5)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=96, bos_token_id=1,
                      use_sliding_window=True, sliding_window=6, max_window_layers=1)
    return _model(lambda: Qwen2ForCausalLM(cfg).eval())


@pytest.mark.parametrize("form", ["row", "channel"])
def test_sliding_window_layers(monkeypatch, form):
    """A sliding-window layer's cache keeps its last keys: the copy slides with it (its ranges from the whole
    prompt, as in the fast loop), and the tokens are exact Sift's and the fast loop's."""
    from siftattention.generation import generate

    model = _sliding_qwen2()
    assert cache_windows(model, {}, "sift") == {1: 6}
    ids, mask = _left_padded_batch()
    follows, steps = Follows(monkeypatch), Steps(monkeypatch)
    follows.starts = ids.shape[1] - mask.sum(1)
    out, _ = _generate(model, ids, mask, Sift(keybound=form, **METHOD))
    assert all(c["same"] for c in follows.calls)
    assert {c["keys"] for c in follows.calls[1::2][1:]} == {6}  # the sliding layer's decode steps see 5 + 1 keys
    assert steps.checks and all(s["same"] and s["kept"] for s in steps.checks)
    exact, _ = _generate(model, ids, mask, Sift(**METHOD))
    assert torch.equal(out.sequences, exact.sequences)
    monkeypatch.undo()  # the checks sync with the host: not inside the fast loop's CUDA graphs
    fast = generate(model, ids, mask, Sift(keybound=form, **METHOD), max_new_tokens=NEW, eos_token_id=-1, pad_token_id=0)
    assert torch.equal(fast.sequences, out.sequences)


def test_key_copy_follows_appends_crops_slides_and_reorders():
    """``KeyCopy`` on its own: a prompt, appends past its buffer, a crop (the first keys stay), a window's slide
    (the last keys stay), keys it cannot place (quantised again) and a reorder; per channel the prompt's ranges stay."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 30, 8, generator=gen) * torch.linspace(0.5, 4, 8) + 3.0

    def check(copy, k, ranges=None):
        fresh = quantize_keys(k, ranges)
        got = copy.buffer
        assert torch.equal(got.values[:, :, :k.shape[2]], fresh.values) and torch.equal(got.scales[:, :, :k.shape[2]], fresh.scales)

    copy = KeyCopy("row")
    copy.follow(keys[:, :, :5], 5)
    for n in range(6, 13):
        copy.follow(keys[:, :, :n], 1)
    check(copy, keys[:, :, :12])
    cropped = torch.cat([keys[:, :, :9], keys[:, :, 20:21]], 2)  # cropped to 9, then one new key
    out = copy.follow(cropped, 1)
    assert out.values.shape[2] == 10
    check(copy, cropped)
    beam = torch.tensor([1, 1])
    copy.reorder(beam)
    check(copy, cropped[beam])
    copy.follow(keys[:, :, :25], 1)  # 24 keys it never saw: quantised again
    check(copy, keys[:, :, :25])

    sliding = KeyCopy("channel", window=4)
    starts = torch.tensor([0, 2])
    sliding.follow(keys[:, :, :7], 7, starts)
    ranges = channel_ranges(keys[:, :, :7], starts)
    for n in range(8, 12):  # the cache holds its last 3 keys, then one new
        sliding.follow(keys[:, :, n - 4:n], 1)
        check(sliding, keys[:, :, n - 4:n], ranges)
    assert torch.equal(sliding.buffer.channel, ranges[0]) and torch.equal(sliding.buffer.offset, ranges[1])


def test_caches_the_copy_cannot_follow_are_refused_in_one_line():
    """Before any work: a static or quantized cache, a cache of other layers, and assisted decoding where a
    sliding-window layer's cache would be cropped are refused in one line; the handle still serves after."""
    from transformers import StaticCache

    model = tiny_llama()
    assert cache_windows(model, {}, "m") == {} and cache_windows(model, {"use_cache": False}, "m") == {}
    for kwargs, why in [(dict(cache_implementation="static"), "cache_implementation='static'"),
                        (dict(cache=StaticCache(config=model.config, max_cache_len=16)), "StaticLayer")]:
        with pytest.raises(ValueError, match="keeps an int8 copy of the keys beside transformers' cache, which it cannot "
                           "follow here: " + why) as err:
            cache_windows(model, kwargs, "sift:keybound=row")
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="assisted decoding crops the sliding-window layers' caches"):
        cache_windows(_sliding_qwen2(), dict(prompt_lookup_num_tokens=3), "m")
    assert cache_windows(model, dict(prompt_lookup_num_tokens=3), "m") == {}
    ids = torch.randint(3, 97, (1, 5))
    with apply(model, Sift(keybound="row", **METHOD)), torch.no_grad():
        with pytest.raises(ValueError, match="cache_implementation='static'"):
            model.generate(input_ids=ids, max_new_tokens=2, cache_implementation="static")
        assert model.generate(input_ids=ids, max_new_tokens=2, do_sample=False).shape == (1, 7)


def test_the_fast_loops_fallback_serves_keybound(monkeypatch):
    """Where the fast loop cannot serve, ``siftattention.generate`` falls back to ``apply`` with the key-bound step
    too (one warning), with the fast loop's tokens."""
    from siftattention.generation import generate, loop
    from siftattention.notices import FallbackWarning

    model = _model(lambda: tiny_qwen2(kv_heads=2))
    ids, mask = _left_padded_batch()
    kw = dict(max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
    fast = generate(model, ids, mask, Sift(keybound="row", **METHOD), **kw)
    monkeypatch.setattr(loop, "fast_path_problem", lambda model, method: "a reason")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slow = generate(model, ids, mask, Sift(keybound="row", **METHOD), **kw)
    assert [w.category for w in caught] == [FallbackWarning] and not slow.fast
    assert torch.equal(slow.sequences, fast.sequences)
