"""Shared fixtures: tiny random models for fast checks, the embedded model once per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub


def full_kernel_tests() -> bool:
    """SIFT_FULL_KERNEL_TESTS=1: the interpreted Triton checks run their full matrix (see tests/test_kernels.py)."""
    return os.environ.get("SIFT_FULL_KERNEL_TESTS", "").strip() == "1"


def run_json_script(script: str, *args: str, interpret: bool) -> dict:
    """Run ``script`` in a subprocess with the checkout importable, under Triton's CPU interpreter
    (TRITON_INTERPRET=1) or without it, so the setting never leaks into this process; its last
    stdout line, as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True, text=True, env=env,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_interpreted(test_file: str, *args: str) -> dict:
    """``test_file`` run as a script with ``args`` under Triton's CPU interpreter (see run_json_script)."""
    return run_json_script(test_file, *args, interpret=True)


def triton_worker(test_file: str) -> dict:
    """``test_file``'s ``--triton-worker`` results (run_interpreted); the test skips where triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")
    return run_interpreted(test_file, "--triton-worker")


def dtype_tolerance(dtype: str) -> float:
    """Relative error allowed against float64: float32 rounding, or half precision's."""
    return 1e-5 if dtype == "float32" else 1e-2


def run_interpreted_parts(test_file: str, flag: str, parts: list[str]) -> list[dict]:
    """``run_interpreted(test_file, flag, part)`` for every part, one subprocess per core at a time
    (the interpreter is single-threaded); results in the order of ``parts``."""
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda part: run_interpreted(test_file, flag, part), parts))


def tiny_llama(seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 97):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=512, pad_token_id=0, eos_token_id=96, bos_token_id=1,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0, kv_heads: int = 1, vocab: int = 97):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=512, pad_token_id=0, eos_token_id=96, bos_token_id=1,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded once."""
    from siftattention.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture
def embedded_by_name(embedded, monkeypatch):
    """``load_model("smollm2-135m")`` hands out the session's embedded model instead of loading it again
    (about 15 s), for tests of what runs after the load; the loading itself is the ``embedded`` fixture's."""
    from siftattention import models

    def load_model(name_or_path=models.DEFAULT_MODEL, *, dtype=torch.float32, device="cpu", tensor_parallel=False):
        assert (name_or_path, dtype, str(device), tensor_parallel) == ("smollm2-135m", torch.float32, "cpu", False)
        return embedded

    monkeypatch.setattr(models, "load_model", load_model)
    return embedded


@pytest.fixture(scope="session")
def wikitext_ids(embedded):
    """The first 256-token window of the WikiText-2 test split shipped in the package."""
    from siftattention.data import load_corpus, token_windows

    corpus = load_corpus("wikitext2")
    assert corpus.source == "siftattention:resources/wikitext2/wiki.test.raw"
    return token_windows(corpus.text, embedded[1], 256, 1)
