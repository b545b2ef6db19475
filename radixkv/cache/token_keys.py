"""Token keys of the radix tree and its descent, in C or pure Python.

An edge's tokens are stored as a ``bytes`` object of int32 ids (4 bytes a token, native byte
order), its slots as a ``bytes`` object of int64 slot indices. ``pack_int32``,
``common_prefix_len``, ``match_walk`` (``match_prefix``'s descent plus the slot read-out) and
``insert_walk`` (``insert``'s descent plus the new leaf's key and slots) come from the optional C
helper ``radixkv.cache._cprefix`` (csrc/prefix_match.c) when it is built, else they are the
pure-Python :func:`pack_int32_py` / :func:`common_prefix_len_py` / :func:`match_walk_py` /
:func:`insert_walk_py` (same results; tested equal). The C walks read a query's list of ints in
place, without packing it first. ``RADIXKV_NO_CEXT=1`` forces the Python path; callers look the
functions up on this module at call time, so :func:`use_python_path` can swap them.
"""

from __future__ import annotations

import ctypes
import operator
import os
import sys
from array import array

import numpy as np

from radixkv.cache.base import Tokens
from radixkv.memory.slots import as_int64, is_tensor

__all__ = [
    "TOKEN_SHIFT",
    "SLOT_SHIFT",
    "HAS_CEXT",
    "NotAnInt",
    "pack_int32",
    "common_prefix_len",
    "match_walk",
    "insert_walk",
    "pack_int32_py",
    "common_prefix_len_py",
    "match_walk_py",
    "insert_walk_py",
    "walk_py",
    "walk_slots_py",
    "read_int64_py",
    "pack_tokens",
    "query_tokens",
    "int_tokens",
    "int_tokens_for_retry",
    "as_slot_array",
    "slot_tensor_address",
    "use_python_path",
]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
TOKEN_SHIFT = 2
"""A key holds int32 token ids: bytes = tokens << TOKEN_SHIFT, tokens = bytes >> TOKEN_SHIFT."""
SLOT_SHIFT = 3
"""A value holds int64 slot indices: bytes = slots << SLOT_SHIFT, slots = bytes >> SLOT_SHIFT."""
assert array("i").itemsize == 1 << TOKEN_SHIFT, "radixkv needs a 4-byte C int"


def pack_int32_py(seq) -> bytes:
    """int32 buffer (native byte order) of a list/tuple of token ids (pure Python).

    Raises:
        ValueError: an id outside the int32 range. TypeError: an item that is not an int.
    """
    try:
        return array("i", seq).tobytes()
    except IndexError:  # an item's __index__ shortened the list
        raise ValueError("tokens changed length while being read") from None
    except TypeError:  # not an integer: int_tokens raises naming the position
        return array("i", int_tokens(seq)).tobytes()
    except OverflowError:
        raise ValueError(f"token ids must fit in int32 (must be in [{_INT32_MIN}, {_INT32_MAX}])") from None


def common_prefix_len_py(a: bytes, b: bytes, start: int, limit: int) -> int:
    """Common-prefix length, in tokens, of int32 buffers ``a`` and ``b[start:limit]``.

    Args:
        a, b: int32 token buffers.
        start, limit: token range of ``b`` compared, ``0 <= start <= limit <= len(b) // 4``.

    Returns:
        The largest ``m <= min(len(a) // 4, limit - start)`` with ``a[:m] == b[start:start+m]``.
        One ``memcmp`` when the whole range matches, else a binary search over prefixes.
    """
    n = min(len(a) >> TOKEN_SHIFT, limit - start)
    off = start << TOKEN_SHIFT
    if a[: n << TOKEN_SHIFT] == b[off : off + (n << TOKEN_SHIFT)]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if a[: mid << TOKEN_SHIFT] == b[off : off + (mid << TOKEN_SHIFT)]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def walk_py(node, kb: bytes, n: int, page_size: int, tick: int) -> tuple:
    """The radix tree's descent (pure Python; same contract as the C ``walk``).

    From ``node``, follows the child keyed by the next page of ``kb`` while the child's whole
    edge matches the first ``n`` tokens of ``kb``, setting each such child's ``last_access`` to
    ``tick``.

    Args:
        node: start node (``children`` dict keyed by first-page bytes; ``key`` int32 bytes;
            ``value`` int64 slot bytes).
        kb: int32 token buffer of the query.
        n: tokens of ``kb`` to match, a multiple of ``page_size``.
        page_size: tokens per page.
        tick: the access time to record.

    Returns:
        ``(node, pos, split_child, m)``: the deepest fully matched node, the tokens matched up
        to it, and, when the walk stopped at an edge that matches only its first ``m`` tokens
        (``m`` a positive multiple of ``page_size``), that child (not updated; the caller
        splits it), else ``None`` and 0.
    """
    pb = page_size << TOKEN_SHIFT
    pos = 0
    cpl = common_prefix_len
    while pos < n:
        child = node.children.get(kb[pos << TOKEN_SHIFT : (pos << TOKEN_SHIFT) + pb])
        if child is None:
            break
        m = cpl(child.key, kb, pos, n)
        if page_size > 1:
            m -= m % page_size
        if m << TOKEN_SHIFT < len(child.key):
            return node, pos, child, m
        child.last_access = tick
        pos += m
        node = child
    return node, pos, None, 0


