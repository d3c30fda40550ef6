// Helpers shared by the CUDA launchers: error checks, grid sizing, the vector width.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "pyasync/common.h"
#include "pyasync/launchers.h"

namespace pyasync {

// Every CUDA call and launch is checked; failures become a C++ exception -> Python RuntimeError.
#define PYASYNC_CUDA_CHECK(expr)                                                                 \
  do {                                                                                           \
    cudaError_t err__ = (expr);                                                                  \
    if (err__ != cudaSuccess) {                                                                  \
      throw std::runtime_error(std::string("pyasync CUDA error: ") + cudaGetErrorString(err__) + \
                               " at " __FILE__ ":" + std::to_string(__LINE__));                  \
    }                                                                                            \
  } while (0)

#define PYASYNC_CUDA_CHECK_LAUNCH() PYASYNC_CUDA_CHECK(cudaGetLastError())

inline cudaStream_t as_stream(StreamHandle s) { return reinterpret_cast<cudaStream_t>(s); }

constexpr int kThreads = 256;  // threads per block for elementwise kernels

// Blocks for an elementwise grid-stride kernel over n items: enough to fill the GPU, never 0.
inline int grid_for(int64_t n, int threads = kThreads) {
  int64_t blocks = ceil_div(n > 0 ? n : 1, threads);
  const int64_t cap = 65535LL * 8;
  return static_cast<int>(blocks < cap ? blocks : cap);
}

}  // namespace pyasync
