// CUDA encode / decode of the gradient codecs. The formulas are in math/{cast,int8,sign,feedback}.h;
// these kernels only index and move memory. Top-k encode lives in topk.cu.
#include <cub/block/block_reduce.cuh>

#include <cstdint>

#include "common.cuh"
#include "pyasync/math/cast.h"
#include "pyasync/math/feedback.h"
#include "pyasync/math/int8.h"
#include "pyasync/math/sign.h"
#include "pyasync/params.h"

namespace pyasync {

// Note [CUDA block codecs]
// int8 and sign run one thread block (CTA) per quantisation block, with CUB BlockReduce for the
// absmax (an integer max over the bits of |v|: exact and order free) or the abs-sum (a fixed tree, so
// every run gives the same scale). A CTA reads the element window [base, end) where
//   s = first element of its block, len = its length, base = round_down(s, 8) (sign; int8: s),
//   end = min(round_up(s + len, 8), n)                                      (sign; int8: s + len)
// and owns the elements [s, s + len) (scale, codes, residual) and, for sign, the bytes j with
// s <= 8j < s + len: the byte that holds element 8j is written by the CTA of element 8j, which reads
// the sign of up to 7 elements of the next block to fill it. So no two CTAs write one byte, even when
// block % 8 != 0, and no atomics are needed. The bits are packed with __ballot_sync: the window starts
// on a multiple of 8, so the ballot of the 32 consecutive elements a warp holds is 4 whole bytes
// (element i is bit i % 8 of byte i / 8, which is the little-endian layout of the ballot word).
// Windows up to THREADS * ITEMS elements stay in registers between the reduction and the code pass
// (block 256 with 64 threads, up to ~1000 with 256 threads); larger blocks loop over the window
// twice (the second read mostly hits L2). The nonfinite flag is a plain store of 1 by any CTA that
// saw a bad element (every writer writes the same value): no atomics, no host sync.

namespace {

struct MaxU32 {
  __device__ __forceinline__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};

// The per-element encode of one owned element given the block scale: codes, residual; returns bad.
template <bool SIGN>
__device__ __forceinline__ bool encode_element(const EncodeParams& p, int64_t x, float v, float scale) {
  float d;
  if constexpr (SIGN) {
    d = math::sign_decode(math::sign_bit(v), scale);
  } else {
    const int8_t q = math::int8_quantize(v, scale);
    static_cast<int8_t*>(p.out.codes)[x] = q;
    d = math::int8_dequantize(q, scale);
  }
  if (p.residual_out != nullptr) p.residual_out[x] = math::ef_residual(v, d, p.residual_in[x]);
  return math::ef_bad(v, d);
}

__device__ __forceinline__ float load_v(const EncodeParams& p, int64_t x) {
  return p.residual_in != nullptr ? p.grad[x] + p.residual_in[x] : p.grad[x];
}

// Lanes 0..3 of a warp write the 4 bytes of its ballot word whose first element is x0 (x0 % 8 == 0)
// when this CTA owns them (s <= 8j < s + len).
__device__ __forceinline__ void store_ballot(uint8_t* bits, uint32_t word, int64_t x0, int64_t s, int64_t len) {
  const int lane = threadIdx.x & 31;
  if (lane < 4) {
    const int64_t first = x0 + 8 * lane;  // element 8j of byte j
    if (first >= s && first < s + len) bits[first >> 3] = static_cast<uint8_t>(word >> (8 * lane));
  }
}

template <bool SIGN, int THREADS, int ITEMS, bool REG>
__global__ void __launch_bounds__(THREADS) encode_block_kernel(EncodeParams p) {
  using Reduce = cub::BlockReduce<float, THREADS>;
  using ReduceU = cub::BlockReduce<uint32_t, THREADS>;
  __shared__ union {
    typename Reduce::TempStorage f;
    typename ReduceU::TempStorage u;
  } tmp;
  __shared__ float s_scale;
  const int64_t n = p.out.n;
  const int64_t block = p.out.block;
  const int64_t nblocks = (n + block - 1) / block;
  uint8_t* bits = static_cast<uint8_t*>(p.out.codes);
  bool bad = false;

  for (int64_t blk = blockIdx.x; blk < nblocks; blk += gridDim.x) {
    const int64_t s = blk * block;
    const int64_t len = min(block, n - s);
    const int64_t base = SIGN ? (s & ~int64_t(7)) : s;
    const int64_t end = SIGN ? min((s + len + 7) & ~int64_t(7), n) : s + len;

    // Pass 1: v of the window (kept in registers when it fits), partial absmax / abs-sum over owned.
    float v[REG ? ITEMS : 1];
    float part = 0.0f;
    uint32_t part_bits = 0;
    if constexpr (REG) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int64_t x = base + i * THREADS + threadIdx.x;
        v[i] = x < end ? load_v(p, x) : 0.0f;
        const bool own = x >= s && x < s + len;
        if (SIGN) part += own ? math::sign_abs_term(v[i]) : 0.0f;
        else part_bits = max(part_bits, own ? math::float_bits(math::int8_absmax_term(v[i])) : 0u);
      }
    } else {
      for (int64_t x = s + threadIdx.x; x < s + len; x += THREADS) {
        const float vx = load_v(p, x);
        if (SIGN) part += math::sign_abs_term(vx);
        else part_bits = max(part_bits, math::float_bits(math::int8_absmax_term(vx)));
      }
    }
    if constexpr (SIGN) {
      const float sum = Reduce(tmp.f).Sum(part);
      if (threadIdx.x == 0) s_scale = math::sign_scale(sum, len);
    } else {
      const uint32_t m = ReduceU(tmp.u).Reduce(part_bits, MaxU32());
      if (threadIdx.x == 0) s_scale = math::int8_scale(math::bits_float(m));
    }
    __syncthreads();
    const float scale = s_scale;
    if (threadIdx.x == 0) p.out.scales[blk] = scale;

