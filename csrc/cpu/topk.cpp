// Top-k by magnitude with error feedback on the CPU: a sampled radix select over the uint32 keys;
// and the worker-side momentum step of momentum-corrected top-k (Note [Momentum correction for top-k]).
// See Note [Top-k selection] (math/topk.h) for the semantics and Note [CPU top-k] for the method.
#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "pyasync/launchers.h"
#include "pyasync/math/topk.h"
#include "pyasync/topk_workspace.h"

namespace pyasync {

// Note [CPU top-k]
// Keys are 31 bits (bit 31 of |v| is 0) and are split into three radix digits: bits 30..19 (4096
// bins: exponent and 4 mantissa bits), 18..8 (2048) and 7..0 (256).
//  0. Sample 16 Ki keys at stratified pseudo-random positions and take the sample key m-th from the
//     top, m = mu + 4 sqrt(mu) + 4 with mu = 16 Ki * k / n (4 standard deviations of the binomial
//     count above the true k-th key): the "collection bound", below the k-th largest key with high
//     probability, with about n * m / 16 Ki elements above it.
//  1. One parallel pass over the data (each thread a fixed chunk; fused AVX2 loop where built for
//     it): v = g + e, the residual store (v, or e where v is not finite), and the candidates
//     (index, key, v) of every element whose key is >= the bound, in index order. Only hits and
//     non-finite v leave the vector registers. A thread whose candidates outgrow twice its expected
//     share stops collecting.
//  2. If some thread stopped, or fewer than k candidates were found (the sample misled us), each
//     thread re-reads its chunk for a digit-0 histogram, which gives the bin b0 of the k-th largest
//     key and the number of elements in bins >= b0. If that is at most n / 8, each thread re-reads
//     its chunk once more and collects exactly those elements. Otherwise (large k; or sparse data
//     with fewer than k non-zeros, where n - k zero keys tie at T = 0) nothing is stored: digits 1
//     and 2 are histogram passes over the data, then one pass counts keys > T and == T per thread
//     and a last pass writes the output (stream_select_and_write). Large k (above ~1/8 of n, where
//     sampling saves nothing) takes step 2 by design.
//  3. One thread runs the radix select over the candidates (a few per cent of n): digit 0 over all
//     of them, digits 1 and 2 over the keys of the selected digit-0 bin, giving the exact threshold
//     key T and the number q of keys == T to keep. It counts each thread's candidates with
//     key > T and key == T; thread t keeps the first min(ties_t, q - ties of threads < t) ties (ties
//     go to the lowest indices), and prefix sums give every thread its output offset.
//  4. Each thread writes its kept candidates' indices and values in ascending index order and
//     zeroes the residual at kept finite elements.
// Only two synchronisation points in the usual case (after pass 1, after step 3): the kernels share
// the cores with the training thread (Note [CPU threads]), where every barrier can cost a time slice.
// Memory traffic in the usual case (fp32, residual in place): read g and e and write e' once, like
// `torch.add(g, e, out=e)`, plus O(k) candidate and output traffic.

namespace {

constexpr int kShift0 = 19;                // digit 0: key bits 30..19
constexpr int kBins0 = 1 << 12;            // digit-0 bins
constexpr int kShift1 = 8;                 // digit 1: key bits 18..8
constexpr int kBins1 = 1 << 11;            // digit-1 bins
constexpr int kBins2 = 1 << 8;             // digit 2: key bits 7..0
constexpr uint32_t kKeyMask = 0x7fffffffu;  // the key bits of a candidate's `key`
constexpr uint32_t kBadBit = 0x80000000u;   // candidate flag: v is not finite (its key is 0)
constexpr int64_t kBlock = 512;            // elements per vectorised block
constexpr int64_t kMinPerThread = 1 << 16;  // fewer elements per thread are not worth a thread
constexpr int64_t kSamples = 1 << 14;      // keys sampled to place the collection bound

// A candidate: an element whose key is at or above the collection bound (pass 1), or whose digit-0
// bin is at or above the k-th largest key's (step 2).
struct Cand {
  uint32_t idx;  // element index
  uint32_t key;  // topk_key(v), | kBadBit where v is not finite
  float val;     // v
};

// Per-thread state (per-thread histograms live in flat arrays of the launcher).
struct ThreadState {
  std::vector<Cand> cands;   // candidates of this thread's chunk, ascending index
  std::vector<uint32_t> bad;  // indices of non-finite v (only kept when a residual is written)
  int64_t lo = 0;            // chunk begin (element)
  int64_t hi = 0;            // chunk end (element)
  int64_t cap = 0;           // most candidates collected in pass 1 before giving up
  bool collecting = false;   // pass 1 collects candidates (cleared on overflow)
  bool any_bad = false;      // the chunk holds a non-finite v
  int64_t gt = 0;            // candidates with key > T
  int64_t eq = 0;            // candidates with key == T
  int64_t quota = 0;         // ties this thread keeps
  int64_t offset = 0;        // first output slot of this thread
};

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The bin holding the rank-th largest count (rank is 1-based); rank becomes the rank inside the bin.
int select_bin(const int64_t* hist, int bins, int64_t& rank) {
  for (int b = bins - 1; b > 0; --b) {
    if (rank <= hist[b]) return b;
    rank -= hist[b];
  }
  return 0;
}

// Sum the first `threads` per-thread histograms of `bins` bins.
void merge(const std::vector<uint32_t>& per_thread, int threads, int bins, std::vector<int64_t>& out) {
  out.assign(bins, 0);
  for (int t = 0; t < threads; ++t)
    for (int j = 0; j < bins; ++j) out[j] += per_thread[static_cast<size_t>(t) * bins + j];
}

// Where pass 1 puts the collection bound: a key below the k-th largest with high probability.
// Returns 0 (collect everything) for small n, and kNoBound when sampling cannot help (large k).
constexpr uint32_t kNoBound = std::numeric_limits<uint32_t>::max();

uint32_t sample_bound(const EncodeParams& p, int64_t& expected) {
  const int64_t n = p.out.n, k = p.out.k;
  expected = n;
  if (n < 4 * kSamples) return 0;
  std::vector<uint32_t> keys(kSamples);
  for (int64_t j = 0; j < kSamples; ++j) {
    const int64_t a = j * n / kSamples, b = (j + 1) * n / kSamples;
    const int64_t i = a + static_cast<int64_t>(mix64(static_cast<uint64_t>(j)) % static_cast<uint64_t>(b - a));
    const float v = p.residual_in != nullptr ? p.grad[i] + p.residual_in[i] : p.grad[i];
    keys[j] = math::topk_key(v);
  }
  const double mu = static_cast<double>(kSamples) * static_cast<double>(k) / static_cast<double>(n);
  const int64_t m = static_cast<int64_t>(std::ceil(mu + 4.0 * std::sqrt(mu) + 4.0));
  if (m >= kSamples / 8) return kNoBound;  // more than ~1/8 of n would be collected: just re-read
  std::nth_element(keys.begin(), keys.begin() + (m - 1), keys.end(), std::greater<uint32_t>());
  expected = static_cast<int64_t>(static_cast<double>(n) * static_cast<double>(m) / kSamples);
  return keys[m - 1];
}

// v of a block [base, base + len) into vbuf, keys (| kBadBit where v is not finite) into kbuf.
// Returns the number of non-finite v.
template <bool kHasRes>
int64_t load_block(const float* g, const float* e, int64_t base, int64_t len, float* ebuf, float* vbuf,
                   uint32_t* kbuf) {
  if (kHasRes) std::memcpy(ebuf, e + base, static_cast<size_t>(len) * sizeof(float));
  int64_t nbad = 0;
  for (int64_t j = 0; j < len; ++j) {
    const float v = kHasRes ? g[base + j] + ebuf[j] : g[base + j];
    vbuf[j] = v;
    kbuf[j] = math::topk_key(v);
    nbad += math::is_finite(v) ? 0 : 1;
  }
  if (nbad != 0)
    for (int64_t j = 0; j < len; ++j)
      if (!math::is_finite(vbuf[j])) kbuf[j] |= kBadBit;
  return nbad;
}

// Append the elements of a loaded block whose key is >= bound, in index order. Tests 16 keys at a
// time (AVX2 where built for it) so that the rare hits alone take the scalar path.
void collect_block(std::vector<Cand>& out, int64_t base, int64_t len, const float* vbuf, const uint32_t* kbuf,
                   uint32_t bound) {
#if defined(__AVX2__)
  // Masked keys and bound are < 2^31, so a signed compare against bound - 1 is key >= bound.
  const __m256i lim = _mm256_set1_epi32(static_cast<int32_t>(bound) - 1);
  const __m256i key_mask = _mm256_set1_epi32(static_cast<int32_t>(kKeyMask));
#endif
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    uint32_t mask = 0;
#if defined(__AVX2__)
    const __m256i a = _mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(kbuf + j0)), key_mask);
    const __m256i b = _mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(kbuf + j0 + 8)), key_mask);
    mask = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a, lim)))) |
           static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b, lim)))) << 8;
