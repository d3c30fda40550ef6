// Top-k by magnitude with error feedback on the GPU: a three-digit radix select with shared-memory
// histograms, then a stable tiled compaction. See Note [Top-k selection] (math/topk.h) for the
// semantics and Note [CUDA top-k] below for the method.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <limits>

#include "common.cuh"
#include "pyasync/math/topk.h"
#include "pyasync/params.h"
#include "pyasync/topk_workspace.h"

namespace pyasync {

// Note [CUDA top-k]
// All scratch lives in the caller's workspace (layout: TopkWorkspace in pyasync/topk_workspace.h),
// every launch goes on the caller's stream, and nothing synchronises with the host: grids are sized
// from n alone and every data-dependent count stays on the device (in TopkState).
//  1. prepare: v = g + e, the residual store (v, or e where v is not finite), keys[i] = topk_key(v)
//     (bit 31 set where v is not finite: the key bits are then 0), the non-finite flag, and the
//     histogram of digit 0 (key bits 30..20) in shared memory, flushed with global atomics.
//  2. select (one block): the bin holding the rank-th largest key, by a block scan over the bins
//     from the top; it appends the bin to the key prefix and makes rank relative to that bin.
//  3. hist: digit 1 (bits 19..9), then digit 2 (bits 8..0), over the keys that match the prefix,
//     each followed by select. After digit 2 the prefix is the k-th largest key T and rank is the
//     number q of keys == T to keep.
//  4. count: per tile of 4096 elements, the number of keys > T and == T (packed in one uint32).
//  5. scan_tiles (one block): exclusive prefix sums of both counts over the tiles.
//  6. write: per tile, a block scan gives every element the number of keys > T and == T before it;
//     element i with key > T goes to slot gt_before + min(eq_before, q), a tie with
//     eq_before < q to gt_before + eq_before: kept elements land in ascending index order, ties
//     kept lowest index first. It writes index and v and zeroes the residual at kept finite v.
// Memory traffic: read g, e; write e', keys (prepare); keys three more times (two hist passes, count,
// write: four reads of 4n bytes); O(k) output.

namespace {

constexpr int kTopkThreads = 256;                     // threads of every tiled / histogram block
constexpr int kItems = static_cast<int>(TopkWorkspace::kTile / kTopkThreads);  // elements per thread and tile
constexpr int kSelectItems = TopkWorkspace::kBins / kTopkThreads;  // bins per thread in select
constexpr uint32_t kKeyMask = 0x7fffffffu;            // key bits of a stored key
constexpr uint32_t kBadBit = 0x80000000u;             // stored-key flag: v is not finite

// Radix digits d = 0, 1, 2, most significant first: key bits 30..20, 19..9, 8..0.
__host__ __device__ __forceinline__ int digit_shift(int d) { return d == 0 ? 20 : (d == 1 ? 9 : 0); }
__host__ __device__ __forceinline__ int digit_width(int d) { return d == 2 ? 9 : 11; }

// Select results, in the workspace.
struct TopkState {
  uint32_t prefix;  // digits of T found so far (after digit 2: T itself)
  uint32_t rank;    // rank of the k-th largest key among keys with that prefix (after digit 2: ties kept)
};

static_assert(sizeof(TopkState) <= 256, "TopkState must fit the workspace's state region");
static_assert(kItems == 16 && kSelectItems == 8, "tile and bin split");

__device__ __forceinline__ void flush_hist(const uint32_t* sh, uint32_t* global, int bins) {
  for (int j = threadIdx.x; j < bins; j += blockDim.x) {
    const uint32_t c = sh[j];
    if (c != 0) atomicAdd(global + j, c);
  }
}

// Step 1. See Note [CUDA top-k].
__global__ void topk_prepare_kernel(const float* __restrict__ g, const float* e, float* ro, uint32_t* keys,
                                    uint32_t* hist, int32_t* nonfinite, int64_t n) {
  __shared__ uint32_t sh[TopkWorkspace::kBins];
  for (int j = threadIdx.x; j < TopkWorkspace::kBins; j += blockDim.x) sh[j] = 0;
  __syncthreads();
  bool bad_seen = false;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float gi = g[i];
    const float ei = e != nullptr ? e[i] : 0.0f;
    const float v = e != nullptr ? gi + ei : gi;
    if (ro != nullptr) ro[i] = math::topk_residual(v, ei, false);
    const bool bad = !math::is_finite(v);
    const uint32_t key = math::topk_key(v);
    keys[i] = bad ? kBadBit : key;
    bad_seen = bad_seen || bad;
    atomicAdd(&sh[key >> digit_shift(0)], 1u);
  }
  if (bad_seen && nonfinite != nullptr) *nonfinite = 1;
  __syncthreads();
  flush_hist(sh, hist, 1 << digit_width(0));
}

// Step 3: histogram of digit `d` (1 or 2) over the keys whose higher digits equal the prefix.
__global__ void topk_hist_kernel(const uint32_t* __restrict__ keys, uint32_t* hist, const TopkState* st, int d,
                                 int64_t n) {
  __shared__ uint32_t sh[TopkWorkspace::kBins];
  const int bins = 1 << digit_width(d);
  for (int j = threadIdx.x; j < bins; j += blockDim.x) sh[j] = 0;
  __syncthreads();
  const uint32_t prefix = st->prefix;
  const int prev_shift = digit_shift(d - 1), shift = digit_shift(d);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t key = keys[i] & kKeyMask;
    if ((key >> prev_shift) == prefix) atomicAdd(&sh[(key >> shift) & (bins - 1)], 1u);
  }
  __syncthreads();
  flush_hist(sh, hist, bins);
}

