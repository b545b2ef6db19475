"""``radixkv plan``: how much KV memory a model and its traffic need.

KV bytes per token from a transformers config (a ``config.json``, a model radixkv loads, or an
entry of :data:`radixkv.obs.architectures.ARCHITECTURES`):

* MHA / GQA / MQA: ``layers x num_key_value_heads x head_dim x 2 (K and V) x dtype bytes``
  (``head_dim`` defaults to ``hidden_size // num_attention_heads``);
* MLA (DeepSeek-V2/V3: ``kv_lora_rank`` in the config): ``layers x (kv_lora_rank +
  qk_rope_head_dim) x dtype bytes``, the compressed latent and the decoupled RoPE key that
  vLLM and SGLang cache (DeepSeek-V2 paper, section 2.1, arXiv:2405.04434);
* sliding-window layers (``layer_types`` entries ``"sliding_attention"``, or every layer when
  ``sliding_window`` is set and ``use_sliding_window`` is not False, as Mistral-7B-v0.1) keep
  at most ``sliding_window`` tokens of a sequence, so a sequence of ``C`` tokens needs
  ``sum over layers of min(C, window) x per-layer bytes``;
* KV dtypes: float32 (4 bytes), bfloat16 / float16 (2), fp8 (e4m3 / e5m2, 1; scales ignored).

Beside these formulas, for a model radixkv itself loads (Llama / Qwen2 / Mistral, not MLA),
:func:`engine_bytes_per_token` gives what radixkv's own KV pool takes per token in that dtype
(``KVPool.token_bytes``: fp8 with its bfloat16 scale per token and KV head, and no sliding-window
saving, as the engine keeps every token): the bytes per token of a running radixkv engine, and
the bytes per token with which every answer below turns memory into tokens
(:func:`pool_bytes_per_token`; the formula's for a model radixkv does not load).

Answers: tokens that fit in a GPU's memory after the weights (``memory x fraction - weights``),
KV memory of one sequence of a given length, and, given a trace, the hit rate vs KV memory
curve for each simulator policy (:mod:`radixkv.sim`) and the least memory that reaches a target
hit rate. Activations, CUDA graphs and allocator fragmentation are not counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from radixkv.obs.architectures import ALIASES, ARCHITECTURES

__all__ = [
    "DTYPE_BYTES",
    "KVSpec",
    "dtype_bytes",
    "engine_bytes_per_token",
    "pool_bytes_per_token",
    "tier_block_bytes",
    "load_spec",
    "plan_memory",
    "hit_rate_curve",
    "memory_for_hit_rate",
    "pool_hit_rates",
    "GB",
]

GB = 10**9
"""Memory sizes are decimal gigabytes (as GPU vendors count them)."""

MAX_GB = 1_000_000
"""The largest ``gpu_memory_gb`` / ``weights_gb`` (``--gpu-memory`` / ``--weights-gb``): a
petabyte, far past any GPU, and still below 2**53 bytes, so that every byte count computed from
it in floating point is exact (``1e30`` printed a 39-digit token count with float noise in it)."""

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_bytes(dtype: str, what: str = "kv dtype") -> int:
    """Bytes of one element of ``dtype`` (a key of :data:`DTYPE_BYTES`); ValueError naming
    ``what`` otherwise."""
    key = str(dtype).lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"{what} must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[key]


@dataclass
class KVSpec:
    """What sizes a model's KV cache (module docstring).

    Attributes:
        name: a display name.
        attention: "MHA", "GQA", "MQA" or "MLA" (plus " + sliding window" when some layers are).
        num_layers: decoder layers.
        elems_per_layer: K+V elements one token needs in one layer (``2 x kv_heads x head_dim``,
            or ``kv_lora_rank + qk_rope_head_dim`` for MLA).
        windows: per layer, the sliding window in tokens, or None (full attention).
        num_parameters: weights, or None when unknown.
        source: where the facts come from.
        facts: the config fields used.
    """

    name: str
    attention: str
    num_layers: int
    elems_per_layer: int
    windows: list = field(default_factory=list)
    num_parameters: Optional[int] = None
    source: str = ""
    facts: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Any, name: str = "", source: str = "") -> "KVSpec":
        """From a transformers config object or a ``config.json`` dict.

        Raises:
            ValueError: a field the formula needs is missing, or one of :data:`CONFIG_INTS` is not
                an integer of at least its least value.
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        text = get("text_config")
        if text is not None and get("num_hidden_layers") is None:  # multimodal wrappers
            return cls.from_config(text if isinstance(text, dict) else text.to_dict(), name, source)
        for key, least in CONFIG_INTS.items():
            v = get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
                raise ValueError(f"config field {key} must be an integer >= {least}, got {v!r}")
        layers = get("num_hidden_layers")
        heads = get("num_attention_heads")
        if layers is None or (heads is None and get("kv_lora_rank") is None):
            raise ValueError("config needs num_hidden_layers and num_attention_heads (or kv_lora_rank for MLA)")
        facts: dict = {"num_hidden_layers": int(layers)}
        if get("kv_lora_rank"):
            rank, rope = int(get("kv_lora_rank")), int(get("qk_rope_head_dim") or 0)
            elems = rank + rope
            kind = "MLA"
            facts.update(kv_lora_rank=rank, qk_rope_head_dim=rope)
        else:
            kv_heads = int(get("num_key_value_heads") or heads)
            head_dim = get("head_dim") or int(get("hidden_size")) // int(heads)
            elems = 2 * kv_heads * int(head_dim)
            kind = "MHA" if kv_heads == heads else ("MQA" if kv_heads == 1 else "GQA")
            facts.update(num_attention_heads=int(heads), num_key_value_heads=kv_heads, head_dim=int(head_dim))
        for key in ("architectures", "model_type"):
            if get(key):
                facts[key] = list(get(key)) if key == "architectures" else str(get(key))
        windows: list = [None] * int(layers)
        sw = get("sliding_window")
        types = get("layer_types")
        if types:
            windows = [int(sw) if (t == "sliding_attention" and sw) else None for t in types]
        elif sw and get("use_sliding_window", True) is not False:
            windows = [int(sw)] * int(layers)
        if any(w is not None for w in windows):
            kind += " + sliding window"
            facts.update(sliding_window=int(sw), sliding_layers=sum(w is not None for w in windows))
        params = get("num_parameters")
        return cls(
            name or str(get("name") or get("_name_or_path") or get("model_type") or "model"),
            kind,
            int(layers),
            elems,
            windows,
            int(params) if params else None,
            source or str(get("source") or ""),
            facts,
        )

    def bytes_per_token(self, kv_dtype: str = "bfloat16") -> int:
        """KV bytes of one token in every layer (sliding windows not applied)."""
        return self.num_layers * self.elems_per_layer * dtype_bytes(kv_dtype)

    def sequence_bytes(self, context: int, kv_dtype: str = "bfloat16") -> int:
        """KV bytes of one sequence of ``context`` tokens (sliding-window layers keep at most
        their window)."""
        if context < 0:
            raise ValueError(f"context must be >= 0, got {context}")
        per = self.elems_per_layer * dtype_bytes(kv_dtype)
        return sum(min(context, w) if w is not None else context for w in self.windows) * per

    def weights_bytes(self, weight_dtype: str = "bfloat16") -> Optional[int]:
        """Bytes of the weights in ``weight_dtype`` (None when the parameter count is unknown)."""
        return None if self.num_parameters is None else self.num_parameters * dtype_bytes(weight_dtype, "weight dtype")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["windows"] = sorted({w for w in self.windows if w is not None})
        return d