#else
    for (int q = 0; q < 16; ++q) mask |= static_cast<uint32_t>((kbuf[j0 + q] & kKeyMask) >= bound) << q;
#endif
    if (len - j0 < 16) mask &= (1u << (len - j0)) - 1u;
    while (mask != 0) {
      const int64_t j = j0 + __builtin_ctz(mask);
      out.push_back(Cand{static_cast<uint32_t>(base + j), kbuf[j], vbuf[j]});
      mask &= mask - 1u;
    }
  }
}

// Pass 1 over elements [lo, hi) of a thread's chunk, portable version. See Note [CPU top-k], step 1.
template <bool kHasRes>
void pass1_generic(const EncodeParams& p, ThreadState& s, uint32_t bound, int64_t lo, int64_t hi) {
  alignas(64) float ebuf[kBlock];
  alignas(64) float vbuf[kBlock];
  alignas(64) uint32_t kbuf[kBlock] = {};
  float* const ro = p.residual_out;
  for (int64_t base = lo; base < hi; base += kBlock) {
    const int64_t len = std::min(kBlock, hi - base);
    const int64_t nbad = load_block<kHasRes>(p.grad, p.residual_in, base, len, ebuf, vbuf, kbuf);
    if (kHasRes && ro != nullptr)
      for (int64_t j = 0; j < len; ++j) ro[base + j] = math::topk_residual(vbuf[j], ebuf[j], false);
    if (nbad != 0) {
      s.any_bad = true;
      if (ro != nullptr)
        for (int64_t j = 0; j < len; ++j)
          if (kbuf[j] & kBadBit) s.bad.push_back(static_cast<uint32_t>(base + j));
    }
    if (s.collecting) {
      collect_block(s.cands, base, len, vbuf, kbuf, bound);
      if (static_cast<int64_t>(s.cands.size()) > s.cap) {
        s.collecting = false;
        std::vector<Cand>().swap(s.cands);
      }
    }
  }
}

