/* radixkv.cache._cprefix: the radix tree's hot loops, in C.
 *
 * Tokens are stored as int32 buffers (bytes objects, native byte order, 4 bytes a token).
 *
 * pack_int32(seq) -> bytes
 *   seq: a list or tuple of ints. Returns their int32 buffer.
 *   Raises ValueError (an id outside the int32 range) or TypeError (an item that is not an int).
 *   Same result as array.array("i", seq).tobytes(), about 10x faster.
 *
 * common_prefix_len(a, b, start, limit) -> int
 *   a, b: int32 token buffers (bytes). Returns the largest m <= min(len(a) // 4, limit - start)
 *   with a[:m] == b[start:start + m] token by token; 0 <= start <= limit <= len(b) // 4.
 *   Compares 8 bytes at a time and finds the first differing token with a count-trailing-zeros.
 *
 * walk(node, kb, n, page_size, tick): the descent of RadixCache._walk (see below).
 *
 * walk_slots(node, kb, n, page_size, tick): walk() plus the matched slots, concatenated into
 *   one bytearray of int64 (match_prefix's slot read-out in one copy).
 *
 * read_int64(address, count): copy of count int64 values at a contiguous CPU tensor's
 *   data_ptr() (insert's slot read-out without Tensor.numpy()).
 *
 * All are tested equal to the pure-Python versions (radixkv/cache/token_keys.py and
 * RadixCache._walk_py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *
pack_int32(PyObject *self, PyObject *seq)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "pack_int32 needs a list or tuple, got %.100s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) return NULL;
    int32_t *dst = (int32_t *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
#if PY_VERSION_HEX >= 0x030C0000
        if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)o);
            if (c >= INT32_MIN && c <= INT32_MAX) {
                dst[i] = (int32_t)c;
                continue;
            }
        }
#else
        /* Fast path for exact ints of at most one 30-bit digit (every realistic token id). */
        if (PyLong_CheckExact(o) && PyLong_SHIFT == 30) {
            Py_ssize_t sz = Py_SIZE(o);
            if (sz == 0) {
                dst[i] = 0;
                continue;
            }
            if (sz == 1 || sz == -1) {
                int32_t d = (int32_t)((PyLongObject *)o)->ob_digit[0];
                dst[i] = sz == 1 ? d : -d;
                continue;
            }
        }
#endif
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        if (overflow || v < INT32_MIN || v > INT32_MAX) {
            Py_DECREF(out);
            PyErr_Format(PyExc_ValueError,
                         "token id at position %zd does not fit in int32 "
                         "(must be in [-2147483648, 2147483647])", i);
            return NULL;
        }
        dst[i] = (int32_t)v;
    }
    return out;
}

static Py_ssize_t
prefix_tokens(const char *p, const char *q, Py_ssize_t n)
{
    Py_ssize_t nbytes = n * 4, i = 0;
    for (; i + 8 <= nbytes; i += 8) {
        uint64_t x, y;
        memcpy(&x, p + i, 8);
        memcpy(&y, q + i, 8);
        if (x != y) {
#if defined(__GNUC__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            return (i + (__builtin_ctzll(x ^ y) >> 3)) / 4;
#else
            break;
#endif
        }
    }
    for (; i < nbytes; i += 4) {
        if (memcmp(p + i, q + i, 4) != 0) break;
    }
    return i / 4;
}

static PyObject *
common_prefix_len(PyObject *self, PyObject *args)
{
    const char *a, *b;
    Py_ssize_t alen, blen, start, limit;
    if (!PyArg_ParseTuple(args, "y#y#nn:common_prefix_len", &a, &alen, &b, &blen, &start,
                          &limit))
        return NULL;
    if (start < 0 || start > limit || limit > blen / 4) {
        PyErr_Format(PyExc_ValueError,
                     "need 0 <= start <= limit <= len(b) // 4, got start=%zd limit=%zd "
                     "len(b) // 4=%zd", start, limit, blen / 4);
        return NULL;
    }
    Py_ssize_t n = alen / 4;
    if (limit - start < n) n = limit - start;
    return PyLong_FromSsize_t(prefix_tokens(a, b + start * 4, n));
}

static PyObject *str_children, *str_key, *str_value, *str_last_access;

/* Appends the first `count` int64 slots (all of them when count == -1) of `value` (an object
 * with a contiguous buffer of 8-byte items: the tree's numpy.int64 slot arrays) to
 * out[*filled:], never past out[cap]. Returns 0, or -1 with an error set. */
