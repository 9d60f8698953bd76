"""``sift capture``: save a real model's attention inputs on real text, for kernel benchmarks and tests."""

from __future__ import annotations

import time
from pathlib import Path

import click


def _int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@click.command(name="capture", help="Save post-RoPE queries and the key/value caches of a model run on real text "
               "(siftattention.capture): one torch file that bench_decode.py --captured replays.",
               short_help="Save a model's real attention for kernel benchmarks.")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True, help="embedded name, local directory or hub id")
@click.option("--dataset", default="wikitext2", show_default=True, help="wikitext2, c4 or wiki")
@click.option("--data-file", type=click.Path(dir_okay=False), default=None, help="read this text file whole instead")
@click.option("--seq-len", default=8192, show_default=True, type=click.IntRange(min=1), help="prompt tokens (one window)")
@click.option("--layers", default=None, help="comma-separated layer indices [default: all]")
@click.option("--positions", default=None, help="comma-separated query positions kept [default: the last]")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="bfloat16", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="the torch file to write")
def capture(model_name: str, dataset: str, data_file: str | None, seq_len: int, layers: str | None, positions: str | None,
            device: str, dtype: str, out: Path) -> None:
    import torch

    from .capture import capture_attention
    from .cli_common import resolve_device
    from .data import load_corpus, token_windows
    from .models import load_model

    layer_ids, rows = _int_list(layers), _int_list(positions)
    device = resolve_device(device)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give the file to write")
    corpus = load_corpus(dataset, data_file)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {out} cannot be created: {err.strerror}") from None
    start = time.perf_counter()
    model, tokenizer = load_model(model_name, dtype=getattr(torch, dtype), device=device)
    ids = token_windows(corpus.text, tokenizer, seq_len, 1).to(device)
    captured = capture_attention(model, ids, layers=layer_ids, positions=rows, source=f"{corpus.source}, first {seq_len} tokens")
    captured.model = model_name
    captured.save(out)
    click.echo(f"captured {len(captured.layers)} layers x {len(captured.positions)} positions of {model_name} on "
               f"{seq_len} tokens of {dataset} into {out} ({out.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - start:.0f} s)")
