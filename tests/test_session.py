"""DecodeSession: calls that reuse one cache and its CUDA graphs give what fresh ``generate`` calls give."""

import copy

import pytest
import torch

from conftest import tiny_llama
from siftattention import DecodeSession, Full, Oracle, Sift, TopK
from siftattention.generation import generate

NEW = 10
PROMPT = 20

METHODS = [
    Full(),
    # Prompt calibration (every row has >= 12 real tokens), a recalibration every 3 sparse steps, value-mean
    # compensation and one kept set per KV group; warmup=4 serves a batch whose prompts are too short.
    Sift(tau=0.6, warmup=4, recalibrate_every=3, vmc=True, gqa="shared"),
    TopK(k=0.3),
    Oracle(tau=0.6, vmc=True),
]
IDS = ["full", "sift", "topk", "oracle"]


def _model(device="cpu"):
    model = tiny_llama(seed=11)
    with torch.no_grad():  # a zero pad embedding would make exact probability ties (see test_generation)
        model.get_input_embeddings().weight[0].normal_()
    return model.to(device)


def _batch(seed, prompt=PROMPT, pads=(0, 3, 6), device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (len(pads), prompt), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


OPTIONS = dict(eos_token_id=-1, pad_token_id=0, output_scores=True)


def _stats(res):
    s = res.stats
    out = {"per_head": s.per_head(), "per_sequence": s.realized_sparsity(per_sequence=True),
           "post_warmup": s.per_head(post_warmup=True), "steps": torch.tensor(s.step_count())}
    state = s.state(s.layers[0]) if s.layers else None
    for name in ("thetas", "alpha", "beta", "fit_sums", "value_sum", "count", "r2"):
        if state is not None and getattr(state, name, None) is not None:
            out[name] = torch.stack([getattr(s.state(layer), name).cpu() for layer in s.layers])
    return out


def _assert_same(res, ref, exact=True):
    assert res.fast and torch.equal(res.sequences, ref.sequences)
    assert torch.equal(res.num_generated, ref.num_generated)
    if exact:
        assert torch.equal(res.scores, ref.scores)
    else:  # another cache capacity on the GPU: another split of the keys, other roundings
        assert torch.allclose(res.scores, ref.scores, rtol=1e-4, atol=1e-4)
    mine, theirs = _stats(res), _stats(ref)
    assert mine.keys() == theirs.keys()
    for name in mine:
        if exact:
            assert torch.equal(mine[name], theirs[name]), name
        else:
            assert torch.allclose(mine[name].double(), theirs[name].double(), rtol=1e-4, atol=1e-5, equal_nan=True), name


def _calls(device, shorter):
    """Three batches of one shape (the third with no padding), and a shorter prompt where asked."""
    calls = [_batch(1, device=device), _batch(2, pads=(5, 0, 2), device=device), _batch(3, pads=(0, 0, 0), device=device)]
    if shorter:
        calls.append(_batch(4, prompt=PROMPT - 6, pads=(0, 1, 2), device=device))
    return calls


def _check_session(device, method, shorter_exact):
    model = _model(device)
    calls = _calls(device, shorter=True)
    refs = [generate(model, ids, mask, copy.deepcopy(method), max_new_tokens=NEW, **OPTIONS) for ids, mask in calls]
    with DecodeSession(model, copy.deepcopy(method), batch_size=3, max_len=PROMPT + NEW, max_new_tokens=NEW,
                       **OPTIONS) as session:
        results, addresses = [], []
        for ids, mask in calls:
            results.append(session.generate(ids, mask))
            addresses.append(session._loop._addresses())
        first = _stats(results[0])
    for i, (res, ref) in enumerate(zip(results, refs)):
        _assert_same(res, ref, exact=i < 3 or shorter_exact)
    # The buffers, states and weights the graphs read stayed where they were.
    assert addresses[1:] == addresses[:-1]
    # A result's statistics are its own: later calls refill the states they were read from.
    assert all(torch.equal(a, b) for a, b in zip(first.values(), _stats(results[0]).values()))
    return results


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_session_calls_equal_fresh_generate_calls(method):
    results = _check_session("cpu", method, shorter_exact=True)
    assert all(r.timings["captures"] == 0 for r in results)  # no graphs on the CPU
    if isinstance(method, Sift):  # the prompts calibrated, and recalibration ran
        assert "recalibrate" in results[0].timings["phases"]


def test_session_calibrates_or_warms_up_per_prompt():
    # A batch whose prompts are too short to calibrate runs the decode warmup, the next one calibrates
    # again: the method's host-side phase plan follows each prompt.
    model = _model()
    method = Sift(tau=0.6, warmup=4, recalibrate_every=3)
    calls = [_batch(5), _batch(6, prompt=8, pads=(0, 1, 2)), _batch(7)]
    refs = [generate(model, ids, mask, copy.deepcopy(method), max_new_tokens=NEW, **OPTIONS) for ids, mask in calls]
    with DecodeSession(model, method, 3, PROMPT + NEW, max_new_tokens=NEW, **OPTIONS) as session:
        results = [session.generate(ids, mask) for ids, mask in calls]
    assert "warmup" in results[1].timings["phases"] and "warmup" not in results[2].timings["phases"]
    for res, ref in zip(results, refs):
        _assert_same(res, ref)


def test_session_refuses_a_shape_it_cannot_serve_in_one_line():
    model = _model()
    with DecodeSession(model, Full(), batch_size=3, max_len=PROMPT + NEW, max_new_tokens=NEW, **OPTIONS) as session:
        ids, mask = _batch(1)
        for bad in [dict(input_ids=ids[:2], attention_mask=mask[:2]),  # another batch size
                    dict(input_ids=torch.cat([ids, ids], 1), attention_mask=torch.cat([mask, torch.ones_like(mask)], 1)),  # too long
                    dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW + 1)]:
            with pytest.raises(ValueError, match="serves 3 rows") as err:
                session.generate(**bad)
            assert "\n" not in str(err.value)
        assert session.generate(ids, mask, max_new_tokens=NEW - 4).new_tokens.shape == (3, NEW - 4)
    assert session.closed and model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="closed"):
        session.generate(ids, mask)


