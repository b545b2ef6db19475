"""The fused native CPU decode step: a whole forward pass of a decode batch as one native call.

For a decode step most of a module-by-module forward is per-op dispatch and Python, not
arithmetic. When the runner's attention backend is ``"cpu"`` and the model suits the kernels
(:func:`model_supported`), :class:`~radixkv.executor.model_runner.ModelRunner` keeps a
:class:`DecodeStep`: a plan of the model's addresses (packed weights, norms, embeddings, KV pool,
block table, RoPE tables) built once, so that a batch of at most :data:`MAX_ROWS` new tokens with at
most :data:`MAX_EXTEND` per request (decode steps, short extends) runs as ONE call,
:func:`radixkv.kernels.cpu.decode_step`: embeddings, every decoder layer (RMSNorm + residual,
packed q/k/v GEMM, RoPE, K/V write, paged attention, o GEMM, RMSNorm, gate|up, SiLU-and-multiply,
down), the final norm and the logits, in one parallel region with the GIL released.
``ModelRunner.build_batch`` then returns a :class:`DecodeBatch` (the batch as Python lists; the
:class:`~radixkv.attention.metadata.ForwardBatch` tensors are built only if something reads them)
and ``ModelRunner.forward`` hands it to :meth:`DecodeStep.forward`: no torch op, no attention
``plan()`` and no per-layer Python run in a step.

The arithmetic is that of the module path's kernels (the same GEMM, norm, RoPE, SiLU and attention
code; tests/test_cpu_kernels.py and tests/test_models_tiny.py check the logits against transformers
and the module path). The pool may be in any K/V dtype of :data:`radixkv.kernels.cpu.KV_DTYPES`: the
step writes each new token's K/V with the pool's rounding (:func:`radixkv.kernels.cpu.kv_quantize`'s
bits, fp8 scales included) and attends over the pool as ``paged_attention`` does
(tests/test_kv_dtypes.py). The plan is rebuilt when a weight is replaced or changed in place (the
weights epoch of :func:`~radixkv.models.layers.weights_epoch`, every source tensor's address and
every packed weight's ``_version`` are compared before each step).
"""

from __future__ import annotations

from itertools import accumulate
from operator import attrgetter

import torch

from radixkv.kernels import cpu
from radixkv.models.layers import CausalLM, Linear, weights_epoch

__all__ = [
    "MAX_ROWS",
    "MAX_EXTEND",
    "MAX_HEAD_DIM",
    "MAX_GROUP",
    "DecodeBatch",
    "DecodeStep",
    "ints",
    "model_supported",
]

MAX_ROWS = 64
"""Most new tokens in a batch the fused step serves (the native kernels' decode-sized batches)."""

MAX_EXTEND = 16
"""Most new tokens of one request in a batch the fused step serves (the attention backend's
``native_max_q``: longer extends are prefills, which torch's blocked kernels do better)."""

MAX_HEAD_DIM = 256
"""Largest head_dim the fused step takes (csrc/cpu_kernels/step.c's ``step_dims_ok``)."""

MAX_GROUP = 64
"""Most query heads per KV head the fused step takes (``step_dims_ok``; its attention keeps a
group's partial sums on the stack)."""

_data_ptr = torch.Tensor.data_ptr
_version = attrgetter("_version")


def ints(v) -> list[int]:
    """A list of Python ints from a sequence or a tensor (``TypeError`` / ``ValueError`` else)."""
    if isinstance(v, torch.Tensor):
        return v.reshape(-1).tolist()
    out = list(v)
    if not all(type(x) is int for x in out):
        out = [int(x) for x in out]
    return out


def model_supported(model: CausalLM) -> str | None:
    """Why the fused step cannot run ``model`` (``None``: it can): the kernels must be there, the
    model float32 on the CPU, not quantized, with :class:`~radixkv.models.layers.Linear`
    projections, head_dim a multiple of 8 up to :data:`MAX_HEAD_DIM` and at most
    :data:`MAX_GROUP` query heads per KV head."""
    if not cpu.AVAILABLE:
        return "radixkv.kernels._ckernels is not built or the CPU lacks AVX2/FMA/F16C"
    if not model.num_layers or model.logits_proj is not None or model.quantization is not None:
        return "the model is quantized or has no layers"
    layer = model.model.layers[0]
    attn = layer.self_attn
    if attn.head_dim % 8 or attn.head_dim > MAX_HEAD_DIM or attn.num_heads // attn.num_kv_heads > MAX_GROUP:
        return (
            f"head_dim {attn.head_dim} (a multiple of 8 up to {MAX_HEAD_DIM}) or "
            f"{attn.num_heads // attn.num_kv_heads} query heads per KV head (at most {MAX_GROUP})"
        )
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        if not isinstance(lin, Linear):
            return "a projection is not a radixkv Linear"
    w = model.model.embed_tokens.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return "the model is not float32 on the CPU"
    if model.lm_head_weight().shape != w.shape:
        return "the output projection and the embedding differ in shape"
    return None


