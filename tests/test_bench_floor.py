"""The end-to-end benchmark's byte floor: the KV bytes a decode step reads, sliding windows included."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_kv_bytes_count_a_sliding_layer_at_its_window():
    from bench_generate_real import kv_bytes
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    gemma = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=6, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]))
    # K and V, 2 rows, 2 KV heads of 16 channels, 2 bytes: three layers at 6 keys and one at 20, or all at 4.
    assert kv_bytes(gemma, 2, 20) == 2 * 2 * (3 * 6 + 20) * 2 * 16 * 2
    assert kv_bytes(gemma, 2, 4) == 2 * 2 * (4 * 4) * 2 * 16 * 2
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert kv_bytes(llama, 2, 20) == 2 * 2 * (3 * 20) * 2 * 16 * 2
