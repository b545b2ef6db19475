"""`EngineConfig`: every knob of the engine, with defaults resolved against the device and model."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Dict, Optional, Union

import torch

from radixkv.memory.fit import check_pool_fits
from radixkv.memory.kv_dtype import canonical_kv_dtype
from radixkv.spec.config import SpeculativeConfig, parse_speculative_config

PREFIX_CACHES = ("radix", "hash", "none")
EVICTION_POLICIES = ("lru", "lfu", "gdf", "reuse-odds")  # radixkv.cache.evict_policy (config stays a leaf)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")  # radixkv.attention.BACKEND_NAMES (config stays a leaf)
TIER_MEDIA = ("host", "disk", "remote")  # the KV tiers below the pool, in lookup order (docs/tiers.md)
TIER_WRITE_POLICIES = ("write_through", "write_back")
DEFAULT_WRITE_POLICY = {"host": "write_back", "disk": "write_through", "remote": "write_through"}
DEFAULT_DISK_CACHE_BYTES = 8 << 30
HASH_ALGOS = ("sha256", "builtin")  # radixkv.cache.hash_cache
QUANTIZATIONS = (None, "int8")  # radixkv.models.quantize.QUANTIZATION_METHODS
SEED_RANGE = (-(2**63), 2**63 - 1)  # as a request's (radixkv.sampling_params.SEED_RANGE)
DEVICE_TYPES = ("cpu", "cuda")


def default_context_len(max_position_embeddings: int, max_total_tokens: int) -> int:
    """The longest sequence when ``max_context_len`` is not given: the model's
    ``max_position_embeddings``, capped at the KV pool's capacity in tokens."""
    return min(int(max_position_embeddings), int(max_total_tokens))


DEFAULT_CPU_FLOAT32_TOKENS = 32768
"""The default pool on the CPU holds the bytes of this many float32 tokens of the model."""

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_memory_bytes(value: Union[int, str], field: str = "kv_cache_memory_bytes") -> int:
    """A memory size in bytes: an int, or a string of a number and an optional unit (B, KB, MB,
    GB, TB decimal; KiB, MiB, GiB, TiB binary; any case, spaces allowed): ``"2GiB"``,
    ``"512MiB"``, ``"1.5GB"``, ``"1000"``. Fractions are floored to whole bytes.

    Raises:
        ValueError: naming ``field``: anything else, or less than 1 byte.
    """
    n = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", value)
        if m is not None and m.group(2).lower() in _UNITS:
            try:
                n = int(Decimal(m.group(1)) * _UNITS[m.group(2).lower()])
            except InvalidOperation:
                n = None
    if n is None or n < 1:
        raise ValueError(
            f"{field} must be a number of bytes >= 1, as an int or a string like '2GiB', '512MiB', '1.5GB', "
            f"got {value!r}"
        )
    return n


