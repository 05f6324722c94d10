/* Publishing kernels: the fp32 masters (and, for weight prediction, Adam's moments) written
 * into the compute weights an iteration reads, in one pass that a compiler vectorizes.
 *
 * Called from Python through ctypes (rp_engine/optim/publish_kernel.py) on flat, contiguous
 * slices, right after DeepSpeed's CPU Adam has stepped the same slice, while it is still in the
 * CPU's caches. Compiled with -O3 -march=native at the CPU's widest vectors and with the
 * reciprocal approximations (-mrecip, one Newton step: ~23 bits): the prediction's step term
 * lr * m / (sqrt(v) + eps) is a small correction to w, so its last bits are far below the
 * rounding of the result (publish_kernel.py, _CFLAGS).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

/* Slices this long are split over the OpenMP threads in contiguous parts (a static schedule,
 * as DeepSpeed's Adam splits a slice, so each thread mostly reads what its own core has just
 * stepped); shorter ones are not worth waking the threads for. */
#define PARALLEL_MIN 65536
#define OMP(x) _Pragma(#x) /* a pragma spread over lines inside a macro */

/* fp32 -> bf16, round to nearest even; NaN becomes torch's canonical 0x7fc0. */
static inline uint16_t to_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return (b & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded; /* as torch */
}

/* fp32 -> fp16, round to nearest even (the hardware's conversion, and torch's, bit for bit:
 * checked over all 2^32 inputs; NaN becomes 0x7e00 with its sign, as torch's). Integer
 * operations, because gcc 12 has no vector type for _Float16 without AVX512-FP16: a loop of
 * `(_Float16)x` stays scalar, and the fp16 fused step ran 5x slower than the bf16 one. Values
 * below 2^-14 (fp16 subnormals) round through the FPU: adding 0.5 puts the fp16 subnormal ulp,
 * 2^-24, at the float's last bit. */
static inline uint16_t to_f16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t sign = (u >> 16) & 0x8000u, o;
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) /* 2^16 and above: inf; NaN */
        o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    else if (u < 0x38800000u) { /* below 2^-14 */
        float t;
        memcpy(&t, &u, sizeof t);
        t += 0.5f;
        uint32_t b;
        memcpy(&b, &t, sizeof b);
        o = b - 0x3f000000u;
    } else /* rebias the exponent by (15 - 127) << 23, round the 13 dropped bits to even */
        o = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
    return (uint16_t)(o | sign);
}

/* fp16 -> fp32, exact (all 65536 inputs checked against the hardware's), vectorizable. */
static inline float widen_f16(uint16_t h) {
    uint32_t em = h & 0x7fffu, b = em << 13;
    if (em >= 0x7c00u) /* inf, NaN */
        b |= 0x7f800000u;
    else if (em >= 0x0400u) /* normal: rebias the exponent by (127 - 15) << 23 */
        b += 0x38000000u;
    else { /* subnormal or zero: em * 2^-24, exact in fp32 */
        float t = (float)em * 0x1p-24f;
        memcpy(&b, &t, sizeof b);
    }
    b |= (uint32_t)(h & 0x8000u) << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* out = w as bf16 */
void rp_copy_bf16(const float *restrict w, uint16_t *restrict out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(w[i]);
}

/* out = w as fp16: with F16C eight at a time by the hardware's conversion (a third of the time
 * of to_f16's integer loop, which the kernels below use because it vectorizes with the rest of
 * their loop), the tail and CPUs without F16C by to_f16: the same bits either way. */
void rp_copy_f16(const float *restrict w, uint16_t *restrict out, int64_t n) {
#ifdef __F16C__
    int64_t vec = n / 8 * 8;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < vec; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(w + i), _MM_FROUND_TO_NEAREST_INT));
    for (int64_t i = vec; i < n; i++) out[i] = to_f16(w[i]);
#else
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = to_f16(w[i]);
#endif
}

/* One Adam step along the moments: decay * w + coef * m / (sqrt(v) + eps), where the caller
 * folds the bias corrections into coef and eps (optimizer.py, ``predict_into``). */
static inline float predicted(float w, float m, float v, float decay, float coef, float eps) {
    return decay * w + coef * m / (sqrtf(v) + eps);
}

void rp_predict_bf16(const float *restrict w, const float *restrict m, const float *restrict v,
                     uint16_t *restrict out, int64_t n, float decay, float coef, float eps) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(predicted(w[i], m[i], v[i], decay, coef, eps));
}

