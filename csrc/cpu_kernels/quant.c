/* Weight packing for the GEMM (gemm.c): W [N, K] in panels of 16 output columns, as float32 or in
 * the Q4_1 / Q8_0 block formats, which are lossless or refused (see pack_weight). */
#include "internal.h"

/* Bytes of a packed [N, K] weight in format fmt (header included); 0: K does not suit fmt. */
Py_ssize_t
pw_bytes(int fmt, Py_ssize_t N, Py_ssize_t K)
{
    Py_ssize_t panels = (N + NR - 1) / NR;
    if (fmt == PW_F32)
        return (Py_ssize_t)sizeof(pw_header) + panels * K * NR * (Py_ssize_t)sizeof(float);
    if (K % QB)
        return 0;
    return (Py_ssize_t)sizeof(pw_header) + panels * (K / QB) * (fmt == PW_Q4_1 ? Q4_GROUP : Q8_GROUP);
}

const char *
check_pw(const pw_header *w, Py_ssize_t N, Py_ssize_t K)
{
    if (!w || w->magic != PW_MAGIC || w->fmt > PW_Q8_0)
        return "a weight is not a packed weight";
    if (w->n != N || w->k != K)
        return "a packed weight's shape does not match";
    if (w->fmt != PW_F32 && K % QB)
        return "a block-format weight needs K to be a multiple of 32";
    return NULL;
}

