"""The ``sift`` command line."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich.console import Console

from .cli_common import DTYPES, OutDir, resolve_device, run_command
from .methods import SPEC_HELP, parse_method, parse_methods
from .progress import prepare_methods, progress, status

# Piped output (CI logs, `make demo | tee`) gets room for the full method specs in tables.
console = Console(width=None if sys.stdout.isatty() else 132)
err_console = Console(stderr=True)

DEMO_METHODS = [
    "full",
    "topk:k=0.125",
    "h2o:k=0.125",
    "sift:tau=0.875,warmup=128",
    "sift:tau=0.875,warmup=128,renormalize=true",
    "oracle:tau=0.875",
    "oracle:tau=0.875,renormalize=true",
    "toptheta:k=16",
    "skipsoftmax:scale=64,block=32",
]

# The prompt of the paper's appendix generation sample.
PAPER_PROMPT = (
    "In a world where technology has advanced beyond imagination, society grapples with the consequences of its own "
    "creations. The integration of artificial intelligence into everyday life has revolutionized how we live, work, and "
    "interact. However, with great power comes great responsibility, and ethical dilemmas abound. Governments struggle "
    "to regulate the use of AI, while corporations push the boundaries of what is possible in the pursuit of profit. "
    "Meanwhile, individuals navigate a landscape where privacy is increasingly scarce, and the line between human and "
    "machine blurs. Against this backdrop, a new generation of thinkers emerges, questioning the very nature of "
    "consciousness and what it means to be human. As tensions rise and alliances shift, the fate of humanity hangs in "
    "the balance, waiting to be written by those bold enough to seize the pen of destiny."
)


def _load(model_name: str, device: str = "cpu", dtype: str = "float32"):
    import torch

    from .models import load_model
    from .parallel import launched_by_torchrun

    sharded = launched_by_torchrun()
    with status(console, f"loading {model_name} ..."):
        start = time.perf_counter()
        model, tokenizer = load_model(model_name, tensor_parallel=sharded, device=device, dtype=getattr(torch, dtype))
    sharded_over = f", heads sharded over {os.environ['WORLD_SIZE']} tensor-parallel ranks" if sharded else ""
    console.print(f"model: {model_name} ({type(model).__name__}{sharded_over}) loaded in {time.perf_counter() - start:.1f} s")
    return model, tokenizer


def run_ppl(
    model_name: str, dataset: str, data_file: str | None, seq_len: int, num_seqs: int, specs: tuple[str, ...], out: Path, loaded=None,
    device: str = "cpu", dtype: str = "float32", prompt_len: int = 0,
) -> dict:
    """Load, evaluate and write ``out/results.json`` (+ the sweep plot); returns the results payload."""
    from .data import load_corpus
    from .eval.perplexity import check_prompt_len, check_windows
    from .report import claim_out_dir

    # Every cheap check before the model load: specs, data, the output directory (held until the results are written).
    methods = parse_methods(specs)
    check_windows(methods, seq_len)  # a warmup longer than the window: refused before the model loads
    check_prompt_len(prompt_len, seq_len)
    corpus = load_corpus(dataset, data_file)
    if not corpus.text.strip():
        raise ValueError(f"the corpus is empty ({corpus.source})")
    with claim_out_dir(out) as out:
        return _ppl(model_name, dataset, corpus, seq_len, num_seqs, methods, out, loaded, device, dtype, prompt_len)


def _ppl(model_name: str, dataset: str, corpus, seq_len: int, num_seqs: int, methods: list, out: Path, loaded,
         device: str = "cpu", dtype: str = "float32", prompt_len: int = 0) -> dict:
    from .data import token_windows
    from .eval.perplexity import evaluate_perplexity
    from .output import json_bytes, save_run
    from .parallel import is_main_rank
    from .report import plot_ppl_vs_sparsity, results_table, versions

    model, tokenizer = loaded or _load(model_name, device, dtype)
    windows = token_windows(corpus.text, tokenizer, seq_len, num_seqs)
    console.print(f"data: {dataset} from {corpus.source}: {num_seqs} windows x {seq_len} tokens")
    start = time.perf_counter()
    prepare_methods(console, model, methods)
    with progress(console) as bars:
        task = bars.add_task("perplexity", total=len(methods) * num_seqs)

        def on_step(spec: str, i: int) -> None:
            bars.update(task, advance=1, description=f"perplexity [{spec}]")

        results, warm = evaluate_perplexity(model, windows, methods, on_step=on_step, prompt_len=prompt_len)
    rows = [r.to_dict() for r in results]
    payload = {
        "model": model_name,
        "dataset": dataset,
        "data_source": corpus.source,
        "seq_len": seq_len,
        "num_seqs": num_seqs,
        "post_warmup_from": warm,
        **({"prompt_len": prompt_len} if prompt_len else {}),
        "versions": versions(),
        "elapsed_s": round(time.perf_counter() - start, 1),
        "results": rows,
    }
    console.print(results_table(rows, title=f"{model_name} / {dataset}, {num_seqs} x {seq_len} tokens (W = {warm})"))
    if is_main_rank():  # under torchrun every rank has the same results; one writes them
        title = f"{model_name} on {dataset}, seq-len {seq_len}"
        written = save_run(out, {"results.json": json_bytes(payload)}, stale=["ppl_vs_sparsity.png"],
                           figures=lambda: plot_ppl_vs_sparsity(rows, out / "ppl_vs_sparsity.png", title))
        console.print("wrote " + " and ".join(str(p) for p in written), highlight=False)
    return payload


def complete_text(tokenizer, new_ids) -> str:
    """The text of the new tokens, without a last character whose bytes were cut off.

    Byte-level tokenizers spread a multi-byte character (an emoji) over several tokens;
    when generation stops inside one, its partial bytes decode to U+FFFD. The whole
    sequence is decoded at once (never token by token, which would break every such
    character), and the last tokens are left out while the text still ends in U+FFFD
    (at most three: a UTF-8 character has at most four bytes). Decoding cannot tell a
    replacement character the model wrote at the very end from a cut one; elsewhere it is kept.
    """
    ids = [int(i) for i in new_ids]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for cut in range(1, min(3, len(ids)) + 1):
        if not text.endswith("\ufffd"):
            break
        text = tokenizer.decode(ids[:-cut], skip_special_tokens=True)
    return text.rstrip("\ufffd")


@dataclass
class Generation:
    """One method's greedy generation as ``sift generate`` reports it."""

    spec: str
    text: str
    new_tokens: int
    sparsity: float
    sparsity_post_warmup: float | None  # None: the method has a warmup and no step came after it
    path: str  # "fast" (siftattention.generate) or "transformers" (its generate under apply)
    seconds: float  # prefill and decode
    steady_tokens_per_s: float | None  # fast path: the last phase's median step, after capture
    fallback_reason: str | None = None
    first_call_seconds: float | None = None  # the same call made first (kernels built and compiled in it)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


