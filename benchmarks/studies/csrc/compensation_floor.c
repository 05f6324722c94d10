/* How cheap can staleness compensation get on this CPU? Hand-vectorized AVX2 + FMA variants of
 * rp_engine's fused step (optim/csrc/publish.c, rp_adam_bf16 with AdamW), each one pass per
 * block over the same arrays, so that benchmarks/studies/compensation_floor.py can time, side by
 * side with DeepSpeed's adam_update + cast ("off"):
 *
 *   la 0: no look-ahead (the cast of the new masters), 1: the look-ahead to ~23 bits (what the
 *         engine computes), 2: the look-ahead with the raw 12-bit rsqrt / rcp (below the
 *         issue's "to fp32 rounding": a floor, not a candidate), 3: a cheaper method, not the
 *         engine's: the look-ahead's m' over the denominator Adam has just used, sqrt(v) bc2 +
 *         eps, instead of the one of v' (one reciprocal shared by the update and the
 *         prediction, no second square root). Under a constant gradient it is still exactly
 *         the next step (v_hat does not move then), but it is not validated for convergence;
 *   dc 0: no delay compensation, 1: the compensation to ~23 bits, 2: its sqrt raw (12 bits);
 *   la 4, the stream: the same bytes moved (g, w, m, v and the read weights in; w, m, v and the compute
 *         weights out) with no arithmetic to speak of: the memory floor of the fused pass.
 *
 * The Adam update itself is always DeepSpeed's formula to ~23 bits, as rp_adam_*. Only bf16
 * compute weights; the slice and the block must be multiples of 8 elements (the Python side
 * checks). A benchmark, not engine code: nothing in rp_engine calls it.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef __m256 V;
#define S(x) _mm256_set1_ps(x)
#define SUB 1024 /* elements per float partial sum of the norms, as publish.c */

static inline V sqrt23(V x) { /* rsqrt + one Newton step; 0 -> 0 */
    V r = _mm256_rsqrt_ps(_mm256_max_ps(x, S(FLT_MIN)));
    V s = _mm256_mul_ps(x, r);
    V e = _mm256_fnmadd_ps(s, _mm256_mul_ps(r, S(0.5f)), S(0.5f));
    return _mm256_fmadd_ps(s, e, s);
}
static inline V sqrt12(V x) { return _mm256_mul_ps(x, _mm256_rsqrt_ps(_mm256_max_ps(x, S(FLT_MIN)))); }
static inline V div23(V a, V b) { /* rcp + one Markstein step */
    V y = _mm256_rcp_ps(b), q = _mm256_mul_ps(a, y);
    return _mm256_fmadd_ps(_mm256_fnmadd_ps(b, q, a), y, q);
}
static inline V div12(V a, V b) { return _mm256_mul_ps(a, _mm256_rcp_ps(b)); }

