/* Publishing kernels: the fp32 masters (and, for weight prediction, Adam's moments) written
 * into the compute weights an iteration reads, in one pass that a compiler vectorizes.
 *
 * Called from Python through ctypes (rp_engine/optim/publish_kernel.py) on flat, contiguous
 * slices, right after DeepSpeed's CPU Adam has stepped the same slice, while it is still in the
 * CPU's caches. Compiled with -O3 -march=native and the reciprocal approximations (-mrecip, one
 * Newton step: ~23 bits): the prediction's step term lr * m / (sqrt(v) + eps) is a small
 * correction to w, so its last bits are far below the rounding of the result.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Slices this long are split over the OpenMP threads in contiguous parts (a static schedule,
 * as DeepSpeed's Adam splits a slice, so each thread mostly reads what its own core has just
 * stepped); shorter ones are not worth waking the threads for. */
#define PARALLEL_MIN 65536

/* fp32 -> bf16, round to nearest even; NaN becomes torch's canonical 0x7fc0. */
static inline uint16_t to_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return (b & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded; /* as torch */
}

/* out = w as bf16 */
void rp_copy_bf16(const float *restrict w, uint16_t *restrict out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(w[i]);
}

/* out = w as fp16 */
void rp_copy_f16(const float *restrict w, _Float16 *restrict out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = (_Float16)w[i];
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
                    _Float16 *restrict out, int64_t n, float decay, float coef, float eps) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++)
        out[i] = (_Float16)predicted(w[i], m[i], v[i], decay, coef, eps);
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

#define AS_F16(x) ((_Float16)(x))
#define AS_F32(x) (x)
LOOKAHEAD(bf16, uint16_t, to_bf16)
LOOKAHEAD(f16, _Float16, AS_F16)
LOOKAHEAD(f32, float, AS_F32)