#if defined(__AVX2__)
// Pass 1, fused AVX2 version of pass1_generic over [s.lo, s.lo + 8m): one load of g and e, one
// store of the residual and one compare per 8 elements; only hits (key >= bound) and non-finite v
// leave the registers. Returns where it stopped (the rest goes to pass1_generic).
template <bool kHasRes>
int64_t pass1_avx2(const EncodeParams& p, ThreadState& s, uint32_t bound) {
  const float* const g = p.grad;
  const float* const e = p.residual_in;
  float* const ro = kHasRes ? p.residual_out : nullptr;
  const __m256i abs_mask = _mm256_set1_epi32(static_cast<int32_t>(kKeyMask));
  const __m256i inf_bits = _mm256_set1_epi32(0x7f800000);
  // key >= bound as key > bound - 1 (signed: keys and bound are < 2^31); never when not collecting.
  __m256i lim = _mm256_set1_epi32(s.collecting ? static_cast<int32_t>(bound) - 1 : 0x7fffffff);
  const int64_t end = s.lo + (s.hi - s.lo) / 8 * 8;
  alignas(32) float tv[8];
  alignas(32) uint32_t tk[8];
  int64_t i = s.lo;
  while (i < end) {
    const int64_t block_end = std::min(end, i + kBlock);
    for (; i < block_end; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      __m256 ev = _mm256_setzero_ps();
      __m256 v = gv;
      if (kHasRes) {
        ev = _mm256_loadu_ps(e + i);
        v = _mm256_add_ps(gv, ev);
      }
      const __m256i abs_bits = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
      const __m256i fin = _mm256_cmpgt_epi32(inf_bits, abs_bits);  // |v| < inf and not NaN
      if (kHasRes && ro != nullptr) _mm256_storeu_ps(ro + i, _mm256_blendv_ps(ev, v, _mm256_castsi256_ps(fin)));
      const __m256i key = _mm256_and_si256(abs_bits, fin);  // math::topk_key
      const uint32_t hit = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, lim))));
      const uint32_t bad = ~static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(fin))) & 0xffu;
      if ((hit | bad) == 0) continue;
      _mm256_store_ps(tv, v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(tk), key);
      for (uint32_t m = hit | bad; m != 0; m &= m - 1u) {
        const int j = __builtin_ctz(m);
        const bool is_bad = (bad >> j) & 1u;
        if (is_bad) {
          s.any_bad = true;
          if (ro != nullptr) s.bad.push_back(static_cast<uint32_t>(i + j));
        }
        if ((hit >> j) & 1u) s.cands.push_back(Cand{static_cast<uint32_t>(i + j), tk[j] | (is_bad ? kBadBit : 0u), tv[j]});
      }
    }
    if (s.collecting && static_cast<int64_t>(s.cands.size()) > s.cap) {
      s.collecting = false;
      std::vector<Cand>().swap(s.cands);
      lim = _mm256_set1_epi32(0x7fffffff);  // finish the residual store without collecting
    }
  }
  return end;
}
#endif