def kv_tokens_for_bytes(memory_bytes: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Tokens of ``bytes_per_token`` each that ``memory_bytes`` holds, floored to whole pages."""
    tokens = int(memory_bytes) // int(bytes_per_token)
    return tokens - tokens % int(page_size)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _parse_device(device: object) -> torch.device:
    """``device`` ("cpu", "cuda", "cuda:N" or a ``torch.device`` of those) as a ``torch.device``.

    Raises:
        ValueError: naming ``device``: another type or string, a CUDA device without CUDA, or an
            index past the GPUs there are.
    """
    dev = None
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            dev = None
    if dev is None or dev.type not in DEVICE_TYPES:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


@dataclass
class EngineConfig:
    """Configuration of an :class:`~radixkv.engine.Engine` (and of ``LLM``, which takes the same names).

    Raises ``ValueError`` naming the field from :meth:`resolve` for any invalid value (at
    construction already for ``kv_cache_memory_bytes`` given with ``max_total_tokens``).
    """

    model: str = "smollm2-135m"
    """Model name or path (see :func:`radixkv.models.loader.load_model`)."""

    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N" (or such a ``torch.device``);
    anything else, CUDA where there is none, or N past the GPUs there are is a ValueError."""

    dtype: Union[str, torch.dtype] = "auto"
    """"auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16" (aliases "fp32",
    "float", "bf16", "fp16", "half"; any case) or one of those torch dtypes; anything else is a
    ValueError."""

    page_size: int = 1
    """Tokens per KV page (>= 1, at most the longest sequence: ``max_context_len``, else the model's
    ``max_position_embeddings``). Prefix matches are floored to whole pages when > 1."""

    max_total_tokens: Optional[int] = None
    """KV pool capacity in tokens (rounded down to whole pages). Give it or
    ``kv_cache_memory_bytes``, not both. Default (neither): on CPU the tokens that fit in the
    bytes 32,768 float32 tokens take (1.4 GiB for SmolLM2-135M: 32,768 float32 tokens, 65,536
    bfloat16 ones, 127,100 fp8 ones); on CUDA the tokens that fit in 40% of the free memory, at
    most 1M."""

    kv_cache_dtype: Union[str, torch.dtype] = "auto"
    """K/V storage dtype: "auto" (the model's compute dtype ``dtype``: float32 on CPU), "float32",
    "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2" or an alias ("fp32", "bf16", "fp16", "half",
    "fp8" = "fp8_e4m3"); the canonical name after :meth:`resolve`. fp8 keeps a bfloat16 scale per
    token and KV head (:mod:`radixkv.memory.kv_dtype`); attention reads K/V back in float32."""

    kv_cache_memory_bytes: Optional[Union[int, str]] = None
    """KV pool size in bytes (vLLM's name): an int or a string like "2GiB", "512MiB", "1.5GB"
    (:func:`parse_memory_bytes`); the pool holds ``bytes // kv_bytes_per_token`` tokens, whole
    pages. Giving it and ``max_total_tokens`` both is a ValueError."""

    max_context_len: Optional[int] = None
    """Longest sequence (prompt + output). Default: the model's max_position_embeddings, capped
    at max_total_tokens. More than max_position_embeddings is a ValueError; more than the pool is
    allowed (a request that could never fit the pool is refused, naming ``max_total_tokens``)."""

    prefix_cache: str = "radix"
    """"radix" (token-level radix tree), "hash" (vLLM-style chained block hashes) or "none"."""

    enable_prefix_caching: bool = True
    """False is the same as prefix_cache="none"."""

    eviction_policy: str = "lru"
    """Which leaf of the radix tree is evicted first (prefix_cache="radix"; always page by page
    from the leaf's tail): "lru", "lfu", "gdf" (GreedyDual-Frequency) or "reuse-odds"
    (:mod:`radixkv.cache.evict_policy`; measured in docs/benchmarks.md). SGLang's
    ``--radix-eviction-policy``. Another than "lru" with another prefix cache is a ValueError
    (that cache would ignore it)."""

    attention_backend: str = "auto"
    """"auto", "torch", "cpu" (native CPU kernels) or "flashinfer"; "auto" picks flashinfer on CUDA (a
    bfloat16 / float16 KV pool), cpu on an AVX2 CPU with a K/V dtype of
    ``radixkv.attention.CPU_AUTO_KV_DTYPES``, else torch. Another name, or "flashinfer" off CUDA,
    is a ValueError naming the field, before the model loads."""

    quantization: Optional[str] = None
    """None (exact weights) or "int8": CPU-only, lossy int8 linear layers for decode speed
    (see docs/model.md for its measured speed and accuracy)."""

    max_running_requests: Optional[int] = None
    """Requests admitted at once (rows of req_to_token). Default 64 on CPU, 256 on CUDA."""

    chunked_prefill_size: Optional[int] = None
    """Prefill token budget of one step; longer prompts are split. Default 2048 on CPU, 8192 on CUDA."""

    max_n: int = 128
    """Most samples one request may ask for (``SamplingParams.n``; OpenAI's own limit on ``n``).
    Default 128. ``Engine.add_request`` refuses more (a ``RequestError`` naming ``n``; the server
    answers 400), so that one request cannot occupy the whole engine."""

    max_queued_requests: Optional[int] = None
    """Most requests waiting for admission at once (accepted, not yet running: queued in the
    scheduler or compiling a grammar). Default None: no bound, as SGLang's
    ``--max-queued-requests`` and vLLM's engine (``LLM.generate`` of a long list of prompts queues
    them all); ``radixkv serve`` sets 1024 (``--max-queued-requests``). Beyond it
    ``Engine.add_request`` refuses a new request (:class:`~radixkv.errors.QueueFullError`, a
    ``RequestError`` naming ``max_queued_requests``; the server answers 429 ``queue_full``)."""

    max_queued_requests_per_tenant: Optional[int] = None
    """Most requests of one tenant (``Namespace.tenant``; every request without a tenant counts
    as one tenant) waiting for admission at once, so that one tenant cannot fill the whole queue
    and leave every other tenant with 429s. Default None: no per-tenant bound. Beyond it
    ``Engine.add_request`` refuses the tenant's new request (:class:`~radixkv.errors.QueueFullError`
    naming ``max_queued_requests_per_tenant``; the server answers 429 ``queue_full``) while other
    tenants are still accepted. ``radixkv serve --max-queued-requests-per-tenant``."""

    schedule_policy: str = "lpm"
    """"lpm" (longest cached prefix first, as SGLang) or "fcfs". Either way, when requests of
    several tenants wait, admission takes the tenants in turn (round robin, the tenant admitted
    longest ago first), each tenant's own requests in policy order."""

    seed: int = 0
    """Seed of the engine's generator, used by requests without their own seed: an integer in
    [-2**63, 2**63 - 1], as a request's ``SamplingParams.seed``."""

    hash_algo: str = "sha256"
    """Block hash of prefix_cache="hash" ("sha256" or "builtin"; "builtin" with another prefix
    cache is a ValueError: it would be ignored)."""

    cache_outcome: bool = True
    """Record why each request's prefix match stopped (``RequestOutput.cache_outcome``, the
    ``RequestAdmitted`` event, :mod:`radixkv.cache.outcome`); False skips it."""
    in_batch_prefix_sharing: bool = True
    """Requests admitted in the same step share the prefixes their rows compute in that forward
    (a prefix shared by requests waiting together is computed once). False: only what is cached
    when a request is admitted is shared (for comparisons)."""

    max_pinned_tokens: Optional[int] = None
    """Bound on the distinct KV tokens that sessions (and stored responses) keep pinned; past it
    the least recently used session of the tenant pinning the most is unpinned (its tokens stay
    cached, evictable). Default: half
    of max_total_tokens. 0 disables session pins."""

    pin_idle_timeout: Optional[float] = 600.0
    """Seconds after which a session pin unused that long is dropped (its tokens become evictable);
    None: never."""

    host_cache_bytes: Optional[Union[int, str]] = None
    """KV tier in host RAM below the pool (docs/tiers.md): its budget in bytes of stored blocks
    (an int or a string such as ``"4GiB"``, as ``kv_cache_memory_bytes``)
    (pinned host memory when the pool is on a GPU). None or 0: no host tier. More than the host
    memory available when the engine starts is a ValueError."""

    disk_cache_dir: Optional[str] = None
    """KV tier on local disk: a directory (created if missing; an unwritable one is a
    ``ValueError`` naming this field at start). Blocks persist across restarts and may be shared
    by several processes. None: no disk tier."""

    disk_cache_bytes: Union[int, str] = DEFAULT_DISK_CACHE_BYTES
    """Budget of the disk tier in bytes (an int or a string such as ``"20GB"``; default 8 GiB); the tier evicts its least recently used
    blocks beyond it."""

    remote_cache_url: Optional[str] = None
    """KV tier shared by engines on any machine: ``redis://[user:pass@]host:port/db`` or
    ``rediss://...`` (Redis or Valkey). A malformed URL is a ``ValueError`` naming this field; a
    server that is down is a miss (the tier is degraded, retried with backoff). None: none."""

    kv_tier_write_policy: Union[None, str, dict] = None
    """When computed blocks are written to the tiers: "write_through" (after they enter the pool)
    or "write_back" (when the pool evicts them); one value for every tier, or a dict per tier
    (``{"host": "write_back", "disk": "write_through"}``). Default: write-back for host,
    write-through for disk and remote (so restarts and other engines see blocks before eviction).
    Resolved into a dict with one entry per tier."""

    first_token_preemption: bool = False
    """With KV tiers: when a request that has produced no token yet cannot be admitted for lack
    of pool memory, sessions' soft pins give way, then running requests of its own tenant that
    have produced tokens are retracted to make room (the newest admitted first, each at most
    once). Their K/V stays in the prefix cache and reaches the tiers before the pool reuses it
    (written through, or back on eviction), so resuming loads it instead of recomputing it: the
    pool works as the tiers' swap space. It lowers time to first token under bursts at the cost
    of the retracted requests' latency; a retracted request waits only behind the requests that
    arrived before its retraction (under sustained overload that backlog can still make its
    latency larger than without it: docs/tiers.md). Default False. Without a tier (configured
    or ``tier_stores``) the engine refuses it (ValueError). ``--first-token-preemption``."""

    tenant_kv_quota_tokens: Optional[Dict[str, int]] = None
    """Soft KV quotas: tenant name (``Namespace.tenant``, set by the server from the API key) ->
    cached tokens. When the pool must evict, tenants holding more than their quota lose their
    least recently used pages first (:mod:`radixkv.cache.tenants`); nothing is refused. None: no
    quotas. ``radixkv serve --api-keys-file`` fills it from the keys' ``kv_quota_tokens``."""

    speculative_config: Optional[Union[dict, str, SpeculativeConfig]] = None
    """Speculative decoding without a draft model (vLLM's ``speculative_config``; docs/speculative.md):
    None (off, the default), or ``{"method": "radix" | "ngram", "num_speculative_tokens": k}``
    (k from 1 to 16; optional keys in :class:`~radixkv.spec.config.SpeculativeConfig`), as a dict,
    its JSON text or a ``SpeculativeConfig`` (what :meth:`resolve` leaves). Outputs are exactly
    those without it; decoding is faster where drafts are accepted."""

    def __post_init__(self) -> None:
        # Checked where the values are given: resolve() later fills max_total_tokens from the
        # memory, and a resolved config may be copied and resolved again.
        if self.kv_cache_memory_bytes is not None and self.max_total_tokens is not None:
            raise ValueError(
                f"give kv_cache_memory_bytes ({self.kv_cache_memory_bytes!r}) or max_total_tokens "
                f"({self.max_total_tokens!r}), not both"
            )

    def resolve(
        self,
        *,
        kv_bytes_per_token: Optional[int] = None,
        max_position_embeddings: Optional[int] = None,
        float32_kv_bytes_per_token: Optional[int] = None,
    ) -> "EngineConfig":
        """Validate and fill the "auto"/None defaults; returns self. Idempotent.

        Called once without arguments (device, dtype, ``kv_cache_dtype``, the memory string and
        every check that needs no model), then by the engine with the loaded model's facts,
        which fill ``max_total_tokens`` (from ``kv_bytes_per_token``, K+V bytes of one token in
        ``kv_cache_dtype``, scales included: ``KVPool.token_bytes``; and from
        ``float32_kv_bytes_per_token``, the same in float32, default ``kv_bytes_per_token``, for
        the CPU default) and ``max_context_len`` (capped at ``max_position_embeddings``).

        Raises:
            ValueError: naming the field and its limit.
        """
        self._resolve_device()
        if max_position_embeddings is not None:  # before the pool is sized from the page
            self._check_page_fits_context(int(max_position_embeddings))
        given = f"max_total_tokens {self.max_total_tokens}"
        if kv_bytes_per_token is not None and self.max_total_tokens is None:
            self.max_total_tokens = self._tokens_of_memory(
                int(kv_bytes_per_token), int(float32_kv_bytes_per_token or kv_bytes_per_token)
            )
            given = "the default KV pool"
        if self.kv_cache_memory_bytes is not None:
            given = f"kv_cache_memory_bytes {self.kv_cache_memory_bytes}"
        if self.max_total_tokens is not None:
            self.max_total_tokens -= self.max_total_tokens % self.page_size
            if self.max_pinned_tokens is None:
                self.max_pinned_tokens = self.max_total_tokens // 2
            if kv_bytes_per_token is not None:  # the engine's call, just before the pool is made
                check_pool_fits(self.max_total_tokens, int(kv_bytes_per_token), self.device, given)
        if max_position_embeddings is not None:
            if self.max_context_len is None:
                cap = self.max_total_tokens if self.max_total_tokens is not None else max_position_embeddings
                self.max_context_len = default_context_len(max_position_embeddings, cap)
            if self.max_context_len > max_position_embeddings:
                raise ValueError(
                    f"max_context_len {self.max_context_len} exceeds the model's "
                    f"max_position_embeddings {max_position_embeddings}"
                )
        return self

    def _check_page_fits_context(self, max_position_embeddings: int) -> None:
        """Refuse a page longer than the longest sequence (``max_context_len`` when given, else the
        model's ``max_position_embeddings``): no prompt would fill it, and only whole pages are
        cached, so the prefix cache would never hit (and the default pool would grow to hold it).

        Raises:
            ValueError: naming ``page_size`` and the limit.
        """
        longest, what = max_position_embeddings, "the model's max_position_embeddings"
        if self.max_context_len is not None and self.max_context_len < longest:
            longest, what = self.max_context_len, "max_context_len"
        if self.page_size > longest:
            raise ValueError(
                f"page_size {self.page_size} is larger than {what} {longest}, the longest sequence: no prompt "
                f"would fill a page and only whole pages are cached; give a page_size of at most {longest}"
            )

    def _tokens_of_memory(self, bytes_per_token: int, float32_bytes_per_token: int) -> int:
        """``max_total_tokens`` from ``kv_cache_memory_bytes``, or the default memory (the
        ``max_total_tokens`` docstring), at ``bytes_per_token``; whole pages.

        Raises:
            ValueError: ``kv_cache_memory_bytes`` holds less than one page.
        """
        if self.kv_cache_memory_bytes is None:
            return self.default_max_total_tokens(bytes_per_token, float32_bytes_per_token)
        tokens = kv_tokens_for_bytes(self.kv_cache_memory_bytes, bytes_per_token, self.page_size)
        if tokens < self.page_size:
            raise ValueError(
                f"kv_cache_memory_bytes {self.kv_cache_memory_bytes} holds no page: one page of {self.page_size} "
                f"tokens takes {self.page_size * bytes_per_token} bytes in {self.kv_cache_dtype} "
                f"({bytes_per_token} bytes per token)"
            )
        if tokens < 2:
            raise ValueError(
                f"kv_cache_memory_bytes {self.kv_cache_memory_bytes} holds {tokens} token of {bytes_per_token} bytes "
                f"in {self.kv_cache_dtype}; a request needs 2 (a prompt token and a generated one)"
            )
        return tokens

    def _resolve_device(self) -> None:
        if isinstance(self.device, str) and self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = _parse_device(self.device)
        if isinstance(self.dtype, str):
            key = self.dtype.strip().lower()  # as vLLM and kv_cache_dtype: "BF16" is bf16
            if key == "auto":
                self.dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
            elif key in _DTYPES:
                self.dtype = _DTYPES[key]
            else:
                raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.dtype not in set(_DTYPES.values()):
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)} (or their torch dtypes), got {self.dtype!r}"
            )
        self._check_plain_fields()
        self.kv_cache_dtype = canonical_kv_dtype(self.kv_cache_dtype, auto=self.dtype)
        self._resolve_memory()
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if not self.enable_prefix_caching:
            self.prefix_cache = "none"
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {PREFIX_CACHES}, got {self.prefix_cache!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if self.eviction_policy != "lru" and self.prefix_cache != "radix":  # the others would ignore it
            raise ValueError(
                f"eviction_policy={self.eviction_policy!r} applies to prefix_cache='radix' only, got "
                f"prefix_cache={self.prefix_cache!r} (the hash cache evicts LRU; none keeps nothing)"
            )
        if self.hash_algo != "sha256" and self.prefix_cache != "hash":
            raise ValueError(
                f"hash_algo={self.hash_algo!r} applies to prefix_cache='hash' only, got prefix_cache={self.prefix_cache!r}"
            )
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        cuda = dev.type == "cuda"
        if self.max_running_requests is None:
            self.max_running_requests = 256 if cuda else 64
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192 if cuda else 2048
        for name in ("max_running_requests", "chunked_prefill_size", "max_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        v = self.max_queued_requests
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"max_queued_requests must be None or an integer >= 0, got {v!r}")
        v = self.max_queued_requests_per_tenant
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"max_queued_requests_per_tenant must be None or an integer >= 1, got {v!r}")
        if self.max_total_tokens is not None and (
            not isinstance(self.max_total_tokens, int)
            or isinstance(self.max_total_tokens, bool)
            or self.max_total_tokens < self.page_size
        ):
            raise ValueError(
                f"max_total_tokens must be an integer >= page_size ({self.page_size}), got {self.max_total_tokens!r}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(
                f"max_total_tokens must be >= 2 (the slots of a prompt token and a generated one), "
                f"got {self.max_total_tokens}"
            )
        if self.max_context_len is not None and (not isinstance(self.max_context_len, int) or self.max_context_len < 2):
            raise ValueError(f"max_context_len must be an integer >= 2, got {self.max_context_len!r}")
        if self.max_pinned_tokens is not None and (
            not isinstance(self.max_pinned_tokens, int) or isinstance(self.max_pinned_tokens, bool)
            or self.max_pinned_tokens < 0
        ):  # fmt: skip
            raise ValueError(f"max_pinned_tokens must be an integer >= 0 or None, got {self.max_pinned_tokens!r}")
        t = self.pin_idle_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"pin_idle_timeout must be a number of seconds > 0 or None, got {t!r}")
        if not isinstance(self.in_batch_prefix_sharing, bool):
            raise ValueError(f"in_batch_prefix_sharing must be a bool, got {self.in_batch_prefix_sharing!r}")
        self.speculative_config = parse_speculative_config(self.speculative_config)
        q = self.tenant_kv_quota_tokens
        if q is not None and (
            not isinstance(q, dict)
            or not all(isinstance(k, str) and k and type(v) is int and v >= 0 for k, v in q.items())
        ):
            raise ValueError(f"tenant_kv_quota_tokens must map tenant names to ints >= 0, got {q!r}")
        self._resolve_tiers()

    def _check_plain_fields(self) -> None:
        """The fields nothing else checks: ``model``'s type, ``seed``, the bool switches, ``hash_algo``,
        ``attention_backend`` (flashinfer's device too) and ``quantization`` (its device and dtype
        too), before the model loads."""
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model).strip():
            raise ValueError(f"model must be a model name or path (a non-empty str), got {self.model!r}")
        s = self.seed
        if not isinstance(s, int) or isinstance(s, bool) or not SEED_RANGE[0] <= s <= SEED_RANGE[1]:
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {s!r}")
        for name in ("enable_prefix_caching", "cache_outcome"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:  # else the model runner refused it once the model loaded
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.attention_backend == "flashinfer" and torch.device(self.device).type != "cuda":
            raise ValueError(f"attention_backend 'flashinfer' needs a CUDA device, got device={self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization is not None and (torch.device(self.device).type != "cpu" or self.dtype != torch.float32):
            raise ValueError(
                f"quantization={self.quantization!r} needs device='cpu' and dtype float32, "
                f"got device={self.device!r}, dtype={self.dtype}"
            )

    def _resolve_tiers(self) -> None:
        """Check the KV tier fields (types and the write policy; the stores check the directory
        and the URL when they are built) and resolve ``kv_tier_write_policy`` into a dict."""
        for name in ("host_cache_bytes", "disk_cache_bytes"):
            v = getattr(self, name)
            if v is not None:  # as kv_cache_memory_bytes: an int or '64MiB' (0: no tier)
                setattr(self, name, parse_bytes(v, name))
        for name in ("disk_cache_dir", "remote_cache_url"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string or None, got {v!r}")
        if self.disk_cache_dir is not None and not self.disk_cache_bytes:
            raise ValueError("disk_cache_bytes must be > 0 when disk_cache_dir is set")
        if self.kv_tiers and self.prefix_cache == "none":  # before the model loads
            raise ValueError(
                "KV tiers (host_cache_bytes, disk_cache_dir, remote_cache_url) need a prefix cache: "
                "prefix_cache='none' keeps nothing"
            )
        named = self.kv_tier_write_policy if isinstance(self.kv_tier_write_policy, dict) else {}
        named = {} if isinstance(named, ResolvedWritePolicy) else named  # resolve() is idempotent
        if asks_write_back(self.kv_tier_write_policy) and self.kv_tiers and self.prefix_cache != "radix":
            raise write_back_refused(self.prefix_cache, self.kv_tier_write_policy)
        for tier in [t for t in named if t in TIER_MEDIA and t not in self.kv_tiers]:
            field = {"host": "host_cache_bytes", "disk": "disk_cache_dir", "remote": "remote_cache_url"}[tier]
            raise ValueError(f"kv_tier_write_policy names the {tier} tier, which is not configured (set {field})")
        self.kv_tier_write_policy = resolve_write_policy(self.kv_tier_write_policy)
        if not isinstance(self.first_token_preemption, bool):
            raise ValueError(f"first_token_preemption must be True or False, got {self.first_token_preemption!r}")

    @property
    def kv_tiers(self) -> tuple:
        """The KV tiers configured, in lookup order (some of ``TIER_MEDIA``)."""
        on = {"host": bool(self.host_cache_bytes), "disk": self.disk_cache_dir is not None}
        on["remote"] = self.remote_cache_url is not None
        return tuple(m for m in TIER_MEDIA if on[m])

    def _resolve_memory(self) -> None:
        """Parse ``kv_cache_memory_bytes`` (an int or a string) into bytes."""
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_memory_bytes(self.kv_cache_memory_bytes)

    def default_max_total_tokens(self, bytes_per_token: int, float32_bytes_per_token: Optional[int] = None) -> int:
        """The KV capacity used when neither ``max_total_tokens`` nor ``kv_cache_memory_bytes`` is
        given (see ``max_total_tokens``), at ``bytes_per_token`` per token (``kv_cache_dtype``)
        and ``float32_bytes_per_token`` (default ``bytes_per_token``) per float32 token."""
        if torch.device(self.device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch.device(self.device))
            return max(self.page_size, min(1 << 20, int(free * 0.4) // bytes_per_token))
        memory = DEFAULT_CPU_FLOAT32_TOKENS * int(float32_bytes_per_token or bytes_per_token)
        return max(self.page_size, memory // bytes_per_token)


class ResolvedWritePolicy(dict):
    """``kv_tier_write_policy`` once resolved: ``{tier: policy}`` for every tier of ``TIER_MEDIA``
    (a dict; the type tells a resolved policy from one a user wrote)."""


def asks_write_back(policy: object) -> bool:
    """Whether a ``kv_tier_write_policy`` as given (a str, or a dict of tier -> policy) names
    ``write_back``; False for a :class:`ResolvedWritePolicy`, whose defaults (host: write-back)
    nobody asked for (``resolve()`` is idempotent)."""
    if isinstance(policy, ResolvedWritePolicy):
        return False
    return policy == "write_back" or (isinstance(policy, dict) and "write_back" in policy.values())


def write_back_refused(prefix_cache: str, asked: object) -> ValueError:
    """The ValueError for an explicit ``write_back`` beside a prefix cache that does not report
    the blocks it evicts (``hash``): its tiers are written through (the engine's and the
    simulator's one message)."""
    return ValueError(
        f"kv_tier_write_policy write_back needs prefix_cache='radix' (the {prefix_cache!r} cache does not report "
        f"the blocks it evicts, so its tiers are written through); got {asked!r}"
    )


def parse_write_policy(text: str) -> Union[str, dict]:
    """The CLIs' ``--kv-tier-write-policy``: one policy for every tier, or ``tier=policy`` pairs
    separated by commas, or a JSON object as the field takes it (checked by
    :func:`resolve_write_policy`).

    Raises:
        ValueError: (naming ``kv_tier_write_policy``) malformed JSON, or a tier named twice.
    """
    if text.lstrip().startswith("{"):
        import json

        try:
            out = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_tier_write_policy: {text!r} is not a JSON object: {e}") from None
        if not isinstance(out, dict):
            raise ValueError(f"kv_tier_write_policy: {text!r} is not a JSON object")
        return out
    if "=" not in text:
        return text
    out = {}
    for part in text.split(","):
        tier, _, policy = part.partition("=")
        if tier.strip() in out:
            raise ValueError(f"kv_tier_write_policy: tier {tier.strip()!r} named twice in {text!r}")
        out[tier.strip()] = policy.strip()
    return out


def resolve_write_policy(policy: Union[None, str, dict]) -> dict:
    """``kv_tier_write_policy`` as ``{tier: policy}`` for every tier of ``TIER_MEDIA``: None gives
    the defaults (:data:`DEFAULT_WRITE_POLICY`), a str applies to every tier, a dict overrides
    the tiers it names.

    Raises:
        ValueError: (naming ``kv_tier_write_policy``) an unknown policy or tier.
    """
    out = ResolvedWritePolicy(DEFAULT_WRITE_POLICY)
    if policy is None:
        return out
    if isinstance(policy, str):
        policy = {m: policy for m in TIER_MEDIA}
    if not isinstance(policy, dict):
        raise ValueError(f"kv_tier_write_policy must be None, a str or a dict per tier, got {policy!r}")
    for tier, p in policy.items():
        if tier not in TIER_MEDIA:
            raise ValueError(f"kv_tier_write_policy: unknown tier {tier!r}; tiers are {TIER_MEDIA}")
        if p not in TIER_WRITE_POLICIES:
            raise ValueError(f"kv_tier_write_policy: {tier} must be one of {TIER_WRITE_POLICIES}, got {p!r}")
        out[tier] = p
    return out


def parse_bytes(text: Union[int, str], field: str = "bytes") -> int:
    """A byte budget as the CLIs take it: 0, or :func:`parse_memory_bytes`'s forms (``4GiB``,
    ``500MB``, ``1073741824``).

    Raises:
        ValueError: naming ``field``: not a byte count.
    """
    if (isinstance(text, str) and text.strip() == "0") or (type(text) is int and text == 0):
        return 0
    try:
        return parse_memory_bytes(text, field)
    except ValueError as e:  # 0 is taken here too: say so
        raise ValueError(str(e).replace("bytes >= 1,", "bytes >= 1 (or 0: none),", 1)) from None
