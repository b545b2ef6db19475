/* radixkv.kernels._ckernels: float32 CPU kernels for the decode step (AVX2 + FMA, a small thread pool).
 *
 * The Python wrappers and the checks on every argument live in radixkv/kernels/cpu.py (and
 * radixkv/executor/cpu_decode.py for decode_step); the functions here trust their arguments:
 * raw addresses of contiguous float32 / int32 / int64 buffers (and K/V pool tensors in their
 * dtype), passed as integers.
 *
 * available() -> bool
 *   True when this CPU has AVX2, FMA and F16C (checked at run time; the module is built for any
 *   x86-64, only the kernels are compiled for AVX2). Every other function needs it.
 *
 * packed_bytes(fmt, N, K) -> int, pack_weight(w, N, K, ldw, fmt, out, out_bytes) -> bool
 *   Pack W [N, K] (rows ldw floats apart) for sgemm_packed: a 64-byte header (magic, format, N,
 *   K), then panels of 16 output columns in format fmt: 0 float32, 1 Q4_1-style 4-bit affine
 *   blocks, 2 Q8_0-style int8 blocks (32 k per block, fp16 scales; layouts at pack_weight). The
 *   block formats are lossless or refused: pack_weight returns False unless every weight decodes
 *   to exactly its float32 value, as it does for weights that GGUF Q4_1 / Q8_0 tensors were
 *   dequantized to. packed_bytes is 0 when K does not suit fmt (not a multiple of 32).
 *
 * sgemm_packed(x, M, K, ldx, wp, N, bias, c, ldc, nthreads)
 *   C[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]). x: X, rows ldx floats apart. wp: W as written by
 *   pack_weight (its header is checked against N and K). bias: bias[N] or 0. c: C, rows ldc
 *   floats apart. Method: the register-blocked micro-kernel of Goto & van de Geijn (2008) / BLIS
 *   (Van Zee & van de Geijn 2015): a 6 x 16 block of C lives in 12 AVX registers; each k step
 *   loads one packed W row (16 floats, one cache line) and broadcasts 6 X values; a block-format
 *   panel is first decoded 128 k at a time into float32 in L1. See gemm_task for the blocking
 *   and the prefetching. Each C element is one float32 FMA chain over k (a summation order other
 *   than MKL's: equal up to float32 rounding), the same bits in every format.
 *
 * paged_attention(q, T, req_meta, n_req, kv_indices, n_indices, page_size, num_pages, k_cache,
 *                 v_cache, k_scale, v_scale, kv_dtype, num_q_heads, num_kv_heads, head_dim,
 *                 sm_scale, out, nthreads)
 *   FlashInfer-paged-prefill semantics (causal, bottom-right aligned) for the requests given.
 *   req_meta: int32 [4, n_req]: first query row, query count q_len, offset into kv_indices
 *   (kv_indptr) and KV length kv_len of each request. q / out: float32 [T, Hq, D]. Position p of a
 *   request lives in slot page * page_size + p % page_size of k_cache / v_cache ([num_slots,
 *   Hkv, D] of kv_dtype: 0 float32, 1 bfloat16, 2 float16, 3 float8_e4m3fn, 4 float8_e5m2; the
 *   fp8 ones with bfloat16 scales k_scale / v_scale [num_slots, Hkv], else 0), page =
 *   kv_indices[kv_indptr + p / page_size]. Query row j attends to positions 0 .. kv_len - q_len
 *   + j. GQA: query head h reads KV head h / (Hq / Hkv). K/V widened to float32, softmax in
 *   float32, max subtracted (two passes, not online). head_dim must be a multiple of 8.
 *
 * kv_quantize(x, rows, d, kv_dtype, q, scale)
 *   rows rows of d float32 (d a multiple of 8) rounded to kv_dtype into q (rows * d elements) and,
 *   for fp8, one bfloat16 scale per row into scale: the pool's write rounding (kvformat.c).
 *
 * add_rms_norm(delta, residual, out, M, K, w, eps), rope_inplace(x, T, nh, d, ldx, cos, sin),
 * silu_mul(gate_up, out, M, I): RMSNorm with the residual add fused, rotate-half RoPE in place,
 *   SwiGLU's silu(gate) * up (one thread each; see the functions).
 *
 * apply_token_bitmask(logits, ldl, bitmask, ldb, rows, n_rows, vocab): grammar masks (xgrammar's
 *   int32 token bitmask, bit j of a row allows token j): logits[r, j] = -inf for every row r in
 *   rows[n_rows] (int64) and token j < vocab whose bit is 0. Rows ldl floats / ldb words apart.
 *
 * step_plan(...), step_set_rope(...), decode_step(...): one whole forward pass of a decode batch
 *   (every layer, the final norm and the LM head) in one call, for radixkv/executor/cpu_decode.py;
 *   see py_step_plan and py_decode_step below, and step.c.
 *
 * advise_hugepages(addr, nbytes) -> bool: madvise(MADV_HUGEPAGE) on the 2 MiB pages inside.
 *
 * threading() -> str: "openmp" or "pthreads", what run_parallel uses in this process now.
 *
 * The kernels behind these live in the other files of csrc/cpu_kernels/ (internal.h lists them);
 * threadpool.c says how their threads run (the GIL is released while a kernel runs). */
