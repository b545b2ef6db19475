"""Mistral causal LM: Llama's decoder; the sliding window is handled by capping the context.

Attention here is full causal attention, which equals Mistral's sliding-window attention as long
as no sequence is longer than ``config.sliding_window``;
:class:`~radixkv.executor.model_runner.ModelRunner` rejects a ``max_context_len`` above the window.
"""

from __future__ import annotations

from radixkv.models.layers import CausalLM


class MistralForCausalLM(CausalLM):
    """Mistral: no biases, GQA, optional sliding window (see the module docstring)."""

    qkv_bias = False