def walk_slots_py(node, kb: bytes, n: int, page_size: int, tick: int) -> tuple:
    """:func:`walk_py` plus the slot read-out of a match (pure Python; the descent of
    :func:`match_walk_py`, same results as the C ``match_walk``).

    Returns:
        ``(node, pos, slots, split_child, m)`` as :func:`walk_py`, plus ``slots``: the
        ``pos + m`` matched int64 slots (every fully matched edge's, then the first ``m`` of
        ``split_child``'s edge), for ``torch.frombuffer``: the matched node's own ``value``
        (``bytes``, shared) when one edge is fully matched and nothing is split; new ``bytes``
        of ``split_child``'s first ``m`` slots when only that edge matched (what splitting it
        makes the upper node's value); ``b""`` for no match; else a new ``bytearray``.
        (Collected afterwards through the matched nodes' ``parent`` links.)
    """
    end, pos, child, m = walk_py(node, kb, n, page_size, tick)
    values = []
    cur = end
    while cur is not node:
        values.append(cur.value)
        cur = cur.parent
    if child is not None:
        if not values:
            return end, pos, child.value[: m << SLOT_SHIFT], child, m
        values.reverse()
        values.append(child.value[: m << SLOT_SHIFT])
    elif len(values) <= 1:
        return end, pos, values[0] if values else b"", child, m
    else:
        values.reverse()
    return end, pos, bytearray().join(values), child, m


def read_int64_py(address: int, count: int) -> bytes:
    """Copy of ``count`` int64 values at ``address`` (via ``ctypes``). ``address`` must come from
    :func:`slot_tensor_address` (plus ``8 * start``) of a tensor that stays alive during the call.

    Raises:
        ValueError: ``count < 0``, or a null ``address`` with ``count > 0``.
    """
    if count < 0 or (address == 0 and count > 0):
        raise ValueError(f"read_int64: need a non-null address and count >= 0, got count={count}")
    return ctypes.string_at(address, count << SLOT_SHIFT) if count else b""


def _as_int32_bytes(tokens) -> bytes:
    """int32 bytes of a walk's query: the tree's own int32 ``bytes``, a list/tuple of ints, or a
    1-D buffer of format i / l / q (int64 ids range-checked)."""
    t = type(tokens)
    if t is bytes:
        return tokens
    if t is list or t is tuple:
        return pack_int32_py(tokens)
    arr = np.frombuffer(tokens, dtype=_BUFFER_DTYPES[_buffer_format(tokens)])
    if arr.dtype.itemsize == 4:
        return arr.tobytes()
    return _narrow_int64(arr).tobytes()


def _narrow_int64(arr: np.ndarray) -> np.ndarray:
    """int32 copy of an int64 array of token ids. Raises ValueError naming the first id outside
    int32."""
    out = arr.astype(np.int32)
    if arr.size and not np.array_equal(out, arr):
        i = int(np.flatnonzero(out != arr)[0])
        raise ValueError(f"token id at position {i} does not fit in int32 (must be in [{_INT32_MIN}, {_INT32_MAX}])")
    return out


_BUFFER_DTYPES = {"i": np.int32, "l": np.dtype("l"), "q": np.int64}


def _buffer_format(buf) -> str:
    """'i', 'l' or 'q' for a 1-D C-contiguous memoryview-able buffer of those, else ''."""
    mv = memoryview(buf)
    f = mv.format.lstrip("@=<" if sys.byteorder == "little" else "@")
    if mv.ndim == 1 and mv.c_contiguous and f in ("i", "l", "q") and mv.itemsize in (4, 8):
        return f
    return ""