_TORCH_FP8_NAMES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def engine_bytes_per_token(spec: KVSpec, kv_dtype: str = "bfloat16") -> Optional[int]:
    """K+V bytes per token of radixkv's own KV pool for ``spec`` in ``kv_dtype``
    (``KVPool.token_bytes``, fp8 scales included; module docstring), or None when radixkv does not
    load the model (MLA, or ``architectures`` / ``model_type`` outside
    :mod:`radixkv.models.registry`).

    Raises:
        ValueError: ``kv_dtype`` is not a K/V dtype (naming ``kv_cache_dtype``).
    """
    from types import SimpleNamespace

    from radixkv.memory.kv_pool import KVPool
    from radixkv.models.registry import get_model_class

    key = str(kv_dtype).lower().replace("torch.", "")
    dtype = _TORCH_FP8_NAMES.get(key, key)
    KVPool.token_bytes(1, 1, 1, dtype)  # an unknown dtype raises here, loadable model or not
    f = spec.facts
    if "num_key_value_heads" not in f:  # MLA
        return None
    if "architectures" in f or "model_type" in f:
        try:
            get_model_class(SimpleNamespace(architectures=f.get("architectures"), model_type=f.get("model_type")))
        except ValueError:
            return None
    return KVPool.token_bytes(spec.num_layers, f["num_key_value_heads"], f["head_dim"], dtype)


