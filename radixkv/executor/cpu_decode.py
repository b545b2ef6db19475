"""The fused native CPU decode step: every decoder layer as one native call.

For a decode step most of a module-by-module forward is per-op dispatch and Python, not
arithmetic. When :func:`eligible` holds, :class:`~radixkv.executor.model_runner.ModelRunner`
runs :func:`forward` instead of the model's module path: the embeddings and the final norm and
logits come from the model as usual, and in between :func:`run_layers` calls
:data:`radixkv.kernels.cpu.decode_layer` once per layer: RMSNorm (fused with the residual add),
the packed q/k/v GEMM, RoPE, the K/V write to the pool, paged attention through the
:class:`~radixkv.attention.cpu_backend.CPUAttentionBackend`'s plan, the output projection, the
second RMSNorm, the packed gate|up GEMM, SiLU-and-multiply and the down projection, with the GIL
released and the threads kept busy. The arithmetic is that of the module path (same kernels);
tests/test_cpu_kernels.py and tests/test_models_tiny.py check the logits equal the module path's
and transformers'.

Not used (the module path runs instead) for prefill-sized batches, other dtypes or devices,
quantized models, or a batch the attention backend does not send entirely to its native kernel
(``AttentionBackend.native_plan()`` is None).
"""

from __future__ import annotations

import weakref

import torch

from radixkv.attention.base import AttentionBackend
from radixkv.kernels import cpu
from radixkv.models.layers import CausalLM, Linear, weights_epoch
from radixkv.models.ops import PACKED_MAX_ROWS

__all__ = ["eligible", "forward", "run_layers"]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def eligible(model: CausalLM, attn: AttentionBackend, num_tokens: int) -> bool:
    """Whether :func:`forward` may replace the module path for this forward pass of
    ``num_tokens`` new tokens (``attn`` already planned)."""
    if not (
        cpu.AVAILABLE
        and model.num_layers
        and 1 <= num_tokens <= PACKED_MAX_ROWS
        and model.logits_proj is None
        and not torch.is_grad_enabled()
    ):
        return False
    qkv = model.model.layers[0].self_attn.qkv_proj
    if not isinstance(qkv, Linear) or qkv.weight.device.type != "cpu" or qkv.weight.dtype != torch.float32:
        return False
    return attn.native_plan() is not None


class _LayerWeights:
    """References to one decoder layer's weight tensors and packed-weight caches, taken once
    through the modules' public attributes (an ``nn.Module`` attribute lookup costs about a
    microsecond; a decode step would do hundreds)."""

    __slots__ = ("layer_id", "norm_in", "norm_post", "eps", "linears")

    def __init__(self, layer) -> None:
        sa, mlp = layer.self_attn, layer.mlp
        self.layer_id = sa.layer_id
        self.norm_in = layer.input_layernorm.weight
        self.norm_post = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.linears = tuple(
            (lin.pack, lin.weight, lin.bias) for lin in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)
        )

    def args(self) -> tuple:
        """The ``decode_layer`` arguments that come from the weights: the two norm weights'
        addresses and eps, then (packed weight, bias) addresses of qkv, o, gate|up and down (each
        packed copy is rebuilt by its :class:`~radixkv.models.ops.PackCache` when its weight
        changed in place)."""
        args = [self.norm_in.data_ptr(), self.norm_post.data_ptr(), self.eps]
        for pack, w, b in self.linears:
            args += (pack.get(w).address, _ptr(b))
        return tuple(args)


_WEIGHTS: "weakref.WeakKeyDictionary[CausalLM, tuple]" = weakref.WeakKeyDictionary()


def _layer_weights(model: CausalLM) -> list[_LayerWeights]:
    """The model's :class:`_LayerWeights`, rebuilt when a module or weight was replaced
    (:func:`~radixkv.models.layers.weights_epoch` moved, or the layer list changed)."""
    layers = tuple(model.model.layers)
    cached = _WEIGHTS.get(model)
    if cached is None or cached[0] != weights_epoch() or cached[1] != layers:
        cached = (weights_epoch(), layers, [_LayerWeights(layer) for layer in layers])
        _WEIGHTS[model] = cached
    return cached[2]


def run_layers(model: CausalLM, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend):
    """All decoder layers over ``h`` ``[T, hidden]`` float32 (the embeddings); returns ``(delta,
    residual)`` like :meth:`CausalLM.run_layers` (the hidden state is ``residual + delta``).
    ``cos`` / ``sin`` ``[T, 1, head_dim]`` from the model's rotary embedding. Call only when
    :func:`eligible` holds."""
    meta, kv_indices, out_slots = attn.native_plan()
    t, hidden = h.shape
    a0 = model.model.layers[0].self_attn
    inter = model.model.layers[0].mlp.inter
    hq, hkv, d = a0.num_heads, a0.num_kv_heads, a0.head_dim
    residual = h.contiguous()  # the embeddings: this forward's own tensor, updated in place
    delta = torch.empty(t, hidden, dtype=torch.float32)
    x = torch.empty(t, hidden, dtype=torch.float32)
    qkv = torch.empty(t, (hq + 2 * hkv) * d, dtype=torch.float32)
    att = torch.empty(t, hq * d, dtype=torch.float32)
    gu = torch.empty(t, 2 * inter, dtype=torch.float32)
    act = torch.empty(t, inter, dtype=torch.float32)
    cos = cos.reshape(t, d).contiguous()
    sin = sin.reshape(t, d).contiguous()
    pool = attn.kv_pool
    nthreads = torch.get_num_threads()
    common = (
        hq,
        hkv,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        meta.data_ptr(),
        meta.shape[1],
        kv_indices.data_ptr(),
        attn.page_size,
    )
    bufs = (x.data_ptr(), qkv.data_ptr(), att.data_ptr(), gu.data_ptr(), act.data_ptr(), nthreads)
    dl, res, slots, tail = (
        delta.data_ptr(),
        residual.data_ptr(),
        out_slots.data_ptr(),
        (kv_indices.numel(), pool.num_pages),
    )
    # every call's arguments first: Python run between the kernels finds its objects evicted from
    # the caches by the kernels' streams, so keep that gap minimal (docs/model.md)
    calls = []
    for i, lw in enumerate(_layer_weights(model)):
        lid = lw.layer_id
        calls.append(
            (
                t,
                hidden,
                dl,
                int(i == 0),
                res,
                *lw.args(),
                inter,
                *common,
                pool.k_buffer[lid].data_ptr(),
                pool.v_buffer[lid].data_ptr(),
                slots,
                attn.sm_scale,
                *bufs,
                *tail,
            )
        )
    decode_layer = cpu.decode_layer
    for args in calls:
        decode_layer(*args)
    return delta, residual


def forward(
    model: CausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionBackend,
    logits_indices: torch.Tensor,
) -> torch.Tensor:
    """The model's forward with :func:`run_layers` in place of its module path: float32 logits
    ``[S, vocab_size]`` for ``logits_indices``. Call only when :func:`eligible` holds."""
    h, cos, sin = model.embed(input_ids, positions)
    delta, residual = run_layers(model, h, cos, sin, attn)
    return model.compute_logits(delta, residual, logits_indices)
