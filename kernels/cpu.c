/* The generation engine's two CPU kernels (loaded by kernels/cpu.py through ctypes; no Python or torch headers).

   cache_attention: each query token attends over its own slot's KV cache columns 0..pos, no further: a decode row
   reads only its own span (a batched product over the longest live row's span reads every row that far) and a
   prompt with a cached prefix needs no mask. vLLM's CPU decode kernel reads its blocks the same way.

   far_candidates: the sampler's candidate tokens (model/sampler.py, _c_draw): each row's largest logit, then the
   32-bit hash of every vocabulary id and the two compares in one pass, in registers, where eager torch makes
   eleven passes at T > 0.5 and a partial sort at T 0.1.

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

/* exp(x) for x <= 0 (a softmax's shifted scores): Cephes' expf, within 2 ulp; exp(-inf) and anything below -87.3
   gives 0 (the scale 2^k built from k + 127 <= 0 is 0). */
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

/* One token's G query heads (q [G][d]) over columns 0..L-1 of one kv head's cache (K, V [cols][d]) -> o [G][d].
   s: scratch of G * round8(L) floats. */
static void attend(const float *q, const float *K, const float *V, int64_t L, int64_t G, int64_t d, float scale,
                   float *s, float *o) {
    const int64_t Lp = (L + 7) & ~(int64_t)7;
    for (int64_t c = 0; c < L; c++) {
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
        for (int64_t j = 0; j < d; j += 8) {
            v8 acc = {};
            for (int64_t c = 0; c < L; c++) acc += sg[c] * ld(V + c * d + j);
            st(og + j, acc * inv);
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

/* lowbias32, C. Wellons' integer hash (model/sampler.py's hash32_i32), on 8 words at once. */
typedef uint32_t v8u __attribute__((vector_size(32)));
static inline v8u hash32(v8u x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* Each row's candidates (model/sampler.py, _c_draw): the (row, id) pairs, in row-major order,
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