// Pass 1 over one thread's chunk. See Note [CPU top-k], step 1.
template <bool kHasRes>
void pass1(const EncodeParams& p, ThreadState& s, uint32_t bound) {
#if defined(__AVX2__)
  const int64_t done = pass1_avx2<kHasRes>(p, s, bound);
#else
  const int64_t done = s.lo;
#endif
  pass1_generic<kHasRes>(p, s, bound, done, s.hi);
}

// Re-read a thread's chunk after pass 1 and call fn(base, len, vbuf, kbuf) per block.
template <typename Fn>
void rescan(const EncodeParams& p, const ThreadState& s, Fn&& fn) {
  alignas(64) float ebuf[kBlock];
  alignas(64) float vbuf[kBlock];
  alignas(64) uint32_t kbuf[kBlock] = {};
  const float* ro = p.residual_out;
  size_t next_bad = 0;
  for (int64_t base = s.lo; base < s.hi; base += kBlock) {
    const int64_t len = std::min(kBlock, s.hi - base);
    if (ro != nullptr) {
      // The residual now holds v, or the old e where v is not finite (those are listed in s.bad).
      load_block<false>(ro, nullptr, base, len, ebuf, vbuf, kbuf);
      for (; next_bad < s.bad.size() && s.bad[next_bad] < base + len; ++next_bad) {
        const int64_t j = s.bad[next_bad] - base;
        vbuf[j] = p.grad[base + j] + ro[base + j];
        kbuf[j] = kBadBit;
      }
    } else if (p.residual_in != nullptr) {
      load_block<true>(p.grad, p.residual_in, base, len, ebuf, vbuf, kbuf);
    } else {
      load_block<false>(p.grad, nullptr, base, len, ebuf, vbuf, kbuf);
    }
    fn(base, len, vbuf, kbuf);
  }
}