GENERATE_PATHS = ("auto", "fast", "reference")


def generate_text(model, tokenizer, prompt: str, spec: str, max_new_tokens: int, chat: bool = True, path: str = "auto",
                  compile: bool = False) -> Generation:
    """Greedy generation with a method, timed, with its realized sparsity.

    ``path``: "fast" or "auto" decode through ``siftattention.generate`` (which itself falls
    back to transformers' ``generate`` for a method it cannot serve, saying why in
    ``fallback_reason``); "reference" through ``reference_generate`` (transformers'
    ``generate`` under ``apply``). Both give the same tokens. ``compile``: the fast path's decode
    steps through torch.compile (``generate(compile=True)``; the command refuses it with "reference").
    """
    import warnings

    from .generation import generate, reference_generate
    from .notices import FallbackWarning

    if path not in GENERATE_PATHS:
        raise ValueError(f"path must be one of {', '.join(GENERATE_PATHS)}, got {path!r}")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        ids = tokenizer(prompt, return_tensors="pt")
    ids = ids.to(model.device)  # a tensor-parallel rank's model is on that rank's device
    method = parse_method(spec)
    prepare_methods(console, model, [(spec, method)])
    run = reference_generate if path == "reference" else functools.partial(generate, compile=compile)
    with warnings.catch_warnings():
        # The fast path's fallback notice is reported as the path's reason; every other warning shows.
        warnings.filterwarnings("ignore", category=FallbackWarning)
        res = run(model, ids["input_ids"], ids["attention_mask"], method, max_new_tokens=max_new_tokens,
                  pad_token_id=tokenizer.eos_token_id)
    new_ids = res.new_tokens[0, : int(res.num_generated[0])]
    seconds = res.timings.get("total_s", res.timings.get("prefill_s", 0.0) + res.timings.get("decode_s", 0.0))
    phases = [p for name, p in res.timings.get("phases", {}).items() if not name.startswith("after_")]
    none_after_warmup = method.warmup > 0 and res.stats.step_count(post_warmup=True) == 0
    return Generation(
        spec=spec, text=complete_text(tokenizer, new_ids), new_tokens=int(new_ids.shape[0]), sparsity=res.stats.realized_sparsity(),
        sparsity_post_warmup=None if none_after_warmup else res.stats.realized_sparsity(post_warmup=True),
        path="fast" if res.fast else "transformers", seconds=seconds,
        steady_tokens_per_s=1e3 / phases[-1]["steady_ms"] if phases else None, fallback_reason=res.fallback_reason)


