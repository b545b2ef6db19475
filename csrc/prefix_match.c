/* radixkv.cache._cprefix: the radix tree's hot loops, in C.
 *
 * An edge's tokens are an int32 buffer (bytes, native byte order, 4 bytes a token) and its KV
 * slots an int64 buffer (bytes, 8 bytes a token). A query's tokens are a list/tuple of Python
 * ints, or any C-contiguous 1-D buffer of signed 4- or 8-byte integers in native byte order
 * (array("i"/"l"/"q"), a numpy int32/int64 array, a memoryview of those; the tree's own int32
 * bytes keys too), read in place through the buffer protocol: no packed copy is made and no
 * Python int is created for a lookup; int64 ids are range-checked as they are read.
 *
 * pack_int32(seq) -> bytes
 *   seq: a list or tuple of ints. Returns their int32 buffer.
 *   Raises ValueError (an id outside the int32 range) or NotAnInt, a TypeError (an item that is
 *   not an int or int subclass: never converted here, since its __index__ could run Python code
 *   that mutates the sequence being read; the Python caller converts and retries).
 *   Same result as array.array("i", seq).tobytes(), about 10x faster.
 *
 * common_prefix_len(a, b, start, limit) -> int
 *   a, b: int32 token buffers (bytes). Returns the largest m <= min(len(a) // 4, limit - start)
 *   with a[:m] == b[start:start + m] token by token; 0 <= start <= limit <= len(b) // 4.
 *   Compares 8 bytes at a time and finds the first differing token with a count-trailing-zeros.
 *
 * match_walk(node, tokens, page_size, tick) -> (node, pos, slots, split_child, m)
 *   RadixCache.match_prefix's descent and slot read-out (see descend() and matched_slots()
 *   below). The slots come back without a copy when one edge holds the whole match: that
 *   node's own value bytes (immutable; the tree never writes into an edge's bytes, so a
 *   read-only view of them handed to a caller stays valid and unchanged).
 *
 * insert_walk(node, tokens, page_size, tick, address) -> (node, pos, split_child, m, tail_key,
 *   tail_slots): RadixCache.insert's descent, plus the new leaf's key and slots.
 *
 * Both validate every token before they change anything (a bad id raises with the tree
 * untouched) and raise NotAnInt for an item that is not an int (see pack_int32). They are tested equal to the pure-Python versions in
 * radixkv/cache/token_keys.py (match_walk_py, insert_walk_py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *NotAnInt; /* TypeError subclass: an item that is not an int */

/* One token id as int32: 0, or -1 with ValueError (out of int32 range) or NotAnInt set (i: its
 * position). */
static inline int
item_to_int32(PyObject *o, Py_ssize_t i, int32_t *out)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)o);
        if (c >= INT32_MIN && c <= INT32_MAX) {
            *out = (int32_t)c;
            return 0;
        }
    }
#else
    /* Fast path for exact ints of at most one 30-bit digit (every realistic token id):
     * value = sign * digit, with Py_SIZE in {-1, 0, 1}. */
    if (Py_IS_TYPE(o, &PyLong_Type) && PyLong_SHIFT == 30) {
        Py_ssize_t sz = Py_SIZE(o);
        if ((size_t)(sz + 1) <= 2) {
            *out = (int32_t)(sz * (Py_ssize_t)((PyLongObject *)o)->ob_digit[0]);
            return 0;
        }
    }
