"""RULER generated offline: deterministic samples, needles at their depths, RULER's scoring, lengths in real tokens, a CPU run."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from conftest import tiny_llama

from siftattention.eval.prompt_encoding import encode_prompt
from siftattention.eval.ruler.categories import CATEGORIES, DEPTHS
from siftattention.eval.ruler.fitting import LengthError, largest_fitting
from siftattention.eval.ruler.needle_probe import needle_report
from siftattention.eval.ruler.texts import split_sentences
from siftattention.eval.tasks import Sample, get_task

CHAT = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"


def word_tokenizer():
    """One token per word or punctuation mark (RULER's fixed words known, the rest <unk>; pad 0, bos 1, EOS <|im_end|> = 96
    as tiny_llama's config says): every category's template fits a few hundred tokens, which a tiny model decodes in seconds."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    known = ("The grass is green . sky blue sun yellow Here we go There and back again VAR = One of the special magic numbers "
             "number for is : What are all mentioned in provided text ? Answer Question words list most common , 1 2 3 4 5 6 7 8 9 0")
    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "<|im_end|>": 96}
    for word in dict.fromkeys(known.split()):
        vocab[word] = len(vocab) if len(vocab) != 96 else len(vocab) + 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Split(Regex(r"<\|im_end\|>|<s>|\w+|[^\w\s]"), "isolated")])
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHAT, pad_token="<pad>", bos_token="<s>", unk_token="<unk>",
                                   eos_token="<|im_end|>")


def ruler(tokenizer=None, chat=True, **options):
    task = get_task("ruler", **options)
    task.use_tokenizer(tokenizer or word_tokenizer(), chat)
    return task


def context_of(draft) -> str:
    """The haystack part of a needle prompt: between the instructions and the question."""
    return draft.user.split("afterwards.\n", 1)[1].rsplit("\nWhat ", 1)[0]


# -- generation ------------------------------------------------------------------------------------
def test_samples_are_a_function_of_the_seed():
    options = dict(length=1024, categories="niah_single_1,niah_multikey_3,vt,cwe,fwe", samples=2)
    first, again, other = ruler(**options).load(), ruler(**options).load(), ruler(seed=7, **options).load()
    assert [s.plain for s in first.samples] == [s.plain for s in again.samples] and first.sha256 == again.sha256
    assert [s.target for s in first.samples] == [s.target for s in again.samples]
    assert all(a.plain != b.plain for a, b in zip(first.samples, other.samples))
    assert len({s.plain for s in first.samples}) == len(first.samples)  # samples of one category differ too
    # A sample does not depend on how many others are asked for.
    one = ruler(**{**options, "samples": 1}).load()
    assert [s.plain for s in one.samples] == [s.plain for s in first.samples[::2]]


@pytest.mark.parametrize("name", ["niah_single_1", "niah_single_2", "niah_multikey_2"])
@pytest.mark.parametrize("depth", [0, 25, 50, 90, 100])
def test_a_needle_goes_at_the_requested_depth(name, depth):
    draft = CATEGORIES[name].draft(random.Random(3), 2000 if name == "niah_single_2" else 200, 8192, depth)
    context, needle = context_of(draft), draft.needles[0][0]
    assert context.count(needle) == 1 and draft.depths == (depth,)
    split = split_sentences if name == "niah_single_2" else (lambda text: [t for t in text.split("\n") if t])  # prose, or a line each
    before = split(context[: context.index(needle)])
    haystack = split(context.replace(needle, ""))
    assert len(before) == int(len(haystack) * depth / 100)  # before the haystack piece at that depth, as RULER inserts


def test_drawn_depths_are_rulers_and_each_needle_sits_at_its_own():
    assert len(DEPTHS) == 40 and DEPTHS[0] == 0 and DEPTHS[-1] == 100 and DEPTHS[20] == 51
    for seed in range(5):
        draft = CATEGORIES["niah_multivalue"].draft(random.Random(seed), 3000, 8192, -1)
        assert len(draft.depths) == 4 and set(draft.depths) <= set(DEPTHS)
        context = context_of(draft)
        for (needle, value), depth in zip(sorted(draft.needles, key=lambda n: context.index(n[0])), sorted(draft.depths)):
            assert value in needle and context.count(needle) == 1
            assert context.index(needle) / len(context) == pytest.approx(depth / 100, abs=0.03)


