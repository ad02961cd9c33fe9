// One model call of a Llama-family decoder (Llama, Qwen2 and kin) on a CPU: every layer, for `rows` runs of `width`
// tokens each, against their keys and values in preallocated slots. Called through ctypes by decoders/models/native.py
// (the step) and linear.py / quantize.py (`dk_linear`, the product alone). Design: docs/design/native.md.
//
// Why it is fast: one call into native code per model call (no per-op dispatch), and matrix products that read each
// weight row once per call, whatever the rows (bfloat16 pairs through AVX512-BF16's dot product where the CPU has it).
// Why it is exact: every output element is computed by the same instructions in the same order whatever the call's
// rows, tokens, masks and thread split, so a token scored in a call of many gets the logits it gets in a call alone.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

constexpr int MAX_HEAD_DIM = 512;  // (the attention's accumulator per head)

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DK_AVX512 1
#else
#define DK_AVX512 0
#endif
#if !DK_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define DK_AVX2 1
#else
#define DK_AVX2 0
#endif
#if DK_AVX512 || DK_AVX2
#include <immintrin.h>
#endif

typedef uint16_t bf16;

static inline float to_f32(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float to_f32(float v) { return v; }

static inline bf16 to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
static inline void store(bf16* p, float f) { *p = to_bf16(f); }
static inline void store(float* p, float f) { *p = f; }

// ---------------------------------------------------------------------------------------------------------------
// Products: y[n, o] = x[n] . w[o] over K elements. Each (input row, weight row) pair sums its products in one chain of
// 16 lanes over the row's chunks in order, then adds the lanes in a fixed order: the same instructions whatever the
// tile it falls in, so a row's outputs do not depend on the other rows of the call (the batch-invariance).

#if DK_AVX512
// out[j] = _mm512_reduce_add_ps(a[j]) for 16 accumulators at once: the same sums in the same order (lanes i and
// i + 8, then i and i + 4, i and i + 2, 0 and 1), by transposing as it adds, in a quarter of the instructions.
static inline void reduce16(const __m512* a, float* out) {
    __m512 z[8], w[4], c[2];
    for (int p = 0; p < 8; p++) {  // z[p] = [a[2p] lanes i + i+8 | a[2p+1] lanes i + i+8]
        __m512 lo = _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0));
        __m512 hi = _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2));
        z[p] = _mm512_add_ps(hi, lo);
    }
    // z[p] 128-bit blocks: [A.a0-3, A.a4-7, B.a0-3, B.a4-7] with A = a[2p], B = a[2p+1]
    for (int p = 0; p < 4; p++) {  // w[p] blocks: [a[4p].b, a[4p+1].b, a[4p+2].b, a[4p+3].b]
        __m512 lo = _mm512_shuffle_f32x4(z[2 * p], z[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0));
        __m512 hi = _mm512_shuffle_f32x4(z[2 * p], z[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1));
        w[p] = _mm512_add_ps(hi, lo);
    }
    for (int p = 0; p < 2; p++) {  // c[p] block j: [w[2p] block j c0, c1, w[2p+1] block j c0, c1]
        __m512 lo = _mm512_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0));
        __m512 hi = _mm512_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2));
        c[p] = _mm512_add_ps(hi, lo);
    }
    // d block j: [c[0] blk j: w0 d, w1 d ; c[1] blk j: w2 d, w3 d]
    __m512 lo = _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0));
    __m512 hi = _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1));
    __m512 d = _mm512_add_ps(hi, lo);
    // d block j element e: accumulator index = 4*e + j  (w[e] block j came from a[4e + j])
    float tmp[16];
    _mm512_storeu_ps(tmp, d);
    for (int j = 0; j < 4; j++)
        for (int e = 0; e < 4; e++) out[4 * e + j] = tmp[4 * j + e];
}
// out[t * ldo + o] = the sum of acc[t * OR + o]'s lanes.
template <int TR, int OR>
static inline void finish(const __m512* acc, float* out, int ldo) {
    int i = 0;
    float sums[16];
    for (; i + 16 <= TR * OR; i += 16) {
        reduce16(acc + i, sums);
        for (int j = 0; j < 16; j++) out[(i + j) / OR * ldo + (i + j) % OR] = sums[j];
    }
    if (TR * OR - i >= 4) {  // (a tail of 4 or more: reduced 16 at a time too, padded with zeros)
        __m512 rest[16];
        for (int j = 0; j < 16; j++) rest[j] = i + j < TR * OR ? acc[i + j] : _mm512_setzero_ps();
        reduce16(rest, sums);
        for (int j = 0; i < TR * OR; i++, j++) out[i / OR * ldo + i % OR] = sums[j];
    }
    for (; i < TR * OR; i++) out[i / OR * ldo + i % OR] = _mm512_reduce_add_ps(acc[i]);
}