// From each thread's counts of keys > T (gt) and == T (eq), and the number of ties to keep: each
// thread's tie quota (the first ties in index order are kept) and its first output slot.
void assign_offsets(std::vector<ThreadState>& ts, int threads, int64_t ties_to_keep) {
  int64_t offset = 0;
  for (int u = 0; u < threads; ++u) {
    ts[u].quota = std::min(ts[u].eq, ties_to_keep);
    ties_to_keep -= ts[u].quota;
    ts[u].offset = offset;
    offset += ts[u].gt + ts[u].quota;
  }
}

// Step 3 on one thread: T from the candidates of every thread (each holds every key >= T of
// its chunk, in index order), then each thread's tie quota and output offset. Returns T.
uint32_t select_threshold(std::vector<ThreadState>& ts, int threads, int64_t k) {
  std::vector<int64_t> hist(kBins0, 0);
  for (int u = 0; u < threads; ++u)
    for (const Cand& c : ts[u].cands) ++hist[(c.key & kKeyMask) >> kShift0];
  int64_t rank = k;
  const uint32_t b0 = static_cast<uint32_t>(select_bin(hist.data(), kBins0, rank));
  // Keys of bin b0, thread after thread; keys of higher bins are > T.
  std::vector<uint32_t> keys;
  std::vector<size_t> begin(threads + 1, 0);
  for (int u = 0; u < threads; ++u) {
    begin[u] = keys.size();
    ts[u].gt = 0;
    for (const Cand& c : ts[u].cands) {
      const uint32_t key = c.key & kKeyMask;
      const uint32_t bin = key >> kShift0;
      if (bin > b0) ++ts[u].gt;
      if (bin == b0) keys.push_back(key);
    }
  }
  begin[threads] = keys.size();
  hist.assign(kBins1, 0);
  for (uint32_t key : keys) ++hist[(key >> kShift1) & (kBins1 - 1)];
  const uint32_t prefix1 = (b0 << 11) | static_cast<uint32_t>(select_bin(hist.data(), kBins1, rank));
  hist.assign(kBins2, 0);
  for (uint32_t key : keys)
    if ((key >> kShift1) == prefix1) ++hist[key & (kBins2 - 1)];
  const uint32_t threshold = (prefix1 << kShift1) | static_cast<uint32_t>(select_bin(hist.data(), kBins2, rank));
  for (int u = 0; u < threads; ++u) {
    ts[u].eq = 0;
    for (size_t j = begin[u]; j < begin[u + 1]; ++j) {
      ts[u].gt += keys[j] > threshold ? 1 : 0;
      ts[u].eq += keys[j] == threshold ? 1 : 0;
    }
  }
  assign_offsets(ts, threads, rank);  // rank: keys == T to keep
  return threshold;
}