void rp_predict_f16(const float *restrict w, const float *restrict m, const float *restrict v,
                    uint16_t *restrict out, int64_t n, float decay, float coef, float eps) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++)
        out[i] = to_f16(predicted(w[i], m[i], v[i], decay, coef, eps));
}

void rp_predict_f32(const float *restrict w, const float *restrict m, const float *restrict v,
                    float *restrict out, int64_t n, float decay, float coef, float eps) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = predicted(w[i], m[i], v[i], decay, coef, eps);
}

/* Look-ahead prediction: the step after the one just applied, for a gradient equal to the one
 * it applied (g, after unscale and clipping; plus l2 * w with Adam's L2 decay): the next
 * moments m' = b1 m + (1 - b1) g, v' = b2 v + (1 - b2) g^2, then decay * w + coef * m' /
 * (sqrt(v') + eps), with the next step's bias corrections folded into coef and eps. */
static inline float looked_ahead(float w, float g, float m, float v, float decay, float b1,
                                 float b2, float coef, float eps, float l2) {
    float gg = g + l2 * w;
    float m1 = b1 * m + (1.0f - b1) * gg;
    float v1 = b2 * v + (1.0f - b2) * gg * gg;
    return decay * w + coef * m1 / (sqrtf(v1) + eps);
}

#define LOOKAHEAD(suffix, type, convert)                                                        \
    void rp_lookahead_##suffix(const float *restrict w, const float *restrict g,                \
                               const float *restrict m, const float *restrict v,                \
                               type *restrict out, int64_t n, float decay, float b1, float b2,  \
                               float coef, float eps, float l2) {                               \
        _Pragma("omp parallel for schedule(static) if (n >= PARALLEL_MIN)")                     \
        for (int64_t i = 0; i < n; i++)                                                         \
            out[i] = convert(looked_ahead(w[i], g[i], m[i], v[i], decay, b1, b2, coef, eps, l2)); \
    }

#define AS_F32(x) (x)
LOOKAHEAD(bf16, uint16_t, to_bf16)
LOOKAHEAD(f16, uint16_t, to_f16)
LOOKAHEAD(f32, float, AS_F32)

/* Delay compensation of a slice's gradient, right before its Adam step: the gradient g
 * (unscaled and clipped) was taken at the compute weights `read` the iteration read, and is
 * applied at the masters w. With the fix f = (sqrt(v) * vcoef + eps) * h * (w - read) (Adam's
 * denominator over the tensor's scale, h folding 1 / (rho rms(w)) and the clip coefficient),
 * each block of `block` elements becomes (g + f) |g| / |g + f|: the compensated direction at
 * the raw gradient's norm (optim/delay_compensation.py). delay_block writes g + f of one block
 * into c (c may be the block of g itself) and returns the block's ratio |g| / |g + f|; part[0..2]
 * gain its sums of g^2, (g + f)^2 and w^2. With h = 0 c is g bit for bit and the ratio 1. */
#define SUB 1024 /* elements per float partial sum of the norms */

