"""The decoder's tensor operations, and the one place that dispatches them to native kernels.

The model modules (:mod:`radixkv.models.layers`) call these functions and stay plain torch. Each
one takes the native CPU kernel (:mod:`radixkv.kernels.cpu`) when :func:`native_rows` holds for
its input (float32 rows on the CPU, a decode-sized batch, the kernels built, no gradient), else
the torch expression with the same math. Results agree to float32 rounding (the kernels sum in
another order); tests/test_models_tiny.py checks the module path on both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixkv.kernels import cpu

__all__ = [
    "SMALL_M_ROWS",
    "PackCache",
    "native_rows",
    "linear",
    "rms_norm",
    "rope_qkv",
    "apply_rope",
    "silu_mul",
]

SMALL_M_ROWS = 128
"""Row counts (2 to this) for which :func:`linear` uses the weight-major product on the CPU."""


class PackCache:
    """Holds the :class:`~radixkv.kernels.cpu.PackedWeight` of one weight tensor, rebuilt when
    the tensor is replaced or changed in place (its address, strides or ``_version`` move). Edits
    through ``weight.data`` do not move ``_version``: call
    :meth:`~radixkv.models.layers.CausalLM.reset_packed_weights` after those.

    Args:
        formats: the packed formats to try, in order (default
            :data:`radixkv.kernels.cpu.DEFAULT_PACK_FORMATS`).
    """

    __slots__ = ("_key", "_packed", "formats")

    def __init__(self, formats: tuple[str, ...] | None = None) -> None:
        self._key: tuple | None = None
        self._packed: cpu.PackedWeight | None = None
        self.formats = formats

    @property
    def packed(self) -> "cpu.PackedWeight | None":
        """The packed copy built so far (None before the first decode-sized forward)."""
        return self._packed

    def get(self, weight: torch.Tensor) -> "cpu.PackedWeight":
        """The packed copy of ``weight`` (``[N, K]`` float32 CPU), packing it when it changed."""
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride())
        if key != self._key:
            self._packed = cpu.PackedWeight(weight, self.formats)
            self._key = key
        return self._packed


def _no_grad(*tensors: torch.Tensor | None) -> bool:
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def native_rows(x: torch.Tensor) -> bool:
    """True when the native CPU kernels serve these rows: ``x`` is float32 on the CPU with at least
    one row, the kernels are available and no gradient is being recorded. Every batch size, a
    decode step's rows as a prefill's: the packed GEMM streams the block formats' 4.5-8.5 bits a
    weight instead of float32's 32 (MKL's sgemm on the float32 weights prefilled about half as
    fast, docs/model.md), and its bits do not depend on the row count."""
    return (
        cpu.AVAILABLE
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] >= 1
        and _no_grad(x)
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: PackCache | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [M, K]``, ``weight [N, K]`` -> ``[M, N]``), with two
    faster float32 CPU paths for decode-sized batches (same values up to float32 rounding):

    * ``M >= 1``, a ``pack`` cache given, the native kernels available and
      no gradient needed (:func:`native_rows`): :func:`radixkv.kernels.cpu.packed_linear` on the
      weight repacked once into 16-column panels (an AVX2 register-blocked GEMM). The packed copy
      costs the weight's bytes again (less in the lossless block formats).
    * else ``2 <= M <= SMALL_M_ROWS``: ``(weight @ x.T).T``. MKL's sgemm streams a large
      ``[N, K]`` left operand against a small packed right one far better than the ``x @ W.T``
      layout ``F.linear`` uses (docs/model.md has the measurement).

    Larger ``M`` (prefill), other devices and other dtypes use ``F.linear``.
    """
    if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and weight.dtype == torch.float32:
        if pack is not None and native_rows(x) and _no_grad(weight):
            return cpu.packed_linear(x, pack.get(weight), bias)
        if 1 < x.shape[0] <= SMALL_M_ROWS:
            if bias is None:
                y = torch.mm(weight, x.t())
            else:
                y = torch.addmm(bias.unsqueeze(1), weight, x.t())
            return y.t().contiguous()
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """RMSNorm (Zhang & Sennrich 2019) in float32, as transformers computes it.

    ``residual=None``: returns ``norm(x)``. Else forms ``residual + x`` (the decoder's skip
    connection, fused as vLLM's ``fused_add_rms_norm``) and returns ``(norm(residual + x),
    residual + x)``; on the native path the residual tensor is updated in place.
    ``x [T, hidden]``, ``weight [hidden]``.
    """
    if native_rows(x) and _no_grad(weight):
        if residual is None:
            return cpu.add_rms_norm(None, x.contiguous(), weight, eps)
        residual = residual.contiguous()
        return cpu.add_rms_norm(x.contiguous(), residual, weight, eps), residual
    if residual is None:
        return _rms_norm_torch(x, weight, eps)
    residual = residual + x
    return _rms_norm_torch(residual, weight, eps), residual


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    if dtype == torch.float32:  # one fused kernel, same math
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by the angles in ``cos``/``sin`` ``[T, 1, D]`` (rotate-half form,
    Su et al. 2021, as transformers' ``rotate_half``)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused ``qkv [T, (Hq + 2 Hkv) * D]`` projection and apply RoPE to q and k.

    Returns ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` rotated, and ``v [T, Hkv, D]``. On the native
    path q and k are rotated in place in ``qkv`` (their heads are adjacent in each row, so one pass
    rotates both). ``cos`` / ``sin``: ``[T, 1, D]`` from the rotary embedding.
    """
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if native_rows(qkv) and cos.is_contiguous() and cos.dtype == torch.float32:
        cpu.rope_(qkv, num_heads + num_kv_heads, head_dim, cos.view(t, head_dim), sin.view(t, head_dim))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, num_heads, head_dim)
        k = k.view(t, num_kv_heads, head_dim)
    else:
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(t, num_heads, head_dim), cos, sin)
        k = apply_rope(k.view(t, num_kv_heads, head_dim), cos, sin)
    return q, k, v.view(t, num_kv_heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020): ``silu(gate) * up`` for ``gate_up = [gate | up]``
    ``[M, 2I]`` -> ``[M, I]``."""
    if native_rows(gate_up):
        return cpu.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
