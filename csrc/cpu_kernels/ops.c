/* The elementwise kernels, one thread each: RMSNorm with the residual add fused, rotate-half RoPE,
 * SwiGLU's silu(gate) * up, grammar bitmasks. */
#include "internal.h"

#if RK_X86
/* residual += delta (when delta); out = w * residual / sqrt(mean(residual^2) + eps), per row. */
__attribute__((target("avx2,fma"))) void
add_rms_norm(const float *delta, float *res, float *out, Py_ssize_t M, Py_ssize_t K, const float *w, float eps)
{
    for (Py_ssize_t m = 0; m < M; m++) {
        float *r = res + m * K, *o = out + m * K;
        if (delta) {
            const float *dl = delta + m * K;
            for (Py_ssize_t k = 0; k < K; k++)
                r[k] += dl[k];
        }
        __m256 acc = _mm256_setzero_ps();
        Py_ssize_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v = _mm256_loadu_ps(r + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum256(acc);
        for (; k < K; k++)
            ss += r[k] * r[k];
        float scale = 1.f / sqrtf(ss / (float)K + eps);
        for (k = 0; k < K; k++)
            o[k] = w[k] * (r[k] * scale);
    }
}

/* Rotate-half RoPE in place on T rows of nh heads (head h of row t at x + t * ldx + h * d):
 * x1' = x1 cos1 - x2 sin1, x2' = x2 cos2 + x1 sin2, with cos / sin [T, d] (halves 1 and 2). */
__attribute__((target("avx2,fma"))) void
rope_inplace(float *x, Py_ssize_t T, Py_ssize_t nh, Py_ssize_t d, Py_ssize_t ldx, const float *cos, const float *sin)
{
    Py_ssize_t half = d / 2;
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *c = cos + t * d, *sn = sin + t * d;
        for (Py_ssize_t h = 0; h < nh; h++) {
            float *x1 = x + t * ldx + h * d, *x2 = x1 + half;
            for (Py_ssize_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * sn[i];
                x2[i] = b * c[half + i] + a * sn[half + i];
            }
        }
    }
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i], silu(g) = g / (1 + exp(-g)). */
__attribute__((target("avx2,fma"))) void
silu_mul(const float *gu, float *out, Py_ssize_t M, Py_ssize_t I)
{
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (Py_ssize_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        Py_ssize_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++)
            o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* act[:, 16u ... 16u + 16) = silu(gate) * up for the rows of gu (as silu_mul, vector lanes). */
__attribute__((target("avx2,fma"))) void
silu_cols(const float *gu, float *act, int M, Py_ssize_t I, Py_ssize_t col)
{
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I + col, *u = g + I;
        float *o = act + m * I + col;
        for (int i = 0; i < NR; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
    }
}

/* Grammar masks: logits[rows[i], j] = -inf wherever bit j (LSB first, 32 tokens per int32 word) of
 * bitmask row rows[i] is 0 (xgrammar's token bitmask layout). Words that allow all 32 tokens are
 * skipped, words that allow none are stored as -inf at once; the others blend 8 lanes at a time. */
__attribute__((target("avx2,fma"))) void
apply_token_bitmask(float *logits, Py_ssize_t ldl, const int32_t *bitmask, Py_ssize_t ldb, const int64_t *rows,
                    Py_ssize_t n_rows, Py_ssize_t vocab)
{
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i zero = _mm256_setzero_si256();
    const Py_ssize_t words = vocab / 32;
    for (Py_ssize_t r = 0; r < n_rows; r++) {
        float *x = logits + rows[r] * ldl;
        const uint32_t *bm = (const uint32_t *)(bitmask + rows[r] * ldb);
        for (Py_ssize_t w = 0; w < words; w++) {
            const uint32_t m = bm[w];
            float *p = x + w * 32;
            if (m == 0xFFFFFFFFu)
                continue;
            if (m == 0) {
                for (int q = 0; q < 4; q++)
                    _mm256_storeu_ps(p + 8 * q, ninf);
                continue;
            }
            for (int q = 0; q < 4; q++) {
                const __m256i b = _mm256_set1_epi32((int)((m >> (8 * q)) & 0xFFu));
                const __m256i off = _mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bit), zero);
                _mm256_storeu_ps(p + 8 * q, _mm256_blendv_ps(_mm256_loadu_ps(p + 8 * q), ninf, _mm256_castsi256_ps(off)));
            }
        }
        for (Py_ssize_t j = words * 32; j < vocab; j++)
            if (!((bm[j / 32] >> (j % 32)) & 1u))
                x[j] = -INFINITY;
    }
}
#endif