#: The commands that shard the model's heads over the ranks of a ``torchrun`` launch (rank 0 prints and writes).
TENSOR_PARALLEL_COMMANDS = ("ppl", "generate", "demo")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="siftattention")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """SiftAttention: power-law guided sparse attention for LLM decoding.

    Under torchrun, ppl, generate and demo shard the model's heads over the ranks
    (tensor parallelism); rank 0 prints and writes.
    """
    from .parallel import is_main_rank, launched_by_torchrun

    if launched_by_torchrun():
        console.quiet = err_console.quiet = not is_main_rank()
        if ctx.invoked_subcommand not in (*TENSOR_PARALLEL_COMMANDS, "models"):  # models loads nothing
            raise click.UsageError(f"sift {ctx.invoked_subcommand} does not run under torchrun; "
                                   f"{', '.join(TENSOR_PARALLEL_COMMANDS)} do (tensor parallelism)")


MODEL_HELP = "embedded name (smollm2-135m, gemma3-270m, qwen2.5-1.5b; `sift models`), a local directory, or a hub id"
PPL_HELP = """Teacher-forced perplexity of several methods against their realized sparsity.

The corpus is cut into the first NUM-SEQS non-overlapping windows of SEQ-LEN tokens; every
row of a window is one generation step. Prints a table and writes into --out:
results.json (ppl, ppl_post_warmup, realized_sparsity, realized_sparsity_post_warmup and
tokens per method; the data source and versions) and, when a method family has several
settings, ppl_vs_sparsity.png. One run at a time per --out: a second one stops at once.

\b
""" + SPEC_HELP


@cli.command(help=PPL_HELP, short_help="Perplexity of methods against their realized sparsity.")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True, help=MODEL_HELP)
@click.option("--dataset", default="wikitext2", show_default=True, help="wikitext2, c4 or wiki")
@click.option("--data-file", type=click.Path(dir_okay=False), default=None, help="read this text file whole instead")
@click.option("--seq-len", default=1024, show_default=True, type=click.IntRange(min=2), help="tokens per window (steps S = 1..seq-len)")
@click.option("--num-seqs", default=8, show_default=True, type=click.IntRange(min=1), help="number of windows")
@click.option("--method", "specs", multiple=True, required=True, help="method spec, repeatable (see above); each method once")
@click.option("--out", type=OutDir(), default=Path("runs/ppl"), show_default=True,
              help="directory for results.json and ppl_vs_sparsity.png (created if missing)")
@click.option("--device", default="cpu", show_default=True, help="auto, cpu, cuda or cuda:N (unused under torchrun)")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True, help="the weights' precision")
@click.option("--prompt-len", default=0, show_default=True, type=click.IntRange(min=0),
              help="score each window as a decode: its first N tokens are a prompt (prefilled exactly, Sift calibrates on "
                   "it), the tokens after it are decode steps and the only ones scored (0: every row is a step)")
