"""KV memory: the per-layer paged K/V tensors and the request-to-token block table.

Layout follows FlashInfer's paged KV cache in ``NHD`` order: per layer one K and one V tensor
shaped ``[num_pages, page_size, num_kv_heads, head_dim]``. KV *slot* ``s`` (the unit the
:class:`~radixkv.memory.allocator.SlotAllocator` hands out) lives at page ``s // page_size``,
offset ``s % page_size``; a page is therefore ``page_size`` consecutive slots.

:class:`ReqToTokenPool` is the block table (SGLang's ``req_to_token``): one int32 row per running
request mapping the request's logical token position to the slot that holds its K/V.
"""

from __future__ import annotations

from typing import Union

import torch

Device = Union[str, torch.device]


class KVPool:
    """Per-layer K and V buffers in FlashInfer's NHD paged layout.

    Args:
        num_layers: number of transformer layers (> 0).
        num_kv_heads: key/value heads per layer (> 0; fewer than query heads under GQA).
        head_dim: size of one head (> 0).
        num_slots: token capacity; must be a positive multiple of ``page_size``.
        page_size: tokens per page (>= 1).
        dtype: element type of the buffers (float32 on CPU; bfloat16/float16 on GPU).
        device: where the buffers live.

    Attributes:
        k_buffer, v_buffer: lists (one per layer) of tensors
            ``[num_pages, page_size, num_kv_heads, head_dim]`` of ``dtype``. K and V of one layer
            have identical shape and strides (FlashInfer then needs a single kernel variant).
        num_pages: ``num_slots // page_size``.
        bytes_per_token: ``2 * num_layers * num_kv_heads * head_dim * dtype size`` (bytes of K+V
            one token occupies across all layers).

    Raises:
        ValueError: a size is not positive, or ``num_slots`` is not a multiple of ``page_size``.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        page_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
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
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.bytes_per_token = self.token_bytes(self.num_layers, self.num_kv_heads, self.head_dim, dtype)

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K+V bytes of one token: ``2 * num_layers * num_kv_heads * head_dim * dtype size``."""
        return 2 * int(num_layers) * int(num_kv_heads) * int(head_dim) * torch.empty((), dtype=dtype).element_size()

    @property
    def total_bytes(self) -> int:
        """Bytes held by all K and V buffers (``num_slots * bytes_per_token``)."""
        return self.num_slots * self.bytes_per_token

    def k_slots(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s K buffer viewed per slot: ``[num_slots, num_kv_heads, head_dim]``."""
        return self.k_buffer[layer_id].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def v_slots(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s V buffer viewed per slot: ``[num_slots, num_kv_heads, head_dim]``."""
        return self.v_buffer[layer_id].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of ``T`` tokens of one layer.

        Args:
            layer_id: layer index in ``[0, num_layers)``.
            slots: ``[T]`` int64 slot ids on the pool's device.
            k, v: ``[T, num_kv_heads, head_dim]``; cast to the pool dtype.
        """
        self.k_slots(layer_id).index_copy_(0, slots, k.to(self.dtype))
        self.v_slots(layer_id).index_copy_(0, slots, v.to(self.dtype))

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"num_slots={self.num_slots}, page_size={self.page_size}, dtype={self.dtype}, "
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