def pool_bytes_per_token(spec: KVSpec, kv_dtype: str = "bfloat16") -> int:
    """The bytes per token that turn a memory into tokens and back in plan's answers (what fits
    after the weights, the hit rate vs KV memory, the memory for a target): radixkv's own KV
    pool's (:func:`engine_bytes_per_token`, fp8 scales included, every token kept) for a model
    radixkv loads, so that ``--kv-cache-memory-bytes`` of the memory planned holds the tokens
    planned; the formula's (:meth:`KVSpec.bytes_per_token`) for another (MLA)."""
    e = engine_bytes_per_token(spec, kv_dtype)
    return spec.bytes_per_token(kv_dtype) if e is None else e


def tier_block_bytes(spec: KVSpec, kv_dtype: str = "bfloat16") -> dict:
    """``{medium: bytes}``: what one 16-token block takes in each KV tier (docs/tiers.md), the
    engine's record of it: its K/V (:func:`pool_bytes_per_token` each token), token ids and
    layout meta (the host tier's ``block_nbytes``; on disk and in Redis the codec's
    ``encoded_size``, header, padding and checksum included). For a model radixkv does not load,
    the K/V alone (its layout is unknown). A tier of ``b`` bytes holds ``b // bytes`` blocks."""
    from radixkv.cache.digests import BLOCK_TOKENS
    from radixkv.tiers import Block, block_nbytes, encoded_size

    bpt = pool_bytes_per_token(spec, kv_dtype)
    if engine_bytes_per_token(spec, kv_dtype) is None:
        return {m: BLOCK_TOKENS * bpt for m in ("host", "disk", "remote")}
    from radixkv.memory.kv_io import KVLayout
    from radixkv.memory.kv_pool import KVPool

    key = str(kv_dtype).lower().replace("torch.", "")
    f = spec.facts
    pool = KVPool(
        spec.num_layers, f["num_key_value_heads"], f["head_dim"], 1, kv_cache_dtype=_TORCH_FP8_NAMES.get(key, key)
    )
    sample = Block((0,) * BLOCK_TOKENS, bytes(BLOCK_TOKENS * bpt), KVLayout(pool).meta)
    rec = encoded_size(sample)
    return {"host": block_nbytes(sample), "disk": rec, "remote": rec}


CONFIG_INTS = {
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "vocab_size": 1,
    "kv_lora_rank": 0,
    "qk_rope_head_dim": 0,
    "sliding_window": 1,
    "num_parameters": 0,
}
"""The config fields the formulas read, and their least value (when present and not null)."""


def _estimate_parameters(cfg: dict) -> Optional[int]:
    """Llama-family parameter count from a config (embeddings, attention, SwiGLU MLP, norms);
    None for mixtures of experts and MLA, which need their model card."""
    try:
        if cfg.get("kv_lora_rank") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
            return None
        h, layers, inter = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or h // heads)
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    attn = h * heads * hd * 2 + h * kv * hd * 2
    if cfg.get("attention_bias"):
        attn += heads * hd + 2 * kv * hd + h
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return embed + layers * per_layer + h


def load_spec(model: str) -> KVSpec:
    """The :class:`KVSpec` of ``model``: a key (or alias) of the architecture table, a path to a
    ``config.json`` or to a directory holding one, or a model radixkv loads ("smollm2-135m").

    Raises:
        ValueError: unknown name, or a config without the needed fields.
    """
    key = ALIASES.get(model.lower(), model.lower())
    if key in ARCHITECTURES:
        facts = dict(ARCHITECTURES[key])
        return KVSpec.from_config(facts, facts["name"], facts["source"])
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a JSON config: {exc}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: a config must be a JSON object, got {type(cfg).__name__}")
        KVSpec.from_config(cfg, str(model), str(path))  # its fields checked before any arithmetic on them
        cfg.setdefault("num_parameters", _estimate_parameters(cfg))
        return KVSpec.from_config(cfg, str(model), str(path))
    raise ValueError(
        f"unknown model {model!r}: give one of {sorted(ARCHITECTURES)}, a config.json (or its directory), "
        "or a model radixkv loads"
    )


