"""KVPool layout and ReqToTokenPool row bookkeeping."""

from __future__ import annotations

import pytest
import torch

from radixkv.memory.kv_pool import KVPool, ReqToTokenPool


def test_kvpool_shapes_and_bytes_per_token():
    pool = KVPool(num_layers=30, num_kv_heads=3, head_dim=64, num_slots=64, page_size=16)
    assert pool.num_pages == 4
    assert len(pool.k_buffer) == len(pool.v_buffer) == 30
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        assert k.shape == v.shape == (4, 16, 3, 64)
        assert k.stride() == v.stride() and k.dtype == torch.float32
    # 2 (K and V) x 30 layers x 3 kv heads x 64 x 4 bytes
    assert pool.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert pool.total_bytes == 64 * 46080
    half = KVPool(2, 3, 64, 8, dtype=torch.bfloat16)
    assert half.bytes_per_token == 2 * 2 * 3 * 64 * 2
    assert half.k_buffer[0].shape == (8, 1, 3, 64)


def test_kvpool_write_lands_in_page_and_offset():
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=4, num_slots=12, page_size=4)
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    v = -k
    pool.write(1, torch.tensor([5, 11, 0]), k, v)
    assert torch.equal(pool.k_buffer[1][1, 1], k[0])  # slot 5 = page 1, offset 1
    assert torch.equal(pool.k_buffer[1][2, 3], k[1])  # slot 11 = page 2, offset 3
    assert torch.equal(pool.v_buffer[1][0, 0], v[2])
    assert pool.k_buffer[0].abs().sum() == 0  # other layer untouched
    assert int((pool.k_buffer[1] != 0).any(-1).any(-1).sum()) == 3  # exactly the 3 written slots


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_layers=0, num_kv_heads=1, head_dim=4, num_slots=4), "num_layers"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=0), "num_slots"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=10, page_size=4), "multiple of page_size"),
        (dict(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=8, page_size=0), "page_size"),
    ],
)
def test_kvpool_rejects_bad_sizes(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVPool(**kwargs)


def test_req_to_token_pool_alloc_free():
    pool = ReqToTokenPool(max_running_requests=3, max_context_len=16)
    assert pool.req_to_token.shape == (3, 16) and pool.req_to_token.dtype == torch.int32
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert pool.alloc() is None and pool.available_size() == 0
    pool.free(rows[1])
    assert pool.available_size() == 1
    assert pool.alloc() == rows[1]
    pool.free(rows[0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(rows[0])
    with pytest.raises(ValueError, match="out of range"):
        pool.free(3)
    assert pool.available_size() == 1


def test_req_to_token_pool_write_bounds():
    pool = ReqToTokenPool(2, 8)
    row = pool.alloc()
    pool.write(row, 2, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[row, 2:5].tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="max_context_len 8"):
        pool.write(row, 6, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="max_running_requests"):
        ReqToTokenPool(0, 8)


def test_req_to_token_pool_write_casts_like_torch():
    """The CPU write goes through a numpy view: int64 slots land as int32 exactly as torch's cast
    gives them (also a read-only view's slots, as the radix tree hands out), other rows untouched."""
    pool = ReqToTokenPool(3, 16)
    pool.write(1, 0, torch.arange(5, 21))
    slots = torch.tensor([2**31 + 3, -1, 2**33 + 7, 0], dtype=torch.int64)
    pool.write(2, 4, slots)
    assert pool.req_to_token[2, 4:8].tolist() == slots.to(torch.int32).tolist()
    assert pool.req_to_token[1].tolist() == list(range(5, 21))
    view = torch.frombuffer(bytearray(torch.tensor([9, 10, 11]).numpy().tobytes()), dtype=torch.int64)
    pool.write(0, 13, view)
    assert pool.req_to_token[0, 13:].tolist() == [9, 10, 11]
    assert pool.req_to_token[0, :13].tolist() == [0] * 13
    pool.write(0, 16, torch.empty(0, dtype=torch.int64))  # an empty write at the end is fine
    with pytest.raises(IndexError):
        pool.write(3, 0, torch.tensor([1]))
