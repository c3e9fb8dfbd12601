/* Attention over runs of entries, a block of BLOCK_ENTRIES at a time: what both CPU kernels share.
 *
 * Included by attend_codes.c (the library's quantized rows, kvfold.runtime.quantized_attention) and
 * attend_pool.c (the served files' rows in an engine's blocks, kvfold.runtime.pool_attention). It holds:
 *
 * - vectors of LANES floats and what keeps them in registers (in_register, vfma, vsum4);
 * - codes as numbers (code_vector, unpack): 8 bits one a byte; 4 and 2 bits by planes (byte j holds the
 *   codes of channels j, j + D/p, ..., p = 8/bits codes a byte); 3 bits eight codes in three bytes
 *   (code i of the eight at bit 3i of their little-endian 24-bit word). KIVI's axes (Liu et al. 2024 §3):
 *   keys per channel over groups of entries, values per entry, each with a scale and a zero point;
 * - a running softmax over blocks of entries (softmax_state, update_maximum): each query's maximum
 *   logit, its weights' sum and weighted values relative to it, rescaled when the maximum grows;
 * - a block's logits (block_logits: a key group's scales folded into the queries by the caller,
 *   q · k = codes · (q ⊙ s) + q · z) and its weighted values (block_values: a value's scale folded into
 *   its weight, its zero point into a sum), reading the codes in place or numbers unpacked once.
 *
 * Nothing here checks a bound: each caller checks every run it passes (before the call, or before each
 * block in the debug build). */
#ifndef KVFOLD_ATTEND_BLOCKS_H
#define KVFOLD_ATTEND_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK_ENTRIES 32 /* entries whose logits are taken before the softmax is updated */
/* At most this many queries in a pass turn codes into numbers where used, in both kernels: three, and four
 * for 8-bit codes; more unpack a block once into numbers for all of them, at a width known when compiled.
 * Four (a GQA group of Llama-3.1-8B's) in place took 1.23x the time of unpacking with 4-bit codes and 1.28x
 * with 3-bit in the pool kernel at a head size of 64 (1.08x and 1.10x at 128), 1.11x and 1.25x in the codes
 * kernel (1.13x and 1.19x at 128), but 0.89x and 0.84x with 8-bit in the pool kernel, 0.79x in the codes
 * kernel at 64 (benchmarks/pool_kernel.py --group 4 and codes_kernel.py --queries 4, paired; outputs equal
 * bit for bit): an 8-bit code is a byte read where it is used. */
#define CODES_IN_PLACE_QUERIES 3
#define CODES_IN_PLACE_QUERIES_8BIT 4

/* How many queries a pass may read codes of `bits` bits in place (above). */
static inline int64_t codes_in_place_queries(int bits) {
    return bits == 8 ? CODES_IN_PLACE_QUERIES_8BIT : CODES_IN_PLACE_QUERIES;
}

/* ------------------------------------------------------------------ vectors */
/* A vector of LANES floats (GCC's and Clang's vector extensions): sixteen in an AVX-512 register where
 * the machine has them, else eight (an AVX2 register, or a pair of SSE ones). A vector wider than the
 * machine's registers is lowered through the stack: sixteen lanes on an AVX2 machine ran the kernel at
 * a third of this speed. Head sizes are multiples of 16. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vf_unaligned __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint8_t vbytes __attribute__((vector_size(LANES)));
typedef uint8_t vbytes_unaligned __attribute__((vector_size(LANES), aligned(1)));
typedef uint16_t vhalves __attribute__((vector_size(LANES * 2)));
typedef uint16_t vhalves_unaligned __attribute__((vector_size(LANES * 2), aligned(2)));
typedef int32_t v8i __attribute__((vector_size(32)));                  /* a 3-bit group's eight codes */
typedef float v8f_unaligned __attribute__((vector_size(32), aligned(4)));
typedef float v8f __attribute__((vector_size(32)));
#define BLOCK_VECTORS (BLOCK_ENTRIES / LANES) /* vectors across a block's entries */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vf vload(const float *p) { return *(const vf_unaligned *)p; }
/* Keeps a loaded vector in a register: GCC otherwise folds its load into every multiply-add that uses it,
 * loading the vector once per use, and the kernel's loops were bound by their loads (keeping them in
 * registers made a first step about 1.3x faster, paired). Only where a vector is one of the machine's
 * registers (AVX's 8 floats, AVX-512's 16). */