// Step 2: one block finds the bin of digit `d` holding the rank-th largest key (rank = k for d = 0).
__global__ void topk_select_kernel(const uint32_t* hist, TopkState* st, int d, uint32_t k) {
  using Scan = cub::BlockScan<uint32_t, kTopkThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int bins = 1 << digit_width(d);
  const uint32_t rank = d == 0 ? k : st->rank;
  const uint32_t prefix = d == 0 ? 0u : st->prefix;
  uint32_t c[kSelectItems];
  uint32_t sum = 0;
  for (int j = 0; j < kSelectItems; ++j) {  // thread t holds bins from the top: bins-1-8t, ...
    const int bin = bins - 1 - (static_cast<int>(threadIdx.x) * kSelectItems + j);
    c[j] = bin >= 0 ? hist[bin] : 0u;
    sum += c[j];
  }
  uint32_t before = 0;
  Scan(tmp).ExclusiveSum(sum, before);  // keys in higher bins than this thread's first
  for (int j = 0; j < kSelectItems; ++j) {
    if (rank > before && rank <= before + c[j]) {
      const uint32_t bin = static_cast<uint32_t>(bins - 1 - (static_cast<int>(threadIdx.x) * kSelectItems + j));
      st->prefix = (prefix << digit_width(d)) | bin;
      st->rank = rank - before;
    }
    before += c[j];
  }
}

// The kItems stored keys of elements [first, first + kItems), 0 past n (callers stop at n).
__device__ __forceinline__ void load_tile_keys(const uint32_t* keys, int64_t first, int64_t n, uint32_t (&k)[kItems]) {
  if (first + kItems <= n) {
    const uint4* src = reinterpret_cast<const uint4*>(keys + first);
#pragma unroll
    for (int q = 0; q < kItems / 4; ++q) {
      const uint4 w = src[q];
      k[4 * q] = w.x;
      k[4 * q + 1] = w.y;
      k[4 * q + 2] = w.z;
      k[4 * q + 3] = w.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kItems; ++j) k[j] = first + j < n ? keys[first + j] : 0u;
  }
}

// Packed per-thread counts: (keys > T) << 16 | (keys == T); each part is at most kTile < 2^16.
__device__ __forceinline__ uint32_t count_packed(const uint32_t (&k)[kItems], int64_t first, int64_t n, uint32_t t) {
  uint32_t packed = 0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (first + j >= n) break;
    const uint32_t key = k[j] & kKeyMask;
    packed += key > t ? (1u << 16) : (key == t ? 1u : 0u);
  }
  return packed;
}

// Step 4.
__global__ void topk_count_kernel(const uint32_t* __restrict__ keys, const TopkState* st, uint32_t* tile_gt,
                                  uint32_t* tile_eq, int64_t n) {
  using Reduce = cub::BlockReduce<uint32_t, kTopkThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * TopkWorkspace::kTile + threadIdx.x * kItems;
  uint32_t k[kItems];
  load_tile_keys(keys, first, n, k);
  const uint32_t total = Reduce(tmp).Sum(count_packed(k, first, n, st->prefix));
  if (threadIdx.x == 0) {
    tile_gt[blockIdx.x] = total >> 16;
    tile_eq[blockIdx.x] = total & 0xffffu;
  }
}

