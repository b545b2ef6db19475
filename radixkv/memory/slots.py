"""The slot arrays that cross the allocator and prefix-cache APIs, without importing torch.

KV slots are int64 indices into the KV pool. The allocator and the prefix caches compute on
``numpy.int64`` arrays; what they hand out (:func:`slot_array`) is a 1-D ``torch.int64`` CPU
tensor sharing that memory when torch can be imported, else the numpy array itself. So the
allocator and the trees run where torch is not installed (a router, a simulator) and give the
engine tensors it writes straight into ``req_to_token``. Inputs may be either form (or any
integer sequence): :func:`as_int64` reads them.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable

import numpy as np

__all__ = ["slot_array", "empty_slots", "buffer_reader", "as_int64", "is_tensor", "torch_available"]

_torch: Any = None  # the torch module once looked up, False when it cannot be imported


def _torch_module() -> Any:
    global _torch
    if _torch is None:
        try:
            import torch
        except ImportError:
            _torch = False
        else:
            _torch = torch
    return _torch


def torch_available() -> bool:
    """True when torch can be imported (then :func:`slot_array` returns tensors)."""
    return bool(_torch_module())


def is_tensor(x: Any) -> bool:
    """True when ``x`` is a torch tensor (without importing torch: if torch was never imported,
    nothing can be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def slot_array(arr: np.ndarray | bytes | bytearray) -> Any:
    """A 1-D int64 slot array over ``arr`` (an int64 numpy array, or a bytes-like buffer of
    native int64): a ``torch.int64`` CPU tensor sharing its memory when torch imports, else a
    numpy array. A ``bytes`` buffer is copied once (tensors need writable memory)."""
    torch = _torch_module()
    if isinstance(arr, (bytes, bytearray)):
        if torch:
            buf = arr if isinstance(arr, bytearray) else bytearray(arr)
            return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)
        return np.frombuffer(arr, dtype=np.int64).copy()
    if torch:
        return torch.from_numpy(arr)
    return arr


def buffer_reader() -> Callable[[bytes | bytearray], Any]:
    """A fast ``f(buf)`` turning a non-empty ``bytes`` / ``bytearray`` of native int64 into a
    slot array that shares it (``torch.frombuffer`` or ``numpy.frombuffer``; no copy), for hot
    paths. Over ``bytes`` the result is a read-only view: numpy marks it so, torch cannot (it
    has no read-only tensors and warns once per process when it is given a read-only buffer;
    that one warning is taken here, silenced, the first time a reader is made, because the
    radix tree hands out such views by design: see ``RadixCache.match_prefix``)."""
    torch = _torch_module()
    if torch:
        _take_readonly_warning(torch)
        return functools.partial(torch.frombuffer, dtype=torch.int64)
    return functools.partial(np.frombuffer, dtype=np.int64)


_readonly_warning_taken = False


def _take_readonly_warning(torch: Any) -> None:
    """Lets torch emit its once-per-process "buffer is not writable" warning now, silenced."""
    global _readonly_warning_taken
    if not _readonly_warning_taken:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            torch.frombuffer(bytes(8), dtype=torch.int64)
        _readonly_warning_taken = True


def empty_slots() -> Any:
    """An empty slot array (see :func:`slot_array`)."""
    return slot_array(np.empty(0, dtype=np.int64))


def as_int64(slots: Any, name: str = "slots") -> np.ndarray:
    """An int64 numpy view (or copy) of a 1-D integer tensor, array or sequence of slots.

    Raises:
        ValueError: naming ``name``: not 1-D, not integers, a tensor not on the CPU (or one
            that requires grad), or a value outside int64.
    """
    if is_tensor(slots):
        try:
            arr = slots.numpy()  # raises for CUDA tensors and tensors that require grad
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"{name} must be a plain CPU tensor ({e})") from None
    else:
        arr = np.asarray(slots)
    if arr.ndim == 1 and arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        what = (
            "integers in the int64 range"
            if arr.ndim == 1 and arr.dtype.kind in "fO" and not (is_tensor(slots) or isinstance(slots, np.ndarray))
            else "a 1-D integer tensor"
        )
        raise ValueError(f"{name} must be {what}, got shape {arr.shape} dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} must fit in int64, got {int(arr.max())}")
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)