ALWAYS_INLINE void in_register(vf *a) {
#if (defined(__AVX__) && LANES == 8) || (defined(__AVX512F__) && LANES == 16)
    __asm__("" : "+x"(*a));
#else
    (void)a;
#endif
}
/* acc + a · b, fused: an intrinsic where the machine has FMA, which GCC does not reassociate (with
 * -fassociative-math it turned four entries' chains of `acc += a * b` into trees of multiplies and adds,
 * 44 operations for 32 multiply-adds). */
ALWAYS_INLINE vf vfma(vf acc, vf a, vf b) {
#if defined(__AVX512F__) && LANES == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__) && LANES == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}
ALWAYS_INLINE void vstore(float *p, vf x) { *(vf_unaligned *)p = x; }
ALWAYS_INLINE float vsum(vf x) {
    float out = 0.0f;
    for (int k = 0; k < LANES; ++k) out += x[k];
    return out;
}
/* The sums of four vectors' lanes into out[0 .. 4), by pairwise additions across them (three vhaddps
 * with AVX2; AVX-512 first adds each vector's halves): four separate sums take six shuffles and adds
 * each, a tenth of a decode step's kernel time. */
ALWAYS_INLINE void vsum4(vf a0, vf a1, vf a2, vf a3, float *out) {
#if defined(__AVX2__) && (LANES == 8 || LANES == 16)
#if LANES == 16
#define HALVES(x) _mm256_add_ps(_mm512_castps512_ps256((__m512)(x)), \
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)(x)), 1)))
    const __m256 b0 = HALVES(a0), b1 = HALVES(a1), b2 = HALVES(a2), b3 = HALVES(a3);
#undef HALVES
#else
    const __m256 b0 = (__m256)a0, b1 = (__m256)a1, b2 = (__m256)a2, b3 = (__m256)a3;
#endif
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    out[0] = vsum(a0), out[1] = vsum(a1), out[2] = vsum(a2), out[3] = vsum(a3);
#endif
}
/* LANES codes as numbers: the bytes p[0 .. LANES) shifted right by `shift` bits and masked by `mask`
 * (8-bit codes: 0 and 255; a 4- or 2-bit plane: its shift and 15 or 3). With AVX2 or AVX-512 the bytes
 * are shifted and masked in one 128-bit register (a 16-bit shift, then the mask drops what crossed from
 * the next byte), then zero-extended (vpmovzxbd) and converted: GCC 12 compiles a shift or mask of a
 * generic 8-byte vector into a byte at a time through a general register, and its conversion into a
 * load and insert a byte; together they were most of a decode step's kernel time. */
#if defined(__AVX512F__)
ALWAYS_INLINE vf codes_to_float(const uint8_t *p, int shift, int mask) {
    const __m128i x = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)p), shift), _mm_set1_epi8((char)mask));
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
}
#elif defined(__AVX2__)
ALWAYS_INLINE vf codes_to_float(const uint8_t *p, int shift, int mask) {
    const __m128i x = _mm_and_si128(_mm_srli_epi16(_mm_loadl_epi64((const __m128i *)p), shift), _mm_set1_epi8((char)mask));
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
}
#else
ALWAYS_INLINE vf codes_to_float(const uint8_t *p, int shift, int mask) {
    const vbytes b = (*(const vbytes_unaligned *)p >> shift) & (uint8_t)mask;
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}
#endif