def plan_memory(
    spec: KVSpec,
    kv_dtype: str = "bfloat16",
    weight_dtype: str = "bfloat16",
    gpu_memory_gb: Optional[float] = None,
    memory_fraction: float = 0.9,
    weights_gb: Optional[float] = None,
    context: Optional[int] = None,
    page_size: int = 1,
    pool_tokens: Optional[int] = None,
    pool_bytes: Optional[int] = None,
) -> dict:
    """The static answers of ``radixkv plan`` as a JSON-ready dict.

    Args:
        spec: the model's :class:`KVSpec`.
        kv_dtype: KV cache dtype; ``weight_dtype``: weights dtype (for their size).
        gpu_memory_gb: the GPU's memory in GB (None: skip "tokens that fit").
        memory_fraction: share of it the server may use (vLLM's ``gpu_memory_utilization``).
        weights_gb: the weights' size in GB (default: parameters x ``weight_dtype`` bytes).
        context: a sequence length to size (None: skip).
        page_size: the engine's KV page size (``--page-size``): the tokens that fit are whole
            pages, as the engine's pool (:func:`radixkv.config.kv_tokens_for_bytes`).
        pool_tokens, pool_bytes: the engine's pool as its options size it (``max_total_tokens``
            or ``kv_cache_memory_bytes``, not both): ``out["pool"]`` its tokens (whole pages) and
            bytes, and the sequences of ``context`` it holds.

    Raises:
        ValueError: bad dtype, a fraction outside (0, 1], a size that is not a finite number
            (``gpu_memory_gb`` > 0, ``weights_gb`` >= 0) or one above :data:`MAX_GB`, or unknown
            weights with a GPU size.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    from radixkv.config import kv_tokens_for_bytes  # lazy: torch

    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1 (tokens), got {page_size!r}")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise ValueError(f"context must be an int >= 1 (tokens), got {context!r}")
    if gpu_memory_gb is not None and not (math.isfinite(gpu_memory_gb * GB) and gpu_memory_gb > 0):
        raise ValueError(f"gpu_memory_gb must be a finite number > 0 (GB), got {gpu_memory_gb!r}")
    if weights_gb is not None and not (math.isfinite(weights_gb * GB) and weights_gb >= 0):
        raise ValueError(f"weights_gb must be a finite number >= 0 (GB), got {weights_gb!r}")
    for name, flag, size in (
        ("gpu_memory_gb", "--gpu-memory", gpu_memory_gb),
        ("weights_gb", "--weights-gb", weights_gb),
    ):
        if size is not None and size > MAX_GB:
            raise ValueError(f"{name} ({flag}) must be at most {MAX_GB:,} GB (a petabyte), got {size!r}")
    dtype_bytes(weight_dtype, "weight dtype")
    bpt = spec.bytes_per_token(kv_dtype)
    out: dict = dict(
        model=spec.as_dict(),
        kv_dtype=kv_dtype,
        kv_bytes_per_token=bpt,
        kv_bytes_per_token_per_layer=spec.elems_per_layer * dtype_bytes(kv_dtype),
        engine_kv_bytes_per_token=engine_bytes_per_token(spec, kv_dtype),
    )
    if context is not None:
        seq = spec.sequence_bytes(context, kv_dtype)
        out["context"] = dict(tokens=context, kv_bytes=seq, kv_gb=seq / GB, full_attention_gb=context * bpt / GB)
    if gpu_memory_gb is not None:
        wb = int(weights_gb * GB) if weights_gb is not None else spec.weights_bytes(weight_dtype)
        if wb is None:
            raise ValueError(f"the parameter count of {spec.name} is unknown: give weights_gb (--weights-gb)")
        budget = int(gpu_memory_gb * GB * memory_fraction) - wb
        pool_bpt = out["engine_kv_bytes_per_token"]
        fit: dict = dict(
            gpu_memory_gb=gpu_memory_gb,
            memory_fraction=memory_fraction,
            weight_dtype=weight_dtype,
            weights_gb=wb / GB,
            kv_budget_gb=budget / GB,
            tokens=kv_tokens_for_bytes(max(0, budget), pool_bpt or bpt, page_size),  # every byte the pool allocates
            formula_tokens=max(0, budget) // bpt,
            page_size=page_size,
            weights_fit=budget > 0,
        )
        if context is not None and budget > 0:  # radixkv's pool keeps every token of a sequence
            seq = context * pool_bpt if pool_bpt else spec.sequence_bytes(context, kv_dtype)
            fit["sequences_of_context"] = budget // seq if seq else None
        out["fit"] = fit
    if pool_tokens is not None or pool_bytes is not None:
        out["pool"] = _pool(spec, kv_dtype, out["engine_kv_bytes_per_token"] or bpt, page_size, pool_tokens, pool_bytes)
        if context is not None:
            seq = context * out["engine_kv_bytes_per_token"] if out["engine_kv_bytes_per_token"] else None
            seq = seq or spec.sequence_bytes(context, kv_dtype)
            out["pool"]["sequences_of_context"] = out["pool"]["kv_bytes"] // seq if seq else None
    return out


def _pool(
    spec: KVSpec, kv_dtype: str, pool_bpt: int, page_size: int, tokens: Optional[int], nbytes: Optional[int]
) -> dict:
    """The engine's pool as ``max_total_tokens`` (``tokens``) or ``kv_cache_memory_bytes``
    (``nbytes``) sizes it: whole pages of ``pool_bpt`` bytes per token (EngineConfig.resolve)."""
    from radixkv.config import kv_tokens_for_bytes

    if tokens is not None and nbytes is not None:
        raise ValueError(
            f"give kv_cache_memory_bytes ({nbytes}) or max_total_tokens ({tokens}), not both "
            "(--kv-cache-memory-bytes, --max-total-tokens)"
        )
    for name, v in (("max_total_tokens", tokens), ("kv_cache_memory_bytes", nbytes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if tokens is not None:
        n = tokens - tokens % page_size
        given = "max_total_tokens"
    else:
        n = kv_tokens_for_bytes(nbytes, pool_bpt, page_size)
        given = "kv_cache_memory_bytes"
    if n < 1:
        raise ValueError(f"{given} {tokens if tokens is not None else nbytes} holds no page of {page_size} tokens")
    return dict(given=given, tokens=n, kv_bytes=n * pool_bpt, kv_gb=n * pool_bpt / GB, page_size=page_size)


def pool_hit_rates(requests: Sequence[Any], tokens: int, policies: Sequence[tuple[str, int]], tiers: Optional[dict] = None,
                   write_policy: Any = None) -> dict:  # fmt: skip
    """The replay's hit rate of ``requests`` in a pool of ``tokens`` (each policy's page-floored),
    ``{label: {"tokens", "hit_rate", "skipped"[, "hit_rate_tiers"]}}`` (``tiers``: tokens per
    medium, as :func:`hit_rate_curve` turns their bytes into)."""
    from radixkv.sim import simulate

    out: dict = {}
    for policy, ps in policies:
        cap = tokens - tokens % ps
        row: dict = dict(tokens=cap, hit_rate=None, skipped=len(requests))
        if cap >= ps:
            r = simulate(requests, policy, ps, cap, outcomes=False, keep_requests=False)
            row.update(hit_rate=r.hit_rate, skipped=r.skipped)
            if tiers and policy != "none":
                t = simulate(requests, policy, ps, cap, outcomes=False, keep_requests=False, tiers=tiers,
                             tier_write_policy=write_policy)  # fmt: skip
                row["hit_rate_tiers"] = t.hit_rate
        out[_label(policy, ps)] = row
    return out


def _label(policy: str, page_size: int) -> str:
    """The benchmarks' policy names: ``radix-p16``, ``hash-b16``."""
    return f"{policy}-{'b' if policy == 'hash' else 'p'}{page_size}"