// TR input rows x OR weight rows, each pair's chain in a register over the whole row.
template <int TR, int OR>
static inline void tile(const bf16* x, size_t ldx, const bf16* w, size_t ldw, int K, float* out, int ldo) {
    __m512 acc[TR][OR];
    for (int t = 0; t < TR; t++)
        for (int o = 0; o < OR; o++) acc[t][o] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh xv[TR];
        for (int t = 0; t < TR; t++) xv[t] = (__m512bh)_mm512_loadu_si512(x + t * ldx + k);
        for (int o = 0; o < OR; o++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + o * ldw + k);
            for (int t = 0; t < TR; t++) acc[t][o] = _mm512_dpbf16_ps(acc[t][o], wv, xv[t]);
        }
    }
    if (k < K) {  // (the row's last, partial chunk: zeros past its end add nothing)
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh xv[TR];
        for (int t = 0; t < TR; t++) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * ldx + k);
        for (int o = 0; o < OR; o++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + o * ldw + k);
            for (int t = 0; t < TR; t++) acc[t][o] = _mm512_dpbf16_ps(acc[t][o], wv, xv[t]);
        }
    }
    finish<TR, OR>(&acc[0][0], out, ldo);
}

template <int TR, int OR>
static inline void tile(const float* x, size_t ldx, const float* w, size_t ldw, int K, float* out, int ldo) {
    __m512 acc[TR][OR];
    for (int t = 0; t < TR; t++)
        for (int o = 0; o < OR; o++) acc[t][o] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[TR];
        for (int t = 0; t < TR; t++) xv[t] = _mm512_loadu_ps(x + t * ldx + k);
        for (int o = 0; o < OR; o++) {
            __m512 wv = _mm512_loadu_ps(w + o * ldw + k);
            for (int t = 0; t < TR; t++) acc[t][o] = _mm512_fmadd_ps(wv, xv[t], acc[t][o]);
        }
    }
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[TR];
        for (int t = 0; t < TR; t++) xv[t] = _mm512_maskz_loadu_ps(m, x + t * ldx + k);
        for (int o = 0; o < OR; o++) {
            __m512 wv = _mm512_maskz_loadu_ps(m, w + o * ldw + k);
            for (int t = 0; t < TR; t++) acc[t][o] = _mm512_fmadd_ps(wv, xv[t], acc[t][o]);
        }
    }
    finish<TR, OR>(&acc[0][0], out, ldo);
}

// int8 weights (an int8 copy, `decoders.quantize`): each chunk widened exactly to the activations' type (|q| <= 127
// fits bfloat16's mantissa), then the same chains; the row's scale multiplies its sum afterwards.
static inline __m512bh widen32(const int8_t* p, int n) {  // n <= 32 int8 -> bfloat16, zeros past n
    const __mmask16 lo = (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1);
    const __mmask16 hi = (__mmask16)(n >= 32 ? 0xffff : n <= 16 ? 0 : (1u << (n - 16)) - 1);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(lo, p)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(hi, p + 16)));
    return _mm512_cvtne2ps_pbh(b, a);  // (the low 16 from a)
}

