// 1-bit sign compression with a per-block scale, with error feedback. See Note [Sign blockwise].
#pragma once

#include <cmath>
#include <cstdint>

#include "pyasync/common.h"
#include "pyasync/math/cast.h"

namespace pyasync {
namespace math {

// Note [Sign blockwise]
// Per block of `block` elements (the last may be short), with v_i = g_i + e_i:
//   scale  = (sum_i |v_i| over finite v_i) / (elements in the block)      (mean |v|)
//   bit_i  = v_i >= 0   (1: +scale, 0: -scale); non-finite v_i encode as bit 1
//   e'_i   = v_i - (bit_i ? scale : -scale)   (e'_i = e_i where g_i is not finite)
// Bits are packed LSB first: element i is bit (i % 8) of byte i / 8, over the whole tensor (not per
// block), so n elements take ceil(n / 8) bytes. The sum's order differs between CPU, GPU and torch,
// so scales agree to a tolerance; the bits are exact.

// NaN, +-Inf encode as 1 (as the Note says); -0.0 is >= 0.
PYASYNC_HOST_DEVICE bool sign_bit(float v) { return !(v < 0.0f) || !is_finite(v); }

PYASYNC_HOST_DEVICE float sign_abs_term(float v) { return is_finite(v) ? fabsf(v) : 0.0f; }

PYASYNC_HOST_DEVICE float sign_scale(float abs_sum, int64_t count) {
  return count > 0 ? abs_sum / static_cast<float>(count) : 0.0f;
}

PYASYNC_HOST_DEVICE float sign_decode(bool bit, float scale) { return bit ? scale : -scale; }

PYASYNC_HOST_DEVICE bool sign_get_bit(const uint8_t* bits, int64_t i) { return (bits[i >> 3] >> (i & 7)) & 1u; }

}  // namespace math
}  // namespace pyasync