    // Pass 2: codes, residual, bits.
    if constexpr (REG) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int64_t x = base + i * THREADS + threadIdx.x;
        if (x >= s && x < s + len) bad |= encode_element<SIGN>(p, x, v[i], scale);
        if constexpr (SIGN) {
          // Uniform per warp: x - threadIdx.x % 32 is the warp's first element.
          const int64_t x0 = x - (threadIdx.x & 31);
          if (x0 < end) {
            const uint32_t word = __ballot_sync(0xffffffffu, x < end && math::sign_bit(v[i]));
            store_ballot(bits, word, x0, s, len);
          }
        }
      }
    } else {
      for (int64_t x0 = base; x0 < end; x0 += THREADS) {  // the whole CTA iterates together
        const int64_t x = x0 + threadIdx.x;
        const float vx = x < end ? load_v(p, x) : 0.0f;
        if (x >= s && x < s + len) bad |= encode_element<SIGN>(p, x, vx, scale);
        if constexpr (SIGN) {
          const int64_t w0 = x - (threadIdx.x & 31);
          if (w0 < end) {
            const uint32_t word = __ballot_sync(0xffffffffu, x < end && math::sign_bit(vx));
            store_ballot(bits, word, w0, s, len);
          }
        }
      }
    }
    __syncthreads();  // s_scale and tmp are reused by the next block
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0 && p.nonfinite != nullptr) *p.nonfinite = 1;
}

// Cast codecs: 4 elements per thread with 16-byte loads / stores (8-byte code stores for 16-bit
// codes) when every pointer allows, else one element per thread.
template <DType D>
__device__ __forceinline__ bool encode_cast_one(const EncodeParams& p, int64_t i, float v) {
  using C = math::Convert<D>;
  using S = typename C::storage;
  const S c = C::store(v);
  const float d = C::load(c);
  static_cast<S*>(p.out.codes)[i] = c;
  if (p.residual_out != nullptr) p.residual_out[i] = math::ef_residual(v, d, p.residual_in[i]);
  return math::ef_bad(v, d);
}

template <typename S>
struct Quad;  // four codes, stored with one instruction
template <>
struct Quad<float> {
  using type = float4;
  static __device__ __forceinline__ float4 make(const float* c) { return make_float4(c[0], c[1], c[2], c[3]); }
};
template <>
struct Quad<uint16_t> {
  using type = uint2;
  static __device__ __forceinline__ uint2 make(const uint16_t* c) {
    return make_uint2(c[0] | (static_cast<uint32_t>(c[1]) << 16), c[2] | (static_cast<uint32_t>(c[3]) << 16));
  }
};