def match_walk_py(node, tokens, page_size: int, tick: int) -> tuple:
    """``match_prefix``'s descent and slot read-out (pure Python; same contract as the C
    ``match_walk``).

    Args:
        node: the namespace root to start from.
        tokens: list/tuple of int, or an int32 ``bytes`` buffer; ``n = len(tokens)`` floored to
            ``page_size`` tokens are matched. Every token is validated before anything changes.
        page_size: tokens per page (>= 1).
        tick: the access time recorded on the fully matched nodes.

    Returns:
        ``(node, pos, slots, split_child, m)`` as :func:`walk_slots_py`.

    Raises:
        ValueError / TypeError: a token id that is not an int in the int32 range.
    """
    kb = _as_int32_bytes(tokens)
    n = len(kb) >> TOKEN_SHIFT
    return walk_slots_py(node, kb, n - n % page_size, page_size, tick)


def insert_walk_py(node, tokens, page_size: int, tick: int, address: int) -> tuple:
    """``insert``'s descent plus the new leaf's key and slots (pure Python; same contract as
    the C ``insert_walk``).

    Args:
        node, tokens, page_size, tick: as :func:`match_walk_py`.
        address: :func:`slot_tensor_address` of the caller's slot tensor (at least ``n`` int64
            slots, alive during the call), or -1 when the slots are not such a tensor.

    Returns:
        ``(node, pos, split_child, m, tail_key, tail_slots)``: the first four as :func:`walk_py`;
        with ``s = pos + m``, ``tail_key`` is the int32 bytes of tokens ``[s, n)`` and
        ``tail_slots`` the bytes of slots ``[s, n)`` read at ``address`` (``None`` when
        ``address < 0``).
    """
    kb = _as_int32_bytes(tokens)
    n = len(kb) >> TOKEN_SHIFT
    n -= n % page_size
    node, pos, child, m = walk_py(node, kb, n, page_size, tick)
    s = pos + m
    tail_slots = read_int64_py(address + (s << SLOT_SHIFT), n - s) if address >= 0 else None
    return node, pos, child, m, kb[s << TOKEN_SHIFT : n << TOKEN_SHIFT], tail_slots


class _NoSuchError(TypeError):
    """Stands for the C helper's NotAnInt when the helper is absent (never raised)."""


try:  # the optional C helper (csrc/prefix_match.c); the Python path is used when it is absent
    if os.environ.get("RADIXKV_NO_CEXT") == "1":
        raise ImportError("disabled by RADIXKV_NO_CEXT=1")
    from radixkv.cache._cprefix import NotAnInt, common_prefix_len, insert_walk, match_walk, pack_int32

    HAS_CEXT = True
except ImportError:
    HAS_CEXT = False
    NotAnInt = _NoSuchError
    common_prefix_len = common_prefix_len_py
    pack_int32 = pack_int32_py
    match_walk = match_walk_py
    insert_walk = insert_walk_py


def int_tokens(seq) -> list:
    """A new list of the ``int`` values of ``seq``'s items (``operator.index`` of each: numpy
    integers, other integer-like objects). The C helper reads a list's items in place and leaves
    items that are not ints to this (it raises ``NotAnInt``), because converting one runs
    arbitrary ``__index__`` code that could change the list under it.

    Raises:
        TypeError: an item that is not an integer, naming its position.
    """
    out = []
    for i, t in enumerate(seq):
        try:
            out.append(operator.index(t))
        except TypeError:
            raise TypeError(f"token id at position {i} must be an int, got {type(t).__name__}") from None
    return out


def int_tokens_for_retry(seq) -> list:
    """:func:`int_tokens` of a list a C walk refused with ``NotAnInt``, for the retry.

    Raises:
        ValueError: the list changed length while being read (an item's ``__index__`` did it).
        TypeError: an item that is not an integer, naming its position.
    """
    n = len(seq)
    out = int_tokens(seq)
    if len(out) != n:
        raise ValueError(f"tokens changed length while being read ({n} -> {len(out)})")
    return out


def pack_tokens(tokens: Tokens) -> bytes:
    """int32 buffer of a token sequence; ValueError for bad shapes, dtypes or ranges (and for raw
    ``bytes`` / ``bytearray``, whose element width is unknown)."""
    if isinstance(tokens, (list, tuple)):
        try:
            return pack_int32(tokens)
        except NotAnInt:
            return pack_int32(int_tokens(tokens))
    if isinstance(tokens, (bytes, bytearray)):
        raise ValueError(_RAW_BYTES)
    if isinstance(tokens, memoryview):
        if tokens.format in ("B", "c"):  # a view of raw bytes
            raise ValueError(_RAW_BYTES)
        tokens = np.asarray(tokens)
    if is_tensor(tokens):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(
                f"tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} dtype {tokens.dtype}"
            )
        tokens = tokens.cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
        if tokens.dtype != np.int32:
            if tokens.size and (tokens.min() < _INT32_MIN or tokens.max() > _INT32_MAX):
                raise ValueError(f"token ids must fit in int32 (must be in [{_INT32_MIN}, {_INT32_MAX}])")
            tokens = tokens.astype(np.int32)
        return tokens.tobytes()
    if isinstance(tokens, array):
        if tokens.typecode in "bBhHiIlLqQ":
            return pack_tokens(np.frombuffer(tokens, dtype=tokens.typecode))
        raise ValueError(f"tokens must be integers, got array of typecode {tokens.typecode!r}")
    return pack_int32(list(tokens))


