"""The attention-backend interface the models call.

Life cycle of one forward pass (``radixkv.executor.model_runner.ModelRunner.forward``)::

    backend.plan(batch)                       # once: host-side scheduling from the metadata
    for layer_id in range(num_layers):
        out = backend.forward(layer_id, q, k, v)   # writes k/v into the pool, then attends

Semantics every backend must implement (those of FlashInfer's paged prefill with
``causal=True``, ``pos_encoding_mode="NONE"``, NHD layout; see
:mod:`radixkv.attention.metadata` for the page-table format):

1. ``k`` and ``v`` of the ``T`` new tokens are stored into ``kv_pool`` layer ``layer_id`` at
   ``batch.out_slots`` (keys arrive already rotated by RoPE).
2. New token ``j`` of request ``i`` (row ``qo_indptr[i] + j``) attends to the request's KV
   positions ``0 .. prefix_len_i + j`` (bottom-right causal alignment), read through
   ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``.
3. GQA: query head ``h`` uses KV head ``h // (num_q_heads // num_kv_heads)``.
4. Softmax scale ``sm_scale`` (default ``1 / sqrt(head_dim)``), computed in float32 or better
   accumulation; output has the dtype of ``q``.
"""

from __future__ import annotations

import abc
import math

import torch

from radixkv.attention.metadata import ForwardBatch
from radixkv.memory.kv_pool import KVPool


class AttentionBackend(abc.ABC):
    """Paged attention over a :class:`~radixkv.memory.kv_pool.KVPool`.

    Args:
        kv_pool: the pool holding every layer's K/V; gives ``num_kv_heads``, ``head_dim``,
            ``page_size``, ``dtype`` and ``device``.
        num_q_heads: query heads per layer; a positive multiple of ``kv_pool.num_kv_heads``.
        sm_scale: softmax scale; default ``1 / sqrt(head_dim)``.

    Raises:
        ValueError: ``num_q_heads`` is not a positive multiple of ``num_kv_heads``.
    """

    name: str = "base"

    def __init__(self, kv_pool: KVPool, num_q_heads: int, sm_scale: float | None = None) -> None:
        if num_q_heads < 1 or num_q_heads % kv_pool.num_kv_heads != 0:
            raise ValueError(
                f"{type(self).__name__}: num_q_heads ({num_q_heads}) must be a positive multiple of "
                f"num_kv_heads ({kv_pool.num_kv_heads})"
            )
        self.kv_pool = kv_pool
        self.num_q_heads = int(num_q_heads)
        self.num_kv_heads = kv_pool.num_kv_heads
        self.head_dim = kv_pool.head_dim
        self.page_size = kv_pool.page_size
        self.group_size = self.num_q_heads // self.num_kv_heads
        self.sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.device = kv_pool.device

    @abc.abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare for the layers of one forward pass over ``batch``.

        Called exactly once per forward, before the first :meth:`forward`; the plan stays valid
        until the next call. Must not change the KV pool.
        """

    @abc.abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the new tokens' K/V of one layer into the pool, then attend.

        Args:
            layer_id: layer index in ``[0, kv_pool.num_layers)``.
            q: ``[T, num_q_heads, head_dim]`` queries of the new tokens (RoPE applied).
            k: ``[T, num_kv_heads, head_dim]`` keys of the new tokens (RoPE applied).
            v: ``[T, num_kv_heads, head_dim]`` values of the new tokens.

        Returns:
            ``[T, num_q_heads, head_dim]`` attention output, dtype of ``q``.
        """