// Step 5: one block of 1024 threads; exclusive scans of both tile counts, in place.
// __launch_bounds__ caps the registers at 64 per thread so that the block fits an SM's 65536: without
// it nvcc 13.0 gives this kernel 92 registers for sm_90 (the 64-bit BlockScan), and every launch
// fails with "too many resources requested for launch".
constexpr int kScanThreads = 1024;
__global__ void __launch_bounds__(kScanThreads)
    topk_scan_tiles_kernel(uint32_t* tile_gt, uint32_t* tile_eq, int64_t tiles) {
  using Scan = cub::BlockScan<unsigned long long, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  unsigned long long carry = 0;  // (gt << 32) | eq before this round; both < 2^31
  for (int64_t base = 0; base < tiles; base += kScanThreads) {
    const int64_t i = base + threadIdx.x;
    const unsigned long long x =
        i < tiles ? (static_cast<unsigned long long>(tile_gt[i]) << 32) | tile_eq[i] : 0ull;
    unsigned long long before = 0, aggregate = 0;
    Scan(tmp).ExclusiveSum(x, before, aggregate);
    if (i < tiles) {
      tile_gt[i] = static_cast<uint32_t>((carry + before) >> 32);
      tile_eq[i] = static_cast<uint32_t>(carry + before);
    }
    carry += aggregate;
    __syncthreads();  // tmp is reused by the next round
  }
}

// Step 6.
__global__ void topk_write_kernel(const uint32_t* __restrict__ keys, const TopkState* st, const uint32_t* tile_gt,
                                  const uint32_t* tile_eq, const float* g, const float* e, float* ro, float* values,
                                  int32_t* indices, float* mask, int64_t n) {
  using Scan = cub::BlockScan<uint32_t, kTopkThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const uint32_t t = st->prefix, q = st->rank;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * TopkWorkspace::kTile + threadIdx.x * kItems;
  uint32_t k[kItems];
  load_tile_keys(keys, first, n, k);
  uint32_t before = 0;
  Scan(tmp).ExclusiveSum(count_packed(k, first, n, t), before);
  uint32_t gt = tile_gt[blockIdx.x] + (before >> 16);  // keys > T before this element
  uint32_t eq = tile_eq[blockIdx.x] + (before & 0xffffu);  // keys == T before this element
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (first + j >= n) break;
    const uint32_t key = k[j] & kKeyMask;
    const bool is_gt = key > t, is_eq = key == t;
    const bool keep = is_gt || (is_eq && eq < q);
    if (keep) {
      const int64_t i = first + j;
      const uint32_t slot = gt + (eq < q ? eq : q);
      // v: the residual holds it unless v is not finite (then it holds e, and v = g + e).
      const bool bad = (k[j] & kBadBit) != 0;
      float v;
      if (ro != nullptr)
        v = bad ? g[i] + ro[i] : ro[i];
      else
        v = e != nullptr ? g[i] + e[i] : g[i];
      indices[slot] = static_cast<int32_t>(i);
      values[slot] = v;
      if (ro != nullptr) ro[i] = math::topk_residual(v, ro[i], true);
      if (mask != nullptr && !bad) mask[i] = 0.0f;  // factor masking: Note [Momentum correction for top-k]
    }
    gt += is_gt ? 1u : 0u;
    eq += is_eq ? 1u : 0u;
  }
}

// Blocks for a grid-stride pass over n elements: enough to fill the GPU, no more (each block
// flushes a 2048-bin histogram with global atomics).
int stream_grid(int64_t n) {
  int device = 0, sms = 0;
  PYASYNC_CUDA_CHECK(cudaGetDevice(&device));
  PYASYNC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t want = ceil_div(n, static_cast<int64_t>(kTopkThreads) * 8);
  const int64_t cap = static_cast<int64_t>(sms > 0 ? sms : 1) * 8;
  return static_cast<int>(want < cap ? (want > 0 ? want : 1) : cap);
}

}  // namespace