def test_templates_answers_and_singular_wording_follow_ruler():
    rng = random.Random(0)
    single = CATEGORIES["niah_single_3"].draft(rng, 300, 8192, 50)
    assert single.user.startswith("A special magic uuid is hidden within the following text.")
    assert single.prefix.startswith(" The special magic uuid for ") and single.prefix.endswith(" mentioned in the provided text is")
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", single.answers[0])
    query = CATEGORIES["niah_multiquery"].draft(rng, 300, 8192, -1)
    assert query.user.startswith("Some special magic numbers are hidden") and len(query.answers) == 4
    assert query.prefix.count(", ") == 3 and ", and " in query.prefix  # four keys asked together
    assert all(re.fullmatch(r"\d{7}", a) for a in query.answers)
    vt = CATEGORIES["vt"].draft(rng, 40, 8192, -1)
    value = re.search(r"assigned the value (\d{5})", vt.prefix).group(1)
    assert f"VAR {vt.answers[0]} = {value}" in vt.user and vt.prefix.startswith(" Answer: According to the chain(s)")
    for a, b in zip(vt.answers, vt.answers[1:]):
        assert f"VAR {b} = VAR {a}" in vt.user
    cwe = CATEGORIES["cwe"].draft(rng, 200, 8192, -1)
    counts = {w: len(re.findall(rf"\d+\. {w}(?= |\n|$)", cwe.user.rsplit("list are:", 1)[1])) for w in cwe.answers}
    assert set(counts.values()) == {30}  # the ten common words, 30 times each (RULER's freq_cw)
    fwe = CATEGORIES["fwe"].draft(rng, 2000, 8192, -1)
    listed = fwe.user.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
    frequency = sorted(set(listed), key=listed.count, reverse=True)
    assert frequency[0] == "..." and tuple(frequency[1:4]) == fwe.answers


def test_largest_fitting_finds_the_boundary():
    assert largest_fitting(lambda n: 10 + 3 * n, 1000) == 330
    assert largest_fitting(lambda n: 10 + 3 * n, 1000, limit=100) == 100
    with pytest.raises(LengthError):
        largest_fitting(lambda n: 2000 + n, 1000)


def test_prompts_fit_the_length_in_smollm2_tokens():
    from siftattention.eval.tasks.ruler import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    task = ruler(tok, length=4096, samples=1)
    for sample in task.load().samples:
        n = len(encode_prompt(tok, sample, True))
        budget = 4096 - sample.target["max_new_tokens"]
        assert budget - 200 < n <= budget, sample.id  # as long as fits, and no longer
        assert sample.target["prompt_tokens"] == n


# -- scoring --------------------------------------------------------------------------------------
def ruler_string_match_all(pred: str, refs: list[str]) -> float:
    """RULER's formula (scripts/eval: postprocess_pred, string_match_all per sample), written out again."""
    pred = re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()
    return sum(1.0 if r.lower() in pred.lower() else 0.0 for r in refs) / len(refs)


def _sample(category: str, answers: list[str], cap: int = 128) -> Sample:
    return Sample("x", ({"role": "user", "content": "q"},), "q", {"category": category, "answers": answers, "max_new_tokens": cap})


@pytest.mark.parametrize("answers, reply, expected", [
    (["8025489"], " 8025489.", 1.0),
    (["8025489"], "The number is 8025488.", 0.0),  # one digit off
    (["8025489"], "802548", 0.0),  # cut short
    (["8025489"], "80254 89", 0.0),
    (["63d90f56-6c79-4819-a41a-11e249804564"], "63D90F56-6C79-4819-A41A-11E249804564", 1.0),  # case is ignored
    (["63d90f56-6c79-4819-a41a-11e249804564"], "63d90f56-6c79-4819-a41a-11e249804565", 0.0),
    (["4363248", "4109862", "4333983", "7698436"], "4363248, 4109862, 4333983, 7698437", 0.75),
    (["4363248", "4109862", "4333983", "7698436"], "7698436 4333983\n4109862\t4363248", 1.0),  # any order
    (["suffering", "pitching"], "1. suffer 2. pitch", 0.0),
    (["jajhok", "jvtxvo", "buoyvs"], " jajhok, jvtxvo and buoyvs", 1.0),
])
def test_scorer_accepts_the_planted_answers_and_rejects_near_misses(answers, reply, expected):
    task = ruler()
    got = task.score(_sample("niah_single_1", answers), reply)
    assert got["string_match"] == pytest.approx(expected) == pytest.approx(ruler_string_match_all(reply, answers))
    assert got["matched"] == [a.lower() in reply.lower() for a in answers] and got["category"] == "niah_single_1"