#endif
    if (!PyLong_Check(o)) {
        /* Not an int: converting it could run Python code (__index__) that mutates the list
         * whose items are being read. The caller converts the sequence in Python and retries
         * (radixkv.cache.token_keys.int_tokens). */
        PyErr_Format(NotAnInt, "token id at position %zd is a %.100s, not an int", i,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0; /* an int or int subclass: no Python code runs */
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "token id at position %zd does not fit in int32 "
                     "(must be in [-2147483648, 2147483647])", i);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

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
        if (item_to_int32(items[i], i, dst + i) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static Py_ssize_t
prefix_tokens(const char *p, const char *q, Py_ssize_t n)
{
    Py_ssize_t nbytes = n * 4, i = 0;
    /* whole 256-byte blocks with memcmp (vectorized by the C library), then 8 bytes at a time */
    while (i + 256 <= nbytes && memcmp(p + i, q + i, 256) == 0) i += 256;
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

/* ------------------------------------------------------------------ query tokens */

/* A query: int32 ids in memory (buf: an int32 bytes object or buffer), int64 ids in memory
 * (buf64: an int64 buffer, each id range-checked when read), or the items of a list/tuple of
 * ints (items). No Python code runs while one is in use (only bytes hashing/compares and slot
 * attribute access), so the borrowed item array and the buffer stay valid. `checked`: ids
 * [0, checked) are known to be valid. A query made from a buffer holds it (query_release). */
typedef struct {
    const char *buf;
    const int64_t *buf64;
    PyObject **items;
    Py_ssize_t len, checked;
    Py_buffer view;
    int has_view;
} Query;

static void
query_release(Query *q)
{
    if (q->has_view) {
        PyBuffer_Release(&q->view);
        q->has_view = 0;
    }
}

/* A buffer's item format is a signed 4- or 8-byte integer in native byte order ("i", "l", "q",
 * optionally after "@", or after "=" / "<" on a little-endian machine). */
static int
int_format(const char *f, Py_ssize_t itemsize)
{
    if (f == NULL) return 0;
    if (f[0] == '@') f++;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    else if (f[0] == '=' || f[0] == '<') f++;
#endif
    return (f[0] == 'i' || f[0] == 'l' || f[0] == 'q') && f[1] == '\0'
           && (itemsize == 4 || itemsize == 8);
}

static int
query_init(Query *q, PyObject *tokens)
{
    q->checked = 0;
    q->buf = NULL;
    q->buf64 = NULL;
    q->items = NULL;
    q->has_view = 0;
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        q->items = PySequence_Fast_ITEMS(tokens);
        q->len = PySequence_Fast_GET_SIZE(tokens);
        return 0;
    }
    if (PyBytes_Check(tokens)) { /* the tree's own int32 keys */
        if (PyBytes_GET_SIZE(tokens) % 4) {
            PyErr_SetString(PyExc_ValueError, "token buffer length must be a multiple of 4");
            return -1;
        }
        q->buf = PyBytes_AS_STRING(tokens);
        q->len = PyBytes_GET_SIZE(tokens) / 4;
        q->checked = q->len;
        return 0;
    }
    if (PyObject_CheckBuffer(tokens)) {
        /* C-contiguous, with its format: an array("i"/"l"/"q"), a numpy int32/int64 array,
         * a memoryview of those */
        if (PyObject_GetBuffer(tokens, &q->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return -1;
        q->has_view = 1;
        if (q->view.ndim != 1 || !int_format(q->view.format, q->view.itemsize)) {
            PyErr_Format(PyExc_TypeError,
                         "a token buffer must be 1-D with items of format i, l or q (signed "
                         "4 or 8 bytes), got ndim %d format %.20s",
                         q->view.ndim, q->view.format ? q->view.format : "B");
            query_release(q);
            return -1;
        }
        q->len = q->view.len / q->view.itemsize;
        if (q->view.itemsize == 4) {
            q->buf = (const char *)q->view.buf;
            q->checked = q->len;
        } else {
            q->buf64 = (const int64_t *)q->view.buf;
        }
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "tokens must be a list, tuple or integer buffer, got %.100s",
                 Py_TYPE(tokens)->tp_name);
    return -1;
}

/* int64 ids [start, end) of an int64 buffer to int32 at dst, range-checked. 0 or -1. */
static int
narrow64(const int64_t *restrict src, Py_ssize_t start, Py_ssize_t end, int32_t *restrict dst)
{
    int64_t bad = 0;
    for (Py_ssize_t i = start; i < end; i++) {
        int64_t v = src[i];
        bad |= v ^ (int64_t)(int32_t)v;
        dst[i - start] = (int32_t)v;
    }
    if (!bad) return 0;
    for (Py_ssize_t i = start; i < end; i++) {
        if (src[i] != (int32_t)src[i]) {
            PyErr_Format(PyExc_ValueError,
                         "token id at position %zd does not fit in int32 "
                         "(must be in [-2147483648, 2147483647])", i);
            break;
        }
    }
    return -1;
}

/* Writes tokens [start, end) as int32 to dst. 0 or -1 (error set). */
static int
query_pack(Query *q, Py_ssize_t start, Py_ssize_t end, char *dst)
{
    if (q->buf) {
        memcpy(dst, q->buf + start * 4, (size_t)(end - start) * 4);
        return 0;
    }
    if (q->buf64) {
        if (narrow64(q->buf64, start, end, (int32_t *)dst) < 0) return -1;
    } else {
        for (Py_ssize_t i = start; i < end; i++) {
            int32_t v;
            if (item_to_int32(q->items[i], i, &v) < 0) return -1;
            memcpy(dst + (i - start) * 4, &v, 4);
        }
    }
    if (end > q->checked) q->checked = end;
    return 0;
}

#define QBLOCK 256

/* Common prefix of an int32 key and int64 ids, in tokens (n at most). An id outside int32 equals
 * no key token, so the compare needs no range check: the ids it passes are valid. Blocks of 16
 * are compared without branches (vectorized), the first differing block token by token. */
static Py_ssize_t
prefix_tokens64(const char *key, const int64_t *restrict ids, Py_ssize_t n)
{
    Py_ssize_t j = 0;
    for (; j + 16 <= n; j += 16) {
        int64_t diff = 0;
        for (int k = 0; k < 16; k++) {
            int32_t t;
            memcpy(&t, key + (j + k) * 4, 4);
            diff |= ids[j + k] ^ (int64_t)t;
        }
        if (diff) break;
    }
    for (; j < n; j++) {
        int32_t t;
        memcpy(&t, key + j * 4, 4);
        if (ids[j] != (int64_t)t) break;
    }
    return j;
}

/* Length of the common prefix of the edge key (int32) and tokens [pos, pos + lim): -1 on a bad
 * token id (error set). Ids read are marked checked (a list's are converted as they are
 * compared; an int64 buffer's equal to a key token are valid by that alone). */
static Py_ssize_t
query_prefix(Query *q, const char *key, Py_ssize_t pos, Py_ssize_t lim)
{
    if (q->buf) return prefix_tokens(key, q->buf + pos * 4, lim);
    if (q->buf64) {
        Py_ssize_t j = prefix_tokens64(key, q->buf64 + pos, lim);
        if (pos + j > q->checked) q->checked = pos + j;
        return j;
    }
    PyObject **items = q->items + pos;
    Py_ssize_t j = 0;
    for (; j < lim; j++) {
        int32_t v, t;
        if (item_to_int32(items[j], pos + j, &v) < 0) return -1;
        memcpy(&t, key + j * 4, 4);
        if (v != t) {
            if (pos + j + 1 > q->checked) q->checked = pos + j + 1;
            return j;
        }
    }
    if (pos + j > q->checked) q->checked = pos + j;
    return j;
}

/* Checks every token not read yet. 0 or -1 (error set). */
static int
query_check_rest(Query *q)
{
    if (q->checked >= q->len) return 0;
    if (q->buf64) {
        int32_t block[QBLOCK];
        for (Py_ssize_t i = q->checked; i < q->len; i += QBLOCK) {
            Py_ssize_t e = q->len - i < QBLOCK ? q->len : i + QBLOCK;
            if (narrow64(q->buf64, i, e, block) < 0) return -1;
        }
    } else {
        for (Py_ssize_t i = q->checked; i < q->len; i++) {
            int32_t v;
            if (item_to_int32(q->items[i], i, &v) < 0) return -1;
        }
    }
    q->checked = q->len;
    return 0;
}

/* ------------------------------------------------------------------ the descent */

static PyObject *str_children, *str_key, *str_value, *str_last_access;

#define PATH_INLINE 32

/* The radix tree's descent from `node` over the first n tokens of q (n % ps == 0): follow the
 * child keyed by the next page of tokens while the child's whole edge matches. Stops at a
 * missing child (*split_child NULL, *m 0) or at an edge that matches only its first m tokens
 * (m floored to ps; *split_child is that child: the caller splits it). Nothing is modified
 * and no slot is read (matched_slots() below does that): the fully matched nodes are returned in path[]
 * (new references, *depth of them; the caller sets their last_access once every token has been
 * checked). Returns 0, or -1 with an error set (split_child released; the caller still
 * releases path[0:*depth]). */
static int
descend(PyObject *node, Query *q, Py_ssize_t n, Py_ssize_t ps, PyObject ***path,
        Py_ssize_t *depth, Py_ssize_t *cap, Py_ssize_t *pos_out, PyObject **split_child,
        Py_ssize_t *m_out)
{
    Py_ssize_t pos = 0, m = 0;
    *split_child = NULL;
    char page[4 * 64];
    char *pagebuf = ps <= 64 ? page : PyMem_Malloc((size_t)ps * 4);
    if (pagebuf == NULL) { PyErr_NoMemory(); return -1; }
    while (pos < n) {
        PyObject *children = PyObject_GetAttr(node, str_children);
        if (children == NULL) goto fail;
        if (query_pack(q, pos, pos + ps, pagebuf) < 0) { Py_DECREF(children); goto fail; }
        PyObject *ck = PyBytes_FromStringAndSize(pagebuf, ps * 4);
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
            PyErr_SetString(PyExc_TypeError, "node.key must be bytes");
            Py_DECREF(ckey); Py_DECREF(child); goto fail;
        }
        Py_ssize_t clen = PyBytes_GET_SIZE(ckey) / 4, lim = n - pos;
        m = query_prefix(q, PyBytes_AS_STRING(ckey), pos, clen < lim ? clen : lim);
        Py_DECREF(ckey);
        if (m < 0) { Py_DECREF(child); goto fail; }
        m -= m % ps;
        if (m < clen) {
            if (m == 0) { /* cannot happen: the child's first page is the dict key */
                Py_DECREF(child);
            } else {
                *split_child = child; /* owned */
            }
            break;
        }
        m = 0;
        if (*depth == *cap) {
            Py_ssize_t ncap = *cap * 2;
            PyObject **np = PyMem_Malloc((size_t)ncap * sizeof(PyObject *));
            if (np == NULL) { PyErr_NoMemory(); Py_DECREF(child); goto fail; }
            memcpy(np, *path, (size_t)*depth * sizeof(PyObject *));
            if (*cap != PATH_INLINE) PyMem_Free(*path);
            *path = np;
            *cap = ncap;
        }
        (*path)[(*depth)++] = child; /* owned */
        pos += clen;
        node = child;
    }
    if (pagebuf != page) PyMem_Free(pagebuf);
    *pos_out = pos;
    *m_out = m;
    return 0;
fail:
    if (pagebuf != page) PyMem_Free(pagebuf);
    Py_CLEAR(*split_child);
    return -1;
}

static void
release_path(PyObject **path, Py_ssize_t depth, Py_ssize_t cap)
{
    for (Py_ssize_t i = 0; i < depth; i++) Py_DECREF(path[i]);
    if (cap != PATH_INLINE) PyMem_Free(path);
}

/* Sets last_access = tick on the matched path. 0 or -1. */
static int
touch_path(PyObject **path, Py_ssize_t depth, PyObject *tick)
{
    for (Py_ssize_t i = 0; i < depth; i++)
        if (PyObject_SetAttr(path[i], str_last_access, tick) < 0) return -1;
    return 0;
}

/* The walks' shared argument checks: page_size >= 1 and a valid query. 0 or -1. */
static int
walk_query(Query *q, PyObject *tokens, Py_ssize_t ps)
{
    if (ps < 1) {
        PyErr_Format(PyExc_ValueError, "page_size must be >= 1, got %zd", ps);
        return -1;
    }
    return query_init(q, tokens);
}

/* A node's value, its int64 slot bytes, checked to hold one slot per token of its key; *len:
 * its tokens. New reference, or NULL with an error set. */
static PyObject *
node_value(PyObject *node, Py_ssize_t *len)
{
    PyObject *key = PyObject_GetAttr(node, str_key);
    if (key == NULL) return NULL;
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "node.key must be bytes");
        Py_DECREF(key);
        return NULL;
    }
    *len = PyBytes_GET_SIZE(key) / 4;
    Py_DECREF(key);
    PyObject *value = PyObject_GetAttr(node, str_value);
    if (value == NULL) return NULL;
    if (!PyBytes_Check(value) || PyBytes_GET_SIZE(value) != *len * 8) {
        PyErr_SetString(PyExc_ValueError, "node.value must be bytes holding one int64 slot per "
                        "token");
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

/* The matched slots of a descent: the int64 slots of path[0:depth]'s edges, then the first m of
 * split_child's edge. From one edge alone: its value bytes object itself (depth 1, no split:
 * shared, immutable, nothing copied) or a new bytes of split_child's first m slots (depth 0:
 * what the caller's split makes the upper node's value). From several: a new bytearray they are
 * copied into. New reference or NULL. */
static PyObject *
matched_slots(PyObject **path, Py_ssize_t depth, Py_ssize_t pos, PyObject *split_child,
              Py_ssize_t m)
{
    Py_ssize_t len;
    if (depth == 1 && split_child == NULL) return node_value(path[0], &len);
    if (depth == 0) {
        PyObject *value = node_value(split_child, &len);
        if (value == NULL) return NULL;
        PyObject *out = PyBytes_FromStringAndSize(PyBytes_AS_STRING(value), m * 8);
        Py_DECREF(value);
        return out;
    }
    PyObject *buf = PyByteArray_FromStringAndSize(NULL, (pos + m) * 8);
    if (buf == NULL) return NULL;
    char *dst = PyByteArray_AS_STRING(buf), *end = dst + (pos + m) * 8;
    for (Py_ssize_t i = 0; i <= depth; i++) {
        PyObject *nd = i < depth ? path[i] : split_child;
        if (nd == NULL) break;
        PyObject *value = node_value(nd, &len);
        if (value == NULL) { Py_DECREF(buf); return NULL; }
        Py_ssize_t take = i < depth ? len : m;
        if (end - dst < take * 8) { /* the edges changed since the descent: cannot happen */
            PyErr_SetString(PyExc_RuntimeError, "match_walk: the matched path changed");
            Py_DECREF(value); Py_DECREF(buf); return NULL;
        }
        memcpy(dst, PyBytes_AS_STRING(value), (size_t)take * 8);
        Py_DECREF(value);
        dst += take * 8;
    }
    return buf;
}

/* match_walk(node, tokens, page_size, tick) -> (node, pos, slots, split_child, m)
 *
 * n = len(tokens) floored to page_size. Descends from `node` (descend() above), then, every
 * token being valid, sets last_access = tick on each fully matched node. Returns the deepest
 * fully matched node (`node` itself when none), the tokens matched up to it, the pos + m matched
 * int64 slots (the split edge's first m included; see matched_slots: the one fully matched
 * edge's own value bytes, a new bytes of the split edge's first m slots when nothing else
 * matched, else a new bytearray; b"" for no match), and the split child (None, m 0 when there
 * is none). */
static PyObject *
match_walk(PyObject *self, PyObject *args)
{
    PyObject *node, *tokens, *tick;
    Py_ssize_t ps;
    Query q;
    if (!PyArg_ParseTuple(args, "OOnO:match_walk", &node, &tokens, &ps, &tick)
            || walk_query(&q, tokens, ps) < 0)
        return NULL;
    Py_ssize_t n = q.len - q.len % ps, pos = 0, m = 0, depth = 0, cap = PATH_INLINE;
    PyObject *inline_path[PATH_INLINE], **path = inline_path, *split_child = NULL;
    PyObject *buf = NULL, *result = NULL;
    if (descend(node, &q, n, ps, &path, &depth, &cap, &pos, &split_child, &m) < 0)
        goto done;
    if (query_check_rest(&q) < 0 || touch_path(path, depth, tick) < 0) goto done;
    if (depth == 0 && split_child == NULL)
        buf = PyBytes_FromStringAndSize(NULL, 0);
    else
        buf = matched_slots(path, depth, pos, split_child, m);
    if (buf == NULL) goto done;
    result = Py_BuildValue("(OnOOn)", depth ? path[depth - 1] : node, pos, buf,
                           split_child ? split_child : Py_None, m);
done:
    Py_XDECREF(split_child);
    release_path(path, depth, cap);
    Py_XDECREF(buf);
    query_release(&q);
    return result;
}

/* insert_walk(node, tokens, page_size, tick, address) -> (node, pos, split_child, m, tail_key,
 *                                                         tail_slots)
 *
 * match_walk's descent without the slot read-out, plus what a new leaf needs, with
 * s = pos + m and n = len(tokens) floored to page_size: tail_key, the int32 bytes of tokens
 * [s, n) (b"" when s == n), and, when address >= 0, tail_slots, the bytes of the int64 slots
 * [s, n) read at `address` (a contiguous int64 CPU tensor's data_ptr(), of at least n slots,
 * kept alive by the caller); None when address < 0. ValueError for a null address with
 * slots to read. */
static PyObject *
insert_walk(PyObject *self, PyObject *args)
{
    PyObject *node, *tokens, *tick;
    Py_ssize_t ps;
    long long addr;
    Query q;
    if (!PyArg_ParseTuple(args, "OOnOL:insert_walk", &node, &tokens, &ps, &tick, &addr)
            || walk_query(&q, tokens, ps) < 0)
        return NULL;
    Py_ssize_t n = q.len - q.len % ps, pos = 0, m = 0, depth = 0, cap = PATH_INLINE;
    PyObject *inline_path[PATH_INLINE], **path = inline_path, *split_child = NULL;
    PyObject *tail_key = NULL, *tail_slots = NULL, *result = NULL;
    if (descend(node, &q, n, ps, &path, &depth, &cap, &pos, &split_child, &m) < 0)
        goto done;
    Py_ssize_t s = pos + m;
    tail_key = PyBytes_FromStringAndSize(NULL, (n - s) * 4);
    if (tail_key == NULL || query_pack(&q, s, n, PyBytes_AS_STRING(tail_key)) < 0) goto done;
    if (query_check_rest(&q) < 0) goto done;
    if (addr == 0 && n > s) {
        PyErr_SetString(PyExc_ValueError, "insert_walk: null slot address");
        goto done;
    }
    if (addr >= 0) {
        tail_slots = PyBytes_FromStringAndSize((const char *)(uintptr_t)addr + s * 8,
                                               (n - s) * 8);
        if (tail_slots == NULL) goto done;
    } else {
        tail_slots = Py_None;
        Py_INCREF(tail_slots);
    }
    if (touch_path(path, depth, tick) < 0) goto done;
    result = Py_BuildValue("(OnOnOO)", depth ? path[depth - 1] : node, pos,
                           split_child ? split_child : Py_None, m, tail_key, tail_slots);
done:
    Py_XDECREF(split_child);
    Py_XDECREF(tail_key);
    Py_XDECREF(tail_slots);
    release_path(path, depth, cap);
    query_release(&q);
    return result;
}

static PyMethodDef methods[] = {
    {"pack_int32", pack_int32, METH_O,
     "pack_int32(seq: list | tuple) -> bytes: the int32 buffer of a sequence of token ids."},
    {"common_prefix_len", common_prefix_len, METH_VARARGS,
     "common_prefix_len(a: bytes, b: bytes, start: int, limit: int) -> int\n\n"
     "Largest m <= min(len(a) // 4, limit - start) with a[:m] == b[start:start + m], in int32 "
     "tokens."},
    {"match_walk", match_walk, METH_VARARGS,
     "match_walk(node, tokens, page_size, tick) -> (node, pos, slots: bytearray, split_child, "
     "m): the radix tree's descent with the matched slots (see csrc/prefix_match.c)."},
    {"insert_walk", insert_walk, METH_VARARGS,
     "insert_walk(node, tokens, page_size, tick, address) -> (node, pos, split_child, m, "
     "tail_key, tail_slots): the descent of an insert plus the new leaf's key and slots."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "radixkv.cache._cprefix",
    "C helpers for radixkv's radix tree: token packing, prefix compare and the tree's descent.",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__cprefix(void)
{
    str_children = PyUnicode_InternFromString("children");
    str_key = PyUnicode_InternFromString("key");
    str_value = PyUnicode_InternFromString("value");
    str_last_access = PyUnicode_InternFromString("last_access");
    if (!str_children || !str_key || !str_value || !str_last_access) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    NotAnInt = PyErr_NewException("radixkv.cache._cprefix.NotAnInt", PyExc_TypeError, NULL);
    if (NotAnInt == NULL || PyModule_AddObjectRef(mod, "NotAnInt", NotAnInt) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