static inline float widen_bf16(uint16_t x) {
    uint32_t b = (uint32_t)x << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

#define DELAY(suffix, type, widen)                                                              \
    static inline float delay_block_##suffix(const float *g, const float *restrict w,           \
                                             const float *restrict v,                           \
                                             const type *restrict read, int64_t lo, int64_t hi, \
                                             float vcoef, float eps, float h, float *c,         \
                                             double *restrict part) {                           \
        double bg = 0.0, bc = 0.0, bw = 0.0;                                                    \
        /* float sums over runs of SUB elements (vectorized), added up in double */             \
        for (int64_t s = lo; s < hi; s += SUB) {                                                \
            int64_t e = s + SUB < hi ? s + SUB : hi;                                            \
            float fg = 0.0f, fc = 0.0f, fw = 0.0f;                                              \
            for (int64_t i = s; i < e; i++) {                                                   \
                float gi = g[i], wi = w[i];                                                     \
                float ci = gi + (sqrtf(v[i]) * vcoef + eps) * h * (wi - widen(read[i]));        \
                fg += gi * gi;                                                                  \
                fc += ci * ci;                                                                  \
                fw += wi * wi;                                                                  \
                c[i - lo] = ci;                                                                 \
            }                                                                                   \
            bg += fg;                                                                           \
            bc += fc;                                                                           \
            bw += fw;                                                                           \
        }                                                                                       \
        part[0] += bg;                                                                          \
        part[1] += bc;                                                                          \
        part[2] += bw;                                                                          \
        /* h = 0 leaves g as it is (c == g, to the bit; the sums could round apart) */         \
        return h == 0.0f ? 1.0f : bc > 0.0 ? (float)sqrt(bg / bc) : 1.0f;                      \
    }                                                                                           \
                                                                                                \
    /* The compensation alone, in place on g (the reference of rp_adam_*'s, tested) */         \
    void rp_delay_##suffix(float *restrict g, const float *restrict w, const float *restrict v, \
                           const type *restrict read, int64_t n, int64_t block, float vcoef,    \
                           float eps, float h, double *restrict sums) {                         \
        double sg = 0.0, sc = 0.0, sw = 0.0;                                                    \
        int64_t blocks = (n + block - 1) / block;                                               \
        _Pragma("omp parallel for schedule(static) reduction(+ : sg, sc, sw) if (n >= PARALLEL_MIN)") \
        for (int64_t k = 0; k < blocks; k++) {                                                  \
            int64_t lo = k * block, hi = lo + block < n ? lo + block : n;                       \
            double part[3] = {0.0, 0.0, 0.0};                                                   \
            float r = delay_block_##suffix(g, w, v, read, lo, hi, vcoef, eps, h, g + lo, part); \
            if (r != 1.0f)                                                                      \
                for (int64_t i = lo; i < hi; i++) g[i] *= r;                                    \
            sg += part[0];                                                                      \
            sc += part[1];                                                                      \
            sw += part[2];                                                                      \
        }                                                                                       \
        sums[0] += sg;                                                                          \
        sums[1] += sc;                                                                          \
        sums[2] += sw;                                                                          \
    }

#define WIDEN_F32(x) (x)
DELAY(bf16, uint16_t, widen_bf16)
DELAY(f16, uint16_t, widen_f16)
DELAY(f32, float, WIDEN_F32)

/* Per OpenMP thread (the team's threads persist between calls): one block of compensated
 * gradient, kept in the core's L2 between the compensation and the Adam loop. The gradient
 * itself is never written: writing it back to memory would cost a tenth of the step. */
static _Thread_local float *scratch = NULL;
static _Thread_local int64_t scratch_len = 0;

static float *block_scratch(int64_t len) {
    if (scratch_len < len) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)((len + 15) / 16 * 16) * sizeof(float));
        scratch_len = scratch == NULL ? 0 : len;
    }
    return scratch;
}

/* One Adam/AdamW step of a slice fused with its compensation and its publish, one block of
 * `block` elements at a time while the block is in the core's L2 (the compensated modes:
 * optim/optimizer.py). Per block: the delay compensation (as rp_delay_*, with dc) into the
 * thread's scratch block, then in one loop DeepSpeed's CPU Adam update of the block's
 * (compensated, rescaled) gradient in DeepSpeed's own order of operations (cpu_adam.h, Step_1:
 * m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, w += w_decay w (AdamW), w += step_size m /
 * (sqrt(v) bc2 + eps), with Adam's L2 decay l2 w added to g first) and the publish of the new
 * w: `kind` 1 the prediction along the new moments, 2 the look-ahead along the moments a repeat
 * of the (compensated) g would make, else the cast. g is read, never written. Returns 0; -1
 * when the scratch could not be allocated (nothing was written), -2 when it could not be for a
 * thread that joined the team later (part of the slice was stepped: the step failed). */
