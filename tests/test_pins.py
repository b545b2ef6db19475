"""`PinTable` (radixkv/engine/pins.py) on its own: reference counts, distinct pinned-token counts,
the soft pins' least-recently-used order, idle timeout and token bound, on a fake clock. The
table moves nothing itself: every pin that dies is handed to its ``unhold`` callback exactly once
(recorded here); the last test checks the KV manager's callback unlocks or frees what it held."""

from __future__ import annotations

import pytest

from radixkv.cache import NoPrefixCache, RadixCache, SlotAllocator
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.pins import PinTable
from radixkv.engine.request import Request
from radixkv.memory.kv_pool import ReqToTokenPool
from radixkv.namespace import Namespace
from radixkv.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(**kw):
    clock = Clock()
    died = []
    table = PinTable(died.append, clock=clock, **kw)
    return table, clock, died


def test_references_and_distinct_token_counts():
    table, clock, died = make()
    a = table.add([0, 1, 2, 3], "node-a", 1, soft=True)
    clock.t = 2.0
    b = table.add([0, 1], None, 2, soft=False)  # shares slots 0, 1 with a
    assert (len(table), table.pinned_size(), table.has_hard()) == (2, 4, True)
    assert (a.last_used, b.last_used, a.refs, b.refs) == (0.0, 2.0, 1, 2)
    assert list(table) == [a, b]
    table.release(b)
    assert (b.live, b.refs, died) == (True, 1, [])
    table.release(b)
    assert (b.live, died, len(table), table.pinned_size(), table.has_hard()) == (False, [b], 1, 4, False)
    table.release(b)  # a dead pin: no-op, never handed back twice
    assert died == [b]
    clock.t = 5.0
    assert table.retain(a) and (a.refs, a.last_used) == (2, 5.0)
    table.release(a)
    table.release(a)
    assert (died, len(table), table.pinned_size(), table.dropped) == ([b, a], 0, 0, 0)
    assert not table.retain(a)  # dead: no new holder
    table.check_integrity()


def test_least_recently_used_order_follows_touch_and_retain():
    table, clock, _ = make()
    pins = []
    for i in range(3):
        clock.t = float(i)
        pins.append(table.add([10 * i], None, 1, soft=True))
    table.add([99], None, 1, soft=False)  # hard pins are never in the soft order
    a, b, c = pins
    assert table.victim() is a  # one owner: the least recently used soft pin
    clock.t = 3.0
    table.touch(a)
    assert table.victim() is b
    clock.t = 4.0
    table.retain(b)
    assert table.victim() is c
    table.drop(c)
    assert table.victim() is a
    table.drop(a)
    table.drop(b)
    assert table.victim() is None  # the hard pin is never a victim


def test_idle_timeout_drops_exactly_the_soft_pins_idle_that_long():
    table, clock, died = make(idle_timeout=10.0)
    a = table.add([0, 1], None, 1, soft=True)  # t = 0
    clock.t = 5.0
    b = table.add([2, 3], None, 2, soft=True)
    h = table.add([4], None, 1, soft=False)  # idle forever, never expires
    clock.t = 9.5
    assert table.expire() == 0 and died == []
    clock.t = 10.0  # a idle 10 s: dropped whatever its references
    assert table.expire() == 1
    assert (died, a.live, b.live, table.dropped, table.pinned_size()) == ([a], False, True, 1, 3)
    clock.t = 14.0
    table.touch(b)
    clock.t = 23.9
    assert table.expire() == 0
    clock.t = 24.0
    assert table.expire() == 1 and died == [a, b] and table.dropped == 2
    clock.t = 1000.0
    assert table.expire() == 0 and h.live and list(table) == [h]
    table.check_integrity()


