"""`BatchSharing` (radixkv/engine/batch_sharing.py) on its own: the index of what rows published
in the forward being planned compute, and the exact borrow and rider decisions made on it (whole
pages, all but the last token, ``max_prefix_len``, riders only when a row computes the last
position now). The engine-level behaviour is tests/test_in_batch_sharing.py's."""

from __future__ import annotations

import torch

from radixkv.engine.batch_sharing import BatchSharing, Borrow
from radixkv.engine.request import Request
from radixkv.sampling_params import SamplingParams


def req(tokens, slots=(), kv_len=0, rid="r"):
    r = Request(rid, 0, list(tokens), SamplingParams())
    r.slots = list(slots)
    r.kv_len = kv_len
    return r


def publish(sharing, r, upto):
    n = upto // sharing.page_size * sharing.page_size
    sharing.publish(r, upto, torch.tensor(r.slots[:n], dtype=torch.int64))


def view(b):
    """A borrow as plain values: (length, its slots, rider source or None)."""
    if b is None:
        return None
    assert isinstance(b, Borrow)
    src = None if b.logits_from is None else (b.logits_from[0].request_id, b.logits_from[1])
    return b.length, b.slots[: b.length].tolist(), src


def test_borrow_and_riders_at_page_size_1():
    s = BatchSharing(1)
    a = req([1, 2, 3, 4, 5], range(10, 15), rid="a")
    assert not s.planning and s.borrow(req([1, 2, 3])) is None  # no plan open
    s.begin()
    assert s.planning and s.borrow(req([1, 2, 3])) is None  # nothing published yet
    publish(s, a, 5)
    assert view(s.borrow(req([1, 2, 3, 9]))) == (3, [10, 11, 12], None)  # the common prefix
    assert view(s.borrow(req([1, 2, 3, 4, 5, 6]))) == (5, [10, 11, 12, 13, 14], None)  # all but its last
    assert view(s.borrow(req([1, 2, 3, 4, 5]))) == (5, [10, 11, 12, 13, 14], ("a", 4))  # identical: rider
    assert view(s.borrow(req([1, 2, 3]))) == (3, [10, 11, 12], ("a", 2))  # a prefix of a: rider too
    assert s.borrow(req([7, 1, 2])) is None  # nothing in common
    assert s.prefix_len(req([1, 2, 3, 4, 5])) == 5 and s.prefix_len(req([1, 2, 9])) == 2
    pinned = req([1, 2, 3, 4])
    pinned.pin = object()  # a request admitted on its pin borrows nothing
    assert s.borrow(pinned) is None
    s.end()
    assert not s.planning and s.borrow(req([1, 2, 3, 9])) is None and s.computing(12, 2) is None


def test_prompt_logprobs_limit_the_borrow_and_rule_out_riding():
    s = BatchSharing(1)
    s.begin()
    publish(s, req([1, 2, 3, 4, 5], range(10, 15), rid="a"), 5)
    r = req([1, 2, 3, 4, 5])
    r.prompt_lp_pos = 2  # the logits of positions 2.. are needed: computed by r itself
    assert r.max_prefix_len == 2 and s.borrow_limit(r) == 2
    assert view(s.borrow(r)) == (2, [10, 11], None)


def test_only_positions_computed_in_this_forward_make_a_rider():
    s = BatchSharing(1)
    s.begin()
    a = req([1, 2, 3, 4, 5], range(10, 15), kv_len=3, rid="a")  # [0, 3) computed in an earlier step
    publish(s, a, 5)
    assert s.computing(13, 3) is a and s.computing(11, 1) is None and s.computing(99, 3) is None
    # [1, 2] ends at position 1, whose logits were computed in an earlier forward: no rider, it
    # borrows all but its last token and computes that one again
    assert view(s.borrow(req([1, 2]))) == (1, [10], None)
    assert view(s.borrow(req([1, 2, 3, 4]))) == (4, [10, 11, 12, 13], ("a", 3))


def test_whole_pages_only_at_page_size_4():
    s = BatchSharing(4)
    s.begin()
    a = req(range(100, 110), range(40, 50), rid="a")  # 10 tokens: pages [0, 8) published
    publish(s, a, 10)
    b = req(list(range(100, 109)) + [7, 7, 7])  # 12 tokens, 9 in common with a
    assert view(s.borrow(b)) == (8, list(range(40, 48)), None)
    assert view(s.borrow(req(range(100, 110)))) == (8, list(range(40, 48)), None)  # identical, partial page: no rider
    assert view(s.borrow(req(range(100, 108)))) == (8, list(range(40, 48)), ("a", 7))  # ends on a page: rider
    assert s.borrow(req(range(100, 103))) is None  # no whole page in common
    assert view(s.borrow(req(range(100, 106)))) == (4, [40, 41, 42, 43], None)


def test_disabled_sharing_publishes_nothing():
    s = BatchSharing(1, enabled=False)
    s.begin()
    publish(s, req([1, 2, 3], range(3), rid="a"), 3)
    assert not s.planning and s.borrow(req([1, 2, 3, 4])) is None and s.prefix_len(req([1, 2, 3])) == 0
    s.enabled = True  # read at the next plan
    s.begin()
    publish(s, req([1, 2, 3], range(3), rid="a"), 3)
    assert s.prefix_len(req([1, 2, 3, 4])) == 3
