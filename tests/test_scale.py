"""Methods inside transformers' tensor parallelism and accelerate device maps (CPU).

Tensor parallelism runs for real: two ranks started by ``torch.distributed.run`` on the
gloo backend load two small random models (Llama, Qwen2) in turn with ``tp_plan="auto"``
(each rank holds half of the heads) and run every method; their logits, tokens and
statistics must equal those of the same model in one process. The device map offloads a
layer to disk, so accelerate's hooks move its weights in at every forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from siftattention import H2O, Full, Oracle, SkipSoftmax, Sift, TopK, TopTheta, apply
from siftattention.generation import generate
from siftattention.parallel import device_map_devices

NEW = 10
RANKS = 2


def _methods() -> dict:
    return {
        "full": Full(),
        "topk": TopK(k=0.25),
        "h2o": H2O(k=0.5),
        "sift": Sift(tau=0.75, warmup=4),  # the warmup ends mid-generation
        "sift_anchored": Sift(tau=0.75, warmup=4, normalizer="anchored"),
        "oracle": Oracle(tau=0.75),
        "skipsoftmax": SkipSoftmax(scale=2, block=4),
        "toptheta": TopTheta(k=4, first_layers=0),
    }


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 90, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    mask[2, :13] = 0
    calibration = torch.randint(2, 90, (2, 48), generator=g)
    return ids, mask, calibration


def _run(model) -> dict:
    """Every method's teacher-forced logits, tokens on both generation paths and statistics."""
    ids, mask, calibration = _inputs()
    out = {}
    for name, method in _methods().items():
        if isinstance(method, TopTheta):
            method.calibrate(model, calibration)
        res: dict = {}
        with apply(model, method) as handle, torch.inference_mode():
            res["logits"] = model(ids, attention_mask=mask).logits.float()
            res["forward_per_head"] = handle.stats.per_head()
            res["hf_tokens"] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
            res["hf_sparsity"] = handle.stats.realized_sparsity()
            if isinstance(method, Sift):
                res["alpha"], res["beta"] = handle.stats.alpha, handle.stats.beta
        fast = generate(model, ids, mask, method, max_new_tokens=NEW)
        res["fast_tokens"] = fast.sequences
        res["fast_per_head"] = fast.stats.per_head()
        res["fast_sparsity"] = fast.stats.realized_sparsity(per_sequence=True)
        out[name] = res
    return out


def _worker(base: str, *names: str) -> None:
    """Each rank's results for the models saved under ``base``/name/model, into ``base``/name."""
    warnings.filterwarnings("ignore")
    for name in names:
        _rank_results(str(Path(base) / name / "model"), Path(base) / name)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _rank_results(model_dir: str, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    rank = torch.distributed.get_rank()
    attn = model.model.layers[0].self_attn
    local_heads = attn.q_proj.weight.to_local().shape[0] // attn.head_dim
    res = _run(model)
    res["local_heads"] = local_heads
    # Thresholds calibrated on the whole model cover other heads than this rank's: prepare calibrates again.
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    foreign = TopTheta(k=4, first_layers=0, calibration="wikitext2", calib_seqs=1, calib_len=64).calibrate(whole, _inputs()[2])
    before = foreign.thresholds.shape[1]
    model._siftattention_tokenizer = lambda text, add_special_tokens: {"input_ids": [2 + b % 88 for b in text.encode()]}
    foreign.prepare(model)
    with apply(model, foreign), torch.inference_mode():
        model(_inputs()[0])
    res["threshold_heads"] = (before, foreign.thresholds.shape[1])
    torch.save(res, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def tensor_parallel_runs(tmp_path_factory):
    """{model: (single-process results, per-rank results)}, both models from one launch (the ranks'
    start, importing torch and transformers, costs more than their work)."""
    # An even vocabulary: transformers 5.17 shards the output layer and asks it to divide by the ranks.
    models = {"llama": tiny_llama(heads=4, kv_heads=2, vocab=98), "qwen2": tiny_qwen2(seed=1, kv_heads=2, vocab=98)}
    base = tmp_path_factory.mktemp("tp")
    for name, model in models.items():
        model.save_pretrained(base / name / "model")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           __file__, "--worker", str(base), *models]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: (_run(model), [torch.load(base / name / f"rank{r}.pt") for r in range(RANKS)])
            for name, model in models.items()}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tensor_parallel_run(request, tensor_parallel_runs):
    """(single-process results, per-rank results) of one model."""
    return tensor_parallel_runs[request.param]