template <DType D>
__global__ void __launch_bounds__(kThreads) encode_cast_kernel(EncodeParams p, bool vec) {
  using C = math::Convert<D>;
  using S = typename C::storage;
  const int64_t n = p.out.n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool bad = false;
  int64_t tail = 0;
  if (vec) {
    const int64_t quads = n / 4;
    for (int64_t q = tid; q < quads; q += stride) {
      const float4 g = reinterpret_cast<const float4*>(p.grad)[q];
      float v[4] = {g.x, g.y, g.z, g.w};
      float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (p.residual_in != nullptr) {
        const float4 r = reinterpret_cast<const float4*>(p.residual_in)[q];
        e[0] = r.x; e[1] = r.y; e[2] = r.z; e[3] = r.w;
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = v[j] + e[j];
      }
      S c[4];
      float r[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        c[j] = C::store(v[j]);
        const float d = C::load(c[j]);
        r[j] = math::ef_residual(v[j], d, e[j]);
        bad |= math::ef_bad(v[j], d);
      }
      reinterpret_cast<typename Quad<S>::type*>(p.out.codes)[q] = Quad<S>::make(c);
      if (p.residual_out != nullptr) reinterpret_cast<float4*>(p.residual_out)[q] = make_float4(r[0], r[1], r[2], r[3]);
    }
    tail = quads * 4;
  }
  for (int64_t i = tail + tid; i < n; i += stride) bad |= encode_cast_one<D>(p, i, load_v(p, i));
  if (__syncthreads_or(bad) && threadIdx.x == 0 && p.nonfinite != nullptr) *p.nonfinite = 1;
}

// ---- decode

template <DType D>
__global__ void __launch_bounds__(kThreads) decode_cast_kernel(DecodeParams p) {
  using C = math::Convert<D>;
  using S = typename C::storage;
  const S* codes = static_cast<const S*>(p.in.codes);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.in.n; i += stride)
    p.out[i] = math::decode_store(p.out[i], p.alpha, C::load(codes[i]), p.accumulate);
}

template <bool SIGN>
__global__ void __launch_bounds__(kThreads) decode_block_kernel(DecodeParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint64_t block = static_cast<uint64_t>(p.in.block);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.in.n; i += stride) {
    const float scale = p.in.scales[static_cast<uint64_t>(i) / block];
    float d;
    if constexpr (SIGN) d = math::sign_decode(math::sign_get_bit(static_cast<const uint8_t*>(p.in.codes), i), scale);
    else d = math::int8_dequantize(static_cast<const int8_t*>(p.in.codes)[i], scale);
    p.out[i] = math::decode_store(p.out[i], p.alpha, d, p.accumulate);
  }
}

// Out-of-range indices are skipped: a corrupt payload never writes outside `out`.
__global__ void __launch_bounds__(kThreads) decode_topk_kernel(DecodeParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float* vals = static_cast<const float*>(p.in.codes);
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < p.in.k; j += stride) {
    const int64_t i = p.in.indices[j];
    if (i >= 0 && i < p.in.n) p.out[i] = math::decode_store(p.out[i], p.alpha, vals[j], p.accumulate);
  }
}

bool aligned(const void* ptr, int bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; }

template <bool SIGN>
void launch_encode_blocks(const EncodeParams& p, cudaStream_t st) {
  const int64_t block = p.out.block;
  const int64_t window = (SIGN && block % 8 != 0) ? block + 14 : block;  // see Note [CUDA block codecs]
  const int64_t nblocks = ceil_div(p.out.n, block);
  const int grid = static_cast<int>(nblocks < (1 << 20) ? nblocks : (1 << 20));
  if (window <= 64 * 4) {
    encode_block_kernel<SIGN, 64, 4, true><<<grid, 64, 0, st>>>(p);
  } else if (window <= 256 * 4) {
    encode_block_kernel<SIGN, 256, 4, true><<<grid, 256, 0, st>>>(p);
  } else {
    encode_block_kernel<SIGN, 256, 1, false><<<grid, 256, 0, st>>>(p);
  }
  PYASYNC_CUDA_CHECK_LAUNCH();
}