class DecodeBatch:
    """A decode-sized batch as the engine gave it (lists), for :meth:`DecodeStep.forward`.

    It stands for the :class:`~radixkv.attention.metadata.ForwardBatch` that
    :meth:`ForwardBatch.build` would make from the same arguments: reading any of its fields
    (``batch.kv_indices``, ``batch.positions`` ...) builds that batch once (:meth:`materialize`)
    and answers from it, so code written for a ``ForwardBatch`` keeps working.

    Attributes:
        tokens, rows, prefix_lens, extend_lens: lists of ints (``T`` tokens; ``B`` requests).
        logits_rows: the ``S`` rows whose logits are computed.
        page_size: the runner's page size.
    """

    __slots__ = ("tokens", "rows", "prefix_lens", "extend_lens", "logits_rows", "page_size", "_req_to_token", "_full")

    def __init__(self, tokens, rows, prefix_lens, extend_lens, logits_rows, page_size, req_to_token) -> None:
        self.tokens, self.rows, self.prefix_lens, self.extend_lens = tokens, rows, prefix_lens, extend_lens
        self.logits_rows, self.page_size, self._req_to_token = logits_rows, page_size, req_to_token
        self._full = None

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_logits(self) -> int:
        return len(self.logits_rows)

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == len(self.rows)

    def materialize(self):
        """The equivalent :class:`~radixkv.attention.metadata.ForwardBatch` (built once)."""
        if self._full is None:
            from radixkv.attention.metadata import ForwardBatch

            self._full = ForwardBatch.build(
                self.tokens,
                self.rows,
                self.prefix_lens,
                self.extend_lens,
                self._req_to_token,
                self.page_size,
                logits_indices=self.logits_rows,
            )
        return self._full

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)


