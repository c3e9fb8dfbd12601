/* Attention of a few queries over quantized rows read from their codes, a block of entries at a time.
 *
 * The stored part of kvfold's quantized attention (kvfold.runtime.quantized_attention): keys
 * quantized per channel over groups of `group` consecutive entries of a row, values per entry
 * (KIVI's axes, Liu et al. 2024, section 3), codes of 8, 4 or 2 bits packed by planes (byte j holds
 * the codes of channels j, j + D/p, ..., p = 8/bits codes a byte) or of 3 bits (eight codes in three
 * bytes, code i of the eight at bit 3i of their little-endian 24-bit word). A key group's scales are folded
 * into the queries (q . k = sum_c codes_c (q_c s_c) + q . z), a value's scale into its
 * probability, so no key or value is ever dequantized into memory. The blocks' logits, running softmax
 * and weighted values are attend_blocks.h's, which the served files' pool kernel (attend_pool.c) uses
 * too: a decode step's few queries (codes_in_place_queries(bits) a row at most) turn each code vector
 * into numbers where they use it, more queries (a prefill's) unpack a block once for all of them.
 *
 * For every row r and query i it writes, relative to the row's own maximum logit top[r, i]:
 *   den[r, i]    = sum_t exp(l_t - top)
 *   num[r, i, :] = sum_t exp(l_t - top) * value_t
 * with l_t = scaling * q_i . k_t + beta_t. A row without entries gets top = -inf, den = 0, num = 0.
 * Head sizes (dim, vdim) are multiples of 16, at most MAX_DIM.
 *
 * Bounds. `entries` is what the entry buffers hold (key_codes: entries * dim*bits/8 bytes,
 * value_codes: entries * vdim*bits/8, value_scale, value_zero and beta: entries floats),
 * `groups` what the key scales and zero points hold (groups * dim floats). Before reading anything the
 * kernel checks the row lengths against them (each length non-negative, their entries and key groups
 * within the buffers) and returns 4 if they do not fit. Built with -DKVFOLD_DEBUG (KVFOLD_NATIVE_DEBUG=1)
 * it skips that check and checks each row's entries and every key group as it reads them instead,
 * returning 5 before a read out of bounds: a test that passes inconsistent lengths then shows each
 * access is guarded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend_blocks.h"

#define MAX_DIM 1024
#define MAX_QUERIES 256

#ifdef KVFOLD_DEBUG
#define CHECK(cond)            \
    do {                       \
        if (!(cond)) return 5; \
    } while (0)
#else
#define CHECK(cond) ((void)0)
#endif

/* One call's arguments (kvfold_attend_codes's) and its workspace. */
typedef struct {
    int64_t rows, m, group, entries, groups;
    const int64_t *lengths;
    const uint8_t *key_codes, *value_codes;
    const float *key_scale, *key_zero, *value_scale, *value_zero, *beta, *queries;
    float scaling;
    float *top, *den, *num;
    float *folded, *zero_dot, *zero_sum, *logits, *block; /* the workspace */
} codes_call;

#ifndef KVFOLD_DEBUG
/* Whether the rows' lengths fit the buffers: 0 if they do, 4 if not. */
static int rows_fit(int64_t rows, int64_t group, const int64_t *lengths, int64_t entries, int64_t groups) {
    int64_t entry = 0, group_count = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = lengths[r];
        if (n < 0 || n > entries - entry) return 4;
        entry += n;
        group_count += n / group + (n % group != 0);
        if (group_count > groups) return 4;
    }
    return 0;
}
#endif

/* A block's `count` entries' codes (`stride` bytes an entry) as numbers, (count, dim): the width's own loop,
 * chosen once a block, so that a copy of attend_rows for every width is not needed to unpack at a width
 * known when compiled. */
ALWAYS_INLINE void unpack_block(const uint8_t *src, int64_t count, int64_t stride, int64_t dim, int bits, float *dst) {
    switch (bits) {
        case 8: for (int64_t t = 0; t < count; ++t) unpack(src + t * stride, dim, 8, dst + t * dim); break;
        case 4: for (int64_t t = 0; t < count; ++t) unpack(src + t * stride, dim, 4, dst + t * dim); break;
        case 3: for (int64_t t = 0; t < count; ++t) unpack(src + t * stride, dim, 3, dst + t * dim); break;
        default: for (int64_t t = 0; t < count; ++t) unpack(src + t * stride, dim, 2, dst + t * dim);
    }
}

