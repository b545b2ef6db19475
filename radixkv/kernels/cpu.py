"""Checked Python entry points to radixkv's native CPU kernels (``csrc/cpu_kernels/``).

float32 kernels for the CPU decode step (over a K/V pool in any of :data:`KV_DTYPES`), all
optional: :data:`AVAILABLE` is False when the extension was not built or the CPU lacks
AVX2/FMA/F16C, and callers then use torch.

* :class:`PackedWeight` + :func:`packed_linear`: ``x @ W.T (+ bias)`` with ``W`` repacked once
  into 16-column panels (a register-blocked GEMM, Goto & van de Geijn 2008; BLIS), stored in
  float32 or, when its values are exactly GGUF Q4_1 / Q8_0 block values, in that block form
  (lossless: the same weights, summed with the block scale factored out). docs/model.md has its speed against MKL and ``F.linear``.
* :func:`paged_attention`: causal paged attention in FlashInfer's semantics (bottom-right
  aligned) for a set of requests, reading K/V straight from the pool through the page table, in
  any of the pool dtypes of :data:`KV_DTYPES` (float32, bfloat16, float16, fp8 e4m3 / e5m2 with
  per token-and-head scales), widened to float32.
* :func:`kv_quantize`: float32 K/V rows rounded to a pool dtype, the pool's write rounding.
* :func:`add_rms_norm`, :func:`rope_`, :func:`silu_mul`: the decoder's elementwise steps.

:func:`step_plan` + :data:`decode_step` (a whole forward pass of a decode batch in one call, on
raw addresses) are driven by :mod:`radixkv.executor.cpu_decode`, which builds the plan from tensors
it has checked and keeps alive.

Every argument is validated here (dtype, device, contiguity, shapes, index ranges are the
caller's contract: see :func:`paged_attention`), because the C side works on raw addresses.

The ISA contract: every kernel gives the same bits on the AVX2 and the AVX-512 path, in every
weight format and every K/V dtype. The one-row GEMV's AVX-512 form keeps the AVX2 form's FMA
chains; the attention passes over bfloat16 / float16 / fp8 rows have AVX-512 forms that keep the
AVX2 forms' FMA chains and reduction trees (csrc/cpu_kernels/attention_lowp.c); the rest (float32
attention, the K/V write rounding, the elementwise kernels) is the same AVX2 code on both.
tests/test_kernels_isa.py and tests/test_kv_dtypes.py run both and compare bits.

Threads: ``torch.get_num_threads()`` at call time, on torch's own OpenMP (libgomp) worker
threads when the extension was built with OpenMP, else (and in a child forked after OpenMP ran)
on the extension's pthread pool; ``_ck.threading()`` says which. One parallel region runs at a
time: a second calling thread waits for the first's region to end.
"""

from __future__ import annotations

import torch

try:  # the optional C extension (setup.py); absent without a compiler
    from radixkv.kernels import _ckernels as _ck

    AVAILABLE = bool(_ck.available())
except ImportError:  # pragma: no cover - depends on the build
    _ck = None
    AVAILABLE = False


def isa() -> str | None:
    """The vector kernels in use: ``"avx512"`` (AVX-512 F/BW/VL, chosen at import when the CPU has
    them) or ``"avx2"`` (the AVX2 + FMA kernels, also what ``RADIXKV_KERNELS_ISA=avx2`` in the
    environment forces); ``None`` without the kernels. The one-row GEMV (a decode step's
    projections and LM head) and the attention passes over bfloat16 / float16 / fp8 K/V have
    AVX-512 forms; they give the AVX2 path's bits exactly."""
    return _ck.isa() if AVAILABLE else None