def test_scorer_reads_only_the_categorys_generation_cap():
    task = ruler()  # one token per word
    assert task.score(_sample("vt", ["ABCDE"], cap=30), "x " * 29 + "ABCDE")["string_match"] == 1.0
    assert task.score(_sample("vt", ["ABCDE"], cap=30), "x " * 30 + "ABCDE")["string_match"] == 0.0


def test_planted_answers_score_full_marks_on_generated_samples():
    task = ruler(length=1024, samples=2)
    for sample in task.load().samples:
        answers = sample.target["answers"]
        assert task.score(sample, " " + " ".join(answers))["string_match"] == 1.0
        wrong = [a[:-1] + ("0" if a[-1] != "0" else "1") for a in answers]
        assert task.score(sample, " " + " ".join(wrong))["string_match"] == 0.0, sample.id


def test_aggregate_averages_categories_then_samples():
    task = ruler()
    rows = [{"category": "a", "string_match": 1.0}, {"category": "a", "string_match": 0.0}, {"category": "b", "string_match": 1.0}]
    metrics = task.aggregate(rows)
    assert metrics["score"] == 0.75 and metrics["a"] == 0.5 and metrics["b"] == 1.0


def test_bad_options_are_one_line_errors():
    for options, words in [({"categories": "niah_single_9"}, "unknown category"), ({"length": 100}, "length must be"),
                           ({"depth": 101}, "depth must be"), ({"samples": 0}, "samples must be"), ({"diagnose": 2}, "diagnose must be")]:
        with pytest.raises(ValueError, match=words):
            get_task("ruler", **options)
    with pytest.raises(ValueError, match="exceed the 8192-token context of smollm2-135m"):
        get_task("ruler-16k").for_model("smollm2-135m", True)
    with pytest.raises(ValueError, match="unknown option 'length'"):
        get_task("ruler-4k", length=4096)
    with pytest.raises(ValueError, match="call for_model"):
        get_task("ruler").load()