template <DType D>
void launch_encode_cast(const EncodeParams& p, cudaStream_t st) {
  const bool vec = aligned(p.grad, 16) && aligned(p.residual_in, 16) && aligned(p.residual_out, 16) &&
                   aligned(p.out.codes, D == DType::kFloat32 ? 16 : 8);
  encode_cast_kernel<D><<<grid_for(vec ? ceil_div(p.out.n, 4) : p.out.n), kThreads, 0, st>>>(p, vec);
  PYASYNC_CUDA_CHECK_LAUNCH();
}

}  // namespace

void encode_cuda(const EncodeParams& p, StreamHandle stream) {
  PYASYNC_CHECK_ARG(p.out.n >= 0, "element count must be >= 0");
  if (p.out.n == 0) return;
  PYASYNC_CHECK_ARG(p.grad != nullptr && p.out.codes != nullptr, "encode needs grad and codes");
  PYASYNC_CHECK_ARG(p.mask_out == nullptr || p.out.codec == Codec::kTopK, "mask_out is for the top-k codec only");
  const cudaStream_t st = as_stream(stream);
  switch (p.out.codec) {
    case Codec::kNone: return launch_encode_cast<DType::kFloat32>(p, st);
    case Codec::kFP16: return launch_encode_cast<DType::kFloat16>(p, st);
    case Codec::kBF16: return launch_encode_cast<DType::kBFloat16>(p, st);
    case Codec::kInt8:
      PYASYNC_CHECK_ARG(p.out.block > 0 && p.out.scales != nullptr, "int8 encode needs block > 0 and scales");
      return launch_encode_blocks<false>(p, st);
    case Codec::kSign:
      PYASYNC_CHECK_ARG(p.out.block > 0 && p.out.scales != nullptr, "sign encode needs block > 0 and scales");
      return launch_encode_blocks<true>(p, st);
    case Codec::kTopK: return topk_encode_cuda(p, stream);
  }
  PYASYNC_CHECK_ARG(false, "unknown codec");
}

void decode_cuda(const DecodeParams& p, StreamHandle stream) {
  PYASYNC_CHECK_ARG(p.in.n >= 0, "element count must be >= 0");
  if (p.in.n == 0) return;
  PYASYNC_CHECK_ARG(p.out != nullptr && p.in.codes != nullptr, "decode needs codes and out");
  const cudaStream_t st = as_stream(stream);
  const int grid = grid_for(p.in.n);
  switch (p.in.codec) {
    case Codec::kNone: decode_cast_kernel<DType::kFloat32><<<grid, kThreads, 0, st>>>(p); break;
    case Codec::kFP16: decode_cast_kernel<DType::kFloat16><<<grid, kThreads, 0, st>>>(p); break;
    case Codec::kBF16: decode_cast_kernel<DType::kBFloat16><<<grid, kThreads, 0, st>>>(p); break;
    case Codec::kInt8:
    case Codec::kSign:
      PYASYNC_CHECK_ARG(p.in.block > 0 && p.in.scales != nullptr, "int8/sign decode needs block > 0 and scales");
      if (p.in.codec == Codec::kSign) decode_block_kernel<true><<<grid, kThreads, 0, st>>>(p);
      else decode_block_kernel<false><<<grid, kThreads, 0, st>>>(p);
      break;
    case Codec::kTopK:
      PYASYNC_CHECK_ARG(p.in.k >= 1 && p.in.k <= p.in.n && p.in.indices != nullptr, "top-k decode needs 1 <= k <= n");
      if (!p.accumulate) PYASYNC_CUDA_CHECK(cudaMemsetAsync(p.out, 0, static_cast<size_t>(p.in.n) * sizeof(float), st));
      decode_topk_kernel<<<grid_for(p.in.k), kThreads, 0, st>>>(p);
      break;
  }
  PYASYNC_CUDA_CHECK_LAUNCH();
}

}  // namespace pyasync
