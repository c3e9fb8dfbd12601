/* One layer's attention for every request on a pooled cache file in a serving step, in one call.
 *
 * The caller is kvfold.runtime.pool_attention (the vLLM backend's requests on files). An engine holds
 * each layer's KV cache as blocks, [num_blocks, kv_heads, block_size, 2 * dim] in the engine's dtype:
 * per (block, head) block_size keys (in a layout of the engine's: channel-major, or any permutation
 * given as a table) then block_size values (row-major). A request on a file holds, first, the file's
 * chunks (kvfold.runtime.row_pool: chunk c is block blocks[c / L] of layer c % L, read as bytes), then
 * its own tokens (the question's and the answer's, written there by the engine). Each chunk holds
 * segments, runs of one row's entries: codes of 8, 4, 3 or 2 bits (KIVI's axes, Liu et al. 2024 §3:
 * keys per channel over groups of `group` entries counted from the segment's start, values per entry),
 * their fp16 scales and zero points, and β (float32), or entries at full precision.
 *
 * For each request, KV head and query (the head's GQA group × the step's tokens), one
 * running softmax (maximum, denominator, numerator) goes over the row's segments, then over the
 * request's own tokens (causal among the new ones), and the output rows are written in place:
 *
 *   out_i = softmax_t(l_it) · v_t,  l_it = scale · q'_i · k_t + β_t (file entries),  scale · q_i · k_t (own)
 *
 * where q'_i is the query turned by the file's position offset (RoPE angle θ_p = (T − P) · ω_p, the
 * table `rope`: the file's keys keep their context positions, the question sits at P + j instead of
 * T + j). A key group's scales are folded into the queries (q · k = codes · (q ⊙ s) + q · z), a value's
 * scale into its weight, so no code is ever dequantized into memory.
 *
 * Requests that hold one file in the same blocks (an engine's prefix cache shares them) read its rows
 * once for their queries together (a tile of up to TILE_QUERIES queries a KV head). Parallel over (tile,
 * KV head) with OpenMP when built with it; each thread has its own slice of `workspace` (the call
 * allocates only its list of tiles).
 *
 * Bounds. Before reading anything, the release build checks the whole call: every request's query
 * rows within the step's tokens, its blocks within the engine's and its block table, its file's tables
 * consistent (each of this layer's segments' arrays inside its chunk, chunks within the file), the
 * header of every chunk it will read, and the workspace's size; it returns 4 if anything does not fit.
 * Built with -DKVFOLD_DEBUG (KVFOLD_NATIVE_DEBUG=1) it skips that check and checks every index as it
 * reads instead, returning 5 before a read out of bounds.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_DIM 512
#define TILE_QUERIES 64 /* queries attended in one pass over a row */
#define CHUNK_MAGIC 0x4346564Bu
#define HEADER_BYTES 16
#define FLAG_BETA 1
#define FLAG_FLOAT 2
#define FLAG_ROTATED 4 /* values stored rotated by value_rotation: the file part's numerators rotated back */

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { KEYS_CHANNEL_MAJOR = 0, KEYS_TABLE = 1 };
enum {
    SEG_CHUNK,
    SEG_ENTRIES,
    SEG_KEYS, /* byte offsets in the chunk: key codes (or keys at full precision) */
    SEG_VALUES,
    SEG_KEY_SCALE,
    SEG_KEY_ZERO,
    SEG_VALUE_SCALE,
    SEG_VALUE_ZERO,
    SEG_BETA,
    SEG_FIELDS
};

/* A pooled file (made once per file). */
typedef struct {
    int64_t layers, rows, num_chunks, chunk_bytes, num_segments;
    int64_t bits; /* 0: entries at full precision, in float_dtype */
    int64_t float_dtype, group, dim, vdim, flags, placeholders;
    const int64_t *row_start;      /* (layers * rows + 1): row (layer, head)'s segments */
    const int64_t *segments;       /* (num_segments, SEG_FIELDS) */
    const int64_t *chunk_segments; /* (num_chunks): the segments each chunk's header counts */
    const double *rope;            /* (dim / 2, 2): cos and sin of the turn of each rotated pair */
    const float *value_rotation;   /* (vdim, vdim) T with FLAG_ROTATED: stored values are v · T; else NULL */
} kvf_file;

/* A request on a file, in this step. */
typedef struct {
    int64_t query_start, query_len, seq_len;
    const kvf_file *file;
    const int32_t *blocks; /* its block table row */
    int64_t num_block_ids; /* entries of that row */
} kvf_request;

/* The engine's caches (made once). */
typedef struct {
    int64_t layers;
    const int64_t *layer_cache; /* each layer's cache base address */
    int64_t num_blocks, kv_heads, q_heads, block_size, dim, dtype, key_layout;
    const int32_t *key_position; /* (block_size * dim): where key element (t, c) lies, KEYS_TABLE */
    float scale;
    int64_t threads;
    float *workspace;
    int64_t workspace_floats;
} kvf_engine;

#ifdef KVFOLD_DEBUG
#define CHECK(cond)           \
    do {                      \
        if (!(cond)) return 5; \
    } while (0)
#else
#define CHECK(cond) ((void)0)
#endif