void topk_encode_cuda(const EncodeParams& p, StreamHandle stream) {
  const int64_t n = p.out.n, k = p.out.k;
  PYASYNC_CHECK_ARG(p.out.codec == Codec::kTopK, "topk_encode_cuda needs codec kTopK");
  PYASYNC_CHECK_ARG(n >= 1 && n <= std::numeric_limits<int32_t>::max(),
                    "top-k needs 1 <= n <= 2^31 - 1 elements (indices are int32)");
  PYASYNC_CHECK_ARG(k >= 1 && k <= n, "top-k needs 1 <= k <= n");
  PYASYNC_CHECK_ARG(p.grad != nullptr && p.out.codes != nullptr && p.out.indices != nullptr,
                    "top-k needs grad, codes (values) and indices");
  PYASYNC_CHECK_ARG(p.residual_out == nullptr || p.residual_in != nullptr, "residual_out given without residual_in");
  const TopkWorkspace ws(n);
  PYASYNC_CHECK_ARG(p.workspace != nullptr && p.workspace_bytes >= ws.bytes,
                    "top-k on CUDA needs a workspace of topk_workspace_bytes(n, k) = " + std::to_string(ws.bytes) +
                        " bytes, got " + std::to_string(p.workspace_bytes));
  const cudaStream_t s = as_stream(stream);
  char* base = static_cast<char*>(p.workspace);
  auto* st = reinterpret_cast<TopkState*>(base + ws.state);
  auto* hist = reinterpret_cast<uint32_t*>(base + ws.hist);
  auto* tile_gt = reinterpret_cast<uint32_t*>(base + ws.tile_gt);
  auto* tile_eq = reinterpret_cast<uint32_t*>(base + ws.tile_eq);
  auto* keys = reinterpret_cast<uint32_t*>(base + ws.keys);
  const int grid = stream_grid(n);
  const unsigned tiles = static_cast<unsigned>(ws.tiles);

  PYASYNC_CUDA_CHECK(cudaMemsetAsync(base, 0, static_cast<size_t>(ws.tile_gt), s));  // state + histograms
  topk_prepare_kernel<<<grid, kTopkThreads, 0, s>>>(p.grad, p.residual_in, p.residual_out, keys, hist, p.nonfinite,
                                                   n);
  PYASYNC_CUDA_CHECK_LAUNCH();
  topk_select_kernel<<<1, kTopkThreads, 0, s>>>(hist, st, 0, static_cast<uint32_t>(k));
  PYASYNC_CUDA_CHECK_LAUNCH();
  for (int d = 1; d < 3; ++d) {
    uint32_t* h = hist + d * TopkWorkspace::kBins;
    topk_hist_kernel<<<grid, kTopkThreads, 0, s>>>(keys, h, st, d, n);
    PYASYNC_CUDA_CHECK_LAUNCH();
    topk_select_kernel<<<1, kTopkThreads, 0, s>>>(h, st, d, 0u);
    PYASYNC_CUDA_CHECK_LAUNCH();
  }
  topk_count_kernel<<<tiles, kTopkThreads, 0, s>>>(keys, st, tile_gt, tile_eq, n);
  PYASYNC_CUDA_CHECK_LAUNCH();
  topk_scan_tiles_kernel<<<1, kScanThreads, 0, s>>>(tile_gt, tile_eq, ws.tiles);
  PYASYNC_CUDA_CHECK_LAUNCH();
  topk_write_kernel<<<tiles, kTopkThreads, 0, s>>>(keys, st, tile_gt, tile_eq, p.grad, p.residual_in,
                                                  p.residual_out, static_cast<float*>(p.out.codes), p.out.indices, p.mask_out,
                                                  n);
  PYASYNC_CUDA_CHECK_LAUNCH();
}

namespace {

__global__ void dgc_velocity_kernel(VelocityParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += stride) {
    const float g = p.grad[i];
    const float un = math::dgc_velocity(p.u_in[i], g, p.mu);
    p.u_out[i] = un;
    if (p.x_out != nullptr) p.x_out[i] = math::dgc_accumulated(un, g, p.mu, p.nesterov);
  }
}

}  // namespace

void dgc_velocity_cuda(const VelocityParams& p, StreamHandle stream) {
  PYASYNC_CHECK_ARG(p.n >= 0, "element count must be >= 0");
  PYASYNC_CHECK_ARG(p.grad != nullptr && p.u_in != nullptr && p.u_out != nullptr, "the velocity step needs grad, u_in and u_out");
  PYASYNC_CHECK_ARG(p.x_out != nullptr || !p.nesterov, "a Nesterov velocity step needs x_out");
  if (p.n == 0) return;
  dgc_velocity_kernel<<<grid_for(p.n), kThreads, 0, as_stream(stream)>>>(p);
  PYASYNC_CUDA_CHECK_LAUNCH();
}

}  // namespace pyasync
