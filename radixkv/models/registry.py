"""Map a Hugging Face config to the radixkv model class (by ``architectures`` or ``model_type``)."""

from __future__ import annotations

from radixkv.models.layers import CausalLM
from radixkv.models.llama import LlamaForCausalLM
from radixkv.models.mistral import MistralForCausalLM
from radixkv.models.qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}
_BY_MODEL_TYPE = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}


def get_model_class(hf_config) -> type[CausalLM]:
    """The model class for ``hf_config``.

    Raises:
        ValueError: the architecture is not one of ``MODEL_REGISTRY`` (names the supported ones).
    """
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(
        f"unsupported model: architectures={getattr(hf_config, 'architectures', None)}, "
        f"model_type={model_type!r}; supported: {sorted(MODEL_REGISTRY)}"
    )


def sliding_window_limit(hf_config) -> int | None:
    """The sliding-window size when the model uses one in any layer, else None."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if getattr(hf_config, "model_type", None) == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
        return None
    return int(window)
