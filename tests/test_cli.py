import json
import math
import os
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


def _plotted_lines(monkeypatch) -> dict:
    """Capture what each saved figure plots: {label: (x, y)} of its lines."""
    from matplotlib.figure import Figure

    lines: dict = {}
    original = Figure.savefig

    def savefig(fig, *args, **kwargs):
        for ax in fig.axes:
            for line in ax.get_lines():
                lines[line.get_label()] = (list(line.get_xdata()), list(line.get_ydata()))
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return lines


def test_ppl_end_to_end_on_the_embedded_model(tmp_path, capsys, embedded_by_name, monkeypatch):
    from siftattention.data import load_corpus, token_windows

    out = tmp_path / "run"
    specs = ["full", "topk:k=0.5", "sift:tau=0.5,warmup=32", "sift:tau=0.75,warmup=32"]
    args = ["ppl", "--dataset", "wikitext2", "--seq-len", "96", "--num-seqs", "2", "--out", str(out)]
    for spec in specs:
        args += ["--method", spec]
    plotted = _plotted_lines(monkeypatch)
    main(args)
    printed = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    assert set(result) >= {"model", "dataset", "data_source", "seq_len", "num_seqs", "versions", "results"}
    assert result["data_source"] == "siftattention:resources/wikitext2/wiki.test.raw"
    assert result["data_source"] in printed.replace("\n", "")
    rows = {r["method"]: r for r in result["results"]}
    assert list(rows) == specs
    row_keys = {"method", "ppl", "ppl_post_warmup", "realized_sparsity", "realized_sparsity_post_warmup", "tokens"}
    assert all(set(r) >= row_keys for r in rows.values())
    # Independent reference: transformers' own attention on the same windows.
    model, tokenizer = embedded_by_name
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
    # The figure: Full as a horizontal line, the swept Sift family as a line through its two
    # points in order of sparsity, and a real PNG of the intended size.
    sift = sorted((rows[s] for s in specs[2:]), key=lambda r: r["realized_sparsity"])
    assert plotted["full"][1] == [rows["full"]["ppl"]] * 2
    assert plotted["sift w=32"] == ([r["realized_sparsity"] for r in sift], [r["ppl"] for r in sift])
    assert plotted["topk"] == ([rows["topk:k=0.5"]["realized_sparsity"]], [rows["topk:k=0.5"]["ppl"]])
    import matplotlib.image

    image = matplotlib.image.imread(out / "ppl_vs_sparsity.png")
    assert image.shape[:2] == (528, 768) and image.std() > 0.05


def test_a_later_run_into_the_same_out_removes_the_stale_figure(tmp_path, capsys, embedded):
    from siftattention.cli import run_ppl

    out = tmp_path / "run"
    run_ppl("smollm2-135m", "wikitext2", None, 24, 1, ("full", "topk:k=0.5", "topk:k=0.25"), out, loaded=embedded)
    assert (out / "ppl_vs_sparsity.png").is_file()
    (out / "notes.txt").write_text("the user's own file\n")
    run_ppl("smollm2-135m", "wikitext2", None, 24, 1, ("full", "topk:k=0.5"), out, loaded=embedded)  # nothing swept
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "results.json"]
    assert [r["method"] for r in json.loads((out / "results.json").read_text())["results"]] == ["full", "topk:k=0.5"]


def test_complete_text_leaves_out_a_character_cut_by_the_token_limit(embedded):
    from siftattention.cli import complete_text

    _, tokenizer = embedded
    text = "Party time \U0001F389\U0001F600 yes"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    whole = [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]
    cut = [n for n, t in enumerate(whole) if t.endswith("\ufffd")]
    assert cut, "the emoji must span several byte-level tokens for this test to mean anything"
    for n in range(len(ids) + 1):
        shown = complete_text(tokenizer, ids[:n])
        assert "\ufffd" not in shown and text.startswith(shown)
        # Only the cut character is left out: the text is the longest complete prefix decoded so far.
        assert shown == max((t for t in whole[: n + 1] if not t.endswith("\ufffd")), key=len)
    assert complete_text(tokenizer, ids) == text
    inside = tokenizer("a \ufffd inside", add_special_tokens=False)["input_ids"]
    assert complete_text(tokenizer, inside) == "a \ufffd inside"  # one the text really has, before its end


def test_generate_says_n_a_when_no_step_came_after_the_warmup(embedded, capsys):
    from siftattention.cli import _print_generations, generate_text

    model, tokenizer = embedded
    res = generate_text(model, tokenizer, "Hello", "sift:warmup=1000,warmup_source=decode", 4)
    assert res.sparsity_post_warmup is None and res.sparsity == 0.0 and res.text
    post = generate_text(model, tokenizer, "Hello", "sift:tau=0.875,warmup=2", 6).sparsity_post_warmup
    assert post is not None and 0.0 < post < 1.0
    full = generate_text(model, tokenizer, "Hello", "full", 2)
    assert (full.sparsity, full.sparsity_post_warmup) == (0.0, 0.0)  # no warmup: every step counts
    _print_generations(model, tokenizer, "Hello", ("sift:warmup=1000,warmup_source=decode", "full"), 4)
    printed = " ".join(capsys.readouterr().out.split())
    assert "realized sparsity 0.000 (post-warmup n/a)" in printed
    assert "realized sparsity 0.000 (post-warmup 0.000)" in printed


