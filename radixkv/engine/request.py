"""`Request`: one sequence being generated, with its KV-slot bookkeeping.

Slot ranges of a request (positions are token positions, all ranges half-open; see
docs/engine.md for the table of what is owned, handed to the cache or freed at each step; only
:class:`~radixkv.engine.kv_manager.KVManager` changes them)::

    [0, prefix_len)            borrowed: slots of a cached prefix, locked in the prefix cache
                               (``prefix_node``) or held by a pin it references (``pin``); between
                               admission and the end of its first forward, its last
                               ``shared_len`` positions may be borrowed from another request
                               computing them in that same forward (in-batch sharing)
    [prefix_len, kv_len)       owned, K/V computed
    [kv_len, len(slots))       owned, allocated, K/V not computed yet (the tokens of the current
                               forward, and with page_size > 1 the rest of the last page); during
                               a verify step, from ``kv_len + 1`` on the tentative slots of its
                               draft tokens (:mod:`radixkv.engine.drafts`)
"""

from __future__ import annotations

import enum
from typing import Any, List, Optional

import torch

from radixkv.namespace import Namespace
from radixkv.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life cycle."""

    WAITING = "waiting"  # in the waiting queue (new or retracted)
    PREFILL = "prefill"  # admitted, prompt (or retracted history) partly computed
    DECODE = "decode"  # every token but the last has K/V; one new token per step
    FINISHED = "finished"


class Request:
    """One sequence: a prompt, its output so far, and where its K/V lives.

    Args:
        request_id: id of the user request (``n`` samples share it).
        index: sample index in ``[0, n)``.
        prompt_token_ids: the prompt (non-empty list of ints).
        params: the sampling parameters.
        namespace: prefix-cache namespace, normalized (``Namespace.of``; None: the shared
            default); requests only share prefixes within one namespace.
        generator: this sample's ``torch.Generator`` (None when unseeded).

    Attributes:
        output_token_ids: sampled tokens.
        status: a :class:`RequestStatus`.
        row: the request's row of ``req_to_token`` while admitted, else None.
        slots: ``list[int]``, the KV slot of each position ``[0, len(slots))`` (see module doc).
        prefix_len: length of the borrowed prefix.
        prefix_node: the locked prefix-cache handle, or None.
        shared_len: positions ``[prefix_len - shared_len, prefix_len)`` are borrowed from
            requests computing them in the forward being run (in-batch sharing); 0 once that
            forward has run (:meth:`~radixkv.engine.kv_manager.KVManager.settle` re-points them
            at the prefix cache).
        num_shared_tokens: ``shared_len`` at its latest admission (what the admission event reports).
        logits_from: ``(request, position)`` when it samples its next token from that request's
            logits at ``position`` in this forward instead of computing anything itself (its
            whole sequence is computed by that request: an identical prompt, or a prefix of a
            longer one), else None.
        pin: the :class:`~radixkv.engine.pins.Pin` it holds a reference on (its borrowed
            prefix), or None.
        kv_len: positions whose K/V is computed.
        admit_seq: admission counter value (the highest is the "newest" request, retracted first).
        num_cached_tokens: prompt tokens served from the cache at first admission (None before).
        cache_outcome: why sample 0's match stopped at its first admission
            (:class:`~radixkv.cache.outcome.CacheOutcome`), or None.
        num_retractions: how many times it was retracted.
        arrival_seq: its place in the order of the scheduler's arrivals and first-token
            preemptions (0 for a fork's sample, which never waited on its own).
        preempted_seq: when it was retracted to let a request produce its first token
            (``EngineConfig.first_token_preemption``), its place in the same order, else None.
        fork_pending: samples still to fork from this one once its prompt is computed (n > 1).
        sampling_state: the sample's :class:`~radixkv.sampling.pipeline.SampleState` (grammar
            matcher, processor tensors), or None; owned by the sampling package.
        prompt_lp_pos: with prompt logprobs still to compute, the next prompt position whose
            logits are needed (they score the token after it); None when none are due.
        tier: its KV-tier state (:class:`~radixkv.engine.tiers.TierHold`: a pending load, the
            lock held for it, the positions the tiers served) once the KV manager looked it up;
            None before.
        draft_tokens: the draft tokens proposed for its next decode step (speculative decoding;
            never part of its tokens: only what the sampler produces is appended).
        spec_state: its drafting state (:class:`~radixkv.spec.drafter.SpecState`), or None;
            owned by the spec package.
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: List[int],
        params: SamplingParams,
        namespace: Optional[Namespace] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.namespace = namespace
        self.generator = generator
        self.output_token_ids: List[int] = []
        self.status = RequestStatus.WAITING
        self.row: Optional[int] = None
        self.slots: List[int] = []
        self.prefix_len = 0
        self.prefix_node: Any = None
        self.shared_len = 0
        self.num_shared_tokens = 0
        self.logits_from: Optional[tuple] = None
        self.pin: Any = None
        self.kv_len = 0
        self.admit_seq = -1
        self.num_cached_tokens: Optional[int] = None
        self.cache_outcome: Any = None
        self.num_retractions = 0
        self.arrival_seq = 0
        self.preempted_seq: Optional[int] = None
        self.fork_pending = 0
        self.finish_reason: Optional[str] = None
        self.sampling_state: Any = None
        self.prompt_lp_pos: Optional[int] = None
        self.tier: Any = None
        self.draft_tokens: List[int] = []
        self.spec_state: Any = None

    @property
    def max_prefix_len(self) -> Optional[int]:
        """The most tokens it may take from the prefix cache (None: no limit). Prompt logprobs
        need the logits of every position from ``prompt_lp_pos`` on, so those positions must be
        computed in this request's own forward, not served from the cache."""
        return self.prompt_lp_pos

    @property
    def all_token_ids(self) -> List[int]:
        """Prompt followed by the output so far."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def seq_len(self) -> int:
        """``len(prompt) + len(output)``."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_admitted(self) -> bool:
        """True while it holds a ``req_to_token`` row (prefill or decode)."""
        return self.row is not None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}#{self.index}, {self.status.value}, seq_len={self.seq_len}, "
            f"prefix_len={self.prefix_len}, kv_len={self.kv_len}, slots={len(self.slots)})"
        )
