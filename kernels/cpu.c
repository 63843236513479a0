/* The generation engine's CPU kernels (loaded by kernels/cpu.py through ctypes; no Python or torch headers).

   cache_attention: each query token attends over its own slot's KV cache columns 0..pos, no further: a decode row
   reads only its own span (a batched product over the longest live row's span reads every row that far) and a
   prompt with a cached prefix needs no mask. vLLM's CPU decode kernel reads its blocks the same way.

   far_candidates: the sampler's candidate tokens (engine/sampler.py, _c_draw): each row's largest logit, then the
   32-bit hash of every vocabulary id and the two compares in one pass, in registers, where eager torch makes
   eleven passes at T > 0.5 and a partial sort at T 0.1.

   rms_norm, rope, silu_mul: the decoder block's elementwise work, one pass each where eager torch makes 5-10 (the
   three vLLM's CPU backend fuses too).

   Float results are the same on every CPU and compiler: vector code through GCC/Clang vector extensions, which are
   lane-wise IEEE operations in the order written here (built with -ffp-contract=off, never -ffast-math), and an exp
   of our own rather than the C library's. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }
static inline v8 vmax(v8 a, v8 b) { v8i m = a > b; return (v8)((m & (v8i)a) | (~m & (v8i)b)); }
static inline float hmax(v8 a) {
    float m = a[0];
    for (int i = 1; i < 8; i++) m = a[i] > m ? a[i] : m;
    return m;
}

/* exp(x) for x <= 0 (a softmax's shifted scores): Cephes' expf, within 2 ulp down to -87.3; below that (and for -inf)
   the argument is clamped to -87.3, giving ~1.2e-38 rather than 0 (a softmax's masked columns and silu's far negative
   tail are off by less than 1e-35). */
static inline v8 exp_neg(v8 x) {
    const v8 lo = (v8){} - 87.3f, one = (v8){} + 1.0f;
    x = vmax(x, lo);
    v8 fx = x * 1.44269504088896341f + 0.5f;
    v8 t = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);  /* truncation, then floor: */
    fx = t - (v8)((v8i)(t > fx) & (v8i)one);
    x = x - fx * 0.693359375f;
    x = x - fx * -2.12194440e-4f;
    v8 z = x * x;
    v8 y = (v8){} + 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    v8i e = __builtin_convertvector(fx, v8i) + 127;
    e &= e > 0;  /* (a compare's true is all ones) */
    return y * (v8)(e << 23);
}

