/* The K/V pool's element formats: the one writer (kv_quantize_rows; kv_store, below, is it
 * for one head's row). Reading is attention.c's kv_load8.
 *
 *   float32    copied
 *   bfloat16   round to nearest even on the bits: (b + 0x7FFF + ((b >> 16) & 1)) >> 16, NaN ->
 *              0x7FC0 (c10::BFloat16's round_to_nearest_even, what torch's .to(torch.bfloat16) does)
 *   float16    F16C's vcvtps2ph, round to nearest even (torch's .to(torch.float16): the same bits)
 *   fp8        per row (one token's head: d values) scale = bf16_ceil(amax / FP8_MAX) (amax = max
 *              |x|, float32 division, then the bits rounded UP to a bfloat16: (b + 0xFFFF) &
 *              0xFFFF0000; 1 where amax / FP8_MAX is 0), then every x / scale (float32 division, not a
 *              reciprocal) rounded to nearest even to float8_e4m3fn (FP8_MAX 448) or float8_e5m2
 *              (FP8_MAX 57344), as torch's .to(torch.float8_e4m3fn / float8_e5m2) does: by integer
 *              arithmetic on the float32 bits for normal results, and for subnormal ones by adding
 *              a power of two whose ulp is the fp8 subnormal step (the float add rounds to nearest
 *              even). |x / scale| <= FP8_MAX up to a rounding of the division; values past it
 *              saturate to +-FP8_MAX (torch saturates e4m3fn there too and rounds e5m2 below
 *              61440 to its max), NaN gives the NaN code (0x7F | sign), which finite rows never
 *              produce.
 *
 * Everything is AVX2 integer and float arithmetic (8 lanes) whose result does not depend on the
 * lane count, so the AVX2 and AVX-512 builds give the same bits, and the same bits as torch's casts
 * (tests/test_kv_dtypes.py checks every float32 near every fp8 rounding boundary and millions of
 * random values against torch). */

#include "internal.h"

#if RK_X86
/* 8 bfloat16 (round to nearest even; NaN -> 0x7FC0) of 8 floats. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m128i
bf16_rne8(__m256 x)
{
    const __m256i b = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* The fp8 codes (in the low byte of each 32-bit lane) of 8 floats: E4M3 selects float8_e4m3fn
 * (4 exponent bits, bias 7, 3 mantissa bits, subnormals below 2^-6), else float8_e5m2 (5, 15, 2,
 * below 2^-14). Saturates at +-FP8_MAX; NaN -> 0x7F | sign. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256i
fp8_rne8(__m256 x, const int e4m3)
{
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const int drop = 23 - mbits;                       /* float32 mantissa bits dropped */
    const uint32_t max_bits = e4m3 ? 0x43E00000u : 0x47600000u; /* 448, 57344 */
    const uint32_t min_normal = (uint32_t)(127 + 1 - bias) << 23; /* 2^-6, 2^-14 */
    /* a power of two whose float32 ulp is the fp8 subnormal step 2^(1 - bias - mbits) */
    const uint32_t denorm = (uint32_t)(127 + 1 - bias - mbits + 23) << 23;
    const __m256i b = _mm256_castps_si256(x);
    const __m256i sign = _mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u));
    __m256i a = _mm256_xor_si256(b, sign); /* |x| (as bits: ordered like the values) */
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    a = _mm256_min_epi32(a, _mm256_set1_epi32((int)max_bits));
    /* normal: rebias the exponent and round the mantissa to nearest even by adding half an ulp
     * minus one plus the kept mantissa's lowest bit */
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, drop), _mm256_set1_epi32(1));
    const int rebias = (int)((uint32_t)(bias - 127) << 23) + ((1 << (drop - 1)) - 1);
    __m256i nrm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(rebias)), odd), drop);
    /* subnormal: the float add rounds to a multiple of the subnormal step; its low bits are the code */
    const __m256 dn = _mm256_castsi256_ps(_mm256_set1_epi32((int)denorm));
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), dn)),
                                   _mm256_set1_epi32((int)denorm));
    __m256i r = _mm256_blendv_epi8(nrm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)min_normal), a));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), nan);
    return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

/* The 8 low bytes of 8 32-bit lanes (each < 256), stored at dst. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
store_bytes8(uint8_t *dst, __m256i r)
{
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64((__m128i *)dst, _mm_packus_epi16(w, w));
}

/* max |x| over x[0 .. d) (d a multiple of 8; max is exact, so any order gives these bits), NaN
 * when x holds a NaN (as torch's amax: maxps alone drops a NaN or keeps it by its position, so the
 * row's scale depended on where the NaN was). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline float
amax_row(const float *x, int d)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int e = 0; e < d; e += 8) {
        const __m256 v = _mm256_loadu_ps(x + e);
        m = _mm256_max_ps(m, _mm256_and_ps(v, abs_mask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    return _mm256_movemask_ps(nan) ? NAN : hmax256(m);
}

/* The fp8 scale of a row whose max |x| is amax: bf16_ceil(amax / fp8_max), 1 where that ratio is 0
 * (an all-zero row, or an amax so small the division underflows: a zero scale would read back NaN)
 * (bfloat16 bits). */
static inline uint16_t
fp8_scale(float amax, float fp8_max)
{
    float s = amax / fp8_max;
    if (s == 0.f)
        return 0x3F80;
    uint32_t u;
    memcpy(&u, &s, sizeof u);
    return (uint16_t)((u + 0xFFFFu) >> 16);
}

__attribute__((target("avx2,fma,f16c"))) void
kv_quantize_rows(int dt, const float *x, Py_ssize_t rows, int d, void *q, uint16_t *scale)
{
    if (dt == KV_F32) {
        memcpy(q, x, sizeof(float) * (size_t)(rows * d));
        return;
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        if (dt == KV_BF16 || dt == KV_F16) {
            uint16_t *qr = (uint16_t *)q + r * d;
            for (int e = 0; e < d; e += 8) {
                __m256 v = _mm256_loadu_ps(xr + e);
                __m128i h = dt == KV_BF16 ? bf16_rne8(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
                _mm_storeu_si128((__m128i *)(qr + e), h);
            }
            continue;
        }
        const int e4m3 = dt == KV_E4M3;
        const uint16_t s = fp8_scale(amax_row(xr, d), e4m3 ? 448.f : 57344.f);
        scale[r] = s;
        const __m256 vs = _mm256_set1_ps(bf16_to_f32(s));
        uint8_t *qr = (uint8_t *)q + r * d;
        for (int e = 0; e < d; e += 8) {
            __m256 v = _mm256_div_ps(_mm256_loadu_ps(xr + e), vs);
            store_bytes8(qr + e, e4m3 ? fp8_rne8(v, 1) : fp8_rne8(v, 0));
        }
    }
}
#endif

void
kv_store(const kv_tensor *t, int dt, Py_ssize_t slot, int hkv, int h, const float *src, int d)
{
    const Py_ssize_t i = slot * hkv + h;
    kv_quantize_rows(dt, src, 1, d, (uint8_t *)t->data + i * d * kv_elem_size(dt), t->scale ? t->scale + i : NULL);
}
