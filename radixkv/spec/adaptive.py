"""`Acceptance`: one request's draft acceptance rate and the draft length it pays to verify.

The cost model: verifying a draft of ``k`` tokens adds ``k`` rows to the forward, each costing
``c`` (``SpeculativeConfig.draft_row_cost``) of a one-row decode step; the ``j``-th draft token
is worth a token only when the ``j - 1`` before it were accepted too. With a per-token acceptance
rate ``a`` that happens with probability ``a ** j``, so drafting the ``j``-th token pays while
``a ** j >= c``: the draft length is ``k = floor(log(c) / log(a))``, capped by
``num_speculative_tokens``.

The rate is an exponentially weighted average (weight :data:`DECAY` per verify) of accepted
over compared draft tokens, starting at :data:`PRIOR`. A verify compares ``accepted + 1``
tokens when a draft token was rejected, ``accepted`` when all were accepted (or the request
stopped first). When the rate gives ``k = 0`` the request stops drafting (plain chat costs nothing)
and probes with one draft token every :data:`PROBE_EVERY` decode steps, so a request whose text
turns repetitive starts drafting again.
"""

from __future__ import annotations

import math

__all__ = ["Acceptance", "DECAY", "PRIOR", "PROBE_EVERY", "row_cost_at"]

DECAY = 0.7
"""Weight of the past per verify (0.7: the last ~3 verifies dominate)."""

PRIOR = (1.0, 2.0)
"""``(accepted, compared)`` a request starts with: a rate of 0.5."""

PROBE_EVERY = 8
"""Decode steps between one-token probes of a request that stopped drafting."""


def row_cost_at(row_cost: float, rows: int) -> float:
    """The cost of one draft row against the tokens it can win, in a step of ``rows`` decode rows.

    ``row_cost`` (``c``) is a draft row's cost relative to a one-row decode step. Model a step of
    ``b`` rows as ``T0 + r * b`` (reading the weights, then each row's multiply-adds), so
    ``c = r / (T0 + r)``. One more draft row adds ``r`` to the step, which yields ``b`` tokens
    without drafts, so it pays while it wins at least ``r * b / (T0 + r * b)`` tokens:
    ``c * b / (1 - c + c * b)``, which is ``c`` at ``b = 1`` and tends to 1 as the step becomes
    bound by multiply-adds (a draft row then costs what a sampled token does).
    """
    b = max(int(rows), 1)
    return row_cost * b / (1.0 - row_cost + row_cost * b)


class Acceptance:
    """The acceptance rate of one request's drafts (module docstring).

    Attributes:
        accepted, compared: the weighted counts (rate = accepted / compared).
        idle: decode steps since the request last verified a draft.
    """

    __slots__ = ("accepted", "compared", "idle")

    def __init__(self) -> None:
        self.accepted, self.compared = PRIOR
        self.idle = 0

    @property
    def rate(self) -> float:
        """Accepted / compared draft tokens, weighted (in [0, 1])."""
        return self.accepted / self.compared if self.compared > 0 else 0.0

    def update(self, drafted: int, accepted: int, rejected: bool) -> None:
        """One verify: ``drafted`` draft tokens, the first ``accepted`` of them accepted,
        ``rejected`` whether the next one was compared and rejected."""
        if drafted <= 0:
            return
        self.accepted = DECAY * self.accepted + accepted
        self.compared = DECAY * self.compared + accepted + (1 if rejected else 0)
        self.idle = 0

    def draft_len(self, cap: int, row_cost: float) -> int:
        """Draft tokens worth verifying now, at most ``cap`` (0: do not draft this step; every
        :data:`PROBE_EVERY`-th such step probes with 1). Counts the step as idle when 0."""
        a = self.rate
        if a >= 1.0:
            k = cap
        elif a <= 0.0:
            k = 0
        else:
            k = min(cap, int(math.log(row_cost) / math.log(a) + 1e-9))
        if k > 0:
            return k
        self.idle += 1
        if self.idle >= PROBE_EVERY:
            self.idle = 0
            return min(1, cap)
        return 0
