"""Opt-in int8 weight quantization of the linear layers, for CPU decode speed.

On a CPU, a decode step is bound by the GEMMs over all the weights (135M parameters for
SmolLM2-135M) for only a few rows of activations, and float32 GEMM throughput caps it
(docs/model.md); int8 arithmetic does more per cycle. ``quantize_model(model, "int8")``
replaces every decoder projection (fused q/k/v, o, fused gate/up, down) and the output
projection (``lm_head``, or the tied embedding matrix) by :class:`Int8DynamicLinear`: weights
stored as int8, symmetric, one scale per output channel; activations scaled per token row to
max |x| = 1, then quantized per call to 7-bit unsigned integers (the "dynamic quantization" of
Jacob et al. 2018 as implemented by PyTorch's FBGEMM ``quantized::linear_dynamic``);
accumulation in int32, output float32.
Embedding lookup, norms, RoPE and attention stay float32, as does the KV cache.

This is lossy: on the default model the mean |logit - fp32 logit| is 1.4-1.9 (max 9-18) and
greedy output can differ from float32's from the first token (measured in
``tests/test_quantization.py``, see docs/model.md), so it is off by default and the exactness
tests use float32.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS = (None, "int8")


class Int8DynamicLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored int8 per output channel, run by FBGEMM (CPU only).

    Args:
        weight: ``[out_features, in_features]`` float tensor (quantized here: scale
            ``max|W[o, :]| / 127`` per row ``o``, zero point 0).
        bias: ``[out_features]`` float tensor or None (kept float32).

    ``forward(x [..., in_features] float32) -> [..., out_features] float32``.

    Raises:
        ValueError: ``weight`` is not 2-D or not on the CPU.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(
                f"Int8DynamicLinear: weight must be a 2-D CPU tensor, got {tuple(weight.shape)} on {weight.device}"
            )
        w = weight.detach().float().contiguous()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero = torch.zeros(self.out_features, dtype=torch.int64)
        qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        b = None if bias is None else bias.detach().float().contiguous()
        self._packed = torch.ops.quantized.linear_prepack(qw, None)
        self.register_buffer("_bias", b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        # per-token activation scale: FBGEMM quantizes its input with one scale per call, so each
        # row is first brought to max|x| = 1 and its output scaled back (the layer is linear).
        s = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        # reduce_range=True: 7-bit activations, required by FBGEMM's AVX2 kernels to avoid overflow
        y = torch.ops.quantized.linear_dynamic(x2 / s, self._packed, True) * s
        if self._bias is not None:
            y = y + self._bias
        return y.view(*shape[:-1], self.out_features)

    def packed_tensors(self) -> dict:
        """The int8 weights FBGEMM holds packed, outside the ``state_dict``: ``{"weight": int8
        [out, in], "scale": float64 [out]}`` (what :func:`radixkv.models.fingerprint.weights_digest`
        hashes, so int8 models of other weights never share KV blocks)."""
        qw, _ = torch.ops.quantized.linear_unpack(self._packed)
        return {"weight": qw.int_repr(), "scale": qw.q_per_channel_scales()}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _linear_to_int8(lin: nn.Linear) -> Int8DynamicLinear:
    return Int8DynamicLinear(lin.weight, lin.bias)


@torch.no_grad()
def quantize_model(model, method: str | None):
    """Quantize ``model`` (a :class:`~radixkv.models.layers.CausalLM`) in place and return it.

    Args:
        model: a float32 model on the CPU.
        method: ``None`` (no change) or ``"int8"`` (see the module docstring).

    Raises:
        ValueError: unknown ``method``, or a model that is not float32 on the CPU.
    """
    if method is None:
        return model
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
    p = model.model.embed_tokens.weight
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"quantization={method!r} needs a float32 CPU model (FBGEMM), got {p.dtype} on {p.device}")
    for layer in model.model.layers:
        layer.self_attn.qkv_proj = _linear_to_int8(layer.self_attn.qkv_proj)
        layer.self_attn.o_proj = _linear_to_int8(layer.self_attn.o_proj)
        layer.mlp.gate_up_proj = _linear_to_int8(layer.mlp.gate_up_proj)
        layer.mlp.down_proj = _linear_to_int8(layer.mlp.down_proj)
    model.logits_proj = Int8DynamicLinear(model.lm_head_weight())
    model.quantization = method
    return model
