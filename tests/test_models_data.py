import pytest
import torch

from siftattention.data import DataNotFoundError, load_corpus, token_windows
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


def test_unknown_model_and_file_paths_raise_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'definitely/not-a-model'.*smollm2-135m"):
        load_model("definitely/not-a-model")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"0")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        load_model(str(f))
    with pytest.raises(ModelNotFoundError, match="directory without a config.json"):
        load_model(str(tmp_path))
    assert "smollm2-135m" in EMBEDDED


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


def test_wikitext2_local_file_is_read_whole(monkeypatch, tmp_path):
    root = tmp_path / "data" / "wikitext-2-raw"
    root.mkdir(parents=True)
    (root / "wiki.test.raw").write_text(" = Title = \n text\n")
    monkeypatch.setenv("SIFT_DATA_DIR", str(tmp_path / "data"))
    corpus = load_corpus("wikitext2")
    assert corpus.text == " = Title = \n text\n" and str(root) in corpus.source
