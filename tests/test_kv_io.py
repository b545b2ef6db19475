"""radixkv/memory/kv_io.py: a block of the KV pool copied out and back bit for bit, whatever the
pool's dtype, page size and per-slot tensors (fp8 K/V with bfloat16 scales included), and a block
of another layout refused."""

from __future__ import annotations

import pytest
import torch

from radixkv.memory.kv_io import gather_block, gather_rows, layout_of, scatter_block, scatter_rows
from radixkv.memory.kv_pool import KVPool


def _pool(dtype, page_size, scales=False, num_slots=64, seed=0):
    """A KVPool filled with random bits (every byte pattern, NaNs included), with fp8-style
    per-(token, head) bfloat16 ``k_scale`` / ``v_scale`` when ``scales``."""
    pool = KVPool(3, 2, 8, num_slots, page_size, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    if scales:
        shape = (pool.num_pages, page_size, pool.num_kv_heads)
        pool.k_scale = [torch.rand(shape, generator=g).to(torch.bfloat16) for _ in range(3)]
        pool.v_scale = [torch.rand(shape, generator=g).to(torch.bfloat16) for _ in range(3)]
    return pool


def _slot_bytes(pool, slot):
    lay = layout_of(pool)
    return b"".join(v[slot].numpy().tobytes() for v in lay.views)


CASES = [
    (torch.float32, 1, False),
    (torch.float32, 16, False),
    (torch.bfloat16, 4, False),
    (torch.float16, 32, False),
    (torch.float8_e4m3fn, 1, True),
    (torch.float8_e5m2, 16, True),
]


@pytest.mark.parametrize("dtype,page_size,scales", CASES)
def test_block_round_trip_is_bit_exact(dtype, page_size, scales):
    src = _pool(dtype, page_size, scales, seed=1)
    dst = _pool(dtype, page_size, scales, seed=2)
    slots = [5, 63, 0, 17, 18, 40, 33, 2, 9, 50, 51, 52, 7, 12, 30, 44]
    payload, meta = gather_block(src, slots)
    lay = layout_of(src)
    per_slot = 2 * 3 * 2 * 8 * torch.empty((), dtype=dtype).element_size() + (2 * 3 * 2 * 2 if scales else 0)
    assert lay.token_bytes == per_slot and len(payload) == 16 * per_slot
    into = [60, 1, 2, 3, 4, 6, 8, 10, 11, 13, 14, 15, 16, 19, 20, 21]
    before = {s: _slot_bytes(dst, s) for s in range(64)}
    scatter_block(dst, into, payload, meta)
    for a, b in zip(slots, into):
        assert _slot_bytes(dst, b) == _slot_bytes(src, a)
    for s in set(range(64)) - set(into):  # nothing else written
        assert _slot_bytes(dst, s) == before[s]


def test_rows_are_slots_in_order_and_a_copy():
    pool = _pool(torch.float32, 4)
    rows = gather_rows(pool, torch.tensor([3, 1]))
    assert rows.dtype == torch.uint8 and tuple(rows.shape) == (2, layout_of(pool).token_bytes)
    assert rows[0].numpy().tobytes() == _slot_bytes(pool, 3) and rows[1].numpy().tobytes() == _slot_bytes(pool, 1)
    kept = rows.clone()
    pool.k_buffer[0].zero_()
    assert torch.equal(rows, kept)  # the pool's later writes do not reach it
    scatter_rows(pool, [1, 3], kept.flip(0))
    assert _slot_bytes(pool, 1) == kept[1].numpy().tobytes() and _slot_bytes(pool, 3) == kept[0].numpy().tobytes()


def test_a_block_of_another_layout_is_refused():
    f32, bf16, fp8 = _pool(torch.float32, 1), _pool(torch.bfloat16, 1), _pool(torch.float8_e4m3fn, 1, scales=True)
    payload, meta = gather_block(f32, list(range(16)))
    for other in (bf16, fp8):
        with pytest.raises(ValueError, match="layout"):
            scatter_block(other, list(range(16)), payload, meta)
    with pytest.raises(ValueError, match="payload"):
        scatter_block(_pool(torch.float32, 16), list(range(16)), payload[:-1], meta)
    with pytest.raises(ValueError, match="uint8"):
        scatter_rows(f32, [0], torch.zeros(1, 3, dtype=torch.uint8))


def test_layout_does_not_depend_on_the_page_size():
    a, b = _pool(torch.bfloat16, 1), _pool(torch.bfloat16, 16)
    assert layout_of(a).meta == layout_of(b).meta
    assert layout_of(a).meta != layout_of(_pool(torch.float16, 1)).meta
    payload, meta = gather_block(a, list(range(16)))
    scatter_block(b, list(range(32, 48)), payload, meta)
    assert all(_slot_bytes(b, 32 + i) == _slot_bytes(a, i) for i in range(16))