class DecodeStep:
    """The fused decode step of one :class:`~radixkv.executor.model_runner.ModelRunner`.

    Args:
        model: the runner's model (:func:`model_supported` must hold).
        kv_pool: the runner's pool on the CPU (``head_dim % 8 == 0``), in a dtype of
            :data:`radixkv.kernels.cpu.KV_DTYPES`; an fp8 pool has ``k_scale`` / ``v_scale``
            (per layer ``[pages, page_size, Hkv]`` bfloat16).
        req_to_token: the runner's block table (int32 ``[rows, max_context_len]``, CPU).
        sm_scale: the attention softmax scale.
    """

    def __init__(self, model: CausalLM, kv_pool, req_to_token: torch.Tensor, sm_scale: float) -> None:
        self.model, self.kv_pool, self.req_to_token = model, kv_pool, req_to_token
        self.sm_scale = float(sm_scale)
        self.max_rows, self.max_ctx = (int(n) for n in req_to_token.shape)
        self._plan = None
        self._rope_len = 0

    # ------------------------------------------------------------------ per step
    def batch(self, input_ids, req_rows, prefix_lens, extend_lens, logits_indices=None) -> DecodeBatch | None:
        """A :class:`DecodeBatch` for these :meth:`ForwardBatch.build` arguments when the fused
        step serves them (at most :data:`MAX_ROWS` tokens, :data:`MAX_EXTEND` per request, every
        value in range), else ``None`` (the caller builds a ``ForwardBatch``, which also raises
        the ``ValueError`` of a bad argument)."""
        try:
            tokens, rows, prefix, extend = (ints(v) for v in (input_ids, req_rows, prefix_lens, extend_lens))
            b = len(rows)
            if not (
                0 < b == len(prefix) == len(extend)
                and len(tokens) <= MAX_ROWS
                and min(extend) >= 1
                and max(extend) <= MAX_EXTEND
                and sum(extend) == len(tokens)
                and min(prefix) >= 0
                and min(rows) >= 0
                and max(rows) < self.max_rows
                and max(map(int.__add__, prefix, extend)) <= self.max_ctx
            ):
                return None
            if logits_indices is None:
                lrows = [e - 1 for e in accumulate(extend)]
            else:
                lrows = ints(logits_indices)
                if len(lrows) > MAX_ROWS or (lrows and (min(lrows) < 0 or max(lrows) >= len(tokens))):
                    return None
        except (TypeError, ValueError, RuntimeError):  # not sequences of ints: ForwardBatch.build says why
            return None
        return DecodeBatch(tokens, rows, prefix, extend, lrows, self.kv_pool.page_size, self.req_to_token)

    def forward(self, batch: DecodeBatch) -> torch.Tensor | None:
        """Float32 logits ``[S, vocab]`` of ``batch.logits_rows`` (and the new tokens' K/V written
        into the pool), or ``None`` when the model no longer suits the fused step (the caller
        then runs the module path). Raises ValueError when a row's block table holds a slot
        outside the pool or a misaligned page (checked natively before anything is written)."""
        plan = self._plan
        if plan is None or not self._still_valid():
            if model_supported(self.model) is not None:
                return None
            plan = self._build()
        need = max(map(int.__add__, batch.prefix_lens, batch.extend_lens))
        if need > self._rope_len:
            self._set_rope(need)
        logits = torch.empty(len(batch.logits_rows), self._vocab, dtype=torch.float32)
        cpu.decode_step(
            plan,
            batch.tokens,
            batch.rows,
            batch.prefix_lens,
            batch.extend_lens,
            batch.logits_rows,
            logits.data_ptr(),
            torch.get_num_threads(),
        )
        return logits

    # ------------------------------------------------------------------ the plan
    def _still_valid(self) -> bool:
        # A tensor's ``_version`` only grows (every in-place op adds 1), so the sum over the
        # packed weights' sources equals the one taken at build time exactly when none changed;
        # a ``.data =`` assignment leaves ``_version`` alone but moves ``data_ptr``.
        return (
            self._epoch == weights_epoch()
            and sum(map(_version, self._packed_src)) == self._versions
            and list(map(_data_ptr, self._tensors)) == self._ptrs
        )

    def _build(self):
        """Take every address the step reads (packing weights through the modules' own
        :class:`~radixkv.models.ops.PackCache`, so ``packed_weight_bytes`` counts them)."""
        model, pool = self.model, self.kv_pool
        layers = model.model.layers
        a0 = layers[0].self_attn
        hidden = model.model.embed_tokens.weight.shape[1]
        tensors, packed_src, keep = [], [], []

        def direct(t: torch.Tensor | None, n: int) -> int:
            if t is None:
                return 0
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"DecodeStep: expected a float32 CPU vector of {n}, got {tuple(t.shape)} {t.dtype}")
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
                keep.append(t)
            tensors.append(t)
            return t.data_ptr()

        def packed(pack, w: torch.Tensor) -> int:
            pw = pack.get(w)
            keep.append(pw)
            packed_src.append(w)
            tensors.append(w)
            return pw.address

        table = []
        for layer in layers:
            sa, mlp = layer.self_attn, layer.mlp
            lid = sa.layer_id
            row = [
                direct(layer.input_layernorm.weight, hidden),
                direct(layer.post_attention_layernorm.weight, hidden),
                float(layer.input_layernorm.eps),
                float(layer.post_attention_layernorm.eps),
            ]
            for lin in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj):
                row += [packed(lin.pack, lin.weight), direct(lin.bias, lin.weight.shape[0])]
            row += self._pool_layer(lid)
            table.append(tuple(row))
        embed = model.model.embed_tokens.weight.detach()
        if not embed.is_contiguous():
            raise ValueError("DecodeStep: the embedding must be contiguous")
        tensors.append(embed)
        self._vocab = int(embed.shape[0])
        lm_head = packed(model.lm_head_pack, model.lm_head_weight())
        norm = model.model.norm
        r2t = self.req_to_token
        plan = cpu.step_plan(
            (model.num_layers, hidden, a0.num_heads, a0.num_kv_heads, a0.head_dim, layers[0].mlp.inter, self._vocab),
            tuple(table),
            embed.data_ptr(),
            direct(norm.weight, hidden),
            float(norm.eps),
            lm_head,
            r2t,
            pool.page_size,
            pool.num_slots,
            self.sm_scale,
            cpu.kv_dtype_name(pool.k_buffer[0].dtype),
        )
        self._plan, self._keep = plan, (keep, embed, r2t, pool)
        self._tensors, self._packed_src = tensors, packed_src
        self._ptrs = list(map(_data_ptr, tensors))
        self._versions = sum(map(_version, packed_src))
        self._epoch = weights_epoch()
        self._rope_len = 0
        return plan

    def _pool_layer(self, lid: int) -> list[int]:
        """Layer ``lid``'s pool addresses for the plan: K, V (``[pages, page_size, Hkv, D]`` in the
        pool's dtype) and, for an fp8 pool, its K and V scales (``[pages, page_size, Hkv]``
        bfloat16), else 0, 0."""
        pool = self.kv_pool
        k, v = pool.k_buffer[lid], pool.v_buffer[lid]
        k_scale, v_scale = (getattr(pool, name, None) for name in ("k_scale", "v_scale"))
        scales = (k_scale[lid], v_scale[lid]) if k_scale is not None else ()
        shape = (pool.num_pages, pool.page_size, pool.num_kv_heads)
        if not (k.is_contiguous() and v.is_contiguous() and all(t.is_contiguous() for t in scales)):
            raise ValueError("DecodeStep: the KV pool's buffers must be contiguous")
        if any(t.dtype != torch.bfloat16 or tuple(t.shape) != shape for t in scales):
            raise ValueError(f"DecodeStep: the KV pool's scales must be bfloat16 {shape}")
        return [k.data_ptr(), v.data_ptr(), *(t.data_ptr() for t in scales)] + [0, 0][len(scales) :]

    def _set_rope(self, need: int) -> None:
        """RoPE tables for positions ``0 .. n-1`` (``n >= need``, doubling, at most
        ``max_context_len``), computed once by the model's own rotary embedding."""
        n = min(self.max_ctx, max(need, 2 * self._rope_len, 256))
        cos, sin = self.model.model.rotary_emb(torch.arange(n), torch.float32)
        self._cos = cos.reshape(n, -1).contiguous()
        self._sin = sin.reshape(n, -1).contiguous()
        cpu.step_set_rope(self._plan, self._cos, self._sin)
        self._rope_len = n