// Step 2 fallback when the candidates would not fit comfortably (more than n / 8: large k, or
// millions of keys tied at the threshold, as with sparse gradients holding fewer than k non-zeros):
// digits 1 and 2 as histogram passes over the data, then a counting pass and a writing pass; no
// candidate storage. Every thread of the team calls it (it holds barriers); `rank`, `threshold`,
// `h1`, `h2` and `merged` are shared.
void stream_select_and_write(const EncodeParams& p, ThreadState& s, std::vector<ThreadState>& ts, int threads,
                             int t, uint32_t b0, int64_t& rank, std::vector<uint32_t>& h1, std::vector<uint32_t>& h2,
                             std::vector<int64_t>& merged, uint32_t& threshold) {
  uint32_t* const hist1 = &h1[static_cast<size_t>(t) * kBins1];
  rescan(p, s, [hist1, b0](int64_t, int64_t len, const float*, const uint32_t* kbuf) {
    for (int64_t j = 0; j < len; ++j) {
      const uint32_t key = kbuf[j] & kKeyMask;
      if ((key >> kShift0) == b0) ++hist1[(key >> kShift1) & (kBins1 - 1)];
    }
  });
#pragma omp barrier
#pragma omp single
  {
    merge(h1, threads, kBins1, merged);
    threshold = (b0 << 11) | static_cast<uint32_t>(select_bin(merged.data(), kBins1, rank));  // digits 0, 1
  }
  const uint32_t prefix1 = threshold;
  uint32_t* const hist2 = &h2[static_cast<size_t>(t) * kBins2];
  rescan(p, s, [hist2, prefix1](int64_t, int64_t len, const float*, const uint32_t* kbuf) {
    for (int64_t j = 0; j < len; ++j) {
      const uint32_t key = kbuf[j] & kKeyMask;
      if ((key >> kShift1) == prefix1) ++hist2[key & (kBins2 - 1)];
    }
  });
#pragma omp barrier
#pragma omp single
  {
    merge(h2, threads, kBins2, merged);
    threshold = (prefix1 << kShift1) | static_cast<uint32_t>(select_bin(merged.data(), kBins2, rank));
  }
  const uint32_t thr = threshold;
  rescan(p, s, [&s, thr](int64_t, int64_t len, const float*, const uint32_t* kbuf) {
    for (int64_t j = 0; j < len; ++j) {
      const uint32_t key = kbuf[j] & kKeyMask;
      s.gt += key > thr ? 1 : 0;
      s.eq += key == thr ? 1 : 0;
    }
  });
#pragma omp barrier
#pragma omp single
  assign_offsets(ts, threads, rank);  // rank: keys == T to keep
  int64_t pos = s.offset, ties = s.quota;
  float* const codes = static_cast<float*>(p.out.codes);
  int32_t* const indices = p.out.indices;
  float* const ro = p.residual_out;
  rescan(p, s, [&](int64_t base, int64_t len, const float* vbuf, const uint32_t* kbuf) {
    for (int64_t j = 0; j < len; ++j) {
      const uint32_t key = kbuf[j] & kKeyMask;
      bool keep = key > thr;
      if (!keep && key == thr && ties > 0) {
        keep = true;
        --ties;
      }
      if (!keep) continue;
      indices[pos] = static_cast<int32_t>(base + j);
      codes[pos] = vbuf[j];
      ++pos;
      if (ro != nullptr && (kbuf[j] & kBadBit) == 0) ro[base + j] = math::topk_residual(vbuf[j], 0.0f, true);
      if (p.mask_out != nullptr && (kbuf[j] & kBadBit) == 0) p.mask_out[base + j] = 0.0f;
    }
  });
}

}  // namespace

int64_t topk_workspace_bytes(int64_t n, int64_t k) {
  PYASYNC_CHECK_ARG(n >= 1 && n <= std::numeric_limits<int32_t>::max(),
                    "top-k needs 1 <= n <= 2^31 - 1 elements (indices are int32)");
  PYASYNC_CHECK_ARG(k >= 1 && k <= n, "top-k needs 1 <= k <= n");
  return TopkWorkspace(n).bytes;
}