@pytest.mark.parametrize("spec", ["full", "sift:tau=0.875,warmup=3", "topk:k=0.25"])
def test_generate_gives_the_same_text_and_sparsity_on_both_paths(embedded, spec):
    from siftattention.cli import generate_text

    model, tokenizer = embedded
    fast = generate_text(model, tokenizer, "Name three rivers.", spec, 8, path="fast")
    reference = generate_text(model, tokenizer, "Name three rivers.", spec, 8, path="reference")
    assert (fast.path, reference.path) == ("fast", "transformers")
    assert fast.text == reference.text and fast.new_tokens == reference.new_tokens == 8
    assert fast.sparsity == pytest.approx(reference.sparsity, abs=1e-12)
    assert fast.sparsity_post_warmup == pytest.approx(reference.sparsity_post_warmup, abs=1e-12)
    assert fast.steady_tokens_per_s > 0 and reference.steady_tokens_per_s is None
    assert fast.tokens_per_s == pytest.approx(8 / fast.seconds)


def test_generate_writes_json_and_names_the_fallback(embedded, tmp_path, capsys, monkeypatch):
    import siftattention.cli as cli_module

    monkeypatch.setattr(cli_module, "_load", lambda name, device, dtype: embedded)
    main(["generate", "--prompt", "Hello", "--method", "full", "--method", "h2o:k=0.5", "--max-new-tokens", "3",
          "--out", str(tmp_path)])
    printed = " ".join(capsys.readouterr().out.split())
    assert "h2o:k=0.5: transformers' generate ran (h2o has no device-side decode step" in printed
    payload = json.loads((tmp_path / "generations.json").read_text())
    assert payload["path"] == "auto" and payload["device"] == "cpu" and payload["max_new_tokens"] == 3
    rows = {r["spec"]: r for r in payload["results"]}
    assert rows["full"]["path"] == "fast" and rows["full"]["fallback_reason"] is None
    assert rows["h2o:k=0.5"]["path"] == "transformers" and rows["h2o:k=0.5"]["steady_tokens_per_s"] is None
    for row in rows.values():
        assert row["new_tokens"] == 3 and row["tokens_per_s"] == pytest.approx(3 / row["seconds"]) and row["text"]
        assert row["first_call_seconds"] > 0


def test_generate_compile_reaches_the_fast_path(embedded, tmp_path, capsys, monkeypatch):
    """--compile hands compile=True to siftattention.generate (tests/test_generation.py checks what it does; the
    real compile of the embedded model takes about a minute on a CPU, so the call runs eagerly here)."""
    import siftattention.cli as cli_module
    import siftattention.generation as generation

    seen, real = [], generation.generate

    def recording(*args, compile=False, **kwargs):
        seen.append(compile)
        return real(*args, **kwargs)

    monkeypatch.setattr(cli_module, "_load", lambda name, device, dtype: embedded)
    monkeypatch.setattr(generation, "generate", recording)
    main(["generate", "--prompt", "Hello", "--method", "full", "--max-new-tokens", "2", "--compile", "--out", str(tmp_path)])
    assert seen == [True, True]  # the untimed first call and the timed one
    assert json.loads((tmp_path / "generations.json").read_text())["compile"] is True


def test_models_say_whether_each_is_installed(capsys):
    from siftattention.models import EMBEDDED

    main(["models"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(EMBEDDED)
    for line, (name, entry) in zip(lines, EMBEDDED.items()):
        assert line.startswith(name)
        status = line.rsplit("; ", 1)[1]
        assert status == ("installed" if entry.installed() else f"not installed: {entry.install}")


def test_help_shows_whole_summaries_and_what_each_option_means(capsys):
    main(["--help"])
    commands = capsys.readouterr().out.split("Commands:")[1].strip().splitlines()
    from siftattention.cli import cli

    # One line a command (no summary wrapped onto a second line), none cut short.
    assert len(commands) == len(cli.commands) and not any(line.rstrip().endswith("...") for line in commands), commands
    main(["ppl", "--help"])
    ppl_help = " ".join(capsys.readouterr().out.split())
    for text in ("--seq-len INTEGER RANGE tokens per window", "--num-seqs INTEGER RANGE number of windows",
                 "--out DIRECTORY directory for results.json and ppl_vs_sparsity.png", "writes into --out: results.json"):
        assert text in ppl_help
    main(["generate", "--help"])
    generate_help = " ".join(capsys.readouterr().out.split())
    assert "NAME[:KEY=VALUE[,KEY=VALUE...]]" in generate_help and "--model TEXT embedded name" in generate_help
    for command in ("generate", "eval", "lm-eval"):
        main([command, "--help"])
        assert "--dtype [float32|bfloat16|float16]" in capsys.readouterr().out


def test_ppl_into_a_pipe_prints_progress_lines_and_strict_json(tmp_path, capsys, embedded, monkeypatch):
    """Off a terminal (captured here, as in `make demo | tee log`), progress comes as plain lines while it
    runs, never rich's bars; results.json is strict JSON (a NaN would be written as null: see the
    write_json row of test_bad_input.py)."""
    from siftattention import progress
    from siftattention.cli import run_ppl

    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    out = tmp_path / "run"
    run_ppl("smollm2-135m", "wikitext2", None, 24, 2, ("full", "sift:tau=0.5,warmup=8"), out, loaded=embedded)
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines.index("perplexity: 0/4 (0:00 elapsed)") < next(i for i, line in enumerate(lines) if line.startswith("perplexity [full]: 1/4"))
    assert any(line.startswith("perplexity [sift:tau=0.5,warmup=8]: 4/4") for line in lines)
    assert not any("perplexity" in line and "━" in line for line in lines)  # no bar drawn at the end

    def strict(name):
        raise AssertionError(f"{name} in results.json")

    rows = json.loads((out / "results.json").read_text(), parse_constant=strict)["results"]
    assert rows[1]["ppl_post_warmup"] > 0 and rows[1]["ppl"] > 0
    assert (out / "results.json").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
