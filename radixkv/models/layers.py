"""Llama-family decoder over a flattened token batch (no padding), using the paged KV cache.

One module implements the architecture shared by Llama 2/3 (incl. ``llama3`` RoPE scaling),
SmolLM2, Qwen2 (bias on q/k/v) and Mistral: pre-norm decoder layers with RMSNorm, rotary position
embeddings (the "rotate half" form, Su et al. 2021, as in Hugging Face transformers), grouped-query
attention (Ainslie et al. 2023) through an :class:`~radixkv.attention.base.AttentionBackend`, and a
SwiGLU MLP (Shazeer 2020). Logits are computed only for the rows that will be sampled.

Weights use Hugging Face names (``model.layers.N.self_attn.q_proj.weight`` ...) at load time;
internally q/k/v and gate/up are fused into one matmul each (:meth:`CausalLM.load_weights` splits
the checkpoint tensors into the fused parameters).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from radixkv.attention.base import AttentionBackend
from radixkv.models import ops
from radixkv.models.ops import SMALL_M_ROWS, PackCache, apply_rope, linear

__all__ = [
    "CausalLM",
    "DecoderLayer",
    "Attention",
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "Linear",
    "config_head_dim",
    "weights_epoch",
    # re-exported from radixkv.models.ops, where they live
    "SMALL_M_ROWS",
    "PackCache",
    "apply_rope",
    "linear",
]


class _Tracked:
    """Mixin of radixkv's modules: every attribute assignment or deletion and every registration
    of a parameter, buffer or submodule after construction bumps :func:`weights_epoch`, so code
    that caches references to weights (the fused CPU decode step) knows when to look again."""

    _epoch = 0

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)
        _Tracked._epoch += 1

    def __delattr__(self, name) -> None:
        super().__delattr__(name)
        _Tracked._epoch += 1

    def register_buffer(self, *args, **kwargs) -> None:
        super().register_buffer(*args, **kwargs)
        _Tracked._epoch += 1

    def register_parameter(self, *args, **kwargs) -> None:
        super().register_parameter(*args, **kwargs)
        _Tracked._epoch += 1

    def add_module(self, *args, **kwargs) -> None:
        super().add_module(*args, **kwargs)
        _Tracked._epoch += 1


def weights_epoch() -> int:
    """A counter that changes whenever a parameter, buffer, submodule or attribute of a radixkv
    model module is assigned, deleted or registered (in-place edits of a tensor's values are not
    counted: they show in the tensor's ``_version``, or, through ``.data``, not at all: see
    :meth:`CausalLM.reset_packed_weights`)."""
    return _Tracked._epoch


class Linear(_Tracked, nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters and state dict), with its
    own packed-weight cache."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pack = PackCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.pack)


def config_head_dim(cfg) -> int:
    """``cfg.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