/* ------------------------------------------------------------------ numbers */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, x;
    if (exponent == 0x1f) {
        x = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent == 0) {
        if (mantissa == 0) {
            x = sign;
        } else { /* subnormal: normalise */
            int shift = 0;
            while (!(mantissa & 0x400u)) mantissa <<= 1, ++shift;
            x = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
        }
    } else {
        x = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
#endif
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline uint16_t f32_to_f16(float f) { /* round to nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
    if (abs >= 0x477ff000u) return sign | 0x7c00u; /* rounds past the largest half: infinity */
    if (abs < 0x38800000u) {                        /* a subnormal half, or zero */
        if (abs < 0x33000000u) return sign;
        const uint32_t exponent = abs >> 23, mantissa = (abs & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - exponent; /* 14 .. 24 */
        uint32_t half = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        if (rest > mid || (rest == mid && (half & 1u))) ++half;
        return sign | (uint16_t)half;
    }
    uint32_t half = ((abs >> 13) - (112u << 10));
    const uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
    return sign | (uint16_t)half;
}

static inline void store_element(void *base, int64_t index, int64_t dtype, float value) {
    if (dtype == DT_F32)
        ((float *)base)[index] = value;
    else
        ((uint16_t *)base)[index] = dtype == DT_BF16 ? f32_to_bf16(value) : f32_to_f16(value);
}

static inline int64_t element_bytes(int64_t dtype) { return dtype == DT_F32 ? 4 : 2; }

#include "attend_blocks.h"

/* ------------------------------------------------------------------ numbers in the engine's dtypes */
/* Runs of numbers in the engine's dtypes, as float32 (a vector at a time). */
static void to_float(const void *src, int64_t dtype, float *dst, int64_t n) {
    const uint16_t *h = (const uint16_t *)src;
    int64_t k = 0;
    if (dtype == DT_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    if (dtype == DT_BF16) {
        for (; k + LANES <= n; k += LANES) {
            const vi x = __builtin_convertvector(*(const vhalves_unaligned *)(h + k), vi) << 16;
            vstore(dst + k, (vf)x);
        }
        for (; k < n; ++k) dst[k] = bf16_to_f32(h[k]);
        return;
    }
#ifdef __AVX512F__
    for (; k + LANES <= n; k += LANES) _mm512_storeu_ps(dst + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + k))));
#elif defined(__F16C__)
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + k))));
#endif
    for (; k < n; ++k) dst[k] = f16_to_f32(h[k]);
}

/* ------------------------------------------------------------------ a file's segment */
typedef struct {
    const kvf_engine *e;
    const kvf_file *f;
    const float *turned; /* (m, dim): the queries turned by the file's offset */
    float *folded;       /* (m, dim): turned ⊙ a key group's scales */
    float *zero_dot;     /* (m): turned · a key group's zero points */
    float *block;        /* (BLOCK_ENTRIES, dim): a block's keys or values as numbers */
} segment_work;

ALWAYS_INLINE int attend_codes(segment_work *w, softmax_state *s, const uint8_t *chunk, const int64_t *seg, int bits,
                               int64_t dim) {
    const kvf_file *f = w->f;
    const int64_t m = s->m, n = seg[SEG_ENTRIES], group = f->group;
    const int64_t kb = dim * bits / 8;
    /* A decode step's few queries turn each code vector into numbers where they use it; more queries (a first
     * step, requests sharing a file) unpack a block once into numbers for all of them. */
    const int in_place = m <= codes_in_place_queries(bits) && codes_by_vector(bits, dim);
    float scales[MAX_DIM], zeros[MAX_DIM], beta[BLOCK_ENTRIES], value_scale[BLOCK_ENTRIES], value_zero[BLOCK_ENTRIES];
    CHECK(group >= 1);
    for (int64_t first = 0; first < n; first += group) {
        const int64_t g = first / group;
        CHECK(seg[SEG_KEY_SCALE] + (g + 1) * dim * 2 <= f->chunk_bytes && seg[SEG_KEY_SCALE] >= HEADER_BYTES);
        CHECK(seg[SEG_KEY_ZERO] + (g + 1) * dim * 2 <= f->chunk_bytes && seg[SEG_KEY_ZERO] >= HEADER_BYTES);
        to_float(chunk + seg[SEG_KEY_SCALE] + g * dim * 2, DT_F16, scales, dim);
        to_float(chunk + seg[SEG_KEY_ZERO] + g * dim * 2, DT_F16, zeros, dim);
        for (int64_t i = 0; i < m; ++i) { /* q · k = codes · (q ⊙ s) + q · z */
            const float *q = w->turned + i * dim;
            float *qs = w->folded + i * dim, offset = 0.0f;
            for (int64_t c = 0; c < dim; ++c) {
                qs[c] = q[c] * scales[c];
                offset += q[c] * zeros[c];
            }
            w->zero_dot[i] = offset;
        }
        const int64_t stop = first + group < n ? first + group : n;
        for (int64_t start = first; start < stop; start += BLOCK_ENTRIES) {
            const int64_t count = stop - start < BLOCK_ENTRIES ? stop - start : BLOCK_ENTRIES;
            CHECK(seg[SEG_KEYS] >= HEADER_BYTES && seg[SEG_KEYS] + (start + count) * kb <= f->chunk_bytes);
            const uint8_t *key_codes = chunk + seg[SEG_KEYS] + start * kb;
            const float *b = NULL;
            if (f->flags & FLAG_BETA) {
                CHECK(seg[SEG_BETA] >= HEADER_BYTES && seg[SEG_BETA] + (start + count) * 4 <= f->chunk_bytes);
                memcpy(beta, chunk + seg[SEG_BETA] + start * 4, sizeof(float) * (size_t)count);
                b = beta;
            }
            if (in_place) {
                block_logits(s, w->folded, w->zero_dot, w->e->scale, b, key_codes, bits, kb, count, dim);
            } else {
                for (int64_t t = 0; t < count; ++t) unpack(key_codes + t * kb, dim, bits, w->block + t * dim);
                numbers_logits(s, w->folded, w->zero_dot, w->e->scale, b, w->block, count, dim);
            }
            update_maximum(s, count, dim);
            CHECK(seg[SEG_VALUES] >= HEADER_BYTES && seg[SEG_VALUES] + (start + count) * kb <= f->chunk_bytes);
            CHECK(seg[SEG_VALUE_SCALE] >= HEADER_BYTES && seg[SEG_VALUE_SCALE] + (start + count) * 2 <= f->chunk_bytes);
            CHECK(seg[SEG_VALUE_ZERO] >= HEADER_BYTES && seg[SEG_VALUE_ZERO] + (start + count) * 2 <= f->chunk_bytes);
            const uint8_t *value_codes = chunk + seg[SEG_VALUES] + start * kb;
            to_float(chunk + seg[SEG_VALUE_SCALE] + start * 2, DT_F16, value_scale, count);
            to_float(chunk + seg[SEG_VALUE_ZERO] + start * 2, DT_F16, value_zero, count);
            if (in_place) {
                block_values(s, value_codes, bits, kb, value_scale, value_zero, count, dim);
            } else {
                for (int64_t t = 0; t < count; ++t) unpack(value_codes + t * kb, dim, bits, w->block + t * dim);
                numbers_values(s, w->block, value_scale, value_zero, count, dim);
            }
        }
    }
    return 0;
}

