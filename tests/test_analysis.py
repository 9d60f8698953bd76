"""Power-law analysis (``sift analyze``): quantile series, fits, summary and CLI errors.

Tiny random models only (2 layers, hidden 64); the whole file runs in seconds.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from siftattention.cli_analyze import analyze
from siftattention.eval import analysis
from siftattention.eval.analysis import (
    AnalysisError,
    distribution,
    fit_series,
    layer_types,
    parse_taus,
    parse_warmups,
    record_series,
    row_quantiles,
)

TAUS = (0.5, 0.75, 0.875)


# -- synthetic rows with a planted quantile series ----------------------------------------------


def planted_rows(targets: torch.Tensor, tau: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal rows [1, H, T, T] whose tau-quantile over the valid prefix is ``targets`` [H, T].

    Row S holds S values in arithmetic progression around the target, centred on the
    interpolation position tau * (S - 1), so linear interpolation lands on the target;
    the values are shuffled so that sorting matters.
    """
    gen = torch.Generator().manual_seed(seed)
    H, T = targets.shape
    probs = torch.zeros(1, H, T, T, dtype=torch.float64)
    for h in range(H):
        for s in range(1, T + 1):
            j = torch.arange(s, dtype=torch.float64)
            pos = tau * (s - 1)
            values = targets[h, s - 1] * (1 + 0.5 / s * (j - pos))
            probs[0, h, s - 1, :s] = values[torch.randperm(s, generator=gen)]
    valid = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
    return probs.float(), valid