static int
copy_slots(PyObject *value, Py_ssize_t count, char *out, Py_ssize_t cap, Py_ssize_t *filled)
{
    Py_buffer view;
    if (PyObject_GetBuffer(value, &view, PyBUF_SIMPLE) < 0) return -1;
    if (count < 0) count = view.len / 8;
    if (view.itemsize != 8 || view.len % 8 || view.len / 8 < count
            || count > (cap - *filled) / 8) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "walk_slots: node.value must hold one int64 slot "
                        "per token");
        return -1;
    }
    memcpy(out + *filled, view.buf, (size_t)count * 8);
    *filled += count * 8;
    PyBuffer_Release(&view);
    return 0;
}


/* walk(node, kb, n, page_size, tick) -> (node, pos, values, split_child, m)
 *
 * The radix tree's descent (RadixCache._walk without the split): from `node`, follow the child
 * keyed by the next page of `kb` (int32 tokens) while the child's whole edge matches the first
 * `n` tokens, setting each child's last_access = tick and collecting its `value`. Stops at a
 * missing child (split_child None) or at an edge that matches only its first m tokens (m floored
 * to page_size; split_child is that child, not updated; the caller splits it). Nodes are any
 * objects with `children` (dict keyed by first-page bytes), `key` (bytes), `value` and a writable
 * `last_access`.
 */
static PyObject *
walk_impl(PyObject *args, int want_slots)
{
    PyObject *node, *tick;
    const char *kb;
    Py_ssize_t kblen, n, ps;
    if (!PyArg_ParseTuple(args, "Oy#nnO:walk", &node, &kb, &kblen, &n, &ps, &tick))
        return NULL;
    if (ps < 1 || n < 0 || n > kblen / 4 || n % ps) {
        PyErr_Format(PyExc_ValueError, "walk: need page_size >= 1 and 0 <= n <= len(kb) // 4, "
                     "n %% page_size == 0; got n=%zd page_size=%zd", n, ps);
        return NULL;
    }
    PyObject *values = PyList_New(0);
    if (values == NULL) return NULL;
    Py_INCREF(node);
    PyObject *split_child = Py_None, *result = NULL;
    Py_INCREF(split_child);
    Py_ssize_t pos = 0, m = 0;
    while (pos < n) {
        PyObject *children = PyObject_GetAttr(node, str_children);
        if (children == NULL) goto fail;
        PyObject *ck = PyBytes_FromStringAndSize(kb + pos * 4, ps * 4);
        if (ck == NULL) { Py_DECREF(children); goto fail; }
        PyObject *child = PyDict_GetItemWithError(children, ck); /* borrowed */
        Py_XINCREF(child);
        Py_DECREF(ck);
        Py_DECREF(children);
        if (child == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        PyObject *ckey = PyObject_GetAttr(child, str_key);
        if (ckey == NULL) { Py_DECREF(child); goto fail; }
        if (!PyBytes_Check(ckey)) {
            PyErr_SetString(PyExc_TypeError, "walk: node.key must be bytes");
            Py_DECREF(ckey); Py_DECREF(child); goto fail;
        }
        Py_ssize_t clen = PyBytes_GET_SIZE(ckey) / 4, lim = n - pos;
        m = prefix_tokens(PyBytes_AS_STRING(ckey), kb + pos * 4, clen < lim ? clen : lim);
        Py_DECREF(ckey);
        m -= m % ps;
        if (m < clen) {
            Py_DECREF(split_child);
            split_child = child; /* owned */
            break;
        }
        m = 0;
        if (PyObject_SetAttr(child, str_last_access, tick) < 0) { Py_DECREF(child); goto fail; }
        PyObject *value = PyObject_GetAttr(child, str_value);
        if (value == NULL) { Py_DECREF(child); goto fail; }
        int rc = PyList_Append(values, value);
        Py_DECREF(value);
        if (rc < 0) { Py_DECREF(child); goto fail; }
        pos += clen;
        Py_DECREF(node);
        node = child; /* owned */
    }
    if (!want_slots) {
        result = Py_BuildValue("(OnOOn)", node, pos, values, split_child, m);
    } else {
        /* walk_slots: one bytearray of the pos + m matched slots, no intermediate list */
        Py_ssize_t cap = (pos + m) * 8, filled = 0, nv = PyList_GET_SIZE(values);
        PyObject *buf = PyByteArray_FromStringAndSize(NULL, cap);
        if (buf == NULL) goto fail;
        char *out = PyByteArray_AS_STRING(buf);
        for (Py_ssize_t i = 0; i < nv; i++) {
            if (copy_slots(PyList_GET_ITEM(values, i), -1, out, cap, &filled) < 0) {
                Py_DECREF(buf); goto fail;
            }
        }
        if (split_child != Py_None) {
            PyObject *v = PyObject_GetAttr(split_child, str_value);
            int rc = v == NULL ? -1 : copy_slots(v, m, out, cap, &filled);
            Py_XDECREF(v);
            if (rc < 0) { Py_DECREF(buf); goto fail; }
        }
        if (filled != cap) {
            PyErr_SetString(PyExc_ValueError, "walk_slots: node.value must hold one int64 "
                            "slot per token");
            Py_DECREF(buf); goto fail;
        }
        result = Py_BuildValue("(OnNOn)", node, pos, buf, split_child, m);
    }
fail:
    Py_DECREF(node);
    Py_DECREF(values);
    Py_DECREF(split_child);
    return result;
}

/* read_int64(address, count) -> bytes: a copy of `count` int64 values at `address`.
 * For RadixCache.insert's slot read-out from a contiguous int64 CPU tensor (the caller checks
 * the tensor and passes tensor.data_ptr() + 8 * start; the tensor stays alive during the call).
 * Same as ctypes.string_at(address, 8 * count), without ctypes' call overhead. */
static PyObject *
read_int64(PyObject *self, PyObject *args)
{
    unsigned long long addr;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "Kn:read_int64", &addr, &count)) return NULL;
    if (count < 0 || (addr == 0 && count > 0) || count > PY_SSIZE_T_MAX / 8) {
        PyErr_Format(PyExc_ValueError, "read_int64: need a non-null address and count >= 0, "
                     "got count=%zd", count);
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)(uintptr_t)addr, count * 8);
}