/* hsum of each of a[0..7], lane i of the result = hsum(a[i]), summed in hsum's order: lanes (j, j + 4), then
   (j, j + 2) of those, then adjacent ones. 21 shuffles and adds where eight hsums take 56 lane operations. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  /* GCC before 12: the same lanes through __builtin_shuffle */
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif
static inline v8 hsum8(const v8 *a) {
    v8 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        c[i] = SHUF(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               SHUF(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUF(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUF(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* o = inv * sum_c w[c] V[c] over columns 0..L-1 (V [cols][d]), each lane summed in column order; one pass over V. */
static inline __attribute__((always_inline)) void weigh(const float *w, const float *V, int64_t L, int64_t d,
                                                        float inv, float *o) {
    v8 acc[16];
    for (int64_t j0 = 0; j0 < d; j0 += 128) {  /* 16 accumulators at a time */
        const int64_t m = d - j0 < 128 ? (d - j0) / 8 : 16;
        for (int64_t j = 0; j < m; j++) acc[j] = (v8){};
        for (int64_t c = 0; c < L; c++) {
            const v8 wc = (v8){} + w[c];
            for (int64_t j = 0; j < m; j++) acc[j] += wc * ld(V + c * d + j0 + 8 * j);
        }
        for (int64_t j = 0; j < m; j++) st(o + j0 + 8 * j, acc[j] * inv);
    }
}

/* One token's G query heads (q [G][d]) over columns 0..L-1 of one kv head's cache (K, V [cols][d]) -> o [G][d].
   s: scratch of G * round8(L) floats. The scores eight columns at a time (hsum8), the same floats as one by one. */
static void attend(const float *q, const float *K, const float *V, int64_t L, int64_t G, int64_t d, float scale,
                   float *s, float *o) {
    const int64_t Lp = (L + 7) & ~(int64_t)7;
    int64_t c = 0;
    for (; c + 8 <= L; c += 8) {
        for (int64_t g = 0; g < G; g++) {
            v8 acc[8] = {};
            for (int64_t j = 0; j < d; j += 8) {
                const v8 qj = ld(q + g * d + j);
                for (int u = 0; u < 8; u++) acc[u] += qj * ld(K + (c + u) * d + j);
            }
            st(s + g * Lp + c, hsum8(acc) * scale);
        }
    }
    for (; c < L; c++) {
        const float *kc = K + c * d;
        for (int64_t g = 0; g < G; g++) {
            v8 acc = {};
            for (int64_t j = 0; j < d; j += 8) acc += ld(q + g * d + j) * ld(kc + j);
            s[g * Lp + c] = hsum(acc) * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * Lp, *og = o + g * d;
        for (int64_t c = L; c < Lp; c++) sg[c] = -INFINITY;
        v8 mv = ld(sg);
        for (int64_t c = 8; c < Lp; c += 8) { v8 x = ld(sg + c); mv = vmax(x, mv); }
        const float m = hmax(mv);
        v8 sum = {};
        for (int64_t c = 0; c < Lp; c += 8) {
            v8 e = exp_neg(ld(sg + c) - m);
            st(sg + c, e);
            sum += e;
        }
        const float inv = 1.0f / hsum(sum);
        switch (d) {  /* a constant d keeps the accumulators in registers */
        case 32: weigh(sg, V, L, 32, inv, og); break;
        case 64: weigh(sg, V, L, 64, inv, og); break;
        case 128: weigh(sg, V, L, 128, inv, og); break;
        default: weigh(sg, V, L, d, inv, og);
        }
    }
}

/* q, out [n][hq][d]; kc, vc [slots][hkv][cols][d] (one layer's cache); token i attends over columns 0..pos[i] of
   slot slot[i]. d a multiple of 8, hq a multiple of hkv (query head h reads kv head h / (hq / hkv)). Returns 0, or
   -1 when scratch memory could not be had. */
int cache_attention(const float *q, const float *kc, const float *vc, const int64_t *slot, const int64_t *pos,
                    int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t cols, float scale, float *out,
                    int threads) {
    const int64_t G = hq / hkv;
    int64_t longest = 1;
    for (int64_t i = 0; i < n; i++) longest = pos[i] + 1 > longest ? pos[i] + 1 : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|| : failed)
    {
        float *s = malloc(sizeof(float) * G * ((longest + 7) & ~(int64_t)7));
        failed = s == NULL;
#pragma omp for schedule(dynamic, 4)
        for (int64_t t = 0; t < n * hkv; t++) {
            if (failed) continue;
            const int64_t i = t / hkv, h = t % hkv, at = (slot[i] * hkv + h) * cols * d;
            attend(q + (i * hq + h * G) * d, kc + at, vc + at, pos[i] + 1, G, d, scale, s,
                   out + (i * hq + h * G) * d);
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* lowbias32, C. Wellons' integer hash (engine/sampler.py's hash32_i32), on 8 words at once. */
typedef uint32_t v8u __attribute__((vector_size(32)));
static inline v8u hash32(v8u x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* Each row's candidates (engine/sampler.py, _c_draw): the (row, id) pairs, in row-major order,
   with hash32(row_hash[r] ^ id) >= floor or logits[r][id] >= near[r], written to r_out, j_out (room for `room` pairs);
   scratch [n][vocab] int32, count [n]. Returns how many there are (more than room: only room are written).
   near NULL: each row's own, from its largest logit's drawn score, logit / T + -log(-log(u)) (any token's score is a
   lower bound on the winner's), as _logit_floor lowers it by far_d: the sampler's near up to an ulp of a log, well
   inside the margin _logit_floor leaves, so the candidates hold every token that can win, and the tokens are the
   same. A row with a NaN gets NaN (no logit compares), as torch's argmax makes it. */
int64_t far_candidates(const float *logits, const uint32_t *row_hash, const float *near, double temperature,
                       double far_d, uint32_t floor, int64_t n, int64_t vocab, int32_t *scratch, int64_t *count,
                       int64_t *r_out, int64_t *j_out, int64_t room, int threads) {
    const v8u iota = {0, 1, 2, 3, 4, 5, 6, 7};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float *lr = logits + r * vocab;
        float nr;
        if (near) {
            nr = near[r];
        } else {
            int64_t j = 0;
            float m = -INFINITY;
            int nan = 0;
            if (vocab >= 8) {
                v8 mv = ld(lr);
                v8i bad = mv != mv;
                for (j = 8; j + 8 <= vocab; j += 8) { v8 x = ld(lr + j); mv = vmax(x, mv); bad |= x != x; }
                m = hmax(mv);
                for (int l = 0; l < 8; l++) nan |= bad[l];
            }
            for (; j < vocab; j++) { nan |= lr[j] != lr[j]; m = lr[j] > m ? lr[j] : m; }
            int64_t top = 0;
            while (top < vocab && lr[top] != m) top++;
            if (nan || top == vocab) {
                nr = NAN;
            } else {
                v8u h = hash32((v8u){} + (row_hash[r] ^ (uint32_t)top));
                double u = ((double)h[0] + 0.5) * 0x1p-32;
                double best = (double)m / temperature + -log(-log(u));
                nr = (float)((best - far_d) * temperature);
                nr -= fabsf(nr) * 1e-6f + 1e-6f;
            }
        }
        int32_t *out = scratch + r * vocab;
        int64_t k = 0, j = 0;
        for (; j + 8 <= vocab; j += 8) {  /* a hit is rare (a few dozen per row at T 1): test 8 at once */
            v8i hit = (v8i)(hash32(row_hash[r] ^ (iota + (uint32_t)j)) >= floor) | (ld(lr + j) >= nr);
            if (hit[0] | hit[1] | hit[2] | hit[3] | hit[4] | hit[5] | hit[6] | hit[7])
                for (int l = 0; l < 8; l++)
                    if (hit[l]) out[k++] = (int32_t)(j + l);
        }
        for (; j < vocab; j++) {
            v8u h = hash32((v8u){} + (row_hash[r] ^ (uint32_t)j));
            if (h[0] >= floor || lr[j] >= nr) out[k++] = (int32_t)j;
        }
        count[r] = k;
    }
    int64_t total = 0;
    for (int64_t r = 0; r < n; r++) {
        for (int64_t k = 0; k < count[r] && total + k < room; k++) {
            r_out[total + k] = r;
            j_out[total + k] = scratch[r * vocab + k];
        }
        total += count[r];
    }
    return total;
}

/* ---- the decoder block's elementwise work, one pass each (the engine's and model/logprobs.py's forwards) ---- */

/* out[t] = w * (x[t] * r), r = 1 / sqrt(mean(x[t]^2) + eps), each x[t] of h floats (h a multiple of 8): the order of
   model/transformer.py's RMSNorm, its mean summed lane-wise then by hsum. */
void rms_norm(const float *x, const float *w, int64_t n, int64_t h, float eps, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const float *xt = x + t * h;
        v8 ss = {};
        for (int64_t j = 0; j < h; j += 8) { v8 v = ld(xt + j); ss += v * v; }
        const float r = 1.0f / sqrtf(hsum(ss) / (float)h + eps);
        for (int64_t j = 0; j < h; j += 8) st(out + t * h + j, ld(w + j) * (ld(xt + j) * r));
    }
}

/* Rotary embedding of n tokens' heads: x [n] rows of `heads` heads of d floats, row t at x + t * stride; cos, sin
   [n][d]; out [n][heads][d]. out = x * cos + rotate_half(x) * sin as model/transformer.py's apply_rope rounds it
   (-(a * b) is (-a) * b exactly). d a multiple of 16. */
void rope(const float *x, int64_t stride, const float *cos_, const float *sin_, int64_t n, int64_t heads, int64_t d,
          float *out, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos_ + t * d, *s = sin_ + t * d;
        for (int64_t hh = 0; hh < heads; hh++) {
            const float *xh = x + t * stride + hh * d;
            float *o = out + (t * heads + hh) * d;
            for (int64_t j = 0; j < half; j += 8) {
                const v8 a = ld(xh + j), b = ld(xh + half + j);
                st(o + j, a * ld(c + j) - b * ld(s + j));
                st(o + half + j, b * ld(c + half + j) + a * ld(s + half + j));
            }
        }
    }
}

/* out[t] = silu(g) * u for each row [g | u] of gu [n][2m]: silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) (exp_neg
   takes no positive argument). m a multiple of 8. */
void silu_mul(const float *gu, int64_t n, int64_t m, float *out, int threads) {
    const v8 one = (v8){} + 1.0f;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const float *g = gu + t * 2 * m, *u = g + m;
        for (int64_t j = 0; j < m; j += 8) {
            const v8 x = ld(g + j);
            const v8i neg = x < 0;
            const v8 ax = (v8)((v8i)x & ((v8i){} + 0x7fffffff)), e = exp_neg(-ax);
            const v8 sig = (v8)((neg & (v8i)(e / (one + e))) | (~neg & (v8i)(one / (one + e))));
            st(out + t * m + j, (x * sig) * ld(u + j));
        }
    }
}