/* ------------------------------------------------------------------ codes */
/* Codes 8g .. 8g + 7 of an entry's 3-bit codes as numbers: their three bytes' word, shifted eight ways at
 * once (vpsrlvd with AVX2). */
ALWAYS_INLINE v8f code_group(const uint8_t *src, int64_t g) {
    const v8i shifts = {0, 3, 6, 9, 12, 15, 18, 21};
    const uint8_t *b = src + 3 * g;
    const int32_t word = (int32_t)((uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16));
    return __builtin_convertvector(((word + (v8i){0}) >> shifts) & 7, v8f);
}

/* Whether an entry's codes of this width and head size come a vector at a time (code_vector): 8 bits; 4
 * and 2 bits where a plane holds whole vectors; 3 bits in vectors of eight. */
ALWAYS_INLINE int codes_by_vector(int bits, int64_t dim) {
    if (bits == 8) return 1;
    if (bits == 4) return dim % (2 * LANES) == 0;
    if (bits == 2) return dim % (4 * LANES) == 0;
    return bits == 3 && LANES == 8;
}

/* Vector v (channels v · LANES ..) of one entry's codes `src` as numbers (codes_by_vector(bits, dim) must
 * hold): what unpack writes there, and what a decode step reads in place. */
ALWAYS_INLINE vf code_vector(const uint8_t *src, int64_t v, int bits, int64_t dim) {
    if (bits == 8) return codes_to_float(src + v * LANES, 0, 255);
    if (bits == 4) {
        const int64_t per = dim / 2 / LANES; /* vectors a plane */
        return v < per ? codes_to_float(src + v * LANES, 0, 15) : codes_to_float(src + (v - per) * LANES, 4, 15);
    }
    if (bits == 2) {
        const int64_t per = dim / 4 / LANES, plane = v / per;
        return codes_to_float(src + (v - plane * per) * LANES, 2 * (int)plane, 3);
    }
#if LANES == 8
    return (vf)code_group(src, v);
#else
    return (vf){0}; /* not reached: codes_by_vector is false */
#endif
}

/* One entry's codes as numbers: 8 bits one a byte; 4 and 2 bits by planes (byte j holds channels
 * j, j + D/p, ..., p = 8/bits); 3 bits eight codes in three bytes (code i at bit 3i of their
 * little-endian 24-bit word). Head sizes are multiples of 16, so 8-bit codes come LANES bytes at a
 * time, and 4- and 2-bit planes too where a plane holds a multiple of LANES bytes (a byte at a time
 * otherwise). */
ALWAYS_INLINE void unpack(const uint8_t *src, int64_t dim, int bits, float *dst) {
    if (codes_by_vector(bits, dim)) {
        for (int64_t v = 0; v < dim / LANES; ++v) vstore(dst + v * LANES, code_vector(src, v, bits, dim));
    } else if (bits == 4) { /* a plane of fewer bytes than a vector: a byte at a time */
        const int64_t w = dim / 2;
        for (int64_t j = 0; j < w; ++j) dst[j] = (float)(src[j] & 15u);
        for (int64_t j = 0; j < w; ++j) dst[w + j] = (float)(src[j] >> 4);
    } else if (bits == 2) {
        const int64_t w = dim / 4;
        for (int64_t j = 0; j < w; ++j) dst[j] = (float)(src[j] & 3u);
        for (int64_t j = 0; j < w; ++j) dst[w + j] = (float)((src[j] >> 2) & 3u);
        for (int64_t j = 0; j < w; ++j) dst[2 * w + j] = (float)((src[j] >> 4) & 3u);
        for (int64_t j = 0; j < w; ++j) dst[3 * w + j] = (float)(src[j] >> 6);
    } else { /* 3 bits in vectors of sixteen: two groups of eight a vector */
        for (int64_t g = 0; g < dim / 8; ++g) *(v8f_unaligned *)(dst + 8 * g) = code_group(src, g);
    }
}

