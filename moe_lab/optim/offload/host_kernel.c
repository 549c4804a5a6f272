/* offload=full's host optimizer step over one flat fp32 master, in one pass over memory (host_kernel.py builds and
 * loads this file; host_step.py calls it).
 *
 * Per element: read the gradient from the transfer buffer (bf16 or fp32: the compute dtype), step the fp32 master
 * (and AdamW's moments), write the new weight into the transfer buffer in the same dtype. One OpenMP region per call,
 * static schedule: each thread streams one contiguous range of every tensor.
 *
 * AdamW follows torch's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, adam_math for float,
 * ADAM_MODE::ADAMW, vectorised path) operation by operation, in fp32 with the coefficients rounded from double as
 * torch rounds them. It is built with -ffp-contract=off and writes its fused multiply-adds where torch's do: the one
 * torch's source writes (the lerp) and the one its x86 builds contract (exp_avg_sq * beta2 + (1 - beta2) * grad *
 * grad, computed as fma((1 - beta2) * grad, grad, exp_avg_sq * beta2)): over 4 steps of 100003 elements the results
 * equal torch 2.11's and 2.13's fused kernel, AVX2 and AVX512 (ATEN_CPU_CAPABILITY), but for the last bit of one
 * element of exp_avg_sq in their scalar tail. SignSGD follows moe_lab/optim/optimizers.py (torch.sign: 0 for 0 and NaN).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16; a NaN stays a (quiet) NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    uint16_t nan = (uint16_t)((u >> 16) | 0x0040u);
    return f != f ? nan : rounded;
}

#define LOAD_bf16(x) bf16_to_float(x)
#define STORE_bf16(x) float_to_bf16(x)
#define LOAD_f32(x) (x)
#define STORE_f32(x) (x)

/* decay = 1 - lr * weight_decay, lerp_weight = 1 - beta1, sq_weight = 1 - beta2, neg_step_size = -lr / bias
 * correction 1, all rounded to float by the caller as torch rounds its doubles. */
#define ADAMW_STEP(name, transfer_t)                                                                               \
    void adamw_step_##name(int64_t n, float *restrict param, float *restrict exp_avg, float *restrict exp_avg_sq,   \
                           transfer_t *restrict transfer, float decay, float lerp_weight, float beta2,              \
                           float sq_weight, float bias_correction2_sqrt, float eps, float neg_step_size,            \
                           int threads) {                                                                           \
        /* exp_avg.lerp_(grad, lerp_weight), as torch's vectorised lerp: from the nearer end */                     \
        const int small = fabsf(lerp_weight) < 0.5f;                                                                \
        const float coeff = small ? lerp_weight : lerp_weight - 1.0f;                                               \
        _Pragma("omp parallel for simd num_threads(threads) schedule(static)")                                      \
        for (int64_t i = 0; i < n; i++) {                                                                           \
            const float grad = LOAD_##name(transfer[i]);                                                            \
            const float p = param[i] * decay;                                                                       \
            const float m = exp_avg[i];                                                                             \
            const float m_new = fmaf(coeff, grad - m, small ? m : grad);                                            \
            const float v_new = fmaf(sq_weight * grad, grad, exp_avg_sq[i] * beta2);                                \
            const float denom = sqrtf(v_new) / bias_correction2_sqrt + eps;                                         \
            const float p_new = p + neg_step_size * m_new / denom;                                                  \
            exp_avg[i] = m_new;                                                                                     \
            exp_avg_sq[i] = v_new;                                                                                  \
            param[i] = p_new;                                                                                       \
            transfer[i] = STORE_##name(p_new);                                                                      \
        }                                                                                                           \
    }

/* decay = 1 - lr * weight_decay (1 without weight decay: an exact no-op), neg_lr = -lr, both rounded to float. */
#define SIGNSGD_STEP(name, transfer_t)                                                                             \
    void signsgd_step_##name(int64_t n, float *restrict param, transfer_t *restrict transfer, float decay,          \
                             float neg_lr, int threads) {                                                           \
        _Pragma("omp parallel for simd num_threads(threads) schedule(static)")                                      \
        for (int64_t i = 0; i < n; i++) {                                                                           \
            const float grad = LOAD_##name(transfer[i]);                                                            \
            const float sign = (float)(grad > 0.0f) - (float)(grad < 0.0f);                                         \
            const float p_new = param[i] * decay + neg_lr * sign;                                                   \
            param[i] = p_new;                                                                                       \
            transfer[i] = STORE_##name(p_new);                                                                      \
        }                                                                                                           \
    }

ADAMW_STEP(bf16, uint16_t)
ADAMW_STEP(f32, float)
SIGNSGD_STEP(bf16, uint16_t)
SIGNSGD_STEP(f32, float)
