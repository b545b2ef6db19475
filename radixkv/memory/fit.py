"""Whether a KV pool fits in its device's memory, checked before its tensors are allocated.

A pool larger than the memory left would otherwise fail inside torch (a ``TypeError`` past
int64, an allocator ``RuntimeError``) or, on the CPU with overcommit, be killed by the kernel's
OOM killer while ``torch.zeros`` touches its pages: :func:`check_pool_fits` turns every such
size into a ``ValueError`` naming the field the user gave and the limit.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

__all__ = ["free_memory_bytes", "check_pool_fits", "check_table_fits"]


def _mem_available() -> Optional[int]:
    """Linux's ``MemAvailable`` (bytes), else free pages times the page size, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def free_memory_bytes(device: Union[str, torch.device]) -> Optional[int]:
    """Bytes a new tensor on ``device`` may take now: CUDA's free memory
    (``torch.cuda.mem_get_info``), the host's available memory on the CPU; None when unknown
    (then nothing is refused)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type == "cpu":
        return _mem_available()
    return None


def check_pool_fits(num_slots: int, bytes_per_token: int, device: Union[str, torch.device], given: str) -> None:
    """Refuse a pool of ``num_slots`` tokens of ``bytes_per_token`` bytes (scales included) that
    the memory available on ``device`` (:func:`free_memory_bytes`) cannot hold.

    Args:
        given: the setting that sized the pool, for the message (``"kv_cache_memory_bytes 2GiB"``,
            ``"max_total_tokens 100000"``, ``"the default KV pool"``).

    Raises:
        ValueError: naming ``given``, the pool's bytes and the bytes available.
    """
    need = int(num_slots) * int(bytes_per_token)
    free = free_memory_bytes(device)
    if free is not None and need > free:
        hint = "give kv_cache_memory_bytes or max_total_tokens" if given.startswith("the default") else "give less"
        raise ValueError(
            f"{given}: a KV pool of {num_slots} tokens x {bytes_per_token} bytes = {need} bytes, more than the "
            f"{free} bytes of memory available on {torch.device(device)}; {hint}"
        )


def check_table_fits(
    max_running_requests: int, max_context_len: int, page_size: int, device: Union[str, torch.device]
) -> None:
    """Refuse a block table (``ReqToTokenPool``: ``max_running_requests`` int32 rows of
    ``max_context_len`` rounded up to whole pages) that the memory available on ``device`` cannot
    hold, before it is allocated (a torch allocator error from deep inside otherwise).

    Raises:
        ValueError: naming ``max_running_requests``, the table's bytes and the bytes available.
    """
    width = -(-int(max_context_len) // int(page_size)) * int(page_size)
    need = int(max_running_requests) * width * 4
    free = free_memory_bytes(device)
    if free is not None and need > free:
        raise ValueError(
            f"max_running_requests {max_running_requests}: its block table of {max_running_requests} rows x "
            f"{width} tokens (max_context_len) x 4 bytes = {need} bytes, more than the {free} bytes of memory "
            f"available on {torch.device(device)}; give fewer"
        )
