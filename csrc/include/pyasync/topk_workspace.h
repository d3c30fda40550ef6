// Layout of the CUDA top-k scratch, shared by topk_workspace_bytes (csrc/cpu/topk.cpp, so a CPU-only
// build answers it too) and the kernels (csrc/cuda/topk.cu). See Note [CUDA top-k] in topk.cu.
#pragma once

#include <cstdint>

#include "pyasync/common.h"

namespace pyasync {

struct TopkWorkspace {
  static constexpr int64_t kTile = 4096;   // elements per compaction tile (256 threads x 16)
  static constexpr int kDigits = 3;        // radix digits of the 31-bit key: bits 30..20, 19..9, 8..0
  static constexpr int kBins = 2048;       // bins of the widest digit
  static constexpr int64_t kAlign = 256;   // byte alignment of every region

  int64_t tiles;    // compaction tiles, ceil(n / kTile)
  int64_t state;    // byte offset of the TopkState (select results, see topk.cu)
  int64_t hist;     // byte offset of kDigits * kBins uint32 histograms
  int64_t tile_gt;  // byte offset of `tiles` uint32: keys > T per tile, then their exclusive prefix
  int64_t tile_eq;  // byte offset of `tiles` uint32: keys == T per tile, then their exclusive prefix
  int64_t keys;     // byte offset of n uint32 keys (bit 31: v is not finite)
  int64_t bytes;    // total bytes

  explicit TopkWorkspace(int64_t n) {
    auto up = [](int64_t b) { return ceil_div(b, kAlign) * kAlign; };
    tiles = ceil_div(n, kTile);
    state = 0;
    hist = up(state + 256);
    tile_gt = up(hist + kDigits * kBins * 4);
    tile_eq = up(tile_gt + tiles * 4);
    keys = up(tile_eq + tiles * 4);
    bytes = up(keys + n * 4);
  }
};

}  // namespace pyasync