template <int TR, int OR>
static inline void tile(const bf16* x, size_t ldx, const int8_t* w, size_t ldw, int K, float* out, int ldo) {
    __m512 acc[TR][OR];
    for (int t = 0; t < TR; t++)
        for (int o = 0; o < OR; o++) acc[t][o] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        const int n = std::min(32, K - k);
        const __mmask32 m = (__mmask32)(n == 32 ? 0xffffffffu : (1u << n) - 1);
        __m512bh xv[TR];
        for (int t = 0; t < TR; t++) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * ldx + k);
        for (int o = 0; o < OR; o++) {
            const __m512bh wv = widen32(w + o * ldw + k, n);
            for (int t = 0; t < TR; t++) acc[t][o] = _mm512_dpbf16_ps(acc[t][o], wv, xv[t]);
        }
    }
    finish<TR, OR>(&acc[0][0], out, ldo);
}

template <int TR, int OR>
static inline void tile(const float* x, size_t ldx, const int8_t* w, size_t ldw, int K, float* out, int ldo) {
    __m512 acc[TR][OR];
    for (int t = 0; t < TR; t++)
        for (int o = 0; o < OR; o++) acc[t][o] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        const int n = std::min(16, K - k);
        const __mmask16 m = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1);
        __m512 xv[TR];
        for (int t = 0; t < TR; t++) xv[t] = _mm512_maskz_loadu_ps(m, x + t * ldx + k);
        for (int o = 0; o < OR; o++) {
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w + o * ldw + k)));
            for (int t = 0; t < TR; t++) acc[t][o] = _mm512_fmadd_ps(wv, xv[t], acc[t][o]);
        }
    }
    finish<TR, OR>(&acc[0][0], out, ldo);
}
#elif DK_AVX2
// AVX2 without AVX-512: each pair's 16 lanes in two registers of 8, bfloat16 and int8 widened exactly to float32 as
// they are read, the lanes added pairwise in the portable build's order.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline float sum16(__m256 lo, __m256 hi) {
    const __m256 v = _mm256_add_ps(lo, hi);                                                 // lane i + lane i + 8
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // + 4
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                             // + 2
    h = _mm_add_ss(h, _mm_movehdup_ps(h));                                              // + 1
    return _mm_cvtss_f32(h);
}

template <int TR, int OR, typename X, typename W>
static inline void chunk(const X* x, size_t ldx, const W* w, size_t ldw, __m256 (&lo)[TR][OR], __m256 (&hi)[TR][OR]) {
    for (int o = 0; o < OR; o++) {
        const __m256 wl = load8(w + o * ldw), wh = load8(w + o * ldw + 8);
        for (int t = 0; t < TR; t++) {
            lo[t][o] = _mm256_fmadd_ps(wl, load8(x + t * ldx), lo[t][o]);
            hi[t][o] = _mm256_fmadd_ps(wh, load8(x + t * ldx + 8), hi[t][o]);
        }
    }
}

template <int TR, int OR, typename X, typename W>
static inline void tile(const X* x, size_t ldx, const W* w, size_t ldw, int K, float* out, int ldo) {
    __m256 lo[TR][OR], hi[TR][OR];
    for (int t = 0; t < TR; t++)
        for (int o = 0; o < OR; o++) lo[t][o] = hi[t][o] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) chunk<TR, OR>(x + k, ldx, w + k, ldw, lo, hi);
    if (k < K) {  // (the row's last, partial chunk, from copies padded with zeros: they add nothing)
        X xs[TR][16] = {};
        W ws[OR][16] = {};
        for (int t = 0; t < TR; t++) memcpy(xs[t], x + t * ldx + k, (K - k) * sizeof(X));
        for (int o = 0; o < OR; o++) memcpy(ws[o], w + o * ldw + k, (K - k) * sizeof(W));
        chunk<TR, OR>(&xs[0][0], 16, &ws[0][0], 16, lo, hi);
    }
    for (int t = 0; t < TR; t++)
        for (int o = 0; o < OR; o++) out[t * ldo + o] = sum16(lo[t][o], hi[t][o]);
}
#else
// Portable: the 16 lanes as a plain array (which compilers vectorize), added pairwise in a fixed order.
static inline float to_f32(int8_t v) { return (float)v; }