void topk_encode_cpu(const EncodeParams& p) {
  const int64_t n = p.out.n, k = p.out.k;
  PYASYNC_CHECK_ARG(p.out.codec == Codec::kTopK, "topk_encode_cpu needs codec kTopK");
  PYASYNC_CHECK_ARG(n >= 1 && n <= std::numeric_limits<int32_t>::max(),
                    "top-k needs 1 <= n <= 2^31 - 1 elements (indices are int32)");
  PYASYNC_CHECK_ARG(k >= 1 && k <= n, "top-k needs 1 <= k <= n");
  PYASYNC_CHECK_ARG(p.grad != nullptr && p.out.codes != nullptr && p.out.indices != nullptr,
                    "top-k needs grad, codes (values) and indices");
  PYASYNC_CHECK_ARG(p.residual_out == nullptr || p.residual_in != nullptr, "residual_out given without residual_in");

  const int max_threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(resolve_num_threads(p.num_threads), n / kMinPerThread)));
  int64_t expected = n;
  const uint32_t bound = sample_bound(p, expected);
  const int64_t cap_total = 2 * expected + 65536;

  // Candidate buffers are kept per calling thread between calls (no page faults in the steady state).
  thread_local std::vector<ThreadState> cache;
  if (static_cast<int>(cache.size()) < max_threads) cache.resize(max_threads);
  std::vector<ThreadState>& ts = cache;
  for (ThreadState& s : ts) {
    s.cands.clear();
    s.bad.clear();
    s.any_bad = false;
    s.gt = s.eq = s.quota = s.offset = 0;
  }
  std::vector<uint32_t> h0;     // fallback only: per-thread digit-0 histograms
  std::vector<int64_t> merged;  // fallback only
  bool collected = true;        // pass 1 collected every element with key >= the k-th largest
  uint32_t b0 = 0;              // fallback only: digit 0 of the k-th largest key
  int64_t rank = k;             // fallback only: rank of the k-th largest key inside its key prefix
  bool streaming = false;       // fallback only: too many candidates to hold; see Note [CPU top-k]
  std::vector<uint32_t> h1, h2;  // streaming only: per-thread digit-1 and digit-2 histograms
  uint32_t threshold = 0;       // the k-th largest key T
  bool any_bad = false;
  float* const codes = static_cast<float*>(p.out.codes);
  int32_t* const indices = p.out.indices;

