"""Bad input and misuse, table-driven: every row has one asserted outcome.

Three classes of rows:

- errors: a command line must exit with status 2 and print exactly one line on stderr,
  ``sift: error: ...`` containing the expected text, with no traceback anywhere; the
  results of an earlier run in the same ``--out`` (``results.json`` and the figure) must
  be byte-identical afterwards, with nothing added beside them (or, where the row says
  what a run may leave, exactly that). A Python row must raise the expected exception
  type with a one-line message containing the expected text;
- warnings: a command line must succeed and print exactly one line on stderr,
  ``sift: warning: ...``; a Python call must warn once with the expected category and text;
- correct results: a Python call must return the expected outcome.

Some rows set a condition first (a disk that fills, another run holding ``--out``, no
C++ compiler): ``when`` says which. Rows that run a model use the embedded one, loaded once.

``python tests/test_bad_input.py`` prints the table with each outcome (docs/bad-input.md).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import sys
import warnings
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
        "sweep": root / "sweep.toml",
        "sweep_empty_out": root / "sweep-empty-out.toml",
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
    sweep = 'methods = ["full"]\n\n[[task]]\nname = "ifeval"\nlimit = 1\n'
    files["sweep"].write_text(sweep)
    files["sweep_empty_out"].write_text('out = ""\n' + sweep)
    return {key: str(path) for key, path in files.items()}


# -- the table ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cli:
    """``sift ARGS`` must fail: exit status 2, one line ``sift: error: ...`` with ``message``.

    ``{name}`` placeholders name the files of ``make_files``; ``--out {earlier}`` is appended
    to commands that take ``--out`` unless the row sets it. ``setup(files, monkeypatch)`` makes
    the row's condition (``when``) and may return a function that ends it. ``leaves`` checks
    what the run may leave in ``{earlier}`` (default: the earlier run's files, untouched and alone).
    """

    args: str
    message: str
    when: str = ""
    setup: Callable[[dict[str, str], Any], Callable[[], None] | None] | None = None
    leaves: Callable[[dict[str, str], dict[str, bytes]], None] | None = None
    model: bool = False  # the row runs the embedded model

    @property
    def id(self) -> str:
        return self.args + (f" [{self.when}]" if self.when else "")

    def argv(self, files: dict[str, str]) -> list[str]:
        import shlex

        argv = shlex.split(self.args.format(**files))
        if argv[0] in ("ppl", "analyze", "demo") and "--out" not in argv:
            argv += ["--out", files["earlier"]]
        return argv


@dataclass(frozen=True)
class CliWarns(Cli):
    """``sift ARGS`` must succeed (status 0) and print exactly one line on stderr, ``sift: warning: ...`` with ``message``."""


@dataclass(frozen=True)
class Api:
    """A Python call: ``call(files)`` must raise ``error`` with ``message`` in it."""

    label: str
    call: Callable[[dict[str, str]], Any]
    error: type[BaseException] | str  # a name resolves in siftattention at run time
    message: str


@dataclass(frozen=True)
class ApiWarns:
    """A Python call that must warn exactly once with ``category`` and ``message``, and not fail."""

    label: str
    call: Callable[[dict[str, str]], Any]
    category: str  # a name in siftattention.notices
    message: str


@dataclass(frozen=True)
class Works:
    """A Python call that must return ``expect`` (a short description of the correct result it checked)."""

    label: str
    call: Callable[[dict[str, str]], str]
    expect: str


def _exc(name: str) -> type[BaseException]:
    import siftattention
    from siftattention import data, models, report
    from siftattention.eval import analysis
    from siftattention.methods import SpecError
    from siftattention import notices

    for where in (siftattention, data, models, report, analysis, notices):
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


def _keybound_static_cache(_):
    from siftattention import apply

    model = tiny_llama()
    with apply(model, _sift(keybound="channel")):
        return model.generate(input_ids=torch.randint(3, 97, (1, 5)), max_new_tokens=2, cache_implementation="static")


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
    Cli("ppl --method sift:tau=0.875,warmup=64 --seq-len 32", "a warmup of 64 steps leaves no approximated row in a window of 32 tokens"),
    Cli("demo --seq-len 100 --max-new-tokens 4", "a warmup of 128 steps leaves no approximated row in a window of 100 tokens"),
    Cli("ppl --method topk:k=0", "k must be in (0, 1]"),
    Cli("ppl --method h2o:k=2", "k must be in (0, 1]"),
    Cli("ppl --method oracle:tau=0", "tau must be in (0, 1)"),
    Cli("ppl --method toptheta:k=0", "toptheta: k must be an integer >= 1, got 0"),
    Cli("ppl --method toptheta:calibration=books", "calibration must be one of wikitext2, c4, wiki"),
    Cli("ppl --method skipsoftmax:scale=-1", "skipsoftmax: scale must be a positive finite number"),
    Cli("ppl --method sift:tau", "'tau' is not key=value"),
    Cli("ppl --method sift:beta=3", "unknown parameter 'beta'"),
    Cli("ppl --method sift:gqa=group", "sift: gqa must be 'head' or 'shared', got 'group'"),
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
    Cli("generate --path reference --compile", "--compile applies to the fast path; --path reference runs transformers' generate"),
    Cli("eval ifeval --method full --device gpu0", "--device gpu0: expected auto, cpu, cuda or cuda:N"),
    Cli("analyze --device tpu", "--device tpu: expected auto, cpu, cuda or cuda:N"),
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
    Api('model.generate(cache_implementation="static") under apply(model, Sift(keybound="channel"))',
        _keybound_static_cache, ValueError, "keeps an int8 copy of the keys beside transformers' cache, which it "
        "cannot follow here: cache_implementation='static'"),
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


# -- conditions some rows set first ---------------------------------------------------------------------


def hold_out_dir(files: dict[str, str], _mp: Any) -> Callable[[], None]:
    """Another run holds ``{earlier}``: its lock file, locked through another open file (as another process would)."""
    import fcntl

    fd = os.open(Path(files["earlier"]) / ".sift.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"pid 4242, since 2026-01-01 00:00:00")

    def release() -> None:
        (Path(files["earlier"]) / ".sift.lock").unlink()
        os.close(fd)

    return release


def disk_full(suffix: str = "") -> Callable[[dict[str, str], Any], None]:
    """The disk under ``{earlier}`` fills: every write to a file there (whose name holds ``suffix``) fails with ENOSPC."""

    def setup(files: dict[str, str], mp: Any) -> None:
        from siftattention.kernels import cpu_decode

        # The torch decode backend: loading (or building) the CPU kernel is not what these rows time or test.
        mp.setattr(cpu_decode, "_module", None)
        mp.setattr(cpu_decode, "_problem", None)
        mp.setenv("SIFTATTENTION_CPU_KERNEL", "0")
        real_write = os.write
        under = os.path.realpath(files["earlier"])

        def write(fd: int, data: Any) -> int:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.startswith(under + os.sep) and suffix in os.path.basename(target):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        mp.setattr(os, "write", write)

    return setup


def no_compiler(files: dict[str, str], mp: Any) -> None:
    """No C++ compiler, and the fused CPU kernel not yet loaded in this process."""
    from siftattention.kernels import cpu_decode

    mp.setattr(cpu_decode, "_module", None)
    mp.setattr(cpu_decode, "_problem", None)
    mp.setenv("CXX", "/nonexistent/c++")


def cache_is_a_file(files: dict[str, str], mp: Any) -> None:
    """SIFTATTENTION_CACHE names a plain file (a compiler is there), the kernel not yet loaded."""
    from siftattention.kernels import cpu_decode

    mp.setattr(cpu_decode, "_module", None)
    mp.setattr(cpu_decode, "_problem", None)
    mp.setenv("CXX", sys.executable)  # found on PATH's terms; never run, the cache check comes first
    mp.setenv("SIFTATTENTION_CACHE", files["file"])


def _only(*names: str) -> Callable[[dict[str, str], dict[str, bytes]], None]:
    """What a failed run may leave in ``{earlier}``: the earlier run's files untouched, plus ``names`` (new)."""

    def check(files: dict[str, str], earlier: dict[str, bytes]) -> None:
        now = snapshot(Path(files["earlier"]))
        assert {k: now[k] for k in earlier} == earlier
        assert sorted(set(now) - set(earlier)) == sorted(names), sorted(now)

    return check


def _new_results_without_figure(files: dict[str, str], earlier: dict[str, bytes]) -> None:
    """The figure failed: the new results.json (strict JSON, this run's) and no figure beside it."""
    out = Path(files["earlier"])
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]
    payload = json.loads((out / "results.json").read_text(), parse_constant=_no_constant)
    assert [r["method"] for r in payload["results"]] == ["topk:k=0.5", "topk:k=0.25"]


