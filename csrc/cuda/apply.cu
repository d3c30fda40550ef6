// Fused decode + optimizer step on an fp32 master shard, CUDA. See Note [Fused apply] (math/optim.h)
// and Note [CUDA apply] below.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "pyasync/math/cast.h"
#include "pyasync/math/int8.h"
#include "pyasync/math/optim.h"
#include "pyasync/math/sign.h"
#include "pyasync/params.h"

namespace pyasync {
namespace {

// Note [CUDA apply]
// One grid-stride elementwise kernel per (codec, optimizer, delay compensation): 5 x 2 x 2
// instantiations. Delay compensation is the template flag kDC (See Note [Delay compensation formula]), so
// the kDC = false kernels are the kernels without it: no dc_held load, no extra registers. Whether a
// dense term and a payload are present, and the optimizer's flags, are uniform runtime branches (every
// thread takes the same side, so they cost no divergence). When every pointer is aligned for it,
// threads move kVec = 4 elements per iteration with 16-byte fp32 loads and stores (8-byte fp16/bf16,
// 4-byte int8 code loads); the elements past the last full vector, or all of them when some pointer
// is misaligned, go through the scalar loop. Blockwise scales are indexed by a running
// (block, offset) pair inside a vector instead of one 64-bit division per element.
// Rounding: nvcc contracts a * b + c into an FMA by default; the gradient terms use __fmul_rn /
// __fadd_rn and math/optim.h writes its FMAs explicitly (fma_torch) and guards its lone products
// (mul_rn), so the kernel rounds exactly like the CPU loop built for an FMA CPU.

constexpr int kVec = 4;

template <Codec C>
struct Codes;
template <>
struct Codes<Codec::kNone> {
  using vec = float4;
  static __device__ __forceinline__ float at(const void* c, int64_t i, float) { return static_cast<const float*>(c)[i]; }
  static __device__ __forceinline__ void load(const void* c, int64_t i0, float, float (&x)[kVec]) {
    const float4 v = reinterpret_cast<const float4*>(c)[i0 / kVec];
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  }
};
template <>
struct Codes<Codec::kFP16> {
  using vec = uint2;
  static __device__ __forceinline__ float at(const void* c, int64_t i, float) {
    return math::fp16_to_float(static_cast<const uint16_t*>(c)[i]);
  }
  static __device__ __forceinline__ void load(const void* c, int64_t i0, float, float (&x)[kVec]) {
    const uint2 v = reinterpret_cast<const uint2*>(c)[i0 / kVec];
    x[0] = math::fp16_to_float(v.x & 0xffffu), x[1] = math::fp16_to_float(v.x >> 16);
    x[2] = math::fp16_to_float(v.y & 0xffffu), x[3] = math::fp16_to_float(v.y >> 16);
  }
};
template <>
struct Codes<Codec::kBF16> {
  using vec = uint2;
  static __device__ __forceinline__ float at(const void* c, int64_t i, float) {
    return math::bf16_to_float(static_cast<const uint16_t*>(c)[i]);
  }
  static __device__ __forceinline__ void load(const void* c, int64_t i0, float, float (&x)[kVec]) {
    const uint2 v = reinterpret_cast<const uint2*>(c)[i0 / kVec];
    x[0] = math::bf16_to_float(v.x & 0xffffu), x[1] = math::bf16_to_float(v.x >> 16);
    x[2] = math::bf16_to_float(v.y & 0xffffu), x[3] = math::bf16_to_float(v.y >> 16);
  }
};
// Blockwise codecs: `load` gets the per-element scales through x (x[j] = scale of element i0 + j).
template <>
struct Codes<Codec::kInt8> {
  using vec = char4;
  static __device__ __forceinline__ float at(const void* c, int64_t i, float s) {
    return math::int8_dequantize(static_cast<const int8_t*>(c)[i], s);
  }
  static __device__ __forceinline__ void load(const void* c, int64_t i0, float, float (&x)[kVec]) {
    const char4 v = reinterpret_cast<const char4*>(c)[i0 / kVec];
    x[0] = math::int8_dequantize(v.x, x[0]), x[1] = math::int8_dequantize(v.y, x[1]);
    x[2] = math::int8_dequantize(v.z, x[2]), x[3] = math::int8_dequantize(v.w, x[3]);
  }
};
template <>
struct Codes<Codec::kSign> {
  using vec = uint8_t;
  static __device__ __forceinline__ float at(const void* c, int64_t i, float s) {
    return math::sign_decode(math::sign_get_bit(static_cast<const uint8_t*>(c), i), s);
  }
  static __device__ __forceinline__ void load(const void* c, int64_t i0, float, float (&x)[kVec]) {
    const uint8_t* bits = static_cast<const uint8_t*>(c);
#pragma unroll
    for (int j = 0; j < kVec; ++j) x[j] = math::sign_decode(math::sign_get_bit(bits, i0 + j), x[j]);
  }
};

// dense_scale * d (+ x): rounded twice like the CPU loop (the _rn intrinsics are never contracted).
__device__ __forceinline__ float dense_term(float ds, float d, float x, bool add) {
  const float t = __fmul_rn(ds, d);
  return add ? __fadd_rn(t, x) : t;
}

constexpr bool blockwise(Codec c) { return c == Codec::kInt8 || c == Codec::kSign; }

template <Codec C, OptimKind K, bool kDC>
__global__ void __launch_bounds__(kThreads) apply_kernel(const ApplyParams p, int64_t nvec) {
  const int64_t n = p.grad.n;
  const bool payload = p.grad.codes != nullptr;
  const bool dense = p.dense != nullptr;
  const bool has_s1 = p.state1 != nullptr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  for (int64_t v = tid; v < nvec; v += stride) {
    const int64_t i0 = v * kVec;
    float g[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (payload) {
      if constexpr (blockwise(C)) {
        const int64_t block = p.grad.block;
        int64_t blk = i0 / block;
        int64_t off = i0 - blk * block;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          g[j] = __ldg(p.grad.scales + blk);
          if (++off == block) ++blk, off = 0;
        }
      }
      Codes<C>::load(p.grad.codes, i0, 0.0f, g);
#pragma unroll
      for (int j = 0; j < kVec; ++j) g[j] = __fmul_rn(p.grad_scale, g[j]);  // never contracted into a later add
    }
    if (dense) {
      const float4 d = __ldg(reinterpret_cast<const float4*>(p.dense) + v);
      const float dv[kVec] = {d.x, d.y, d.z, d.w};
#pragma unroll
      for (int j = 0; j < kVec; ++j) g[j] = dense_term(p.dense_scale, dv[j], g[j], payload);
    }
    float4 pv = reinterpret_cast<float4*>(p.param)[v];
    float4 s1 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), s2 = s1;
    if (has_s1) s1 = reinterpret_cast<float4*>(p.state1)[v];
    if constexpr (K != OptimKind::kSGD) s2 = reinterpret_cast<float4*>(p.state2)[v];
    float pa[kVec] = {pv.x, pv.y, pv.z, pv.w};
    float ma[kVec] = {s1.x, s1.y, s1.z, s1.w};
    float va[kVec] = {s2.x, s2.y, s2.z, s2.w};
    if constexpr (kDC) {
      const float4 h = __ldg(reinterpret_cast<const float4*>(p.dc_held) + v);
      const float ha[kVec] = {h.x, h.y, h.z, h.w};
#pragma unroll
      for (int j = 0; j < kVec; ++j) g[j] = math::dc_compensate(g[j], p.dc_lambda, pa[j], ha[j]);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if constexpr (K == OptimKind::kAdam) {
        math::adam_step(p.opt, g[j], pa[j], ma[j], va[j]);
      } else if constexpr (K == OptimKind::kDelayedNesterov) {
        math::delayed_nesterov_step(p.opt, g[j], pa[j], ma[j], va[j]);
      } else {
        math::sgd_step(p.opt, g[j], pa[j], &ma[j]);
      }
    }
    reinterpret_cast<float4*>(p.param)[v] = make_float4(pa[0], pa[1], pa[2], pa[3]);
    if (has_s1) reinterpret_cast<float4*>(p.state1)[v] = make_float4(ma[0], ma[1], ma[2], ma[3]);
    if constexpr (K != OptimKind::kSGD) reinterpret_cast<float4*>(p.state2)[v] = make_float4(va[0], va[1], va[2], va[3]);
  }

