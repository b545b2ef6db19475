"""Decoder layers as one native call each, for decode-sized float32 batches on the CPU.

:class:`~radixkv.models.layers.CausalLM` runs its layers through torch modules; for a decode step
most of that time is per-op dispatch and Python, not arithmetic. When :func:`eligible` holds, the
model instead calls ``radixkv._ckernels.decode_layer`` once per layer: RMSNorm (fused with the
residual add), the packed q/k/v GEMM, RoPE, the K/V write to the pool, paged attention through
the :class:`~radixkv.attention.cpu_backend.CPUAttentionBackend`'s plan, the output projection,
the second RMSNorm, the packed gate|up GEMM, SiLU-and-multiply and the down projection, with the
GIL released and the two threads kept busy. The arithmetic is that of the module path (same
kernels: :mod:`radixkv.cpu_kernels`); tests/test_cpu_kernels.py checks the logits equal the
module path's and transformers'.

Not used (the module path runs instead) for prefill-sized batches, other dtypes or devices,
quantized models, a backend that is not the native CPU one, or a batch the backend does not send
entirely to its native kernel.
"""

from __future__ import annotations

import torch

from radixkv import cpu_kernels
from radixkv.attention.base import AttentionBackend
from radixkv.attention.cpu_backend import CPUAttentionBackend


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def eligible(model, attn: AttentionBackend, num_tokens: int, dtype: torch.dtype) -> bool:
    """Whether :func:`run_layers` may replace the module path for this forward pass."""
    from radixkv.models.layers import PACKED_MAX_ROWS, Linear

    if not (
        cpu_kernels.AVAILABLE
        and isinstance(attn, CPUAttentionBackend)
        and 1 <= num_tokens <= PACKED_MAX_ROWS
        and dtype == torch.float32
        and model.logits_proj is None
        and not torch.is_grad_enabled()
    ):
        return False
    layer = model.model.layers[0]
    if not isinstance(layer.self_attn.qkv_proj, Linear) or layer.self_attn.qkv_proj.weight.device.type != "cpu":
        return False
    return attn.native_plan() is not None


def _weight_args(layer) -> tuple:
    """The ``decode_layer`` arguments that come from one layer's weights: the two norm weights'
    addresses and eps, then (packed weight, bias) addresses of qkv, o, gate|up and down. Reads the
    modules' ``_modules`` / ``_parameters`` dicts directly: ``nn.Module.__getattr__`` costs ~1 us
    a lookup, which was ~1.7 ms of Python per decode step over 30 layers."""
    m = layer._modules
    sa, mlp, n_in = m["self_attn"]._modules, m["mlp"]._modules, m["input_layernorm"]
    args = [_tensor(n_in, "weight").data_ptr(), _tensor(m["post_attention_layernorm"], "weight").data_ptr(), n_in.eps]
    for lin in (sa["qkv_proj"], sa["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]):
        args += (lin.pack.get(_tensor(lin, "weight")).address, _ptr(_tensor(lin, "bias")))
    return tuple(args)


def _tensor(mod: torch.nn.Module, name: str) -> torch.Tensor | None:
    """``mod.<name>``, from the parameters dict when it is a parameter (the fast path), else
    through ``getattr`` (a weight registered as a buffer or a plain attribute)."""
    params = mod._parameters
    return params[name] if name in params else getattr(mod, name)


def run_layers(model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: CPUAttentionBackend):
    """All decoder layers over ``h`` ``[T, hidden]`` (the embeddings); returns ``(delta,
    residual)`` like the module path (the hidden state is ``residual + delta``). ``cos`` / ``sin``
    ``[T, 1, head_dim]`` from the model's rotary embedding. Call only when :func:`eligible`."""
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
    # the caches by the kernels' streams (~100 us a layer measured), so keep that gap minimal
    calls = []
    for i, layer in enumerate(model.model.layers):
        lid = layer._modules["self_attn"].layer_id
        calls.append(
            (
                t,
                hidden,
                dl,
                int(i == 0),
                res,
                *_weight_args(layer),
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
    decode_layer = cpu_kernels._ck.decode_layer
    for args in calls:
        decode_layer(*args)
    return delta, residual