def ppl(model_name: str, dataset: str, data_file: str | None, seq_len: int, num_seqs: int, specs: tuple[str, ...], out: Path,
        device: str, dtype: str, prompt_len: int) -> None:

    run_ppl(model_name, dataset, data_file, seq_len, num_seqs, specs, out, device=resolve_device(device), dtype=dtype,
            prompt_len=prompt_len)


@cli.command(help="Greedy generation with one or more methods, printed side by side, with tokens/s and realized sparsity. "
             "Each method runs twice: the table gives the first call's seconds (kernels built and compiled) and the "
             "second call's speed.\n\n\b\n" + SPEC_HELP,
             short_help="Greedy generation with each method, side by side, timed.")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True, help=MODEL_HELP)
@click.option("--prompt", default=PAPER_PROMPT, help="defaults to the paper's appendix prompt")
@click.option("--method", "specs", multiple=True, default=("full", "sift:tau=0.875,warmup=16"), show_default=True,
              help="method spec, repeatable (see above); each method once")
@click.option("--max-new-tokens", default=96, show_default=True, type=click.IntRange(min=1))
@click.option("--path", "gen_path", type=click.Choice(GENERATE_PATHS), default="auto", show_default=True,
              help="decode path: the fast loop (siftattention.generate) or transformers' generate")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N (unused under torchrun)")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True, help="the weights' precision")
@click.option("--compile", "compile_steps", is_flag=True,
              help="the fast path's decode steps through torch.compile (the model's small ops fused; the first call "
                   "compiles): faster decoding at long context, dense and sparse alike")
@click.option("--out", type=OutDir(), default=None, help="also write generations.json into this directory")
def generate(model_name: str, prompt: str, specs: tuple[str, ...], max_new_tokens: int, gen_path: str, device: str, dtype: str,
             compile_steps: bool, out: Path | None) -> None:
    from .report import claim_out_dir

    if compile_steps and gen_path == "reference":
        raise click.UsageError("--compile applies to the fast path; --path reference runs transformers' generate")
    parse_methods(specs)
    device = resolve_device(device)
    with claim_out_dir(out) if out is not None else contextlib.nullcontext():
        model, tokenizer = _load(model_name, device, dtype)
        results = _print_generations(model, tokenizer, prompt, specs, max_new_tokens, gen_path, compile_steps)
        if out is not None:
            _write_generations(out / "generations.json", model_name, model, prompt, max_new_tokens, gen_path, results,
                               compile_steps)


def _print_generations(model, tokenizer, prompt: str, specs: tuple[str, ...], max_new_tokens: int, path: str = "auto",
                       compile: bool = False) -> list[Generation]:
    from rich.columns import Columns
    from rich.panel import Panel
    from rich.table import Table

    results, panels = [], []
    for spec in specs:
        with status(console, f"generating with {spec} (twice: the first call builds and compiles its kernels) ..."):
            first = generate_text(model, tokenizer, prompt, spec, max_new_tokens, path=path, compile=compile)
            res = generate_text(model, tokenizer, prompt, spec, max_new_tokens, path=path, compile=compile)
        res.first_call_seconds = first.seconds
        results.append(res)
        post_text = "n/a" if res.sparsity_post_warmup is None else f"{res.sparsity_post_warmup:.3f}"
        subtitle = f"realized sparsity {res.sparsity:.3f} (post-warmup {post_text})"
        panels.append(Panel(res.text.strip(), title=spec, subtitle=subtitle, width=60))
    console.print(Panel(prompt, title="prompt"))
    console.print(Columns(panels))
    table = Table(title=f"{model.device.type}, {str(model.dtype).removeprefix('torch.')}: greedy, one prompt")
    table.add_column("method", overflow="fold")
    table.add_column("path")
    for name in ("tokens", "first call s", "s", "tok/s", "steady tok/s", "sparsity", "post-warmup"):
        table.add_column(name, justify="right")
    for res in results:
        post = "n/a" if res.sparsity_post_warmup is None else f"{res.sparsity_post_warmup:.3f}"
        steady = "n/a" if res.steady_tokens_per_s is None else f"{res.steady_tokens_per_s:.1f}"
        table.add_row(res.spec, res.path, str(res.new_tokens), f"{res.first_call_seconds:.2f}", f"{res.seconds:.2f}",
                      f"{res.tokens_per_s:.1f}", steady, f"{res.sparsity:.3f}", post)
    console.print(table)
    console.print("Each method ran twice; the first call builds and compiles its kernels. s and tok/s: the second "
                  "call's new tokens, prefill included; steady: its decode loop's median step in the last phase "
                  "(after Sift's warmup); sparsity: realized", highlight=False)
    for res in results:
        if res.fallback_reason:
            console.print(f"{res.spec}: transformers' generate ran ({res.fallback_reason})", highlight=False)
    return results