def _analysis_without_figures(files: dict[str, str], earlier: dict[str, bytes]) -> None:
    """A figure failed: the new summary.json and series.npz, no figure or report, the other command's files untouched."""
    now = snapshot(Path(files["earlier"]))
    assert {k: now[k] for k in earlier} == earlier
    assert sorted(set(now) - set(earlier)) == ["series.npz", "summary.json"]
    assert json.loads(now["summary.json"], parse_constant=_no_constant)["seq_len"] == 16


def _eval_samples_kept(files: dict[str, str], earlier: dict[str, bytes]) -> None:
    """Writing the samples failed: run.json, Full's sample file cut back to nothing (no torn line), no summary."""
    _only("ifeval")(files, earlier)
    task = Path(files["earlier"]) / "ifeval"
    assert sorted(p.name for p in task.iterdir()) == ["full.jsonl", "run.json"]
    assert (task / "full.jsonl").read_bytes() == b""


def _eval_finished(files: dict[str, str], earlier: dict[str, bytes]) -> None:
    _only("ifeval")(files, earlier)
    summary = json.loads((Path(files["earlier"]) / "ifeval" / "summary.json").read_text(), parse_constant=_no_constant)
    assert [m["method"] for m in summary["methods"]] == ["full", "sift:tau=0.5,warmup=2"]


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} in a JSON file: strict parsers (JavaScript's JSON.parse) reject it")


SMALL_PPL = "ppl --data-file {corpus} --seq-len 8 --num-seqs 1 --method topk:k=0.5 --method topk:k=0.25"  # a swept family: a figure
SMALL_ANALYSIS = "analyze --data-file {corpus} --seq-len 16 --num-seqs 1 --taus 0.5 --warmups 4"
SMALL_EVAL = "eval ifeval --limit 1 --max-new-tokens 2 --batch-size 1 --no-score --out {earlier}"

CLI_ROWS += [
    # --out "" would scatter a run's files in the current directory
    Cli('ppl --method full --out ""', "Invalid value for '--out': the path is empty"),
    Cli('analyze --out ""', "Invalid value for '--out': the path is empty"),
    Cli('generate --out ""', "Invalid value for '--out': the path is empty"),
    Cli('demo --out ""', "Invalid value for '--out': the path is empty"),
    Cli('eval ifeval --method full --out ""', "Invalid value for '--out': the path is empty"),
    Cli('lm-eval --tasks x --out ""', "Invalid value for '--out': the path is empty"),
    Cli('sweep {sweep} --out ""', "Invalid value for '--out': the path is empty"),
    Cli("sweep {sweep_empty_out}", "out must name a directory, got ''"),
    # one method twice: two identical rows, one file name
    Cli("ppl --method full --method full", "--method full is given twice"),
    Cli("ppl --method sift:tau=0.875 --method sift:warmup=128", "--method sift:warmup=128 is the same method as --method sift:tau=0.875"),
    Cli("generate --method full --method full", "--method full is given twice"),
    Cli("eval ifeval --method topk:k=0.5 --method topk:k=0.50 --out {earlier}", "is the same method as --method topk:k=0.5"),
    Cli("lm-eval --tasks x --method full --method full --out {earlier}", "--method full is given twice"),
    # choices, and a warmup whose buffers would not fit
    Cli("eval ifeval --method full --dtype fp64", "Invalid value for '--dtype': 'fp64' is not one of 'float32', 'bfloat16', 'float16'"),
    Cli("lm-eval --tasks x --dtype half", "Invalid value for '--dtype': 'half' is not one of"),
    Cli("ppl --method sift:warmup=1000000000", "sift: warmup must be at most 65536 steps, got 1000000000"),
    # another run holds --out: the second stops at once instead of replacing the first one's results later
    Cli("ppl --method full", "--out {earlier} is in use by another sift run (pid 4242", "another run holds $TMP/earlier-run", hold_out_dir),
    Cli("analyze", "--out {earlier} is in use by another sift run", "another run holds $TMP/earlier-run", hold_out_dir),
    Cli("generate --out {earlier}", "--out {earlier} is in use by another sift run", "another run holds $TMP/earlier-run", hold_out_dir),
    Cli("demo", "--out {earlier} is in use by another sift run", "another run holds $TMP/earlier-run", hold_out_dir),
    Cli("eval ifeval --method full --limit 1 --out {earlier}", "--out {earlier} is in use by another sift run",
        "another run holds $TMP/earlier-run", hold_out_dir),
    Cli("lm-eval --tasks x --out {earlier}", "--out {earlier} is in use by another sift run", "another run holds $TMP/earlier-run",
        hold_out_dir),
    Cli("sweep {sweep} --out {earlier}", "--out {earlier} is in use by another sift run", "another run holds $TMP/earlier-run",
        hold_out_dir),
    # the disk fills after the work: one line naming the path and what was saved, never a mixed set of files
    Cli(SMALL_PPL, "could not write {earlier}/results.json (No space left on device); nothing was saved", "the disk is full",
        disk_full(), model=True),
    Cli(SMALL_PPL, "could not write {earlier}/ppl_vs_sparsity.png (No space left on device); saved: {earlier}/results.json",
        "the disk fills after results.json", disk_full(".png"), _new_results_without_figure, model=True),
    Cli("generate --prompt Hello --method full --max-new-tokens 2 --out {earlier}",
        "could not write {earlier}/generations.json (No space left on device); nothing was saved", "the disk is full", disk_full(), model=True),
    Cli(SMALL_ANALYSIS, "could not write {earlier}/summary.json (No space left on device); nothing was saved", "the disk is full",
        disk_full(), model=True),
    Cli(SMALL_ANALYSIS, "could not write {earlier}/series_samples.png (No space left on device); saved: {earlier}/summary.json, "
        "{earlier}/series.npz", "the disk fills after the data", disk_full(".png"), _analysis_without_figures, model=True),
    Cli(SMALL_EVAL + " --method full", "could not write {earlier}/ifeval/run.json (No space left on device); nothing was decoded "
        "or saved", "the disk is full",
        disk_full(), _only("ifeval"), model=True),
    Cli(SMALL_EVAL + " --method full", "could not write {earlier}/ifeval/full.jsonl (No space left on device); saved: 0 finished "
        "samples of full", "the disk fills while decoding", disk_full(".jsonl"), _eval_samples_kept, model=True),
    # the library's own warnings reach the command line, one line each
    CliWarns("generate --prompt Hello --method sift:tau=0.5,warmup=2 --max-new-tokens 2", "the fused CPU decode kernel is not used: no C++ compiler "
             "found; the torch backend runs instead", "no C++ compiler", no_compiler, model=True),
    CliWarns(SMALL_EVAL + " --method sift:tau=0.5,warmup=2", "the fused CPU decode kernel is not used: no C++ compiler found",
             "no C++ compiler", no_compiler, _eval_finished, model=True),
    CliWarns("generate --prompt Hello --method sift:tau=0.5,warmup=2 --max-new-tokens 2", "the fused CPU decode kernel is not used: "
             "SIFTATTENTION_CACHE={file} is not a directory", "SIFTATTENTION_CACHE is a file", cache_is_a_file, model=True),
]


# -- generation inputs, restoring the model, buffers sized by a parameter ---------------------------------


def _tiny_ids(n: int = 6) -> torch.Tensor:
    return torch.arange(3, 3 + n)[None]


def _gen(ids: Any = None, mask: Any = None, method: Any = None, model: Any = None, **kw: Any) -> Any:
    from siftattention import Full, generate

    return generate(model or tiny_llama(), _tiny_ids() if ids is None else ids, mask, method or Full(), **{"max_new_tokens": 3, **kw})


def _ref_gen(ids: Any, **kw: Any) -> Any:
    from siftattention import Full
    from siftattention.generation import reference_generate

    return reference_generate(tiny_llama(), ids, None, Full(), max_new_tokens=3, **kw)


def _under_apply(ids: Any, mask: Any = None) -> Any:
    """transformers' generate on a model with a method applied."""
    from siftattention import Sift, apply

    model = tiny_llama()
    with apply(model, Sift(tau=0.5, warmup=2)):
        return model.generate(ids, attention_mask=mask, max_new_tokens=3)


def _fake_cuda_ids() -> torch.Tensor:
    """Token ids on a CUDA device with no GPU here (a fake tensor: a shape and a device, no data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.zeros(1, 6, dtype=torch.long, device="cuda")


def _with_id(token: int) -> torch.Tensor:
    ids = _tiny_ids()
    ids[0, 2] = token
    return ids


def _meta_model_gen(_: Any) -> Any:
    from siftattention import Full, generate

    with torch.device("meta"):
        model = tiny_llama()
    return generate(model, _tiny_ids(), None, Full(), max_new_tokens=3)


def _claim_held(files: dict[str, str]) -> None:
    from siftattention.output import claim_out_dir

    release = hold_out_dir(files, None)
    try:
        with claim_out_dir(files["earlier"]):
            pass
    finally:
        release()


def _run_ppl_empty_out(_: Any) -> Any:
    from siftattention.cli import run_ppl

    return run_ppl("smollm2-135m", "wikitext2", None, 16, 1, ("full",), "")


API_ROWS += [
    Api("generate(top_k=-5)", lambda f: _gen(do_sample=True, top_k=-5), ValueError, "top_k must be None (no limit) or an integer >= 1, got -5"),
    Api("generate(top_k=0)", lambda f: _gen(do_sample=True, top_k=0), ValueError, "top_k must be None (no limit) or an integer >= 1, got 0"),
    Api("generate(temperature=0)", lambda f: _gen(do_sample=True, temperature=0.0), ValueError,
        "temperature must be a finite number > 0, got 0.0"),
    Api("generate(temperature=nan)", lambda f: _gen(do_sample=True, temperature=math.nan), ValueError,
        "temperature must be a finite number > 0, got nan"),
    Api("generate(temperature=-1) without sampling", lambda f: _gen(temperature=-1.0), ValueError,
        "temperature must be a finite number > 0, got -1.0"),
    Api('generate(do_sample="yes")', lambda f: _gen(do_sample="yes"), ValueError, "do_sample must be True or False, got 'yes'"),
    Api("generate(a token id = the vocabulary size)", lambda f: _gen(_with_id(97)), ValueError,
        "input_ids hold the token id 97, outside the model's vocabulary of 97 (ids 0..96)"),
    Api("generate(a negative token id)", lambda f: _gen(_with_id(-3)), ValueError, "input_ids hold the negative token id -3"),
    Api("generate(float input_ids)", lambda f: _gen(_tiny_ids().float()), ValueError, "input_ids must hold integer token ids, got float32"),
    Api("generate(bool input_ids)", lambda f: _gen(_tiny_ids() > 4), ValueError, "input_ids must hold integer token ids, got bool"),
    Api("generate(input_ids as a list)", lambda f: _gen([[3, 4, 5]]), ValueError, "input_ids must be a tensor of token ids"),
    Api("generate(1-d input_ids)", lambda f: _gen(_tiny_ids()[0]), ValueError, "input_ids must be [batch, prompt_len], got shape (6,)"),
    Api("generate(an empty prompt)", lambda f: _gen(_tiny_ids()[:, :0]), ValueError, "the prompt is empty"),
    Api("generate(an empty batch)", lambda f: _gen(_tiny_ids()[:0]), ValueError, "the batch is empty"),
    Api("generate(attention_mask of another shape)", lambda f: _gen(mask=torch.ones(1, 4, dtype=torch.long)), ValueError,
        "attention_mask (1, 4) and input_ids (1, 6) differ in shape"),
    Api("generate(attention_mask of 2s)", lambda f: _gen(mask=torch.full((1, 6), 2)), ValueError,
        "attention_mask must hold only 0 (padding) and 1 (a token)"),
    Api("generate(right padding)", lambda f: _gen(mask=torch.tensor([[1, 1, 1, 1, 0, 0]])), ValueError,
        "attention_mask must describe left padding"),
    Api("generate(input_ids on the meta device)", lambda f: _gen(_tiny_ids().to("meta")), ValueError,
        "input_ids is on the meta device, which holds no values"),
    Api("generate(input_ids on CUDA, no GPU here)", lambda f: _gen(_fake_cuda_ids()), ValueError,
        "input_ids is on cuda:0, but no CUDA device is available here"),
    Api("generate(a model on the meta device)", _meta_model_gen, ValueError, "the model's weights are on the meta device"),
    Api("generate(pad_token_id outside the vocabulary)", lambda f: _gen(pad_token_id=500), ValueError,
        "pad_token_id 500 is not a token id of the model (ids 0..96)"),
    Api('generate(eos_token_id="</s>")', lambda f: _gen(eos_token_id="</s>"), ValueError,
        "eos_token_id must be a token id or a list of token ids, got '</s>'"),
    Api("generate(max_new_tokens=0)", lambda f: _gen(max_new_tokens=0), ValueError, "max_new_tokens must be an integer >= 1, got 0"),
    Api("generate(prefill_chunk=0)", lambda f: _gen(prefill_chunk=0), ValueError, "prefill_chunk must be an integer >= 1, got 0"),
    Api("generate(check_every=0)", lambda f: _gen(check_every=0), ValueError, "check_every must be an integer >= 1, got 0"),
    Api("reference_generate(a token id = the vocabulary size)", lambda f: _ref_gen(_with_id(97)), ValueError,
        "input_ids hold the token id 97, outside the model's vocabulary of 97"),
    Api("reference_generate(top_k=-5)", lambda f: _ref_gen(_tiny_ids(), do_sample=True, top_k=-5), ValueError,
        "top_k must be None (no limit) or an integer >= 1, got -5"),
    Api("model.generate under apply (a token id = the vocabulary size)", lambda f: _under_apply(_with_id(97)), ValueError,
        "input_ids hold the token id 97, outside the model's vocabulary of 97"),
    Api("model.generate under apply (input_ids on the meta device)", lambda f: _under_apply(_tiny_ids().to("meta")), ValueError,
        "input_ids is on the meta device, which holds no values"),
    Api("model.generate under apply (input_ids on CUDA, no GPU here)", lambda f: _under_apply(_fake_cuda_ids()), ValueError,
        "input_ids is on cuda:0, but no CUDA device is available here"),
    Api("model.generate under apply (float input_ids)", lambda f: _under_apply(_tiny_ids().float()), ValueError,
        "input_ids must hold integer token ids, got float32"),
    Api("model.generate under apply (attention_mask of another shape)",
        lambda f: _under_apply(_tiny_ids(), torch.ones(1, 5, dtype=torch.long)), ValueError, "differ in shape"),
    Api("Sift(warmup=10**9)", lambda f: _sift(warmup=10**9), ValueError, "warmup must be at most 65536 steps, got 1000000000"),
    Api('parse_methods(["full", "full"])', lambda f: __import__("siftattention.methods").methods.parse_methods(["full", "full"]),
        "SpecError", "--method full is given twice"),
    Api('check_out_dir("")', lambda f: __import__("siftattention.report").report.check_out_dir(""), "OutputDirError", "--out is empty"),
    Api('run_ppl(..., out="")', _run_ppl_empty_out, "OutputDirError", "--out is empty; give a directory"),
    Api("claim_out_dir(a directory another run holds)", _claim_held, "OutputDirError",
        "is in use by another sift run (pid 4242, since 2026-01-01 00:00:00)"),
]


def _round_trip(implementation: str) -> str:
    """apply then remove on a model configured for ``implementation``; a second apply after it works too."""
    from siftattention import Full, Sift, apply

    model = tiny_llama()
    model.config._attn_implementation = implementation
    with apply(model, Sift(tau=0.5, warmup=2)) as handle:
        assert model.config._attn_implementation == handle.name
    again = apply(model, Full())
    again.remove()
    left = hasattr(model, "_siftattention_handle") or "generate" in vars(model)
    return f"{model.config._attn_implementation} restored" + (", the model still patched" if left else "")


def _generate_on(implementation: str) -> str:
    """siftattention.generate on a model configured for ``implementation``: the tokens of an sdpa one, and restored."""
    from siftattention import Sift

    model = tiny_llama()
    model.config._attn_implementation = implementation
    res = _gen(method=Sift(tau=0.5, warmup=2), model=model, max_new_tokens=6)
    same = torch.equal(res.new_tokens, _gen(method=Sift(tau=0.5, warmup=2), max_new_tokens=6).new_tokens)
    return f"{'the same' if same else 'other'} tokens as on sdpa; {model.config._attn_implementation} restored"


def _skip_softmax_huge_block(_: Any) -> str:
    """A block wider than any row is the whole row: nothing skipped, Full's logits, no allocation by the block."""
    from siftattention import Full, SkipSoftmax, apply

    model, ids = tiny_llama(), torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with apply(model, Full()):
            full = model(ids).logits
        with apply(model, SkipSoftmax(scale=1e-6, block=10**9)) as handle:
            logits = model(ids).logits
    same = torch.allclose(logits, full, atol=1e-5)
    return f"sparsity {handle.stats.realized_sparsity():.1f}, {'the same' if same else 'other'} logits as Full"


def _longest_warmup(_: Any) -> str:
    from siftattention import Sift, apply

    model = tiny_llama()
    with apply(model, Sift(tau=0.5, warmup=65536)) as handle, torch.no_grad():
        model(_tiny_ids(20))
    return f"every step exact: sparsity {handle.stats.realized_sparsity():.1f}"


def _top_k_beyond_vocabulary(_: Any) -> str:
    torch.manual_seed(0)
    wide = _gen(do_sample=True, top_k=10**6, max_new_tokens=8).new_tokens
    torch.manual_seed(0)
    unlimited = _gen(do_sample=True, top_k=None, max_new_tokens=8).new_tokens
    return "the same tokens as top_k=None" if torch.equal(wide, unlimited) else "other tokens than top_k=None"


def _strict_json(files: dict[str, str]) -> str:
    from siftattention.report import write_json

    path = write_json(Path(files["dir"]) / "r.json", {"ppl": math.nan, "steps": [math.inf, 1.5]})
    return repr(json.loads(path.read_text(), parse_constant=_no_constant))


def _file_mode(files: dict[str, str]) -> str:
    """Result files get the mode the umask gives, as any file the user creates."""
    from siftattention.output import save_run

    old = os.umask(0o022)
    try:
        path = save_run(Path(files["dir"]), {"results.json": b"{}\n"})[0]
    finally:
        os.umask(old)
    return oct(path.stat().st_mode & 0o777)


def _lock_released(files: dict[str, str]) -> str:
    from siftattention.output import claim_out_dir

    with claim_out_dir(files["dir"]) as out, claim_out_dir(files["dir"]):  # a command running another claims again
        held = (Path(out) / ".sift.lock").is_file()
    with claim_out_dir(files["dir"]):  # the next run
        pass
    return f"held: {held}, left behind: {(Path(files['dir']) / '.sift.lock').exists()}"


def _lock_across_processes(files: dict[str, str]) -> str:
    """A second process claiming the directory while this one holds it is refused; after, it gets it."""
    import subprocess

    from siftattention.output import claim_out_dir

    code = ("import sys; from siftattention.output import claim_out_dir\n"
            "try:\n    with claim_out_dir(sys.argv[1], lock=True): print('got it')\n"
            "except ValueError as e: print(e)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = lambda: subprocess.run([sys.executable, "-c", code, files["dir"]], capture_output=True, text=True, env=env,  # noqa: E731
                                 timeout=60).stdout.strip()
    with claim_out_dir(files["dir"]):
        during = run()
    after = run()
    return f"{'refused' if 'in use by another sift run' in during else during}, then {after}"


WORKS_ROWS: list[Works] = [
    Works("apply then remove on an eager model", lambda f: _round_trip("eager"), "eager restored"),
    Works("apply then remove on an sdpa model", lambda f: _round_trip("sdpa"), "sdpa restored"),
    Works("apply then remove on a flex_attention model", lambda f: _round_trip("flex_attention"), "flex_attention restored"),
    Works("apply then remove on a flash_attention_2 model (flash-attn not installed)", lambda f: _round_trip("flash_attention_2"),
          "flash_attention_2 restored"),
    Works("siftattention.generate on a flash_attention_2 model", lambda f: _generate_on("flash_attention_2"),
          "the same tokens as on sdpa; flash_attention_2 restored"),
    Works("siftattention.generate on an eager model", lambda f: _generate_on("eager"), "the same tokens as on sdpa; eager restored"),
    Works("SkipSoftmax(block=10**9)", _skip_softmax_huge_block, "sparsity 0.0, the same logits as Full"),
    Works("Sift(warmup=65536), the longest", _longest_warmup, "every step exact: sparsity 0.0"),
    Works("generate(do_sample=True, top_k=10**6)", _top_k_beyond_vocabulary, "the same tokens as top_k=None"),
    Works("write_json with NaN and inf", _strict_json, "{'ppl': None, 'steps': [None, 1.5]}"),
    Works("a results file's mode under umask 022", _file_mode, "0o644"),
    Works("claim_out_dir twice in one run, then the next run", _lock_released, "held: True, left behind: False"),
    Works("claim_out_dir from a second process", _lock_across_processes, "refused, then got it"),
]


def _fallback_notice(_: Any) -> Any:
    from siftattention import H2O

    return _gen(method=H2O(k=0.5))


def _load_kernel(files: dict[str, str], condition: Callable[[dict[str, str], Any], None]) -> Any:
    from siftattention.kernels import cpu_decode

    with pytest.MonkeyPatch.context() as mp:
        condition(files, mp)
        return cpu_decode.load()


def _compile_without_compiler(_: Any) -> Any:
    from siftattention.kernels import cpu_decode

    cpu_decode.load()  # the fused CPU kernel, built or loaded first: this row is about torch.compile's compiler
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", "/nonexistent/c++")
        return _gen(compile=True)


WARN_ROWS: list[ApiWarns] = [
    ApiWarns("generate(method=H2O(k=0.5))", _fallback_notice, "FallbackWarning",
             "using transformers' generate (h2o has no device-side decode step"),
    ApiWarns("generate(compile=True) on the CPU without a C++ compiler", _compile_without_compiler, "SiftWarning",
             "siftattention.generate: compile=True is not used: torch.compile needs a C++ compiler on the CPU and found "
             "none (/nonexistent/c++); the decode steps run eagerly"),
    ApiWarns("the CPU kernel without a C++ compiler", lambda f: _load_kernel(f, no_compiler), "SiftWarning",
             "the fused CPU decode kernel is not used: no C++ compiler found"),
    ApiWarns("the CPU kernel with SIFTATTENTION_CACHE a file", lambda f: _load_kernel(f, cache_is_a_file), "SiftWarning",
             "SIFTATTENTION_CACHE={file} is not a directory"),
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
    """Every entry of ``directory`` with its bytes (a subdirectory as b"<dir>")."""
    return {p.name: p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(directory.iterdir())}


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    return make_files(tmp_path)


ERROR_ROWS = [row for row in CLI_ROWS if not isinstance(row, CliWarns)]
WARNING_ROWS = [row for row in CLI_ROWS if isinstance(row, CliWarns)]
_loaded: dict[str, Any] = {}


def cached_loader(embedded: Callable[[], Any] | None = None) -> Callable[..., Any]:
    """``load_model`` loading each model once for all the rows (the embedded one from ``embedded()`` where given)."""
    from siftattention import models

    real = models.load_model

    def load_model(name: str, **_: Any) -> Any:
        if name not in _loaded:
            loaded = embedded() if embedded is not None and name == models.DEFAULT_MODEL else None
            _loaded[name] = loaded if loaded is not None else real(name)
        return _loaded[name]

    return load_model


def run_row(row: Cli, files: dict[str, str], load_model: Callable[..., Any]) -> tuple[int | None, str, str]:
    """A command-line row under its condition, which ends with the run."""
    from siftattention import models

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "load_model", load_model)
        end = row.setup(files, mp) if row.setup is not None else None
        try:
            return run_cli_row(row.argv(files))
        finally:
            if end is not None:
                end()


@pytest.fixture
def load_model(request) -> Callable[..., Any]:
    """The row's model loader: the session's embedded model for a row that runs one."""
    row = request.node.callspec.params["row"]
    model = request.getfixturevalue("embedded") if row.model else None
    return cached_loader(lambda: model)


def _check_leaves(row: Cli, files: dict[str, str], earlier: dict[str, bytes]) -> None:
    if row.leaves is not None:
        row.leaves(files, earlier)
    else:
        assert snapshot(Path(files["earlier"])) == earlier  # the earlier results, untouched and alone


@pytest.mark.parametrize("row", ERROR_ROWS, ids=[row.id for row in ERROR_ROWS])
def test_cli_bad_input(row: Cli, files: dict[str, str], load_model) -> None:
    earlier = snapshot(Path(files["earlier"]))
    code, out, err = run_row(row, files, load_model)
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("sift: error: "), err
    assert row.message.format(**files) in lines[0]
    assert "Traceback" not in out + err
    _check_leaves(row, files, earlier)


@pytest.mark.parametrize("row", WARNING_ROWS, ids=[row.id for row in WARNING_ROWS])
def test_cli_warning(row: CliWarns, files: dict[str, str], load_model) -> None:
    earlier = snapshot(Path(files["earlier"]))
    code, out, err = run_row(row, files, load_model)
    lines = err.strip().splitlines()
    assert code == 0, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("sift: warning: "), err
    assert row.message.format(**files) in lines[0]
    assert "Traceback" not in out + err
    _check_leaves(row, files, earlier)


@pytest.mark.parametrize("row", API_ROWS, ids=[row.label for row in API_ROWS])
def test_api_bad_input(row: Api, files: dict[str, str]) -> None:
    error = _exc(row.error) if isinstance(row.error, str) else row.error
    with pytest.raises(error) as info:
        row.call(files)
    message = str(info.value)
    assert "\n" not in message
    assert row.message.format(**files) in message


@pytest.mark.parametrize("row", WORKS_ROWS, ids=[row.label for row in WORKS_ROWS])
def test_api_correct_result(row: Works, files: dict[str, str]) -> None:
    assert row.call(files) == row.expect


@pytest.mark.parametrize("row", WARN_ROWS, ids=[row.label for row in WARN_ROWS])
def test_api_warning(row: ApiWarns, files: dict[str, str]) -> None:
    from siftattention.notices import SiftWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row.call(files)
    ours = [w for w in caught if issubclass(w.category, SiftWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert issubclass(ours[0].category, _exc(row.category)) and "\n" not in str(ours[0].message)
    assert row.message.format(**files) in str(ours[0].message)


def test_the_table_is_large_enough() -> None:
    rows = CLI_ROWS + API_ROWS + WORKS_ROWS + WARN_ROWS
    assert len(rows) >= 90 and len({row.id for row in CLI_ROWS}) == len(CLI_ROWS)
    assert len({row.label for row in rows if not isinstance(row, Cli)}) == len(rows) - len(CLI_ROWS)


# -- the table for the docs ------------------------------------------------------------------------


def markdown_table() -> str:
    """Every row with its outcome, as docs/bad-input.md shows it."""
    import shlex
    import tempfile

    def cell(text: str) -> str:
        return text.replace(root, "$TMP").replace("|", "\\|")

    lines = ["| input | condition | exit status | stderr (one line) |", "|---|---|---|---|"]
    load = cached_loader()
    with tempfile.TemporaryDirectory() as tmp:
        for row in CLI_ROWS:
            root = tempfile.mkdtemp(dir=tmp)  # each row its own files: a row may change the earlier run's
            files = make_files(Path(root))
            code, _, err = run_row(row, files, load)
            lines.append(f"| `sift {cell(shlex.join(row.argv(files)))}` | {row.when} | {code} | `{cell(err.strip())}` |")
        root = tempfile.mkdtemp(dir=tmp)
        files = make_files(Path(root))
        lines += ["", "| Python call | exception | message |", "|---|---|---|"]
        for row in API_ROWS:
            try:
                row.call(files)
                outcome, message = "no error (a bug)", ""
            except Exception as err:  # noqa: BLE001 - the table shows whatever happens
                outcome, message = type(err).__name__, cell(str(err))
            lines.append(f"| `{cell(row.label)}` | {outcome} | {message} |")
        lines += ["", "| Python call | warning | message |", "|---|---|---|"]
        for row in WARN_ROWS:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                row.call(files)
            shown = "; ".join(f"{w.category.__name__}: {w.message}" for w in caught) or "no warning (a bug)"
            lines.append(f"| `{cell(row.label)}` | {row.category} | {cell(shown)} |")
        lines += ["", "| Python call | result |", "|---|---|"]
        for row in WORKS_ROWS:
            lines.append(f"| `{cell(row.label)}` | {cell(row.call(files))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
