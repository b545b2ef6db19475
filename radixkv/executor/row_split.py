"""Row-count invariance: every decode row runs on the path a one-row decode step runs.

A decode row (a request entry with ``extend_len == 1``: an ordinary decode step, or one of the
``k + 1`` verify rows of speculative decoding, which repeat a request's ``req_to_token`` row at
consecutive positions) must give the bits (K/V written, logits) that the same row gives alone,
whatever else is in the batch. The native CPU kernels give them for any batch they serve (every
output element is computed per row in a fixed order: the GEMV, the small-M GEMM and the
micro-kernel share one summation order per row; attention is per row), but one batch does not
reach the one-row path whole: with the fused decode step (:mod:`radixkv.executor.cpu_decode`), a
batch beyond its limits (more than :data:`~radixkv.executor.cpu_decode.MAX_ROWS` tokens, or a
prefill chunk longer than :data:`~radixkv.executor.cpu_decode.MAX_EXTEND`) goes through the module
path, whose attention merges no 256-position chunks (other bits past 256 positions). Without the
fused step every batch runs the module path on the native kernels, whose bits do not depend on
the batch, and nothing is split.

:func:`plan_parts` splits such a batch into parts the runner runs one after the other: the decode
rows in chunks of at most ``max_rows`` (each on the one-row path: the fused step, or the module
path at native row counts), and the other requests (prefill chunks) as one part. Running them apart
computes the same thing as long as no part reads K/V a later part writes: rows of one request stay
in order (chunk after chunk), so a later verify row reads the earlier rows' K/V as written; and a
request riding on another's prefill in the same forward (in-batch prefix sharing) runs after it
(the prefill chunks first when a decode entry is such a rider; no split when parts read each
other's new K/V both ways).
:class:`SplitBatch` holds the parts' batches and puts their logits back in the caller's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from radixkv.attention.metadata import ForwardBatch

__all__ = ["Part", "SplitBatch", "plan_parts", "verify_rows"]


def verify_rows(row: int, prefix_len: int, num_rows: int) -> tuple[list[int], list[int], list[int]]:
    """``(req_rows, prefix_lens, extend_lens)`` of the ``num_rows`` (``k + 1``) verify rows of one
    request for :meth:`ModelRunner.build_batch
    <radixkv.executor.model_runner.ModelRunner.build_batch>`: row ``j`` is the request's block-table
    row ``row`` at position ``prefix_len + j`` (``prefix_len``: the tokens whose K/V are in the pool;
    the input tokens are the last sampled token, then the ``k`` drafts), one new token each. Rows of
    several requests concatenate, with ordinary decode rows and prefill chunks. The slots of
    positions ``0 .. prefix_len + num_rows - 1`` must be in the block table first.

    Raises:
        ValueError: ``num_rows < 1`` or ``prefix_len < 0``.
    """
    if num_rows < 1 or prefix_len < 0:
        raise ValueError(f"verify_rows: num_rows must be >= 1 and prefix_len >= 0, got {num_rows}, {prefix_len}")
    return [row] * num_rows, [prefix_len + j for j in range(num_rows)], [1] * num_rows


@dataclass(frozen=True)
class Part:
    """One part of a split batch, as :meth:`ModelRunner.build_batch
    <radixkv.executor.model_runner.ModelRunner.build_batch>` arguments (lists of ints), and where
    its logits rows go: ``out[i]`` is the row of the whole batch's logits that this part's logits
    row ``i`` fills."""

    tokens: list[int]
    rows: list[int]
    prefix: list[int]
    extend: list[int]
    logits_rows: list[int]
    out: list[int]


def _chunks(entries: list[int], rows: list[int], max_rows: int) -> list[list[int]]:
    """Decode entries (one token each) in chunks of at most ``max_rows``, in order; a run of
    entries of one request (its verify rows) is kept in one chunk when it fits in one."""
    runs: list[list[int]] = []
    for i in entries:
        if runs and rows[runs[-1][-1]] == rows[i] and len(runs[-1]) < max_rows:
            runs[-1].append(i)
        else:
            runs.append([i])
    chunks: list[list[int]] = []
    for run in runs:
        if chunks and len(chunks[-1]) + len(run) <= max_rows:
            chunks[-1].extend(run)
        else:
            chunks.append(list(run))
    return chunks


def _reads(readers: list[int], writers: list[int], rows: list[int], prefix: list[int], table: torch.Tensor) -> bool:
    """Whether an entry of ``readers`` attends over a slot an entry of ``writers`` writes in this
    forward (``table``: the block table, int ``[rows, max_context_len]``). NOTE: slots are shared
    as prefixes (a rider's block-table row holds its source's slots from position 0 on), so a
    reader reads a writer's new K/V exactly when it holds the writer's slot at the writer's first
    new position. One gather over all (reader, writer) pairs: a step may split 64 decode rows
    from 64 more."""
    if not readers or not writers:
        return False
    rr = torch.tensor([rows[i] for i in readers])
    pr = torch.tensor([prefix[i] for i in readers])
    rw = torch.tensor([rows[j] for j in writers])
    pw = torch.tensor([prefix[j] for j in writers])
    held = table[rr[:, None], pw[None, :]]  # each reader's slot at each writer's first new position
    hit = (pr[:, None] > pw[None, :]) & (rr[:, None] != rw[None, :]) & (held == table[rw, pw][None, :])
    return bool(hit.any())


def _ordered(
    groups: list[list[int]], rows: list[int], prefix: list[int], table: torch.Tensor | None
) -> list[list[int]] | None:
    """``groups`` (decode chunks, then the rest) in an order where no part reads a later part's new
    K/V: as given, else the rest first; None when neither order is one."""
    if table is None or len(groups) < 2:
        return groups
    for order in (groups, groups[-1:] + groups[:-1]):
        if not any(_reads(a, b, rows, prefix, table) for g, a in enumerate(order) for b in order[g + 1 :]):
            return order
    return None


def plan_parts(
    tokens: list[int],
    rows: list[int],
    prefix: list[int],
    extend: list[int],
    logits_rows: list[int],
    max_rows: int,
    table: torch.Tensor | None = None,
) -> list[Part] | None:
    """The parts of a batch (module docstring): the decode entries (``extend == 1``) in chunks of at
    most ``max_rows`` tokens, in order, then the other entries as one part; the other entries
    first when a decode entry reads slots they write in this forward (in-batch prefix sharing: a
    request whose only new token is its last rides on another's prefill). ``logits_rows`` are rows
    of the whole batch's ``T = len(tokens)`` tokens, in ``[0, T)``. ``table`` is the
    block table (``req_to_token``, int ``[rows, max_context_len]``; None: entries share no slots).

    Returns None when there is nothing to split: no decode entry, only decode entries that fit in
    one chunk, a block-table row used by a decode entry and by a longer one (one request's tokens
    in two parts could run out of order), or parts that read each other's new K/V both ways."""
    decode = [i for i, e in enumerate(extend) if e == 1]
    rest = [i for i, e in enumerate(extend) if e != 1]
    if not decode or (not rest and len(decode) <= max_rows):
        return None
    if {rows[i] for i in decode} & {rows[i] for i in rest}:
        return None
    start = [0] * len(extend)
    for i in range(1, len(extend)):
        start[i] = start[i - 1] + extend[i - 1]
    groups = _ordered(_chunks(decode, rows, max_rows) + ([rest] if rest else []), rows, prefix, table)
    if groups is None:
        return None
    where: dict[int, tuple[int, int]] = {}  # token of the whole batch -> (part, token of the part)
    for g, entries in enumerate(groups):
        t = 0
        for i in entries:
            for j in range(extend[i]):
                where[start[i] + j] = (g, t)
                t += 1
    local: list[list[int]] = [[] for _ in groups]
    out: list[list[int]] = [[] for _ in groups]
    for s, r in enumerate(logits_rows):
        g, t = where[r]
        local[g].append(t)
        out[g].append(s)
    return [
        Part(
            [tok for i in entries for tok in tokens[start[i] : start[i] + extend[i]]],
            [rows[i] for i in entries],
            [prefix[i] for i in entries],
            [extend[i] for i in entries],
            local[g],
            out[g],
        )
        for g, entries in enumerate(groups)
    ]


class SplitBatch:
    """A batch the runner runs as several forwards (:func:`plan_parts`), built by
    :meth:`ModelRunner.build_batch <radixkv.executor.model_runner.ModelRunner.build_batch>`.

    Like :class:`~radixkv.executor.cpu_decode.DecodeBatch`, it stands for the
    :class:`~radixkv.attention.metadata.ForwardBatch` of the whole batch: reading one of that
    batch's fields (``batch.positions`` ...) builds it once (:meth:`materialize`).

    Attributes:
        parts: the parts' batches (a ``DecodeBatch`` or a ``ForwardBatch`` each), in run order.
        outs: per part, the rows of the whole batch's logits its logits rows fill.
        num_logits: ``S``, the whole batch's logits rows.
        page_size: the runner's page size.
    """

    __slots__ = ("parts", "outs", "num_logits", "page_size", "_args", "_full")

    def __init__(self, parts: list, outs: list[list[int]], num_logits: int, page_size: int, args: tuple) -> None:
        self.parts, self.outs, self.num_logits, self.page_size = parts, outs, num_logits, page_size
        self._args, self._full = args, None

    def run(self, forward: Callable[[object], torch.Tensor]) -> torch.Tensor:
        """Float32 logits ``[S, vocab]`` of the whole batch: ``forward`` on each part in order,
        each part's rows put where they belong."""
        out = None
        for part, rows in zip(self.parts, self.outs):
            logits = forward(part)
            if out is None:
                out = logits.new_empty(self.num_logits, logits.shape[1])
            if rows:
                out[torch.tensor(rows, dtype=torch.int64, device=out.device)] = logits
        return out

    def materialize(self):
        """The equivalent :class:`~radixkv.attention.metadata.ForwardBatch` (built once)."""
        if self._full is None:
            tokens, rows, prefix, extend, logits_rows, req_to_token, device = self._args
            self._full = ForwardBatch.build(
                tokens, rows, prefix, extend, req_to_token, self.page_size, logits_indices=logits_rows, device=device
            )
        return self._full

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)
