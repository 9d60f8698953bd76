"""The README runs as written: its Python quick-start, and every `sift` command up to the model load."""

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _sift_layer0_decode_reference(model, sequence: torch.Tensor, prompt_len: int, tau: float, warmup: int):
    """(alpha [H], beta [H], post-warmup realized sparsity [H]) of Sift in generate() on layer 0.

    From first principles on transformers' eager attention over the whole generated
    sequence (layer 0 sees only token embeddings, so its probabilities do not depend on
    the method): the first ``warmup`` decoded tokens (steps S = P+1..P+w) record
    torch.quantile's tau-quantile; numpy's polyfit of log theta on log S gives the power
    law; each later decode step S keeps the keys with p > alpha * S^-beta plus the row max.
    The last generated token is never fed back, so the steps end at S = len - 1.
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            probs = model(sequence[None], output_attentions=True).attentions[0][0].double()  # [H, T, T]
    finally:
        model.set_attn_implementation(previous)
    warm_steps = np.arange(prompt_len + 1, prompt_len + warmup + 1, dtype=np.float64)
    alpha, beta, sparsity = [], [], []
    for h in range(probs.shape[0]):
        thetas = [torch.quantile(probs[h, s - 1, :s], tau).item() for s in warm_steps.astype(int)]
        slope, intercept = np.polyfit(np.log(warm_steps), np.log(thetas), 1)
        alpha.append(np.exp(intercept))
        beta.append(-slope)
        per_step = []
        for s in range(prompt_len + warmup + 1, len(sequence)):
            row = probs[h, s - 1, :s]
            eta = alpha[-1] * s ** -beta[-1]
            per_step.append(1 - (int((row > eta).sum()) + int(row.max() <= eta)) / s)
        sparsity.append(np.mean(per_step))
    return torch.tensor(alpha), torch.tensor(beta), torch.tensor(sparsity)


def test_readme_quick_start_runs(capsys, monkeypatch, embedded_by_name):
    import siftattention.hf

    code = re.search(r"## Python quick-start\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    handles = []
    real_apply = siftattention.hf.apply

    def recording_apply(*args, **kwargs):
        handles.append(real_apply(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(siftattention.hf, "apply", recording_apply)
    namespace: dict = {}
    exec(compile(code, "README.md quick-start", "exec"), namespace)
    assert namespace["model"] is embedded_by_name[0]
    out = capsys.readouterr().out
    printed = float(re.search(r"realized sparsity after warmup: ([0-9.e-]+)", out).group(1))
    assert float(re.search(r"Skip-Softmax realized sparsity: ([0-9.e-]+)", out).group(1)) > 0.1  # the example shows a skip
    sift_handle = handles[0]
    assert sift_handle.method.name == "sift" and (sift_handle.method.tau, sift_handle.method.warmup) == (0.875, 16)
    assert printed == sift_handle.stats.realized_sparsity(post_warmup=True)
    model, inputs, generated = namespace["model"], namespace["inputs"], namespace["out"]
    prompt_len = inputs["input_ids"].shape[1]
    assert generated.shape[1] == prompt_len + 64  # no early stop, so 64 - 1 - 16 post-warmup steps
    assert sift_handle.stats.step_count(post_warmup=True) == 64 - 1 - 16
    alpha, beta, sparsity = _sift_layer0_decode_reference(model, generated[0], prompt_len, 0.875, 16)
    torch.testing.assert_close(sift_handle.stats.alpha[0, 0].double(), alpha, rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(sift_handle.stats.beta[0, 0].double(), beta, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(sift_handle.stats.per_head(post_warmup=True)[0, 0].double(), sparsity, rtol=0, atol=2e-3)
    assert namespace["logits"].shape[:2] == inputs["input_ids"].shape
    fast = namespace["res"]  # the fast loop runs the same decode steps: the same tokens and statistics
    assert fast.fast and torch.equal(fast.sequences, generated)
    assert fast.stats.realized_sparsity(post_warmup=True) == pytest.approx(printed, abs=1e-12)
    assert model.config._attn_implementation == "sdpa"  # restored after remove()


def readme_sift_commands() -> list[list[str]]:
    """Every `sift ...` command of the README's code blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    indented = re.findall(r"^    (sift .*?(?:\\\n    .*?)*)$", README.read_text(), re.M)
    text = "\n".join(blocks + indented).replace("\\\n", " ")
    return [shlex.split(line.split("#")[0]) for line in text.splitlines() if line.strip().startswith("sift ")]


def test_readme_lists_its_commands():
    names = [cmd[1] for cmd in readme_sift_commands()]
    assert {"ppl", "generate", "analyze", "models"} <= set(names)


@pytest.mark.parametrize("command", readme_sift_commands(), ids=lambda c: " ".join(c[:2]))
def test_readme_command_passes_every_check_before_the_model_load(command, tmp_path, monkeypatch, capsys):
    """Each README command verbatim (run in an empty directory, so `--out runs/...` is fresh) gets
    through spec parsing, data loading and the output check, and reaches the model load."""
    from siftattention import models
    from siftattention.cli import main

    class ReachedModelLoad(Exception):
        pass

    def stop(name, **kwargs):
        raise ReachedModelLoad(name)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "load_model", stop)
    if command[1] == "models":
        main(command[1:])
        assert "smollm2-135m" in capsys.readouterr().out
        return
    with pytest.raises(ReachedModelLoad) as info:
        main(command[1:])
    assert info.value.args[0] == (command[command.index("--model") + 1] if "--model" in command else "smollm2-135m")
    assert "error" not in capsys.readouterr().err


def test_readme_demo_table_full_row_is_what_the_packaged_data_gives(embedded):
    """The README's demo table (make demo) on this machine: Full's row from the packaged WikiText-2."""
    import math

    from siftattention import Full, apply
    from siftattention.cli import DEMO_METHODS
    from siftattention.data import load_corpus, token_windows
    from siftattention.eval.perplexity import token_nll

    section = README.read_text().split("### Perplexity on the embedded model (CPU)")[1]
    command = re.search(r"`(sift ppl [^`]*)`", section).group(1).split()
    seq_len, num_seqs = int(command[command.index("--seq-len") + 1]), int(command[command.index("--num-seqs") + 1])
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(r"^\| (\S+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", section, re.M)}
    assert list(rows) == DEMO_METHODS
    model, tokenizer = embedded
    windows = token_windows(load_corpus("wikitext2").text, tokenizer, seq_len, num_seqs)
    with apply(model, Full()):
        nll = torch.stack([token_nll(model, w) for w in windows]).double()
    warm = 128  # W: the largest warmup among the demo's methods
    # Within a unit of the last printed digit: float32 sums differ in the 4th decimal across builds.
    assert math.exp(nll.mean()) == pytest.approx(float(rows["full"][0]), abs=1e-3)
    assert math.exp(nll[:, warm:].mean()) == pytest.approx(float(rows["full"][1]), abs=1e-3)