  for (int64_t i = nvec * kVec + tid; i < n; i += stride) {
    float g = 0.0f;
    if (payload) {
      const float scale = blockwise(C) ? __ldg(p.grad.scales + i / p.grad.block) : 0.0f;
      g = __fmul_rn(p.grad_scale, Codes<C>::at(p.grad.codes, i, scale));
    }
    if (dense) g = dense_term(p.dense_scale, p.dense[i], g, payload);
    float pi = p.param[i];
    if constexpr (kDC) g = math::dc_compensate(g, p.dc_lambda, pi, __ldg(p.dc_held + i));
    float m = has_s1 ? p.state1[i] : 0.0f;
    float vv = K != OptimKind::kSGD ? p.state2[i] : 0.0f;
    if constexpr (K == OptimKind::kAdam) {
      math::adam_step(p.opt, g, pi, m, vv);
      p.state2[i] = vv;
    } else if constexpr (K == OptimKind::kDelayedNesterov) {
      math::delayed_nesterov_step(p.opt, g, pi, m, vv);
      p.state2[i] = vv;
    } else {
      math::sgd_step(p.opt, g, pi, &m);
    }
    p.param[i] = pi;
    if (has_s1) p.state1[i] = m;
  }
}

bool aligned(const void* ptr, uintptr_t bytes) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

template <Codec C, bool kDC>
void launch_for_optimizer(const ApplyParams& p, int64_t nvec, int blocks, cudaStream_t stream) {
  if (p.opt.kind == OptimKind::kAdam) {
    apply_kernel<C, OptimKind::kAdam, kDC><<<blocks, kThreads, 0, stream>>>(p, nvec);
  } else if (p.opt.kind == OptimKind::kDelayedNesterov) {
    apply_kernel<C, OptimKind::kDelayedNesterov, kDC><<<blocks, kThreads, 0, stream>>>(p, nvec);
  } else {
    apply_kernel<C, OptimKind::kSGD, kDC><<<blocks, kThreads, 0, stream>>>(p, nvec);
  }
  PYASYNC_CUDA_CHECK_LAUNCH();
}

template <Codec C>
void launch(const ApplyParams& p, cudaStream_t stream) {
  const int64_t n = p.grad.n;
  const bool dc = p.dc_lambda != 0.0f;
  const bool vec_ok = aligned(p.param, 16) && aligned(p.state1, 16) && aligned(p.state2, 16) &&
                      aligned(p.dense, 16) && aligned(p.grad.codes, sizeof(typename Codes<C>::vec)) &&
                      (!dc || aligned(p.dc_held, 16));
  const int64_t nvec = vec_ok ? n / kVec : 0;
  const int blocks = grid_for(nvec > 0 ? nvec : n);
  if (dc) {
    launch_for_optimizer<C, true>(p, nvec, blocks, stream);
  } else {
    launch_for_optimizer<C, false>(p, nvec, blocks, stream);
  }
}

}  // namespace

