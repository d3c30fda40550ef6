// Per-element optimizer steps on an fp32 master shard, in torch.optim's order of operations.
// See Note [Fused apply].
#pragma once

#include <cmath>

#include "pyasync/common.h"
#include "pyasync/params.h"

namespace pyasync {
namespace math {

// Note [Fused apply]
// An owner turns a push (or the mean of several) into one optimizer step on its fp32 shard:
//   g = dense_scale * dense_i + grad_scale * decode(payload)_i     (either term may be absent)
// then the step below, written to follow torch.optim's single-tensor code line by line so the
// result agrees with torch.optim.SGD / Adam / AdamW element-wise (tests check 10+ steps).
// Scalars that depend only on the step (bias corrections) are computed once on the host in double
// and passed in OptimParams, as torch does.

// torch.optim.SGD: weight decay, momentum (buffer = grad on the first step), dampening, nesterov.
PYASYNC_HOST_DEVICE void sgd_step(const OptimParams& o, float g, float& p, float* buf) {
  if (o.maximize) g = -g;
  if (o.weight_decay != 0.0f) g = g + o.weight_decay * p;
  if (o.momentum != 0.0f) {
    float b = o.first_step ? g : *buf * o.momentum + g * (1.0f - o.dampening);
    *buf = b;
    g = o.nesterov ? g + o.momentum * b : b;
  }
  p = p + g * (-o.lr);
}

// torch.optim.Adam (L2 weight decay) and AdamW (decoupled weight decay), amsgrad=False.
PYASYNC_HOST_DEVICE void adam_step(const OptimParams& o, float g, float& p, float& m, float& v) {
  if (o.maximize) g = -g;
  if (o.decoupled_weight_decay) {
    p = p * (1.0f - o.lr * o.weight_decay);
  } else if (o.weight_decay != 0.0f) {
    g = g + o.weight_decay * p;
  }
  m = m + (g - m) * (1.0f - o.beta1);  // lerp
  v = v * o.beta2 + g * g * (1.0f - o.beta2);
  const float denom = sqrtf(v) / o.bias_correction2_sqrt + o.eps;
  p = p + (m / denom) * (-o.step_size);
}

PYASYNC_HOST_DEVICE void optim_step(const OptimParams& o, float g, float& p, float* s1, float* s2) {
  if (o.kind == OptimKind::kSGD) {
    sgd_step(o, g, p, s1);
  } else {
    adam_step(o, g, p, *s1, *s2);
  }
}

}  // namespace math
}  // namespace pyasync
