"""The identity of a model's weights, for keys of KV blocks that outlive a process (docs/tiers.md).

:func:`weights_digest` hashes every tensor of the model's ``state_dict`` (names, dtypes, shapes
and raw bytes, in name order) and the int8 layers' packed weights and scales (FBGEMM keeps them
outside the ``state_dict``): the same weights give the same 16 bytes in every process and on
every restart, and any change of a weight, of the weights' dtype or of their quantization (int8
weights are other tensors) gives other bytes. It reads what is loaded, not the files, so a model
built in memory (random test models, weights changed after loading) is named by what it computes
with. About 0.4 s for the default model's 538 MB of float32 weights on one core; computed once per
model object and process while its tensors are unchanged (a second engine over the same
``LoadedModel`` reuses it; weights changed in place since, other than through ``.data``, are
hashed again).

:func:`config_digest` names what else the model computes with: its buffers that are not in the
``state_dict`` (RoPE's ``inv_freq``, made from the config's ``rope_theta`` / ``rope_scaling``) and
its config (norm epsilon, RoPE type and scaling, activation, sliding window, ...), less the keys
that name where and how it was loaded. Two copies of one checkpoint whose config.json differ (a
``rope_scaling`` added for long contexts, as Qwen's docs ask) compute other K/V for the same
tokens, so their KV blocks must not share a name (docs/tiers.md, "Keys").
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from typing import Any

import torch

__all__ = ["config_digest", "weights_digest"]

_DIGESTS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    c = t.detach().contiguous()
    if c.device.type != "cpu":
        c = c.cpu()
    if c.numel() == 0:
        return memoryview(b"")
    return memoryview(c.reshape(-1).view(torch.uint8).numpy())


_NOT_COMPUTE = frozenset(
    {
        "name_or_path",
        "transformers_version",
        "dtype",  # NOTE: the compute dtype is the engine's, a part of the fingerprint already
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "architectures",
        "initializer_range",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
    }
)
"""Config keys that do not change what the model computes (paths, versions, generation ids,
training settings); keys starting with ``_`` are left out too (transformers' own bookkeeping)."""


def config_digest(model: Any) -> bytes:
    """16 bytes naming what ``model`` computes with besides its ``state_dict`` (module docstring):
    its other buffers and its ``config`` (``to_dict()``, a dict or nothing), less
    :data:`_NOT_COMPUTE`."""
    h = hashlib.blake2b(b"radixkv-model-config-1", digest_size=16)
    if isinstance(model, torch.nn.Module):
        state = set(model.state_dict())
        with torch.no_grad():
            for name, buf in sorted(model.named_buffers()):
                if name not in state:
                    h.update(f"{name}|{buf.dtype}|{tuple(buf.shape)}|".encode())
                    h.update(_tensor_bytes(buf))
    cfg = getattr(model, "config", None)
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else cfg if isinstance(cfg, dict) else {}
    kept = {k: v for k, v in d.items() if not k.startswith("_") and k not in _NOT_COMPUTE}
    h.update(json.dumps(kept, sort_keys=True, default=str).encode())
    return h.digest()


def weights_digest(model: torch.nn.Module) -> bytes:
    """16 bytes naming ``model``'s weights (module docstring): blake2b over each ``state_dict``
    entry's name, dtype, shape and bytes, in name order, then the same of each module's
    ``packed_tensors()`` (int8 layers: their packed weights and scales, not in the
    ``state_dict``). Memoized per model object while its tensors stay the same (:func:`_signature`):
    weights changed in place since (a training step, an adapter merged) are hashed again."""
    sig = _signature(model)
    with _LOCK:
        got = _DIGESTS.get(model)
    if got is not None and got[0] == sig:
        return got[1]
    h = hashlib.blake2b(b"radixkv-weights-1", digest_size=16)
    with torch.no_grad():
        state = model.state_dict()
        for name in sorted(state):
            t = state[name]
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(_tensor_bytes(t))
        for mod_name, mod in model.named_modules():  # int8 layers keep their weights packed
            packed = mod.packed_tensors() if hasattr(mod, "packed_tensors") else {}
            for key in sorted(packed):
                t = packed[key]
                h.update(f"{mod_name}.{key}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(_tensor_bytes(t))
    digest = h.digest()
    with _LOCK:
        _DIGESTS[model] = (sig, digest)
    return digest


def _signature(model: torch.nn.Module) -> tuple:
    """What :func:`weights_digest`'s memo is valid for: each parameter's and buffer's identity
    and version counter (torch bumps it at every in-place change: ``copy_``, ``mul_``,
    ``load_state_dict``; not through ``.data``) and each int8 layer's packed weights object."""
    tensors = [(id(t), t._version) for t in (*model.parameters(), *model.buffers())]
    packed = [id(getattr(m, "_packed", None)) for m in model.modules() if hasattr(m, "packed_tensors")]
    return tuple(tensors), tuple(packed)
