"""The verify of draft tokens (speculative decoding, docs/speculative.md): sample each draft
position in order, exactly as decoding without drafts would, and keep the drafts while they equal
what was sampled.

A decoding request with sequence length ``L`` and drafts ``d_1 .. d_k`` ran ``k + 1`` decode rows
in one forward (inputs ``t_L, d_1, .., d_k`` at positions ``L - 1 .. L - 1 + k``); the kernels give
each row the bits a one-row decode step at that position would. Round 0 samples row 0 with the
rest of the batch (the engine's ordinary sampling call). Round ``j >= 1`` runs for the requests
whose round ``j - 1`` token equals ``d_j`` (so row ``j``'s input is the request's real token)
and that did not stop: its position ``L - 1 + j`` becomes computed K/V (``kv_len += 1``), then row
``j`` is sampled by the same sampling pipeline, with the request's own generator, grammar matcher
and output history, and the token is taken with the same stop checks. The first token that
differs from its draft (the "bonus") ends the request's verify; so does a stop. Every sampling
feature (penalties, logit_bias, min_tokens, stop strings and tokens, max_tokens, logprobs,
structured outputs) sees what it would see without drafts, and a seeded request draws the same
numbers from its generator in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence

from radixkv.engine.request import Request, RequestStatus

__all__ = ["Verify", "verify_rounds"]


@dataclass
class Verify:
    """One request's verify in a forward.

    Attributes:
        req: the request.
        drafts: its draft tokens ``d_1 .. d_k``.
        rows: the logits rows of its draft positions: ``rows[j - 1]`` holds the logits of the
            row whose input is ``d_j`` (they score the token after it).
        accepted: drafts accepted so far (rounds ``>= 1`` that ran).
    """

    req: Request
    drafts: List[int]
    rows: List[int] = field(default_factory=list)
    accepted: int = 0

    def next_round_ok(self, failed: Dict[str, Any]) -> bool:
        """Whether round ``accepted + 1`` runs: a draft is left, the request is decoding and did
        not fail, and its newest token equals the next draft."""
        r, j = self.req, self.accepted
        return (
            j < len(self.drafts)
            and r.status == RequestStatus.DECODE
            and r.request_id not in failed
            and bool(r.output_token_ids)
            and r.output_token_ids[-1] == self.drafts[j]
        )

    @property
    def rejected(self) -> bool:
        """True when a draft token was compared with a sampled token and differed."""
        r, j = self.req, self.accepted
        return j < len(self.drafts) and r.status == RequestStatus.DECODE and r.output_token_ids[-1] != self.drafts[j]


def verify_rounds(
    verifies: Sequence[Verify],
    sample: Callable[[List[Request], List[int]], Any],
    take: Callable[[List[Request], Any], None],
    failed: Dict[str, Any],
) -> None:
    """Rounds ``1 .. k`` of the verifies (module docstring); round 0 has run.

    Args:
        verifies: the step's :class:`Verify` entries.
        sample: ``sample(requests, logits_rows)``: the sampling pipeline's result for those rows.
        take: ``take(requests, result)``: append each request's token and run its stop checks
            (a request whose row failed goes into ``failed``).
        failed: request id -> exception of the requests that failed in this step.
    """
    while True:
        live = [v for v in verifies if v.next_round_ok(failed)]
        if not live:
            return
        reqs = [v.req for v in live]
        for v in live:
            v.req.kv_len += 1  # row j's input is the request's own token now: its K/V is real
            v.accepted += 1
        take(reqs, sample(reqs, [v.rows[v.accepted - 1] for v in live]))