#define FUSED(suffix, type, widen, convert)                                                     \
    static inline __attribute__((always_inline)) void adam_block_##suffix(                      \
        const float *restrict src, float r, float *restrict w, float *restrict m,               \
        float *restrict v, type *restrict out, int64_t len, float b1, float b2, float nb1,      \
        float nb2, float step_size, float bc2, float eps, float w_decay, float l2, int kind,    \
        float pdecay, float pcoef, float peps, float pl2) {                                     \
        for (int64_t i = 0; i < len; i++) {                                                     \
            float gi = src[i] * r, wi = w[i];                                                   \
            float gd = gi + l2 * wi;                                                            \
            float mi = gd * nb1 + m[i] * b1;                                                    \
            float vi = gd * gd * nb2 + v[i] * b2;                                               \
            float u = mi / (sqrtf(vi) * bc2 + eps);                                             \
            wi = wi + w_decay * wi;                                                             \
            wi = u * step_size + wi;                                                            \
            w[i] = wi;                                                                          \
            m[i] = mi;                                                                          \
            v[i] = vi;                                                                          \
            float o = wi;                                                                       \
            if (kind == 1)                                                                      \
                o = predicted(wi, mi, vi, pdecay, pcoef, peps);                                 \
            else if (kind == 2)                                                                 \
                o = looked_ahead(wi, gi, mi, vi, pdecay, b1, b2, pcoef, peps, pl2);             \
            out[i] = convert(o);                                                                \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    int rp_adam_##suffix(const float *restrict g, float *restrict w, float *restrict m,          \
                         float *restrict v, type *restrict out, int64_t n, int64_t block,       \
                         int dc, float dvcoef, float deps, float dh, float b1, float b2,        \
                         float step_size, float bc2, float eps, float w_decay, float l2,        \
                         int kind, float pdecay, float pcoef, float peps, float pl2,            \
                         double *restrict sums) {                                               \
        double sg = 0.0, sc = 0.0, sw = 0.0;                                                    \
        int64_t blocks = (n + block - 1) / block;                                               \
        float nb1 = 1.0f - b1, nb2 = 1.0f - b2;                                                 \
        int failed = 0;                                                                         \
        if (dc) { /* every thread's scratch first: a failure leaves everything unwritten */    \
            _Pragma("omp parallel reduction(| : failed) if (n >= PARALLEL_MIN)")                \
            failed |= block_scratch(block) == NULL;                                             \
            if (failed)                                                                         \
                return -1;                                                                      \
        }                                                                                       \
        OMP(omp parallel for schedule(static) reduction(+ : sg, sc, sw) reduction(| : failed)   \
                if (n >= PARALLEL_MIN))                                                         \
        for (int64_t k = 0; k < blocks; k++) {                                                  \
            int64_t lo = k * block, hi = lo + block < n ? lo + block : n;                       \
            const float *src = g + lo;                                                          \
            float r = 1.0f;                                                                     \
            if (dc) { /* with h = 0 it only measures (the tensor's first step) */              \
                double part[3] = {0.0, 0.0, 0.0};                                               \
                float *c = block_scratch(block);                                                \
                if (c == NULL) { /* a thread not in the first team, out of memory */            \
                    failed = 1;                                                                 \
                    continue;                                                                   \
                }                                                                               \
                r = delay_block_##suffix(g, w, v, out, lo, hi, dvcoef, deps, dh, c, part);      \
                src = c;                                                                        \
                sg += part[0];                                                                  \
                sc += part[1];                                                                  \
                sw += part[2];                                                                  \
            }                                                                                   \
            /* one call per kind, each inlined with its kind constant: a loop without the    \
             * publishes it does not write (if-converted, each element would compute all) */   \
            if (kind == 1)                                                                      \
                adam_block_##suffix(src, r, w + lo, m + lo, v + lo, out + lo, hi - lo, b1, b2,  \
                                    nb1, nb2, step_size, bc2, eps, w_decay, l2, 1, pdecay,      \
                                    pcoef, peps, pl2);                                          \
            else if (kind == 2)                                                                 \
                adam_block_##suffix(src, r, w + lo, m + lo, v + lo, out + lo, hi - lo, b1, b2,  \
                                    nb1, nb2, step_size, bc2, eps, w_decay, l2, 2, pdecay,      \
                                    pcoef, peps, pl2);                                          \
            else                                                                                \
                adam_block_##suffix(src, r, w + lo, m + lo, v + lo, out + lo, hi - lo, b1, b2,  \
                                    nb1, nb2, step_size, bc2, eps, w_decay, l2, 0, pdecay,      \
                                    pcoef, peps, pl2);                                          \
        }                                                                                       \
        sums[0] += sg;                                                                          \
        sums[1] += sc;                                                                          \
        sums[2] += sw;                                                                          \
        return failed ? -2 : 0;                                                                 \
    }

FUSED(bf16, uint16_t, widen_bf16, to_bf16)
FUSED(f16, uint16_t, widen_f16, to_f16)
FUSED(f32, float, WIDEN_F32, AS_F32)
