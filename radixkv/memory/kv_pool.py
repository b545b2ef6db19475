"""KV memory: the per-layer paged K/V tensors and the request-to-token block table.

Layout follows FlashInfer's paged KV cache in ``NHD`` order: per layer one K and one V tensor
shaped ``[num_pages, page_size, num_kv_heads, head_dim]``, in the pool's K/V dtype (float32,
bfloat16, float16, fp8 e4m3 / e5m2 with per-token-and-head scales: :mod:`radixkv.memory.kv_dtype`). KV *slot* ``s`` (the unit the
:class:`~radixkv.memory.allocator.SlotAllocator` hands out) lives at page ``s // page_size``,
offset ``s % page_size``; a page is therefore ``page_size`` consecutive slots.

:class:`ReqToTokenPool` is the block table (SGLang's ``req_to_token``): one int32 row per running
request mapping the request's logical token position to the slot that holds its K/V.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from radixkv.memory.kv_dtype import (
    SCALE_DTYPE,
    canonical_kv_dtype,
    dequantize,
    has_scales,
    kv_token_bytes,
    kv_torch_dtype,
    quantize,
)

Device = Union[str, torch.device]


class KVPool:
    """Per-layer K and V buffers in FlashInfer's NHD paged layout, stored in one of the K/V dtypes
    of :mod:`radixkv.memory.kv_dtype` (fp8 with a bfloat16 scale per token and KV head).

    Args:
        num_layers: number of transformer layers (> 0).
        num_kv_heads: key/value heads per layer (> 0; fewer than query heads under GQA).
        head_dim: size of one head (> 0).
        num_slots: token capacity; must be a positive multiple of ``page_size``.
        page_size: tokens per page (>= 1).
        dtype: the K/V dtype: a torch dtype (float32, bfloat16, float16, float8_e4m3fn,
            float8_e5m2) or a name :func:`~radixkv.memory.kv_dtype.canonical_kv_dtype` accepts
            (``"bf16"``, ``"fp8"``, ...; not ``"auto"``). Default float32.
        device: where the buffers live.
        kv_cache_dtype: the same as ``dtype`` under ``EngineConfig``'s name (either may be
            given; both only when they agree).

    Attributes:
        k_buffer, v_buffer: lists (one per layer) of tensors
            ``[num_pages, page_size, num_kv_heads, head_dim]`` of the storage dtype ``dtype``. K
            and V of one layer have identical shape and strides (FlashInfer then needs a single
            kernel variant). Zero-initialized.
        k_scale, v_scale: fp8 only, lists (one per layer) of bfloat16 tensors
            ``[num_pages, page_size, num_kv_heads]`` (the scale of each token's K / V row of each
            head; initialized to 1); None for the other dtypes.
        dtype: the storage torch dtype; kv_cache_dtype: its canonical name (``"fp8_e4m3"``, ...).
        num_pages: ``num_slots // page_size``.
        bytes_per_token: K+V bytes one token occupies across all layers, scales included
            (:meth:`token_bytes`); the one source of the K/V size.

    Raises:
        ValueError: a size is not positive, ``num_slots`` is not a multiple of ``page_size``, or
            an unknown dtype (naming ``kv_cache_dtype``).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        page_size: int = 1,
        dtype: Union[str, torch.dtype, None] = None,
        device: Device = "cpu",
        kv_cache_dtype: Union[str, torch.dtype, None] = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_slots", num_slots),
            ("page_size", page_size),
        ):
            if int(value) < 1:
                raise ValueError(f"KVPool: {name} must be >= 1, got {value}")
        if num_slots % page_size != 0:
            raise ValueError(f"KVPool: num_slots ({num_slots}) must be a multiple of page_size ({page_size})")
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.num_slots = int(num_slots)
        self.page_size = int(page_size)
        self.num_pages = self.num_slots // self.page_size
        self.kv_cache_dtype = self._dtype_name(dtype, kv_cache_dtype)
        self.dtype = kv_torch_dtype(self.kv_cache_dtype)
        self.device = torch.device(device)
        shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor] | None = None
        self.v_scale: list[torch.Tensor] | None = None
        if has_scales(self.kv_cache_dtype):
            # 1, not 0: a slot never written reads back as 0 * 1 (finite), as in the other dtypes
            self.k_scale = [torch.ones(shape[:3], dtype=SCALE_DTYPE, device=self.device) for _ in range(num_layers)]
            self.v_scale = [torch.ones(shape[:3], dtype=SCALE_DTYPE, device=self.device) for _ in range(num_layers)]
        self.bytes_per_token = self.token_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_cache_dtype)

    @staticmethod
    def _dtype_name(dtype: Union[str, torch.dtype, None], kv_cache_dtype: Union[str, torch.dtype, None]) -> str:
        """The canonical K/V dtype of the two spellings (float32 when neither is given).

        Raises:
            ValueError: an unknown dtype, or two that disagree (naming ``kv_cache_dtype``).
        """
        names = {canonical_kv_dtype(d) for d in (dtype, kv_cache_dtype) if d is not None}
        if len(names) > 1:
            raise ValueError(f"KVPool: dtype {dtype!r} and kv_cache_dtype {kv_cache_dtype!r} disagree; give one")
        return names.pop() if names else "float32"

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: Union[str, torch.dtype]) -> int:
        """K+V bytes of one token (scales included): ``2 * num_layers * num_kv_heads * head_dim *
        element size``, plus ``2 * num_layers * num_kv_heads * 2`` for fp8's bfloat16 scales.
        ``dtype`` as the constructor's. SmolLM2-135M: 46,080 (float32), 23,040 (bfloat16,
        float16), 11,880 (fp8).

        Raises:
            ValueError: an unknown dtype (naming ``kv_cache_dtype``).
        """
        return kv_token_bytes(num_layers, num_kv_heads, head_dim, dtype)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by all K and V buffers, scales included (``num_slots * bytes_per_token``)."""
        return self.num_slots * self.bytes_per_token

    @property
    def total_bytes(self) -> int:
        """The same as :attr:`kv_cache_bytes`."""
        return self.kv_cache_bytes

    def k_slots(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s raw K storage viewed per slot: ``[num_slots, num_kv_heads, head_dim]``
        of :attr:`dtype` (fp8: without its scales; :meth:`read` gives values)."""
        return self.k_buffer[layer_id].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def v_slots(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s raw V storage viewed per slot: ``[num_slots, num_kv_heads, head_dim]``."""
        return self.v_buffer[layer_id].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def k_scale_slots(self, layer_id: int) -> torch.Tensor | None:
        """Layer ``layer_id``'s K scales per slot, ``[num_slots, num_kv_heads]`` bfloat16 (fp8), else None."""
        return None if self.k_scale is None else self.k_scale[layer_id].view(self.num_slots, self.num_kv_heads)

    def v_scale_slots(self, layer_id: int) -> torch.Tensor | None:
        """Layer ``layer_id``'s V scales per slot, ``[num_slots, num_kv_heads]`` bfloat16 (fp8), else None."""
        return None if self.v_scale is None else self.v_scale[layer_id].view(self.num_slots, self.num_kv_heads)

    def write(
        self,
        layer_id: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        quantizer: Callable[[torch.Tensor, str], tuple] = quantize,
    ) -> None:
        """Store K/V of ``T`` tokens of one layer, rounded to the pool's dtype
        (:mod:`radixkv.memory.kv_dtype`: an RNE cast; fp8 with a scale per token and head).

        Args:
            layer_id: layer index in ``[0, num_layers)``.
            slots: ``[T]`` int64 slot ids on the pool's device.
            k, v: ``[T, num_kv_heads, head_dim]`` (float32, or the model's compute dtype).
            quantizer: ``(x, kv_cache_dtype) -> (q, scale | None)``, the rounding; default the
                torch reference :func:`~radixkv.memory.kv_dtype.quantize` (a native one must give
                the same bits).
        """
        for x, store, scales in ((k, self.k_slots, self.k_scale_slots), (v, self.v_slots, self.v_scale_slots)):
            q, s = quantizer(x, self.kv_cache_dtype)
            dst = store(layer_id)
            if q.dtype.itemsize == 1:  # torch's index_copy_ has no float8 kernel: copy the bytes
                dst, q = dst.view(torch.uint8), q.view(torch.uint8)
            dst.index_copy_(0, slots, q)
            if s is not None:
                scales(layer_id).index_copy_(0, slots, s)

    def gather(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple:
        """K and V values of the given slots of one layer, dequantized (``q * scale`` in float32
        for fp8, exact widening otherwise), then cast to ``dtype``.

        Args:
            slots: ``[N]`` int64 slot ids on the pool's device.

        Returns:
            ``(k, v)``, each ``[N, num_kv_heads, head_dim]`` of ``dtype``.
        """
        out = []
        for store, scales in ((self.k_slots, self.k_scale_slots), (self.v_slots, self.v_scale_slots)):
            q = store(layer_id).index_select(0, slots)
            s = scales(layer_id)
            out.append(dequantize(q, None if s is None else s.index_select(0, slots), dtype))
        return out[0], out[1]

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple:
        """``gather(layer_id, slots, torch.float32)``: the float32 K/V the attention reads."""
        return self.gather(layer_id, slots, torch.float32)

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"num_slots={self.num_slots}, page_size={self.page_size}, kv_cache_dtype={self.kv_cache_dtype}, "
            f"bytes_per_token={self.bytes_per_token})"
        )


class ReqToTokenPool:
    """The block table: ``req_to_token[row, pos]`` is the KV slot of token ``pos`` of a request.

    Args:
        max_running_requests: number of rows (requests that can be in flight at once; > 0).
        max_context_len: row length (the longest prompt + output a request may reach; > 0).
        device: where ``req_to_token`` lives (the device of the model).

    Attributes:
        req_to_token: int32 ``[max_running_requests, max_context_len]``. Rows are filled by the
            owner of the request (the engine); positions beyond a request's length are garbage.

    ``alloc()`` returns a free row (most recently freed first) or ``None`` when all rows are taken; ``free(row)``
    returns it. Freeing a row that is not allocated raises ``ValueError``.
    """

    def __init__(self, max_running_requests: int, max_context_len: int, device: Device = "cpu") -> None:
        if int(max_running_requests) < 1:
            raise ValueError(f"ReqToTokenPool: max_running_requests must be >= 1, got {max_running_requests}")
        if int(max_context_len) < 1:
            raise ValueError(f"ReqToTokenPool: max_context_len must be >= 1, got {max_context_len}")
        self.max_running_requests = int(max_running_requests)
        self.max_context_len = int(max_context_len)
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (self.max_running_requests, self.max_context_len), dtype=torch.int32, device=self.device
        )
        # Popping from the end of a descending list hands out the lowest row first.
        self._free_rows = list(range(self.max_running_requests - 1, -1, -1))
        self._in_use = [False] * self.max_running_requests
        # On the CPU, writes go through a numpy view of the same memory: a torch slice assignment
        # costs ~50 us a call (dispatch, a cast kernel), a numpy one a few, and a decode step
        # makes one per request.
        self._host = self.req_to_token.numpy() if self.device.type == "cpu" else None

    def alloc(self) -> int | None:
        """Take a free row; ``None`` when all ``max_running_requests`` rows are in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        """Return ``row``. Raises ``ValueError`` if it is out of range or not allocated."""
        row = int(row)
        if not 0 <= row < self.max_running_requests:
            raise ValueError(f"ReqToTokenPool.free: row {row} out of range [0, {self.max_running_requests})")
        if not self._in_use[row]:
            raise ValueError(f"ReqToTokenPool.free: row {row} is not allocated (double free?)")
        self._in_use[row] = False
        self._free_rows.append(row)

    def available_size(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set ``req_to_token[row, start:start+len(slots)] = slots``.

        Raises ``ValueError`` when the range passes ``max_context_len``.
        """
        end = start + int(slots.numel())
        if start < 0 or end > self.max_context_len:
            raise ValueError(
                f"ReqToTokenPool.write: positions [{start}, {end}) exceed max_context_len {self.max_context_len}"
            )
        if self._host is not None and slots.device.type == "cpu":
            self._host[row, start:end] = slots.numpy(force=True)  # int64 -> int32 as torch's .to() casts
        else:
            self.req_to_token[row, start:end] = slots.to(device=self.device, dtype=torch.int32)
