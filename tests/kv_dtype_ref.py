"""The K/V dtype contract in torch ops, for the native kernels' tests (issue 35).

The write rounding of every K/V pool dtype, written here from the contract (not from the
kernels): float32 copied; bfloat16 / float16 torch's round-to-nearest-even casts; fp8 per (token,
head) ``scale = bf16_ceil(amax / FP8_MAX)`` (1 where amax / FP8_MAX is 0), ``q = (x / scale).to(fp8)``.
A row reads back as ``q.to(float32) * scale``.

:func:`make_pool` gives a pool laid out as the contract says (``k_buffer`` / ``v_buffer`` per
layer ``[pages, page_size, H, D]`` in the storage dtype, ``k_scale`` / ``v_scale`` ``[pages,
page_size, H]`` bfloat16 for fp8, else None, ``kv_cache_dtype``): radixkv's own ``KVPool`` when it
takes ``kv_cache_dtype``, else :class:`RefPool`, this module's stand-in with the same layout whose
``write`` is :func:`ref_quantize`. :class:`RoundedF32Pool` is a float32 pool whose ``write``
stores the dequantized rounding: the module path over it is the float32 reference computation of
a pool in that dtype.
"""

from __future__ import annotations

import inspect

import torch

from radixkv.memory.kv_pool import KVPool

STORAGE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
DTYPES = tuple(STORAGE)


def bf16_ceil(s: torch.Tensor) -> torch.Tensor:
    """The float32 values ``s`` (>= 0) rounded up to bfloat16 values (float32 result)."""
    bits = s.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def ref_quantize(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ``[..., D]`` float32 rounded to dtype ``name``: ``(q, scale)`` with ``scale``
    ``[...]`` bfloat16 for fp8, else None."""
    x = x.to(torch.float32)
    if name not in FP8_MAX:
        return x.to(STORAGE[name]), None
    ratio = x.abs().amax(-1) / FP8_MAX[name]
    scale = torch.where(ratio == 0, torch.ones_like(ratio), bf16_ceil(ratio))
    return (x / scale[..., None]).to(STORAGE[name]), scale.to(torch.bfloat16)


def ref_dequantize(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What a stored row reads back as: ``q.to(float32) (* scale)``."""
    out = q.to(torch.float32)
    return out if scale is None else out * scale.to(torch.float32)[..., None]


def ref_round(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` written in dtype ``name`` and read back (float32)."""
    return ref_dequantize(*ref_quantize(x, name))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A byte view of ``t`` (index_copy_ has no fp8 kernel on the CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


class RefPool(KVPool):
    """A CPU KVPool in dtype ``kv_cache_dtype`` laid out as the contract says; ``write`` rounds
    with :func:`ref_quantize` (or the ``quantizer`` given, as radixkv's KVPool.write takes one)."""

    def __init__(self, num_layers, num_kv_heads, head_dim, num_slots, page_size=1, kv_cache_dtype="float32"):
        super().__init__(num_layers, num_kv_heads, head_dim, num_slots, page_size, STORAGE[kv_cache_dtype], "cpu")
        self.kv_cache_dtype = kv_cache_dtype
        self.k_scale = self.v_scale = None
        if kv_cache_dtype in FP8_MAX:
            shape = (self.num_pages, self.page_size, self.num_kv_heads)
            self.k_scale = [torch.ones(shape, dtype=torch.bfloat16) for _ in range(num_layers)]
            self.v_scale = [torch.ones(shape, dtype=torch.bfloat16) for _ in range(num_layers)]
            self.bytes_per_token += 2 * self.num_layers * self.num_kv_heads * 2

    def write(self, layer_id, slots, k, v, quantizer=None):
        for buf, scales, x in ((self.k_buffer, self.k_scale, k), (self.v_buffer, self.v_scale, v)):
            q, s = (quantizer or ref_quantize)(x, self.kv_cache_dtype)
            _bytes(buf[layer_id]).view(self.num_slots, self.num_kv_heads, -1).index_copy_(0, slots, _bytes(q))
            if s is not None:
                scales[layer_id].view(self.num_slots, -1).index_copy_(0, slots, s)


class RoundedF32Pool(KVPool):
    """A float32 CPU KVPool whose ``write`` stores K/V as dtype ``name`` rounds them (read back)."""

    def __init__(self, num_layers, num_kv_heads, head_dim, num_slots, page_size=1, name="float32"):
        super().__init__(num_layers, num_kv_heads, head_dim, num_slots, page_size, torch.float32, "cpu")
        self.rounding = name

    def write(self, layer_id, slots, k, v):
        super().write(layer_id, slots, ref_round(k, self.rounding), ref_round(v, self.rounding))


def make_pool(num_layers, num_kv_heads, head_dim, num_slots, page_size, kv_cache_dtype):
    """A CPU pool of ``kv_cache_dtype``: radixkv's KVPool when it takes the dtype, else :class:`RefPool`."""
    if "kv_cache_dtype" in inspect.signature(KVPool).parameters:
        return KVPool(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_slots=num_slots,
            page_size=page_size,
            kv_cache_dtype=kv_cache_dtype,
            device="cpu",
        )
    return RefPool(num_layers, num_kv_heads, head_dim, num_slots, page_size, kv_cache_dtype)


def pool_rows(pool, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows of ``slots`` in layer ``layer_id`` as they read back (float32 ``[n, H, D]``)."""
    out = []
    for buf, scales in (
        (pool.k_buffer, getattr(pool, "k_scale", None)),
        (pool.v_buffer, getattr(pool, "v_scale", None)),
    ):
        q = buf[layer_id].view(pool.num_slots, pool.num_kv_heads, -1)[slots]
        s = None if scales is None else scales[layer_id].view(pool.num_slots, -1)[slots]
        out.append(ref_dequantize(q, s))
    return out[0], out[1]