def _write_generations(path: Path, model_name: str, model, prompt: str, max_new_tokens: int, gen_path: str,
                       results: list[Generation], compile: bool = False) -> None:
    from .output import json_bytes, save_run
    from .parallel import is_main_rank
    from .report import versions

    if not is_main_rank():
        return
    payload = {"model": model_name, "device": model.device.type, "dtype": str(model.dtype).removeprefix("torch."),
               "prompt": prompt, "max_new_tokens": max_new_tokens, "path": gen_path, "compile": compile, "versions": versions(),
               "results": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results]}
    save_run(path.parent, {path.name: json_bytes(payload)})
    console.print(f"wrote {path}", highlight=False)


@cli.command(help="The main job on the embedded model: the perplexity comparison of the README's table (sift ppl "
             "with nine methods, 2 windows of 1024 tokens; about 5 min on 2 CPU cores), then Full vs Sift generation.",
             short_help="The README's perplexity table, then Full vs Sift generation.")
@click.option("--seq-len", default=1024, show_default=True, type=click.IntRange(min=2), help="tokens per window")
@click.option("--num-seqs", default=2, show_default=True, type=click.IntRange(min=1), help="number of windows")
@click.option("--max-new-tokens", default=96, show_default=True, type=click.IntRange(min=1))
@click.option("--out", type=OutDir(), default=Path("runs/demo"), show_default=True, help="directory for sift ppl's files")
def demo(seq_len: int, num_seqs: int, max_new_tokens: int, out: Path) -> None:
    from .data import load_corpus
    from .eval.perplexity import check_windows
    from .report import claim_out_dir

    load_corpus("wikitext2")  # shipped in the package: the README's table on any machine
    check_windows(parse_methods(tuple(DEMO_METHODS)), seq_len)  # before the model loads
    with claim_out_dir(out):
        model, tokenizer = _load("smollm2-135m")
        run_ppl("smollm2-135m", "wikitext2", None, seq_len, num_seqs, tuple(DEMO_METHODS), out, loaded=(model, tokenizer))
        _print_generations(model, tokenizer, PAPER_PROMPT, ("full", "sift:tau=0.875,warmup=16"), max_new_tokens)


@cli.command(name="models", help="List the embedded models (no hub needed) and whether each is installed.",
             short_help="The embedded models and whether each is installed.")
def list_models() -> None:
    from .models import EMBEDDED

    for name, entry in EMBEDDED.items():
        status = "installed" if entry.installed() else f"not installed: {entry.install}"
        console.print(f"{name:14s} {entry.description}; {status}", highlight=False, soft_wrap=True)


from .cli_analyze import analyze  # noqa: E402  (the command lives beside its analysis code)
from .cli_capture import capture  # noqa: E402
from .cli_eval import commands as eval_commands  # noqa: E402  (eval, sweep, lm-eval)

cli.add_command(analyze)
cli.add_command(capture)
for _command in eval_commands:
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """The ``sift`` entry point: a user error is one line on stderr and exit status 2; a warning is one line too."""
    run_command(cli, argv, "sift", err_console)

if __name__ == "__main__":
    main()
