import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from siftattention import models
from siftattention.data import DataFormatError, DataNotFoundError, load_corpus, read_text_file, resource_file, token_windows
from siftattention.models import EMBEDDED, ModelNotFoundError, load_model


def test_local_directory_loads_through_transformers(tmp_path, embedded):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = embedded
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path))
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert tok("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]


def test_unknown_model_and_file_paths_raise_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError) as info:
        load_model("definitely/not-a-model")
    message = str(info.value)
    assert message.startswith("unknown model 'definitely/not-a-model': not an embedded model (smollm2-135m, gemma3-270m, qwen2.5-1.5b)")
    assert "\n" not in message
    f = tmp_path / "weights.bin"
    f.write_bytes(b"0")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        load_model(str(f))
    with pytest.raises(ModelNotFoundError, match="directory without a config.json"):
        load_model(str(tmp_path))


def test_unreachable_hub_fails_at_once_without_retries(monkeypatch):
    # Offline mode unset, as on a user's machine; the probe answers "unreachable" and
    # transformers must then not be asked at all (its retries took ~50 s).
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=models.HUB_PROBE_TIMEOUT_S: False)
    monkeypatch.setattr(models, "_load", lambda *a, **k: pytest.fail("transformers was asked for an unreachable hub's model"))
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="not in the local hub cache with the hub .* unreachable"):
        load_model("no-such-org/no-such-model")
    assert time.perf_counter() - start < 2.0


def test_hub_probe_is_bounded_by_its_timeout(monkeypatch):
    # An endpoint that never answers (a listening socket that never accepts a request in time).
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    start = time.perf_counter()
    try:
        assert models.hub_reachable(timeout=0.5) is False
    finally:
        server.close()
    assert time.perf_counter() - start < 3.0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_reachable() is False


def test_embedded_models_say_whether_they_are_installed():
    import importlib.util

    for name, entry in EMBEDDED.items():
        packages = (entry.package, *entry.more_packages)
        assert entry.installed() == all(importlib.util.find_spec(package) is not None for package in packages), name
    assert EMBEDDED["smollm2-135m"].installed()  # make install puts it in


def test_embedded_model_is_smollm2(embedded):
    model, tokenizer = embedded
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert tokenizer.decode(tokenizer("SiftAttention")["input_ids"]) == "SiftAttention"
    import gguf
    from gguf.gguf_reader import GGUFReader
    from gguf.tensor_mapping import get_tensor_name_map

    # load_model shares one GGUF parse per load; gguf's own names are restored afterwards.
    assert gguf.GGUFReader is GGUFReader and gguf.get_tensor_name_map is get_tensor_name_map


def test_corpora_and_windows(tmp_path, embedded):
    _, tokenizer = embedded
    text = "The quick brown fox jumps over the lazy dog.\n" * 40
    f = tmp_path / "corpus.txt"
    f.write_text(text)
    corpus = load_corpus("wikitext2", f)
    assert corpus.text == text and corpus.source == f"file:{f}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = token_windows(corpus.text, tokenizer, 50, 3)
    assert windows.shape == (3, 50) and windows.flatten().tolist() == ids[:150]  # first non-overlapping windows
    with pytest.raises(ValueError, match="only"):
        token_windows(text, tokenizer, 500, 3)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        token_windows(load_corpus("wiki", empty).text, tokenizer, 16, 1)
    with pytest.raises(DataNotFoundError, match="data file not found"):
        load_corpus("wikitext2", tmp_path / "missing.txt")
    with pytest.raises(DataNotFoundError, match="unknown dataset"):
        load_corpus("imagenet")
    wiki = load_corpus("wiki")
    assert wiki.source.startswith("exllamav2:") and len(wiki.text) > 1_000_000


def test_wikitext2_data_dir_is_read_when_the_package_copy_is_missing(monkeypatch, tmp_path):
    root = tmp_path / "data" / "wikitext-2-raw"
    root.mkdir(parents=True)
    (root / "wiki.test.raw").write_text(" = Title = \n text\n")
    monkeypatch.setenv("SIFT_DATA_DIR", str(tmp_path / "data"))
    assert load_corpus("wikitext2").source == "siftattention:resources/wikitext2/wiki.test.raw"  # the package copy first
    monkeypatch.setattr("siftattention.data.resource_file", lambda relative: None)
    corpus = load_corpus("wikitext2")
    assert corpus.text == " = Title = \n text\n" and corpus.source == f"file:{root / 'wiki.test.raw'}"
    monkeypatch.delenv("SIFT_DATA_DIR")
    with pytest.raises(DataNotFoundError, match="WikiText-2 not found"):
        load_corpus("wikitext2")


def _recorded(source_md: Path) -> tuple[str, int, int]:
    """(sha256, lines, bytes) as the resource's SOURCE.md states them."""
    text = source_md.read_text()
    sha = re.search(r"sha256 `([0-9a-f]{64})`", text).group(1)
    lines, size = re.search(r"([\d,]+) lines.*?([\d,]+) bytes", text, re.S).groups()
    return sha, int(lines.replace(",", "")), int(size.replace(",", ""))


@pytest.mark.parametrize(
    "relative, licence_words",
    [("wikitext2/wiki.test.raw", "Attribution-ShareAlike 3.0 Unported"), ("ifeval/input_data.jsonl", "Apache License")],
)
def test_package_data_matches_its_recorded_source(relative, licence_words):
    path = resource_file(relative)
    assert path is not None and path.is_relative_to(Path(models.__file__).parent / "resources")
    data = path.read_bytes()
    sha, lines, size = _recorded(path.parent / "SOURCE.md")
    assert hashlib.sha256(data).hexdigest() == sha and data.count(b"\n") == lines and len(data) == size
    assert licence_words in (path.parent / "LICENSE").read_text()


def test_packaged_wikitext2_is_the_published_test_split():
    corpus = load_corpus("wikitext2")
    lines = corpus.text.splitlines()
    # The test split starts with the Robert Boulter article; read with universal newlines.
    assert lines[0] == " = Robert Boulter = " and "\r" not in corpus.text and len(lines) == 2891
    assert corpus.source == "siftattention:resources/wikitext2/wiki.test.raw"


def test_a_fresh_process_elsewhere_reads_only_the_package(tmp_path):
    # No $SIFT_DATA_DIR and a working directory with a decoy ../shared beside it: the package copy is read.
    decoy = tmp_path / "shared" / "data" / "wikitext-2-raw"
    decoy.mkdir(parents=True)
    (decoy / "wiki.test.raw").write_text("decoy\n")
    cwd = tmp_path / "work"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SIFT_DATA_DIR"}
    code = "from siftattention.data import load_corpus; c = load_corpus('wikitext2'); print(c.source, len(c.text))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["siftattention:resources/wikitext2/wiki.test.raw", str(len(load_corpus("wikitext2").text))]


def test_binary_and_non_utf8_files_are_refused_by_name(tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"GGUF\x00\x01\x02")
    with pytest.raises(DataFormatError, match=f"data file {re.escape(str(binary))} is binary"):
        load_corpus("wikitext2", binary)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataFormatError, match=f"data file {re.escape(str(latin))} is not UTF-8 text .byte 0xe9 at offset 3"):
        read_text_file(latin)
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"a\r\nb\rc\n")
    assert read_text_file(crlf) == "a\nb\nc\n"
