"""Native CPU paged attention: decode and short extends in C, the rest through the torch reference.

:class:`CPUAttentionBackend` sends every request with at most ``native_max_q`` new tokens (decode
steps, short extends) to :func:`radixkv.kernels.cpu.paged_attention`, which reads K/V straight
from the pool through ``kv_indptr`` / ``kv_indices`` (no gathered copy of the context), one query
row (all its heads) per work unit, on ``torch.get_num_threads()`` threads. Requests with more new
tokens (prefills) go through :class:`~radixkv.attention.torch_backend.TorchAttentionBackend`'s
padded SDPA groups, where SDPA's blocked kernel wins. Same semantics as the reference
(FlashInfer's paged prefill, causal, bottom-right aligned); tests/test_attention_torch.py checks
both against the same float64 reference.

The pool may hold K/V in any dtype of :data:`radixkv.kernels.cpu.KV_DTYPES` (float32, bfloat16,
float16, fp8 e4m3 / e5m2 with the pool's per token-and-head bfloat16 scales): the kernel reads
them widened to float32 (docs/model.md). New K/V are written by the pool's own ``write`` before
the kernel reads them back, so every backend sees the same rounded values; for an fp8 pool whose
``write`` takes a ``quantizer``, the rounding is the native :func:`radixkv.kernels.cpu.kv_quantize`
(the same bits as the pool's torch reference, 4-6x less CPU time: tests/test_kv_dtypes.py,
docs/model.md; bfloat16 / float16 keep torch's cast, as fast).

Needs the ``radixkv.kernels._ckernels`` extension on an AVX2/FMA/F16C CPU, a pool on the CPU in one
of those dtypes and a head_dim that is a multiple of 8; ``create_attention_backend("auto", "cpu",
...)`` picks it when all hold.
"""

from __future__ import annotations

import inspect

import torch

from radixkv.attention.metadata import ForwardBatch
from radixkv.attention.torch_backend import TorchAttentionBackend
from radixkv.kernels import cpu
from radixkv.memory.kv_pool import KVPool


def native_unsupported_reason(kv_pool: KVPool) -> str | None:
    """Why :class:`CPUAttentionBackend` cannot serve ``kv_pool`` (``None``: it can)."""
    if not cpu.AVAILABLE:
        return "radixkv.kernels._ckernels is not built or the CPU lacks AVX2/FMA/F16C"
    if kv_pool.device.type != "cpu":
        return f"the KV pool is on {kv_pool.device}, not the CPU"
    dtype = kv_pool.k_buffer[0].dtype
    if dtype not in cpu.KV_DTYPES.values():
        return f"the KV pool is {dtype}, not one of {[str(d) for d in cpu.KV_DTYPES.values()]}"
    if cpu.kv_dtype_name(dtype) in cpu.FP8_MAX and getattr(kv_pool, "k_scale", None) is None:
        return f"the {dtype} KV pool has no scales"
    if kv_pool.head_dim % 8:
        return f"head_dim {kv_pool.head_dim} is not a multiple of 8"
    return None


def _native_quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool's write rounding of K or V rows ``[T, Hkv, D]`` by the native kernel
    (:func:`radixkv.kernels.cpu.kv_quantize`; rows in another float dtype are widened first,
    exactly, as the torch reference does)."""
    return cpu.kv_quantize(x.to(torch.float32), kv_cache_dtype)


class CPUAttentionBackend(TorchAttentionBackend):
    """Paged attention with a native kernel for decode rows (module docstring).

    Args:
        kv_pool, num_q_heads, sm_scale, max_pad_waste: as in
            :class:`~radixkv.attention.torch_backend.TorchAttentionBackend`.
        native_max_q: requests with at most this many new tokens use the native kernel.

    Raises:
        ValueError: the pool or the CPU does not support the native kernel
            (:func:`native_unsupported_reason`).
    """

    name = "cpu"

    def __init__(
        self,
        kv_pool: KVPool,
        num_q_heads: int,
        sm_scale: float | None = None,
        max_pad_waste: float = 2.0,
        native_max_q: int = 16,
    ) -> None:
        reason = native_unsupported_reason(kv_pool)
        if reason is not None:
            raise ValueError(f"CPUAttentionBackend: {reason}")
        super().__init__(kv_pool, num_q_heads, sm_scale, max_pad_waste)
        self.native_max_q = int(native_max_q)
        fp8 = cpu.kv_dtype_name(kv_pool.k_buffer[0].dtype) in cpu.FP8_MAX
        native_write = fp8 and "quantizer" in inspect.signature(kv_pool.write).parameters
        self._quantizer = {"quantizer": _native_quantize} if native_write else {}
        self._meta = torch.zeros(4, 0, dtype=torch.int32)
        self._kv_indices = torch.zeros(0, dtype=torch.int32)
        self._out_slots = torch.zeros(0, dtype=torch.int64)

    def plan(self, batch: ForwardBatch) -> None:
        if batch.page_size != self.page_size:
            raise ValueError(
                f"CPUAttentionBackend.plan: batch.page_size {batch.page_size} != kv_pool.page_size {self.page_size}"
            )
        self._batch = batch
        extend = batch.extend_lens_cpu.to(torch.int64)
        native = extend <= self.native_max_q
        # per native request: first query row, query count, first page in kv_indices, KV length
        self._meta = (
            torch.stack(
                [
                    batch.qo_indptr_cpu[:-1][native],
                    extend[native],
                    batch.kv_indptr_cpu[:-1][native],
                    batch.seq_lens_cpu[native],
                ]
            )
            .to(torch.int32)
            .contiguous()
        )
        self._kv_indices = batch.kv_indices.to(torch.int32).contiguous()
        self._out_slots = batch.out_slots.to(torch.int64).contiguous()
        self._groups = self._plan_groups(batch, (~native).nonzero().flatten().tolist())

    def _scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
        """Layer ``layer_id``'s K and V scales per slot (``[num_slots, Hkv]`` bfloat16 views) of an
        fp8 pool; nothing for the other dtypes."""
        pool = self.kv_pool
        k_scale = getattr(pool, "k_scale", None)
        if k_scale is None:
            return ()
        shape = (pool.num_slots, pool.num_kv_heads)
        return k_scale[layer_id].view(shape), pool.v_scale[layer_id].view(shape)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._batch is None:
            raise RuntimeError("CPUAttentionBackend.forward called before plan()")
        self.kv_pool.write(layer_id, self._batch.out_slots, k, v, **self._quantizer)
        if self._meta.shape[1] == 0:  # nothing native (e.g. one long prefill): the reference's attention
            in_order = len(self._groups) == 1 and self._groups[0].q_valid is None
            return self._attend_groups(layer_id, q, None if in_order else torch.empty_like(q))
        dtype = q.dtype  # NOTE: the kernel attends in float32; the output is the queries' dtype
        q = q.to(torch.float32).contiguous()
        out = torch.empty_like(q)
        cpu.paged_attention(
            q,
            out,
            self._meta,
            self._kv_indices,
            self.page_size,
            self.kv_pool.k_slots(layer_id),
            self.kv_pool.v_slots(layer_id),
            self.sm_scale,
            *self._scales(layer_id),
        )
        if self._groups:
            self._attend_groups(layer_id, q, out)
        return out if dtype == torch.float32 else out.to(dtype)
