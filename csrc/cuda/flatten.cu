// Multi-tensor flatten / unflatten on CUDA, the apex multi_tensor_apply way.
// Semantics: see Note [Bucket copies] in csrc/cpu/flatten.cpp. Launch scheme: Note [Copy tables].
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.cuh"
#include "pyasync/bucket_slices.h"
#include "pyasync/math/cast.h"
#include "pyasync/params.h"

namespace pyasync {
namespace {

// Note [Copy tables]
// Both ops reduce to "copy n_k elements from src_k to dst_k, converting (and for flatten scaling
// and checking)" for a list of (src, dst, n) entries: flatten has one entry per tensor, unflatten one
// per tensor overlapping [begin, end), with the pointers already moved to the overlap. Entries are
// cut into chunks of kChunk elements, one chunk per block. A CopyTable holding up to kMaxEntries
// entries and kMaxBlocks (entry, chunk) pairs travels BY VALUE in the kernel arguments (~2.5 KB,
// under the 4 KB limit), so a launch needs no host-to-device copy and no allocation; the host fills
// tables and launches whenever one is full, an entry cut by a full table continuing as entry 0 of
// the next (apex's multi_tensor_apply). One generic kernel reads its (entry, chunk), then runs the
// functor over the chunk: 16-byte vector loads/stores when both pointers are aligned (float4, or 8
// halves), kIlp of them in flight per thread, a guarded scalar tail, and a plain scalar loop for
// misaligned entries (e.g. an fp32 tensor at an odd bucket offset). Element counts and
// chunk starts are int64. Nine kernels in all (src dtype x dst dtype); scaling and the non-finite
// check are runtime flags, uniform per launch, so they cost no extra instantiations.

constexpr int kMaxEntries = 36;      // tensors per launch
constexpr int kMaxBlocks = 320;      // chunks (blocks) per launch
constexpr int64_t kChunk = 65536;    // elements per block
constexpr int kBlockThreads = 512;   // threads per block
constexpr int kIlp = 4;              // vectors each thread loads before it stores

struct CopyTable {
  const void* src[kMaxEntries];    // first source element of each entry; null: write zeros
  void* dst[kMaxEntries];          // first destination element of each entry
  int64_t n[kMaxEntries];          // elements of each entry
  uint8_t block_entry[kMaxBlocks];  // entry that block b copies
  int32_t block_chunk[kMaxBlocks];  // chunk of that entry that block b copies
};
static_assert(sizeof(CopyTable) + 32 <= 4096, "kernel arguments must stay under 4 KB");

// Per-element conversion: dst = store_D(load_S(x) [* scale]); flags NaN/Inf source values.
template <DType S, DType D>
struct CopyOp {
  using TS = typename math::Convert<S>::storage;  // source element storage
  using TD = typename math::Convert<D>::storage;  // destination element storage
  float scale;                                     // multiplies every value when use_scale
  bool use_scale;                                  // false: plain converting copy (scale == 1)
  int32_t* nonfinite;                              // nullable; set to 1 when a source is NaN/Inf

