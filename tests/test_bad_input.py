"""Bad input, table-driven: every row fails cleanly and early.

A command-line row must exit with status 2 and print exactly one line on stderr,
``sift: error: ...`` containing the expected text, with no traceback anywhere; the
results of an earlier run in the same ``--out`` (``results.json`` and the figure) must
be byte-identical afterwards, with nothing added beside them. A Python row must raise
the expected exception type with a one-line message containing the expected text.

``python tests/test_bad_input.py`` prints the table with each outcome (docs/bad-input.md).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_llama  # noqa: E402


# -- files the rows point at ------------------------------------------------------------------------


def make_files(root: Path) -> dict[str, str]:
    """The placeholders of the table, as files and directories under ``root``."""
    files = {
        "binary": root / "weights.bin",
        "latin1": root / "latin1.txt",
        "empty": root / "empty.txt",
        "corpus": root / "corpus.txt",
        "file": root / "a-file",
        "nocfg": root / "model-dir-without-config",
        "dir": root / "a-directory",
        "earlier": root / "earlier-run",
    }
    files["binary"].write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)))
    files["latin1"].write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    files["empty"].write_text("\n  \n")
    files["corpus"].write_text("hello world " * 50)
    files["file"].write_text("not a directory\n")
    files["nocfg"].mkdir()
    files["dir"].mkdir()
    files["earlier"].mkdir()
    (files["earlier"] / "results.json").write_text('{"results": [{"method": "full", "ppl": 20.21}]}\n')
    (files["earlier"] / "ppl_vs_sparsity.png").write_bytes(b"\x89PNG\r\n\x1a\n earlier figure")
    return {key: str(path) for key, path in files.items()}


# -- the table ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cli:
    """``sift ARGS``; ``{name}`` placeholders name the files of ``make_files``.

    ``--out {earlier}`` is appended to commands that take ``--out`` unless the row sets it.
    """

    args: str
    message: str

    def argv(self, files: dict[str, str]) -> list[str]:
        import shlex

        argv = shlex.split(self.args.format(**files))
        if argv[0] in ("ppl", "analyze", "demo") and "--out" not in argv:
            argv += ["--out", files["earlier"]]
        return argv


@dataclass(frozen=True)
class Api:
    """A Python call: ``call(files)`` must raise ``error`` with ``message`` in it."""

    label: str
    call: Callable[[dict[str, str]], Any]
    error: type[BaseException] | str  # a name resolves in siftattention at run time
    message: str


def _exc(name: str) -> type[BaseException]:
    import siftattention
    from siftattention import data, models, report
    from siftattention.eval import analysis
    from siftattention.methods import SpecError

    for where in (siftattention, data, models, report, analysis):
        if hasattr(where, name):
            return getattr(where, name)
    return {"SpecError": SpecError}[name]


def _sift(**kw):
    from siftattention import Sift

    return Sift(**kw)


def _stats_before_forward(_):
    from siftattention import Sift, apply

    with apply(tiny_llama(), Sift(tau=0.5, warmup=4)) as handle:
        return handle.stats.beta


def _second_apply(_):
    from siftattention import AlreadyAppliedError, Sift, TopK, apply

    model = tiny_llama()
    ids = torch.randint(3, 97, (1, 12))
    with apply(model, Sift(tau=0.5, warmup=4)) as first:
        try:
            apply(model, TopK(k=0.5))
        except AlreadyAppliedError:
            with torch.no_grad():
                model(ids)  # the first handle still works
            assert first.stats.step_count() == 12 and model.config._attn_implementation == first.name
            raise


CLI_ROWS: list[Cli] = [
    # method specs
    Cli("ppl --method sift:tau=1.5", "sift: tau must be in (0, 1), got 1.5"),
    Cli("ppl --method sift:tau=0.5,tau=0.9", "'sift:tau=0.5,tau=0.9' gives tau more than once"),
    Cli("ppl --method magic", "unknown method 'magic'"),
    Cli("ppl --method sift:warmup=1", "warmup must be an integer >= 2"),
    Cli("ppl --method topk:k=0", "k must be in (0, 1]"),
    Cli("ppl --method h2o:k=2", "k must be in (0, 1]"),
    Cli("ppl --method oracle:tau=0", "tau must be in (0, 1)"),
    Cli("ppl --method toptheta:k=0", "toptheta: k must be an integer >= 1, got 0"),
    Cli("ppl --method toptheta:calibration=books", "calibration must be one of wikitext2, c4, wiki"),
    Cli("ppl --method skipsoftmax:scale=-1", "skipsoftmax: scale must be a positive finite number"),
    Cli("ppl --method sift:tau", "'tau' is not key=value"),
    Cli("ppl --method sift:beta=3", "unknown parameter 'beta'"),
    Cli("ppl --method topk:renormalize=maybe", "is not a boolean"),
    Cli("generate --method sift:tau=x", "tau='x' is not a number"),
    # data
    Cli("ppl --method full --dataset nope", "unknown dataset 'nope'"),
    Cli("ppl --method full --data-file /nonexistent/corpus.txt", "data file not found: /nonexistent/corpus.txt"),
    Cli("ppl --method full --data-file {binary}", "data file {binary} is binary (a NUL byte at offset 5)"),
    Cli("ppl --method full --data-file {latin1}", "data file {latin1} is not UTF-8 text (byte 0xe9 at offset 3)"),
    Cli("ppl --method full --data-file {empty}", "the corpus is empty (file:{empty})"),
    Cli("ppl --method full --data-file {dir}", "is a directory"),
    Cli("analyze --data-file {binary}", "data file {binary} is binary"),
    # output directory
    Cli("ppl --method full --out /sys/x", "--out /sys/x cannot be created in /sys"),
    Cli("ppl --method full --out /proc/x", "--out /proc/x cannot be created in /proc"),
    Cli("ppl --method full --out {file}/x", "--out {file}/x cannot be created: {file} is a file"),
    Cli("ppl --method full --out {file}", "is a file"),
    Cli("analyze --out /sys/x", "--out /sys/x cannot be created in /sys"),
    Cli("eval ifeval --method full --limit 2 --out /sys/x", "--out /sys/x cannot be created in /sys"),
    Cli("lm-eval --tasks x --out /proc/x", "--out /proc/x cannot be created in /proc"),
    Cli("analyze --out {file}/sub/dir", "cannot be created: {file} is a file"),
    Cli("demo --out /proc/x", "--out /proc/x cannot be created in /proc"),
    Cli("generate --out {file}", "is a file"),
    # options and commands click checks
    Cli("ppl --seq-len x --method full", "Invalid value for '--seq-len': 'x' is not a valid integer range"),
    Cli("ppl --seq-len 1 --method full", "Invalid value for '--seq-len': 1 is not in the range x>=2"),
    Cli("ppl --num-seqs 0 --method full", "Invalid value for '--num-seqs'"),
    Cli("ppl --method full --bogus", "No such option '--bogus'"),
    Cli("ppl", "Missing option '--method'"),
    Cli("nope", "No such command 'nope'"),
    Cli("generate --max-new-tokens 0", "Invalid value for '--max-new-tokens'"),
    Cli("generate --path compiled", "Invalid value for '--path': 'compiled' is not one of 'auto', 'fast', 'reference'"),
    Cli("generate --device tpu", "--device tpu: expected auto, cpu, cuda or cuda:N"),
    Cli("eval ifeval --method full --device gpu0", "--device gpu0: expected auto, cpu, cuda or cuda:N"),
    # models
    Cli("ppl --model no-such-org/no-such-model --data-file {corpus} --method full", "unknown model 'no-such-org/no-such-model'"),
    Cli("ppl --model {nocfg} --data-file {corpus} --method full", "is a directory without a config.json"),
    Cli("ppl --model {file} --data-file {corpus} --method full", "is a file, not a model directory"),
    Cli("generate --model no-such-org/no-such-model", "unknown model 'no-such-org/no-such-model'"),
    # analysis parameters
    Cli("analyze --taus 0.5,1.5", "tau must be in (0, 1), got 1.5"),
    Cli("analyze --taus 0.5,0.5", "tau 0.5 is given twice"),
    Cli("analyze --seq-len 256 --warmups 64,512", "warmup 512 is longer than the sequence length 256"),
    Cli("analyze --seq-len 2 --warmups 2", "--seq-len must be at least 3, got 2"),
    Cli("analyze --num-seqs 0", "--num-seqs must be at least 1, got 0"),
]

API_ROWS: list[Api] = [
    Api('Sift(tau="0.5")', lambda f: _sift(tau="0.5"), ValueError, "tau must be a number in (0, 1), got '0.5'"),
    Api("Sift(tau=1.5)", lambda f: _sift(tau=1.5), ValueError, "tau must be in (0, 1), got 1.5"),
    Api("Sift(warmup=1)", lambda f: _sift(warmup=1), ValueError, "warmup must be an integer >= 2"),
    Api('TopK(k="x")', lambda f: __import__("siftattention").TopK(k="x"), ValueError, "k must be a number in (0, 1], got 'x'"),
    Api("H2O(heavy_ratio=2)", lambda f: __import__("siftattention").H2O(heavy_ratio=2), ValueError, "heavy_ratio must be in [0, 1]"),
    Api('parse_method("magic")', lambda f: __import__("siftattention").parse_method("magic"), "SpecError", "unknown method 'magic'"),
    Api('parse_method("sift:tau=0.5,tau=0.9")', lambda f: __import__("siftattention").parse_method("sift:tau=0.5,tau=0.9"), "SpecError", "gives tau more than once"),
    Api("apply(torch.nn.Linear(2, 2), Full())",
        lambda f: __import__("siftattention").apply(torch.nn.Linear(2, 2), __import__("siftattention").Full()),
        "UnsupportedModelError", "Linear"),
    Api('apply(model, "sift")', lambda f: __import__("siftattention").apply(tiny_llama(), "sift"), TypeError,
        "method must be a siftattention method"),
    Api("handle.stats.beta before a forward pass", _stats_before_forward, RuntimeError, "no statistics yet"),
    Api("a second apply on the same model", _second_apply, "AlreadyAppliedError", ""),
    Api('load_corpus("imagenet")', lambda f: __import__("siftattention.data").data.load_corpus("imagenet"),
        "DataNotFoundError", "unknown dataset 'imagenet'"),
    Api("load_corpus(data_file=binary)", lambda f: __import__("siftattention.data").data.load_corpus("x", f["binary"]),
        "DataFormatError", "data file {binary} is binary"),
    Api("token_windows(seq_len=1)", lambda f: __import__("siftattention.data").data.token_windows("text", None, 1, 1),
        ValueError, "seq_len must be >= 2"),
    Api('load_model("no-such-org/no-such-model")',
        lambda f: __import__("siftattention").load_model("no-such-org/no-such-model"), "ModelNotFoundError",
        "unknown model 'no-such-org/no-such-model'"),
    Api("load_model(a file)", lambda f: __import__("siftattention").load_model(f["file"]), "ModelNotFoundError", "is a file"),
    Api('check_out_dir("/sys/x")', lambda f: __import__("siftattention.report").report.check_out_dir(Path("/sys/x")),
        "OutputDirError", "cannot be created in /sys"),
    Api('parse_taus("0.5,1.5")', lambda f: __import__("siftattention.eval.analysis").eval.analysis.parse_taus("0.5,1.5"),
        "AnalysisError", "tau must be in (0, 1), got 1.5"),
]


# -- running a row ----------------------------------------------------------------------------------


def run_cli_row(argv: list[str]) -> tuple[int | None, str, str]:
    """(exit status, stdout, stderr) of ``sift ARGV`` in this process."""
    from siftattention.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: int | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    return make_files(tmp_path)


@pytest.mark.parametrize("row", CLI_ROWS, ids=[row.args for row in CLI_ROWS])
def test_cli_bad_input(row: Cli, files: dict[str, str]) -> None:
    earlier = snapshot(Path(files["earlier"]))
    code, out, err = run_cli_row(row.argv(files))
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("sift: error: "), err
    assert row.message.format(**files) in lines[0]
    assert "Traceback" not in out + err
    assert snapshot(Path(files["earlier"])) == earlier  # the earlier results, untouched and alone


@pytest.mark.parametrize("row", API_ROWS, ids=[row.label for row in API_ROWS])
def test_api_bad_input(row: Api, files: dict[str, str]) -> None:
    error = _exc(row.error) if isinstance(row.error, str) else row.error
    with pytest.raises(error) as info:
        row.call(files)
    message = str(info.value)
    assert "\n" not in message
    assert row.message.format(**files) in message


def test_the_table_is_large_enough() -> None:
    assert len(CLI_ROWS) + len(API_ROWS) >= 30 and len({row.args for row in CLI_ROWS}) == len(CLI_ROWS)


# -- the table for the docs ------------------------------------------------------------------------


def markdown_table() -> str:
    """Every row with its outcome, as docs/bad-input.md shows it."""
    import tempfile

    lines = ["| input | exit status | stderr (one line) |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        files = make_files(Path(tmp))
        for row in CLI_ROWS:
            code, _, err = run_cli_row(row.argv(files))
            shown = " ".join(row.argv(files)).replace(tmp, "$TMP")
            lines.append(f"| `sift {shown}` | {code} | `{err.strip().replace(tmp, '$TMP')}` |")
        lines += ["", "| Python call | exception | message |", "|---|---|---|"]
        for row in API_ROWS:
            try:
                row.call(files)
                outcome, message = "no error (a bug)", ""
            except Exception as err:  # noqa: BLE001 - the table shows whatever happens
                outcome, message = type(err).__name__, str(err).replace(tmp, "$TMP")
            lines.append(f"| `{row.label}` | {outcome} | {message} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