#include "internal.h"

#include <sys/mman.h>

/* 1 when the kernels can run here, else 0 with a RuntimeError naming fn set. */
static int
cpu_or_raise(const char *fn)
{
    if (cpu_ok())
        return 1;
    PyErr_Format(PyExc_RuntimeError, "%s needs a CPU with AVX2, FMA and F16C", fn);
    return 0;
}

static PyObject *
py_available(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(cpu_ok());
}

static PyObject *
py_isa(PyObject *self, PyObject *noargs)
{
    if (!cpu_ok())
        Py_RETURN_NONE;
#if RK_X86
    return PyUnicode_FromString(rk_isa == ISA_AVX512 ? "avx512" : "avx2");
#else
    Py_RETURN_NONE;
#endif
}

static PyObject *
py_set_isa(PyObject *self, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name) || !cpu_or_raise("set_isa"))
        return NULL;
#if RK_X86
    if (strcmp(name, "avx2") == 0) {
        rk_isa = ISA_AVX2;
    } else if (strcmp(name, "avx512") == 0) {
        if (!rk_has_avx512) {
            PyErr_SetString(PyExc_ValueError, "set_isa: isa 'avx512' needs AVX-512 F/BW/VL, which this CPU lacks");
            return NULL;
        }
        rk_isa = ISA_AVX512;
    } else {
        PyErr_Format(PyExc_ValueError, "set_isa: isa must be 'avx2' or 'avx512', got %R", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_threading(PyObject *self, PyObject *noargs)
{
    return PyUnicode_FromString(pool_threading());
}

/* ------------------------------------------------------------------ weights and GEMM (quant.c, gemm.c) */

static PyObject *
py_packed_bytes(PyObject *self, PyObject *args)
{
    int fmt;
    Py_ssize_t N, K;
    if (!PyArg_ParseTuple(args, "inn", &fmt, &N, &K))
        return NULL;
    if (fmt < PW_F32 || fmt > PW_Q8_0 || N < 1 || K < 1) {
        PyErr_SetString(PyExc_ValueError, "packed_bytes: bad format or shape");
        return NULL;
    }
    return PyLong_FromSsize_t(pw_bytes(fmt, N, K));
}

static PyObject *
py_pack_weight(PyObject *self, PyObject *args)
{
    Py_ssize_t w, N, K, ldw, out, out_bytes;
    int fmt;
    if (!PyArg_ParseTuple(args, "nnnninn", &w, &N, &K, &ldw, &fmt, &out, &out_bytes))
        return NULL;
    if (fmt < PW_F32 || fmt > PW_Q8_0 || N < 1 || K < 1 || ldw < K || !pw_bytes(fmt, N, K) ||
        out_bytes < pw_bytes(fmt, N, K)) {
        PyErr_SetString(PyExc_ValueError, "pack_weight: bad format, shape or buffer size");
        return NULL;
    }
    if (!cpu_or_raise("pack_weight"))
        return NULL;
    int ok = 0;
#if RK_X86
    Py_BEGIN_ALLOW_THREADS
    ok = pack_weight((const float *)w, N, K, ldw, fmt, (uint8_t *)out);
    Py_END_ALLOW_THREADS
#endif
    return PyBool_FromLong(ok);
}

static PyObject *
py_sgemm_packed(PyObject *self, PyObject *args)
{
    Py_ssize_t x, M, K, ldx, wp, N, bias, c, ldc, nthreads;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnn", &x, &M, &K, &ldx, &wp, &N, &bias, &c, &ldc, &nthreads))
        return NULL;
    const char *bad = check_pw((const pw_header *)wp, N, K);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "sgemm_packed: %s", bad);
        return NULL;
    }
    if (!cpu_or_raise("sgemm_packed"))
        return NULL;
#if RK_X86
    float *xs = NULL;
    if (((const pw_header *)wp)->fmt != PW_F32 && M > 0) {
        xs = (float *)PyMem_RawMalloc(sizeof(float) * (size_t)(M * (K / QB)));
        if (!xs)
            return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    gemm((const float *)x, M, K, ldx, (const pw_header *)wp, N, (const float *)bias, (float *)c, ldc, (int)nthreads, xs);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(xs);
#endif
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ attention (attention.c) */

static PyObject *
py_paged_attention(PyObject *self, PyObject *args)
{
    Py_ssize_t q, T, q_start, n_req, kv_indices, n_indices, page_size, num_pages, k_cache, v_cache, k_scale, v_scale;
    Py_ssize_t hq, hkv, d, out, nthreads;
    int dt;
    double sm_scale;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnninnndnn", &q, &T, &q_start, &n_req, &kv_indices, &n_indices, &page_size,
                          &num_pages, &k_cache, &v_cache, &k_scale, &v_scale, &dt, &hq, &hkv, &d, &sm_scale, &out,
                          &nthreads))
        return NULL;
    if (dt < 0 || dt >= KV_NDTYPES || kv_has_scale(dt) != (k_scale != 0) || (k_scale != 0) != (v_scale != 0)) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: unknown kv_dtype, or scales given for a dtype without");
        return NULL;
    }
    const char *bad = check_attn_meta((const int32_t *)q_start, n_req, T, (const int32_t *)kv_indices, n_indices,
                                      page_size, num_pages);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "paged_attention: %s", bad);
        return NULL;
    }
    if (!cpu_or_raise("paged_attention"))
        return NULL;