/* Vector v of entry t of a block's rows: `rows` is (count, dim) floats when bits is 0, else the entries'
 * codes, `stride` bytes an entry, turned into numbers here (no block of numbers written and read back). */
ALWAYS_INLINE vf entry_vector(const void *rows, int64_t t, int64_t v, int bits, int64_t stride, int64_t dim) {
    if (bits == 0) return vload((const float *)rows + t * dim + v * LANES);
    return code_vector((const uint8_t *)rows + t * stride, v, bits, dim);
}

/* ------------------------------------------------------------------ the running softmax */
typedef struct {
    int64_t m;
    float *top, *den, *zero_sum, *num; /* (m), (m), (m), (m, dim) */
    float *logits;                     /* (m, BLOCK_ENTRIES): query i's logits, then weights, of a block */
} softmax_state;

/* exp(x) for x <= 0 (−inf included: 0), to about 2e-7 relative (Cephes' expf polynomial after
 * x = n ln 2 + r), branch-free so that a loop of it vectorises; below −87 it is 0 (weights under
 * 1.6e-38 of the largest, which has weight 1). */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = floorf(clamped * 1.44269504088896341f + 0.5f);
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n = {.i = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * two_n.f;
}

/* The largest of a block's logits l[0 .. BLOCK_ENTRIES), a vector at a time: a scalar loop is one
 * chain of dependent maxima (vmaxss), which GCC does not vectorise while NaNs are honoured. */
ALWAYS_INLINE float block_maximum(const float *l) {
    vf top = vload(l);
    for (int a = 1; a < BLOCK_VECTORS; ++a) {
        const vf x = vload(l + a * LANES);
        const vi greater = x > top;
        top = (vf)(((vi)x & greater) | ((vi)top & ~greater));
    }
    float out = top[0];
    for (int k = 1; k < LANES; ++k) out = top[k] > out ? top[k] : out;
    return out;
}

/* Turn a block's logits (n entries) into weights relative to the running maximum, rescaling what was
 * gathered before when the maximum grows; adds the weights to the denominators. The block's slots past n
 * are set to −inf (weight 0) so that the maximum and the weights go over whole vectors. Not marked inline:
 * the compiler's choice kept the pool kernel's float32 results as they were (inlined everywhere, their
 * sums' order moved). */
static void update_maximum(softmax_state *s, int64_t n, int64_t dim) {
    for (int64_t i = 0; i < s->m; ++i) {
        float *l = s->logits + i * BLOCK_ENTRIES;
        for (int64_t t = n; t < BLOCK_ENTRIES; ++t) l[t] = -INFINITY;
        const float block_top = block_maximum(l);
        if (block_top == -INFINITY) { /* nothing seen yet, or all masked: weights 0 */
            for (int64_t t = 0; t < n; ++t) l[t] = 0.0f;
            continue;
        }
        if (block_top > s->top[i]) {
            const float keep = exp_nonpositive(s->top[i] - block_top);
            s->den[i] *= keep, s->zero_sum[i] *= keep;
            float *o = s->num + i * dim;
            for (int64_t c = 0; c < dim; ++c) o[c] *= keep;
            s->top[i] = block_top;
        }
        const float top = s->top[i];
        float added = 0.0f;
        for (int64_t t = 0; t < BLOCK_ENTRIES; ++t) {
            const float w = exp_nonpositive(l[t] - top);
            l[t] = w;
            added += w;
        }
        s->den[i] += added;
    }
}

/* ------------------------------------------------------------------ a block of entries */
/* Query rows i .. i + rows − 1's (rows 1 to 3) dot products with a block's keys into their logits (keys as
 * entry_vector reads them: numbers, or codes turned into numbers here): four entries at a time, the
 * rows' query vectors and each key vector loaded once into a register and used by every row (rows × 4
 * chains of multiply-adds; one row at a time loaded five vectors for four multiply-adds, and GCC loaded a
 * vector again for each use). */
