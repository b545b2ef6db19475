"""Per-forward batch metadata in FlashInfer's paged-KV format.

A forward batch is ``B`` requests; request ``i`` already has ``prefix_lens[i]`` tokens of K/V in
the pool (a cached prefix or earlier decode steps) and brings ``extend_lens[i] >= 1`` new tokens
(a fresh prefill has prefix 0; a decode step is an extend of length 1). The new tokens of all
requests are flattened, request after request, into ``T = sum(extend_lens)`` rows: there is no
padding anywhere in the model.

Format (identical to what FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan`` /
``BatchDecodeWithPagedKVCacheWrapper.plan`` take, see the FlashInfer docs "KV-Cache Layout"):

* ``qo_indptr [B+1]`` int32: new tokens of request ``i`` are rows ``qo_indptr[i]:qo_indptr[i+1]``.
* ``kv_indptr [B+1]`` int32, in *pages*: the pages of request ``i`` are
  ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, covering its ``seq_len = prefix + extend`` tokens
  (new tokens included: their K/V are written before attention runs).
* ``kv_indices [nnz_pages]`` int32 page ids. Token ``p`` of request ``i`` sits in page
  ``kv_indices[kv_indptr[i] + p // page_size]`` at offset ``p % page_size``, i.e. slot
  ``page * page_size + p % page_size``.
* ``kv_last_page_len [B]`` int32 in ``1..page_size``: how many tokens the last page holds.
* Causal masking is *bottom-right aligned*: new token ``j`` (0-based) of request ``i`` attends to
  KV positions ``0 .. prefix_lens[i] + j``.

This module only imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

IntSeq = Union[Sequence[int], torch.Tensor]


def _as_cpu_long(x: IntSeq, name: str) -> torch.Tensor:
    t = torch.as_tensor(x.tolist() if isinstance(x, torch.Tensor) else list(x), dtype=torch.int64)
    if t.dim() != 1:
        raise ValueError(f"ForwardBatch.build: {name} must be 1-D, got shape {tuple(t.shape)}")
    return t


def _cumsum_indptr(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=out[1:])
    return out


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides the weights and the KV pool.

    Device tensors (on ``device``; ``T`` new tokens, ``B`` requests, ``S`` sampled rows):

    Attributes:
        input_ids: ``[T]`` int64 token ids of the new tokens.
        positions: ``[T]`` int64 absolute position of each new token (``prefix_len + j``), for RoPE.
        out_slots: ``[T]`` int64 KV slot each new token's K/V is written to
            (``req_to_token[row, position]``).
        qo_indptr: ``[B+1]`` int32, rows of each request's new tokens.
        kv_indptr: ``[B+1]`` int32, each request's range in ``kv_indices`` (pages).
        kv_indices: ``[nnz_pages]`` int32 page ids (slot ``// page_size``).
        kv_last_page_len: ``[B]`` int32 in ``1..page_size``.
        seq_lens: ``[B]`` int32 ``prefix_len + extend_len`` (KV length attended after the write).
        logits_indices: ``[S]`` int64 rows of the ``T`` new tokens whose logits are computed.
        req_rows: ``[B]`` int64 rows of ``req_to_token`` used by each request.

    Host (CPU) copies, for planners that need them without a device sync (FlashInfer's plan):
        qo_indptr_cpu, kv_indptr_cpu (int32 ``[B+1]``), kv_last_page_len_cpu, seq_lens_cpu,
        prefix_lens_cpu, extend_lens_cpu (int32 ``[B]``).

    Scalars: ``page_size``, ``batch_size`` (B), ``num_tokens`` (T), ``max_extend_len``,
    ``max_seq_len``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    req_rows: torch.Tensor
    qo_indptr_cpu: torch.Tensor
    kv_indptr_cpu: torch.Tensor
    kv_last_page_len_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    prefix_lens_cpu: torch.Tensor
    extend_lens_cpu: torch.Tensor
    page_size: int
    batch_size: int
    num_tokens: int
    max_extend_len: int
    max_seq_len: int

    @property
    def is_decode(self) -> bool:
        """True when every request brings exactly one new token (a pure decode batch)."""
        return self.num_tokens == self.batch_size

    @property
    def num_logits(self) -> int:
        """``S``, the number of rows whose logits are computed."""
        return int(self.logits_indices.numel())

    @classmethod
    def build(
        cls,
        input_ids: IntSeq,
        req_rows: IntSeq,
        prefix_lens: IntSeq,
        extend_lens: IntSeq,
        req_to_token: torch.Tensor,
        page_size: int,
        logits_indices: IntSeq | None = None,
        device: Union[str, torch.device, None] = None,
    ) -> "ForwardBatch":
        """Build the metadata of one forward batch.

        The caller must already have written the slots of positions ``0 .. prefix_len+extend_len-1``
        of every request into its ``req_to_token`` row. With ``page_size > 1`` the slots must be
        page aligned: position ``p`` maps to a slot ``s`` with ``s % page_size == p % page_size``
        and the slots of positions in the same page are in the same page (the
        :class:`~radixkv.memory.allocator.SlotAllocator` hands out whole pages).

        Args:
            input_ids: ``T`` new token ids, request after request.
            req_rows: ``B`` rows of ``req_to_token``.
            prefix_lens: ``B`` counts of tokens whose K/V are already in the pool (>= 0).
            extend_lens: ``B`` counts of new tokens (>= 1); ``sum(extend_lens) == T``.
            req_to_token: int32 ``[max_running_requests, max_context_len]`` block table.
            page_size: tokens per KV page (>= 1).
            logits_indices: rows in ``[0, T)`` whose logits are wanted; default the last new token
                of each request (``qo_indptr[1:] - 1``).
            device: device of the result; default ``req_to_token.device``.

        Returns:
            A :class:`ForwardBatch`.

        Raises:
            ValueError: empty batch, mismatched lengths, ``extend_len < 1``, ``prefix_len < 0``,
                ``prefix_len + extend_len > max_context_len``, a row out of range, a logits index
                outside ``[0, T)``, or (CPU block tables only) slots that are not page aligned.
        """
        page_size = int(page_size)
        if page_size < 1:
            raise ValueError(f"ForwardBatch.build: page_size must be >= 1, got {page_size}")
        device = torch.device(device) if device is not None else req_to_token.device
        ids, rows, prefix, extend = _checked_inputs(input_ids, req_rows, prefix_lens, extend_lens, req_to_token)
        bs, seq, num_tokens = int(rows.numel()), prefix + extend, int(extend.sum())
        qo_indptr = _cumsum_indptr(extend)
        req_of_token = torch.repeat_interleave(torch.arange(bs), extend)
        positions = prefix[req_of_token] + (torch.arange(num_tokens) - qo_indptr[req_of_token])
        num_pages = (seq + page_size - 1) // page_size
        kv_indptr = _cumsum_indptr(num_pages)
        last_page_len = seq - (num_pages - 1) * page_size
        logits = _logits_rows(logits_indices, qo_indptr, num_tokens)
        out_slots, kv_indices = _gather_slots(
            req_to_token, rows, req_of_token, positions, num_pages, kv_indptr, page_size
        )

        def dev(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        i32 = torch.int32
        return cls(
            input_ids=dev(ids, torch.int64),
            positions=dev(positions, torch.int64),
            out_slots=dev(out_slots, torch.int64),
            qo_indptr=dev(qo_indptr, i32),
            kv_indptr=dev(kv_indptr, i32),
            kv_indices=dev(kv_indices, i32),
            kv_last_page_len=dev(last_page_len, i32),
            seq_lens=dev(seq, i32),
            logits_indices=dev(logits, torch.int64),
            req_rows=dev(rows, torch.int64),
            qo_indptr_cpu=qo_indptr.to(i32),
            kv_indptr_cpu=kv_indptr.to(i32),
            kv_last_page_len_cpu=last_page_len.to(i32),
            seq_lens_cpu=seq.to(i32),
            prefix_lens_cpu=prefix.to(i32),
            extend_lens_cpu=extend.to(i32),
            page_size=page_size,
            batch_size=bs,
            num_tokens=num_tokens,
            max_extend_len=int(extend.max()),
            max_seq_len=int(seq.max()),
        )


def _checked_inputs(
    input_ids: IntSeq, req_rows: IntSeq, prefix_lens: IntSeq, extend_lens: IntSeq, req_to_token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, rows, prefix, extend)`` as CPU int64 tensors, checked (:meth:`ForwardBatch.build`'s
    ValueErrors but the page-size, logits-index and alignment ones)."""
    rows = _as_cpu_long(req_rows, "req_rows")
    prefix = _as_cpu_long(prefix_lens, "prefix_lens")
    extend = _as_cpu_long(extend_lens, "extend_lens")
    ids = (
        input_ids.reshape(-1).to(torch.int64)
        if isinstance(input_ids, torch.Tensor)
        else torch.as_tensor(list(input_ids), dtype=torch.int64)
    )
    bs = int(rows.numel())
    if bs == 0:
        raise ValueError("ForwardBatch.build: the batch has no requests (req_rows is empty)")
    if prefix.numel() != bs or extend.numel() != bs:
        raise ValueError(
            f"ForwardBatch.build: req_rows ({bs}), prefix_lens ({prefix.numel()}) and "
            f"extend_lens ({extend.numel()}) must have the same length"
        )
    if int(extend.min()) < 1:
        raise ValueError(f"ForwardBatch.build: every extend_len must be >= 1, got {extend.tolist()}")
    if int(prefix.min()) < 0:
        raise ValueError(f"ForwardBatch.build: every prefix_len must be >= 0, got {prefix.tolist()}")
    max_rows, max_ctx = req_to_token.shape
    if int(rows.min()) < 0 or int(rows.max()) >= max_rows:
        raise ValueError(f"ForwardBatch.build: req_rows must be in [0, {max_rows}), got {rows.tolist()}")
    seq = prefix + extend
    if int(seq.max()) > max_ctx:
        raise ValueError(
            f"ForwardBatch.build: prefix_len + extend_len = {int(seq.max())} exceeds max_context_len {max_ctx}"
        )
    num_tokens = int(extend.sum())
    if ids.numel() != num_tokens:
        raise ValueError(f"ForwardBatch.build: input_ids has {ids.numel()} tokens but sum(extend_lens) = {num_tokens}")
    return ids, rows, prefix, extend


