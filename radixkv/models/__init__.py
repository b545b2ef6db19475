"""Llama-family models over a flattened token batch, and their loader.

``load_model(name_or_path="smollm2-135m", device="cpu", dtype=torch.float32) -> LoadedModel``;
``build_model(hf_config, seed=0, ...)`` for randomly initialized models (``init_random_weights``
fills an existing model in place, on its own device).
"""

from radixkv.models.layers import CausalLM
from radixkv.models.llama import LlamaForCausalLM
from radixkv.models.loader import LoadedModel, build_model, init_random_weights, load_model, resolve_hf_dir
from radixkv.models.mistral import MistralForCausalLM
from radixkv.models.qwen2 import Qwen2ForCausalLM
from radixkv.models.registry import MODEL_REGISTRY, get_model_class

__all__ = [
    "CausalLM",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "MODEL_REGISTRY",
    "get_model_class",
    "LoadedModel",
    "build_model",
    "init_random_weights",
    "load_model",
    "resolve_hf_dir",
]
