"""FlashInfer paged attention (CUDA): the fast backend, checked against the torch reference.

One forward pass = one ``plan`` + one ``run`` per layer, over radixkv's own paged KV pool:

* **Prefill / extend** (any batch with a request bringing more than one new token; decode
  requests inside a mixed batch are extends of length 1): ``BatchPrefillWithPagedKVCacheWrapper``
  with ``causal=True``. The new tokens' K/V are written into their slots first (a plain index
  write, :meth:`radixkv.memory.kv_pool.KVPool.write`), so the paged KV of request ``i`` covers its cached
  prefix *and* its new tokens; FlashInfer's bottom-right aligned causal mask then gives exactly
  "new token ``j`` sees positions ``0 .. prefix_len + j``".
* **Decode** (every request brings exactly one token): ``BatchDecodeWithPagedKVCacheWrapper``.
  The CUDA-core decode kernel by default for GQA group sizes below 4 (our SmolLM2 shape has
  9/3 heads, group 3, which its compile-time dispatch includes), the tensor-core path
  (FlashInfer's prefill kernels, the same compiled module as prefill) from group 4 up, the
  heuristic SGLang uses.

Both wrappers share one zero-initialised float workspace allocated once per backend, and the
prefill wrapper is pinned to the FA2 kernels (``backend="fa2"``): on Hopper ``"auto"`` would pick
FA3, whose module costs ~4x more to build and is not what the carried AOT modules contain.

``plan`` hands FlashInfer host (CPU) copies of ``qo_indptr``, ``kv_indptr`` and
``kv_last_page_len`` (FlashInfer's plan reads them on the host; device tensors would force a
blocking copy) and the device ``kv_indices``. The exact arguments are built by
:func:`flashinfer_plan_inputs`, a pure-torch function the CPU tests check; this module imports
``flashinfer`` only inside :class:`FlashInferAttentionBackend`'s constructor.

API and semantics: FlashInfer documentation ("KV-Cache Layout", ``flashinfer.prefill`` and
``flashinfer.decode``), and ``shared/notes/flashinfer.md`` in this project's workspace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.attention.base import AttentionBackend
from radixkv.attention.metadata import ForwardBatch
from radixkv.memory.kv_pool import KVPool

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_KV_CACHE_DTYPES = ("bfloat16", "float16")
"""K/V dtypes of the pool this backend serves (``KVPool.kv_cache_dtype``); float32 and fp8 pools
are refused (no GPU run has covered them)."""
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
# FlashInfer's kernels need CUDA. Tests set this to False to run the backend's glue (plan routing,
# run arguments, KV writes) on CPU against a stand-in ``flashinfer`` module.
REQUIRE_CUDA = True


@dataclass
class FlashInferPlan:
    """Arguments of one FlashInfer ``plan`` call (what :func:`flashinfer_plan_inputs` returns).

    Attributes:
        kind: ``"decode"`` (``BatchDecodeWithPagedKVCacheWrapper``) or ``"prefill"``
            (``BatchPrefillWithPagedKVCacheWrapper``).
        qo_indptr: ``[B+1]`` int32 on CPU: rows of each request's new tokens (prefill only;
            for decode it is ``arange(B+1)`` and is not passed).
        kv_indptr: ``[B+1]`` int32 on CPU, in pages.
        kv_indices: ``[nnz_pages]`` int32 page ids, on the KV pool's device.
        kv_last_page_len: ``[B]`` int32 on CPU, in ``1..page_size``.
        kwargs: the remaining keyword arguments (head counts, ``head_dim``, ``page_size``,
            ``causal``, ``sm_scale``, ``q_data_type``, ``kv_data_type``, ...).
    """

    kind: str
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kwargs: dict[str, Any] = field(default_factory=dict)


def flashinfer_plan_inputs(
    batch: ForwardBatch,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sm_scale: float,
) -> FlashInferPlan:
    """Build the FlashInfer ``plan`` arguments for ``batch`` (no flashinfer import, runs on CPU).

    Args:
        batch: the forward batch (its page table must already include the new tokens' slots).
        num_q_heads, num_kv_heads, head_dim: attention shape of every layer.
        dtype: query and KV dtype (``torch.bfloat16`` or ``torch.float16``).
        sm_scale: softmax scale.

    Returns:
        A :class:`FlashInferPlan`; ``kind == "decode"`` exactly when ``batch.is_decode``.

    Raises:
        ValueError: ``dtype`` is not bf16/fp16, or the batch's host and device indptrs disagree
            in length.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"FlashInfer backend: dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    bs = batch.batch_size
    if batch.qo_indptr_cpu.numel() != bs + 1 or batch.kv_indptr_cpu.numel() != bs + 1:
        raise ValueError(
            f"FlashInfer backend: qo_indptr_cpu/kv_indptr_cpu must have batch_size + 1 = {bs + 1} entries, "
            f"got {batch.qo_indptr_cpu.numel()} and {batch.kv_indptr_cpu.numel()}"
        )
    i32 = torch.int32
    qo = batch.qo_indptr_cpu.to(device="cpu", dtype=i32)
    kv = batch.kv_indptr_cpu.to(device="cpu", dtype=i32)
    last = batch.kv_last_page_len_cpu.to(device="cpu", dtype=i32)
    indices = batch.kv_indices.to(i32)
    common = dict(
        num_qo_heads=int(num_q_heads),
        num_kv_heads=int(num_kv_heads),
        page_size=int(batch.page_size),
        sm_scale=float(sm_scale),
        q_data_type=dtype,
        kv_data_type=dtype,
        pos_encoding_mode="NONE",
    )
    if batch.is_decode:
        return FlashInferPlan("decode", qo, kv, indices, last, dict(common, head_dim=int(head_dim)))
    return FlashInferPlan("prefill", qo, kv, indices, last, dict(common, head_dim_qk=int(head_dim), causal=True))


def check_kv_cache_dtype(kv_pool: KVPool) -> None:
    """Refuse a pool whose K/V dtype the FlashInfer backend does not serve (no flashinfer import).

    Raises:
        ValueError: naming the backend and ``kv_cache_dtype``, listing :data:`SUPPORTED_KV_CACHE_DTYPES`.
    """
    if kv_pool.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(
            f"attention backend 'flashinfer': kv_cache_dtype must be one of {list(SUPPORTED_KV_CACHE_DTYPES)}, "
            f"got {kv_pool.kv_cache_dtype!r} (use attention_backend='torch' for it)"
        )


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through FlashInfer's FA2 prefill and decode kernels (CUDA, bf16/fp16).

    Args:
        kv_pool: the KV pool (on a CUDA device, dtype bfloat16 or float16).
        num_q_heads: query heads per layer (a multiple of the pool's KV heads).
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        workspace_bytes: size of the float workspace shared by both wrappers (default 128 MiB).
        use_tensor_cores: decode through the tensor-core (prefill) kernels; default
            ``group_size >= 4``.
        prefill_backend: FlashInfer kernel family for both wrappers, default ``"fa2"`` (an explicit
            choice also keeps decode's ``"auto"`` rule from routing to cuDNN).

    Raises:
        ValueError: the pool is not on CUDA, its K/V dtype is not bfloat16/float16
            (:func:`check_kv_cache_dtype`), ``workspace_bytes < 1``.
        ImportError: ``flashinfer`` is not installed (``pip install flashinfer-python``).
    """

    name = "flashinfer"

    def __init__(
        self,
        kv_pool: KVPool,
        num_q_heads: int,
        sm_scale: float | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        use_tensor_cores: bool | None = None,
        prefill_backend: str = "fa2",
    ) -> None:
        super().__init__(kv_pool, num_q_heads, sm_scale)
        if REQUIRE_CUDA and kv_pool.device.type != "cuda":
            raise ValueError(f"FlashInferAttentionBackend: kv_pool must be on a CUDA device, got {kv_pool.device}")
        check_kv_cache_dtype(kv_pool)
        if int(workspace_bytes) < 1:
            raise ValueError(f"FlashInferAttentionBackend: workspace_bytes must be >= 1, got {workspace_bytes}")
        import flashinfer  # lazy: CPU installs never import it

        self.flashinfer_version = getattr(flashinfer, "__version__", "unknown")
        self.dtype = kv_pool.dtype
        self.use_tensor_cores = self.group_size >= 4 if use_tensor_cores is None else bool(use_tensor_cores)
        self.workspace = torch.zeros(int(workspace_bytes), dtype=torch.uint8, device=kv_pool.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend=prefill_backend
        )
        self._batch: ForwardBatch | None = None
        self._wrapper: Any = None
        self.last_plan: FlashInferPlan | None = None

    def plan(self, batch: ForwardBatch) -> None:
        """Plan the prefill or decode wrapper for ``batch`` (host work, once per forward).

        Raises:
            ValueError: ``batch.page_size`` differs from the pool's.
        """
        if batch.page_size != self.page_size:
            raise ValueError(
                f"FlashInferAttentionBackend.plan: batch.page_size {batch.page_size} != kv_pool.page_size {self.page_size}"
            )
        p = flashinfer_plan_inputs(batch, self.num_q_heads, self.num_kv_heads, self.head_dim, self.dtype, self.sm_scale)
        if p.kind == "decode":
            kw = dict(p.kwargs)
            self._decode.plan(
                p.kv_indptr,
                p.kv_indices,
                p.kv_last_page_len,
                kw.pop("num_qo_heads"),
                kw.pop("num_kv_heads"),
                kw.pop("head_dim"),
                kw.pop("page_size"),
                **kw,
            )
            self._wrapper = self._decode
        else:
            self._prefill.plan(p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len, **p.kwargs)
            self._wrapper = self._prefill
        self._batch = batch
        self.last_plan = p

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write ``k``/``v`` into the pool at ``batch.out_slots``, then run the planned kernel.

        Shapes as in :meth:`AttentionBackend.forward`; ``q`` is cast to the pool dtype for the
        kernel and the output is returned in ``q``'s dtype.

        Raises:
            RuntimeError: called before :meth:`plan`.
        """
        if self._batch is None:
            raise RuntimeError("FlashInferAttentionBackend.forward called before plan()")
        self.kv_pool.write(layer_id, self._batch.out_slots, k, v)
        qk = q.to(self.dtype).contiguous()
        cache = (self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id])
        out = self._wrapper.run(qk, cache)
        return out if out.dtype == q.dtype else out.to(q.dtype)