/* Every row's stored part, for one code width and head size (constants where the caller passes them, so
 * that the code vectors' width and the channel loops are compiled for them). */
ALWAYS_INLINE int attend_rows(const codes_call *c, int bits, int64_t dim, int64_t vdim, int in_place) {
    const int64_t m = c->m, group = c->group, kb = dim * bits / 8, vb = vdim * bits / 8;
    const int keys_in_place = in_place && codes_by_vector(bits, dim);
    const int values_in_place = in_place && codes_by_vector(bits, vdim);
    float *folded = c->folded, *zero_dot = c->zero_dot, *zero_sum = c->zero_sum, *block = c->block;
    int64_t entry = 0, first_group = 0;
    for (int64_t r = 0; r < c->rows; ++r) {
        const int64_t n = c->lengths[r];
        CHECK(n >= 0 && n <= c->entries - entry);
        const float *q = c->queries + r * m * dim;
        softmax_state s = {m, c->top + r * m, c->den + r * m, zero_sum, c->num + r * m * vdim, c->logits};
        for (int64_t i = 0; i < m; ++i) s.top[i] = -INFINITY, s.den[i] = 0.0f, zero_sum[i] = 0.0f;
        memset(s.num, 0, sizeof(float) * (size_t)(m * vdim));
        for (int64_t first = 0; first < n; first += group) {
            const int64_t g = first_group + first / group;
            CHECK(g < c->groups);
            const float *scale = c->key_scale + g * dim, *zero = c->key_zero + g * dim;
            for (int64_t i = 0; i < m; ++i) { /* q · k = codes · (q ⊙ s) + q · z */
                float offset = 0.0f;
                for (int64_t k = 0; k < dim; ++k) {
                    folded[i * dim + k] = q[i * dim + k] * scale[k];
                    offset += q[i * dim + k] * zero[k];
                }
                zero_dot[i] = offset;
            }
            const int64_t stop = first + group < n ? first + group : n;
            for (int64_t start = first; start < stop; start += BLOCK_ENTRIES) {
                const int64_t count = stop - start < BLOCK_ENTRIES ? stop - start : BLOCK_ENTRIES;
                const int64_t at = entry + start; /* the block's first entry in the buffers */
                const uint8_t *keys = c->key_codes + at * kb, *values = c->value_codes + at * vb;
                const float *b = c->beta ? c->beta + at : NULL;
                if (keys_in_place) {
                    block_logits(&s, folded, zero_dot, c->scaling, b, keys, bits, kb, count, dim);
                } else {
                    unpack_block(keys, count, kb, dim, bits, block);
                    numbers_logits(&s, folded, zero_dot, c->scaling, b, block, count, dim);
                }
                update_maximum(&s, count, vdim);
                const float *value_scale = c->value_scale + at, *value_zero = c->value_zero + at;
                if (values_in_place) {
                    block_values(&s, values, bits, vb, value_scale, value_zero, count, vdim);
                } else {
                    unpack_block(values, count, vb, vdim, bits, block);
                    numbers_values(&s, block, value_scale, value_zero, count, vdim);
                }
            }
        }
        for (int64_t i = 0; i < m; ++i) /* each value's zero point, weighted, on every channel */
            for (int64_t k = 0; k < vdim; ++k) s.num[i * vdim + k] += zero_sum[i];
        entry += n;
        first_group += n / group + (n % group != 0);
    }
    return 0;
}

/* attend_rows compiled for the common head sizes (64 and 128, their loops unrolled) and any other. More
 * queries than codes_in_place_queries(bits) a row (a prefill's, and a decode step's GQA group of four
 * with codes under 8 bits) unpack a block once into numbers for all of them: compiled once for every code
 * width, each block unpacked by its width's own loop (unpack_block). A decode step's few queries read the
 * codes in place, compiled for each width and the common head sizes; other head sizes unpack. Each copy
 * costs seconds of the first build (about 18 s in all on this project's 2-core machine). */