class RMSNorm(_Tracked, nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) computed in float32, as transformers does.

    ``norm(x)`` returns the normed ``x``. ``norm(x, residual)`` first forms ``residual + x`` (the
    decoder's skip connection) and returns ``(normed, new_residual)`` (:func:`ops.rms_norm`).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(_Tracked, nn.Module):
    """cos/sin of RoPE at arbitrary positions.

    The inverse frequencies and the attention scaling come from transformers'
    ``ROPE_INIT_FUNCTIONS`` for the config's ``rope_type`` (default, linear, llama3, yarn, ...), so
    every scaling variant matches the reference implementation; ``dynamic`` (NTK that changes
    with the sequence length) is rejected.
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(cfg, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "dynamic" or rope_type == "longrope":
            raise ValueError(f"rope_type {rope_type!r} is not supported (sequence-length dependent)")
        head_dim = config_head_dim(cfg)
        if rope_type == "default":
            base = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            # NOTE: on the CPU even while the model is built on the meta device (load_model):
            # transformers' functions move their arange to the device named, a meta tensor's
            # copy raised NotImplementedError ("Cannot copy out of meta tensor")
            with torch.device("cpu"):
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` int64 -> ``(cos, sin)`` each ``[T, 1, head_dim]`` of ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype).unsqueeze(1)
        sin = (emb.sin() * self.attention_scaling).to(dtype).unsqueeze(1)
        return cos, sin


class Attention(_Tracked, nn.Module):
    """Self-attention with fused q/k/v projection; KV handled by the attention backend."""

    def __init__(self, cfg, layer_id: int, qkv_bias: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = config_head_dim(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = qkv_bias or bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=bool(getattr(cfg, "attention_bias", False)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = ops.rope_qkv(self.qkv_proj(x), cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        o = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(_Tracked, nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, cfg) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {act!r}")
        self.inter = int(cfg.intermediate_size)
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(_Tracked, nn.Module):
    def __init__(self, cfg, layer_id: int, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, qkv_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos, sin, attn: AttentionBackend):
        """``h``: the previous layer's output delta (or the embeddings, with ``residual=None``).
        Returns ``(delta, residual)``; the hidden state after the layer is ``residual + delta``."""
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, attn), residual)
        return self.mlp(x), residual


class DecoderModel(_Tracked, nn.Module):
    def __init__(self, cfg, qkv_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, qkv_bias) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


_QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.(weight|bias)$")


class CausalLM(_Tracked, nn.Module):
    """A Llama-family causal LM over a flattened batch.

    Args:
        config: a transformers ``PretrainedConfig`` (Llama / Qwen2 / Mistral fields).

    ``forward(input_ids [T] int64, positions [T] int64, attn, logits_indices [S] int64)``
    returns float32 logits ``[S, vocab_size]``; ``attn`` must have been planned for the batch.
    """

    qkv_bias: bool = False

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.qkv_bias)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        attn0 = self.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.num_layers = len(self.model.layers)
        # set by radixkv.models.quantize.quantize_model: replaces the output projection
        self.logits_proj: nn.Module | None = None
        self.quantization: str | None = None
        self.pack_formats: tuple[str, ...] | None = None
        self.lm_head_pack = PackCache()

    def _packs(self) -> list[PackCache]:
        return [m.pack for m in self.modules() if isinstance(m, Linear)] + [self.lm_head_pack]

    def set_pack_formats(self, formats: tuple[str, ...] | None) -> None:
        """Choose the storage formats of the packed weight copies the native CPU GEMM reads
        (tried in order; None: :data:`radixkv.kernels.cpu.DEFAULT_PACK_FORMATS`); e.g. ``("f32",)``
        keeps plain float32 panels. Drops the packed copies built so far."""
        self.pack_formats = None if formats is None else tuple(formats)
        self.reset_packed_weights()

    def reset_packed_weights(self) -> None:
        """Drop every packed copy of the weights (:class:`PackCache`); the next decode-sized
        forward repacks them. Needed only after changing weights in place through ``.data``
        (``w.data.mul_(2)``), which torch does not count in the tensor's ``_version``; assignments,
        ``copy_`` / ``load_state_dict`` / :meth:`load_weights` are noticed on their own."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack = PackCache(self.pack_formats)
        self.lm_head_pack = PackCache(self.pack_formats)

    def packed_weight_bytes(self) -> dict[str, int]:
        """Bytes of the packed weight copies built so far (by the first decode-sized forward), by
        storage format (``"f32"``, ``"q4_1"``, ``"q8_0"``: :class:`~radixkv.kernels.cpu.PackedWeight`).
        Empty before that forward, or without the native kernels."""
        out: dict[str, int] = {}
        for pack in self._packs():
            if pack.packed is not None:
                out[pack.packed.format] = out.get(pack.packed.format, 0) + pack.packed.nbytes
        return out

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection's weight ``[vocab, hidden]`` (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(h [T, hidden], cos, sin)``: the token embeddings and RoPE's ``[T, 1, head_dim]``
        angles at ``positions``."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        return h, cos, sin

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend):
        """Every decoder layer over the embeddings ``h``; returns ``(delta, residual)`` (the
        hidden state is ``residual + delta``; ``residual`` is None without layers)."""
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, attn)
        return h, residual

    def compute_logits(
        self, delta: torch.Tensor, residual: torch.Tensor | None, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """Final norm and output projection of the rows ``logits_indices`` -> float32
        ``[S, vocab_size]``."""
        if residual is None:  # no decoder layers
            h = self.model.norm(delta[logits_indices])
        else:
            h, _ = self.model.norm(delta[logits_indices], residual[logits_indices])
        if self.logits_proj is not None:
            return self.logits_proj(h).float()
        return linear(h, self.lm_head_weight(), None, self.lm_head_pack).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        h, cos, sin = self.embed(input_ids, positions)
        delta, residual = self.run_layers(h, cos, sin, attn)
        return self.compute_logits(delta, residual, logits_indices)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Raises:
            ValueError: an unknown tensor name, a shape mismatch, or parameters left unset.
        """
        params = dict(self.named_parameters())
        unset = set(params)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_off = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the output projection
            m = _QKV.match(name)
            g = _GATE_UP.match(name)
            if m:
                target = f"model.layers.{m.group(1)}.self_attn.qkv_proj.{m.group(3)}"
                start, size = qkv_off[m.group(2)]
            elif g:
                target = f"model.layers.{g.group(1)}.mlp.gate_up_proj.{g.group(3)}"
                inter = self.model.layers[0].mlp.inter
                start, size = (0 if g.group(2) == "gate" else inter), inter
            else:
                target, start, size = name, None, None
            if target not in params:
                raise ValueError(f"load_weights: unexpected tensor {name!r}")
            dst = params[target] if start is None else params[target].narrow(0, start, size)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            unset.discard(target)
        if unset:
            raise ValueError(f"load_weights: parameters missing from the checkpoint: {sorted(unset)[:5]}")
