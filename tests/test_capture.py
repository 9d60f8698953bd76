"""The real-attention capture: its keys are the model's cache, its queries reproduce the model's attention."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_llama  # noqa: E402

from siftattention.capture import CapturedAttention, capture_attention  # noqa: E402


def cache_of(model, ids):
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def attention_outputs(model, ids) -> dict[int, torch.Tensor]:
    """Each layer's attention output before o_proj, [B, N, Hq * D], from a plain forward pass."""
    outs, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.o_proj.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, a[0].detach())))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return outs


def test_capture_equals_the_cache_and_reproduces_attention_in_float64():
    model = tiny_llama(layers=3, heads=4, kv_heads=2)
    ids = torch.randint(3, 97, (2, 13))
    previous = model.config._attn_implementation
    cap = capture_attention(model, ids, layers=[0, 2], positions=[0, 6, 12])
    assert model.config._attn_implementation == previous
    assert cap.layers == [0, 2] and cap.positions == [0, 6, 12]
    cache, outs = cache_of(model, ids), attention_outputs(model, ids)
    for layer in cap.layers:
        assert torch.equal(cap.key[layer], cache[layer][0]) and torch.equal(cap.value[layer], cache[layer][1])
        for index, position in enumerate(cap.positions):
            q, k, v = (t.double() for t in cap.step(layer, index))
            assert k.shape[2] == position + 1
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            p = torch.softmax(torch.einsum("bhd,bhsd->bhs", q, k) * cap.scaling, -1)
            expected = torch.einsum("bhs,bhsd->bhd", p, v).flatten(1)
            torch.testing.assert_close(expected, outs[layer][:, position].double(), rtol=1e-4, atol=1e-5)


def test_capture_computes_logits_for_the_last_position_only():
    model = tiny_llama(layers=2, heads=4, kv_heads=2)
    ids = torch.randint(3, 97, (2, 29))
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[1]))
    try:
        cap = capture_attention(model, ids, layers=[1], positions=[28])
    finally:
        hook.remove()
    assert rows == [1]
    assert torch.equal(cap.key[1], cache_of(model, ids)[1][0])


def test_capture_saves_and_loads(tmp_path):
    model = tiny_llama()
    cap = capture_attention(model, torch.randint(3, 97, (1, 9)), source="planted")
    cap.save(tmp_path / "cap.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["cap.pt"]
    back = CapturedAttention.load(tmp_path / "cap.pt")
    assert back.positions == [8] and back.source == "planted" and back.scaling == cap.scaling
    for layer in cap.layers:
        assert torch.equal(back.query[layer], cap.query[layer]) and torch.equal(back.key[layer], cap.key[layer])


@pytest.mark.parametrize("kwargs, message", [
    (dict(layers=[2]), r"layers \[2\] out of range: the model has 2 layers"),
    (dict(positions=[9]), r"positions \[9\] out of range for a prompt of 9 tokens"),
])
def test_capture_refuses_out_of_range_and_restores_the_model(kwargs, message):
    model = tiny_llama()
    with pytest.raises(ValueError, match=message):
        capture_attention(model, torch.randint(3, 97, (1, 9)), **kwargs)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_capture_on_the_embedded_model_equals_its_cache(embedded):
    from siftattention.data import load_corpus

    model, tokenizer = embedded
    ids = tokenizer(load_corpus("wikitext2").text[:2000], return_tensors="pt").input_ids[:, :256]
    cap = capture_attention(model, ids, layers=[0, 29], positions=[127, 255])
    cache = cache_of(model, ids)
    assert cap.key[29].shape == (1, 3, 256, 64) and cap.query[29].shape == (1, 9, 2, 64)
    for layer in cap.layers:
        assert torch.equal(cap.key[layer], cache[layer][0]) and torch.equal(cap.value[layer], cache[layer][1])
