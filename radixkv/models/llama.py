"""Llama 2/3 (and SmolLM2) causal LM: the shared decoder of :mod:`radixkv.models.layers`."""

from __future__ import annotations

from radixkv.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    """Llama: no q/k/v bias unless ``config.attention_bias``; RoPE variants incl. ``llama3``."""

    qkv_bias = False
