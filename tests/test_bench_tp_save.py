"""The tensor-parallel benchmark's layer-at-a-time checkpoint: what transformers loads is the whole model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_chunked_save_loads_as_one_model_and_the_per_gpu_share_has_its_heads(tmp_path, monkeypatch):
    import bench_generate
    import bench_generate_tp as tp
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(bench_generate.build, "__defaults__", (None, torch.float32, "cpu"))
    shape = dict(tp.LLAMA_70B, hidden_size=128, intermediate_size=256, num_hidden_layers=5, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=32, vocab_size=300)
    args = argparse.Namespace(layers=None, plant_std=2.0, head_corr=0.0, q_scale=0.1)
    tp.save_model(tmp_path / "whole", args, shape, chunk_layers=2)  # chunks of 2, 2 and 1 layers
    tp.save_model(tmp_path / "share", args, tp.per_gpu_shape(shape, 4), chunk_layers=2)
    for name, heads, kv_heads, inter in (("whole", 8, 4, 256), ("share", 2, 1, 64)):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mismatched weight
        cfg = model.config
        assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (
            5, heads, kv_heads, 32, inter)
        attn = model.model.layers[4].self_attn
        assert attn.q_proj.weight.shape == (heads * 32, 128) and attn.q_proj.bias.abs().sum() > 0  # planted query bias
        # Layers of different chunks are planted with different generators.
        assert not torch.equal(model.model.layers[0].self_attn.q_proj.bias, model.model.layers[2].self_attn.q_proj.bias)
        with torch.no_grad():
            assert torch.isfinite(model(torch.randint(3, 300, (1, 9))).logits).all()
