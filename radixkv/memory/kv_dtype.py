"""K/V storage dtypes of the KV pool: their names, sizes and the write rounding (the torch reference).

Canonical names (:data:`KV_DTYPES`): ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"fp8_e4m3"``,
``"fp8_e5m2"``. Accepted spellings (:func:`canonical_kv_dtype`): those, the aliases of
:data:`KV_DTYPE_ALIASES` (``fp32``, ``bf16``, ``fp16``, ``half``, ``fp8`` = ``fp8_e4m3``), the
matching torch dtypes, and ``"auto"`` (the model's compute dtype).

The rounding every backend reproduces bit for bit (the native CPU kernels in C, this module in
torch ops), for a ``[..., head_dim]`` float32 row ``x`` of one token and one KV head:

* float32: stored as is. bfloat16 / float16: float32 -> round to nearest even (torch's ``.to``).
  Read back: exact widening to float32.
* fp8 (``FP8_MAX`` 448 for e4m3fn, 57344 for e5m2): ``amax = max |x|``; ``scale = 1`` when
  ``amax / FP8_MAX == 0`` (a zero row, or an underflowing tiny one), else ``bf16_ceil(amax / FP8_MAX)`` (float32 division, then rounded *up* to a
  bfloat16 value through its bits: ``(bits + 0xFFFF) & 0xFFFF0000``); ``q = fp8_rne(x / scale)``
  (float32 true division, then torch's float32 -> float8 cast, round to nearest even). Stored:
  ``q`` and ``scale`` (a bfloat16, one per token and KV head). Read back:
  ``q.to(float32) * scale`` (a float32 multiply).

So ``|x / scale| <= FP8_MAX`` up to the division's rounding, and a row's largest element keeps
e4m3's 3 (e5m2's 2) mantissa bits relative to itself.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = [
    "KV_DTYPES",
    "KV_DTYPE_ALIASES",
    "FP8_MAX",
    "SCALE_DTYPE",
    "canonical_kv_dtype",
    "kv_torch_dtype",
    "kv_element_size",
    "has_scales",
    "kv_token_bytes",
    "quantize",
    "dequantize",
]

KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
"""The canonical K/V dtype names (``EngineConfig.kv_cache_dtype`` after ``resolve``)."""

KV_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3"}
"""Other accepted spellings -> the canonical name."""

_TORCH = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_BY_TORCH = {dt: name for name, dt in _TORCH.items()}

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
"""The largest finite value of each fp8 format (e4m3fn: no infinities; e5m2: IEEE-like)."""

SCALE_DTYPE = torch.bfloat16
"""Dtype of the fp8 scales (one per token and KV head; 2 bytes)."""

DtypeLike = Union[str, torch.dtype]


def canonical_kv_dtype(value: DtypeLike, auto: Optional[DtypeLike] = None) -> str:
    """The canonical name of a K/V dtype spelling (module docstring).

    Args:
        value: a canonical name, an alias, a torch dtype of the five, or ``"auto"``.
        auto: what ``"auto"`` means (the model's compute dtype); None: ``"auto"`` is refused.

    Raises:
        ValueError: naming ``kv_cache_dtype`` and listing the valid spellings.
    """
    if isinstance(value, torch.dtype) and value in _BY_TORCH:
        return _BY_TORCH[value]
    if isinstance(value, str):
        key = value.strip().lower()
        if key == "auto" and auto is not None:
            return canonical_kv_dtype(auto)
        if key in _TORCH:
            return key
        if key in KV_DTYPE_ALIASES:
            return KV_DTYPE_ALIASES[key]
    valid = (["auto"] if auto is not None else []) + list(KV_DTYPES) + sorted(KV_DTYPE_ALIASES)
    raise ValueError(f"kv_cache_dtype must be one of {valid}, got {value!r}")


def kv_torch_dtype(name: DtypeLike) -> torch.dtype:
    """The storage torch dtype of a K/V dtype (float8_e4m3fn / float8_e5m2 for fp8)."""
    return _TORCH[canonical_kv_dtype(name)]


def kv_element_size(name: DtypeLike) -> int:
    """Bytes of one stored K or V element (4, 2 or 1)."""
    return torch.empty((), dtype=kv_torch_dtype(name)).element_size()


def has_scales(name: DtypeLike) -> bool:
    """Whether the dtype stores a scale per (token, KV head): the fp8 dtypes."""
    return canonical_kv_dtype(name) in FP8_MAX


def kv_token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, name: DtypeLike) -> int:
    """K+V bytes of one token in every layer, scales included: ``2 * L * H * D * element size``,
    plus ``2 * L * H * 2`` (the bfloat16 scales of K and V) for fp8."""
    layers, heads = int(num_layers), int(num_kv_heads)
    out = 2 * layers * heads * int(head_dim) * kv_element_size(name)
    if has_scales(name):
        out += 2 * layers * heads * torch.empty((), dtype=SCALE_DTYPE).element_size()
    return out


def _bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 ``x`` rounded up to the next bfloat16 value (float32 result)."""
    bits = x.view(torch.int32)
    # 0xFFFF0000 as an int32 is -65536; the sum cannot overflow for finite x >= 0 (< 0x7F800000)
    return ((bits + 0xFFFF) & -65536).view(torch.float32)


def quantize(x: torch.Tensor, name: DtypeLike) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The write rounding (module docstring) of rows ``x`` ``[..., head_dim]``.

    Returns:
        ``(q, scale)``: ``q`` shaped as ``x`` in the storage dtype; ``scale`` ``[...]`` bfloat16
        (one per row) for fp8, else None.
    """
    kv = canonical_kv_dtype(name)
    if kv not in FP8_MAX:
        return x.to(_TORCH[kv]), None
    x = x.to(torch.float32)
    ratio = x.abs().amax(dim=-1) / FP8_MAX[kv]
    # NOTE: 1 where the ratio is 0 (a zero row, or an amax below ~6e-43 whose division underflows):
    # a zero scale would read back as NaN
    scale = torch.where(ratio == 0, torch.ones_like(ratio), _bf16_ceil(ratio))
    q = (x / scale.unsqueeze(-1)).to(_TORCH[kv])
    return q, scale.to(SCALE_DTYPE)


def dequantize(q: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows back as values: ``q.to(float32) * scale`` (fp8; ``scale`` ``[...]`` one per row)
    or ``q`` widened (``scale`` None); then cast to ``dtype``."""
    if scale is None:
        return q.to(dtype)
    x = q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    return x.to(dtype)
