"""The constructor keywords :class:`~radixkv.llm.LLM` and :class:`~radixkv.async_llm.AsyncLLM`
share: ``LLM(model, **kwargs)`` / ``AsyncLLM(model, **kwargs)`` become one
:class:`~radixkv.config.EngineConfig` (every field of it a keyword) and the
:class:`~radixkv.engine.Engine` keywords (``model_runner``, ``tokenizer``, ``eos_token_ids``,
``loaded_model``, ``clock``: read from ``Engine``'s signature, so both front ends take exactly
what the engine takes)."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Dict, List, Mapping, Tuple

from radixkv.config import EngineConfig

__all__ = ["engine_keywords", "split_engine_kwargs", "build_engine"]


def engine_keywords() -> List[str]:
    """The keyword-only arguments of ``Engine.__init__`` besides its config (sorted names)."""
    from radixkv.engine import Engine  # lazy: the engine imports the sampling stack (torch)

    params = inspect.signature(Engine.__init__).parameters.values()
    return sorted(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


VLLM_NAMES = {
    "max_model_len": "max_context_len",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "chunked_prefill_size",
    "block_size": "page_size",
    "gpu_memory_utilization": "kv_cache_memory_bytes",
    "speculative_model": "speculative_config",
}
"""vLLM's ``LLM`` keywords whose radixkv counterpart has another name (the error names it; the
units may differ: ``kv_cache_memory_bytes`` is bytes of K/V, not a fraction of the GPU)."""


def _hints(unknown: List[str], valid: List[str]) -> str:
    """`` (did you mean: max_context_len for max_model_len, ...)``: vLLM's names and near spellings."""
    said = []
    for name in unknown:
        near = VLLM_NAMES.get(name) or next(iter(difflib.get_close_matches(name, valid, n=1, cutoff=0.8)), None)
        if near is not None:
            said.append(f"{near} for {name}")
    return f" (did you mean: {', '.join(said)})" if said else ""


def split_engine_kwargs(owner: str, model: str, kwargs: Mapping[str, Any]) -> Tuple[EngineConfig, Dict[str, Any]]:
    """``(EngineConfig(model=model, **config fields), {engine keyword: value})`` from the keywords
    given to ``owner`` (``"LLM"`` or ``"AsyncLLM"``, named in errors); ``kwargs`` is not changed.

    Raises:
        ValueError: a keyword that is neither an ``EngineConfig`` field nor an ``Engine`` keyword
            (the message names each one and lists the valid ones), or an invalid field value
            (``EngineConfig`` names the field).
    """
    engine_names = set(engine_keywords())
    fields = set(EngineConfig.__dataclass_fields__) - {"model"}
    unknown = sorted(set(kwargs) - fields - engine_names)
    if unknown:
        valid = sorted(fields | engine_names | {"model"})
        raise ValueError(f"{owner}: unknown argument(s) {unknown}{_hints(unknown, valid)}; valid: {valid}")
    config = EngineConfig(model=model, **{k: v for k, v in kwargs.items() if k in fields})
    return config, {k: v for k, v in kwargs.items() if k in engine_names}


def build_engine(owner: str, model: str, kwargs: Mapping[str, Any]) -> Any:
    """The :class:`~radixkv.engine.Engine` of ``owner(model, **kwargs)`` (:func:`split_engine_kwargs`).

    Raises:
        ValueError: as :func:`split_engine_kwargs`, or the engine refuses a value.
    """
    from radixkv.engine import Engine

    config, engine_kwargs = split_engine_kwargs(owner, model, kwargs)
    return Engine(config, **engine_kwargs)