def set_isa(name: str) -> None:
    """Choose the vector kernels for this process: ``"avx2"`` or ``"avx512"`` (see :func:`isa`).

    Raises:
        ValueError: another name, or ``"avx512"`` on a CPU without AVX-512 F/BW/VL.
        RuntimeError: the native kernels are not available.
    """
    if not AVAILABLE:
        raise RuntimeError("set_isa: radixkv.kernels._ckernels is not available (no AVX2/FMA/F16C or not built)")
    _ck.set_isa(name)


def has_avx512() -> bool:
    """True when this CPU can run the AVX-512 kernels (whatever :func:`isa` is now)."""
    if not AVAILABLE:
        return False
    was = _ck.isa()
    try:
        _ck.set_isa("avx512")
        return True
    except ValueError:
        return False
    finally:
        _ck.set_isa(was)


decode_step = _ck.decode_step if AVAILABLE else None
"""The C entry point running one whole forward pass of a decode batch on a :func:`step_plan`:
``decode_step(plan, tokens, rows, prefix_lens, extend_lens, logits_rows, logits_address,
nthreads)`` (lists of ints: ``T`` token ids request after request, per request its block-table
row, cached length and new-token count, the ``S`` rows whose logits go to the float32 ``[S, vocab]``
buffer at ``logits_address``); ``None`` without the kernels. Every row, position, token id, logits
row and every slot the step reads or writes through the block table is checked first
(``ValueError``, nothing written). Its caller is :class:`radixkv.executor.cpu_decode.DecodeStep`."""


def step_plan(
    dims: tuple[int, ...],
    layers: tuple[tuple, ...],
    embed: int,
    final_norm: int,
    final_eps: float,
    lm_head: int,
    req_to_token: torch.Tensor,
    page_size: int,
    num_slots: int,
    sm_scale: float,
    kv_dtype: str = "float32",
):
    """The native plan of one model for :data:`decode_step` (an opaque capsule).

    Args:
        dims: ``(layers, hidden, q heads, kv heads, head_dim, intermediate, vocab)``.
        layers: per layer ``(norm_in, norm_post, eps_in, eps_post, qkv, qkv_bias, o, o_bias,
            gate_up, gate_up_bias, down, down_bias, k_cache, v_cache, k_scale, v_scale)``:
            addresses of float32 vectors, :class:`PackedWeight` addresses (their headers are
            checked against the shapes), 0 for no bias, the layer's contiguous pool tensors in
            ``kv_dtype`` and, for fp8, their bfloat16 scales ``[num_slots, Hkv]`` (else 0).
        embed: address of the float32 ``[vocab, hidden]`` embedding; ``final_norm`` of the final
            norm's weight; ``lm_head`` of the packed ``[vocab, hidden]`` output projection.
        req_to_token: the int32 ``[rows, max_context_len]`` contiguous CPU block table.
        page_size, num_slots: the KV pool's.
        kv_dtype: the pool's dtype (a name of :data:`KV_DTYPES`): the step writes each new
            token's K/V rounded as :func:`kv_quantize` does and attends over the pool as
            :func:`paged_attention` does.

    The caller keeps every tensor alive while the plan is used. Raises ValueError for bad
    dimensions, a packed weight that does not match its shape, a 0 address, an unknown
    ``kv_dtype`` or scales that do not match it.
    """
    if not AVAILABLE:
        raise RuntimeError("step_plan: radixkv.kernels._ckernels is not available")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"step_plan: kv_cache_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
    _need_tensor("step_plan: req_to_token", req_to_token)
    if req_to_token.dtype != torch.int32 or req_to_token.device.type != "cpu" or not req_to_token.is_contiguous():
        raise ValueError("step_plan: req_to_token must be a contiguous int32 CPU tensor")
    rows, cols = req_to_token.shape
    return _ck.step_plan(
        tuple(int(v) for v in dims),
        layers,
        int(embed),
        int(final_norm),
        float(final_eps),
        int(lm_head),
        req_to_token.data_ptr(),
        int(rows),
        int(cols),
        int(page_size),
        int(num_slots),
        float(sm_scale),
        _KV_CODES[kv_dtype],
    )