def _logits_rows(logits_indices: IntSeq | None, qo_indptr: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The rows whose logits are computed: the given ones, checked to be in ``[0, num_tokens)``,
    or the last new token of each request."""
    if logits_indices is None:
        return qo_indptr[1:] - 1
    logits = _as_cpu_long(logits_indices, "logits_indices")
    if logits.numel() and (int(logits.min()) < 0 or int(logits.max()) >= num_tokens):
        raise ValueError(f"ForwardBatch.build: logits_indices must be in [0, {num_tokens}), got {logits.tolist()}")
    return logits


def _gather_slots(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    req_of_token: torch.Tensor,
    positions: torch.Tensor,
    num_pages: torch.Tensor,
    kv_indptr: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_slots, kv_indices)`` read from the block table (on its device): each new token's
    slot (int64), and each request's page ids (int32). A CPU block table with ``page_size > 1``
    is checked to hold page-aligned slots (ValueError otherwise)."""
    r2t_dev = req_to_token.device
    bs = int(rows.numel())
    req_of_page = torch.repeat_interleave(torch.arange(bs), num_pages)
    page_pos = (torch.arange(int(kv_indptr[-1])) - kv_indptr[req_of_page]) * page_size
    tok_rows = rows[req_of_token].to(r2t_dev)
    out_slots = req_to_token[tok_rows, positions.to(r2t_dev)].to(torch.int64)
    page_first_slots = req_to_token[rows[req_of_page].to(r2t_dev), page_pos.to(r2t_dev)]
    kv_indices = torch.div(page_first_slots, page_size, rounding_mode="floor").to(torch.int32)
    if page_size > 1 and r2t_dev.type == "cpu":
        page_of_tok = kv_indptr[req_of_token] + torch.div(positions, page_size, rounding_mode="floor")
        expect = kv_indices.to(torch.int64)[page_of_tok] * page_size + positions % page_size
        if not torch.equal(expect, out_slots):
            raise ValueError(
                f"ForwardBatch.build: slots in req_to_token are not aligned to page_size {page_size} "
                "(position p must sit at offset p % page_size of the page holding its page's first slot)"
            )
    return out_slots, kv_indices