template <int TR, int OR, typename X, typename W>
static inline void tile(const X* x, size_t ldx, const W* w, size_t ldw, int K, float* out, int ldo) {
    for (int t = 0; t < TR; t++)
        for (int o = 0; o < OR; o++) {
            const X* xr = x + t * ldx;
            const W* wr = w + o * ldw;
            float lane[16] = {0};
            for (int k = 0; k < K; k++) lane[k % 16] += to_f32(xr[k]) * to_f32(wr[k]);
            for (int half = 8; half >= 1; half /= 2)
                for (int i = 0; i < half; i++) lane[i] += lane[i + half];
            out[t * ldo + o] = lane[0];
        }
}
#endif

// Rows [n, n + rows) against weight rows [o, o + orows): the tile shape only decides which loads are shared.
template <int TR, int OR, typename X, typename W>
static inline void tiles(const X* x, size_t ldx, int rows, const W* w, int K, int orows, float* out, int ldo) {
    int o = 0;
    for (; o + OR <= orows; o += OR) tile<TR, OR>(x, ldx, w + (size_t)o * K, K, K, out + o, ldo);
    for (; o < orows; o++) tile<TR, 1>(x, ldx, w + (size_t)o * K, K, K, out + o, ldo);
    (void)rows;
}

template <typename X, typename W>
static void block(const X* x, size_t ldx, int rows, const W* w, int K, int orows, float* out, int ldo) {
    // A few rows (a step, a verification): one weight row at a time, read once from memory in order, which its
    // prefetcher streams best. Many rows (a prompt): 4 x 4 or 6 x 4 tiles, whose loads feed 16 or 24 products each.
    int n = 0;
    if (rows <= 4) {
        switch (rows) {
            case 4: tiles<4, 1>(x, ldx, 4, w, K, orows, out, ldo); break;
            case 3: tiles<3, 1>(x, ldx, 3, w, K, orows, out, ldo); break;
            case 2: tiles<2, 1>(x, ldx, 2, w, K, orows, out, ldo); break;
            default: tiles<1, 1>(x, ldx, 1, w, K, orows, out, ldo); break;
        }
        return;
    }
#if DK_AVX2
    // (2 x 2 tiles: their accumulators and loads fit AVX2's 16 registers; 3 x 2, 4 x 1 and 2 x 3 were no faster)
    for (; n + 2 <= rows; n += 2) tiles<2, 2>(x + n * ldx, ldx, 2, w, K, orows, out + (size_t)n * ldo, ldo);
    if (n < rows) tiles<1, 2>(x + n * ldx, ldx, 1, w, K, orows, out + (size_t)n * ldo, ldo);
#else
    const int tr = rows >= 48 ? 6 : 4;
    for (; n + tr <= rows; n += tr) {
        if (tr == 6) tiles<6, 4>(x + n * ldx, ldx, 6, w, K, orows, out + (size_t)n * ldo, ldo);
        else tiles<4, 4>(x + n * ldx, ldx, 4, w, K, orows, out + (size_t)n * ldo, ldo);
    }
    for (; n < rows; n++) tiles<1, 4>(x + n * ldx, ldx, 1, w, K, orows, out + (size_t)n * ldo, ldo);
#endif
}