def step_set_rope(plan, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Give a :func:`step_plan` its RoPE tables: ``cos`` / ``sin`` ``[n, head_dim]`` float32
    contiguous, row ``p`` for position ``p`` (the caller keeps them alive)."""
    _check_rows("step_set_rope: cos", cos)
    _check_rows("step_set_rope: sin", sin, cos.shape[1])
    if sin.shape[0] != cos.shape[0]:
        raise ValueError("step_set_rope: cos and sin differ in length")
    _ck.step_set_rope(plan, cos.data_ptr(), sin.data_ptr(), cos.shape[0], cos.shape[1])


def threading_mode() -> str:
    """``"openmp"`` (torch's libgomp workers) or ``"pthreads"`` (the extension's own pool, used
    without OpenMP and in a child forked after OpenMP ran); ``"unavailable"`` without the kernels."""
    return _ck.threading() if AVAILABLE else "unavailable"


KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""The K/V pool dtypes the kernels read and write (canonical names, as ``EngineConfig.kv_cache_dtype``
resolves them) and their torch storage dtypes. The fp8 ones come with one bfloat16 scale per
(token, KV head)."""

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
"""The largest finite value of each fp8 format (what an fp8 row's amax is scaled to at most)."""

_KV_CODES = {name: i for i, name in enumerate(KV_DTYPES)}  # csrc/cpu_kernels/internal.h's KV_F32 ...
_KV_BY_TORCH = {dt: name for name, dt in KV_DTYPES.items()}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The canonical K/V dtype name of a pool's torch storage dtype (:data:`KV_DTYPES`).

    Raises ValueError for a dtype the kernels do not read."""
    name = _KV_BY_TORCH.get(dtype)
    if name is None:
        raise ValueError(f"kv_cache_dtype: the kernels read {sorted(KV_DTYPES)}, not {dtype}")
    return name


def kv_quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round float32 K or V rows to a K/V pool dtype: the pool's write rounding, bit for bit.

    * ``"float32"``: a copy. ``"bfloat16"`` / ``"float16"``: round to nearest even, the bits of
      ``x.to(torch.bfloat16)`` / ``x.to(torch.float16)``.
    * ``"fp8_e4m3"`` / ``"fp8_e5m2"``: per row ``x[t, h]`` (``D`` values) ``scale =
      bf16_ceil(amax / FP8_MAX)`` (``amax = max |x|``; the float32 quotient's bits rounded up to a
      bfloat16 value; 1 when ``amax == 0``), then ``q = (x / scale).to(float8_e4m3fn / float8_e5m2)``
      (float32 true division, round to nearest even; saturating at ``FP8_MAX``). The row reads back
      as ``q.to(float32) * scale``. Finite input never gives a NaN code.

    Args:
        x: ``[T, H, D]`` float32 CPU tensor (made contiguous), ``D`` a multiple of 8.
        kv_dtype: a name of :data:`KV_DTYPES`.

    Returns:
        ``(q, scale)``: ``q`` ``[T, H, D]`` in the dtype's torch storage dtype; ``scale`` ``[T, H]``
        bfloat16 for fp8, else ``None``.

    Raises:
        ValueError: an unknown ``kv_dtype`` (the valid ones listed), or ``x`` not a 3-d float32 CPU
            tensor with ``D % 8 == 0``.
        RuntimeError: the native kernels are not available.
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_quantize: kv_cache_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
    _check_cpu_f32("kv_quantize: x", x, 3)
    t, h, d = x.shape
    if d % 8 or d < 8:
        raise ValueError(f"kv_quantize: head_dim must be a positive multiple of 8, got {d}")
    if not AVAILABLE:
        raise RuntimeError("kv_quantize: radixkv.kernels._ckernels is not available (no AVX2/FMA/F16C or not built)")
    x = x.detach().contiguous()
    q = torch.empty(t, h, d, dtype=KV_DTYPES[kv_dtype])
    scale = torch.empty(t, h, dtype=torch.bfloat16) if kv_dtype in FP8_MAX else None
    if not q.numel():  # no rows: an empty tensor's address is 0, which the kernel reads as "no scales"
        return q, scale
    _ck.kv_quantize(x.data_ptr(), t * h, d, _KV_CODES[kv_dtype], q.data_ptr(), 0 if scale is None else scale.data_ptr())
    return q, scale


def _need_tensor(name: str, t) -> None:
    """ValueError naming ``name`` unless ``t`` is a tensor (None, a list, a number are refused here
    rather than failing later with an AttributeError)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _check_cpu_f32(name: str, t: torch.Tensor, dim: int) -> None:
    _need_tensor(name, t)
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-d float32 CPU tensor, got {t.dim()}-d {t.dtype} on {t.device}")


_HUGE = 2 << 20


def _huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``nbytes`` whose memory the kernel backs with transparent huge pages
    where it can (``madvise(MADV_HUGEPAGE)`` before first touch): fewer TLB walks while a decode
    step streams the weights (docs/model.md has what it measured)."""
    if not AVAILABLE or nbytes < _HUGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    start = -buf.data_ptr() % _HUGE  # the first 2 MiB boundary
    out = buf[start : start + nbytes]
    _ck.advise_hugepages(out.data_ptr(), nbytes)
    return out


DEFAULT_PACK_FORMATS: tuple[str, ...] = ("q4_1", "q8_0", "f32")
"""The formats :class:`PackedWeight` tries, in order, when none are given (a model can choose
others: :meth:`radixkv.models.layers.CausalLM.set_pack_formats`)."""

_FORMAT_IDS = {"f32": 0, "q4_1": 1, "q8_0": 2}


class PackedWeight:
    """A ``[N, K]`` float32 weight repacked for :func:`packed_linear`, losslessly compressed
    when its values allow.

    ``data`` is a uint8 buffer: a 64-byte header (format, ``N``, ``K``, checked by the kernels),
    then panels of 16 weight rows (zero-padded past ``N``) in ``format``:

    * ``"f32"``: float32 ``[K, 16]`` per panel (the rows transposed). 4 bytes a weight.
    * ``"q4_1"``: per 32 ``k`` of a row, fp16 ``d``, fp16 ``m`` and 4-bit ``q`` with
      ``w = q * d + m``: the values a GGUF ``Q4_1`` tensor dequantizes to (gguf-py, llama.cpp's
      ``dequantize_row_q4_1``). 0.625 bytes a weight.
    * ``"q8_0"``: per 32 ``k``, fp16 ``d`` and int8 ``q`` with ``w = q * d`` (GGUF ``Q8_0``).
      1.06 bytes a weight.

    A block format is used only when every weight decodes to exactly its float32 value
    (bit for bit; checked here while packing). A GEMM over a block format sums each block of 32
    ``k`` as ``t = x . q`` and adds ``t * d`` (+ ``m * sum(x)``) per block: one FMA per weight instead
    of a decode and an FMA. That is the same value as the float32 panels' sum over the decoded
    weights but not the same rounding (ulps apart); it is the same bits for any row count, thread
    count and ISA, and a one-hot ``x`` gives every weight back exactly. The default model's weights
    come from a Q4_1/Q8_0 GGUF file, so its packed copy is 96 MB, not 540. (Bit-exactness
    assumes the default round-to-nearest float mode, as torch and numpy do.)

    Args:
        weight: ``[N, K]`` float32 CPU tensor (any strides).
        formats: formats to try in order; the first exact one is used (default
            :data:`DEFAULT_PACK_FORMATS`). Include ``"f32"`` to accept any weight.

    Raises:
        ValueError: another dtype, device or rank, ``K < 1``, an unknown format, or no format in
            ``formats`` holds this weight exactly.
        RuntimeError: the native kernels are not available (:data:`AVAILABLE` is False).
    """

    __slots__ = ("data", "n", "k", "format", "address")

    def __init__(self, weight: torch.Tensor, formats: tuple[str, ...] | None = None) -> None:
        _check_cpu_f32("PackedWeight: weight", weight, 2)
        n, k = weight.shape
        if k < 1 or n < 1:
            raise ValueError(f"PackedWeight: weight must be at least [1, 1], got {tuple(weight.shape)}")
        if not AVAILABLE:
            raise RuntimeError(
                "PackedWeight: radixkv.kernels._ckernels is not available (no AVX2/FMA/F16C or not built)"
            )
        formats = DEFAULT_PACK_FORMATS if formats is None else tuple(formats)
        for f in formats:
            if not isinstance(f, str) or f not in _FORMAT_IDS:
                raise ValueError(f"PackedWeight: unknown format {f!r}; expected one of {sorted(_FORMAT_IDS)}")
        w = weight.detach()
        if w.stride(1) != 1 or (n > 1 and w.stride(0) < k):  # the packer reads rows of K adjacent floats
            w = w.contiguous()
        ldw = w.stride(0) if n > 1 else k  # a single row's stride is arbitrary
        self.n, self.k = int(n), int(k)
        for f in formats:
            nbytes = _ck.packed_bytes(_FORMAT_IDS[f], self.n, self.k)
            if not nbytes:
                continue  # K is not a multiple of the format's block
            data = _huge_page_empty(nbytes)
            if _ck.pack_weight(w.data_ptr(), self.n, self.k, ldw, _FORMAT_IDS[f], data.data_ptr(), nbytes):
                self.data, self.format = data, f
                self.address = data.data_ptr()  # what the kernels take
                return
        raise ValueError(f"PackedWeight: the weight {tuple(weight.shape)} is not exact in any of {formats}")

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy (header included)."""
        return self.data.numel()


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``x [M, K]`` float32 on the CPU, ``W`` given packed.

    Returns a new ``[M, N]`` float32 tensor. Each output is one float32 FMA chain over ``k``,
    so it equals ``F.linear`` up to float32 rounding (another summation order).

    Raises:
        RuntimeError: the native kernels are not available (:data:`AVAILABLE` is False).
        ValueError: ``x`` is not 2-d float32 on the CPU or needs a gradient, ``K`` differs from
            the weight's, or ``bias`` is not a float32 ``[N]`` CPU tensor. (Rows of ``x`` may be strided; ``x``
            is copied only when its columns are not adjacent.)
    """
    if not AVAILABLE:
        raise RuntimeError("packed_linear: radixkv.kernels._ckernels is not available (no AVX2/FMA/F16C or not built)")
    _check_cpu_f32("packed_linear: x", x, 2)
    if not isinstance(packed, PackedWeight):
        raise ValueError(f"packed_linear: packed must be a PackedWeight, got {type(packed).__name__}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("packed_linear: x requires grad; the native GEMM records no gradient (use F.linear)")
    m, k = x.shape
    if k != packed.k:
        raise ValueError(f"packed_linear: x has {k} columns, the weight has K={packed.k}")
    if x.stride(1) != 1 and k > 1:
        x = x.contiguous()
    b = 0
    if bias is not None:
        _check_cpu_f32("packed_linear: bias", bias, 1)
        if bias.shape[0] != packed.n:
            raise ValueError(f"packed_linear: bias has {bias.shape[0]} entries, N={packed.n}")
        bias = bias.contiguous()
        b = bias.data_ptr()
    out = torch.empty(m, packed.n, dtype=torch.float32)
    if m:
        _ck.sgemm_packed(
            x.data_ptr(),
            m,
            k,
            x.stride(0),
            packed.address,
            packed.n,
            b,
            out.data_ptr(),
            packed.n,
            torch.get_num_threads(),
        )
    return out


def paged_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    req_meta: torch.Tensor,
    kv_indices: torch.Tensor,
    page_size: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Causal paged attention for some requests of a batch, written into ``out`` in place.

    Semantics of FlashInfer's paged prefill with ``causal=True`` (bottom-right aligned): query
    row ``j`` of a request attends to its KV positions ``0 .. kv_len - q_len + j``; GQA by head
    groups; softmax in float32 (two passes, max subtracted).

    Args:
        q: ``[T, Hq, D]`` float32 contiguous queries (RoPE applied), D a multiple of 8.
        out: ``[T, Hq, D]`` float32 contiguous; the rows of the given requests are overwritten.
        req_meta: ``[4, R]`` int32 contiguous: per request its first query row, query count,
            offset into ``kv_indices`` (``kv_indptr``) and KV length (tokens, new ones included).
            Checked in C before the kernel runs (rows inside ``q``, ``0 <= q_len <= kv_len``,
            pages inside ``kv_indices``, page ids inside the pool).
        kv_indices: int32 contiguous page ids.
        page_size: tokens per page.
        k_cache, v_cache: one layer's ``[num_slots, Hkv, D]`` contiguous pool tensors (the NHD
            pages flattened), both of one dtype of :data:`KV_DTYPES` (read as float32: exact
            widening; fp8 values times their scale, factored out of the dot products).
        sm_scale: softmax scale.
        k_scale, v_scale: fp8 pools only (and then required): ``[num_slots, Hkv]`` bfloat16
            contiguous, the scale of each (slot, KV head).

    Raises:
        RuntimeError: the native kernels are not available.
        ValueError: a dtype, device, layout, shape or metadata value outside the above.
    """
    if not AVAILABLE:
        raise RuntimeError(
            "paged_attention: radixkv.kernels._ckernels is not available (no AVX2/FMA/F16C or not built)"
        )
    page_size = int(page_size)
    for name, t, dim in (("q", q, 3), ("out", out, 3)):
        _check_cpu_f32(f"paged_attention: {name}", t, dim)
        if not t.is_contiguous():
            raise ValueError(f"paged_attention: {name} must be contiguous")
    dt = _check_kv_tensors("paged_attention", k_cache, v_cache, k_scale, v_scale)
    t_rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    if out.shape != q.shape or k_cache.shape != v_cache.shape or k_cache.shape[2] != d:
        raise ValueError(
            f"paged_attention: shapes q {tuple(q.shape)}, out {tuple(out.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)} do not agree"
        )
    if page_size < 1 or k_cache.shape[0] % page_size:
        raise ValueError(
            f"paged_attention: page_size must be >= 1 and divide num_slots ({k_cache.shape[0]}), got {page_size}"
        )
    if hkv < 1 or d % 8 or hq % hkv:
        raise ValueError(f"paged_attention: head_dim ({d}) must be a multiple of 8 and Hq ({hq}) of Hkv ({hkv})")
    for name, t in (("req_meta", req_meta), ("kv_indices", kv_indices)):
        _need_tensor(f"paged_attention: {name}", t)
        if t.dtype != torch.int32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"paged_attention: {name} must be a contiguous int32 CPU tensor")
    if req_meta.dim() != 2 or req_meta.shape[0] != 4:
        raise ValueError(f"paged_attention: req_meta must be [4, R], got {tuple(req_meta.shape)}")
    r = req_meta.shape[1]
    if r == 0:
        return
    _ck.paged_attention(
        q.data_ptr(),
        t_rows,
        req_meta.data_ptr(),
        r,
        kv_indices.data_ptr(),
        kv_indices.numel(),
        page_size,
        k_cache.shape[0] // page_size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        0 if k_scale is None else k_scale.data_ptr(),
        0 if v_scale is None else v_scale.data_ptr(),
        _KV_CODES[dt],
        hq,
        hkv,
        d,
        float(sm_scale),
        out.data_ptr(),
        torch.get_num_threads(),
    )