def character_tokenizer():
    """One token per character: far more tokens a word than a real tokenizer (Gemma's splits numbers into digits)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "<|im_end|>": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_end\|>|<s>|\S"), "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", unk_token="<unk>",
                                   eos_token="<|im_end|>")


def test_a_category_whose_fixed_text_does_not_fit_takes_rulers_short_form():
    """cwe at 4096 tokens: its worked example and 30 repeats alone overflow a tokenizer that spends many tokens a word,
    so it is drafted in the form RULER uses below 4096 tokens, and says so; a word tokenizer keeps the full form."""
    compact = ruler(character_tokenizer(), chat=False, length=4096, categories="cwe", samples=1).load().samples[0]
    assert compact.target["short_form"] and compact.target["prompt_tokens"] <= 4096 - 120
    assert compact.plain.count("1. ") < 60  # the short form's worked example: 20 words, 3 and 1 repeats
    full = ruler(length=4096, categories="cwe", samples=1).load().samples[0]
    assert not full.target["short_form"]


# -- the needle probe -------------------------------------------------------------------------------
def test_needle_report_names_the_layers_where_no_head_kept_the_needle():
    everything = torch.ones(4, 10, dtype=torch.bool)
    one_head_lost = everything.clone()
    one_head_lost[1, 7] = False  # head 1 of this layer lost one needle key
    all_lost = everything.clone()
    all_lost[:, 6] = False  # every head of this layer lost one
    report = needle_report([everything, one_head_lost, all_lost], [True, True, True], [6, 7])
    assert report["kept_all_fraction"] == pytest.approx(7 / 12) and report["layer_kept_all"] == [1.0, 0.75, 0.0]
    assert report["kept_token_fraction"] == pytest.approx(19 / 24) and report["layers_dropped"] == [2] and report["approximated"]
    assert needle_report([], [], [6])["decode_step"] is False


def test_needle_report_reads_sliding_window_layers_by_position():
    """A sliding layer's kept row covers the newest keys only: its key j is position total - K + j; a window that
    misses part of the needle leaves the layer out, as Full cannot see it there either."""
    total = 12
    full_layer = torch.zeros(2, total, dtype=torch.bool)
    full_layer[:, [8, 9]] = True
    window = torch.tensor([[False, True, True, False], [True, False, True, False]])  # positions 8..11
    report = needle_report([full_layer, window], [True, True], [9, 10], total)
    assert report["layers_out_of_window"] == [] and report["layer_kept_all"] == [0.0, 0.5]
    report = needle_report([full_layer, window], [True, True], [7, 8], total)
    assert report["layers_out_of_window"] == [1] and report["layer_kept_all"] == [0.0, None]
    assert report["kept_all_fraction"] == 0.0 and report["layers_dropped"] == [0]


# -- end to end on the CPU ----------------------------------------------------------------------------
def test_a_tiny_model_runs_every_category_end_to_end(tmp_path, monkeypatch):
    from siftattention.eval.generation_eval import EvalSettings, evaluate_generation
    from siftattention.kernels import cpu_decode

    if cpu_decode._module is None:  # a format check: the torch kernels, not a (re)build of the fused CPU kernel
        monkeypatch.setattr(cpu_decode, "_problem", "not built for this test")

    model = tiny_llama(seed=5, vocab=128)
    model.config.max_position_embeddings = 1024
    tok = word_tokenizer()
    task = ruler(tok, length=640, samples=1, diagnose=1)
    data = task.load()
    assert len(data.samples) == len(CATEGORIES)
    specs = ["topk:k=0.25"]
    settings = EvalSettings(model="tiny", max_new_tokens=4, batch_size=11, path="fast")
    summaries = evaluate_generation(model, tok, task, data, specs, tmp_path, settings)
    assert [s["method"] for s in summaries] == ["full", *specs]
    for s in summaries:
        metrics = s["all"]["metrics"]
        assert set(CATEGORIES) | {"score", "needle_kept_all", "needle_dropped"} == set(metrics)
        assert 0.0 <= metrics["score"] <= 1.0 and 0.0 <= metrics["needle_kept_all"] <= 1.0
    assert summaries[0]["all"]["metrics"]["needle_kept_all"] == 1.0
    (topk,) = (tmp_path / "ruler").glob("topk*.jsonl")
    rows = [json.loads(line) for line in topk.read_text().splitlines()]
    assert len(rows) == len(CATEGORIES)
    for row in rows:
        assert row["prompt_tokens"] <= 640 - CATEGORIES[row["scores"]["category"]].max_new_tokens
        needle = row["scores"].get("needle")
        if row["scores"]["category"] in ("cwe", "fwe"):
            assert needle is None
        else:
            assert needle["needle_tokens"] > 0 and 0.0 <= needle["kept_all_fraction"] <= 1.0
            assert all(0 <= layer < 2 for layer in needle["layers_dropped"])
    # Top-k keeping a quarter of the keys drops some needle key somewhere, and says so.
    assert summaries[1]["all"]["metrics"]["needle_kept_all"] < 1.0
    again = evaluate_generation(model, tok, task, data, specs, tmp_path, settings)  # resumed: nothing decoded again
    assert [s["all"]["metrics"] for s in again] == [s["all"]["metrics"] for s in summaries]


# -- the sweep configs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["smollm2", "gemma3", "qwen"])
def test_each_models_sweep_config_runs_every_method_within_its_context(name):
    from pathlib import Path

    from siftattention.eval.sweep import load_sweep
    from siftattention.eval.tasks.ruler import EMBEDDED_CONTEXT

    sweep = load_sweep(Path(__file__).parent.parent / "configs" / f"ruler_{name}.toml")
    names = {spec.split(":")[0] for spec in sweep.specs}
    assert names == {"full", "topk", "toptheta", "skipsoftmax", "oracle", "sift"}
    assert {"topk:k=0.125", "topk:k=0.05"} <= set(sweep.specs)
    # the paper's Sift (a decode warmup) and the default, calibrated on the prompt, at two taus each
    assert sum(s.startswith("sift:") and "warmup_source=decode" in s for s in sweep.specs) == 2
    assert {"sift:tau=0.875", "sift:tau=0.95"} <= set(sweep.specs)
    lengths = [get_task(t.name, **t.options).length for t in sweep.tasks]
    assert lengths == [n for n in (4096, 8192, 16384, 32768) if n <= EMBEDDED_CONTEXT[sweep.model]]
    assert sweep.chat == (sweep.model != "gemma3-270m")  # the embedded Gemma-3 is the base checkpoint