def test_every_rank_holds_a_shard_of_the_heads(tensor_parallel_run):
    _, ranks = tensor_parallel_run
    assert [r["local_heads"] for r in ranks] == [4 // RANKS] * RANKS


def test_top_theta_calibrates_again_for_a_rank_s_heads(tensor_parallel_run):
    _, ranks = tensor_parallel_run
    for rank in ranks:  # calibrated on the whole model's 4 heads, then on the rank's 2 (on a byte-level corpus)
        assert rank["threshold_heads"] == (4, 4 // RANKS)


@pytest.mark.parametrize("name", list(_methods()))
def test_tensor_parallel_ranks_equal_one_process(tensor_parallel_run, name):
    single, ranks = tensor_parallel_run
    ref = single[name]
    for rank in ranks:
        res = rank[name]
        torch.testing.assert_close(res["logits"], ref["logits"], atol=1e-4, rtol=1e-4)
        assert torch.equal(res["hf_tokens"], ref["hf_tokens"])
        assert torch.equal(res["fast_tokens"], ref["fast_tokens"])
        # Every rank reports every head of the model, in the model's order.
        for key in ("forward_per_head", "fast_per_head"):
            assert res[key].shape == ref[key].shape
            torch.testing.assert_close(res[key], ref[key], atol=1e-9, rtol=0)
        assert res["hf_sparsity"] == pytest.approx(ref["hf_sparsity"], abs=1e-9)
        torch.testing.assert_close(res["fast_sparsity"], ref["fast_sparsity"], atol=1e-9, rtol=0)
        if "alpha" in ref:
            torch.testing.assert_close(res["alpha"], ref["alpha"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(res["beta"], ref["beta"], atol=1e-5, rtol=1e-5)
    if name not in ("full", "skipsoftmax"):  # sparsity is 0 by definition / at these tiny lengths
        assert ref["fast_sparsity"].min() > 0


@pytest.mark.parametrize("name", ["topk", "sift", "toptheta"])
def test_a_device_map_with_a_layer_on_disk_gives_the_same_results(tmp_path, name):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(heads=4, kv_heads=2)
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    dispatched = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload", dtype=torch.float32).eval()
    assert type(dispatched.model.layers[1]._hf_hook).__name__ == "AlignDevicesHook"
    ids, mask, calibration = _inputs()
    results = []
    for m in (model, dispatched):
        method = _methods()[name]
        if isinstance(method, TopTheta):
            method.calibrate(m, calibration)
        with apply(m, method) as handle, torch.inference_mode():
            tokens = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
            results.append((tokens, handle.stats.per_head()))
        if m is dispatched:
            with pytest.warns(UserWarning, match="device map spreads it over cpu, disk") as record:
                fast = generate(m, ids, mask, method, max_new_tokens=NEW)
            assert len([w for w in record if "siftattention" in str(w.message)]) == 1
            assert not fast.fast
        else:
            fast = generate(m, ids, mask, method, max_new_tokens=NEW)
        results[-1] += (fast.sequences,)
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-9, rtol=0)
    assert torch.equal(results[0][2], results[1][2])  # the fast loop, and transformers' generate where it falls back
    assert float(results[0][1].mean()) > 0


def test_device_map_devices_names_each_device_once_in_order():
    model = torch.nn.Linear(1, 1)
    assert device_map_devices(model) == []
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": "cpu", "x": "disk"}
    assert device_map_devices(model) == ["cuda:0", "cuda:1", "cpu", "disk"]
    model.hf_device_map = {"": "cuda:0"}
    assert device_map_devices(model) == ["cuda:0"]


def test_a_device_map_on_one_device_keeps_the_fast_loop(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(heads=4, kv_heads=2)
    model.save_pretrained(tmp_path / "model")
    mapped = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="auto", dtype=torch.float32).eval()
    assert len(device_map_devices(mapped)) <= 1  # transformers records {"": "cpu"} or, from 5.23, no map at all
    ids, mask, _ = _inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mapped_run = generate(mapped, ids, mask, Sift(tau=0.75, warmup=4), max_new_tokens=NEW)
    assert not [w for w in caught if "siftattention" in str(w.message)]  # no fallback warning
    plain_run = generate(model, ids, mask, Sift(tau=0.75, warmup=4), max_new_tokens=NEW)
    assert mapped_run.fast and torch.equal(mapped_run.sequences, plain_run.sequences)
    torch.testing.assert_close(mapped_run.stats.per_head(), plain_run.stats.per_head(), atol=1e-9, rtol=0)


def test_sift_ppl_under_torchrun_shards_the_embedded_model_and_rank_0_alone_reports(embedded, tmp_path):
    from siftattention.data import load_corpus, token_windows
    from siftattention.eval.perplexity import evaluate_perplexity
    from siftattention.methods import parse_method

    specs = ["full", "sift:tau=0.875,warmup=32,renormalize=true"]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m", "siftattention.cli",
           "ppl", "--seq-len", "128", "--num-seqs", "1", *[a for spec in specs for a in ("--method", spec)], "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("heads sharded over 3 tensor-parallel ranks") == 1
    assert proc.stdout.count("smollm2-135m / wikitext2, 1 x 128 tokens") == 1  # one table: rank 0's
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.json"]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    model, tokenizer = embedded
    windows = token_windows(load_corpus("wikitext2").text, tokenizer, 128, 1)
    single, _ = evaluate_perplexity(model, windows, [(spec, parse_method(spec)) for spec in specs])
    for row, ref in zip(rows, single):
        assert row["method"] == ref.method
        assert row["ppl"] == pytest.approx(ref.ppl, rel=1e-5)
        assert row["realized_sparsity"] == pytest.approx(ref.realized_sparsity, abs=1e-6)
    assert rows[1]["realized_sparsity"] > 0.3


def test_commands_that_do_not_shard_refuse_torchrun_in_one_line(monkeypatch, capsys):
    from siftattention.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "ifeval", "--method", "full"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sift: error: sift eval does not run under torchrun; ppl, generate, demo do") and "\n" not in err


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(*sys.argv[2:])