def _check_kv_tensors(
    fn: str, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> str:
    """The K/V dtype name of one layer's pool tensors ``[num_slots, Hkv, D]`` (contiguous CPU, one
    dtype of :data:`KV_DTYPES`) after checking them and their scales (``[num_slots, Hkv]``
    bfloat16 contiguous for fp8, else ``None``); ValueError naming what is wrong."""
    for name, t in (("k_cache", k), ("v_cache", v)):
        _need_tensor(f"{fn}: {name}", t)
        if t.device.type != "cpu" or t.dim() != 3 or not t.is_contiguous() or t.dtype not in _KV_BY_TORCH:
            raise ValueError(
                f"{fn}: {name} must be a contiguous 3-d CPU tensor of {[str(x) for x in KV_DTYPES.values()]}, "
                f"got {t.dim()}-d {t.dtype} on {t.device}"
            )
    if k.dtype != v.dtype:
        raise ValueError(f"{fn}: k_cache is {k.dtype}, v_cache {v.dtype}")
    name = _KV_BY_TORCH[k.dtype]
    if name not in FP8_MAX:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{fn}: a {name} pool has no scales")
        return name
    for sname, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{fn}: an {name} pool needs {sname}")
        _need_tensor(f"{fn}: {sname}", s)
        if s.dtype != torch.bfloat16 or s.device.type != "cpu" or not s.is_contiguous() or s.shape != k.shape[:2]:
            raise ValueError(
                f"{fn}: {sname} must be a contiguous bfloat16 CPU tensor of shape {tuple(k.shape[:2])}, "
                f"got {tuple(s.shape)} {s.dtype} on {s.device}"
            )
    return name


def _check_rows(name: str, t: torch.Tensor, cols: int | None = None) -> None:
    """``t`` is a contiguous 2-d float32 CPU tensor (with ``cols`` columns when given)."""
    _need_tensor(name, t)
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous 2-d float32 CPU tensor, got {tuple(t.shape)} {t.dtype} on {t.device}"
        )
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name}: expected {cols} columns, got {t.shape[1]}")


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` (in place, when ``delta`` is given), then return
    ``weight * residual / sqrt(mean(residual ** 2, -1) + eps)`` (RMSNorm, Zhang & Sennrich 2019,
    as transformers' ``LlamaRMSNorm`` computes it in float32).

    Args:
        delta: ``[M, K]`` float32 contiguous, or ``None``.
        residual: ``[M, K]`` float32 contiguous; updated in place when ``delta`` is given.
        weight: ``[K]`` float32 contiguous.

    Returns a new ``[M, K]`` float32 tensor. Raises RuntimeError without the native kernels and
    ValueError for another dtype, device, layout or shape.
    """
    if not AVAILABLE:
        raise RuntimeError("add_rms_norm: radixkv.kernels._ckernels is not available")
    _check_rows("add_rms_norm: residual", residual)
    m, k = residual.shape
    if delta is not None:
        _check_rows("add_rms_norm: delta", delta, k)
        if delta.shape[0] != m:
            raise ValueError(f"add_rms_norm: delta has {delta.shape[0]} rows, residual {m}")
    _need_tensor("add_rms_norm: weight", weight)
    if (
        weight.dtype != torch.float32
        or weight.shape != (k,)
        or not weight.is_contiguous()
        or weight.device.type != "cpu"
    ):
        raise ValueError(f"add_rms_norm: weight must be a contiguous float32 CPU tensor of shape ({k},)")
    out = torch.empty_like(residual)
    _ck.add_rms_norm(
        0 if delta is None else delta.data_ptr(),
        residual.data_ptr(),
        out.data_ptr(),
        m,
        k,
        weight.data_ptr(),
        float(eps),
    )
    return out


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE (Su et al. 2021, transformers' ``rotate_half`` form) in place on the first
    ``num_heads * head_dim`` columns of each row of ``x``.

    Args:
        x: ``[T, C]`` float32 CPU tensor with unit column stride (rows may be further apart,
            e.g. the q/k part of a fused qkv output), ``C >= num_heads * head_dim``.
        cos, sin: ``[T, head_dim]`` float32 contiguous (both halves, as RotaryEmbedding gives).

    Raises RuntimeError without the native kernels, ValueError for bad shapes or layouts.
    """
    if not AVAILABLE:
        raise RuntimeError("rope_: radixkv.kernels._ckernels is not available")
    _need_tensor("rope_: x", x)
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("rope_: x must be a 2-d float32 CPU tensor with unit column stride")
    t = x.shape[0]
    if num_heads < 1 or head_dim < 2 or head_dim % 2 or num_heads * head_dim > x.shape[1]:
        raise ValueError(
            f"rope_: {num_heads} heads of {head_dim} do not fit x's {x.shape[1]} columns (num_heads >= 1, head_dim even)"
        )
    for name, c in (("cos", cos), ("sin", sin)):
        _check_rows(f"rope_: {name}", c, head_dim)
        if c.shape[0] != t:
            raise ValueError(f"rope_: {name} has {c.shape[0]} rows, x {t}")
    _ck.rope_inplace(x.data_ptr(), t, int(num_heads), int(head_dim), x.stride(0), cos.data_ptr(), sin.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[M, 2I]`` float32
    contiguous; returns ``[M, I]``. ``silu(g) = g / (1 + exp(-g))`` with a vectorized exp (Cephes
    polynomial, ~2 ulp). Raises RuntimeError without the native kernels, ValueError otherwise.
    """
    if not AVAILABLE:
        raise RuntimeError("silu_mul: radixkv.kernels._ckernels is not available")
    _check_rows("silu_mul: gate_up", gate_up)
    m, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"silu_mul: gate_up must have an even number of columns, got {two_i}")
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    _ck.silu_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
    return out


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Grammar masks in place: ``logits[r, j] = -inf`` for each row ``r`` of ``rows`` and each
    token ``j`` whose bit is 0 in ``bitmask[r]`` (xgrammar's layout: int32 words, 32 tokens each,
    least significant bit first). ``logits`` ``[S, V]`` float32 CPU with unit column stride,
    ``bitmask`` ``[>= S, >= ceil(V / 32)]`` int32 CPU contiguous rows, ``rows`` 1-D int64 in
    ``[0, S)``. AVX2, one thread. Raises RuntimeError without the native kernels, ValueError
    otherwise."""
    if not AVAILABLE:
        raise RuntimeError("apply_token_bitmask_: radixkv.kernels._ckernels is not available")
    for name, t in (("logits", logits), ("bitmask", bitmask), ("rows", rows)):
        _need_tensor(f"apply_token_bitmask_: {name}", t)
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("apply_token_bitmask_: logits must be a 2-d float32 CPU tensor with unit column stride")
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask_: bitmask must be a 2-d int32 CPU tensor with unit column stride")
    s, v = logits.shape
    if bitmask.shape[1] * 32 < v or bitmask.shape[0] < s:
        raise ValueError(f"apply_token_bitmask_: bitmask {tuple(bitmask.shape)} does not cover logits {(s, v)}")
    rows = rows.to(torch.int64).contiguous()
    if rows.dim() != 1 or rows.device.type != "cpu":
        raise ValueError("apply_token_bitmask_: rows must be a 1-d CPU index tensor")
    if rows.numel() == 0:
        return
    if int(rows.min()) < 0 or int(rows.max()) >= s:
        raise ValueError(f"apply_token_bitmask_: rows must be in [0, {s}), got {rows.tolist()}")
    _ck.apply_token_bitmask(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0), rows.data_ptr(), rows.numel(), v
    )
