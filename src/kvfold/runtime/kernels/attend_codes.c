/* Attention of a few queries over quantized rows read from their codes, in one pass a row.
 *
 * The stored part of kvfold's quantized attention (kvfold.runtime.quantized_attention): keys
 * quantized per channel over groups of `group` consecutive entries of a row, values per entry
 * (KIVI's axes, Liu et al. 2024, section 3), codes of 8, 4 or 2 bits packed by planes (byte j holds
 * the codes of channels j, j + D/p, ..., p = 8/bits codes a byte) or of 3 bits (eight codes in three
 * bytes, code i of the eight at bit 3i of their little-endian 24-bit word). A key group's scales are folded
 * into the queries (q . k = sum_c codes_c (q_c s_c) + q . z), a value's scale into its
 * probability, so no key or value is ever dequantized.
 *
 * `scratch` holds the longest row's m logits an entry. For every row r and query i it writes, relative to the row's own maximum logit top[r, i]:
 *   den[r, i]    = sum_t exp(l_t - top)
 *   num[r, i, :] = sum_t exp(l_t - top) * value_t
 * with l_t = scaling * q_i . k_t + beta_t. A row without entries gets top = -inf, den = 0, num = 0.
 *
 * Bounds. `entries` is what the entry buffers hold (key_codes: entries * ceil(dim*bits/8) bytes,
 * value_codes: entries * ceil(vdim*bits/8), value_scale, value_zero and beta: entries floats),
 * `groups` what the key scales and zero points hold (groups * dim floats), `scratch_len` the floats
 * of scratch. Before reading anything the kernel checks the row lengths against them (each length
 * non-negative, their entries, key groups and scratch within the buffers) and returns 4 if they do
 * not fit. Built with -DKVFOLD_DEBUG (KVFOLD_NATIVE_DEBUG=1) it skips that check and checks every
 * index as it reads instead, returning 5 before a read out of bounds: a test that passes
 * inconsistent lengths then shows each access is guarded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DIM 1024
#define MAX_QUERIES 256

#ifdef KVFOLD_DEBUG
#define CHECK(cond)          \
    do {                     \
        if (!(cond)) {       \
            status = 5;      \
            goto done;       \
        }                    \
    } while (0)
#else
#define CHECK(cond) ((void)0)
#endif

#ifndef KVFOLD_DEBUG
/* Whether the rows' lengths fit the buffers: 0 if they do, 4 if not. */
static int rows_fit(int64_t rows, int64_t m, int64_t group, const int64_t *lengths, int64_t entries,
                    int64_t groups, int64_t scratch_len) {
    int64_t entry = 0, group_count = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = lengths[r];
        if (n < 0 || n > entries - entry || n > scratch_len / (m > 0 ? m : 1)) return 4;
        entry += n;
        group_count += n / group + (n % group != 0);
        if (group_count > groups) return 4;
    }
    return 0;
}
#endif

static void unpack(const uint8_t *src, int64_t dim, int64_t bits, float *dst) {
    if (bits == 8) {
        for (int64_t c = 0; c < dim; ++c) dst[c] = (float)src[c];
        return;
    }
    if (bits == 3) {
        for (int64_t g = 0; g < dim / 8; ++g) {
            const uint8_t *b = src + 3 * g;
            const uint32_t word = (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16);
            for (int64_t i = 0; i < 8; ++i) dst[8 * g + i] = (float)((word >> (3 * i)) & 7u);
        }
        return;
    }
    const int64_t per = 8 / bits, width = dim / per;
    const unsigned mask = (1u << bits) - 1u;
    for (int64_t k = 0; k < per; ++k) {
        const unsigned shift = (unsigned)(k * bits);
        float *d = dst + k * width;
        for (int64_t j = 0; j < width; ++j) d[j] = (float)((src[j] >> shift) & mask);
    }
}

