// Per-element optimizer steps on an fp32 master shard, in torch.optim's order of operations.
// See Note [Fused apply].
#pragma once

#include <cmath>

#include "pyasync/common.h"
#include "pyasync/math/feedback.h"  // mul_rn
#include "pyasync/params.h"

namespace pyasync {
namespace math {

// Note [Fused apply]
// An owner turns a push (or the mean of several) into one optimizer step on its fp32 shard:
//   g = dense_scale * dense_i + grad_scale * decode(payload)_i     (either term may be absent)
// then the step below, written to follow torch.optim's single-tensor code line by line so the
// result agrees with torch.optim.SGD / Adam / AdamW element-wise (tests check 10+ steps).
// Scalars that depend only on the step (bias corrections) or on the hyperparameters (1 - beta,
// 1 - dampening, 1 - lr * weight_decay) are computed once on the host in double and passed in
// OptimParams, as torch does. Rounding follows eager torch's CPU kernels: where they use a fused
// multiply-add (Vectorized::fmadd in `add(x, alpha=a)` and `lerp`; addcmul's `self + value*t1*t2`
// as GCC contracts it), so does fma_torch below, on hardware that has one (torch's scalar fallback
// without FMA rounds twice, and so do we); every other operation is one IEEE operation in torch's
// order, never contracted (-ffp-contract=off). SGD then matches torch.optim.SGD bit for bit on FMA
// CPUs. Adam matches to about an ulp: torch's CPU sqrt is not correctly rounded (some 16% of its
// results are 1 ulp off sqrtf on AVX-512), ours is, on the CPU and on CUDA alike.

// a * b + c rounded once where the hardware has FMA (CUDA; CPUs built with FMA), else twice.
PYASYNC_HOST_DEVICE float fma_torch(float a, float b, float c) {
#if defined(__CUDA_ARCH__) || defined(__FMA__)
  return fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// Note [Delay compensation formula]
// DC-ASGD (Zheng et al. 2017, "Asynchronous SGD with delay compensation"): a push's gradient g was
// computed at the weights w_held its worker installed, but is applied to the owner's current master
// w_now. A first-order Taylor step of the gradient, with the Hessian replaced by its cheap diagonal
// outer-product estimate lambda * g * g, moves g to about where it would have been at w_now:
//   g_dc = g + lambda * g * g * (w_now - w_held)                        (elementwise)
// - g is taken where the optimizer would take it: the decoded, scaled gradient of Note [Fused apply]
//   (after grad_scale / dense_scale; top-k after its scatter), before maximize and weight decay.
//   Compensation corrects the stale estimate of the loss gradient itself; weight decay's term
//   (wd * w_now, or AdamW's decay of w_now) is already evaluated at w_now, so it has no delay to
//   correct, and folding it in first would also put wd^2 * w^2 into the Hessian estimate. maximize
//   then negates the compensated estimate exactly as it negates a fresh gradient.
// - w_held is one fp32 value per element, held by the caller; with a sum of several pushes (one g,
//   many held weights) the formula is only as good as the w_held the caller passes.
// - Rounding: each operation is one IEEE fp32 operation in the order the formula is written, as eager
//   torch evaluates `g + lam * g * g * (w - held)` (mul_rn / add_rn, never contracted into an FMA), so
//   the CPU loop and the CUDA kernel both round like that expression (tests/test_apply_dc.py checks
//   the CPU bit for bit).
// - lambda == 0 is not "multiply by zero" (0 * inf is NaN, and g + 0 * x can turn -0 into +0): the
//   compensation is skipped altogether, outside the element loop (a separate tile pass on the CPU,
//   a template flag on CUDA), so the result is bit-identical to an apply without it and w_held is
//   never read. Callers validate lambda >= 0 and finite.
PYASYNC_HOST_DEVICE float dc_compensate(float g, float lambda, float w_now, float w_held) {
  const float curvature = mul_rn(mul_rn(lambda, g), g);  // (lambda * g) * g
  return add_rn(g, mul_rn(curvature, w_now - w_held));
}

// torch.optim.SGD: weight decay, momentum (buffer = grad on the first step), dampening, nesterov.
PYASYNC_HOST_DEVICE void sgd_step(const OptimParams& o, float g, float& p, float* buf) {
  if (o.maximize) g = -g;
  if (o.weight_decay != 0.0f) g = fma_torch(p, o.weight_decay, g);  // grad.add(param, alpha=wd)
  if (o.momentum != 0.0f) {
    // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
    const float b = o.first_step ? g : fma_torch(g, o.one_minus_dampening, *buf * o.momentum);
    *buf = b;
    g = o.nesterov ? fma_torch(b, o.momentum, g) : b;  // grad.add(buf, alpha=momentum)
  }
  p = fma_torch(g, -o.lr, p);  // param.add_(grad, alpha=-lr)
}

// torch.optim.Adam (L2 weight decay) and AdamW (decoupled weight decay), amsgrad=False.
PYASYNC_HOST_DEVICE void adam_step(const OptimParams& o, float g, float& p, float& m, float& v) {
  if (o.maximize) g = -g;
  if (o.decoupled_weight_decay) {
    p = mul_rn(p, o.decay_factor);  // param.mul_(1 - lr * weight_decay)
  } else if (o.weight_decay != 0.0f) {
    g = fma_torch(p, o.weight_decay, g);  // grad.add(param, alpha=weight_decay)
  }
  // exp_avg.lerp_(grad, 1 - beta1), as torch's lerp: from the nearer end by the smaller weight
  const float w = o.one_minus_beta1;
  const float diff = g - m;
  m = fabsf(w) < 0.5f ? fma_torch(w, diff, m) : fma_torch(w - 1.0f, diff, g);
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  v = fma_torch(o.one_minus_beta2 * g, g, v * o.beta2);
  // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps); param.addcdiv_(m, denom, -step_size)
  const float denom = sqrtf(v) / o.bias_correction2_sqrt + o.eps;
  p = p + (-o.step_size) * m / denom;
}

// Note [Delayed Nesterov]
// The outer step of asynchronous local steps (policy "local:H:async", pyasync/local.py): each worker
// pushes its change over H local steps (a pseudo-gradient), and the owner applies each one on arrival.
// Nesterov momentum applied per arrival accelerates along stale directions and diverges (Liu et al.
// 2024, "Asynchronous Local-SGD Training for Language Modeling"); their fix is to move the momentum
// only once per N arrivals. Here, per arrival of g (the push's share, already x 1/n):
//   a = a + g;  p = p - lr * g                                 (the gradient part, at once)
//   every N-th arrival (close_round):  m = mu * m + a;  p = p - lr * mu * m;  a = 0
// Over a round of N arrivals that moves p by lr * (a + mu * m'), m' = mu * m + a: exactly one step of
// torch.optim.SGD(nesterov=True) on the round's sum, whose gradient part arrives without waiting and
// whose momentum part waits for the round. With N = 1 it is Nesterov SGD on every push. Rounding:
// each operation is one IEEE operation in the order written, the `p - x * y` ones an fma as torch's
// add_(alpha=) (fma_torch); lr * mu comes from the host in double, as torch's Python scalar would.
// Its eager twin is pyasync.optim.DelayedNesterov (tests/kernels/test_apply_outer.py).
PYASYNC_HOST_DEVICE void delayed_nesterov_step(const OptimParams& o, float g, float& p, float& m, float& a) {
  a = add_rn(a, g);            // accumulator.add_(g)
  p = fma_torch(g, -o.lr, p);  // param.add_(g, alpha=-lr)
  if (o.close_round) {
    m = add_rn(mul_rn(m, o.momentum), a);  // buf.mul_(momentum).add_(accumulator)
    p = fma_torch(m, -o.lr_momentum, p);   // param.add_(buf, alpha=-lr * momentum)
    a = 0.0f;                              // accumulator.zero_()
  }
}

PYASYNC_HOST_DEVICE void optim_step(const OptimParams& o, float g, float& p, float* s1, float* s2) {
  if (o.kind == OptimKind::kSGD) {
    sgd_step(o, g, p, s1);
  } else if (o.kind == OptimKind::kAdam) {
    adam_step(o, g, p, *s1, *s2);
  } else {
    delayed_nesterov_step(o, g, p, *s1, *s2);
  }
}

}  // namespace math
}  // namespace pyasync