  PYASYNC_HOST_DEVICE TD operator()(TS x, bool& bad) const {
    float v = math::Convert<S>::load(x);
    bad |= !math::is_finite(v);
    if (use_scale) v *= scale;
    return math::Convert<D>::store(v);
  }
};

// N elements of T in one aligned access (16 bytes for the wider of the two element types).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// The share of thread `tid` (of `threads`) of block `block` in a multi_tensor_copy launch: its chunk
// of the block's entry. Returns true when it read a NaN/Inf source value. Host-callable as well, so
// the indexing (vector body, ILP guard, tail, misaligned and zero paths) can be exercised on a
// machine without a GPU by running every (block, tid) pair in turn.
template <typename Op>
PYASYNC_HOST_DEVICE bool copy_chunk(const CopyTable& t, const Op& op, int block, int64_t tid,
                                    int64_t threads) {
  using TS = typename Op::TS;
  using TD = typename Op::TD;
  constexpr int kWide = sizeof(TS) > sizeof(TD) ? sizeof(TS) : sizeof(TD);
  constexpr int kVec = 16 / kWide;  // 4 for any fp32 side, 8 when both sides are 16-bit

  const int e = t.block_entry[block];
  const int64_t start = static_cast<int64_t>(t.block_chunk[block]) * kChunk;
  const int64_t left = t.n[e] - start;
  const int64_t n = left < kChunk ? left : kChunk;
  TD* dst = static_cast<TD*>(t.dst[e]) + start;
  const TS* src = t.src[e] != nullptr ? static_cast<const TS*>(t.src[e]) + start : nullptr;

  bool bad = false;
  int64_t done = 0;  // elements handled by the vector path
  const bool dst_vec = reinterpret_cast<uintptr_t>(dst) % (sizeof(TD) * kVec) == 0;
  if (src == nullptr) {  // zeros
    if (dst_vec) {
      const int64_t nv = n / kVec;
      const Vec<TD, kVec> z{};
      for (int64_t i = tid; i < nv; i += threads) reinterpret_cast<Vec<TD, kVec>*>(dst)[i] = z;
      done = nv * kVec;
    }
    for (int64_t i = done + tid; i < n; i += threads) dst[i] = TD(0);
    return false;
  }
  if (dst_vec && reinterpret_cast<uintptr_t>(src) % (sizeof(TS) * kVec) == 0) {
    const int64_t nv = n / kVec;
    const auto* in = reinterpret_cast<const Vec<TS, kVec>*>(src);
    auto* out = reinterpret_cast<Vec<TD, kVec>*>(dst);
    // kIlp coalesced vector loads in flight per thread before the first store (apex's ILP).
    for (int64_t base = tid; base < nv; base += threads * kIlp) {
      Vec<TS, kVec> a[kIlp];
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int64_t i = base + j * threads;
        if (i < nv) a[j] = in[i];
      }
#pragma unroll
      for (int j = 0; j < kIlp; ++j) {
        const int64_t i = base + j * threads;
        if (i < nv) {
          Vec<TD, kVec> b;
#pragma unroll
          for (int k = 0; k < kVec; ++k) b.v[k] = op(a[j].v[k], bad);
          out[i] = b;
        }
      }
    }
    done = nv * kVec;
  }
  for (int64_t i = done + tid; i < n; i += threads) dst[i] = op(src[i], bad);  // tail, or all if misaligned
  return bad;
}

template <typename Op>
__global__ void __launch_bounds__(kBlockThreads) multi_tensor_copy(CopyTable t, Op op) {
  const bool bad = copy_chunk(t, op, static_cast<int>(blockIdx.x), threadIdx.x, blockDim.x);
  // op.nonfinite is uniform across the block, so every thread reaches the barrier or none does.
  if (op.nonfinite != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) *op.nonfinite = 1;
}

// One entry of the copy list: n elements from src (null: zeros) to dst.
struct Entry {
  const void* src;  // first source element, or null
  void* dst;        // first destination element
  int64_t n;        // elements
};

// Fills copy tables from the entry list and calls launch(table, blocks) for each full (or the last)
// table; see Note [Copy tables]. Host only, no CUDA calls: the launch is the caller's.
template <typename Launch>
void for_each_table(const std::vector<Entry>& entries, Launch&& launch) {
  CopyTable t;
  int slot = 0;    // next free entry slot in t
  int blocks = 0;  // blocks filled in t
  auto flush = [&] {
    launch(t, blocks);  // the kernel takes t by value: the slots may be reused right after
    blocks = 0;
  };
  for (const Entry& e : entries) {
    const int64_t chunks = ceil_div(e.n, kChunk);
    PYASYNC_CHECK_ARG(chunks <= INT32_MAX, "flatten: tensor too large for one launch table");
    t.src[slot] = e.src;
    t.dst[slot] = e.dst;
    t.n[slot] = e.n;
    for (int64_t c = 0; c < chunks; ++c) {
      t.block_entry[blocks] = static_cast<uint8_t>(slot);
      t.block_chunk[blocks] = static_cast<int32_t>(c);
      if (++blocks == kMaxBlocks) {
        flush();
        if (c + 1 < chunks) {  // this entry goes on as slot 0 of the next table
          t.src[0] = t.src[slot];
          t.dst[0] = t.dst[slot];
          t.n[0] = t.n[slot];
          slot = 0;
        } else {
          slot = -1;  // entry finished with the table: the next one starts at slot 0
        }
      }
    }
    if (++slot == kMaxEntries) {
      if (blocks > 0) flush();
      slot = 0;
    }
  }
  if (blocks > 0) flush();
}

template <DType S, DType D>
void launch_copies(const std::vector<Entry>& entries, CopyOp<S, D> op, cudaStream_t stream) {
  for_each_table(entries, [&](const CopyTable& t, int blocks) {
    multi_tensor_copy<<<blocks, kBlockThreads, 0, stream>>>(t, op);
    PYASYNC_CUDA_CHECK_LAUNCH();
  });
}

template <DType S, DType D>
void run(const std::vector<Entry>& entries, float scale, bool use_scale, int32_t* nonfinite, cudaStream_t s) {
  launch_copies<S, D>(entries, CopyOp<S, D>{scale, use_scale, nonfinite}, s);
}

template <DType S>
void dispatch_dst(DType d, const std::vector<Entry>& e, float scale, bool use_scale, int32_t* nf,
                  cudaStream_t s) {
  switch (d) {
    case DType::kFloat32: return run<S, DType::kFloat32>(e, scale, use_scale, nf, s);
    case DType::kFloat16: return run<S, DType::kFloat16>(e, scale, use_scale, nf, s);
    case DType::kBFloat16: return run<S, DType::kBFloat16>(e, scale, use_scale, nf, s);
  }
  throw ArgumentError("pyasync: unknown destination dtype");
}

void dispatch(DType sd, DType dd, const std::vector<Entry>& e, float scale, bool use_scale, int32_t* nf,
              cudaStream_t s) {
  if (e.empty()) return;
  switch (sd) {
    case DType::kFloat32: return dispatch_dst<DType::kFloat32>(dd, e, scale, use_scale, nf, s);
    case DType::kFloat16: return dispatch_dst<DType::kFloat16>(dd, e, scale, use_scale, nf, s);
    case DType::kBFloat16: return dispatch_dst<DType::kBFloat16>(dd, e, scale, use_scale, nf, s);
  }
  throw ArgumentError("pyasync: unknown source dtype");
}

}  // namespace

