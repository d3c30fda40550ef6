// Top-k by magnitude: the ordering key. See Note [Top-k selection].
#pragma once

#include <cstdint>

#include "pyasync/common.h"
#include "pyasync/math/cast.h"
#include "pyasync/math/feedback.h"

namespace pyasync {
namespace math {

// Note [Top-k selection]
// With v_i = g_i + e_i, keep the k elements of largest |v_i|. The key of an element is the bit
// pattern of |v_i| as uint32 (monotone in |v| for non-negative floats, so a radix select over the
// bits finds the k-th largest exactly); non-finite v_i get key 0. With T the k-th largest key, the
// kept set is every i with key_i > T plus the elements with key_i == T in ascending index order
// until k are kept. Output: the kept indices in ascending order (int32) and v at them (fp32).
// Error feedback (Note [Error feedback] with d_i = v_i where kept, 0 elsewhere): e'_i = 0 where
// kept, e'_i = v_i elsewhere; where v_i is not finite (always so where g_i is not finite) e'_i = e_i,
// kept or not, and the non-finite flag is set.
// Decode scatters the values into a dense zero tensor.

PYASYNC_HOST_DEVICE uint32_t topk_key(float v) { return is_finite(v) ? (float_bits(v) & 0x7fffffffu) : 0u; }

// The new residual of one element, kept or not. See Note [Top-k selection].
PYASYNC_HOST_DEVICE float topk_residual(float v, float e_old, bool kept) {
  return is_finite(v) ? (kept ? 0.0f : v) : e_old;
}

// Note [Momentum correction for top-k]
// Why top-k fails with momentum. Error feedback delivers every gradient, but late: at 1% an element
// waits until its accumulated value is among the largest, so half of the mass sent is 15-20 steps
// old and a tenth over 140 (bench/topk_momentum.py on `seq`). Delivered into the owner's momentum
// buffer, each late burst keeps pushing for another 1 / (1 - mu) steps, on top of the delay: the
// staleness-with-momentum problem of ASP. Without momentum (plain SGD at lr / (1 - mu)) the same
// top-k 1% loses nothing against its dense run, with momentum 0.9 it loses over 20 points; and since
// the owner's buffer moves every element at every step, top-k replies of that change lag as well.
// DGC (Lin et al. 2018, "Deep Gradient Compression"): each worker keeps its own velocity and error
// feedback sums the velocity, not the gradient:
//   u'_i = mu * u_i + g_i                           (the momentum step, before any compression)
//   x_i  = u'_i,  or g_i + mu * u'_i with Nesterov   (what one step of momentum SGD would apply)
//   v_i  = x_i + e_i, top-k of v as in Note [Top-k selection]
// The owner then applies the sum with plain SGD, momentum 0 (its master changes only where
// something was sent, so top-k replies of the change are nearly exact), weight decay divided by
// 1 - mu (the decay a momentum buffer would have carried).
// Factor masking: where an element is sent (kept, v finite), u'_i = 0 as well as e'_i = 0, so the
// velocity that was delivered stops pushing. It drops the velocity's tail at every send: cheap when
// sends are rare against the momentum's memory, ruinous when they are not (on `seq`, top-k 25% with
// masking 0.40, without 0.997; top-k 1% for 4x the steps with masking 0.9995 = dense, without
// 0.79-0.99). TopK masks by default where ratio < 1 - mu (an element is sent less often than once
// per 1 / (1 - mu) steps on average).
// Each product and sum rounds on its own (mul_rn, add_rn), so the CPU, the GPU and the eager
// reference agree bit for bit. Where g_i is not finite, u'_i is not finite either: the payload is
// dropped and the caller keeps the old u (the encode writes a spare buffer), as it keeps the old
// residual.

// The new velocity of one element. See Note [Momentum correction for top-k].
PYASYNC_HOST_DEVICE float dgc_velocity(float u, float g, float mu) { return add_rn(mul_rn(mu, u), g); }

// What one element accumulates into error feedback, from its new velocity.
PYASYNC_HOST_DEVICE float dgc_accumulated(float u_new, float g, float mu, bool nesterov) {
  return nesterov ? add_rn(g, mul_rn(mu, u_new)) : u_new;
}

}  // namespace math
}  // namespace pyasync
