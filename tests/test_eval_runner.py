"""The generation-eval runner on tiny random models: decode paths, per-row sparsity, resume, sweeps, bad input."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from siftattention.eval import generation_eval as ge
from siftattention.eval.generation_eval import EvalSettings, evaluate_generation, generate_batch, left_pad
from siftattention.eval.tasks import get_task
from siftattention.methods import Full, Sift, TopK

pytest.importorskip("lm_eval")

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def tiny_chat_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A character-level tokenizer whose ids fit tiny_llama's vocabulary (pad 0, bos 1, EOS <|im_end|> = 96)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2}
    for c in string.ascii_letters + string.digits + " \n.,:;?!'\"-_$\\{}()[]=+*#/%<>|":
        vocab[c] = len(vocab)
    vocab["<|im_end|>"] = 96
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = chat_template
    return tok


def ifeval_file(path: Path, n: int = 5) -> Path:
    prompts = ["Write a poem.", "List three fruits, no commas.", "Say hi in lower case.", "Describe a cat.", "Count to five."]
    rows = [{"key": i, "prompt": prompts[i % len(prompts)] * (1 + i % 3), "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class _KeepAllSift(Sift):
    """Sift whose fitted threshold is forced to 0 after the warmup, so it keeps every key."""

    def _fit(self, state, which):
        super()._fit(state, which)
        state.log_alpha[which] = float("-inf")  # alpha = 0: the threshold is 0


def _left_padded_batch(seed: int = 3):
    torch.manual_seed(seed)
    prompts = [torch.randint(3, 95, (n,)).tolist() for n in (5, 11, 8)]
    return left_pad(prompts, pad_id=0)


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_decode_mode_sift_that_keeps_everything_generates_full_tokens(path):
    model = tiny_llama(seed=7)
    ids, mask = _left_padded_batch()
    full = generate_batch(model, ids, mask, Full(), 20, eos_ids=[96], pad_id=0, path=path)
    keep_all = generate_batch(model, ids, mask, _KeepAllSift(tau=0.5, warmup=4), 20, eos_ids=[96], pad_id=0, path=path)
    assert keep_all.tokens == full.tokens
    assert all(s == pytest.approx(0.0, abs=1e-12) for s in keep_all.sparsity_post_warmup)
    real = generate_batch(model, ids, mask, Sift(tau=0.75, warmup=4), 20, eos_ids=[96], pad_id=0, path=path)
    assert min(real.sparsity_post_warmup) > 0.2  # the same setting without the forced threshold does prune


def test_fast_and_reference_paths_give_the_same_tokens_and_sparsity():
    model = tiny_llama(seed=8)
    ids, mask = _left_padded_batch(4)
    probe = generate_batch(model, ids, mask, Full(), 16, eos_ids=[96], pad_id=0, path="reference")
    eos = probe.tokens[1][6]  # a token row 1 emits early: an EOS that ends rows at different steps
    for method in (Full(), Sift(tau=0.75, warmup=4), Sift(tau=0.875, warmup=4, renormalize=True), TopK(k=0.25)):
        ref = generate_batch(model, ids, mask, method, 16, eos_ids=[eos], pad_id=0, path="reference")
        fast = generate_batch(model, ids, mask, method, 16, eos_ids=[eos], pad_id=0, path="fast")
        assert fast.tokens == ref.tokens and fast.hit_eos == ref.hit_eos
        assert fast.sparsity == pytest.approx(ref.sparsity, abs=1e-9, nan_ok=True)
        if isinstance(method, Full):
            assert ref.hit_eos[1] and len(ref.tokens[1]) <= 7 and not all(ref.hit_eos)


def test_row_sparsity_counts_only_the_steps_before_its_eos():
    model = tiny_llama(seed=9)
    ids, mask = _left_padded_batch(5)
    method = Sift(tau=0.75, warmup=3)
    probe = generate_batch(model, ids, mask, Full(), 14, eos_ids=[96], pad_id=0, path="reference")
    eos = probe.tokens[0][5]
    batch = generate_batch(model, ids, mask, method, 14, eos_ids=[eos], pad_id=0, path="reference")
    n = len(batch.tokens[0])
    assert batch.hit_eos[0] and n < max(len(t) for t in batch.tokens)
    alone_ids = ids[:1, mask[0].argmax() :]  # the first prompt without its padding
    alone = generate_batch(model, alone_ids, torch.ones_like(alone_ids), method, n, eos_ids=[eos], pad_id=0, path="reference")
    assert alone.tokens[0] == batch.tokens[0]
    assert batch.sparsity[0] == pytest.approx(alone.sparsity[0], abs=1e-6)


# -- the runner: resume ------------------------------------------------------------------------------
SPECS = ["sift:tau=0.75,warmup=4", "topk:k=0.25"]


def _run(model, tok, out, data, settings, specs=SPECS):
    return evaluate_generation(model, tok, get_task("ifeval"), data, specs, out, settings)


def _comparable(summaries):
    return [{k: v for k, v in s.items() if k != "generation_s"} for s in summaries]


def _rows(out: Path):
    rows = {}
    for path in sorted((out / "ifeval").glob("*.jsonl")):
        rows[path.name] = [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in path.read_text().splitlines()]
    return rows


def test_interrupted_eval_resumes_without_redoing_finished_samples(tmp_path, monkeypatch):
    model, tok = tiny_llama(seed=10), tiny_chat_tokenizer()
    data = get_task("ifeval").load(ifeval_file(tmp_path / "p.jsonl"))
    settings = EvalSettings(model="tiny", max_new_tokens=10, batch_size=2, path="reference")
    whole = _run(model, tok, tmp_path / "whole", data, settings)
    assert [s["method"] for s in whole] == ["full", *SPECS]  # Full added and run first
    assert whole[1]["all"]["agreement"]["rouge_l"] <= 1.0 and whole[0]["all"]["agreement"] is None

    calls = []
    real = ge.generate_batch
    stop_at = [5]  # 3 batches per method: Full done, Sift half done

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ge, "generate_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(model, tok, tmp_path / "resumed", data, settings)
    sift_file = next((tmp_path / "resumed" / "ifeval").glob("sift*.jsonl"))
    assert len(sift_file.read_text().splitlines()) == 2
    with sift_file.open("a") as f:
        f.write('{"id": "torn')  # a line cut by the interruption
    calls.clear()
    stop_at[0] = 0
    resumed = _run(model, tok, tmp_path / "resumed", data, settings)
    assert len(calls) == 9 - 4  # only the unfinished batches ran
    assert _comparable(resumed) == _comparable(whole)
    assert _rows(tmp_path / "resumed") == _rows(tmp_path / "whole")
    summary = json.loads((tmp_path / "resumed" / "ifeval" / "summary.json").read_text())
    assert summary["min_new_tokens"] == 4 and [m["method"] for m in summary["methods"]] == ["full", *SPECS]


def test_valid_samples_are_those_with_at_least_the_largest_warmup(tmp_path):
    model, tok = tiny_llama(seed=11), tiny_chat_tokenizer()
    data = get_task("ifeval").load(ifeval_file(tmp_path / "p.jsonl"))
    settings = EvalSettings(model="tiny", max_new_tokens=6, batch_size=5, path="reference", min_new_tokens=7)
    summaries = _run(model, tok, tmp_path / "out", data, settings)
    for s in summaries:
        assert s["valid"]["n"] == 0 and s["valid"]["dropped"] == 5 and s["all"]["n"] == 5
    row = json.loads((tmp_path / "out" / "ifeval" / "full.jsonl").read_text().splitlines()[0])
    for key in ("id", "prompt_tokens", "num_generated", "realized_sparsity", "realized_sparsity_post_warmup", "scores", "text", "tokens"):
        assert key in row


def test_a_directory_with_other_settings_is_refused(tmp_path):
    model, tok = tiny_llama(seed=12), tiny_chat_tokenizer()
    data = get_task("ifeval").load(ifeval_file(tmp_path / "p.jsonl"))
    _run(model, tok, tmp_path / "out", data, EvalSettings(model="tiny", max_new_tokens=4, batch_size=2, path="reference"), ["full"])
    with pytest.raises(ge.RunMismatchError, match="max_new_tokens=4, not 5"):
        _run(model, tok, tmp_path / "out", data, EvalSettings(model="tiny", max_new_tokens=5, batch_size=2, path="reference"), ["full"])


# -- sweeps ----------------------------------------------------------------------------------------------
def _sweep_config(tmp_path: Path) -> Path:
    data = ifeval_file(tmp_path / "p.jsonl", n=4)
    config = tmp_path / "sweep.toml"
    config.write_text(
        f'model = "tiny"\nout = "{tmp_path / "sweep"}"\nbatch_size = 2\npath = "reference"\n'
        'methods = ["full", "topk:k=0.5"]\n[grid.sift]\ntau = [0.5, 0.875]\nwarmup = [3]\nrenormalize = [false, true]\n'
        f'[[task]]\nname = "ifeval"\nlimit = 4\nmax_new_tokens = 8\ndata_file = "{data}"\n'
    )
    return config


def test_sweep_resumes_and_draws_the_figures(tmp_path, monkeypatch):
    from siftattention.eval.sweep import load_sweep, run_sweep

    model, tok = tiny_llama(seed=13), tiny_chat_tokenizer()
    sweep = load_sweep(_sweep_config(tmp_path))
    assert len(sweep.specs) == 2 + 4 and sweep.min_new_tokens == 3
    calls = []
    real = ge.generate_batch

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ge, "generate_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, loaded=(model, tok))
    monkeypatch.setattr(ge, "generate_batch", real)
    resumed = run_sweep(sweep, loaded=(model, tok))
    whole_sweep = load_sweep(_sweep_config(tmp_path))
    whole_sweep.out = tmp_path / "whole"
    whole = run_sweep(whole_sweep, loaded=(model, tok))
    strip = lambda r: [{k: v for k, v in c.items() if k != "generation_s"} for c in r["tasks"]["ifeval"]["cells"]]  # noqa: E731
    assert strip(resumed) == strip(whole) and len(strip(whole)) == 6
    for name in ("score_vs_sparsity_ifeval.png", "agreement_vs_sparsity_ifeval.png", "realized_vs_intended_ifeval.png", "sweep.md", "sweep.json"):
        assert (tmp_path / "sweep" / name).stat().st_size > 0
    assert "| sift:tau=0.875,warmup=3,renormalize=true |" in (tmp_path / "sweep" / "sweep.md").read_text()


@pytest.mark.parametrize(
    "text, message",
    [
        ('methods = ["full"]\nfoo = 1\n[[task]]\nname = "ifeval"\n', "unknown key 'foo'"),
        ('methods = ["sift:tau=2"]\n[[task]]\nname = "ifeval"\n', "tau must be in (0, 1)"),
        ('[grid.magic]\nk = [1]\n[[task]]\nname = "ifeval"\n', "unknown method 'magic'"),
        ('methods = ["full"]\n[[task]]\nname = "mmlu"\n', "unknown task 'mmlu'"),
        ('methods = ["full"]\n', "no [[task]] tables"),
        ('methods = ["full"\n', "cannot read"),
    ],
)
def test_bad_sweep_configs_name_the_problem(tmp_path, text, message):
    from siftattention.eval.sweep import load_sweep

    config = tmp_path / "bad.toml"
    config.write_text(text)
    with pytest.raises(ValueError) as info:
        load_sweep(config)
    assert message in str(info.value)


# -- the command line: bad input ---------------------------------------------------------------------
def _run_cli(args, capsys):
    from siftattention.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny models saved as local directories: one whose tokenizer has a chat template, one without."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, template in (("chat", CHAT_TEMPLATE), ("plain", None)):
        tiny_llama(seed=14).save_pretrained(root / name)
        tiny_chat_tokenizer(template).save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def test_bad_input_is_one_line_and_leaves_earlier_results_untouched(tmp_path, capsys, model_dirs):
    prompts = ifeval_file(tmp_path / "p.jsonl", n=2)
    out = tmp_path / "out"
    base = ["eval", "ifeval", "--model", str(model_dirs["chat"]), "--data-file", str(prompts), "--out", str(out), "--path", "reference"]
    code, stdout, err = _run_cli(base + ["--method", "full", "--max-new-tokens", "3", "--limit", "2"], capsys)
    assert code == 0, err
    before = _snapshot(out)
    assert "ifeval/full.jsonl" in before and "ifeval/summary.json" in before
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    cases = [
        (["eval", "nosuchtask", "--method", "full", "--out", str(out)], "unknown task 'nosuchtask'"),
        (base[:4] + ["--data-file", str(broken), "--out", str(out), "--method", "full"], f"cannot read {broken}: line 1 is not JSON"),
        (base[:4] + ["--data-file", str(tmp_path / "missing.jsonl"), "--out", str(out), "--method", "full"], "data file not found"),
        (base + ["--method", "full", "--limit", "0"], "--limit must be >= 1, got 0"),
        (base + ["--method", "sift:tau=3"], "tau must be in (0, 1)"),
        (base + ["--method", "full", "--max-new-tokens", "4", "--limit", "2"], "holds results made with max_new_tokens=3, not 4"),
        (["eval", "ifeval", "--model", str(model_dirs["plain"]), "--data-file", str(prompts), "--out", str(tmp_path / "other"),
          "--method", "full", "--limit", "1"], "has no chat template; pass --no-chat"),
    ]
    for args, message in cases:
        code, _, err = _run_cli(args, capsys)
        assert code == 2, (args, err)
        assert message in err and err.strip().count("\n") == 0 and "Traceback" not in err, err
        assert _snapshot(out) == before
    assert not (tmp_path / "other" / "ifeval" / "run.json").exists()
    # Without the chat template the same model runs with --no-chat.
    code, stdout, err = _run_cli(["eval", "ifeval", "--model", str(model_dirs["plain"]), "--data-file", str(prompts), "--out",
                                  str(tmp_path / "other"), "--method", "full", "--limit", "1", "--max-new-tokens", "2", "--no-chat"], capsys)
    assert code == 0, err
    assert (tmp_path / "other" / "ifeval" / "full.jsonl").is_file()


def test_decoding_without_scores_then_scoring_later_equals_one_scored_run(tmp_path, monkeypatch):
    model, tok = tiny_llama(seed=15), tiny_chat_tokenizer()
    data = get_task("ifeval").load(ifeval_file(tmp_path / "p.jsonl", n=3))
    scored = _run(model, tok, tmp_path / "scored", data, EvalSettings(model="tiny", max_new_tokens=6, batch_size=2, path="reference"))
    unscored = _run(model, tok, tmp_path / "later", data, EvalSettings(model="tiny", max_new_tokens=6, batch_size=2, path="reference", score=False))
    assert all(s["all"]["metrics"] == {} for s in unscored)
    assert all(json.loads(line)["scores"] is None for line in (tmp_path / "later" / "ifeval" / "full.jsonl").read_text().splitlines())
    monkeypatch.setattr(ge, "generate_batch", lambda *a, **k: pytest.fail("nothing should be decoded again"))
    later = _run(model, tok, tmp_path / "later", data, EvalSettings(model="tiny", max_new_tokens=6, batch_size=2, path="reference"))
    assert _comparable(later) == _comparable(scored)
    assert _rows(tmp_path / "later") == _rows(tmp_path / "scored")


def test_summary_table_prints_scored_and_unscored_methods_side_by_side(tmp_path, monkeypatch):
    # A sweep that decodes new methods without scoring next to methods scored earlier prints one
    # table: metrics a method lacks show as n/a (this raised KeyError before).
    import io

    from rich.console import Console

    from siftattention.eval import runner

    model, tok = tiny_llama(seed=17), tiny_chat_tokenizer()
    data = get_task("ifeval").load(ifeval_file(tmp_path / "p.jsonl", n=2))
    scored = _run(model, tok, tmp_path / "a", data, EvalSettings(model="tiny", max_new_tokens=5, batch_size=2, path="reference"),
                  ["full"])
    unscored = _run(model, tok, tmp_path / "b", data, EvalSettings(model="tiny", max_new_tokens=5, batch_size=2, path="reference",
                                                                   score=False), ["sift:tau=0.75,warmup=4"])
    buf = io.StringIO()
    monkeypatch.setattr(runner, "console", Console(file=buf, width=400))
    sift_only = [s for s in unscored if s["method"] != "full"]
    runner.print_summaries("ifeval", scored + sift_only, title="mixed")
    lines = {line.split()[1]: line for line in buf.getvalue().splitlines() if line.startswith("│ ")}
    assert "prompt strict" in buf.getvalue()
    assert "n/a" not in lines["full"].split("│")[2]
    assert lines["sift:tau=0.75,warmup=4"].split("│")[2].strip() == "n/a"


def test_figures_draw_scored_and_unscored_methods_together(tmp_path):
    # Cells decoded elsewhere and not scored here (no metrics) are left off the score figure, not a KeyError.
    from siftattention.eval.sweep import figure_names, plot_task

    model, tok = tiny_llama(seed=18), tiny_chat_tokenizer()
    data = get_task("ifeval").load(ifeval_file(tmp_path / "p.jsonl", n=2))
    settings = EvalSettings(model="tiny", max_new_tokens=5, batch_size=2, path="reference")
    scored = _run(model, tok, tmp_path / "a", data, settings, ["full", "sift:tau=0.5,warmup=4"])
    unscored = _run(model, tok, tmp_path / "b", data, EvalSettings(model="tiny", max_new_tokens=5, batch_size=2,
                                                                   path="reference", score=False), ["full", "topk:k=0.5"])
    cells = scored + [s for s in unscored if s["method"] != "full"]
    assert cells[-1]["all"]["metrics"] == {}
    paths = plot_task("ifeval", "prompt_level_strict_acc", cells, tmp_path, "tiny")
    assert sorted(p.name for p in paths) == sorted(figure_names("ifeval", cells)) and all(p.stat().st_size > 0 for p in paths)
    unscored_full = [s for s in unscored if s["method"] == "full"]  # an unscored Full draws too, without its line
    assert len(plot_task("ifeval", "prompt_level_strict_acc", unscored_full + cells[1:], tmp_path, "tiny")) == len(paths)


def test_scoring_without_decoding_skips_unfinished_methods(tmp_path):
    model, tok = tiny_llama(seed=16), tiny_chat_tokenizer()
    data = get_task("ifeval").load(ifeval_file(tmp_path / "p.jsonl", n=3))
    settings = EvalSettings(model="tiny", max_new_tokens=5, batch_size=2, path="reference", score=False)
    _run(model, tok, tmp_path / "out", data, settings, ["full"])
    sift_file = tmp_path / "out" / "ifeval" / "sift_tau_0.75_warmup_4_renormalize_False_warmup_source_prompt.jsonl"
    full_rows = (tmp_path / "out" / "ifeval" / "full.jsonl").read_text().splitlines()
    sift_file.write_text(full_rows[0] + "\n")  # one of three samples finished
    summaries = _run(None, tok, tmp_path / "out", data, EvalSettings(model="tiny", max_new_tokens=5, batch_size=2, decode=False))
    assert [s["method"] for s in summaries] == ["full"]  # Sift has 1 of 3 samples, Top-k none: both left out
    assert summaries[0]["all"]["metrics"]["prompt_level_strict_acc"] >= 0.0
    assert len(sift_file.read_text().splitlines()) == 1


def test_result_lines_survive_unicode_line_separators_and_a_torn_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"id": "a", "text": "line\u2028sep \x85 \x1e é 🙂"}, {"id": "b", "text": "plain"}]
    ge.append_rows(path, rows)
    with path.open("a", encoding="utf-8") as f:
        f.write('{"id": "c", "text": "tor')
    assert ge.read_rows(path) == rows
    assert path.read_text(encoding="utf-8").count("\n") == 2 and ge.read_rows(path) == rows  # the torn tail was cut, in bytes
