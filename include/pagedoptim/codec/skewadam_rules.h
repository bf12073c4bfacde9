// SkewAdam's element math (DESIGN.md section 5), shared by the CPU and CUDA kernels.
//
// Every parameter has one of two second-moment forms, fixed by its tier and rank:
//
// Factored (>= 2-D parameters of the backbone and experts tiers), Adafactor's rank-1
// estimate, per matrix [rows, cols] (per expert for an [E, rows, cols] tensor):
//   R_i = beta2 * R_i + (1 - beta2) * mean_j(g_ij^2 + eps)      row running means   [rows]
//   C_j = beta2 * C_j + (1 - beta2) * mean_i(g_ij^2 + eps)      column running means [cols]
//   v_hat_ij = R_i * C_j / (mean_i(R_i) * bc2)                  bc2 = 1 - beta2^t
//   u_ij = g_ij / sqrt(v_hat_ij),   u <- u / max(1, rms(u))     rms over the matrix
// The update is u itself (experts tier: no momentum) or, in the backbone,
//   m = lerp(m, u, 1 - beta1),  update = m / (1 - beta1^t)
// The kernels never form v_hat: u_ij = g_ij * row_coef_i * col_coef_j with
//   row_coef_i = clip / sqrt(R_i / (mean(R) * bc2)),  col_coef_j = 1 / sqrt(C_j)
// (clip = 1 / max(1, rms(u)) folded into the row coefficients once per matrix).
//
// Exact (router tier, and 1-D / 0-D parameters in every tier):
//   v = beta2 * v + (1 - beta2) * (g^2 + eps)
//   update = (momentum ? m / (1 - beta1^t) with m = lerp(m, g, 1 - beta1) : g) / sqrt(v / bc2)
// This is Adam with its epsilon moved under the square root, onto g^2; no update clipping
// (the exact v bounds |update| by about 1 / sqrt(1 - beta2) already).
//
// Epsilon sits on g^2 (Adafactor's eps1 = 1e-30): it only keeps the row and column means
// away from 0 / 0 where a whole row has zero gradient, and never competes with a real g^2.
// A 1e-8 floor on the factors instead caps 1 / sqrt(v_hat) at 1e4 and silently scales
// down the update of every weight whose gradients are below ~1e-4 (docs/skewadam.md).
//
// Decoupled weight decay comes first, p <- p * (1 - lr * wd), applied to the fp32 master
// (bf16 parameter + residual), so a decay smaller than half a bf16 ulp is kept, not rounded
// away.
#pragma once

#include <cmath>

#include "pagedoptim/codec/update_rules.h"
#include "pagedoptim/common.h"

namespace pagedoptim::codec {

struct SkewAdamScalars {
  float decay;            // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;  // lerp weight of the momentum
  float beta2;
  float one_minus_beta2;
  float eps;              // added to g^2
  float lr;               // step size of the momentum-free updates
  float step_size;        // lr / (1 - beta1^t), for updates with momentum
  float bias_correction2;       // 1 - beta2^t
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

PO_HOST_DEVICE SkewAdamScalars make_skewadam_scalars(double lr, double beta1, double beta2,
                                                     double eps, double weight_decay,
                                                     long long step) {
  SkewAdamScalars s;
  // In double, as Python computes AdamW's scalars, then rounded once; beta^t by power_of so
  // that the CUDA scalar kernel computes the same bits (update_rules.h).
  s.decay = float(1.0 - lr * weight_decay);
  s.beta1 = float(beta1);
  s.one_minus_beta1 = float(1.0 - beta1);
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.eps = float(eps);
  s.lr = float(lr);
  s.step_size = float(lr / (1.0 - power_of(beta1, step)));
  const double bias_correction2 = 1.0 - power_of(beta2, step);
  s.bias_correction2 = float(bias_correction2);
  s.bias_correction2_sqrt = float(sqrt(bias_correction2));
  return s;
}

// g^2 + eps, the quantity whose row and column means the factors track.
PO_HOST_DEVICE float skewadam_squared_grad(float grad, const SkewAdamScalars& s) {
  return grad * grad + s.eps;
}

// One running mean (a row mean R_i or a column mean C_j) moved towards this step's mean.
PO_HOST_DEVICE float skewadam_running_mean(float state, float mean_now,
                                           const SkewAdamScalars& s) {
  return fmaf(s.one_minus_beta2, mean_now, state * s.beta2);
}

// 1 / (mean(R) * bc2) of one matrix, from the sum of its new row means.
PO_HOST_DEVICE float skewadam_inverse_norm(double row_mean_sum, long long rows,
                                           const SkewAdamScalars& s) {
  return float(1.0 / (row_mean_sum / double(rows) * double(s.bias_correction2)));
}

PO_HOST_DEVICE float skewadam_row_coefficient(float row_mean, float inverse_norm) {
  return 1.0f / sqrtf(row_mean * inverse_norm);
}

PO_HOST_DEVICE float skewadam_col_coefficient(float col_mean) { return 1.0f / sqrtf(col_mean); }

// 1 / max(1, rms) from the sum of u^2 over a matrix of `count` elements.
PO_HOST_DEVICE float skewadam_clip_factor(double sum_of_squares, double count) {
  const double rms = sqrt(sum_of_squares / count);
  return rms > 1.0 ? float(1.0 / rms) : 1.0f;
}

// u_ij = g_ij * row_coef_i * col_coef_j.
PO_HOST_DEVICE float skewadam_factored_direction(float grad, float row_coef, float col_coef) {
  return grad * row_coef * col_coef;
}

// One element of a factored parameter, given its (clipped) direction u.
template <bool kMomentum>
PO_HOST_DEVICE void skewadam_factored_element(float& param, float direction, float& m,
                                              const SkewAdamScalars& s) {
  param *= s.decay;
  if constexpr (kMomentum) {
    m = lerp(m, direction, s.one_minus_beta1);
    param += -s.step_size * m;
  } else {
    param += -s.lr * direction;
  }
}

// One element of a parameter with an exact second moment.
template <bool kMomentum>
PO_HOST_DEVICE void skewadam_exact_element(float& param, float grad, float& m, float& v,
                                           const SkewAdamScalars& s) {
  param *= s.decay;
  v = fmaf(s.one_minus_beta2, skewadam_squared_grad(grad, s), v * s.beta2);
  const float denom = sqrtf(v) / s.bias_correction2_sqrt;
  if constexpr (kMomentum) {
    m = lerp(m, grad, s.one_minus_beta1);
    param += (-s.step_size * m) / denom;
  } else {
    param += (-s.lr * grad) / denom;
  }
}

}  // namespace pagedoptim::codec