def test_a_state_made_anew_between_calls_is_noticed():
    # A forward pass of the model between calls makes the method's states anew (the handle's reset):
    # the fingerprint of what the graphs read changes, so the next call would capture its graphs again.
    model = _model()
    method = Sift(tau=0.6, warmup=4, recalibrate_every=3, vmc=True)
    ids, mask = _batch(1)
    with DecodeSession(model, method, 3, PROMPT + NEW, max_new_tokens=NEW, **OPTIONS) as session:
        before = session.generate(ids, mask)
        addresses = session._loop._addresses()
        session._handle.reset()  # what transformers' generate under the session's handle would do first
        again = session.generate(ids, mask)
        assert session._loop._addresses() != addresses
    _assert_same(again, before)


def _cuda_graphs_session(method):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the session's graphs are CUDA graphs (the CPU tests above run its steps eagerly)")
    results = _check_session("cuda", method, shorter_exact=False)
    assert results[0].timings["captures"] >= 1
    assert [r.timings["captures"] for r in results[1:]] == [0] * (len(results) - 1)  # replays only
    assert all(r.timings["recaptures"] == 0 for r in results)
    return results


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_cuda_session_replays_its_graphs_and_equals_fresh_calls(method):
    _cuda_graphs_session(method)


def test_cuda_session_captures_again_after_a_state_moved():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (CUDA graphs)")
    model = _model("cuda")
    method = Sift(tau=0.6, warmup=4, recalibrate_every=3, vmc=True)
    ids, mask = _batch(1, device="cuda")
    ref = generate(model, ids, mask, copy.deepcopy(method), max_new_tokens=NEW, **OPTIONS)
    with DecodeSession(model, method, 3, PROMPT + NEW, max_new_tokens=NEW, **OPTIONS) as session:
        session.generate(ids, mask)
        session._handle.reset()  # the states are made anew by the next prompt
        res = session.generate(ids, mask)
    assert res.timings["recaptures"] == res.timings["captures"] >= 1
    _assert_same(res, ref)