void flatten_cuda(const FlattenParams& p, StreamHandle stream) {
  PYASYNC_CHECK_ARG(p.count >= 0, "flatten: negative tensor count");
  const int64_t ds = dtype_size(p.dst_dtype);
  std::vector<Entry> entries;
  entries.reserve(static_cast<size_t>(p.count));
  for (int32_t i = 0; i < p.count; ++i) {
    const int64_t n = p.numels[i];
    if (n == 0) continue;
    PYASYNC_CHECK_ARG(p.bucket != nullptr, "flatten: null bucket");
    entries.push_back(Entry{reinterpret_cast<const void*>(p.srcs[i]),
                            static_cast<unsigned char*>(p.bucket) + p.offsets[i] * ds, n});
  }
  dispatch(p.src_dtype, p.dst_dtype, entries, p.scale, p.scale != 1.0f, p.nonfinite, as_stream(stream));
}

void unflatten_cuda(const UnflattenParams& p, StreamHandle stream) {
  std::vector<Entry> entries;
  entries.reserve(static_cast<size_t>(p.count > 0 ? p.count : 0));
  for_each_unflatten_piece(p, [&](const unsigned char* src, unsigned char* dst, int64_t len) {
    entries.push_back(Entry{src, dst, len});
  });
  dispatch(p.src_dtype, p.dst_dtype, entries, 1.0f, false, nullptr, as_stream(stream));
}

}  // namespace pyasync
