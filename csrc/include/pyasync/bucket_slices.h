// Host-side geometry of unflatten, shared by the CPU and CUDA launchers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "pyasync/common.h"
#include "pyasync/params.h"

namespace pyasync {

// Note [Unflatten pieces]
// Tensor i covers bucket elements [offsets[i], offsets[i] + numels[i]); the slice held at `src`
// covers [begin, end). Each tensor overlapping the slice gets one contiguous piece: `len` elements
// read from src + (lo - begin) and written to dsts[i] + (lo - offsets[i]), with [lo, hi) the
// overlap. Tensors outside the slice are skipped. Calls f(src_bytes, dst_bytes, len) per piece.
template <typename F>
void for_each_unflatten_piece(const UnflattenParams& p, F&& f) {
  PYASYNC_CHECK_ARG(p.count >= 0, "unflatten: negative tensor count");
  PYASYNC_CHECK_ARG(0 <= p.begin && p.begin <= p.end, "unflatten: needs 0 <= begin <= end");
  const int64_t ss = dtype_size(p.src_dtype);
  const int64_t ds = dtype_size(p.dst_dtype);
  for (int32_t i = 0; i < p.count; ++i) {
    const int64_t lo = std::max(p.offsets[i], p.begin);
    const int64_t hi = std::min(p.offsets[i] + p.numels[i], p.end);
    if (lo >= hi) continue;  // tensor i does not overlap the slice
    PYASYNC_CHECK_ARG(p.src != nullptr && p.dsts[i] != 0, "unflatten: null source or destination");
    f(static_cast<const unsigned char*>(p.src) + (lo - p.begin) * ss,
      reinterpret_cast<unsigned char*>(p.dsts[i]) + (lo - p.offsets[i]) * ds, hi - lo);
  }
}

}  // namespace pyasync