ALWAYS_INLINE int attend_float_rows(segment_work *w, softmax_state *s, const uint8_t *chunk, const int64_t *seg,
                                    int64_t dim) {
    const kvf_file *f = w->f;
    const int64_t n = seg[SEG_ENTRIES], dt = f->float_dtype, row = dim * element_bytes(dt);
    float beta[BLOCK_ENTRIES];
    for (int64_t start = 0; start < n; start += BLOCK_ENTRIES) {
        const int64_t count = n - start < BLOCK_ENTRIES ? n - start : BLOCK_ENTRIES;
        CHECK(seg[SEG_KEYS] >= HEADER_BYTES && seg[SEG_KEYS] + (start + count) * row <= f->chunk_bytes);
        to_float(chunk + seg[SEG_KEYS] + start * row, dt, w->block, count * dim);
        const float *b = NULL;
        if (f->flags & FLAG_BETA) {
            CHECK(seg[SEG_BETA] >= HEADER_BYTES && seg[SEG_BETA] + (start + count) * 4 <= f->chunk_bytes);
            memcpy(beta, chunk + seg[SEG_BETA] + start * 4, sizeof(float) * (size_t)count);
            b = beta;
        }
        numbers_logits(s, w->turned, NULL, w->e->scale, b, w->block, count, dim);
        update_maximum(s, count, dim);
        CHECK(seg[SEG_VALUES] >= HEADER_BYTES && seg[SEG_VALUES] + (start + count) * row <= f->chunk_bytes);
        to_float(chunk + seg[SEG_VALUES] + start * row, dt, w->block, count * dim);
        numbers_values(s, w->block, NULL, NULL, count, dim);
    }
    return 0;
}

/* One segment's entries, a function for each format and common head size (noinline: a tile calls one a
 * segment). Inlined into the tile, the fifteen made one function that took GCC 70-90 s to compile on 2 cores;
 * apart they take about 20 s, and the outputs are the same to the bit. */
#define SEGMENT_FUNCTION(NAME, CALL)                                                                            \
    __attribute__((noinline)) static int NAME(segment_work *w, softmax_state *s, const uint8_t *chunk,        \
                                              const int64_t *seg, int64_t dim) {                              \
        (void)dim;                                                                                            \
        return CALL;                                                                                          \
    }