#if RK_X86
static inline uint32_t
f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Finds fp16 d, m and q[i] in 0..15 with fmaf(q[i], d, m) == v[i] bitwise for a block of QB
 * values (the form GGUF's Q4_1 dequantizes to: m is the block minimum, the maximum has q = 15).
 * Returns 0 when there are none. */
__attribute__((target("avx2,fma,f16c"))) static int
encode_q4_1(const float *v, uint16_t *hd, uint16_t *hm, uint8_t *q)
{
    float mn = v[0], mx = v[0];
    for (int i = 0; i < QB; i++) {
        if (!isfinite(v[i]))
            return 0;
        mn = v[i] < mn ? v[i] : mn;
        mx = v[i] > mx ? v[i] : mx;
    }
    uint16_t m16 = _cvtss_sh(mn, _MM_FROUND_TO_NEAREST_INT);
    if (f32_bits(_cvtsh_ss(m16)) != f32_bits(mn))
        return 0;
    int c = _cvtss_sh((mx - mn) / 15.f, _MM_FROUND_TO_NEAREST_INT);
    static const int tries[] = {0, 1, -1, 2, -2};
    for (int t = 0; t < 5; t++) {
        int h = c + tries[t];
        if (h < 0 || h >= 0x7c00) /* +0 .. the largest finite fp16 */
            continue;
        float d = _cvtsh_ss((uint16_t)h);
        int ok = 1;
        for (int i = 0; i < QB && ok; i++) {
            float qf = d > 0.f ? nearbyintf((v[i] - mn) / d) : 0.f;
            ok = qf >= 0.f && qf <= 15.f;
            q[i] = ok ? (uint8_t)qf : 0;
            /* checked as the kernel decodes it: from the stored integer (never -0), one FMA */
            ok = ok && f32_bits(fmaf((float)q[i], d, mn)) == f32_bits(v[i]);
        }
        if (ok) {
            *hd = (uint16_t)h;
            *hm = m16;
            return 1;
        }
    }
    return 0;
}

/* Finds fp16 d and q[i] in -128..127 with q[i] * d == v[i] bitwise (GGUF's Q8_0 form: the
 * largest magnitude has |q| = 127). Returns 0 when there are none. */
__attribute__((target("avx2,fma,f16c"))) static int
encode_q8_0(const float *v, uint16_t *hd, int8_t *q)
{
    float amax = 0.f;
    for (int i = 0; i < QB; i++) {
        if (!isfinite(v[i]))
            return 0;
        amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    }
    int c = _cvtss_sh(amax / 127.f, _MM_FROUND_TO_NEAREST_INT);
    static const int tries[] = {0, 1, -1};
    for (int t = 0; t < 3; t++) {
        int h = c + tries[t];
        if (h < 0 || h >= 0x7c00)
            continue;
        float d = _cvtsh_ss((uint16_t)h);
        int ok = 1;
        for (int i = 0; i < QB && ok; i++) {
            float qf = d > 0.f ? nearbyintf(v[i] / d) : 0.f;
            ok = qf >= -128.f && qf <= 127.f;
            q[i] = ok ? (int8_t)qf : 0;
            ok = ok && f32_bits((float)q[i] * d) == f32_bits(v[i]); /* as decoded: -0 is refused */
        }
        if (ok) {
            *hd = (uint16_t)h;
            return 1;
        }
    }
    return 0;
}

/* Writes W [N, K] (rows ldw floats apart) packed in format fmt to out (pw_bytes(fmt, N, K)
 * bytes). Panel p holds rows 16p .. 16p + 15 (zeros past N):
 *   PW_F32:  float32 [K][16]: k-th row of the panel, one cache line.
 *   PW_Q4_1: K / 32 groups of Q4_GROUP bytes: fp16 d[16], fp16 m[16], then 32 k rows of 8 bytes
 *            (byte j: column j in the low nibble, column j + 8 in the high one).
 *   PW_Q8_0: K / 32 groups of Q8_GROUP bytes: fp16 d[16], then 32 k rows of 16 int8.
 * The quantized forms are lossless or refused: returns 0 (out unusable) unless every block of 32
 * k of every row decodes to exactly the float32 given. */
__attribute__((target("avx2,fma,f16c"))) int
pack_weight(const float *w, Py_ssize_t N, Py_ssize_t K, Py_ssize_t ldw, int fmt, uint8_t *out)
{
    pw_header *hdr = (pw_header *)out;
    memset(hdr, 0, sizeof *hdr);
    uint8_t *dst = out + sizeof *hdr;
    const Py_ssize_t panels = (N + NR - 1) / NR;
    if (fmt == PW_F32) {
        float *f = (float *)dst;
        for (Py_ssize_t p = 0; p < panels; p++)
            for (Py_ssize_t k = 0; k < K; k++)
                for (int j = 0; j < NR; j++) {
                    Py_ssize_t n = p * NR + j;
                    *f++ = n < N ? w[n * ldw + k] : 0.f;
                }
    } else {
        uint8_t q[NR][QB];
        for (Py_ssize_t p = 0; p < panels; p++)
            for (Py_ssize_t g = 0; g < K / QB; g++) {
                uint16_t *d16 = (uint16_t *)dst, *m16 = d16 + NR;
                for (int j = 0; j < NR; j++) {
                    Py_ssize_t n = p * NR + j;
                    const float *v = w + n * ldw + g * QB;
                    if (n >= N) {
                        d16[j] = 0;
                        if (fmt == PW_Q4_1)
                            m16[j] = 0;
                        memset(q[j], 0, QB);
                    } else if (fmt == PW_Q4_1 ? !encode_q4_1(v, d16 + j, m16 + j, q[j])
                                              : !encode_q8_0(v, d16 + j, (int8_t *)q[j])) {
                        return 0;
                    }
                }
                if (fmt == PW_Q4_1) {
                    uint8_t *qs = dst + 4 * NR;
                    for (int k = 0; k < QB; k++)
                        for (int j = 0; j < NR / 2; j++)
                            qs[k * (NR / 2) + j] = (uint8_t)(q[j][k] | q[j + NR / 2][k] << 4);
                    dst += Q4_GROUP;
                } else {
                    uint8_t *qs = dst + 2 * NR;
                    for (int k = 0; k < QB; k++)
                        for (int j = 0; j < NR; j++)
                            qs[k * NR + j] = q[j][k];
                    dst += Q8_GROUP;
                }
            }
    }
    hdr->magic = PW_MAGIC;
    hdr->fmt = (uint32_t)fmt;
    hdr->n = N;
    hdr->k = K;
    return 1;
}
#endif
