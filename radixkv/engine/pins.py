"""`PinTable`: the pins the KV manager holds, their reference counts, the distinct pinned-token
counts, and the soft pins' bounds (least recently used first, idle timeout, token bound).

A :class:`Pin` keeps a computed prefix in memory for holders that are not running now: the
samples ``1 .. n-1`` of a request with ``n > 1`` (hard pins), and sessions and stored Responses
(soft pins, which the table may drop). The table is bookkeeping only: it never touches the cache
or the allocator. What a pin holds (a lock on the cached path, or slots of its own without a
prefix cache) is given back by the ``unhold`` callback of its owner, the
:class:`~radixkv.engine.kv_manager.KVManager`, the moment the pin dies (its last holder released
it, or the table dropped it). So the KV manager stays the only code that moves slots.

Soft pins are bounded: past ``max_tokens`` distinct tokens pinned by soft pins (hard pins do
not count), or ``idle_timeout`` seconds without use (on ``clock``), the least recently used
soft pin is dropped (:meth:`PinTable.expire`); the KV manager also drops them when a running
request is short of memory. A pin's tokens count once however many pins share them (forked
sessions): :meth:`PinTable.pinned_size`.

Which soft pin goes first (:meth:`PinTable.victim`): the least recently used one of the owner
(the tenant, docs/security.md) holding the most soft-pinned tokens, so one tenant's pins (a flood
of sessions or stored Responses) crowd out its own before any other tenant's; with one owner (no
API keys) that is plain least recently used first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, List, Optional

__all__ = ["Pin", "PinTable"]


class Pin:
    """A computed prefix kept for holders that will attach to it (module docstring).

    Attributes:
        slots: ``list[int]`` KV slots of positions ``[0, len(slots))``, page aligned.
        node: the locked prefix-cache handle (with a prefix cache), else None (the pin owns
            ``slots``).
        refs: holders left; the pin is released when it drops to 0.
        soft: True for a session's pin, which the KV manager may drop (LRU, idle timeout, or
            memory for running requests); False for the pin of ``n > 1`` samples.
        last_used: the table's clock (seconds) when a holder last used it.
        live: False once released or dropped (a holder's handle then pins nothing).
        owner: who the pin is held for (the request's tenant; None without API keys): the
            bounds drop the pins of the owner holding the most first (:meth:`PinTable.victim`).
    """

    __slots__ = ("slots", "node", "refs", "soft", "last_used", "live", "owner")

    def __init__(
        self, slots: List[int], node: Any, refs: int, soft: bool = False, last_used: float = 0.0, owner: Any = None
    ) -> None:
        self.slots = slots
        self.node = node
        self.refs = refs
        self.soft = soft
        self.last_used = last_used
        self.live = True
        self.owner = owner

    def __len__(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        return f"Pin({len(self.slots)} tokens, refs={self.refs}, soft={self.soft}, live={self.live})"


class PinTable:
    """The live pins, one reference count each, and the soft pins' bounds (module docstring).

    Args:
        unhold: called with each pin as it dies, to give back what it holds (unlock its cache
            path, or free its own slots); the table never does that itself.
        max_tokens: bound on the distinct tokens soft pins hold (None: no bound).
        idle_timeout: seconds after which an unused soft pin is dropped (None: never).
        clock: the time source of ``idle_timeout`` and of :attr:`Pin.last_used` (default
            ``time.monotonic``; tests pass a fake one).

    Attributes:
        dropped: soft pins dropped by the table (bound, timeout, memory, reset) so far.
    """

    def __init__(
        self,
        unhold: Callable[[Pin], None],
        *,
        max_tokens: Optional[int] = None,
        idle_timeout: Optional[float] = None,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        self._unhold = unhold
        self.max_tokens = max_tokens
        self.idle_timeout = idle_timeout
        self.clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self.dropped = 0
        self._pins: dict[int, Pin] = {}  # id(pin) -> pin, every live pin
        self._counts: dict[int, int] = {}  # slot -> live pins holding it (distinct pinned tokens)
        self._soft: dict[int, int] = {}  # slot -> live soft pins holding it (what max_tokens bounds)
        # NOTE: the live soft pins least recently used first (``last_used`` only grows on a
        # monotonic clock), so the idle timeout looks at the pins that expire, not at every pin
        self._lru: OrderedDict[int, Pin] = OrderedDict()
        self._hard = 0  # live hard pins

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        """Live pins."""
        return len(self._pins)

    def __iter__(self) -> Iterator[Pin]:
        """The live pins, in the order they were added."""
        return iter(list(self._pins.values()))

    def pinned_size(self) -> int:
        """Distinct tokens held by live pins (pins sharing a prefix count it once)."""
        return len(self._counts)

    def soft_pinned_size(self) -> int:
        """Distinct tokens held by live soft pins (what ``max_tokens`` bounds: the hard pins of
        ``n > 1`` samples never make a session's pin go)."""
        return len(self._soft)

    def has_hard(self) -> bool:
        """True while a hard pin (``n > 1`` samples) is live."""
        return self._hard > 0

    # ------------------------------------------------------------------ holders
    def add(self, slots: List[int], node: Any, refs: int, *, soft: bool, owner: Any = None) -> Pin:
        """Register a new live pin on ``slots`` (its holder already took the cache lock on
        ``node``, or handed it the slots) with ``refs`` holders, used now, held for ``owner``."""
        pin = Pin(slots, node, refs, soft=soft, last_used=self.clock(), owner=owner)
        self._pins[id(pin)] = pin
        _count(self._counts, slots, 1)
        if soft:
            _count(self._soft, slots, 1)
            self._lru[id(pin)] = pin
        else:
            self._hard += 1
        return pin

    def retain(self, pin: Pin) -> bool:
        """One more holder of ``pin`` (it becomes the most recently used): True, or False when it
        is dead."""
        if not pin.live:
            return False
        pin.refs += 1
        self.touch(pin)
        return True

    def touch(self, pin: Pin) -> None:
        """A holder uses ``pin`` now (it becomes the most recently used)."""
        pin.last_used = self.clock()
        if pin.soft and pin.live:
            self._lru.move_to_end(id(pin))

    def release(self, pin: Pin) -> None:
        """A holder lets go of ``pin``; the last one kills it (``unhold``). No-op on a dead pin."""
        if not pin.live:
            return
        pin.refs -= 1
        if pin.refs <= 0:
            self._remove(pin)

    def _remove(self, pin: Pin) -> None:
        """Kill ``pin`` whatever its references: unregister it, uncount its tokens, ``unhold``."""
        del self._pins[id(pin)]
        pin.live = False
        _count(self._counts, pin.slots, -1)
        if pin.soft:
            _count(self._soft, pin.slots, -1)
            del self._lru[id(pin)]
        else:
            self._hard -= 1
        self._unhold(pin)

    # ------------------------------------------------------------------ soft pins
    def drop(self, pin: Pin) -> None:
        """Drop the soft pin ``pin`` for its holders (they find it dead) and count it."""
        self._remove(pin)
        self.dropped += 1

    def victim(self) -> Optional[Pin]:
        """The soft pin a bound drops next (module docstring): the least recently used pin of
        the owner whose soft pins hold the most tokens (each pin's length; ties: the owner with
        the older least recently used pin); None when no soft pin is live."""
        held: dict = {}
        oldest: dict = {}
        for p in self._pins.values():  # in the order added: the first of an owner at the oldest time wins ties
            if p.soft:
                held[p.owner] = held.get(p.owner, 0) + len(p.slots)
                if p.owner not in oldest or p.last_used < oldest[p.owner].last_used:
                    oldest[p.owner] = p
        if not held:
            return None
        owner = max(held, key=lambda o: (held[o], -oldest[o].last_used))
        return oldest[owner]

    def expire(self) -> int:
        """Drop the soft pins idle for ``idle_timeout`` seconds or more, then :meth:`victim` while
        more than ``max_tokens`` distinct tokens are soft-pinned; returns how many were dropped."""
        if not self._pins:
            return 0
        dropped = 0
        if self.idle_timeout is not None:
            now = self.clock()
            while self._lru:
                p = next(iter(self._lru.values()))  # the least recently used soft pin
                if now - p.last_used < self.idle_timeout:
                    break
                self.drop(p)
                dropped += 1
        while self.max_tokens is not None and len(self._soft) > self.max_tokens:
            self.drop(self.victim())  # soft tokens are counted, so a soft pin is live
            dropped += 1
        return dropped

    def drop_soft(self) -> int:
        """Drop every soft pin (a cache reset); returns how many."""
        soft = [p for p in self._pins.values() if p.soft]
        for p in soft:
            self.drop(p)
        return len(soft)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Raise AssertionError when a registered pin is dead or has no holder, or the distinct
        pinned-token counts disagree with the live pins."""
        counts: dict[int, int] = {}
        soft: dict[int, int] = {}
        for pin in self._pins.values():
            if pin.refs < 1 or not pin.live:
                raise AssertionError(f"a registered pin has {pin.refs} references (live={pin.live})")
            _count(counts, pin.slots, 1)
            if pin.soft:
                _count(soft, pin.slots, 1)
        if counts != self._counts or soft != self._soft:
            raise AssertionError("the pinned-token counts disagree with the live pins")
        lru = list(self._lru.values())
        if {id(p) for p in lru} != {id(p) for p in self._pins.values() if p.soft} or self._hard != len(
            self._pins
        ) - len(lru):
            raise AssertionError("the soft pins' LRU order or the hard pins' count disagrees with the live pins")
        if any(a.last_used > b.last_used for a, b in zip(lru, lru[1:])):
            raise AssertionError("the soft pins' LRU order is not least recently used first")


def _count(counts: dict, slots: List[int], d: int) -> None:
    """Add ``d`` (1 or -1) to the count of each of ``slots`` in ``counts`` (a count of 0 leaves)."""
    for s in slots:
        c = counts.get(s, 0) + d
        if c:
            counts[s] = c
        else:
            del counts[s]