def test_token_bound_drops_least_recently_used_soft_pins_until_within():
    table, clock, died = make(max_tokens=6)
    a = table.add([0, 1, 2, 3], None, 1, soft=True)  # t = 0
    clock.t = 1.0
    b = table.add([2, 3, 4, 5], None, 1, soft=True)  # slots 2, 3 shared: 6 distinct
    assert table.pinned_size() == 6 and table.expire() == 0
    clock.t = 2.0
    c = table.add([6, 7], None, 1, soft=True)  # 8 distinct > 6: a (least recently used) goes
    assert table.expire() == 1
    assert (died, table.pinned_size(), b.live, c.live) == ([a], 6, True, True)
    clock.t = 3.0
    h = table.add([10, 11, 12, 13, 14, 15, 16], None, 1, soft=False)  # hard: 13 distinct
    assert table.expire() == 0  # the bound is the soft pins': 6 distinct, within it
    assert (table.pinned_size(), table.soft_pinned_size(), b.live, c.live) == (13, 6, True, True)
    d = table.add([7, 16], None, 1, soft=True)  # slot 7 (c's) and 16 (h's): 7 soft-pinned
    assert table.expire() == 1  # b, the least recently used, goes
    assert (died, list(table), table.pinned_size(), table.dropped) == ([a, b], [c, h, d], 9, 2)


def test_the_owner_holding_the_most_loses_its_least_recently_used_pin_first():
    """The soft pins' bounds were one least-recently-used order for every tenant, so one
    tenant's newer pins (a flood of stored Responses) dropped another's older pin. The victim is
    now the least recently used pin of the owner holding the most tokens; one owner: plain LRU."""
    table, clock, died = make(max_tokens=8)
    alice = table.add([0, 1], None, 1, soft=True, owner="alice")  # the oldest
    mallory = []
    for i in range(3):
        clock.t = 1.0 + i
        mallory.append(table.add([10 + 2 * i, 11 + 2 * i], None, 1, soft=True, owner="mallory"))
    assert table.victim() is mallory[0]
    clock.t = 9.0
    table.add([30, 31, 32, 33], None, 1, soft=True, owner="mallory")  # 12 tokens > 8
    assert table.expire() == 2
    assert died == mallory[:2] and alice.live and table.dropped == 2
    clock.t = 10.0
    table.touch(mallory[2])
    assert table.victim().slots == [30, 31, 32, 33]  # mallory still holds the most: 6 of 8
    table.drop(table.victim())
    assert table.victim() is alice and table.victim() is not mallory[2]  # 2 tokens each: the older first
    one, _, _ = make()
    a = one.add([0], None, 1, soft=True)
    one.add([1, 2, 3], None, 1, soft=True)
    assert one.victim() is a  # one owner: least recently used
    table.check_integrity()


def test_a_tenants_pins_give_way_to_memory_before_another_tenants():
    """Through the KV manager: pins are owned by the request namespace's tenant; a running
    request short of memory drops the pins of the tenant holding the most first."""
    alice, mallory = Namespace(tenant="alice"), Namespace(tenant="mallory")
    kv = KVManager(RadixCache(1), SlotAllocator(16, 1), ReqToTokenPool(2, 16, "cpu"))
    kv.release(_served(kv, [1, 2, 3], alice))
    a = kv.pin_prefix([1, 2, 3], alice)
    pins = []
    for t in ([5, 6, 7, 8], [9, 10, 11, 12]):
        kv.release(_served(kv, t, mallory))
        pins.append(kv.pin_prefix(t, mallory))
    assert (kv.free_size(), kv.pinned_size()) == (5, 11)
    assert kv.yield_pins(9)  # 4 more slots: one of mallory's pins must go, not alice's older one
    assert (a.live, pins[0].live, pins[1].live, kv.dropped_pins) == (True, False, True, 1)
    kv.check_integrity([])


def test_drop_soft_keeps_hard_pins():
    table, clock, died = make()
    s1 = table.add([0], None, 3, soft=True)
    h = table.add([1, 2], None, 1, soft=False)
    s2 = table.add([3], None, 1, soft=True)
    assert table.drop_soft() == 2
    assert (died, list(table), table.dropped, table.pinned_size()) == ([s1, s2], [h], 2, 2)
    assert not s1.live and s1.refs == 3  # dropped for its holders: their handles are dead