#if RK_X86
    Py_BEGIN_ALLOW_THREADS
    kv_tensor k = {(void *)k_cache, (uint16_t *)k_scale}, v = {(void *)v_cache, (uint16_t *)v_scale};
    paged_attention((const float *)q, hq * d, (const int32_t *)q_start, n_req, (const int32_t *)kv_indices, page_size,
                    k, v, dt, (int)hq, (int)hkv, (int)d, (float)sm_scale, (float *)out, (int)nthreads);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_kv_quantize(PyObject *self, PyObject *args)
{
    Py_ssize_t x, rows, d, q, scale;
    int dt;
    if (!PyArg_ParseTuple(args, "nnninn", &x, &rows, &d, &dt, &q, &scale))
        return NULL;
    if (dt < 0 || dt >= KV_NDTYPES || rows < 0 || d < 8 || d % 8 || kv_has_scale(dt) != (scale != 0)) {
        PyErr_SetString(PyExc_ValueError, "kv_quantize: bad kv_dtype, shape or scale buffer");
        return NULL;
    }
    if (!cpu_or_raise("kv_quantize"))
        return NULL;
#if RK_X86
    Py_BEGIN_ALLOW_THREADS
    kv_quantize_rows(dt, (const float *)x, rows, (int)d, (void *)q, (uint16_t *)scale);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ elementwise (ops.c) */

static PyObject *
py_add_rms_norm(PyObject *self, PyObject *args)
{
    Py_ssize_t delta, res, out, M, K, w;
    double eps;
    if (!PyArg_ParseTuple(args, "nnnnnnd", &delta, &res, &out, &M, &K, &w, &eps))
        return NULL;
#if RK_X86
    if (cpu_ok())
        add_rms_norm((const float *)delta, (float *)res, (float *)out, M, K, (const float *)w, (float)eps);
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_rope_inplace(PyObject *self, PyObject *args)
{
    Py_ssize_t x, T, nh, d, ldx, cos, sin;
    if (!PyArg_ParseTuple(args, "nnnnnnn", &x, &T, &nh, &d, &ldx, &cos, &sin))
        return NULL;
#if RK_X86
    if (cpu_ok())
        rope_inplace((float *)x, T, nh, d, ldx, (const float *)cos, (const float *)sin);
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_silu_mul(PyObject *self, PyObject *args)
{
    Py_ssize_t gu, out, M, I;
    if (!PyArg_ParseTuple(args, "nnnn", &gu, &out, &M, &I))
        return NULL;
#if RK_X86
    if (cpu_ok())
        silu_mul((const float *)gu, (float *)out, M, I);
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_apply_token_bitmask(PyObject *self, PyObject *args)
{
    Py_ssize_t logits, ldl, bitmask, ldb, rows, n_rows, vocab;
    if (!PyArg_ParseTuple(args, "nnnnnnn", &logits, &ldl, &bitmask, &ldb, &rows, &n_rows, &vocab))
        return NULL;
#if RK_X86
    if (cpu_ok()) {
        Py_BEGIN_ALLOW_THREADS
        apply_token_bitmask((float *)logits, ldl, (const int32_t *)bitmask, ldb, (const int64_t *)rows, n_rows, vocab);
        Py_END_ALLOW_THREADS
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *
py_advise_hugepages(PyObject *self, PyObject *args)
{
    Py_ssize_t addr, nbytes;
    if (!PyArg_ParseTuple(args, "nn", &addr, &nbytes))
        return NULL;
#ifdef MADV_HUGEPAGE
    /* only whole 2 MiB pages inside the range; pages not yet touched get transparent huge pages */
    uintptr_t lo = ((uintptr_t)addr + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1);
    uintptr_t hi = ((uintptr_t)addr + (uintptr_t)nbytes) & ~(uintptr_t)((2u << 20) - 1);
    if (hi > lo && madvise((void *)lo, hi - lo, MADV_HUGEPAGE) == 0)
        Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}


/* ------------------------------------------------------------------ the whole decode step (step.c) */

static void
step_plan_capsule_free(PyObject *cap)
{
    step_plan *p = (step_plan *)PyCapsule_GetPointer(cap, "radixkv.step_plan");
    if (p)
        step_plan_free(p);
}

/* step_plan(dims, layers, embed, final_norm, final_eps, lm_head, r2t, r2t_rows, r2t_cols,
 *           page_size, num_slots, sm_scale, kv_dtype) -> capsule
 * dims: (L, H, hq, hkv, d, inter, V). layers: L tuples (norm_in, norm_post, eps_in, eps_post,
 * qkv, qkv_b, o, o_b, gate_up, gate_up_b, down, down_b, k_cache, v_cache, k_scale, v_scale):
 * addresses (0 for no bias, and for the scales of a pool that is not fp8) and floats. kv_dtype:
 * the pool's (paged_attention's codes). Every packed weight's header is checked against its
 * shape. The RoPE tables are set with step_set_rope before the first step. */
static PyObject *
py_step_plan(PyObject *self, PyObject *args)
{
    step_dims dm;
    PyObject *layers;
    Py_ssize_t embed, fnorm, lm_head, r2t, r2t_rows, r2t_cols, page_size, num_slots;
    double feps, sm_scale;
    if (!PyArg_ParseTuple(args, "(iiiiiii)Onndnnnnnndi", &dm.L, &dm.H, &dm.hq, &dm.hkv, &dm.d, &dm.inter, &dm.V,
                          &layers, &embed, &fnorm, &feps, &lm_head, &r2t, &r2t_rows, &r2t_cols, &page_size, &num_slots,
                          &sm_scale, &dm.kv_dt))
        return NULL;
    if (!cpu_or_raise("step_plan"))
        return NULL;
    if (!step_dims_ok(&dm) || page_size < 1 || num_slots < 1 || r2t_rows < 1 || r2t_cols < 1 ||
        !PyTuple_Check(layers) || PyTuple_GET_SIZE(layers) != dm.L) {
        PyErr_SetString(PyExc_ValueError, "step_plan: bad dimensions or layer table");
        return NULL;
    }
    const char *bad = check_pw((const pw_header *)lm_head, dm.V, dm.H);
    layer_plan *lps = (layer_plan *)calloc((size_t)dm.L, sizeof(layer_plan));
    if (!lps)
        return PyErr_NoMemory();
    for (int l = 0; l < dm.L && !bad; l++) {
        Py_ssize_t a[14];
        double e0, e1;
        PyObject *item = PyTuple_GET_ITEM(layers, l);
        if (!PyArg_ParseTuple(item, "nnddnnnnnnnnnnnn", &a[0], &a[1], &e0, &e1, &a[2], &a[3], &a[4], &a[5], &a[6],
                              &a[7], &a[8], &a[9], &a[10], &a[11], &a[12], &a[13])) {
            free(lps);
            return NULL;
        }
        layer_plan *lp = &lps[l];
        lp->norm_in = (const float *)a[0], lp->norm_post = (const float *)a[1];
        lp->eps_in = (float)e0, lp->eps_post = (float)e1;
        for (int i = 0; i < 4; i++) {
            lp->w[i] = (const pw_header *)a[2 + 2 * i];
            lp->b[i] = (const float *)a[3 + 2 * i];
        }
        lp->k_cache.data = (void *)a[10], lp->v_cache.data = (void *)a[11];
        lp->k_cache.scale = (uint16_t *)a[12], lp->v_cache.scale = (uint16_t *)a[13];
        bad = step_check_layer(&dm, lp);
    }
    if (bad || !embed || !fnorm || !r2t) {
        free(lps);
        PyErr_Format(PyExc_ValueError, "step_plan: %s", bad ? bad : "an address is 0");
        return NULL;
    }
    step_plan *p = step_plan_new(&dm, lps, (const float *)embed, (const float *)fnorm, (float)feps,
                                 (const pw_header *)lm_head, (const int32_t *)r2t, r2t_rows, r2t_cols, page_size,
                                 num_slots, (float)sm_scale);
    free(lps);
    if (!p)
        return PyErr_NoMemory();
    PyObject *cap = PyCapsule_New(p, "radixkv.step_plan", step_plan_capsule_free);
    if (!cap)
        step_plan_free(p);
    return cap;
}

/* step_set_rope(plan, cos, sin, rope_len, width): the RoPE tables [rope_len, d] (positions 0 ..);
 * width must be the plan's head_dim. */
static PyObject *
py_step_set_rope(PyObject *self, PyObject *args)
{
    PyObject *cap;
    Py_ssize_t cos, sin, len, width;
    if (!PyArg_ParseTuple(args, "Onnnn", &cap, &cos, &sin, &len, &width))
        return NULL;
    step_plan *p = (step_plan *)PyCapsule_GetPointer(cap, "radixkv.step_plan");
    if (!p)
        return NULL;
    if (!cos || !sin || len < 0 || width != step_plan_head_dim(p)) {
        PyErr_SetString(PyExc_ValueError, "step_set_rope: bad table");
        return NULL;
    }
    step_plan_set_rope(p, (const float *)cos, (const float *)sin, len);
    Py_RETURN_NONE;
}

/* Reads a sequence of ints into out[0 .. n) (n <= cap); returns n, or -1 with an exception. */
static Py_ssize_t
read_ints(PyObject *seq, int64_t *out, Py_ssize_t cap, const char *name)
{
    PyObject *fast = PySequence_Fast(seq, name);
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > cap) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "decode_step: %s has more than %zd entries", name, cap);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = v;
    }
    Py_DECREF(fast);
    return n;
}

/* decode_step(plan, tokens, rows, prefix_lens, extend_lens, logits_rows, logits, nthreads): one
 * forward pass (see step.c). tokens: T ids (request after request); rows / prefix_lens /
 * extend_lens: per request its block-table row, K/V already in the pool and new tokens;
 * logits_rows: S token rows; logits: address of float32 [S, V]. Raises ValueError for any value
 * that would read or write outside the buffers (nothing is written then). */
static PyObject *
py_decode_step(PyObject *self, PyObject *args)
{
    PyObject *cap, *otok, *orows, *opre, *oext, *olr;
    Py_ssize_t logits, nthreads;
    if (!PyArg_ParseTuple(args, "OOOOOOnn", &cap, &otok, &orows, &opre, &oext, &olr, &logits, &nthreads))
        return NULL;
    step_plan *p = (step_plan *)PyCapsule_GetPointer(cap, "radixkv.step_plan");
    if (!p)
        return NULL;
    int64_t tok[STEP_MAX_ROWS], rows[STEP_MAX_ROWS], pre[STEP_MAX_ROWS], ext[STEP_MAX_ROWS], lr[STEP_MAX_ROWS];
    Py_ssize_t T = read_ints(otok, tok, STEP_MAX_ROWS, "tokens");
    Py_ssize_t B = T < 0 ? -1 : read_ints(orows, rows, STEP_MAX_ROWS, "rows");
    Py_ssize_t B2 = B < 0 ? -1 : read_ints(opre, pre, STEP_MAX_ROWS, "prefix_lens");
    Py_ssize_t B3 = B2 < 0 ? -1 : read_ints(oext, ext, STEP_MAX_ROWS, "extend_lens");
    Py_ssize_t S = B3 < 0 ? -1 : read_ints(olr, lr, STEP_MAX_ROWS, "logits_rows");
    if (S < 0)
        return NULL;
    int32_t t_row[STEP_MAX_ROWS], t_pos[STEP_MAX_ROWS], lrows[STEP_MAX_ROWS];
    const char *bad = B < 1 || B2 != B || B3 != B
                          ? "rows, prefix_lens and extend_lens need the same length >= 1"
                          : step_check_batch(p, tok, T, rows, pre, ext, B, lr, S, logits != 0, t_row, t_pos, lrows);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "decode_step: %s", bad);
        return NULL;
    }
    if (!cpu_or_raise("decode_step"))
        return NULL;
#if RK_X86
    int fail;
    Py_BEGIN_ALLOW_THREADS
    fail = step_run(p, tok, (int)T, t_row, t_pos, lrows, (int)S, (float *)logits, (int)nthreads);
    Py_END_ALLOW_THREADS
    if (fail)
        return PyErr_NoMemory();
#endif
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the module */

static PyMethodDef methods[] = {
    {"available", py_available, METH_NOARGS, "True when the CPU has AVX2, FMA and F16C."},
    {"isa", py_isa, METH_NOARGS, "'avx512' or 'avx2': the vector kernels in use (None: no kernels)."},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa('avx2' | 'avx512'): choose the vector kernels."},
    {"threading", py_threading, METH_NOARGS, "'openmp' or 'pthreads': what the kernels' threads are now."},
    {"sgemm_packed", py_sgemm_packed, METH_VARARGS, "C = X @ W^T (+ bias) with W packed in 16-column panels."},
    {"packed_bytes", py_packed_bytes, METH_VARARGS, "Bytes of a packed [N, K] weight in a format (0: K does not suit it)."},
    {"pack_weight", py_pack_weight, METH_VARARGS, "Pack W [N, K] in a format; False when it is not exact there."},
    {"advise_hugepages", py_advise_hugepages, METH_VARARGS, "madvise(MADV_HUGEPAGE) the whole 2 MiB pages of a range."},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS, "residual += delta; out = RMSNorm(residual) * w."},
    {"rope_inplace", py_rope_inplace, METH_VARARGS, "Rotate-half RoPE in place."},
    {"silu_mul", py_silu_mul, METH_VARARGS, "out = silu(gate) * up."},
    {"apply_token_bitmask", py_apply_token_bitmask, METH_VARARGS, "-inf where a token bitmask bit is 0."},
    {"step_plan", py_step_plan, METH_VARARGS, "The addresses of a model for decode_step (a capsule)."},
    {"step_set_rope", py_step_set_rope, METH_VARARGS, "Set a step plan's RoPE tables."},
    {"decode_step", py_decode_step, METH_VARARGS, "One whole forward pass of a decode batch (see the source)."},
    {"paged_attention", py_paged_attention, METH_VARARGS, "Causal paged attention (FlashInfer semantics)."},
    {"kv_quantize", py_kv_quantize, METH_VARARGS, "float32 rows rounded to a K/V pool dtype (+ fp8 scales)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "radixkv.kernels._ckernels", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__ckernels(void)
{
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, pool_after_fork_child);
        atfork_done = 1;
    }
    return PyModule_Create(&moddef);
}
