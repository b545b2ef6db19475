"""`PinTable` (radixkv/engine/pins.py) on its own: reference counts, distinct pinned-token counts,
the soft pins' least-recently-used order, idle timeout and token bound, on a fake clock. The
table moves nothing itself: every pin that dies is handed to its ``unhold`` callback exactly once
(the KV manager's, which unlocks or frees what the pin held), recorded here."""

from __future__ import annotations

import pytest

from radixkv.engine.pins import PinTable


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
    assert table.soft_lru() == [a, b, c]
    clock.t = 3.0
    table.touch(a)
    assert table.soft_lru() == [b, c, a]
    clock.t = 4.0
    table.retain(b)
    assert table.soft_lru() == [c, a, b]


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
    assert table.expire() == 2  # every soft pin goes; the hard one alone exceeds the bound and stays
    assert (died, list(table), table.pinned_size(), table.dropped) == ([a, b, c], [h], 7, 3)


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