def test_check_integrity_sees_a_miscount():
    table, _, _ = make()
    pin = table.add([0, 1], None, 1, soft=True)
    table.check_integrity()
    pin.slots.append(2)  # the table no longer counts what the pin holds
    with pytest.raises(AssertionError, match="pinned-token counts"):
        table.check_integrity()
    pin.slots.pop()
    pin.refs = 0
    with pytest.raises(AssertionError, match="0 references"):
        table.check_integrity()


def _served(kv, tokens, namespace=None):
    """``tokens`` computed by one request and handed to the cache (or freed without one)."""
    r = Request("r", 0, list(tokens), SamplingParams(), namespace)
    prefix = kv.lock_prefix(r)
    assert kv.reserve(len(tokens) - prefix.length, 0)
    kv.admit(r, prefix, len(tokens))
    r.kv_len = len(tokens)
    return r


def test_the_kv_manager_gives_back_what_a_dying_pin_held():
    # with a prefix cache: the pin's lock is released (tokens evictable), on the table's clock
    clock = Clock()
    kv = KVManager(
        RadixCache(1), SlotAllocator(16, 1), ReqToTokenPool(2, 16, "cpu"), pin_idle_timeout=10.0, clock=clock
    )
    kv.release(_served(kv, [1, 2, 3, 4, 5, 6]))
    pin = kv.pin_prefix([1, 2, 3, 4, 9])
    cache = kv.cache
    assert (len(pin), kv.num_pins, kv.pinned_size(), cache.protected_size(), cache.evictable_size()) == (4, 1, 4, 4, 2)
    assert kv.free_size() + cache.evictable_size() + kv.pinned_size() == kv.capacity
    clock.t = 10.0
    assert kv.expire_pins() == 1
    assert (pin.live, kv.dropped_pins, kv.pinned_size()) == (False, 1, 0)
    assert (cache.protected_size(), cache.evictable_size(), kv.free_size()) == (0, 6, 10)
    kv.check_integrity([])
    # without one: the pin owns sample 0's first pages, freed by the last holder
    kv = KVManager(NoPrefixCache(1), SlotAllocator(16, 1), ReqToTokenPool(2, 16, "cpu"))
    parent = _served(kv, [1, 2, 3, 4, 5])
    child = Request("r", 1, [1, 2, 3, 4, 5], SamplingParams())
    kv.fork(parent, [child])
    assert (parent.pin is child.pin, len(parent.pin), parent.pin.refs, parent.prefix_len) == (True, 4, 2, 4)
    pin = parent.pin
    kv.check_integrity([parent, child])
    kv.drop_pin(child)
    kv.release(parent)
    assert (pin.live, kv.free_size(), kv.num_pins, kv.pinned_size()) == (False, 16, 0, 0)
    kv.check_integrity([])


def test_the_idle_timeout_looks_only_at_the_pins_that_expire(monkeypatch):
    """Each step's ``expire`` read every live pin's ``last_used`` (10,000 stored Responses: 10,000
    reads a step); it now walks the soft pins least recently used first and stops at the first
    one still in use: the reads are the expired pins plus one, whatever the number of pins, and
    the same pins go (touched ones stay)."""
    import radixkv.engine.pins as pins_mod

    reads = [0]

    class CountingPin(pins_mod.Pin):
        @property
        def last_used(self):
            reads[0] += 1
            return self._last_used

        @last_used.setter
        def last_used(self, v):
            self._last_used = v

    monkeypatch.setattr(pins_mod, "Pin", CountingPin)
    table, clock, died = make(idle_timeout=10.0)
    pins = []
    for i in range(1000):
        clock.t = float(i // 100)  # 100 pins per second
        pins.append(table.add([i], None, 1, soft=True))
    table.add([5000], None, 1, soft=False)  # a hard pin never expires
    clock.t = 10.5
    table.touch(pins[0])  # used again: stays
    reads[0] = 0
    assert table.expire() == 99 and reads[0] == 100  # pins[1:100] idle 10.5 s; pins[100] idle 9.5 s
    assert died == pins[1:100] and pins[0].live and pins[100].live
    reads[0] = 0
    assert table.expire() == 0 and reads[0] == 1
    clock.t = 30.0
    assert table.expire() == 901 and len(table) == 1 and table.has_hard()
    table.check_integrity()
