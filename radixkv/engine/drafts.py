"""`DraftSlots`: the tentative KV slots of draft tokens in the forward being run (speculative
decoding, docs/speculative.md).

A decoding request that verifies ``k`` draft tokens computes positions ``[kv_len, kv_len + 1 + k)``
in one forward: its last sampled token and the drafts. The slots of the draft positions
``[kv_len + 1, kv_len + 1 + k)`` are *tentative*: the KV manager allocates them when the step is
planned (:meth:`~radixkv.engine.kv_manager.KVManager.reserve_drafts`) and, once the verify has
decided how many drafts were accepted, keeps the accepted positions' slots and frees the rest in
the same step (:meth:`~radixkv.engine.kv_manager.KVManager.settle_drafts`; or
:meth:`~radixkv.engine.kv_manager.KVManager.release` when the request ends inside its draft). A
draft token never enters the request's tokens, the prefix cache or an event: only the tokens the
sampler produces do.

This class is bookkeeping only (which requests hold tentative slots, and how many); it moves no
slot. Between steps it is empty (:meth:`DraftSlots.check_integrity`).
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["DraftSlots"]


class DraftSlots:
    """The requests holding tentative draft slots now (module docstring).

    Attributes:
        reserved: draft positions given slots so far (a running total).
    """

    __slots__ = ("_open", "reserved")

    def __init__(self) -> None:
        self._open: Dict[int, tuple] = {}  # id(request) -> (request, first draft position, end)
        self.reserved = 0

    def __len__(self) -> int:
        """Requests holding tentative slots now."""
        return len(self._open)

    def open(self, req: Any, start: int, end: int) -> None:
        """``req`` holds tentative slots for draft positions ``[start, end)``."""
        self._open[id(req)] = (req, start, end)
        self.reserved += end - start

    def close(self, req: Any) -> bool:
        """``req``'s draft is decided (or it was released): forget it; False when it held none."""
        return self._open.pop(id(req), None) is not None

    def check_integrity(self) -> None:
        """Raise AssertionError when a request still holds tentative slots (between steps every
        verify has settled)."""
        if self._open:
            reqs = [v[0] for v in self._open.values()]
            raise AssertionError(f"requests still hold tentative draft slots after their verify: {reqs!r}")
