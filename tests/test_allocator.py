"""SlotAllocator: exact slot ids, page layout, double-free and range errors, a seeded fuzz."""

import random

import numpy as np
import pytest
import torch

from radixkv.cache import SlotAllocator

pytestmark = pytest.mark.timeout(60)


def test_constructor_validation():
    with pytest.raises(ValueError, match="multiple of page_size"):
        SlotAllocator(10, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        SlotAllocator(8, page_size=0)
    with pytest.raises(ValueError, match="num_slots"):
        SlotAllocator(-4)
    a = SlotAllocator(12, page_size=4)
    assert (a.num_slots, a.page_size, a.num_pages, a.available_size()) == (12, 4, 3, 12)


def test_alloc_exact_ids_and_exhaustion():
    a = SlotAllocator(8)
    s = a.alloc(3)
    assert s.dtype == torch.int64 and s.tolist() == [0, 1, 2]
    assert a.alloc(5).tolist() == [3, 4, 5, 6, 7]
    assert a.available_size() == 0
    assert a.alloc(1) is None
    assert a.alloc(0).tolist() == []
    a.free(torch.tensor([6, 2]))
    assert a.available_size() == 2
    assert a.alloc(3) is None and a.available_size() == 2  # a failed alloc takes nothing
    assert sorted(a.alloc(2).tolist()) == [2, 6]


def test_alloc_rejects_bad_n():
    a = SlotAllocator(16, page_size=4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(6)
    with pytest.raises(ValueError, match="n must be"):
        a.alloc(-4)


def test_pages_contiguous_ascending_and_whole_page_free():
    a = SlotAllocator(16, page_size=4)
    s = a.alloc(8)
    assert s.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    t = a.alloc(4)
    assert t.tolist() == [8, 9, 10, 11]
    # Freeing any slots of a page frees the whole page, each page once.
    a.free(torch.tensor([1, 3, 5]))
    assert a.available_size() == 4 + 8
    with pytest.raises(ValueError, match="not allocated"):
        a.free(torch.tensor([2]))  # page 0 is already free
    again = a.alloc(8)
    pages = again.view(-1, 4)
    assert sorted(pages[:, 0].tolist()) == [0, 4]
    assert all(p.tolist() == list(range(int(p[0]), int(p[0]) + 4)) for p in pages)


def test_double_free_and_never_allocated_raise_without_side_effects():
    a = SlotAllocator(8)
    s = a.alloc(4)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([5])  # never handed out
    with pytest.raises(ValueError, match="more than once"):
        a.free([1, 1])
    with pytest.raises(ValueError, match=r"\[0, num_slots=8\)"):
        a.free([8])
    with pytest.raises(ValueError, match=r"\[0, num_slots=8\)"):
        a.free([-1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([0, 5])  # one good, one bad: nothing is freed
    assert a.available_size() == 4
    a.free(s)
    assert a.available_size() == 8
    with pytest.raises(ValueError, match="not allocated"):
        a.free(s)
    with pytest.raises(ValueError, match="1-D integer"):
        a.free(torch.zeros(2, 2, dtype=torch.int64))


def test_accepts_int32_tensors_lists_and_empty():
    a = SlotAllocator(6)
    s = a.alloc(6)
    a.free(s[:2].to(torch.int32))
    a.free(s[2:4].tolist())
    a.free(np.array(s[4:].tolist()))
    a.free([])
    assert a.available_size() == 6


@pytest.mark.parametrize("page_size", [1, 4])
def test_seeded_fuzz_against_set_oracle(page_size):
    rng = random.Random(1234 + page_size)
    a = SlotAllocator(256, page_size)
    owned: list = []  # allocations held, each a list of slots
    held = set()
    for _ in range(2000):
        if owned and rng.random() < 0.45:
            chunk = owned.pop(rng.randrange(len(owned)))
            a.free(torch.tensor(chunk))
            held -= set(chunk)
        else:
            n = rng.randrange(0, 9) * page_size
            before = a.available_size()
            s = a.alloc(n)
            if s is None:
                assert n > before == a.available_size()
                continue
            got = s.tolist()
            assert len(got) == n and not held & set(got)
            for p in range(0, n, page_size):
                assert got[p] % page_size == 0
                assert got[p : p + page_size] == list(range(got[p], got[p] + page_size))
            held |= set(got)
            if got:
                owned.append(got)
        assert a.available_size() + len(held) == 256
        assert all(0 <= x < 256 for x in held)


@pytest.mark.parametrize("n", [3, 200])  # the plain-Python path (<= 64 slots) and the numpy path
@pytest.mark.parametrize("page_size", [1, 4])
def test_small_and_large_frees_check_the_same_things(n, page_size):
    a = SlotAllocator(1024, page_size)
    s = a.alloc(-(-n // page_size) * page_size)[:n]
    other = a.alloc(page_size)
    with pytest.raises(ValueError, match="more than once"):
        a.free(torch.cat([s, s[:1]]))
    with pytest.raises(ValueError, match=r"\[0, num_slots=1024\)"):
        a.free(torch.cat([s, torch.tensor([1024])]))
    with pytest.raises(ValueError, match=r"\[0, num_slots=1024\)"):
        a.free(torch.cat([s, torch.tensor([-1])]))
    with pytest.raises(ValueError, match="not allocated"):
        a.free(torch.cat([s, torch.tensor([1000])]))
    with pytest.raises(ValueError, match="1-D integer"):
        a.free(s.to(torch.float32))
    assert a.available_size() == 1024 - len(s) - (-len(s)) % page_size - page_size
    a.free(s)
    assert a.available_size() == 1024 - page_size
    with pytest.raises(ValueError, match="not allocated"):
        a.free(s)
    a.free(other)
    assert a.available_size() == 1024
