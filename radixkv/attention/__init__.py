"""Attention backends over the paged KV pool.

``create_attention_backend(name, device, kv_pool, num_q_heads, sm_scale=None, **kwargs)``:

* ``"torch"``: :class:`~radixkv.attention.torch_backend.TorchAttentionBackend` (CPU or CUDA),
  the reference.
* ``"cpu"``: :class:`~radixkv.attention.cpu_backend.CPUAttentionBackend`, the reference with a
  native kernel for decode rows (float32 pool on an AVX2/FMA/F16C CPU).
* ``"flashinfer"``: ``radixkv.attention.flashinfer_backend.FlashInferAttentionBackend``
  (CUDA only; the module is imported only here, so CPU installs never import flashinfer).
* ``"auto"``: FlashInfer on a CUDA device when its backend imports and constructs (a bfloat16 or
  float16 pool); on the CPU, ``"cpu"`` when the pool's K/V dtype is one of
  :data:`CPU_AUTO_KV_DTYPES` and the pool and CPU support it; else torch.
  The choice (and the reason for a fallback) is logged at INFO level.
"""

from __future__ import annotations

import logging
from typing import Any, Union

import torch

from radixkv.attention.base import AttentionBackend
from radixkv.attention.cpu_backend import CPUAttentionBackend, native_unsupported_reason
from radixkv.attention.metadata import ForwardBatch
from radixkv.attention.torch_backend import TorchAttentionBackend
from radixkv.memory.kv_pool import KVPool

__all__ = [
    "AttentionBackend",
    "CPUAttentionBackend",
    "ForwardBatch",
    "TorchAttentionBackend",
    "create_attention_backend",
    "BACKEND_NAMES",
    "CPU_AUTO_KV_DTYPES",
]

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu", "flashinfer")

CPU_AUTO_KV_DTYPES = frozenset({"float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"})
"""K/V dtypes (``KVPool.kv_cache_dtype``) for which ``"auto"`` picks the native ``cpu`` backend on
the CPU (every K/V dtype: the native kernels read and write all five); a dtype outside it gets the
torch backend (``"cpu"`` named explicitly is the backend's own check either way)."""


def _flashinfer(kv_pool: KVPool, num_q_heads: int, sm_scale: float | None, **kwargs: Any) -> AttentionBackend:
    from radixkv.attention.flashinfer_backend import FlashInferAttentionBackend  # lazy: pulls in flashinfer

    return FlashInferAttentionBackend(kv_pool, num_q_heads, sm_scale, **kwargs)


def create_attention_backend(
    name: str,
    device: Union[str, torch.device],
    kv_pool: KVPool,
    num_q_heads: int,
    sm_scale: float | None = None,
    **kwargs: Any,
) -> AttentionBackend:
    """Build the attention backend called ``name`` for ``kv_pool``.

    Args:
        name: ``"auto"``, ``"torch"``, ``"cpu"`` or ``"flashinfer"``.
        device: the model's device (FlashInfer needs CUDA).
        kv_pool: the KV pool the backend writes and reads.
        num_q_heads: query heads per layer.
        sm_scale: softmax scale (default ``1/sqrt(head_dim)``).
        **kwargs: passed to the FlashInfer backend only (e.g. workspace size).

    Raises:
        ValueError: unknown ``name``, ``"flashinfer"`` on a non-CUDA device, or ``"cpu"`` for a
            pool it cannot serve.
        ImportError / RuntimeError: ``"flashinfer"`` requested explicitly but unusable.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "torch":
        return TorchAttentionBackend(kv_pool, num_q_heads, sm_scale)
    if name == "cpu":
        return CPUAttentionBackend(kv_pool, num_q_heads, sm_scale)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention_backend 'flashinfer' needs a CUDA device, got {device}")
        return _flashinfer(kv_pool, num_q_heads, sm_scale, **kwargs)
    # auto
    if device.type == "cuda":
        try:
            backend = _flashinfer(kv_pool, num_q_heads, sm_scale, **kwargs)
            logger.info("attention backend: flashinfer (auto, device %s)", device)
            return backend
        except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
            logger.info("attention backend: torch (auto; flashinfer unavailable: %s: %s)", type(exc).__name__, exc)
    else:
        reason = native_unsupported_reason(kv_pool)
        if reason is None and kv_pool.kv_cache_dtype not in CPU_AUTO_KV_DTYPES:
            reason = f"auto picks it for K/V dtypes {sorted(CPU_AUTO_KV_DTYPES)}, not {kv_pool.kv_cache_dtype}"
        if reason is None:
            logger.info("attention backend: cpu (auto, device %s)", device)
            return CPUAttentionBackend(kv_pool, num_q_heads, sm_scale)
        logger.info("attention backend: torch (auto, device %s; native cpu kernel unusable: %s)", device, reason)
    return TorchAttentionBackend(kv_pool, num_q_heads, sm_scale)