@pytest.mark.parametrize("tau", [0.5, 0.875])
def test_planted_power_law_is_recovered(tau: float) -> None:
    T = 160
    steps = torch.arange(1, T + 1, dtype=torch.float64)
    alphas, betas = torch.tensor([0.8, 0.3]), torch.tensor([1.1, 0.6])
    noise = 0.05 * torch.randn(2, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    clean = alphas[:, None] * steps ** -betas[:, None]
    probs, valid = planted_rows(clean * noise.exp(), tau)

    theta = row_quantiles(probs, valid, [tau], block_rows=23)[0, :, :, 0]  # [H, T]
    np.testing.assert_allclose(theta.double(), clean * noise.exp(), rtol=1e-5)

    fits = fit_series(steps.numpy(), theta.numpy(), [64, T])
    np.testing.assert_allclose(fits.beta, betas.numpy(), atol=0.02)
    np.testing.assert_allclose(fits.alpha, alphas.numpy(), rtol=0.08)
    assert (fits.r2 > 0.95).all()
    # A warmup of the whole series is the full fit; a 64-step warmup still predicts well.
    np.testing.assert_allclose(fits.warmup_r2[1], fits.r2, atol=1e-9)
    assert (fits.warmup_r2[0] > 0.9).all()


def test_warmup_r2_goes_negative_when_the_series_bends_after_the_warmup() -> None:
    T, w, tau = 256, 48, 0.75
    steps = torch.arange(1, T + 1, dtype=torch.float64)
    decay = 0.5 * steps**-1.0
    # Power law up to S = w, then the quantile climbs again instead of decaying.
    bent = torch.where(steps <= w, decay, 0.5 * w**-1.0 * (steps / w) ** 0.8)
    probs, valid = planted_rows(torch.stack([decay, bent]), tau)
    theta = row_quantiles(probs, valid, [tau])[0, :, :, 0].numpy()

    fits = fit_series(steps.numpy(), theta, [w])
    assert fits.warmup_r2[0, 0] > 0.99  # unbent: the warmup fit holds out of sample
    assert fits.warmup_r2[0, 1] < -1.0  # bent: raw out-of-sample R^2, worse than the mean
    assert fits.r2[1] < fits.r2[0]
    stats = distribution(fits.warmup_r2[0], negative=True)
    assert stats["frac_negative"] == 0.5 and stats["p5"] < -1.0  # kept raw, not clipped to [0, 1]


def test_row_quantiles_match_torch_quantile_on_sliding_bands() -> None:
    gen = torch.Generator().manual_seed(3)
    B, H, R, K, W = 2, 3, 37, 37, 6
    probs = torch.rand(B, H, R, K, generator=gen)
    i = torch.arange(R)[:, None]
    j = torch.arange(K)[None, :]
    valid = ((j <= i) & (j > i - W))[None, None].expand(B, 1, R, K).clone()
    valid[1, 0, :5] = False  # rows with no valid key (left padding) give 0
    got = row_quantiles(probs, valid, TAUS, block_rows=8)
    for b in range(B):
        for r in range(R):
            keys = valid[b, 0, r].nonzero().flatten()
            for t, tau in enumerate(TAUS):
                want = torch.quantile(probs[b, :, r, keys], tau, dim=-1) if keys.numel() else torch.zeros(H)
                torch.testing.assert_close(got[b, :, r, t], want, rtol=1e-6, atol=1e-7)


# -- tiny random models ---------------------------------------------------------------------------


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


def tiny_gemma3(window: int = 8):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=16, sliding_window=window, max_position_embeddings=256,
                              layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")
    return Gemma3ForCausalLM(config).eval()


def reference_quantiles(model, ids: torch.Tensor, window: list[int | None]) -> np.ndarray:
    """torch.quantile over the valid keys of eager attention's probabilities: [N, L, H, T, taus]."""
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    N, T = ids.shape
    out = np.zeros((N, len(attentions), attentions[0].shape[1], T, len(TAUS)), dtype=np.float32)
    for layer, attn in enumerate(attentions):
        for i in range(T):
            first = 0 if window[layer] is None else max(0, i - window[layer] + 1)
            row = attn[:, :, i, first : i + 1].float()
            for t, tau in enumerate(TAUS):
                out[:, layer, :, i, t] = torch.quantile(row, tau, dim=-1).numpy()
    return out


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_recorded_series_equal_torch_quantile_of_eager_attention(kind: str, monkeypatch) -> None:
    import siftattention.attention as attention

    model = tiny_llama() if kind == "llama" else tiny_gemma3(window=8)
    window = [None, None] if kind == "llama" else [8, None]
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    want = reference_quantiles(model, ids, window)
    # Several row chunks per layer and several sort blocks per chunk.
    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", 4 * 40 * 13)
    layers_seen: list[int] = []
    thetas, counts = record_series(model, ids, TAUS, block_rows=5, on_layer=layers_seen.append)
    assert thetas.shape == want.shape
    np.testing.assert_allclose(thetas, want, rtol=2e-5, atol=1e-7)
    assert np.all(thetas[:, :, :, 0, :] == 1.0)  # theta_1 = 1 for every tau
    steps = np.arange(1, 41)
    for layer, w in enumerate(window):
        np.testing.assert_array_equal(counts[layer], steps if w is None else np.minimum(steps, w))
    assert layers_seen == [0, 1, 0, 1]
    assert model.config._attn_implementation == "eager"  # the recorder was removed
    if kind == "gemma3":
        assert layer_types(model) == ["sliding_attention", "full_attention"]


# -- end to end through the command -----------------------------------------------------------------


def save_tiny_model(tmp_path, model) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(96)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory = tmp_path / "tiny-model"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    model.save_pretrained(directory)
    text = tmp_path / "corpus.txt"
    gen = np.random.default_rng(0)
    text.write_text(" ".join(words[i] for i in gen.integers(0, 96, 400)) + "\n")
    return str(directory), str(text)


def test_analyze_command_writes_summary_series_figures_and_report(tmp_path) -> None:
    model_dir, text = save_tiny_model(tmp_path, tiny_gemma3(window=8))
    out = tmp_path / "out"
    result = CliRunner().invoke(analyze, ["--model", model_dir, "--dataset", "tiny", "--data-file", text, "--seq-len", "48",
                                          "--num-seqs", "3", "--taus", "0.5,0.875", "--warmups", "8,24", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert {"model", "dataset", "data_source", "seq_len", "num_seqs", "r2", "warmup_r2", "per_layer"} <= set(summary)
    assert (summary["seq_len"], summary["num_seqs"], summary["dataset"]) == (48, 3, "tiny")
    assert list(summary["r2"]) == ["0.5", "0.875"] and list(summary["warmup_r2"]["0.5"]) == ["8", "24"]
    assert set(summary["r2"]["0.5"]) >= {"median", "p5", "p25", "p75", "p95"}
    assert "frac_negative" in summary["warmup_r2"]["0.875"]["8"]
    assert list(summary["per_layer"]["0.5"]) == ["0", "1"]
    assert set(summary["per_layer"]["0.5"]["1"]) == {"alpha_median", "beta_median", "r2_median"}

    with np.load(out / "series.npz") as z:
        assert z["thetas"].shape == (3, 2, 4, 48, 2)
        assert z["r2"].shape == (2, 3, 2, 4) and z["warmup_r2"].shape == (2, 2, 3, 2, 4)
        # The summary's statistics are those of the saved fits (windows x layers x heads).
        assert summary["r2"]["0.875"]["median"] == pytest.approx(float(np.median(z["r2"][1])))
        assert summary["warmup_r2"]["0.5"]["24"]["p5"] == pytest.approx(float(np.percentile(z["warmup_r2"][0, 1], 5)))
        sliding = z["r2"][:, :, [0]]
        r2 = z["r2"].copy()
    by_type = summary["by_layer_type"]
    assert by_type["sliding_attention"]["layers"] == [0] and by_type["full_attention"]["layers"] == [1]
    assert by_type["sliding_attention"]["r2"]["0.5"]["median"] == pytest.approx(float(np.median(sliding[0])))
    assert by_type["sliding_attention"]["sliding_window"] == 8
    assert "r2_within_window" in by_type["sliding_attention"]

    report = (out / "report.md").read_text()
    assert "r2_within_window" in by_type["full_attention"]  # the like-for-like control
    pngs = ["series_samples.png", "r2_box.png", "warmup_r2_box.png", "beta_heatmap.png", "r2_box_by_layer_type.png",
            "warmup_r2_box_sliding_attention.png", "warmup_r2_box_full_attention.png"]
    for png in pngs:
        assert (out / png).stat().st_size > 5000
        assert f"]({png})" in report
    # The report's R^2 table carries the statistics of the saved fits, recomputed here from series.npz.
    for t, tk in enumerate(["0.5", "0.875"]):
        row = re.search(rf"^\| {re.escape(tk)} \| \*\*(\S+)\*\* \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|", report, re.M)
        want = [np.median(r2[t]), *np.percentile(r2[t], [5, 25, 75, 95])]
        assert [float(x) for x in row.groups()] == pytest.approx(want, abs=0.0051), tk


def test_a_later_analysis_into_the_same_out_leaves_no_stale_figures(tmp_path) -> None:
    model_dir, text = save_tiny_model(tmp_path, tiny_gemma3(window=8))
    out = tmp_path / "out"
    common = ["--model", model_dir, "--dataset", "tiny", "--data-file", text, "--num-seqs", "1", "--taus", "0.5",
              "--warmups", "8", "--out", str(out)]
    first = CliRunner().invoke(analyze, [*common, "--seq-len", "32"])
    assert first.exit_code == 0, first.output
    assert (out / "r2_box_by_layer_type.png").is_file() and (out / "report.md").is_file()
    (out / "notes.txt").write_text("the user's own file\n")
    second = CliRunner().invoke(analyze, [*common, "--seq-len", "24", "--no-figures"])
    assert second.exit_code == 0, second.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "series.npz", "summary.json"]
    assert json.loads((out / "summary.json").read_text())["seq_len"] == 24


# -- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--taus", "0.5,1.5"], "tau must be in (0, 1), got 1.5"),
        (["--taus", "0"], "tau must be in (0, 1), got 0"),
        (["--taus", "abc"], "is not a number"),
        (["--seq-len", "256", "--warmups", "64,512"], "warmup 512 is longer than the sequence length 256"),
        (["--warmups", "1"], "at least 2 steps"),
        (["--data-file", "/nonexistent/corpus.txt"], "data file not found"),
        (["--seq-len", "2", "--warmups", "2"], "--seq-len must be at least 3, got 2: a power law through 2 point(s) fits exactly"),
    ],
)
def test_bad_input_is_one_line_error_with_exit_code_2(args: list[str], message: str, tmp_path) -> None:
    # The model is never loaded: a bad input fails before any slow work.
    result = CliRunner().invoke(analyze, ["--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sift: error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_empty_corpus_is_an_error(tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    result = CliRunner().invoke(analyze, ["--model", str(tmp_path / "no-such-model"), "--data-file", str(empty)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"sift: error: the corpus is empty (file:{empty})"


def test_library_errors_are_value_errors() -> None:
    with pytest.raises(AnalysisError):
        parse_taus("0.5,1.0")
    with pytest.raises(ValueError, match="longer than the sequence length"):
        parse_warmups("64,128", seq_len=100)
    assert parse_taus("0.5, 0.875") == [("0.5", 0.5), ("0.875", 0.875)]
    assert parse_warmups("64,128", 128) == [("64", 64), ("128", 128)]
    with pytest.raises(ValueError):
        analysis.QuantileRecorder(taus=(0.5, 2.0))
