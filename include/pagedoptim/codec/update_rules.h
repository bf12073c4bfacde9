// Per-element update rules of the optimizers, shared by the CPU and CUDA kernels.
//
// Each rule takes the scalars that are the same for a whole parameter (hoisted once per
// parameter by the step driver, see make_*_scalars) and updates one element in fp32.
// The operation order follows torch.optim's implementations, so that exact mode
// (fp32 state) matches torch.optim.AdamW / SGD to fp32 rounding.
#pragma once

#include <cmath>

#include "pagedoptim/common.h"

namespace pagedoptim::codec {

// ---------------------------------------------------------------------------------------------
// AdamW (decoupled weight decay), torch.optim.AdamW's math:
//   p *= 1 - lr*wd;  m = lerp(m, g, 1-beta1);  v = beta2*v + (1-beta2)*g*g
//   denom = sqrt(max(v)) / sqrt(1-beta2^t) + eps;  p -= lr/(1-beta1^t) * m / denom
// (evaluated with the bias corrections folded into two scalars, see AdamWScalars)
struct AdamWScalars {
  float decay;             // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;   // lerp weight
  float beta2;
  float one_minus_beta2;
  // lr / (1 - beta1^t) * sqrt(1 - beta2^t), negated, and eps * sqrt(1 - beta2^t): torch's
  //   p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
  // multiplied through by sqrt(bc2), which leaves one division per element instead of two
  // (the step is division-bound on CPUs) and changes the result by rounding only.
  float neg_scaled_step;
  float scaled_eps;
  float grad_sign;         // -1 when maximizing
};

// beta^step by repeated squaring in double. std::pow and CUDA's pow may differ in the last
// bit; the step scalars must be the same on both backends (the CUDA path computes them on
// the device, from step counters that live there), so both use this one sequence of IEEE
// multiplications. It differs from a correctly rounded pow by a few double ulps, far below
// the float rounding the scalars then get.
PO_HOST_DEVICE double power_of(double base, long long exponent) {
  double result = 1.0;
  while (exponent > 0) {
    if (exponent & 1) result *= base;
    base *= base;
    exponent >>= 1;
  }
  return result;
}

PO_HOST_DEVICE AdamWScalars make_adamw_scalars(double lr, double beta1, double beta2, double eps,
                                               double weight_decay, long long step,
                                               bool maximize) {
  AdamWScalars s;
  // torch computes these in Python floats (double) and hands them to the kernels as
  // scalars; doing the same keeps the rounding identical.
  s.decay = float(1.0 - lr * weight_decay);
  s.beta1 = float(beta1);
  s.one_minus_beta1 = float(1.0 - beta1);
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  const double bias_correction1 = 1.0 - power_of(beta1, step);
  const double bias_correction2_sqrt = sqrt(1.0 - power_of(beta2, step));
  s.neg_scaled_step = float(-lr / bias_correction1 * bias_correction2_sqrt);
  s.scaled_eps = float(eps * bias_correction2_sqrt);
  s.grad_sign = maximize ? -1.0f : 1.0f;
  return s;
}

// torch's lerp: numerically stable on both halves of the weight range, one fused
// multiply-add as in ATen's vectorized lerp.
PO_HOST_DEVICE float lerp(float from, float to, float weight) {
  return weight < 0.5f ? fmaf(weight, to - from, from) : fmaf(weight - 1.0f, to - from, to);
}

// One AdamW element. `v_denominator` and `v_max_denominator` are the previous v and v_max as
// the denominator should see them: the state itself for fp32 state; for 8-bit state the
// decode with a floor for code 0 (codec::decode_second_moment_for_denominator), so that a
// v that rounded to 0 next to a larger neighbour cannot make m / sqrt(v) explode. The state
// (m, v, v_max) is updated from the plain values. `v_max` is touched only with amsgrad.
template <bool kAmsgrad>
PO_HOST_DEVICE void adamw_element(float& param, float grad, float& m, float& v,
                                  float v_denominator, float& v_max, float v_max_denominator,
                                  const AdamWScalars& s) {
  grad *= s.grad_sign;
  param *= s.decay;
  m = lerp(m, grad, s.one_minus_beta1);
  const float grad_term = s.one_minus_beta2 * grad;
  v = fmaf(grad_term, grad, v * s.beta2);
  float second_moment = fmaf(grad_term, grad, v_denominator * s.beta2);
  if constexpr (kAmsgrad) {
    v_max = v_max > v ? v_max : v;
    second_moment = v_max_denominator > second_moment ? v_max_denominator : second_moment;
  }
  param += (s.neg_scaled_step * m) / (sqrtf(second_moment) + s.scaled_eps);
}

// fp32 state: the denominator sees the state itself.
template <bool kAmsgrad>
PO_HOST_DEVICE void adamw_element(float& param, float grad, float& m, float& v, float& v_max,
                                  const AdamWScalars& s) {
  adamw_element<kAmsgrad>(param, grad, m, v, v, v_max, v_max, s);
}

// ---------------------------------------------------------------------------------------------
// SGD, torch.optim.SGD's math:
//   g = ±g + wd*p;  b = first ? g : momentum*b + (1-dampening)*g
//   g = nesterov ? g + momentum*b : b;  p -= lr*g
struct SGDScalars {
  float lr;
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  float grad_sign;
  bool nesterov;
  bool first_step;  // the momentum buffer starts as a copy of the first gradient
};

PO_HOST_DEVICE SGDScalars make_sgd_scalars(double lr, double momentum, double dampening,
                                   double weight_decay, bool nesterov, bool maximize,
                                   bool first_step) {
  SGDScalars s;
  s.lr = float(lr);
  s.weight_decay = float(weight_decay);
  s.momentum = float(momentum);
  s.one_minus_dampening = float(1.0 - dampening);
  s.grad_sign = maximize ? -1.0f : 1.0f;
  s.nesterov = nesterov;
  s.first_step = first_step;
  return s;
}

// torch's `a.add(b, alpha=x)` is one fused multiply-add, fmaf(b, x, a), on its vector
// path; the rules below spell that out so that -ffp-contract=off builds stay bit-identical.
PO_HOST_DEVICE float sgd_direction(float param, float grad, const SGDScalars& s) {
  grad *= s.grad_sign;
  if (s.weight_decay != 0.0f) grad = fmaf(param, s.weight_decay, grad);
  return grad;
}

// SGD with a momentum buffer (momentum != 0).
PO_HOST_DEVICE void sgd_momentum_element(float& param, float grad, float& buffer,
                                         const SGDScalars& s) {
  grad = sgd_direction(param, grad, s);
  buffer = s.first_step ? grad : fmaf(grad, s.one_minus_dampening, buffer * s.momentum);
  const float direction = s.nesterov ? fmaf(buffer, s.momentum, grad) : buffer;
  param = fmaf(direction, -s.lr, param);
}

// Plain SGD (momentum == 0): no state at all.
PO_HOST_DEVICE void sgd_element(float& param, float grad, const SGDScalars& s) {
  param = fmaf(sgd_direction(param, grad, s), -s.lr, param);
}

// ---------------------------------------------------------------------------------------------
// Lion (Chen et al. 2023), the reference formulation:
//   p *= 1 - lr*wd;  p -= lr * sign(beta1*m + (1-beta1)*g);  m = beta2*m + (1-beta2)*g
struct LionScalars {
  float lr;
  float decay;  // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float grad_sign;
};

PO_HOST_DEVICE LionScalars make_lion_scalars(double lr, double beta1, double beta2,
                                     double weight_decay, bool maximize) {
  LionScalars s;
  s.lr = float(lr);
  s.decay = float(1.0 - lr * weight_decay);
  s.beta1 = float(beta1);
  s.one_minus_beta1 = float(1.0 - beta1);
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.grad_sign = maximize ? -1.0f : 1.0f;
  return s;
}

PO_HOST_DEVICE float sign_of(float x) { return float(x > 0.0f) - float(x < 0.0f); }

PO_HOST_DEVICE void lion_element(float& param, float grad, float& m, const LionScalars& s) {
  grad *= s.grad_sign;
  param *= s.decay;
  const float interpolated = fmaf(grad, s.one_minus_beta1, m * s.beta1);
  param = fmaf(sign_of(interpolated), -s.lr, param);
  m = fmaf(grad, s.one_minus_beta2, m * s.beta2);
}

}  // namespace pagedoptim::codec
