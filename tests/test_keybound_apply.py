"""The key-bound Sift step under ``apply``: the int8 key copy kept beside transformers' ``DynamicCache``
(``siftattention/key_copy.py``) and the decode steps of ``model.generate()`` that read it."""

from __future__ import annotations

import torch

from siftattention.kernels.keybound import channel_ranges, quantize_keys
from siftattention.key_copy import KeyCopy


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
