// fp32 <-> fp16 / bf16 conversions, round-to-nearest-even, on raw uint16_t bits.
// Written once for host and device; see Note [Bit-exact casts].
#pragma once

#include <cstdint>
#include <cstring>

#include "pyasync/common.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace pyasync {
namespace math {

// Note [Bit-exact casts]
// The CPU twin and the CUDA kernels must produce the same bits as torch's `.half()` / `.bfloat16()`
// (round to nearest, ties to even; NaN stays NaN; overflow to fp16 becomes +-inf). On the device the
// fp16 conversion uses the hardware instruction, which implements exactly that rounding; on the host
// the same rounding is written out below. bf16 is the same integer formula on both sides.

PYASYNC_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

PYASYNC_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// Branch-free (selects only) so CPU loops over it vectorise; see Note [Bit-exact casts].
PYASYNC_HOST_DEVICE uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);  // NaN: canonical, as torch
}

PYASYNC_HOST_DEVICE float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

PYASYNC_HOST_DEVICE uint16_t float_to_fp16(float x) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(x));
#else
  // Every case is computed and one is selected (no branches), so CPU loops vectorise.
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t r_special = 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u);  // inf / quiet NaN
  // fp16 subnormal or zero: add 0.5 (as a float) so the FPU rounds the mantissa into the low bits,
  // ties to even.
  const uint32_t r_sub = float_bits(bits_float(a) + 0.5f) - 0x3f000000u;
  const uint32_t r_norm = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;  // rebias exponent (-112 << 23), round
  const uint32_t r = a >= 0x7f800000u ? r_special
                     : a >= 0x477ff000u ? 0x7c00u  // rounds to >= 65520: inf
                     : a < 0x38800000u ? r_sub
                                       : r_norm;
  return static_cast<uint16_t>(sign | r);
#endif
}

PYASYNC_HOST_DEVICE float fp16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  // Picked by bit masks, not ?: -- with a select, gcc sinks the float multiply into a branch that
  // -ftrapping-math then forbids it to if-convert, and the loops over this do not vectorise.
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t is_special = 0u - static_cast<uint32_t>(em >= 0x7c00u);  // all ones: inf / NaN
  const uint32_t is_sub = 0u - static_cast<uint32_t>(em < 0x0400u);       // all ones: subnormal / 0
  const uint32_t special = 0x7f800000u | (em & 0x3ffu) << 13;
  const uint32_t sub = float_bits(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);  // em * 2^-24
  const uint32_t norm = (em << 13) + 0x38000000u;
  return bits_float(sign | (special & is_special) | (sub & is_sub) | (norm & ~(is_special | is_sub)));
#endif
}

// Value of element type T as float, and back. T is float, or uint16_t bits tagged by the DType.
template <DType D>
struct Convert;
template <>
struct Convert<DType::kFloat32> {
  using storage = float;
  static PYASYNC_HOST_DEVICE float load(float v) { return v; }
  static PYASYNC_HOST_DEVICE float store(float v) { return v; }
};
template <>
struct Convert<DType::kFloat16> {
  using storage = uint16_t;
  static PYASYNC_HOST_DEVICE float load(uint16_t v) { return fp16_to_float(v); }
  static PYASYNC_HOST_DEVICE uint16_t store(float v) { return float_to_fp16(v); }
};
template <>
struct Convert<DType::kBFloat16> {
  using storage = uint16_t;
  static PYASYNC_HOST_DEVICE float load(uint16_t v) { return bf16_to_float(v); }
  static PYASYNC_HOST_DEVICE uint16_t store(float v) { return float_to_bf16(v); }
};

PYASYNC_HOST_DEVICE bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

}  // namespace math
}  // namespace pyasync