ALWAYS_INLINE void logits_rows(softmax_state *s, int64_t i, int rows, const float *queries, const void *keys,
                               int bits, int64_t stride, int64_t count, int64_t dim) {
    const int64_t nv = dim / LANES;
    const float *q = queries + i * dim;
    float *l = s->logits + i * BLOCK_ENTRIES;
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {
        vf a[3][4] = {{{0}}};
        for (int64_t v = 0; v < nv; ++v) {
            vf qv[3];
            for (int j = 0; j < rows; ++j) qv[j] = vload(q + j * dim + v * LANES), in_register(&qv[j]);
            for (int e = 0; e < 4; ++e) {
                vf kv = entry_vector(keys, t + e, v, bits, stride, dim);
                in_register(&kv);
                for (int j = 0; j < rows; ++j) a[j][e] = vfma(a[j][e], qv[j], kv);
            }
        }
        for (int j = 0; j < rows; ++j) vsum4(a[j][0], a[j][1], a[j][2], a[j][3], l + j * BLOCK_ENTRIES + t);
    }
    for (; t < count; ++t)
        for (int j = 0; j < rows; ++j) {
            vf a = {0};
            for (int64_t v = 0; v < nv; ++v) a = vfma(a, vload(q + j * dim + v * LANES), entry_vector(keys, t, v, bits, stride, dim));
            l[j * BLOCK_ENTRIES + t] = vsum(a);
        }
}

/* Logits of a block's keys `keys` (count entries, as entry_vector reads them), as float32: query i's is
 * (queries_i · k_t + offset_i) · scale + beta_t (offset and beta may be NULL: 0). Three queries at a time
 * (a decode step's three query heads a KV head in SmolLM2), then one at a time. */
ALWAYS_INLINE void block_logits(softmax_state *s, const float *queries, const float *offset, float scale,
                                const float *beta, const void *keys, int bits, int64_t stride, int64_t count,
                                int64_t dim) {
    int64_t i = 0;
    for (; i + 3 <= s->m; i += 3) logits_rows(s, i, 3, queries, keys, bits, stride, count, dim);
    for (; i < s->m; ++i) logits_rows(s, i, 1, queries, keys, bits, stride, count, dim);
    for (i = 0; i < s->m; ++i) {
        float *l = s->logits + i * BLOCK_ENTRIES;
        const float shift = offset ? offset[i] : 0.0f;
        for (int64_t u = 0; u < count; ++u) l[u] = (l[u] + shift) * scale + (beta ? beta[u] : 0.0f);
    }
}

/* Query rows i .. i + rows − 1's numerators (rows 1 to 3) plus a block's values `values` (count, dim)
 * weighted by their weights: four vectors of channels at a time, rows × 4 accumulators in registers
 * across the block. Three queries share each value vector loaded, and their twelve chains of
 * multiply-adds hide the chains' latency (one query's four left the FMA units waiting). */
ALWAYS_INLINE void values_rows(softmax_state *s, int64_t i, int rows, const void *values, int bits, int64_t stride,
                               int64_t count, int64_t dim) {
    const int64_t nv = dim / LANES;
    const float *l = s->logits + i * BLOCK_ENTRIES;
    float *o = s->num + i * dim;
    for (int64_t v0 = 0; v0 < nv; v0 += 4) {
        const int64_t width = nv - v0 < 4 ? nv - v0 : 4;
        vf a[3][4] = {{{0}}};
        for (int j = 0; j < rows; ++j)
            for (int k = 0; k < width; ++k) a[j][k] = vload(o + j * dim + (v0 + k) * LANES);
        for (int64_t t = 0; t < count; ++t) {
            vf w[3];
            for (int j = 0; j < rows; ++j) w[j] = l[j * BLOCK_ENTRIES + t] + (vf){0};
            for (int k = 0; k < width; ++k) {
                vf xv = entry_vector(values, t, v0 + k, bits, stride, dim);
                in_register(&xv);
                for (int j = 0; j < rows; ++j) a[j][k] = vfma(a[j][k], w[j], xv);
            }
        }
        for (int j = 0; j < rows; ++j)
            for (int k = 0; k < width; ++k) vstore(o + j * dim + (v0 + k) * LANES, a[j][k]);
    }
}