// y [N, o1 - o0] (row stride ldy) = x [N, K] . w [o0:o1]: the weight rows in blocks that the core's cache holds while
// every input row passes them, so that a prompt reads each weight from memory once.
template <typename X, typename W>
static void gemm(const X* x, int N, size_t ldx, const W* w, int K, int o0, int o1, float* y, int ldy) {
    const int rows_held = std::max(4, (int)((384 * 1024) / ((size_t)K * sizeof(W))) / 4 * 4);
    const int ob = N <= 4 ? o1 - o0 : rows_held;
    for (int o = o0; o < o1; o += ob) {
        const int orows = std::min(ob, o1 - o);
        for (int n = 0; n < N; n += 96)  // (96 rows of x at a time: they stay in the core's cache too)
            block(x + (size_t)n * ldx, ldx, std::min(96, N - n), w + (size_t)o * K, K, orows,
                  y + (size_t)n * ldy + (o - o0), ldy);
    }
}

// A weight matrix: its elements (the model's dtype, or int8 with a bfloat16 scale per row).
struct Mat {
    const void* w;
    const void* scale;
};

// gemm of `x` by the matrix `m` of weight type `wtype` (2: int8 rows times their scales, else the activations' type).
template <typename X>
static void product(const X* x, int N, size_t ldx, int wtype, Mat m, int K, int o0, int o1, float* y, int ldy) {
    if (wtype != 2) return gemm(x, N, ldx, (const X*)m.w, K, o0, o1, y, ldy);
    gemm(x, N, ldx, (const int8_t*)m.w, K, o0, o1, y, ldy);
    const bf16* scale = (const bf16*)m.scale;
    for (int n = 0; n < N; n++)
        for (int o = o0; o < o1; o++) y[(size_t)n * ldy + (o - o0)] *= to_f32(scale[o]);
}

// This thread's share [begin, end) of `count` items, split in multiples of `align`.
static inline void share(int count, int align, int* begin, int* end) {
    int threads = omp_get_num_threads(), me = omp_get_thread_num();
    int blocks = (count + align - 1) / align;
    int b0 = (int)((int64_t)blocks * me / threads), b1 = (int)((int64_t)blocks * (me + 1) / threads);
    *begin = std::min(count, b0 * align);
    *end = std::min(count, b1 * align);
}

// ---------------------------------------------------------------------------------------------------------------

extern "C" {

struct DkModel {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    int64_t dtype;  // the activations and cache: 0 float32, 1 bfloat16
    int64_t wtype;  // the linear layers' weights: the same as dtype, or 2: int8 with a bfloat16 scale per row
    double eps, scale;
    const void* final_norm;  // [hidden]
    const void* lm_head;     // [vocab, hidden]
    const void* lm_head_scale;  // [vocab] (int8 weights)
    // per layer: input norm, q, q bias, k, k bias, v, v bias, o, post-attention norm, gate, up, down, then the
    // int8 weights' scales of q, k, v, o, gate, up, down (a bias or scale may be 0)
    const void* const* weights;
};

struct DkCall {
    int64_t rows, width, past, capacity, keep, threads;
    const void* embeddings;  // [rows * width, hidden], the model's dtype
    const float* cos;        // [rows * width, head_dim]
    const float* sin;
    const uint8_t* allowed;  // [rows, width, capacity]: query (r, w) sees slot s; 0: causal over slots < past + w + 1
    void* const* keys;       // per layer [rows, kv_heads, capacity, head_dim], the model's dtype
    void* const* values;
    float* logits;           // [rows, keep, vocab]: the last `keep` tokens of each row
};

enum { NORM_IN, WQ, BQ, WK, BK, WV, BV, WO, NORM_POST, WG, WU, WD, SQ, SK, SV, SO, SG, SU, SD, PER_LAYER };

}  // extern "C"

