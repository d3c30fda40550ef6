// Multi-tensor flatten / unflatten on the CPU (OpenMP). See Note [Bucket copies].

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "pyasync/bucket_slices.h"
#include "pyasync/common.h"
#include "pyasync/launchers.h"
#include "pyasync/math/cast.h"
#include "pyasync/params.h"

namespace pyasync {

// Note [Bucket copies]
// flatten and unflatten are converting copies between many tensors and one bucket.
//   flatten:   bucket[offsets[i] + j] = store_D(load_S(src_i[j]) * scale)     (scale != 1)
//              bucket[offsets[i] + j] = store_D(load_S(src_i[j]))             (scale == 1)
//              bucket[offsets[i] + j] = 0                                      (src_i is null)
//   unflatten: dst_i[j] = store_D(load_S(src[offsets[i] + j - begin]))  for the j whose bucket
//              element offsets[i] + j lies in [begin, end)
// load/store are math::Convert (exact widening to fp32, round-to-nearest-even narrowing), so one
// fp32 multiply and one rounding per element: the result is the bits torch gives for
// `t.to(torch.float32).mul(scale).to(dst_dtype)` (reference/bucketing.py), NaN payloads aside
// (torch's own vectorised and scalar bf16 casts disagree on those). With scale == 1 the multiply is
// skipped, so the copy is exactly `.to(dst_dtype)`. The non-finite flag looks at the SOURCE values
// (a finite gradient that overflows after scaling or narrowing is not flagged), inside the same loop.
//
// Work split (CPU): every copied range is cut into chunks of at most kChunk elements, listed in
// bucket order in one flat work list. Each thread takes one contiguous run of the list holding
// ~1/T of the total cost, cost = elements + kItemCost per chunk (so a thousand 1-element tensors
// weigh what they cost, and one 25M-element tensor is split over all threads). Contiguous runs
// keep each thread streaming through adjacent memory; the split is static, so the result (and the
// flag) never depend on timing. The CUDA twin (csrc/cuda/flatten.cu) cuts the same work into
// 64K-element chunks, one per block, the apex multi_tensor_apply way.

namespace {

constexpr int64_t kChunk = 32768;          // elements per work item
constexpr int64_t kItemCost = 64;          // per-item overhead in element-equivalents
// Fewer elements than this (1 MiB of fp32) run on the calling thread: a copy that short takes tens of
// microseconds, no more than waking a team, and much less than waiting for one on a busy machine.
constexpr int64_t kSerialBelow = 1 << 18;

// One work item: copy n elements from src to dst (byte addresses of the first element).
struct Span {
  const unsigned char* src;  // first source element; null: write zeros
  unsigned char* dst;        // first destination element
  int64_t n;                 // elements
};

// Converts (and optionally scales and checks) one span; returns 1 when a source value is NaN/Inf.
using SpanFn = uint32_t (*)(const Span&, float);

// `flatten` inlines the math::Convert calls here, in this file's compile step: left to the LTO link,
// the prevailing copy of an inline math function may come from a file compiled with other
// optimisation attributes, which gcc then refuses to inline (one call per element, ~10x slower).
template <DType S, DType D, bool kScale, bool kCheck>
__attribute__((flatten)) uint32_t copy_span(const Span& s, float scale) {
  using TS = typename math::Convert<S>::storage;
  using TD = typename math::Convert<D>::storage;
  const TS* in = reinterpret_cast<const TS*>(s.src);
  TD* out = reinterpret_cast<TD*>(s.dst);
  const int64_t n = s.n;
  uint32_t bad = 0;
  // Simple enough for gcc to vectorise (checked with -fopt-info-vec): no early exit, the flag is
  // an OR reduction over the exponent bits of the loaded value.
  for (int64_t i = 0; i < n; ++i) {
    float v = math::Convert<S>::load(in[i]);
    if (kCheck) bad |= static_cast<uint32_t>((math::float_bits(v) & 0x7f800000u) == 0x7f800000u);
    if (kScale) v *= scale;
    out[i] = math::Convert<D>::store(v);
  }
  return bad;
}

template <DType S, DType D>
SpanFn pick_flags(bool scale, bool check) {
  if (scale) return check ? &copy_span<S, D, true, true> : &copy_span<S, D, true, false>;
  return check ? &copy_span<S, D, false, true> : &copy_span<S, D, false, false>;
}

template <DType S>
SpanFn pick_dst(DType d, bool scale, bool check) {
  switch (d) {
    case DType::kFloat32: return pick_flags<S, DType::kFloat32>(scale, check);
    case DType::kFloat16: return pick_flags<S, DType::kFloat16>(scale, check);
    case DType::kBFloat16: return pick_flags<S, DType::kBFloat16>(scale, check);
  }
  throw ArgumentError("pyasync: unknown destination dtype");
}

SpanFn pick(DType s, DType d, bool scale, bool check) {
  switch (s) {
    case DType::kFloat32: return pick_dst<DType::kFloat32>(d, scale, check);
    case DType::kFloat16: return pick_dst<DType::kFloat16>(d, scale, check);
    case DType::kBFloat16: return pick_dst<DType::kBFloat16>(d, scale, check);
  }
  throw ArgumentError("pyasync: unknown source dtype");
}

// Appends [src, src + n) -> [dst, dst + n) to the work list in chunks of kChunk elements.
void add_spans(std::vector<Span>& spans, const unsigned char* src, int64_t src_size, unsigned char* dst,
               int64_t dst_size, int64_t n) {
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    spans.push_back(Span{src ? src + start * src_size : nullptr, dst + start * dst_size, len});
  }
}

// Runs the work list on `requested` threads (see Note [Bucket copies]); returns the OR of the flags.
uint32_t run_spans(const std::vector<Span>& spans, SpanFn fn, float scale, int64_t dst_size,
                   int32_t requested) {
  const int64_t items = static_cast<int64_t>(spans.size());
  if (items == 0) return 0;
  // prefix[j]: cost of items [0, j); item j goes to the thread whose cost range holds prefix[j].
  std::vector<int64_t> prefix(items + 1, 0);
  int64_t elements = 0;
  for (int64_t j = 0; j < items; ++j) {
    prefix[j + 1] = prefix[j] + spans[j].n + kItemCost;
    elements += spans[j].n;
  }
  const int64_t total = prefix[items];
  int64_t threads = resolve_num_threads(requested);
  if (elements < kSerialBelow) threads = 1;
  threads = std::max<int64_t>(1, std::min(threads, items));

  uint32_t bad = 0;
#pragma omp parallel num_threads(static_cast<int>(threads)) reduction(| : bad) if (threads > 1)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t nt = omp_get_num_threads();
    const int64_t lo = total * t / nt;
    const int64_t hi = total * (t + 1) / nt;
    const auto first = std::lower_bound(prefix.begin(), prefix.end() - 1, lo) - prefix.begin();
    const auto last = std::lower_bound(prefix.begin(), prefix.end() - 1, hi) - prefix.begin();
    for (int64_t j = first; j < last; ++j) {
      const Span& s = spans[j];
      if (s.src == nullptr) {
        std::memset(s.dst, 0, static_cast<size_t>(s.n * dst_size));  // 0 bits are +0 in every dtype
      } else {
        bad |= fn(s, scale);
      }
    }
  }
  return bad;
}

}  // namespace

