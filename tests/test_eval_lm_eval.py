"""The lm-eval bridge, offline: tasks defined on local files, run on a tiny model with methods applied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_llama
from test_eval_runner import tiny_chat_tokenizer

from siftattention.methods import Full, Sift, TopK

pytest.importorskip("lm_eval")


def local_tasks(root: Path) -> Path:
    """Two lm-eval tasks on a local JSON-lines file: one generative, one multiple choice."""
    data = root / "qa.jsonl"
    rows = [{"question": f"What is {a} plus {b}?", "answer": str(a + b), "choices": [str(a + b), str(a + b + 1)], "label": 0}
            for a, b in ((1, 2), (3, 4), (2, 2), (5, 1))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\ndoc_to_text: \"Q: {{{{question}}}}\\nA:\"\n"
    (root / "sift_local_gen.yaml").write_text(
        "task: sift_local_gen\n" + common + "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (root / "sift_local_mc.yaml").write_text(
        "task: sift_local_mc\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return root


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return local_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


def test_bridge_runs_local_tasks_with_each_method(task_dir):
    from siftattention.eval.lm_eval_bridge import evaluate_lm_eval

    model, tok = tiny_llama(seed=22), tiny_chat_tokenizer()  # its replies run past the warmup (seed 20 ends at once)
    tasks = ["sift_local_gen", "sift_local_mc"]
    full = evaluate_lm_eval(model, tok, Full(), tasks, batch_size=2, include_path=task_dir)
    assert set(full["results"]) == set(tasks)
    assert "exact_match,none" in full["results"]["sift_local_gen"] and "acc,none" in full["results"]["sift_local_mc"]
    assert full["realized_sparsity"] == 0.0 and full["calls"] > 0

    topk = evaluate_lm_eval(model, tok, TopK(k=0.25), ["sift_local_mc"], batch_size=2, include_path=task_dir)
    # Teacher-forced Top-k keeps ceil(k*S) keys of each row; over ~20-token rows that is a sparsity near 0.6-0.75.
    assert 0.45 < topk["realized_sparsity"] < 0.76 and topk["steps"] > 0

    sift = evaluate_lm_eval(model, tok, Sift(tau=0.75, warmup=3), ["sift_local_gen"], batch_size=2, include_path=task_dir)
    assert sift["realized_sparsity_post_warmup"] > 0.2  # generation went through the method after its warmup
    assert not hasattr(model, "_sift_handle") or model._sift_handle is None  # the model is restored afterwards


def test_bridge_names_an_unknown_task(task_dir):
    from siftattention.eval.lm_eval_bridge import evaluate_lm_eval

    with pytest.raises(ValueError, match="unknown lm-eval task 'no_such_task'"):
        evaluate_lm_eval(tiny_llama(), tiny_chat_tokenizer(), Full(), ["no_such_task"], include_path=task_dir)


def test_lm_eval_command_writes_results(tmp_path, task_dir, capsys):
    from siftattention.cli import main

    model_dir = tmp_path / "model"
    tiny_llama(seed=21).save_pretrained(model_dir)
    tiny_chat_tokenizer().save_pretrained(model_dir)
    main(["lm-eval", "--tasks", "sift_local_gen", "--include-path", str(task_dir), "--model", str(model_dir), "--method", "full",
          "--method", "sift:tau=0.5,warmup=2", "--limit", "2", "--batch-size", "2", "--out", str(tmp_path / "out")])
    files = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert files == ["full.json", "sift_tau_0.5_warmup_2_renormalize_False_warmup_source_prompt.json"]
    payload = json.loads((tmp_path / "out" / files[1]).read_text())
    assert payload["method"] == "sift:tau=0.5,warmup=2" and "sift_local_gen" in payload["results"]
    assert "sift_local_gen" in capsys.readouterr().out
