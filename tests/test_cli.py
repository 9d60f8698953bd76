import json
import math
import subprocess
import sys

import pytest
import torch

from siftattention.cli import main


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


@pytest.mark.parametrize(
    "args, message",
    [
        (["ppl", "--method", "sift:tau=1.5"], "tau must be in (0, 1)"),
        (["ppl", "--method", "sift:warmup=1"], "warmup must be an integer >= 2"),
        (["ppl", "--method", "topk:k=0"], "k must be in (0, 1]"),
        (["ppl", "--method", "h2o:k=2"], "k must be in (0, 1]"),
        (["ppl", "--method", "oracle:tau=0"], "tau must be in (0, 1)"),
        (["ppl", "--method", "magic"], "unknown method 'magic'"),
        (["ppl", "--method", "full", "--dataset", "nope"], "unknown dataset 'nope'"),
        (["ppl", "--method", "full", "--data-file", "/nonexistent/corpus.txt"], "data file not found: /nonexistent/corpus.txt"),
        (["generate", "--method", "sift:tau=x"], "tau='x' is not a number"),
        # `sift analyze` through the same entry point (its own checks run before any model load).
        (["analyze", "--taus", "0.5,1.5"], "tau must be in (0, 1), got 1.5"),
        (["analyze", "--seq-len", "256", "--warmups", "64,512"], "warmup 512 is longer than the sequence length 256"),
    ],
)
def test_bad_input_is_one_line_on_stderr_with_nonzero_exit(args, message, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert message in err
    assert err.strip().count("\n") == 0 and "Traceback" not in err


def test_ppl_help_documents_the_spec_grammar(capsys):
    main(["ppl", "--help"])  # standalone_mode=False: help returns instead of exiting
    out = capsys.readouterr().out
    assert "NAME[:KEY=VALUE[,KEY=VALUE...]]" in out
    for name in ("full", "topk:k=", "h2o:k=", "sift:tau=", "oracle:tau="):
        assert name in out


def test_empty_corpus_fails_before_the_model_loads(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    code, out, err = run_cli(["ppl", "--model", "no-such-org/no-such-model", "--data-file", str(empty), "--method", "full"], capsys)
    assert code == 2 and err.strip() == f"sift: error: the corpus is empty (file:{empty})"


def test_unknown_model_names_the_model(capsys, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world " * 50)
    code, _, err = run_cli(["ppl", "--model", "no-such-org/no-such-model", "--data-file", str(corpus), "--method", "full"], capsys)
    assert code == 2 and "unknown model 'no-such-org/no-such-model'" in err and "smollm2-135m" in err


def test_console_entry_point_exits_cleanly_on_bad_spec():
    proc = subprocess.run(
        [sys.executable, "-m", "siftattention.cli", "ppl", "--method", "sift:tau=7"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "sift: error: sift: tau must be in (0, 1), got 7.0"


def test_ppl_end_to_end_on_the_embedded_model(tmp_path, capsys, embedded):
    from siftattention.data import find_shared_file, load_corpus, token_windows

    out = tmp_path / "run"
    specs = ["full", "topk:k=0.5", "sift:tau=0.5,warmup=32", "sift:tau=0.75,warmup=32"]
    # WikiText-2 where ../shared/data is beside the checkout, else the offline Wikipedia text.
    dataset = "wikitext2" if find_shared_file("wikitext-2-raw/wiki.test.raw") else "wiki"
    args = ["ppl", "--dataset", dataset, "--seq-len", "96", "--num-seqs", "2", "--out", str(out)]
    for spec in specs:
        args += ["--method", spec]
    main(args)
    printed = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    assert set(result) >= {"model", "dataset", "data_source", "seq_len", "num_seqs", "versions", "results"}
    assert result["data_source"] in printed.replace("\n", "")
    rows = {r["method"]: r for r in result["results"]}
    assert list(rows) == specs
    row_keys = {"method", "ppl", "ppl_post_warmup", "realized_sparsity", "realized_sparsity_post_warmup", "tokens"}
    assert all(set(r) >= row_keys for r in rows.values())
    # Independent reference: transformers' own attention on the same windows.
    model, tokenizer = embedded
    windows = token_windows(load_corpus(result["dataset"]).text, tokenizer, 96, 2)
    with torch.no_grad():
        logits = model(windows).logits[:, :-1]
    flat = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1), reduction="none")
    nll = flat.double().view(2, 95)
    assert rows["full"]["ppl"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-4)
    # Post-warmup: the tokens predicted by rows S > 32, i.e. NLL entries 32.. of each window.
    assert rows["full"]["ppl_post_warmup"] == pytest.approx(math.exp(nll[:, 32:].mean().item()), rel=1e-4)
    assert rows["full"]["realized_sparsity"] == 0.0 and rows["full"]["tokens"] == 2 * 95
    steps = torch.arange(1, 97, dtype=torch.float64)
    assert rows["topk:k=0.5"]["realized_sparsity"] == pytest.approx((1 - torch.ceil(0.5 * steps) / steps).mean().item())
    # Post-warmup covers the tokens predicted at S > 32 for every method.
    assert all(r["tokens_post_warmup"] == 2 * (95 - 32) for r in rows.values())
    assert rows["sift:tau=0.75,warmup=32"]["realized_sparsity_post_warmup"] > rows["sift:tau=0.5,warmup=32"]["realized_sparsity_post_warmup"]
    assert (out / "ppl_vs_sparsity.png").stat().st_size > 10_000