// exp(x) of `n` floats in place: a degree-6 polynomial after range reduction (within 2 ulp of libm's), the same
// instructions for every element wherever it sits in the array, so that no result depends on a row's neighbours.
#if DK_AVX512
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
static inline void exp_inplace(float* a, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(a + i, exp16(_mm512_loadu_ps(a + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(a + i, m, exp16(_mm512_maskz_loadu_ps(m, a + i)));
    }
}
#else
static inline void exp_inplace(float* a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = expf(a[i]);
}
#endif

// q . key over `n` elements in 16 lanes, reduced pairwise: written so that compilers vectorize it without reordering.
template <typename T>
static inline float dot_lanes(const float* q, const T* key, int n) {
    float lane[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lane[j] += q[i + j] * to_f32(key[i + j]);
    for (int j = 0; i + j < n; j++) lane[j] += q[i + j] * to_f32(key[i + j]);
    for (int half = 8; half >= 1; half /= 2)
        for (int j = 0; j < half; j++) lane[j] += lane[j + half];
    return lane[0];
}

// One query head over the slots it sees (`allow`, or all of [0, last)): softmax(q . k * scale) . v into `dst`. HD_
// fixed (64, 128) keeps the output's sums in registers; 0: any head size. The same operations in the same order.
template <int HD_, typename T>
static void attend(const float* q, const T* keys, const T* values, int hd, int64_t last, const uint8_t* allow,
                   float scale, float* s, T* dst) {
    const int HD = HD_ ? HD_ : hd;
    float best = -INFINITY;
    for (int64_t slot = 0; slot < last; slot++) {
        s[slot] = allow && !allow[slot] ? -INFINITY : dot_lanes(q, keys + slot * HD, HD) * scale;
        best = std::max(best, s[slot]);
    }
    for (int64_t slot = 0; slot < last; slot++) s[slot] -= best;
    exp_inplace(s, last);
    float total = 0.f, out[HD_ ? HD_ : MAX_HEAD_DIM];
    for (int i = 0; i < HD; i++) out[i] = 0.f;
    for (int64_t slot = 0; slot < last; slot++) {
        if (allow && !allow[slot]) continue;
        const float p = s[slot];
        total += p;
        const T* value = values + slot * HD;
        for (int i = 0; i < HD; i++) out[i] += p * to_f32(value[i]);
    }
    for (int i = 0; i < HD; i++) store(dst + i, out[i] / total);
}

template <typename T>
static void rmsnorm_rows(const float* h, int n0, int n1, int d, const T* weight, double eps, T* out) {
    for (int n = n0; n < n1; n++) {
        const float* row = h + (size_t)n * d;
        double sum = 0.0;  // (a double: the same sum whatever the row's length, and no worse than torch's float)
        for (int i = 0; i < d; i++) sum += (double)row[i] * row[i];
        float inv = (float)(1.0 / sqrt(sum / d + eps));
        for (int i = 0; i < d; i++) store(out + (size_t)n * d + i, row[i] * inv * to_f32(weight[i]));
    }
}

template <typename T>
static int forward(const DkModel* m, const DkCall* c) {
    const int R = (int)c->rows, W = (int)c->width, N = R * W, D = (int)m->hidden;
    const int H = (int)m->heads, KV = (int)m->kv_heads, HD = (int)m->head_dim, I = (int)m->intermediate;
    const int QD = H * HD, KD = KV * HD, G = H / KV, CAP = (int)c->capacity, keep = (int)c->keep;
    const int64_t past = c->past, seen_max = past + W;  // slots a query may see: those before the call, and its own
    const int V = (int)m->vocab;
    const float scale = (float)m->scale;
    const int wtype = (int)m->wtype;
    // the residual stream in float32; each product's input in the activations' dtype
    std::vector<float> h((size_t)N * D), q((size_t)N * QD), k((size_t)N * KD), v((size_t)N * KD);
    std::vector<float> sum((size_t)N * D), gate((size_t)N * I), up((size_t)N * I);
    std::vector<T> att((size_t)N * QD), act((size_t)N * I);
    const T* emb = (const T*)c->embeddings;
    for (size_t i = 0; i < (size_t)N * D; i++) h[i] = to_f32(emb[i]);

    const int threads = (int)std::max<int64_t>(1, c->threads);
    std::vector<float> scores((size_t)threads * seen_max);
    std::vector<std::vector<float>> expbuf(threads, std::vector<float>(I));
    // each thread normalizes every row for itself (a few microseconds) rather than wait for the other at a barrier
    std::vector<std::vector<T>> normed(threads, std::vector<T>((size_t)N * D));

#pragma omp parallel num_threads(threads)
    {
        int o0, o1;
        const int me = omp_get_thread_num();
        float* sc = scores.data() + (size_t)me * seen_max;
        T* xn = normed[me].data();
        for (int64_t l = 0; l < m->layers; l++) {
            const void* const* lw = m->weights + l * PER_LAYER;
            const T *bq = (const T*)lw[BQ], *bk = (const T*)lw[BK], *bv = (const T*)lw[BV];
            T* kc = (T*)c->keys[l];
            T* vc = (T*)c->values[l];

            rmsnorm_rows(h.data(), 0, N, D, (const T*)lw[NORM_IN], m->eps, xn);
            // q, k and v as one product's rows, split between the threads by whole heads: each thread adds the biases
            // and rotary positions to its own heads and writes its keys and values to their slots (row r's token w
            // at slot past + w)
            int h0, h1;
            share(H + 2 * KV, 1, &h0, &h1);
            for (int part = 0; part < 3; part++) {
                const int base = part == 0 ? 0 : part == 1 ? H : H + KV, count = part == 0 ? H : KV;
                const int a = std::max(h0, base) - base, b = std::min(h1, base + count) - base;
                if (a >= b) continue;
                float* out = part == 0 ? q.data() : part == 1 ? k.data() : v.data();
                const T* bias = part == 0 ? bq : part == 1 ? bk : bv;
                const int width = count * HD;
                const Mat w = part == 0 ? Mat{lw[WQ], lw[SQ]} : part == 1 ? Mat{lw[WK], lw[SK]} : Mat{lw[WV], lw[SV]};
                product(xn, N, D, wtype, w, D, a * HD, b * HD, out + a * HD, width);
                for (int n = 0; n < N; n++) {
                    float* row = out + (size_t)n * width;
                    if (bias)
                        for (int i = a * HD; i < b * HD; i++) row[i] += to_f32(bias[i]);
                    const float *cs = c->cos + (size_t)n * HD, *sn = c->sin + (size_t)n * HD;
                    const int half = HD / 2, r = n / W, t = n % W;
                    for (int head = a; head < b; head++) {
                        float* p = row + head * HD;
                        if (part < 2)
                            for (int i = 0; i < half; i++) {
                                const float x0 = p[i], x1 = p[i + half];
                                p[i] = x0 * cs[i] - x1 * sn[i];
                                p[i + half] = x1 * cs[i + half] + x0 * sn[i + half];
                            }
                        if (part > 0) {
                            T* cache = (part == 1 ? kc : vc) + (((size_t)r * KV + head) * CAP + past + t) * HD;
                            for (int i = 0; i < HD; i++) store(cache + i, p[i]);
                        }
                    }
                }
            }
#pragma omp barrier
            // attention: each (row, token, key/value head) with its group of query heads, over the slots it sees; the
            // units dealt out in turn, as later tokens of a prompt see more slots
            for (int unit = me; unit < N * KV; unit += threads) {
                const int n = unit / KV, g = unit % KV, r = n / W, t = n % W;
                const uint8_t* allow = c->allowed ? c->allowed + ((size_t)r * W + t) * CAP : nullptr;
                const int64_t last = allow ? seen_max : past + t + 1;
                const T* kr = kc + ((size_t)r * KV + g) * CAP * HD;
                const T* vr = vc + ((size_t)r * KV + g) * CAP * HD;
                for (int j = 0; j < G; j++) {
                    const float* qh = &q[(size_t)n * QD + (g * G + j) * HD];
                    T* dst = att.data() + (size_t)n * QD + (g * G + j) * HD;
                    if (HD == 64) attend<64>(qh, kr, vr, HD, last, allow, scale, sc, dst);
                    else if (HD == 128) attend<128>(qh, kr, vr, HD, last, allow, scale, sc, dst);
                    else attend<0>(qh, kr, vr, HD, last, allow, scale, sc, dst);
                }
            }
#pragma omp barrier
            // the attention's output projection, added to the residual by the thread that computed it
            share(D, 8, &o0, &o1);
            product(att.data(), N, QD, wtype, Mat{lw[WO], lw[SO]}, QD, o0, o1, sum.data() + o0, D);
            for (int n = 0; n < N; n++)
                for (int o = o0; o < o1; o++) h[(size_t)n * D + o] += sum[(size_t)n * D + o];
#pragma omp barrier
            // the MLP: silu(gate) * up of this thread's rows, then the down projection
            rmsnorm_rows(h.data(), 0, N, D, (const T*)lw[NORM_POST], m->eps, xn);
            share(I, 8, &o0, &o1);
            product(xn, N, D, wtype, Mat{lw[WG], lw[SG]}, D, o0, o1, gate.data() + o0, I);
            product(xn, N, D, wtype, Mat{lw[WU], lw[SU]}, D, o0, o1, up.data() + o0, I);
            for (int n = 0; n < N; n++) {
                float *gn = &gate[(size_t)n * I], *un = &up[(size_t)n * I];
                std::vector<float>& e = expbuf[me];
                for (int o = o0; o < o1; o++) e[o - o0] = -gn[o];
                exp_inplace(e.data(), o1 - o0);
                for (int o = o0; o < o1; o++) store(&act[(size_t)n * I + o], gn[o] / (1.f + e[o - o0]) * un[o]);
            }
#pragma omp barrier
            share(D, 8, &o0, &o1);
            product(act.data(), N, I, wtype, Mat{lw[WD], lw[SD]}, I, o0, o1, sum.data() + o0, D);
            for (int n = 0; n < N; n++)
                for (int o = o0; o < o1; o++) h[(size_t)n * D + o] += sum[(size_t)n * D + o];
#pragma omp barrier
        }
        // the last `keep` tokens of each row: final norm, then the logits
        for (int i = 0; i < R * keep; i++) {
            const int r = i / keep, t = W - keep + i % keep;
            rmsnorm_rows(h.data() + ((size_t)r * W + t) * D, 0, 1, D, (const T*)m->final_norm, m->eps,
                         xn + (size_t)i * D);
        }
        share(V, 8, &o0, &o1);
        product(xn, R * keep, D, wtype, Mat{m->lm_head, m->lm_head_scale}, D, o0, o1, c->logits + o0, V);
    }
    return 0;
}

extern "C" {

int dk_forward(const DkModel* m, const DkCall* c) {
    return m->dtype == 1 ? forward<bf16>(m, c) : forward<float>(m, c);
}

int dk_vectorized(void) { return DK_AVX512 ? 512 : DK_AVX2 ? 256 : 0; }  // (the vector width of the products)

// y [N, O] float32 = x [N, K] . w [O, K]: the step's product alone. dtype: x's (1 bfloat16, 0 float32); wtype: w's
// (the same, or 2: int8 with `scale` [O] bfloat16).
int dk_linear(const void* x, int64_t N, int64_t K, const void* w, const void* scale, int64_t O, float* y,
              int64_t dtype, int64_t wtype, int64_t threads) {
#pragma omp parallel num_threads((int)threads)
    {
        int o0, o1;
        share((int)O, 8, &o0, &o1);
        if (dtype == 1) product((const bf16*)x, (int)N, K, (int)wtype, Mat{w, scale}, (int)K, o0, o1, y + o0, (int)O);
        else product((const float*)x, (int)N, K, (int)wtype, Mat{w, scale}, (int)K, o0, o1, y + o0, (int)O);
    }
    return 0;
}

}  // extern "C"