_RAW_BYTES = (
    "tokens must not be raw bytes / bytearray (their element width is unknown): pass a list of "
    "ints, an array('i'/'l'/'q'), a numpy int32/int64 array, a memoryview of format i/l/q or a "
    "1-D integer tensor"
)


def _native_int_array(arr: np.ndarray) -> bool:
    """True for a 1-D C-contiguous numpy array of native int32 / int64 (read in place)."""
    return arr.ndim == 1 and arr.dtype.char in "ilq" and arr.dtype.isnative and arr.flags.c_contiguous


def query_tokens(tokens: Tokens):
    """``tokens`` as the walk helpers take them, read in place where possible:

    * a list or tuple of ints, unchanged (read item by item and validated by the walk);
    * a 1-D C-contiguous buffer of signed 4- or 8-byte integers in native order, unchanged:
      ``array('i' / 'l' / 'q')``, a numpy int32 / int64 array, a memoryview of format i / l / q;
      a 1-D integer CPU tensor of int32 / int64 becomes its numpy view (no copy);
    * anything else (other integer dtypes, strided views, other sequences) packed by
      :func:`pack_tokens` into int32 bytes.

    Raises:
        ValueError: raw ``bytes`` / ``bytearray``, a shape other than 1-D, a non-integer dtype,
            an id outside int32 (the last one for in-place inputs: raised by the walk).
    """
    t = type(tokens)
    if t is list or t is tuple:
        return tokens
    if t is np.ndarray:
        return tokens if _native_int_array(tokens) else pack_tokens(tokens)
    if t is array:
        return tokens if tokens.typecode in "ilq" else pack_tokens(tokens)
    if t is bytes or t is bytearray:
        raise ValueError(_RAW_BYTES)
    if t is memoryview:
        return tokens if _buffer_format(tokens) else pack_tokens(tokens)
    if is_tensor(tokens):
        if tokens.dim() == 1 and tokens.is_cpu and tokens.dtype in _tensor_int_dtypes():
            arr = tokens.numpy()  # integer tensors never require grad
            if arr.flags.c_contiguous:
                return arr
        return pack_tokens(tokens)
    return pack_tokens(tokens)


_TENSOR_DTYPES: tuple = ()


def _tensor_int_dtypes() -> tuple:
    global _TENSOR_DTYPES
    if not _TENSOR_DTYPES:
        torch = sys.modules["torch"]
        _TENSOR_DTYPES = (torch.int32, torch.int64)
    return _TENSOR_DTYPES


def num_query_tokens(q) -> int:
    """Number of tokens of a :func:`query_tokens` result (int32 ``bytes`` count 4 bytes a token)."""
    return len(q) >> TOKEN_SHIFT if type(q) is bytes else len(q)


def slot_tensor_address(slots) -> int:
    """The address of ``slots``' int64 data when it is a 1-D contiguous int64 CPU tensor or numpy
    array (the common case, read in place with ``read_int64``), else -1 (the caller falls back to
    :func:`as_slot_array`, which validates and converts everything else)."""
    if type(slots) is np.ndarray:
        if slots.dtype == np.int64 and slots.ndim == 1 and slots.flags.c_contiguous:
            return slots.ctypes.data if slots.size else -1
        return -1
    if is_tensor(slots) and slots.dtype is sys.modules["torch"].int64 and slots.is_cpu and slots.dim() == 1:
        if slots.is_contiguous():
            return slots.data_ptr()
    return -1


def as_slot_array(slots) -> np.ndarray:
    """int64 numpy view (or copy) of a 1-D integer CPU tensor, array or sequence of slots.

    Raises:
        ValueError: not 1-D, not integers, not on the CPU, or a value outside int64.
    """
    return as_int64(slots)


class use_python_path:
    """Context manager: inside it the pure-Python helpers are used even if the C one is built
    (for tests and the benchmark's C-vs-Python comparison)."""

    _names = ("pack_int32", "common_prefix_len", "match_walk", "insert_walk")

    def __enter__(self) -> "use_python_path":
        g = globals()
        self._saved = [g[k] for k in self._names]
        for k in self._names:
            g[k] = g[k + "_py"]
        return self

    def __exit__(self, *exc) -> None:
        g = globals()
        for k, v in zip(self._names, self._saved):
            g[k] = v