void apply_cuda(const ApplyParams& p, StreamHandle stream) {
  const Payload& g = p.grad;
  PYASYNC_CHECK_ARG(g.n >= 0, "apply: element count must be >= 0");
  if (g.n == 0) return;
  PYASYNC_CHECK_ARG(p.param != nullptr, "apply: param is null");
  PYASYNC_CHECK_ARG(g.codes != nullptr || p.dense != nullptr, "apply: needs a payload, a dense gradient or both");
  if (g.codes != nullptr && blockwise(g.codec))
    PYASYNC_CHECK_ARG(g.block > 0 && g.scales != nullptr, "apply: int8/sign payload needs block > 0 and scales");
  if (p.opt.kind == OptimKind::kAdam || p.opt.kind == OptimKind::kDelayedNesterov)
    PYASYNC_CHECK_ARG(p.state1 != nullptr && p.state2 != nullptr,
                      "apply: Adam and delayed Nesterov need state1 and state2");
  else if (p.opt.momentum != 0.0f)
    PYASYNC_CHECK_ARG(p.state1 != nullptr, "apply: SGD with momentum needs a momentum buffer");
  PYASYNC_CHECK_ARG(std::isfinite(p.dc_lambda) && p.dc_lambda >= 0.0f, "apply: dc_lambda must be finite and >= 0");
  PYASYNC_CHECK_ARG(p.dc_lambda == 0.0f || p.dc_held != nullptr, "apply: dc_lambda > 0 needs dc_held");
  const cudaStream_t s = as_stream(stream);
  PYASYNC_DISPATCH_INLINE_CODEC(g.codes == nullptr ? Codec::kNone : g.codec, return launch<C>(p, s));
}

}  // namespace pyasync
