// Device discovery for has_cuda() / cuda_device_count(): never throws, so a machine without a
// driver gets a clear Python error from pyasync/_ext.py instead of a crash.
#include <cuda_runtime.h>

#include "common.cuh"

namespace pyasync {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

}  // namespace pyasync
