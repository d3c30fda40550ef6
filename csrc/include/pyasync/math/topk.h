// Top-k by magnitude: the ordering key. See Note [Top-k selection].
#pragma once

#include <cstdint>

#include "pyasync/common.h"
#include "pyasync/math/cast.h"

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

}  // namespace math
}  // namespace pyasync