__attribute__((noinline)) static int attend_rows_unpacked(const codes_call *c, int bits, int64_t dim, int64_t vdim) {
    if (dim == 64 && vdim == 64) return attend_rows(c, bits, 64, 64, 0);
    if (dim == 128 && vdim == 128) return attend_rows(c, bits, 128, 128, 0);
    return attend_rows(c, bits, dim, vdim, 0);
}

/* The rows read in place, a function for each code width and common head size (noinline): inlined into one,
 * the eight took GCC longer to compile and kept accumulators on the stack. */
#define IN_PLACE_FUNCTIONS(BITS)                                                                                \
    __attribute__((noinline)) static int in_place_##BITS##_64(const codes_call *c) {                           \
        return attend_rows(c, BITS, 64, 64, 1);                                                                \
    }                                                                                                          \
    __attribute__((noinline)) static int in_place_##BITS##_128(const codes_call *c) {                          \
        return attend_rows(c, BITS, 128, 128, 1);                                                              \
    }
IN_PLACE_FUNCTIONS(8)
IN_PLACE_FUNCTIONS(4)
IN_PLACE_FUNCTIONS(3)
IN_PLACE_FUNCTIONS(2)

ALWAYS_INLINE int attend_rows_in_place(const codes_call *c, int bits, int64_t dim, int64_t vdim) {
#define IN_PLACE_SWITCH(D)                              \
    switch (bits) {                                     \
        case 8: return in_place_8_##D(c);               \
        case 4: return in_place_4_##D(c);               \
        case 3: return in_place_3_##D(c);               \
        default: return in_place_2_##D(c);              \
    }
    if (dim == 64 && vdim == 64) IN_PLACE_SWITCH(64)
    if (dim == 128 && vdim == 128) IN_PLACE_SWITCH(128)
#undef IN_PLACE_SWITCH
    return attend_rows_unpacked(c, bits, dim, vdim);
}

int kvfold_attend_codes(int64_t rows, int64_t m, int64_t dim, int64_t vdim, int64_t bits, int64_t group,
                        int64_t entries, int64_t groups, const int64_t *lengths, const uint8_t *key_codes,
                        const float *key_scale, const float *key_zero, const uint8_t *value_codes,
                        const float *value_scale, const float *value_zero, const float *beta, const float *queries,
                        float scaling, float *top, float *den, float *num) {
    if (dim > MAX_DIM || vdim > MAX_DIM || dim % 16 || vdim % 16 || m > MAX_QUERIES || group < 1) return 1;
    if (bits != 8 && bits != 4 && bits != 3 && bits != 2) return 2;
    if (entries < 0 || groups < 0) return 4;
#ifndef KVFOLD_DEBUG
    if (rows_fit(rows, group, lengths, entries, groups)) return 4;
#endif
    const int64_t widest = dim > vdim ? dim : vdim;
    /* the queries folded with a key group's scales (m, dim), their zero points' dot products (m), the
     * zero points' sums (m), a block's logits then weights (m, BLOCK_ENTRIES), a block as numbers */
    const size_t floats = (size_t)(m * dim + 2 * m + m * BLOCK_ENTRIES + BLOCK_ENTRIES * widest);
    float *work = (float *)malloc(sizeof(float) * (floats > 0 ? floats : 1));
    if (!work) return 3;
    codes_call c = {rows, m, group, entries, groups, lengths, key_codes, value_codes, key_scale, key_zero,
                    value_scale, value_zero, beta, queries, scaling, top, den, num};
    c.folded = work, c.zero_dot = work + m * dim, c.zero_sum = c.zero_dot + m;
    c.logits = c.zero_sum + m, c.block = c.logits + m * BLOCK_ENTRIES;
    int status;
    if (m > codes_in_place_queries((int)bits)) {
        status = attend_rows_unpacked(&c, (int)bits, dim, vdim);
    } else {
        switch (bits) {
            case 8: status = attend_rows_in_place(&c, 8, dim, vdim); break;
            case 4: status = attend_rows_in_place(&c, 4, dim, vdim); break;
            case 3: status = attend_rows_in_place(&c, 3, dim, vdim); break;
            default: status = attend_rows_in_place(&c, 2, dim, vdim);
        }
    }
    free(work);
    return status;
}
