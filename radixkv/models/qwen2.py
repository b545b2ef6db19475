"""Qwen2 causal LM: Llama's decoder with a bias on the q/k/v projections."""

from __future__ import annotations

from radixkv.models.layers import CausalLM


class Qwen2ForCausalLM(CausalLM):
    """Qwen2: q/k/v projections carry a bias, o_proj does not."""

    qkv_bias = True
