"""The constructor keywords :class:`~radixkv.llm.LLM` and :class:`~radixkv.async_llm.AsyncLLM`
share: ``LLM(model, **kwargs)`` / ``AsyncLLM(model, **kwargs)`` become one
:class:`~radixkv.config.EngineConfig` (every field of it a keyword) and the
:class:`~radixkv.engine.Engine` keywords (``model_runner``, ``tokenizer``, ``eos_token_ids``,
``loaded_model``, ``clock``: read from ``Engine``'s signature, so both front ends take exactly
what the engine takes)."""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Tuple

from radixkv.config import EngineConfig

__all__ = ["engine_keywords", "split_engine_kwargs", "build_engine"]


def engine_keywords() -> List[str]:
    """The keyword-only arguments of ``Engine.__init__`` besides its config (sorted names)."""
    from radixkv.engine import Engine  # lazy: the engine imports the sampling stack (torch)

    params = inspect.signature(Engine.__init__).parameters.values()
    return sorted(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


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
        raise ValueError(f"{owner}: unknown argument(s) {unknown}; valid: {sorted(fields | engine_names | {'model'})}")
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