#pragma omp parallel num_threads(max_threads)
  {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    ThreadState& s = ts[t];
    s.lo = (n * t / T) & ~int64_t{63};
    s.hi = t == T - 1 ? n : (n * (t + 1) / T) & ~int64_t{63};
    s.collecting = bound != kNoBound;
    const double share = static_cast<double>(s.hi - s.lo) / static_cast<double>(n);  // of the elements
    s.cap = static_cast<int64_t>(static_cast<double>(cap_total) * share) + 1024;  // small n: > chunk
    if (s.collecting)
      s.cands.reserve(static_cast<size_t>(std::min(s.cap, static_cast<int64_t>(static_cast<double>(expected) * share) + 1024)));
    if (p.residual_in != nullptr)
      pass1<true>(p, s, bound);
    else
      pass1<false>(p, s, bound);

#pragma omp barrier
#pragma omp single
    {
      int64_t total = 0;
      for (int u = 0; u < T; ++u) {
        collected = collected && ts[u].collecting;
        total += static_cast<int64_t>(ts[u].cands.size());
        any_bad = any_bad || ts[u].any_bad;
      }
      collected = collected && total >= k;
      if (collected) threshold = select_threshold(ts, T, k);
      else h0.assign(static_cast<size_t>(T) * kBins0, 0u);
    }
    if (!collected) {
      // Step 2 fallback: a digit-0 histogram of the whole chunk, then the elements of bin >= b0.
      uint32_t* const hist0 = &h0[static_cast<size_t>(t) * kBins0];
      rescan(p, s, [hist0](int64_t, int64_t len, const float*, const uint32_t* kbuf) {
        for (int64_t j = 0; j < len; ++j) ++hist0[(kbuf[j] & kKeyMask) >> kShift0];
      });
      std::vector<Cand>().swap(s.cands);
#pragma omp barrier
#pragma omp single
      {
        merge(h0, T, kBins0, merged);
        b0 = static_cast<uint32_t>(select_bin(merged.data(), kBins0, rank));
        int64_t above = 0;  // elements of bin >= b0: the candidates
        for (int j = static_cast<int>(b0); j < kBins0; ++j) above += merged[j];
        streaming = above > n / 8;
        if (streaming) {
          h1.assign(static_cast<size_t>(T) * kBins1, 0u);
          h2.assign(static_cast<size_t>(T) * kBins2, 0u);
        }
      }
      if (!streaming) {
        int64_t count = 0;
        for (int j = static_cast<int>(b0); j < kBins0; ++j) count += hist0[j];
        s.cands.reserve(static_cast<size_t>(count));
        const uint32_t bkey = b0 << kShift0;
        rescan(p, s, [&s, bkey](int64_t base, int64_t len, const float* vbuf, const uint32_t* kbuf) {
          collect_block(s.cands, base, len, vbuf, kbuf, bkey);
        });
#pragma omp barrier
#pragma omp single
        threshold = select_threshold(ts, T, k);
      } else {
        stream_select_and_write(p, s, ts, T, t, b0, rank, h1, h2, merged, threshold);
      }
    }
    // Step 4: each thread writes its kept candidates, in index order, from its offset.
    // The residual is only stored to (a kept element's residual is 0, or stays e where v is not
    // finite: math::topk_residual), and prefetched for writing a few candidates ahead: the kept
    // indices are scattered, so each store misses the cache.
    int64_t pos = s.offset, ties = s.quota;
    float* const ro = p.residual_out;
    const size_t count = s.cands.size();
    constexpr size_t kAhead = 16;
    for (size_t j = 0; j < count; ++j) {
      if (ro != nullptr && j + kAhead < count) __builtin_prefetch(ro + s.cands[j + kAhead].idx, 1);
      const Cand& c = s.cands[j];
      const uint32_t key = c.key & kKeyMask;
      bool keep = key > threshold;
      if (!keep && key == threshold && ties > 0) {
        keep = true;
        --ties;
      }
      if (!keep) continue;
      indices[pos] = static_cast<int32_t>(c.idx);
      codes[pos] = c.val;
      ++pos;
      if (ro != nullptr && (c.key & kBadBit) == 0) ro[c.idx] = math::topk_residual(c.val, 0.0f, true);
      if (p.mask_out != nullptr && (c.key & kBadBit) == 0) p.mask_out[c.idx] = 0.0f;
    }
  }
  if (any_bad && p.nonfinite != nullptr) *p.nonfinite = 1;
  for (ThreadState& s : ts) {  // keep at most ~48 MB of candidates per thread between calls
    if (s.cands.capacity() > (size_t{1} << 22)) std::vector<Cand>().swap(s.cands);
    if (s.bad.capacity() > (size_t{1} << 22)) std::vector<uint32_t>().swap(s.bad);
  }
}

void dgc_velocity_cpu(const VelocityParams& p) {
  PYASYNC_CHECK_ARG(p.n >= 0, "element count must be >= 0");
  PYASYNC_CHECK_ARG(p.grad != nullptr && p.u_in != nullptr && p.u_out != nullptr, "the velocity step needs grad, u_in and u_out");
  PYASYNC_CHECK_ARG(p.x_out != nullptr || !p.nesterov, "a Nesterov velocity step needs x_out");
  const int64_t n = p.n;
  const int threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(resolve_num_threads(p.num_threads), n / kMinPerThread)));
  const float mu = p.mu;
  const float* const g = p.grad;
  const float* const u = p.u_in;
  float* const uo = p.u_out;
  float* const xo = p.x_out;
  const bool nesterov = p.nesterov;
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float un = math::dgc_velocity(u[i], g[i], mu);
    uo[i] = un;
    if (xo != nullptr) xo[i] = math::dgc_accumulated(un, g[i], mu, nesterov);
  }
}

}  // namespace pyasync