#define SEGMENT_FUNCTIONS(D, SUFFIX)                                               \
    SEGMENT_FUNCTION(codes8_##SUFFIX, attend_codes(w, s, chunk, seg, 8, D))        \
    SEGMENT_FUNCTION(codes4_##SUFFIX, attend_codes(w, s, chunk, seg, 4, D))        \
    SEGMENT_FUNCTION(codes3_##SUFFIX, attend_codes(w, s, chunk, seg, 3, D))        \
    SEGMENT_FUNCTION(codes2_##SUFFIX, attend_codes(w, s, chunk, seg, 2, D))        \
    SEGMENT_FUNCTION(floats_##SUFFIX, attend_float_rows(w, s, chunk, seg, D))
SEGMENT_FUNCTIONS(64, 64)
SEGMENT_FUNCTIONS(128, 128)
SEGMENT_FUNCTIONS(dim, any)
#define SEGMENT_SWITCH(SUFFIX)                                      \
    switch (bits) {                                                 \
        case 8: return codes8_##SUFFIX(w, s, chunk, seg, dim);      \
        case 4: return codes4_##SUFFIX(w, s, chunk, seg, dim);      \
        case 3: return codes3_##SUFFIX(w, s, chunk, seg, dim);      \
        case 2: return codes2_##SUFFIX(w, s, chunk, seg, dim);      \
        default: return floats_##SUFFIX(w, s, chunk, seg, dim);     \
    }

/* A segment of a file's rows in its format (bits 0: float rows), at the head size the tile is compiled for. */
ALWAYS_INLINE int attend_segment(segment_work *w, softmax_state *s, const uint8_t *chunk, const int64_t *seg,
                                 int64_t bits, int64_t dim) {
    if (dim == 64) SEGMENT_SWITCH(64)
    if (dim == 128) SEGMENT_SWITCH(128)
    SEGMENT_SWITCH(any)
}
#undef SEGMENT_SWITCH

/* ------------------------------------------------------------------ one (tile of queries, head) */
/* Tokens first_token .. first_token + tokens − 1 of a request's query. */
typedef struct {
    int64_t request, first_token, tokens;
} query_piece;

/* A tile: pieces of the queries of requests on one file's blocks (at most TILE_QUERIES queries a KV
 * head), attended over the file's rows in one pass, then each over its own request's tokens. */
typedef struct {
    const kvf_engine *e;
    const kvf_request *requests;
    const query_piece *pieces;
    int64_t num_pieces;
    int64_t layer, head;
    int64_t step_tokens; /* rows of query and out */
    const void *query;
    int64_t query_token_stride, query_head_stride;
    void *out;
    int64_t out_token_stride, out_head_stride;
} tile_job;

static inline const uint8_t *block_base(const kvf_engine *e, int64_t layer, int64_t block) {
    const int64_t block_bytes = e->kv_heads * e->block_size * 2 * e->dim * element_bytes(e->dtype);
    return (const uint8_t *)(intptr_t)e->layer_cache[layer] + block * block_bytes;
}

/* The file part's weighted values back in the values' own coordinates: they were read as stored,
 * v · T, so numerator i (its zero points' sum on every channel) becomes (num_i + zero_sum_i) · Tᵀ;
 * attention is linear in the values. `scratch` holds dim floats. */
static void rotate_back(softmax_state *s, const float *rotation, float *scratch, int64_t dim) {
    for (int64_t i = 0; i < s->m; ++i) {
        float *o = s->num + i * dim;
        const float z = s->zero_sum[i];
        for (int64_t c = 0; c < dim; ++c) {
            const float *row = rotation + c * dim; /* T's row c: out_c = Σ_d (o_d + z) T[c][d] */
            float acc = 0.0f;
            for (int64_t d = 0; d < dim; ++d) acc += (o[d] + z) * row[d];
            scratch[c] = acc;
        }
        memcpy(o, scratch, sizeof(float) * (size_t)dim);
        s->zero_sum[i] = 0.0f;
    }
}

/* The request's own tokens (served slots P .. seq_len − 1), with the queries as the engine turned them. */
ALWAYS_INLINE int attend_own_tokens(const tile_job *job, const query_piece *piece, softmax_state *s,
                                    const float *queries, float *block, int64_t dim) {
    const kvf_engine *e = job->e;
    const kvf_request *r = job->requests + piece->request;
    const int64_t m = s->m, bs = e->block_size, group = e->q_heads / e->kv_heads, size = element_bytes(e->dtype);
    const int64_t placeholders = r->file->placeholders, own = r->seq_len - placeholders;
    const int64_t head_bytes = bs * 2 * dim * size;
    /* query i = token j (i / group) of the piece sees own tokens 0 .. own − query_len + first_token + j */
    const int64_t first_seen = own - r->query_len + piece->first_token;
    const int64_t last = first_seen + piece->tokens; /* own tokens any query of the piece sees */
    float keys[MAX_DIM * BLOCK_ENTRIES];           /* (dim, count): channel-major */
    for (int64_t start = 0, count = 0; start < last; start += count) {
        const int64_t slot = placeholders + start, block_index = slot / bs, offset = slot % bs;
        count = last - start < BLOCK_ENTRIES ? last - start : BLOCK_ENTRIES;
        if (count > bs - offset) count = bs - offset; /* one block at a time */
        CHECK(block_index < r->num_block_ids);
        const int64_t id = r->blocks[block_index];
        CHECK(id >= 0 && id < e->num_blocks && job->layer < e->layers);
        const uint8_t *run = block_base(e, job->layer, id) + job->head * head_bytes;
        const float *key_rows = keys; /* channel c's keys at key_rows + c * key_stride */
        int64_t key_stride = BLOCK_ENTRIES;
        if (e->key_layout == KEYS_CHANNEL_MAJOR && e->dtype == DT_F32 && offset + BLOCK_ENTRIES <= bs) {
            /* read in place: a whole block's vectors lie within the block; the slots past count are the
             * block's other tokens, whose logits update_maximum replaces by −inf */
            key_rows = (const float *)(const void *)(run + offset * size), key_stride = bs;
        } else if (e->key_layout == KEYS_CHANNEL_MAJOR) {
            for (int64_t c = 0; c < dim; ++c) to_float(run + (c * bs + offset) * size, e->dtype, keys + c * BLOCK_ENTRIES, count);
        } else {
            for (int64_t c = 0; c < dim; ++c)
                for (int64_t t = 0; t < count; ++t) {
                    const int64_t at = e->key_position[(offset + t) * dim + c];
                    CHECK(at >= 0 && at < bs * dim);
                    to_float(run + at * size, e->dtype, keys + c * BLOCK_ENTRIES + t, 1);
                }
        }
        for (int64_t i = 0; i < m; ++i) { /* logits along the block's tokens, channel by channel */
            const float *q = queries + i * dim;
            vf acc[BLOCK_VECTORS] = {{0}};
            for (int64_t c = 0; c < dim; ++c) {
                const vf qc = q[c] + (vf){0};
                for (int a = 0; a < BLOCK_VECTORS; ++a) acc[a] += qc * vload(key_rows + c * key_stride + a * LANES);
            }
            float *l = s->logits + i * BLOCK_ENTRIES;
            for (int a = 0; a < BLOCK_VECTORS; ++a) vstore(l + a * LANES, acc[a] * e->scale);
            const int64_t sees = first_seen + i / group; /* causal: own tokens 0 .. sees */
            for (int64_t t = 0; t < count; ++t)
                if (start + t > sees) l[t] = -INFINITY;
        }
        update_maximum(s, count, dim);
        const uint8_t *values = run + bs * dim * size + offset * dim * size; /* row-major */
        if (e->dtype == DT_F32) {
            block_values(s, values, 0, 0, NULL, NULL, count, dim);
        } else {
            to_float(values, e->dtype, block, count * dim);
            block_values(s, block, 0, 0, NULL, NULL, count, dim);
        }
    }
    return 0;
}

/* Floats of workspace one thread needs. */
static int64_t workspace_per_thread(int64_t dim) {
    const int64_t m = TILE_QUERIES;
    return 4 * m * dim /* queries, turned, folded, numerators */ + 4 * m /* maxima, sums, zero_dot */ +
           BLOCK_ENTRIES * m /* logits */ + BLOCK_ENTRIES * dim /* a block */ + 64;
}

/* The queries of a tile's pieces, in order: piece p's token j, head group · head + g, is query
 * i0 + j · group + g, where i0 counts the queries of the pieces before it. */
ALWAYS_INLINE void gather_queries(const tile_job *job, float *queries, int64_t dim) {
    const kvf_engine *e = job->e;
    const int64_t group = e->q_heads / e->kv_heads;
    for (int64_t p = 0, i = 0; p < job->num_pieces; ++p) {
        const query_piece *piece = job->pieces + p;
        const kvf_request *r = job->requests + piece->request;
        for (int64_t j = 0; j < piece->tokens; ++j)
            for (int64_t g = 0; g < group; ++g, ++i) {
                const int64_t token = r->query_start + piece->first_token + j, head = job->head * group + g;
                const int64_t at = token * job->query_token_stride + head * job->query_head_stride;
                to_float((const uint8_t *)job->query + at * element_bytes(e->dtype), e->dtype, queries + i * dim, dim);
            }
    }
}

/* The tile's file rows: every query of every piece in one running softmax per query (the pieces' requests
 * hold the file in the same blocks, so the first one's block table serves them all). */
ALWAYS_INLINE int attend_file_rows(const tile_job *job, softmax_state *s, segment_work *w, int64_t dim) {
    const kvf_request *r = job->requests + job->pieces[0].request;
    const kvf_file *f = r->file;
    const int64_t row = job->layer * f->rows + job->head;
    CHECK(row >= 0 && row < f->layers * f->rows);
    for (int64_t k = f->row_start[row]; k < f->row_start[row + 1]; ++k) {
        CHECK(k >= 0 && k < f->num_segments);
        const int64_t *seg = f->segments + k * SEG_FIELDS;
        const int64_t chunk = seg[SEG_CHUNK];
        CHECK(chunk >= 0 && chunk < f->num_chunks && chunk / f->layers < r->num_block_ids);
        const int64_t id = r->blocks[chunk / f->layers];
        CHECK(id >= 0 && id < job->e->num_blocks);
        const uint8_t *bytes = block_base(job->e, chunk % f->layers, id);
        const int status = attend_segment(w, s, bytes, seg, f->bits, dim);
        if (status) return status;
    }
    if (f->flags & FLAG_ROTATED) rotate_back(s, f->value_rotation, w->block, dim);
    return 0;
}

/* A piece of a tile, after the file's rows: its own request's tokens, then its rows of the output. Its
 * queries are the tile's i0 .. i0 + tokens · group − 1. */
ALWAYS_INLINE int finish_piece_dim(const tile_job *job, const query_piece *piece, const softmax_state *s, int64_t i0,
                                   const float *queries, float *block, int64_t dim) {
    const kvf_engine *e = job->e;
    const kvf_request *r = job->requests + piece->request;
    const int64_t group = e->q_heads / e->kv_heads, m = piece->tokens * group;
    softmax_state own = {m, s->top + i0, s->den + i0, s->zero_sum + i0, s->num + i0 * dim, s->logits + i0 * BLOCK_ENTRIES};
    const int status = attend_own_tokens(job, piece, &own, queries + i0 * dim, block, dim);
    if (status) return status;
    for (int64_t j = 0; j < piece->tokens; ++j)
        for (int64_t g = 0; g < group; ++g) {
            const int64_t i = j * group + g;
            const int64_t token = r->query_start + piece->first_token + j, head = job->head * group + g;
            const int64_t at = token * job->out_token_stride + head * job->out_head_stride;
            const float inverse = 1.0f / own.den[i], *o = own.num + i * dim;
            for (int64_t c = 0; c < dim; ++c)
                store_element(job->out, at + c, e->dtype, (o[c] + own.zero_sum[i]) * inverse);
        }
    return 0;
}

/* finish_piece_dim for the common head sizes and any other; not inlined into the tile, whose pass over the
 * file's rows then keeps the code the compiler gives it alone (about 5% faster than inlined, paired). */
__attribute__((noinline)) static int finish_piece(const tile_job *job, const query_piece *piece, const softmax_state *s,
                                                  int64_t i0, const float *queries, float *block) {
    switch (job->e->dim) {
        case 64: return finish_piece_dim(job, piece, s, i0, queries, block, 64);
        case 128: return finish_piece_dim(job, piece, s, i0, queries, block, 128);
        default: return finish_piece_dim(job, piece, s, i0, queries, block, job->e->dim);
    }
}

ALWAYS_INLINE int attend_tile_dim(const tile_job *job, float *ws, int64_t dim) {
    const kvf_engine *e = job->e;
    const kvf_file *f = job->requests[job->pieces[0].request].file;
    const int64_t group = e->q_heads / e->kv_heads;
    int64_t m = 0;
    for (int64_t p = 0; p < job->num_pieces; ++p) {
        const query_piece *piece = job->pieces + p;
        CHECK(job->requests[piece->request].file == f && job->requests[piece->request].query_start >= 0);
        CHECK(job->requests[piece->request].query_start + piece->first_token + piece->tokens <= job->step_tokens);
        m += piece->tokens * group;
    }
    CHECK(m >= 1 && m <= TILE_QUERIES);
    float *queries = ws, *turned = queries + m * dim, *folded = turned + m * dim;
    softmax_state s = {m, folded + m * dim, 0, 0, 0, 0};
    s.den = s.top + m, s.zero_sum = s.den + m, s.num = s.zero_sum + m, s.logits = s.num + m * dim;
    float *zero_dot = s.logits + BLOCK_ENTRIES * m, *block = zero_dot + m;
    CHECK(f && f->dim == dim && f->vdim == dim && f->rows == e->kv_heads && f->layers == e->layers);
    CHECK(!(f->flags & FLAG_ROTATED) || f->value_rotation);
    CHECK(f->chunk_bytes <= e->kv_heads * e->block_size * 2 * dim * element_bytes(e->dtype));
    CHECK(f->bits != 0 || (f->float_dtype >= DT_F32 && f->float_dtype <= DT_F16));
    gather_queries(job, queries, dim);
    /* turned by the file's offset: (x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin), RoPE's half-split pairs */
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < m; ++i) {
        const float *q = queries + i * dim;
        float *t = turned + i * dim;
        for (int64_t p = 0; p < half; ++p) {
            const double cs = f->rope[2 * p], sn = f->rope[2 * p + 1], x1 = q[p], x2 = q[p + half];
            t[p] = (float)(x1 * cs - x2 * sn);
            t[p + half] = (float)(x2 * cs + x1 * sn);
        }
    }
    for (int64_t i = 0; i < m; ++i) s.top[i] = -INFINITY, s.den[i] = 0.0f, s.zero_sum[i] = 0.0f;
    memset(s.num, 0, sizeof(float) * (size_t)(m * dim));
    segment_work w = {e, f, turned, folded, zero_dot, block};
    int status = attend_file_rows(job, &s, &w, dim);
    if (status) return status;
    /* then each piece's own tokens, with the engine's queries, and its rows of the output */
    for (int64_t p = 0, i0 = 0; p < job->num_pieces; ++p) {
        status = finish_piece(job, job->pieces + p, &s, i0, queries, block);
        if (status) return status;
        i0 += job->pieces[p].tokens * group;
    }
    return 0;
}

/* The tile, compiled for the common head sizes (so that their loops unroll) and for any other. */
static int attend_tile(const tile_job *job, float *ws) {
    switch (job->e->dim) {
        case 64: return attend_tile_dim(job, ws, 64);
        case 128: return attend_tile_dim(job, ws, 128);
        default: return attend_tile_dim(job, ws, job->e->dim);
    }
}

/* ------------------------------------------------------------------ the whole call's bounds */
#ifndef KVFOLD_DEBUG
static int within(int64_t start, int64_t bytes, int64_t limit) {
    return start >= HEADER_BYTES && bytes >= 0 && start <= limit && bytes <= limit - start;
}

static int segment_fits(const kvf_file *f, const int64_t *seg) {
    const int64_t n = seg[SEG_ENTRIES], limit = f->chunk_bytes;
    if (n < 0 || n > limit || seg[SEG_CHUNK] < 0 || seg[SEG_CHUNK] >= f->num_chunks) return 0;
    if (f->flags & FLAG_BETA && !within(seg[SEG_BETA], n * 4, limit)) return 0;
    if (f->bits == 0) {
        const int64_t size = element_bytes(f->float_dtype);
        return within(seg[SEG_KEYS], n * f->dim * size, limit) && within(seg[SEG_VALUES], n * f->vdim * size, limit);
    }
    const int64_t groups = (n + f->group - 1) / f->group;
    return within(seg[SEG_KEYS], n * (f->dim * f->bits / 8), limit) &&
           within(seg[SEG_VALUES], n * (f->vdim * f->bits / 8), limit) &&
           within(seg[SEG_KEY_SCALE], groups * f->dim * 2, limit) && within(seg[SEG_KEY_ZERO], groups * f->dim * 2, limit) &&
           within(seg[SEG_VALUE_SCALE], n * 2, limit) && within(seg[SEG_VALUE_ZERO], n * 2, limit);
}

static int block_ok(const kvf_engine *e, const kvf_request *r, int64_t index) {
    return index >= 0 && index < r->num_block_ids && r->blocks[index] >= 0 && r->blocks[index] < e->num_blocks;
}

static int call_fits(const kvf_engine *e, const kvf_request *requests, int64_t count, int64_t layer, int64_t tokens) {
    const int64_t block_bytes = e->kv_heads * e->block_size * 2 * e->dim * element_bytes(e->dtype);
    for (int64_t n = 0; n < count; ++n) {
        const kvf_request *r = requests + n;
        const kvf_file *f = r->file;
        if (!f || !r->blocks || f->layers != e->layers || f->rows != e->kv_heads || f->dim != e->dim) return 0;
        if (f->vdim != e->dim || f->chunk_bytes != block_bytes || f->placeholders % e->block_size) return 0;
        if (f->bits != 0 && (f->bits < 2 || f->bits > 8 || f->bits == 5 || f->bits == 6 || f->bits == 7)) return 0;
        if (f->bits == 0 && (f->float_dtype < DT_F32 || f->float_dtype > DT_F16)) return 0;
        if (f->bits && f->group < 1) return 0;
        if ((f->flags & FLAG_ROTATED) && (f->bits == 0 || !f->value_rotation)) return 0;
        if (f->num_chunks < 0 || (f->num_chunks + f->layers - 1) / f->layers > f->placeholders / e->block_size) return 0;
        if (r->query_len < 1 || r->query_start < 0 || r->query_start > tokens - r->query_len) return 0;
        if (r->seq_len - f->placeholders < r->query_len) return 0;
        const int64_t needed = (r->seq_len + e->block_size - 1) / e->block_size;
        if (needed > r->num_block_ids) return 0;
        for (int64_t b = 0; b < needed; ++b)
            if (!block_ok(e, r, b)) return 0;
        for (int64_t head = 0; head < f->rows; ++head) {
            const int64_t row = layer * f->rows + head, first = f->row_start[row], stop = f->row_start[row + 1];
            if (first < 0 || stop < first || stop > f->num_segments) return 0;
            for (int64_t k = first; k < stop; ++k) {
                const int64_t *seg = f->segments + k * SEG_FIELDS;
                if (!segment_fits(f, seg)) return 0;
                const int64_t chunk = seg[SEG_CHUNK];
                const uint8_t *bytes = block_base(e, chunk % f->layers, r->blocks[chunk / f->layers]);
                uint32_t header[3];
                memcpy(header, bytes, sizeof header);
                if (header[0] != CHUNK_MAGIC || (int64_t)header[1] != f->chunk_segments[chunk] ||
                    (int64_t)header[2] != f->flags)
                    return 0;
            }
        }
    }
    return 1;
}
#endif

/* ------------------------------------------------------------------ the call's tiles */
/* Whether requests a and b hold one file in the same blocks (an engine's prefix cache shares a file's
 * blocks between the requests on it): then their queries can share a pass over the file's rows. */
static int same_file_blocks(const kvf_engine *e, const kvf_request *a, const kvf_request *b) {
    if (!a->file || a->file != b->file || !a->blocks || !b->blocks) return 0;
    const int64_t n = a->file->placeholders / e->block_size;
    if (n < 0 || n > a->num_block_ids || n > b->num_block_ids) return 0;
    return memcmp(a->blocks, b->blocks, sizeof(int32_t) * (size_t)n) == 0;
}

/* The call's tiles: each request's query cut into pieces of up to `tile_tokens` tokens, the pieces of
 * requests on the same file's blocks laid out together and packed into tiles of up to TILE_QUERIES
 * queries a KV head, so that each tile reads the file's rows once for all its queries. A file's tiles are
 * kept small enough that the call has about ITEMS_PER_THREAD (tile, KV head) items a thread, so that
 * the threads stay busy. Tile t is pieces start[t] .. start[t + 1] − 1; its file's tiles are
 * first[t] .. first[t] + tiles[t] − 1. */
#define ITEMS_PER_THREAD 2
typedef struct {
    int64_t num_tiles;
    int64_t *start, *first, *tiles; /* (num_tiles + 1), (num_tiles), (num_tiles) */
    query_piece *pieces;
    int64_t *memory; /* one allocation: the tables above, then two of `count` the planning needs */
} tile_plan;

static int64_t count_pieces(const kvf_request *requests, int64_t count, int64_t tile_tokens) {
    int64_t pieces = 0;
    for (int64_t n = 0; n < count; ++n) pieces += (requests[n].query_len + tile_tokens - 1) / tile_tokens;
    return pieces;
}

/* Which requests hold the same file in the same blocks: leader[n] the first of them, next[n] the next
 * one after n (−1: none); returns the step's queries a KV head. */
static int64_t group_requests(const kvf_engine *e, const kvf_request *requests, int64_t count, int64_t *leader,
                              int64_t *next) {
    const int64_t group = e->q_heads / e->kv_heads;
    int64_t all_queries = 0;
    for (int64_t n = 0; n < count; ++n) {
        leader[n] = n, next[n] = -1;
        all_queries += requests[n].query_len * group;
        for (int64_t l = 0; l < n; ++l)
            if (leader[l] == l && same_file_blocks(e, requests + l, requests + n)) {
                leader[n] = l;
                break;
            }
    }
    for (int64_t n = count - 1; n >= 0; --n) /* members in request order */
        if (leader[n] != n) next[n] = next[leader[n]], next[leader[n]] = n;
    return all_queries;
}

/* The plan of `count` (≥ 1) requests, each with a query (free plan->memory); −1 without memory. */
static int make_tiles(const kvf_engine *e, const kvf_request *requests, int64_t count, int64_t threads, tile_plan *plan) {
    const int64_t group = e->q_heads / e->kv_heads, tile_tokens = TILE_QUERIES / group;
    const int64_t num_pieces = count_pieces(requests, count, tile_tokens);
    const int64_t tables = 3 * num_pieces + 1 + 2 * count;
    const int64_t piece_words = (int64_t)(sizeof(query_piece) / sizeof(int64_t)) * num_pieces;
    plan->memory = malloc(sizeof(int64_t) * (size_t)(tables + piece_words));
    if (!plan->memory) return -1;
    plan->start = plan->memory, plan->first = plan->start + num_pieces + 1, plan->tiles = plan->first + num_pieces;
    int64_t *leader = plan->tiles + num_pieces, *next = leader + count;
    plan->pieces = (query_piece *)(next + count);
    const int64_t all_queries = group_requests(e, requests, count, leader, next);
    const int64_t wanted = (ITEMS_PER_THREAD * threads + e->kv_heads - 1) / e->kv_heads; /* tiles */
    int64_t made = 0, t = 0;
    for (int64_t l = 0; l < count; ++l) {
        if (leader[l] != l) continue;
        int64_t queries = 0;
        for (int64_t n = l; n >= 0; n = next[n]) queries += requests[n].query_len * group;
        /* this file's share of the wanted tiles, and at least enough for TILE_QUERIES each */
        int64_t tiles = (queries * wanted + all_queries - 1) / all_queries;
        const int64_t least = (queries + TILE_QUERIES - 1) / TILE_QUERIES;
        if (tiles < least) tiles = least;
        const int64_t cap = (queries + tiles - 1) / tiles, first_tile = t;
        int64_t in_tile = 0;
        for (int64_t n = l; n >= 0; n = next[n])
            for (int64_t first = 0; first < requests[n].query_len; first += tile_tokens) {
                const int64_t rest = requests[n].query_len - first, tokens = rest < tile_tokens ? rest : tile_tokens;
                if (in_tile == 0 || in_tile + tokens * group > cap) {
                    plan->start[t++] = made;
                    in_tile = 0;
                }
                plan->pieces[made++] = (query_piece){n, first, tokens};
                in_tile += tokens * group;
            }
        for (int64_t k = first_tile; k < t; ++k) plan->first[k] = first_tile, plan->tiles[k] = t - first_tile;
    }
    plan->start[t] = made;
    plan->num_tiles = t;
    return 0;
}

/* Item `item` of the call's num_tiles × kv_heads: a file's items are adjacent, and within them a head's
 * tiles, so that a file's rows of a head are read again while the caches hold them. */
static void item_tile(const tile_plan *plan, int64_t kv_heads, int64_t item, int64_t *tile, int64_t *head) {
    const int64_t t = item / kv_heads; /* a tile of the same file (whose items are kv_heads · first ..) */
    const int64_t first = plan->first[t], tiles = plan->tiles[t], local = item - kv_heads * first;
    *head = local / tiles;
    *tile = first + local % tiles;
}

/* The tiles kvfold_attend_pool would attend for these requests (for tests and benchmarks): the request of
 * each piece in `piece_request` (up to `capacity`), where each tile's pieces start in `tile_start`
 * (capacity + 1). Returns the number of tiles; −1 if `capacity` is too small, −3 without memory, −7 for a
 * request with no query or an engine whose heads do not divide. */
int64_t kvfold_pool_tiles(const kvf_engine *e, const kvf_request *requests, int64_t count, int64_t *piece_request,
                          int64_t *tile_start, int64_t capacity) {
    if (e->kv_heads < 1 || e->q_heads % e->kv_heads || e->q_heads / e->kv_heads > TILE_QUERIES) return -7;
    for (int64_t n = 0; n < count; ++n)
        if (requests[n].query_len < 1) return -7;
    if (count < 1) return 0;
    tile_plan plan;
    if (make_tiles(e, requests, count, e->threads < 1 ? 1 : e->threads, &plan)) return -3;
    const int64_t num_pieces = plan.start[plan.num_tiles];
    if (num_pieces > capacity) {
        free(plan.memory);
        return -1;
    }
    for (int64_t k = 0; k < num_pieces; ++k) piece_request[k] = plan.pieces[k].request;
    for (int64_t t = 0; t <= plan.num_tiles; ++t) tile_start[t] = plan.start[t];
    free(plan.memory);
    return plan.num_tiles;
}

/* Every request's rows of one layer's output. Returns 0, or an error code (kvfold.runtime.native.ERRORS):
 * 1 a dimension past the kernel's limits, 3 no memory for the call's tiles, 5 an index past a buffer (debug
 * build), 6 a workspace too small, 7 a request that does not fit the engine (its file, blocks, rows or chunk
 * headers; release build: checked before anything is written, so the caller may call again without it), 8
 * an engine layout the kernel does not read (layer, dtype, block size or key layout). */
int kvfold_attend_pool(const kvf_engine *e, const kvf_request *requests, int64_t count, int64_t layer, int64_t tokens,
                       const void *query, int64_t query_token_stride, int64_t query_head_stride, void *out,
                       int64_t out_token_stride, int64_t out_head_stride) {
    if (e->dim > MAX_DIM || e->dim % LANES || e->kv_heads < 1 || e->q_heads % e->kv_heads) return 1;
    if (e->q_heads / e->kv_heads > TILE_QUERIES) return 1;
    if (layer < 0 || layer >= e->layers || e->dtype < DT_F32 || e->dtype > DT_F16 || e->block_size < 1) return 8;
    const int64_t threads = e->threads < 1 ? 1 : e->threads;
    if (e->workspace_floats < threads * workspace_per_thread(e->dim)) return 6;
    if (e->key_layout != KEYS_CHANNEL_MAJOR && (e->key_layout != KEYS_TABLE || !e->key_position)) return 8;
    if (count < 1) return 0;
    for (int64_t n = 0; n < count; ++n)
        if (requests[n].query_len < 1) return 7;
#ifndef KVFOLD_DEBUG
    if (!call_fits(e, requests, count, layer, tokens)) return 7;
#endif
    tile_plan plan;
    if (make_tiles(e, requests, count, threads, &plan)) return 3;
    int status = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
#endif
    for (int64_t item = 0; item < plan.num_tiles * e->kv_heads; ++item) {
#ifdef _OPENMP
        float *ws = e->workspace + (int64_t)omp_get_thread_num() * workspace_per_thread(e->dim);
#else
        float *ws = e->workspace;
#endif
        int64_t tile, head;
        item_tile(&plan, e->kv_heads, item, &tile, &head);
        const tile_job job = {e, requests, plan.pieces + plan.start[tile], plan.start[tile + 1] - plan.start[tile], layer,
                              head, tokens, query, query_token_stride, query_head_stride, out, out_token_stride,
                              out_head_stride};
        const int found = attend_tile(&job, ws);
        if (found) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            status = found;
        }
    }
    free(plan.memory);
    return status;
}

/* What kvfold_attend_pool needs of workspace per thread, in floats (the caller allocates it). */
int64_t kvfold_pool_workspace_floats(int64_t dim) { return workspace_per_thread(dim); }