def hit_rate_curve(
    requests: Sequence[Any],
    spec: KVSpec,
    kv_dtype: str = "bfloat16",
    policies: Sequence[tuple[str, int]] = (("radix", 1), ("radix", 16), ("hash", 16)),
    points: int = 12,
    tiers: Optional[dict] = None,
    write_policy: Any = None,
) -> dict:
    """Hit rate vs KV memory of ``requests`` (:class:`~radixkv.sim.SimRequest`) for each
    ``(policy, page_size)``: capacities from 1% of the working set (the tokens an infinite
    token-level cache holds at the end) to all of it, on a log scale.

    Args:
        tiers: KV tiers below the pool, ``{medium: capacity in bytes}`` (``host``, ``disk``,
            ``remote``; docs/tiers.md): each row also gets the hit rate with them
            (``hit_rate_tiers``, :mod:`radixkv.sim.tiers`), each holding the whole blocks the
            engine's tier of those bytes holds (:func:`tier_block_bytes`); ``write_policy``
            theirs, as ``EngineConfig.kv_tier_write_policy`` (None: the engine's defaults).

    Returns:
        ``{"working_set_tokens", "infinite": {label: hit rate}, "curves": {label: [{"tokens",
        "kv_gb", "hit_rate", "skipped"[, "hit_rate_tiers"]}, ...]}[, "tiers": {medium: {"bytes",
        "tokens"}}]}`` with labels like ``radix-p16``, ``hash-b16``; ``skipped``: the requests
        too large for that pool (the engine refuses them; the hit rate counts the others).
    """
    from radixkv.cache.digests import BLOCK_TOKENS
    from radixkv.sim import simulate

    bpt = pool_bytes_per_token(spec, kv_dtype)
    inf = simulate(requests, "radix", 1, None, outcomes=False, keep_requests=False)
    ws = max(16, inf.cache_tokens_end)
    caps = sorted({max(16, int(ws * 10 ** (-2 + 2 * i / max(1, points - 1)))) for i in range(points)})
    curves: dict = {}
    infinite: dict = {}
    per_block = tier_block_bytes(spec, kv_dtype) if tiers else {}
    tier_tokens = {m: int(b) // per_block[m] * BLOCK_TOKENS for m, b in (tiers or {}).items() if b}  # whole blocks
    for policy, ps in policies:
        label = _label(policy, ps)
        infinite[label] = simulate(requests, policy, ps, None, outcomes=False, keep_requests=False).hit_rate
        rows = []
        for cap in caps:
            cap = max(ps, cap - cap % ps)
            r = simulate(requests, policy, ps, cap, outcomes=False, keep_requests=False)
            rows.append(dict(tokens=cap, kv_gb=cap * bpt / GB, hit_rate=r.hit_rate, skipped=r.skipped))
            if tier_tokens and policy != "none":
                t = simulate(
                    requests, policy, ps, cap, outcomes=False, keep_requests=False, tiers=tier_tokens,
                    tier_write_policy=write_policy,
                )  # fmt: skip
                rows[-1]["hit_rate_tiers"] = t.hit_rate
        curves[label] = rows
    out = dict(working_set_tokens=ws, kv_bytes_per_token=bpt, infinite=infinite, curves=curves)
    if tier_tokens:
        out["tiers"] = {m: dict(bytes=int(tiers[m]), tokens=t) for m, t in tier_tokens.items()}
    return out


def memory_for_hit_rate(
    requests: Sequence[Any], spec: KVSpec, target: float, kv_dtype: str = "bfloat16", policy: str = "radix",
    page_size: int = 1, tolerance: float = 0.02,
) -> dict:  # fmt: skip
    """The least KV memory whose replay of ``requests`` reaches hit rate ``target`` (a
    bisection over capacities, to ``tolerance`` relative; the hit rate of LRU caches grows
    with capacity in practice, not by a theorem, so the answer is the smallest capacity found
    that reaches it). Only a memory that holds every request is an answer: below the largest
    request (:func:`radixkv.sim.capacity_needed`) the engine refuses it, and the hit rate of the
    requests left says nothing about the trace.

    Returns:
        ``{"target", "reachable", "tokens", "kv_gb", "hit_rate", "infinite_hit_rate"}``;
        ``reachable`` is False when even infinite memory stays below ``target``.
    """
    from radixkv.sim import capacity_bound, capacity_needed, simulate

    if not 0 <= target <= 1:
        raise ValueError(f"target hit rate must be in [0, 1], got {target}")
    bpt = pool_bytes_per_token(spec, kv_dtype)
    hi = capacity_bound(requests, page_size)
    best = simulate(requests, policy, page_size, hi, outcomes=False, keep_requests=False)
    out = dict(target=target, policy=_label(policy, page_size), infinite_hit_rate=best.hit_rate)
    if best.hit_rate < target:
        return dict(out, reachable=False, tokens=None, kv_gb=None, hit_rate=None)
    lo = capacity_needed(requests, page_size) - page_size  # too small for the largest request
    hi_rate = best.hit_rate
    while hi - lo > max(page_size, int(hi * tolerance)):
        mid = (lo + hi) // 2
        mid = max(lo + page_size, mid - mid % page_size)
        if mid >= hi:
            break
        r = simulate(requests, policy, page_size, mid, outcomes=False, keep_requests=False)
        if r.hit_rate >= target:
            hi, hi_rate = mid, r.hit_rate
        else:
            lo = mid
    return dict(out, reachable=True, tokens=hi, kv_gb=hi * bpt / GB, hit_rate=hi_rate)


def format_bytes(n: float) -> str:
    """``n`` bytes as B / KB / MB / GB (decimal)."""
    for unit, size in (("GB", GB), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
