"""Shared fixtures: tiny random models for fast checks, the embedded model once per session.

The Triton kernels are checked under Triton's CPU interpreter, in subprocesses (``run_interpreted``).
``make test`` runs every kernel configuration and code path at least once against its float64
reference; ``SIFT_FULL_KERNEL_TESTS=1`` runs the full matrix (the sizes and combinations that repeat a
path: tests/test_kernels.py's docstring lists them). The interpreted runs start ahead, in the
background, when collection ends, and the tests that read them run last (the ``interpreted`` mark,
below).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub


def full_kernel_tests() -> bool:
    """SIFT_FULL_KERNEL_TESTS=1: the interpreted Triton checks run their full matrix (see tests/test_kernels.py)."""
    return os.environ.get("SIFT_FULL_KERNEL_TESTS", "").strip() == "1"


def _subprocess_env(interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


_RUNNING: set[subprocess.Popen] = set()  # subprocesses of run_json_script, ended at the session's end


def run_json_script(script: str, *args: str, interpret: bool) -> dict:
    """Run ``script`` in a subprocess with the checkout importable, under Triton's CPU interpreter
    (TRITON_INTERPRET=1) or without it, so the setting never leaks into this process; its last
    stdout line, as JSON."""
    p = subprocess.Popen([sys.executable, os.path.abspath(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_subprocess_env(interpret))
    _RUNNING.add(p)
    try:
        stdout, stderr = p.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
    finally:
        _RUNNING.discard(p)
    assert p.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


# Interpreted runs ahead of time. The interpreter is single-threaded and most other tests leave one of
# CI's two cores idle, so the runs that the selected tests name with ``@pytest.mark.interpreted(...)``
# start when collection ends, one at a time in a background thread, in the order the tests need them;
# a test that needs a run not yet started starts it at once. At most one run a core at a time.
_SLOTS = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))
_LOCK = threading.Lock()
_FUTURES: dict[tuple[str, tuple[str, ...]], Future] = {}
_BACKGROUND: ThreadPoolExecutor | None = None
_FOREGROUND = ThreadPoolExecutor(max_workers=16)


def _interpreted_run(script: str, args: tuple[str, ...]) -> dict:
    with _SLOTS:
        return run_json_script(script, *args, interpret=True)


def _future(script: str, args: tuple[str, ...]) -> Future:
    """The run's future: the background's if it has started there, else one started now."""
    key = (os.path.abspath(script), tuple(args))
    with _LOCK:
        fut = _FUTURES.get(key)
        if fut is None or fut.cancel():  # not queued, or queued and not yet started: start it now
            fut = _FUTURES[key] = _FOREGROUND.submit(_interpreted_run, *key)
        return fut


def run_interpreted(test_file: str, *args: str) -> dict:
    """``test_file`` run as a script with ``args`` under Triton's CPU interpreter (see run_json_script);
    the result of the same run started ahead where one was (see ``interpreted`` above)."""
    return _future(test_file, args).result()


def triton_worker(test_file: str) -> dict:
    """``test_file``'s ``--triton-worker`` results (run_interpreted); the test skips where triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")
    return run_interpreted(test_file, "--triton-worker")


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreted(*runs): the test reads run_interpreted(its file, *run) for each "
                                       "run (a tuple of arguments); these start ahead, in the background")


def pytest_collection_modifyitems(session, config, items):
    """The tests that read interpreted runs go last, in their order: the runs then have the rest of the
    session to finish on the core the other tests leave, instead of being waited for midway."""
    if importlib.util.find_spec("triton") is None:
        return
    waiting = [item for item in items if item.get_closest_marker("interpreted")]
    if waiting:
        items[:] = [item for item in items if not item.get_closest_marker("interpreted")] + waiting


def pytest_collection_finish(session):
    """Queue the selected tests' interpreted runs (first needed first) on one background thread."""
    global _BACKGROUND
    if importlib.util.find_spec("triton") is None or session.config.option.collectonly:
        return
    runs: list[tuple[str, tuple[str, ...]]] = []
    for item in session.items:
        for mark in item.iter_markers("interpreted"):
            for args in mark.args:
                key = (str(item.path), tuple(args))
                if key not in runs:
                    runs.append(key)
    if not runs:
        return
    _BACKGROUND = ThreadPoolExecutor(max_workers=1)
    with _LOCK:
        for key in runs:
            _FUTURES.setdefault(key, _BACKGROUND.submit(_interpreted_run, *key))


# torch's threads spin at the end of every parallel op until all have arrived; one that shares a core
# with an interpreted run stalls them all, which made small-model tests up to ten times slower. While
# runs are pending, the one in the background takes a core from this process and from the
# subprocesses a test starts (a test that waits for runs computes nothing meanwhile).
_THREADS = torch.get_num_threads()
_OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")


def _interpreted_pending() -> bool:
    with _LOCK:
        return any(not fut.done() for fut in _FUTURES.values())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Each test starts with the threads the cores left by the interpreted runs allow (see above)."""
    threads = max(1, _THREADS - 1) if _interpreted_pending() else _THREADS
    torch.set_num_threads(threads)
    if threads < _THREADS:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    elif _OMP_NUM_THREADS is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = _OMP_NUM_THREADS


def pytest_sessionfinish(session):
    """Runs still queued are dropped, running ones ended (a run the tests did not wait for is of no use)."""
    if _BACKGROUND is not None:
        _BACKGROUND.shutdown(wait=False, cancel_futures=True)
    for p in list(_RUNNING):
        p.kill()


def dtype_tolerance(dtype: str) -> float:
    """Relative error allowed against float64: float32 rounding, or half precision's."""
    return 1e-5 if dtype == "float32" else 1e-2


def run_interpreted_parts(test_file: str, flag: str, parts: list[str]) -> list[dict]:
    """``run_interpreted(test_file, flag, part)`` for every part, side by side (one subprocess per core at
    a time: the interpreter is single-threaded); results in the order of ``parts``."""
    futures = [_future(test_file, (flag, part)) for part in parts]
    return [fut.result() for fut in futures]


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