static PyObject *
walk(PyObject *self, PyObject *args)
{
    return walk_impl(args, 0);
}

/* walk_slots(node, kb, n, page_size, tick) -> (node, pos, slots, split_child, m)
 *
 * walk() plus the slot read-out of a match: `slots` is a new bytearray holding the int64 slots
 * of every fully matched edge and, when split_child is not None, the first m slots of
 * split_child's edge (pos + m slots in all); the caller wraps it in a tensor with
 * torch.frombuffer (one copy in all, instead of a concatenate plus a conversion). The pure-Python
 * walk_slots_py returns a numpy.int64 array instead (see radixkv/cache/token_keys.py).
 */
static PyObject *
walk_slots(PyObject *self, PyObject *args)
{
    return walk_impl(args, 1);
}

static PyMethodDef methods[] = {
    {"pack_int32", pack_int32, METH_O,
     "pack_int32(seq: list | tuple) -> bytes: the int32 buffer of a sequence of token ids."},
    {"common_prefix_len", common_prefix_len, METH_VARARGS,
     "common_prefix_len(a: bytes, b: bytes, start: int, limit: int) -> int\n\n"
     "Largest m <= min(len(a) // 4, limit - start) with a[:m] == b[start:start + m], in int32 "
     "tokens."},
    {"walk", walk, METH_VARARGS,
     "walk(node, kb, n, page_size, tick) -> (node, pos, values, split_child, m): the radix "
     "tree's descent over the first n int32 tokens of kb (see csrc/prefix_match.c)."},
    {"read_int64", read_int64, METH_VARARGS,
     "read_int64(address: int, count: int) -> bytes: copy of count int64 values at address "
     "(a contiguous CPU tensor's data_ptr())."},
    {"walk_slots", walk_slots, METH_VARARGS,
     "walk_slots(node, kb, n, page_size, tick) -> (node, pos, slots: bytearray, split_child, m):"
     " walk() plus the int64 slots of the matched tokens, split edge's first m included."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "radixkv.cache._cprefix",
    "C helpers for radixkv's radix tree: int32 token packing and common-prefix length.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__cprefix(void)
{
    str_children = PyUnicode_InternFromString("children");
    str_key = PyUnicode_InternFromString("key");
    str_value = PyUnicode_InternFromString("value");
    str_last_access = PyUnicode_InternFromString("last_access");
    if (!str_children || !str_key || !str_value || !str_last_access) return NULL;
    return PyModule_Create(&module);
}
