"""radixkv: a prefix-caching LLM runtime built around a token-level radix tree over a paged KV cache.

Public API (vLLM-shaped): ``from radixkv import LLM, SamplingParams``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "Namespace",
]


def __getattr__(name: str):
    # Lazy imports keep `import radixkv.cache` free of the model stack.
    if name == "LLM":
        from radixkv.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from radixkv.async_llm import AsyncLLM

        return AsyncLLM
    if name == "SamplingParams":
        from radixkv.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from radixkv.config import EngineConfig

        return EngineConfig
    if name == "Namespace":
        from radixkv.namespace import Namespace

        return Namespace
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from radixkv import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
