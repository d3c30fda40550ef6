// Error feedback and decode-with-accumulate: the two formulas every codec shares.
// See Note [Error feedback].
#pragma once

#include <cstdint>

#include "pyasync/common.h"
#include "pyasync/math/cast.h"

namespace pyasync {
namespace math {

// Note [Error feedback]
// Every codec encodes v_i = g_i + e_i (e: the residual, 0 without error feedback) and decodes the
// code back to d_i. The new residual is
//   e'_i = v_i - d_i                          when v_i and d_i are finite
//   e'_i = e_i      (and the flag is set)     otherwise ("bad" elements)
// A bad element is a NaN/Inf gradient (v is then non-finite for any finite e), or a finite v whose
// code does not decode to a finite value (fp16 overflow past 65504, a sign scale that overflowed):
// either way the payload must not be applied, and the residual keeps its old value so the dropped
// step leaves error feedback untouched.
// Decode writes out_i = alpha * d_i, or out_i + alpha * d_i with accumulate, as two separately
// rounded operations (the product, then the sum). On the device the explicit _rn intrinsics keep
// nvcc from contracting them (or v - q * scale) into an FMA, so the CPU, the GPU and the eager-torch
// reference round identically.

PYASYNC_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

PYASYNC_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

PYASYNC_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// True when element (v, d) must not be applied: see Note [Error feedback].
PYASYNC_HOST_DEVICE bool ef_bad(float v, float d) { return !(is_finite(v) & is_finite(d)); }  // & not &&: no branch

// The new residual of one element.
PYASYNC_HOST_DEVICE float ef_residual(float v, float d, float e_old) { return ef_bad(v, d) ? e_old : sub_rn(v, d); }

// One decoded element written into out: alpha * d, plus the old value when accumulating.
PYASYNC_HOST_DEVICE float decode_store(float out_old, float alpha, float d, bool accumulate) {
  const float x = mul_rn(alpha, d);
  return accumulate ? add_rn(out_old, x) : x;
}

}  // namespace math
}  // namespace pyasync