int kvfold_attend_codes(int64_t rows, int64_t m, int64_t dim, int64_t vdim, int64_t bits, int64_t group,
                        int64_t entries, int64_t groups, int64_t scratch_len, const int64_t *lengths, const uint8_t *key_codes, const float *key_scale,
                        const float *key_zero, const uint8_t *value_codes, const float *value_scale,
                        const float *value_zero, const float *beta, const float *queries, float scaling,
                        float *scratch, float *top, float *den, float *num) {
    if (dim > MAX_DIM || vdim > MAX_DIM || m > MAX_QUERIES || group < 1) return 1;
    if (bits != 8 && bits != 4 && bits != 3 && bits != 2) return 2;
    if (entries < 0 || groups < 0 || scratch_len < 0) return 4;
#ifndef KVFOLD_DEBUG
    if (rows_fit(rows, m, group, lengths, entries, groups, scratch_len)) return 4;
#endif
    const int64_t kb = dim * bits / 8, vb = vdim * bits / 8;
    int status = 0;
    float codes[MAX_DIM];
    float *qs = (float *)malloc(sizeof(float) * (size_t)(m * dim));
    float *qz = (float *)malloc(sizeof(float) * (size_t)m);
    float *zs = (float *)malloc(sizeof(float) * (size_t)m);
    if (!qs || !qz || !zs) {
        free(qs), free(qz), free(zs);
        return 3;
    }
    int64_t entry = 0, first_group = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = lengths[r];
        CHECK(n >= 0 && n <= entries - entry);
        const float *q = queries + r * m * dim;
        float *tp = top + r * m, *dn = den + r * m, *nm = num + r * m * vdim;
        for (int64_t i = 0; i < m; ++i) tp[i] = -INFINITY, dn[i] = 0.0f;
        memset(nm, 0, sizeof(float) * (size_t)(m * vdim));
        /* logits: the group's scales folded into the queries, one group of entries at a time */
        for (int64_t start = 0; start < n; start += group) {
            const int64_t g = first_group + start / group;
            CHECK(g < groups);
            const float *s = key_scale + g * dim, *z = key_zero + g * dim;
            for (int64_t i = 0; i < m; ++i) {
                float offset = 0.0f;
                for (int64_t c = 0; c < dim; ++c) {
                    qs[i * dim + c] = q[i * dim + c] * s[c];
                    offset += q[i * dim + c] * z[c];
                }
                qz[i] = offset;
            }
            const int64_t stop = start + group < n ? start + group : n;
            for (int64_t t = start; t < stop; ++t) {
                CHECK(entry + t < entries && (t + 1) * m <= scratch_len);
                unpack(key_codes + (entry + t) * kb, dim, bits, codes);
                const float b = beta ? beta[entry + t] : 0.0f;
                for (int64_t i = 0; i < m; ++i) {
                    const float *qi = qs + i * dim;
                    float dot = 0.0f;
                    for (int64_t c = 0; c < dim; ++c) dot += qi[c] * codes[c];
                    const float l = (dot + qz[i]) * scaling + b;
                    scratch[t * m + i] = l;
                    if (l > tp[i]) tp[i] = l;
                }
            }
        }
        /* probabilities relative to the row's maximum */
        for (int64_t t = 0; t < n; ++t)
            for (int64_t i = 0; i < m; ++i) {
                const float w = tp[i] == -INFINITY ? 0.0f : expf(scratch[t * m + i] - tp[i]);
                scratch[t * m + i] = w;
                dn[i] += w;
            }
        /* values: each entry's scale folded into its probability, its zero point into a sum */
        for (int64_t i = 0; i < m; ++i) zs[i] = 0.0f;
        for (int64_t t = 0; t < n; ++t) {
            CHECK(entry + t < entries && (t + 1) * m <= scratch_len);
            unpack(value_codes + (entry + t) * vb, vdim, bits, codes);
            const float s = value_scale[entry + t], z = value_zero[entry + t];
            for (int64_t i = 0; i < m; ++i) {
                const float w = scratch[t * m + i];
                const float a = w * s;
                float *o = nm + i * vdim;
                zs[i] += w * z;
                for (int64_t c = 0; c < vdim; ++c) o[c] += a * codes[c];
            }
        }
        for (int64_t i = 0; i < m; ++i)
            for (int64_t c = 0; c < vdim; ++c) nm[i * vdim + c] += zs[i];
        entry += n;
        first_group += n / group + (n % group != 0);
    }
#ifdef KVFOLD_DEBUG
done:
#endif
    free(qs), free(qz), free(zs);
    return status;
}