void flatten_cpu(const FlattenParams& p) {
  PYASYNC_CHECK_ARG(p.count >= 0, "flatten: negative tensor count");
  const int64_t ss = dtype_size(p.src_dtype);
  const int64_t ds = dtype_size(p.dst_dtype);
  std::vector<Span> spans;
  spans.reserve(static_cast<size_t>(p.count));
  for (int32_t i = 0; i < p.count; ++i) {
    const int64_t n = p.numels[i];
    if (n == 0) continue;
    PYASYNC_CHECK_ARG(p.bucket != nullptr, "flatten: null bucket");
    add_spans(spans, reinterpret_cast<const unsigned char*>(p.srcs[i]), ss,
              static_cast<unsigned char*>(p.bucket) + p.offsets[i] * ds, ds, n);
  }
  const bool scale = p.scale != 1.0f;
  const bool check = p.nonfinite != nullptr;
  const SpanFn fn = pick(p.src_dtype, p.dst_dtype, scale, check);
  const uint32_t bad = run_spans(spans, fn, p.scale, ds, p.num_threads);
  if (bad != 0 && check) *p.nonfinite = 1;  // never cleared: the caller resets it
}

void unflatten_cpu(const UnflattenParams& p) {
  const int64_t ss = dtype_size(p.src_dtype);
  const int64_t ds = dtype_size(p.dst_dtype);
  std::vector<Span> spans;
  spans.reserve(static_cast<size_t>(p.count > 0 ? p.count : 0));
  for_each_unflatten_piece(p, [&](const unsigned char* src, unsigned char* dst, int64_t len) {
    add_spans(spans, src, ss, dst, ds, len);
  });
  run_spans(spans, pick(p.src_dtype, p.dst_dtype, false, false), 1.0f, ds, p.num_threads);
}

}  // namespace pyasync