/* Add a block's values `values` (count, dim), weighted by the block's weights (each entry's times its
 * value scale `value_scale`, its zero point `value_zero` into a sum; both may be NULL: 1 and 0), to
 * the numerators. */
ALWAYS_INLINE void block_values(softmax_state *s, const void *values, int bits, int64_t stride,
                                const float *value_scale, const float *value_zero, int64_t count, int64_t dim) {
    for (int64_t i = 0; i < s->m; ++i) {
        float *l = s->logits + i * BLOCK_ENTRIES;
        if (value_zero) {
            float zeros = 0.0f;
            for (int64_t t = 0; t < count; ++t) zeros += l[t] * value_zero[t];
            s->zero_sum[i] += zeros;
        }
        if (value_scale)
            for (int64_t t = 0; t < count; ++t) l[t] *= value_scale[t];
    }
    int64_t i = 0;
    for (; i + 3 <= s->m; i += 3) values_rows(s, i, 3, values, bits, stride, count, dim);
    for (; i < s->m; ++i) values_rows(s, i, 1, values, bits, stride, count, dim);
}

/* block_logits and block_values over a block of numbers (codes unpacked, or float rows), in functions of their
 * own for each common head size (noinline), shared by every code width: three query rows' twelve accumulators,
 * three weights and a value vector take all sixteen AVX2 registers, and inlined among a width's code GCC kept
 * one accumulator on the stack (a first step over 3-bit codes 1.18x slower, paired, 2026-12-01). */
#define NUMBERS_BLOCK_FUNCTIONS(D, SUFFIX)                                                                    \
    __attribute__((noinline)) static void numbers_logits_##SUFFIX(                                           \
        softmax_state *s, const float *queries, const float *offset, float scale, const float *beta,         \
        const float *block, int64_t count, int64_t dim) {                                                    \
        (void)dim;                                                                                           \
        block_logits(s, queries, offset, scale, beta, block, 0, 0, count, D);                                \
    }                                                                                                        \
    __attribute__((noinline)) static void numbers_values_##SUFFIX(                                           \
        softmax_state *s, const float *block, const float *value_scale, const float *value_zero,             \
        int64_t count, int64_t dim) {                                                                        \
        (void)dim;                                                                                           \
        block_values(s, block, 0, 0, value_scale, value_zero, count, D);                                     \
    }
NUMBERS_BLOCK_FUNCTIONS(64, 64)
NUMBERS_BLOCK_FUNCTIONS(128, 128)
NUMBERS_BLOCK_FUNCTIONS(dim, any)

/* block_logits over a block of numbers (count, dim), in the function for its head size. */
ALWAYS_INLINE void numbers_logits(softmax_state *s, const float *queries, const float *offset, float scale,
                                  const float *beta, const float *block, int64_t count, int64_t dim) {
    if (dim == 64) numbers_logits_64(s, queries, offset, scale, beta, block, count, dim);
    else if (dim == 128) numbers_logits_128(s, queries, offset, scale, beta, block, count, dim);
    else numbers_logits_any(s, queries, offset, scale, beta, block, count, dim);
}

/* block_values over a block of numbers (count, dim), in the function for its head size. */
ALWAYS_INLINE void numbers_values(softmax_state *s, const float *block, const float *value_scale,
                                  const float *value_zero, int64_t count, int64_t dim) {
    if (dim == 64) numbers_values_64(s, block, value_scale, value_zero, count, dim);
    else if (dim == 128) numbers_values_128(s, block, value_scale, value_zero, count, dim);
    else numbers_values_any(s, block, value_scale, value_zero, count, dim);
}

#endif /* KVFOLD_ATTEND_BLOCKS_H */
