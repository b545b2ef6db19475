"""ModelRunner: one model, its KV pool, its block table and its attention backend.

The engine builds one runner and, every step, a :class:`~radixkv.attention.metadata.ForwardBatch`
(through :meth:`ModelRunner.build_batch` after writing the requests' slots into
``runner.req_to_token_pool.req_to_token``), then calls :meth:`ModelRunner.forward` to get the
logits of the rows it samples.
"""

from __future__ import annotations

import logging
from itertools import accumulate
from typing import Any, Sequence, Union

import torch

from radixkv.attention import AttentionBackend, ForwardBatch, create_attention_backend
from radixkv.config import default_context_len
from radixkv.executor import cpu_decode, row_split
from radixkv.kernels import cpu
from radixkv.memory.kv_dtype import canonical_kv_dtype
from radixkv.memory.kv_pool import KVPool, ReqToTokenPool
from radixkv.models.layers import CausalLM
from radixkv.models.quantize import quantize_model
from radixkv.models.registry import sliding_window_limit

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs forward passes of a :class:`~radixkv.models.layers.CausalLM` over a paged KV pool.

    Args:
        model: a ``CausalLM`` or a :class:`~radixkv.models.loader.LoadedModel` (its model and
            config are used).
        hf_config: the transformers config; default ``model.config``.
        num_slots: KV capacity in tokens (multiple of ``page_size``); required unless ``kv_pool``.
        page_size: tokens per KV page.
        max_running_requests: rows of the block table (requests in flight at once).
        max_context_len: longest sequence (prompt + output) a request may reach; default
            ``min(max_position_embeddings, num_slots)``. The block table's rows are that rounded up
            to whole pages (a sequence ending in a partial page holds the whole page).
        device, dtype: where and in what precision the model and the KV pool live; default the
            model's. The model is moved/cast when they differ.
        attention_backend: ``"auto"``, ``"torch"``, ``"cpu"``, ``"flashinfer"`` or an
            :class:`~radixkv.attention.base.AttentionBackend` built for ``kv_pool``.
        kv_pool: use this pool instead of allocating one.
        quantization: ``None`` (default) or ``"int8"``: quantize the model's linear layers in place
            (:func:`radixkv.models.quantize.quantize_model`; CPU float32 only, lossy, faster
            decode). A model that is already quantized is left as it is.
        kv_cache_dtype: the new pool's K/V dtype (a name of :mod:`radixkv.memory.kv_dtype` or a
            torch dtype); default (None or ``"auto"``): ``dtype``.

    For the positional form of the architecture contract, ``ModelRunner(model, kv_pool,
    attention_backend)`` is accepted too.

    Attributes:
        model, hf_config, kv_pool, req_to_token_pool, attn_backend, device, dtype, page_size,
        max_context_len, vocab_size.

    Raises:
        ValueError: missing/invalid sizes, a pool that does not fit the model, or
            ``max_context_len`` above the model's sliding window (not implemented: attention
            here is always full causal).
    """

    def __init__(
        self,
        model: Any,
        hf_config: Any = None,
        num_slots: int | None = None,
        page_size: int = 1,
        max_running_requests: int = 256,
        max_context_len: int | None = None,
        device: Union[str, torch.device, None] = None,
        dtype: torch.dtype | None = None,
        attention_backend: Union[str, AttentionBackend] = "auto",
        kv_pool: KVPool | None = None,
        quantization: str | None = None,
        kv_cache_dtype: Union[str, torch.dtype, None] = None,
    ) -> None:
        if isinstance(hf_config, KVPool):  # contract form ModelRunner(model, kv_pool, backend)
            kv_pool, hf_config = hf_config, None
            if isinstance(num_slots, (str, AttentionBackend)):
                attention_backend, num_slots = num_slots, None
        if hasattr(model, "model") and hasattr(model, "hf_config") and not isinstance(model, CausalLM):
            hf_config = hf_config if hf_config is not None else model.hf_config
            model = model.model
        if not isinstance(model, CausalLM):
            raise ValueError(
                f"ModelRunner: model must be a radixkv CausalLM or LoadedModel, got {type(model).__name__}"
            )
        self.hf_config = hf_config if hf_config is not None else model.config
        self.model = self._place_model(model, device, dtype, quantization)
        self.kv_pool = kv_pool = self._make_kv_pool(self.model, kv_pool, num_slots, page_size, kv_cache_dtype)
        self.page_size = kv_pool.page_size
        self.max_context_len = self._context_len(max_context_len, kv_pool.num_slots)
        # NOTE: rows are whole pages wide: a sequence reaching into the context's last, partial page
        # holds that whole page (the allocator hands out whole pages), so its slots need columns
        width = -(-self.max_context_len // self.page_size) * self.page_size
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, width, self.device)
        self.attn_backend = self._make_backend(attention_backend, kv_pool, self.model.num_heads)
        self.vocab_size = int(self.hf_config.vocab_size)
        # the fused native decode step (one call a forward) when the backend and the model allow it
        self.decode_step: cpu_decode.DecodeStep | None = None
        if self.attn_backend.name == "cpu" and cpu_decode.model_supported(self.model) is None:
            self.decode_step = cpu_decode.DecodeStep(
                self.model, kv_pool, self.req_to_token_pool.req_to_token, self.attn_backend.sm_scale
            )
        # decode rows give their one-row bits in any batch (row_split): a float32 CPU model on the kernels
        self.row_exact = (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and cpu.AVAILABLE
            and self.model.quantization is None
        )
        logger.info(
            "ModelRunner: %d layers, %d slots (page_size %d, %s K/V, %d bytes/token, %.1f MiB KV), backend %s",
            self.model.num_layers,
            kv_pool.num_slots,
            kv_pool.page_size,
            kv_pool.kv_cache_dtype,
            kv_pool.bytes_per_token,
            kv_pool.total_bytes / 2**20,
            self.attn_backend.name,
        )

    def _place_model(
        self,
        model: CausalLM,
        device: Union[str, torch.device, None],
        dtype: torch.dtype | None,
        quantization: str | None,
    ) -> CausalLM:
        """Set :attr:`device` / :attr:`dtype` (default the model's), move or cast ``model`` there,
        quantize it when asked; returns it in eval mode.

        Raises:
            ValueError: a quantized model asked to move or change dtype, or ``quantization`` off
                CPU float32.
        """
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype if dtype is not None else param.dtype
        if model.quantization is not None and (param.device != self.device or param.dtype != self.dtype):
            raise ValueError(
                f"ModelRunner: a {model.quantization} quantized model stays on {param.device} in {param.dtype}; "
                f"got device={self.device}, dtype={self.dtype}"
            )
        if param.device != self.device or param.dtype != self.dtype:
            model = model.to(device=self.device, dtype=self.dtype)
        if quantization is not None and model.quantization != quantization:
            if self.device.type != "cpu" or self.dtype != torch.float32:
                raise ValueError(
                    f"ModelRunner: quantization={quantization!r} needs device='cpu' and dtype=torch.float32"
                )
            quantize_model(model, quantization)
        return model.eval()

    def _make_kv_pool(
        self,
        model: CausalLM,
        kv_pool: KVPool | None,
        num_slots: int | None,
        page_size: int,
        kv_cache_dtype: Union[str, torch.dtype, None],
    ) -> KVPool:
        """A new :class:`~radixkv.memory.kv_pool.KVPool` of ``num_slots`` in ``kv_cache_dtype``
        (default the model's dtype) for ``model``, or the given one checked against it.

        Raises:
            ValueError: no pool and no ``num_slots``, a pool whose shape does not fit the model,
                or an unknown ``kv_cache_dtype``.
        """
        if kv_pool is None:
            if num_slots is None:
                raise ValueError("ModelRunner: num_slots is required when no kv_pool is given")
            return KVPool(
                model.num_layers,
                model.num_kv_heads,
                model.head_dim,
                int(num_slots),
                page_size,
                canonical_kv_dtype(kv_cache_dtype if kv_cache_dtype is not None else "auto", auto=self.dtype),
                self.device,
            )
        shape = (kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim)
        if shape != (model.num_layers, model.num_kv_heads, model.head_dim):
            raise ValueError(
                f"ModelRunner: kv_pool (layers, kv_heads, head_dim) = {shape} does not fit the model "
                f"{(model.num_layers, model.num_kv_heads, model.head_dim)}"
            )
        return kv_pool

    def _context_len(self, max_context_len: int | None, num_slots: int) -> int:
        """``max_context_len`` (default ``min(max_position_embeddings, num_slots)``), checked.

        Raises:
            ValueError: below 1, or above the model's sliding window.
        """
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", num_slots))
        if max_context_len is None:
            max_context_len = default_context_len(max_pos, num_slots)
        if max_context_len < 1:
            raise ValueError(f"ModelRunner: max_context_len must be >= 1, got {max_context_len}")
        window = sliding_window_limit(self.hf_config)
        if window is not None and max_context_len > window:
            raise ValueError(
                f"ModelRunner: max_context_len {max_context_len} exceeds the model's sliding_window {window} "
                "(sliding-window attention is not implemented; pass max_context_len <= sliding_window)"
            )
        return int(max_context_len)

    def _make_backend(
        self, attention_backend: Union[str, AttentionBackend], kv_pool: KVPool, num_heads: int
    ) -> AttentionBackend:
        """The attention backend named (or the one given, checked to be built for ``kv_pool``).

        Raises:
            ValueError: a given backend built for another pool.
        """
        if isinstance(attention_backend, AttentionBackend):
            if attention_backend.kv_pool is not kv_pool:
                raise ValueError("ModelRunner: the given attention backend was built for another kv_pool")
            return attention_backend
        return create_attention_backend(attention_backend, self.device, kv_pool, num_heads)

    def build_batch(
        self,
        input_ids: Union[Sequence[int], torch.Tensor],
        req_rows: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        logits_indices: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """:meth:`ForwardBatch.build` over this runner's block table, page size and device. A
        decode-sized batch for the fused native step comes back as a
        :class:`~radixkv.executor.cpu_decode.DecodeBatch`, which builds the same ``ForwardBatch``
        only if one of its fields is read; a batch whose decode rows that path does not reach whole
        as a :class:`~radixkv.executor.row_split.SplitBatch` (same).

        Decode rows (``extend_len == 1``) may repeat a request's row at consecutive positions: the
        ``k + 1`` verify rows of speculative decoding (:func:`~radixkv.executor.row_split.verify_rows`
        builds their arguments). On a float32 CPU model (:attr:`row_exact`) every decode row gives
        exactly the bits, K/V written and logits, that it gives in a one-row batch, whatever the
        batch holds besides (docs/model.md, "Verify rows")."""
        if self.decode_step is not None:
            fast = self.decode_step.batch(input_ids, req_rows, prefix_lens, extend_lens, logits_indices)
            if fast is not None:
                return fast
        split = self._split(input_ids, req_rows, prefix_lens, extend_lens, logits_indices)
        if split is not None:
            return split
        return ForwardBatch.build(
            input_ids,
            req_rows,
            prefix_lens,
            extend_lens,
            self.req_to_token_pool.req_to_token,
            self.page_size,
            logits_indices=logits_indices,
            device=self.device,
        )

    def _split(self, input_ids, req_rows, prefix_lens, extend_lens, logits_indices) -> row_split.SplitBatch | None:
        """The batch as parts whose decode rows run on the one-row path
        (:func:`~radixkv.executor.row_split.plan_parts`), or None: nothing to split, or arguments
        that :meth:`ForwardBatch.build` refuses (it then says why)."""
        if not self.row_exact:
            return None
        try:
            tokens, rows, prefix, extend = (cpu_decode.ints(v) for v in (input_ids, req_rows, prefix_lens, extend_lens))
            if self.decode_step is None:
                return None  # the module path serves it on the native, row-invariant kernels
            if len(extend) != len(rows) or sum(extend) != len(tokens) or min(extend, default=0) < 1:
                return None
            starts = [0, *accumulate(extend)]
            lrows = [s - 1 for s in starts[1:]] if logits_indices is None else cpu_decode.ints(logits_indices)
            if lrows and (min(lrows) < 0 or max(lrows) >= len(tokens)):
                return None
        except (TypeError, ValueError, RuntimeError):
            return None
        parts = row_split.plan_parts(
            tokens, rows, prefix, extend, lrows, cpu_decode.MAX_ROWS, table=self.req_to_token_pool.req_to_token
        )
        if parts is None:
            return None
        batches = [self.build_batch(p.tokens, p.rows, p.prefix, p.extend, p.logits_rows) for p in parts]
        r2t = self.req_to_token_pool.req_to_token
        args = (tokens, rows, prefix, extend, lrows, r2t, self.device)
        return row_split.SplitBatch(batches, [p.out for p in parts], len(lrows), self.page_size, args)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model on ``batch`` (no gradient is recorded): writes the new tokens' K/V into the
        pool (every layer) and returns float32 logits ``[S, vocab_size]`` for
        ``batch.logits_indices``. Picks the path:
        the fused native CPU decode step (:mod:`radixkv.executor.cpu_decode`: the whole pass in
        one call) for a :class:`~radixkv.executor.cpu_decode.DecodeBatch` from :meth:`build_batch`,
        each part in order for a :class:`~radixkv.executor.row_split.SplitBatch`, else the
        model's module path."""
        if batch.page_size != self.page_size:
            raise ValueError(f"ModelRunner.forward: batch.page_size {batch.page_size} != {self.page_size}")
        if isinstance(batch, row_split.SplitBatch):
            return batch.run(self.forward)
        if isinstance(batch, cpu_decode.DecodeBatch):
            if self.decode_step is not None and batch._req_to_token is self.req_to_token_pool.req_to_token:
                logits = self.decode_step.forward(batch)
                if logits is not None:
                    return logits
            batch = batch.materialize()
        return self._module_forward(batch)

    @torch.inference_mode()
    def _module_forward(self, batch: ForwardBatch) -> torch.Tensor:
        attn = self.attn_backend
        attn.plan(batch)
        return self.model(batch.input_ids, batch.positions, attn, batch.logits_indices)
