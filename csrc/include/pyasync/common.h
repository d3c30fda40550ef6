// Shared definitions for the CPU and CUDA halves of the core. No torch, no pybind11 here.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define PYASYNC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PYASYNC_HOST_DEVICE inline
#endif

namespace pyasync {

// Element type of a bucket or tensor. Values are part of the Python <-> C++ contract (ops/_common.py).
enum class DType : int32_t {
  kFloat32 = 0,   // IEEE binary32
  kFloat16 = 1,   // IEEE binary16, stored as uint16_t bits
  kBFloat16 = 2,  // bfloat16, stored as uint16_t bits
};

// Wire encoding of a gradient slice. Values are part of the wire format (engine/wire.py) and of the
// Python <-> C++ contract (ops/_common.py): never renumber.
enum class Codec : int32_t {
  kNone = 0,  // raw fp32 values
  kFP16 = 1,  // fp16 cast
  kBF16 = 2,  // bf16 cast
  kInt8 = 3,  // blockwise absmax int8, fp32 scale per block
  kSign = 4,  // 1 bit per element (LSB first), fp32 scale (mean |x|) per block
  kTopK = 5,  // k int32 indices (ascending) + k fp32 values
};

inline int64_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Thrown for bad arguments that reach the core; pybind11 turns it into ValueError.
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

#define PYASYNC_CHECK_ARG(cond, msg)                                      \
  do {                                                                    \
    if (!(cond)) throw ::pyasync::ArgumentError(std::string("pyasync: ") + (msg)); \
  } while (0)

// Note [Inline codec dispatch]
// The fused apply decodes none, fp16, bf16, int8 and sign payloads inside its kernel, one template
// instance per codec; top-k is scattered into a dense gradient first (see Note [Fused apply]). This
// macro is the one switch from the runtime codec to the compile-time one, shared by the CPU and CUDA
// apply (the way apex's type_shim.h dispatches dtypes): inside the body (the macro's remaining
// arguments), the constexpr `C` is the codec.
// Any other codec throws ArgumentError naming it.
#define PYASYNC_DISPATCH_INLINE_CODEC(CODEC, ...)                                                    \
  do {                                                                                               \
    switch (CODEC) {                                                                                 \
      case ::pyasync::Codec::kNone: { constexpr ::pyasync::Codec C = ::pyasync::Codec::kNone; __VA_ARGS__; } \
      case ::pyasync::Codec::kFP16: { constexpr ::pyasync::Codec C = ::pyasync::Codec::kFP16; __VA_ARGS__; } \
      case ::pyasync::Codec::kBF16: { constexpr ::pyasync::Codec C = ::pyasync::Codec::kBF16; __VA_ARGS__; } \
      case ::pyasync::Codec::kInt8: { constexpr ::pyasync::Codec C = ::pyasync::Codec::kInt8; __VA_ARGS__; } \
      case ::pyasync::Codec::kSign: { constexpr ::pyasync::Codec C = ::pyasync::Codec::kSign; __VA_ARGS__; } \
      default:                                                                                       \
        throw ::pyasync::ArgumentError("pyasync: apply cannot decode codec id " +                     \
                                       std::to_string(static_cast<int>(CODEC)) +                      \
                                       " inline (top-k must be scattered into `dense` first)");      \
    }                                                                                                \
  } while (0)

// CPU thread count: `requested` > 0 wins, else set_num_threads(), else PYASYNC_NUM_THREADS, else
// the OpenMP default. Defined in csrc/cpu/threads.cpp.
int resolve_num_threads(int32_t requested);
void set_num_threads(int32_t n);
int get_num_threads();

}  // namespace pyasync
