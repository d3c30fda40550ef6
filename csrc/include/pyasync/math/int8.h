// Blockwise absmax int8 quantisation with error feedback. See Note [Int8 blockwise].
#pragma once

#include <cmath>
#include <cstdint>

#include "pyasync/common.h"
#include "pyasync/math/cast.h"

namespace pyasync {
namespace math {

// Note [Int8 blockwise]
// A tensor is cut into blocks of `block` elements (the last may be short). Per block:
//   v_i     = g_i + e_i                      (e: the error-feedback residual, 0 without it)
//   absmax  = max_i |v_i| over finite v_i
//   scale   = absmax / 127                   (fp32 division)
//   q_i     = clamp(rint(v_i / scale), -127, 127), 0 where scale == 0 or v_i is not finite
//   e'_i    = v_i - q_i * scale              (e'_i = e_i where g_i is not finite)
// Decode is q_i * scale. Every step is a single IEEE operation, so the codes are bit-identical on
// the CPU, the GPU and in torch (reference/codecs.py), as long as nothing is fused into an FMA
// before the division.

PYASYNC_HOST_DEVICE float int8_scale(float absmax) { return absmax / 127.0f; }

// No early return and no ?: around the division, so CPU loops vectorise (gcc would sink the division
// into a branch that -ftrapping-math then forbids it to if-convert).
PYASYNC_HOST_DEVICE int8_t int8_quantize(float v, float scale) {
  float r = rintf(v / scale);
  r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
  // Keep r only where scale > 0 and v is finite; this also clears the NaN of v / 0 before the cast.
  const uint32_t keep = 0u - static_cast<uint32_t>((scale > 0.0f) & is_finite(v));
  return static_cast<int8_t>(bits_float(float_bits(r) & keep));
}

PYASYNC_HOST_DEVICE float int8_dequantize(int8_t q, float scale) { return static_cast<float>(q) * scale; }

// |v| for the absmax, with non-finite values counted as 0 (they are flagged, not quantised).
PYASYNC_HOST_DEVICE float int8_absmax_term(float v) { return is_finite(v) ? fabsf(v) : 0.0f; }

}  // namespace math
}  // namespace pyasync