static inline __m128i to_bf16(V x) { /* round to nearest even; NaN -> 0x7fc0, as torch */
    __m256i b = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline V widen(const uint16_t *p) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
static inline double hsum(V x) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

typedef struct {
    float vcoef, deps, h;                              /* the compensation (publish.c) */
    float b1, b2, step_size, bc2, eps, w_decay;        /* AdamW, DeepSpeed's folding */
    float pdecay, pcoef, peps;                         /* the look-ahead's next step */
    float pstep;                                       /* la 3: its -lr / (1 - b1^(t+1)) */
} Terms;

static _Thread_local float *scratch = NULL;
static _Thread_local int64_t scratch_len = 0;

static inline __attribute__((always_inline)) int block(const float *g, float *w, float *m,
                                                      float *v, uint16_t *out, int64_t len,
                                                      const Terms *t, int la, int dc,
                                                      double *part) {
    const float *src = g;
    float r = 1.0f;
    if (dc) {
        if (scratch_len < len) {
            free(scratch);
            scratch = aligned_alloc(64, (size_t)len * sizeof(float));
            scratch_len = scratch == NULL ? 0 : len;
            if (scratch == NULL) return -1;
        }
        double bg = 0.0, bc = 0.0, bw = 0.0;
        V vh = S(t->vcoef * t->h), eh = S(t->deps * t->h);
        for (int64_t s = 0; s < len; s += SUB) {
            int64_t e = s + SUB < len ? s + SUB : len;
            V fg = S(0.0f), fc = S(0.0f), fw = S(0.0f);
            for (int64_t i = s; i < e; i += 8) {
                V gi = _mm256_loadu_ps(g + i), wi = _mm256_loadu_ps(w + i);
                V vi = _mm256_loadu_ps(v + i);
                V f = _mm256_fmadd_ps(dc == 2 ? sqrt12(vi) : sqrt23(vi), vh, eh);
                V ci = _mm256_fmadd_ps(f, _mm256_sub_ps(wi, widen(out + i)), gi);
                fg = _mm256_fmadd_ps(gi, gi, fg);
                fc = _mm256_fmadd_ps(ci, ci, fc);
                fw = _mm256_fmadd_ps(wi, wi, fw);
                _mm256_store_ps(scratch + i, ci);
            }
            bg += hsum(fg);
            bc += hsum(fc);
            bw += hsum(fw);
        }
        part[0] += bg;
        part[1] += bc;
        part[2] += bw;
        r = t->h == 0.0f ? 1.0f : bc > 0.0 ? (float)sqrt(bg / bc) : 1.0f;
        src = scratch;
    }
    V vr = S(r), b1 = S(t->b1), b2 = S(t->b2), nb1 = S(1.0f - t->b1), nb2 = S(1.0f - t->b2);
    V step = S(t->step_size), bc2 = S(t->bc2), eps = S(t->eps), wd = S(t->w_decay);
    V pd = S(t->pdecay), pc = S(t->pcoef), pe = S(t->peps);
    for (int64_t i = 0; i < len; i += 8) {
        V gi = _mm256_mul_ps(_mm256_loadu_ps(src + i), vr), wi = _mm256_loadu_ps(w + i);
        V mi = _mm256_fmadd_ps(gi, nb1, _mm256_mul_ps(_mm256_loadu_ps(m + i), b1));
        V g2 = _mm256_mul_ps(gi, gi);
        V vi = _mm256_fmadd_ps(g2, nb2, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
        V den = _mm256_fmadd_ps(sqrt23(vi), bc2, eps);
        V inv = la == 3 ? div23(S(1.0f), den) : S(0.0f);
        V u = la == 3 ? _mm256_mul_ps(mi, inv) : div23(mi, den);
        wi = _mm256_fmadd_ps(u, step, _mm256_fmadd_ps(wi, wd, wi));
        _mm256_storeu_ps(w + i, wi);
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        V o = wi;
        if (la) { /* the next step's moments for a repeat of this gradient, then its step */
            V m1 = _mm256_fmadd_ps(gi, nb1, _mm256_mul_ps(mi, b1));
            V v1 = _mm256_fmadd_ps(g2, nb2, _mm256_mul_ps(vi, b2));
            V q;
            if (la == 3)
                q = _mm256_mul_ps(S(t->pstep), _mm256_mul_ps(m1, inv));
            else if (la == 2)
                q = _mm256_mul_ps(pc, div12(m1, _mm256_add_ps(sqrt12(v1), pe)));
            else
                q = _mm256_mul_ps(pc, div23(m1, _mm256_add_ps(sqrt23(v1), pe)));
            o = _mm256_fmadd_ps(pd, wi, q);
        }
        _mm_storeu_si128((__m128i *)(out + i), to_bf16(o));
    }
    return 0;
}

/* The memory floor: every byte the fused compensated step moves, next to no arithmetic. */
static void stream(const float *g, float *w, float *m, float *v, uint16_t *out, int64_t len) {
    for (int64_t i = 0; i < len; i += 8) {
        V gi = _mm256_loadu_ps(g + i), wi = _mm256_add_ps(_mm256_loadu_ps(w + i), widen(out + i));
        _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gi));
        _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gi));
        _mm256_storeu_ps(w + i, wi);
        _mm_storeu_si128((__m128i *)(out + i), to_bf16(wi));
    }
}

#define CASE(LA, DC)                                                                            \
    case LA * 3 + DC:                                                                           \
        failed |= block(g + lo, w + lo, m + lo, v + lo, out + lo, hi - lo, t, LA, DC, p) != 0;  \
        break;

/* One slice of n elements in blocks of `blk` over the OpenMP threads (static, as publish.c).
 * la, dc: the variant (above); la = 4: the memory stream. Returns 0, -1 on a failed scratch. */
int floor_step(const float *g, float *w, float *m, float *v, uint16_t *out, int64_t n,
               int64_t blk, int la, int dc, const Terms *t, double *sums) {
    double sg = 0.0, sc = 0.0, sw = 0.0;
    int failed = 0;
    int64_t blocks = (n + blk - 1) / blk;
#pragma omp parallel for schedule(static) reduction(+ : sg, sc, sw) reduction(| : failed)
    for (int64_t k = 0; k < blocks; k++) {
        int64_t lo = k * blk, hi = lo + blk < n ? lo + blk : n;
        double p[3] = {0.0, 0.0, 0.0};
        if (la == 4) {
            stream(g + lo, w + lo, m + lo, v + lo, out + lo, hi - lo);
            continue;
        }
        switch (la * 3 + dc) { /* each variant inlined with its constants */
            CASE(0, 0) CASE(0, 1) CASE(0, 2) CASE(1, 0) CASE(1, 1) CASE(1, 2) CASE(2, 0)
            CASE(2, 1) CASE(2, 2) CASE(3, 0) CASE(3, 1) CASE(3, 2)
        }
        sg += p[0];
        sc += p[1];
        sw += p[2];
    }
    sums[0] += sg;
    sums[1] += sc;
    sums[2] += sw;
    return failed ? -1 : 0;
}
