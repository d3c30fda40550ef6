// CPU encode / decode of the gradient codecs. The formulas are in math/{cast,int8,sign,feedback}.h;
// this file only indexes and moves memory. Top-k encode lives in topk.cpp.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pyasync/common.h"
#include "pyasync/launchers.h"
#include "pyasync/math/cast.h"
#include "pyasync/math/feedback.h"
#include "pyasync/math/int8.h"
#include "pyasync/math/sign.h"
#include "pyasync/params.h"

namespace pyasync {

// Note [CPU codec loops]
// Work is split into tiles that threads own outright, so no two threads write one byte:
//  * cast codecs (none, fp16, bf16): tiles of kTile elements;
//  * int8 / sign: tiles of whole quantisation blocks. Sign bits are packed over the whole tensor, so
//    a tile holds G = 8 / gcd(block, 8) blocks and therefore starts on a byte boundary; inside a tile
//    blocks are processed in order and a block that starts mid-byte ORs its bits into the byte the
//    previous block began (partial bytes are written with their high bits zero).
// grad and residual_in are read from memory once: v = g + e (and a copy of e) go to a small
// thread-local scratch (a block, or kChunk elements; L1-resident), and the later passes (absmax or
// abs-sum, codes, decode, residual) run over the scratch. Each pass is a separate simple loop over
// __restrict pointers, which GCC vectorises (it gives up on the fused loop, and on anything where the
// in-place residual_out == residual_in could alias). The absmax is an integer max over the bits of
// |v| (monotone for non-negative floats, so exact); the abs-sum uses kLanes partial sums so it
// vectorises without -ffast-math; sign bits go through one 0/1 byte per element and are packed 8 at a
// time with a multiply. The shared formulas avoid ?: around divisions and multiplies (gcc will not
// if-convert a possibly trapping operation it sank into a branch). That is not enough on its own: the
// residual's select and the int8 clamp still vectorise under the default -ftrapping-math only with
// AVX-512's masked operations. On an AVX2 machine they ran scalar (int8/sign encode 4-7x and the Adam
// apply 3-6x slower, bench/results/kernels_cpu_avx2_ab.json), so the build passes -fno-trapping-math
// (CMakeLists.txt), which changes no value; -ffp-contract=off keeps every result bit-identical to the
// scalar formula, and the exact-code tests hold it to the torch reference.
// Small inputs run on one thread (an OpenMP fork costs more than the work).

namespace {

constexpr int64_t kTile = 8192;             // elements per tile of the cast codecs
constexpr int64_t kParallelMin = 1 << 15;   // fewer elements than this: one thread
constexpr int kLanes = 16;                  // partial sums in the sign abs-sum

int threads_for(int64_t n, int32_t requested) {
  if (n < kParallelMin) return 1;
  return resolve_num_threads(requested);
}

// ---- cast codecs: none / fp16 / bf16 --------------------------------------------------------

// Cast codecs run in chunks of kChunk elements through simple loops that GCC vectorises (it does
// not vectorise the fused fp16 loop): v = g + e into scratch, codes = store(v), d = load(codes),
// then the residual and the bad flag. The scratch stays in L1.
constexpr int64_t kChunk = 1024;

template <DType D>
void cast_store(const float* __restrict v, typename math::Convert<D>::storage* __restrict codes, int64_t len) {
  for (int64_t i = 0; i < len; ++i) codes[i] = math::Convert<D>::store(v[i]);
}

template <DType D>
void cast_load(const typename math::Convert<D>::storage* __restrict codes, float* __restrict d, int64_t len) {
  for (int64_t i = 0; i < len; ++i) d[i] = math::Convert<D>::load(codes[i]);
}

// The error-feedback step shared by every codec loop: residual (when RO) and the bad flag.
template <bool RO>
int feedback(const float* __restrict v, const float* __restrict d, const float* __restrict e, float* __restrict ro,
             int64_t len) {
  int bad = 0;
  for (int64_t i = 0; i < len; ++i) {
    if (RO) ro[i] = math::ef_residual(v[i], d[i], e[i]);
    bad |= static_cast<int>(math::ef_bad(v[i], d[i]));
  }
  return bad;
}

// v = g + e and a copy of e into scratch (the only read of grad and residual_in).
inline void load_block(const float* __restrict g, const float* __restrict ri, float* __restrict v,
                       float* __restrict e, int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    e[i] = ri[i];
    v[i] = g[i] + ri[i];
  }
}

template <DType D>
void encode_cast(const EncodeParams& p) {
  using S = typename math::Convert<D>::storage;
  const int64_t n = p.out.n;
  const int64_t tiles = ceil_div(n, kTile);
  int bad_any = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(n, p.num_threads)) reduction(| : bad_any)
  for (int64_t t = 0; t < tiles; ++t) {
    alignas(64) float vbuf[kChunk];
    alignas(64) float ebuf[kChunk];
    alignas(64) float dbuf[kChunk];
    const int64_t tile_end = std::min(n, (t + 1) * kTile);
    for (int64_t b = t * kTile; b < tile_end; b += kChunk) {
      const int64_t len = std::min(kChunk, tile_end - b);
      S* codes = static_cast<S*>(p.out.codes) + b;
      const float* v = p.grad + b;  // without a residual, v is grad itself
      if (p.residual_in != nullptr) {
        load_block(p.grad + b, p.residual_in + b, vbuf, ebuf, len);
        v = vbuf;
      }
      cast_store<D>(v, codes, len);
      const float* d = v;  // fp32 decodes to itself
      if constexpr (D != DType::kFloat32) {
        cast_load<D>(codes, dbuf, len);
        d = dbuf;
      }
      bad_any |= p.residual_out != nullptr ? feedback<true>(v, d, ebuf, p.residual_out + b, len)
                                           : feedback<false>(v, d, ebuf, nullptr, len);
    }
  }
  if (bad_any && p.nonfinite != nullptr) *p.nonfinite = 1;
}

// ---- int8 / sign: one quantisation block at a time ------------------------------------------

// Thread-local scratch for one block: v, the old residual, and (sign) one 0/1 byte per element.
struct Scratch {
  std::vector<float> v, e;
  std::vector<uint8_t> flags;
  explicit Scratch(int64_t len)
      : v(static_cast<size_t>(len)), e(static_cast<size_t>(len)), flags(static_cast<size_t>(len) + 16) {}
};

// absmax over the block as the bits of a non-negative float (an integer max: exact, and it
// vectorises; the bits of a finite |v| fit in int32).
inline float block_absmax(const float* __restrict v, int64_t len) {
  int32_t m = 0;
  for (int64_t i = 0; i < len; ++i) m = std::max(m, static_cast<int32_t>(math::float_bits(math::int8_absmax_term(v[i]))));
  return math::bits_float(static_cast<uint32_t>(m));
}

// Sum of |v| over finite v, in kLanes partial sums (vectorises without reassociation flags).
inline float block_abs_sum(const float* __restrict v, int64_t len) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += math::sign_abs_term(v[i + j]);
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  for (; i < len; ++i) sum += math::sign_abs_term(v[i]);
  return sum;
}

template <bool RO>
int int8_codes(const float* __restrict v, const float* __restrict e, float scale, int8_t* __restrict q,
               float* __restrict ro, int64_t len) {
  int bad = 0;
  for (int64_t i = 0; i < len; ++i) {
    const int8_t c = math::int8_quantize(v[i], scale);
    const float d = math::int8_dequantize(c, scale);
    q[i] = c;
    bad |= static_cast<int>(math::ef_bad(v[i], d));
    if (RO) ro[i] = math::ef_residual(v[i], d, e[i]);
  }
  return bad;
}

template <bool RO>
int sign_codes(const float* __restrict v, const float* __restrict e, float scale, uint8_t* __restrict f,
               float* __restrict ro, int64_t len) {
  int bad = 0;
  for (int64_t i = 0; i < len; ++i) {
    const bool bit = math::sign_bit(v[i]);
    const float d = math::sign_decode(bit, scale);
    f[i] = static_cast<uint8_t>(bit);
    bad |= static_cast<int>(math::ef_bad(v[i], d));
    if (RO) ro[i] = math::ef_residual(v[i], d, e[i]);
  }
  return bad;
}

// Eight 0/1 bytes (flag j in byte j, little endian) -> one byte with flag j in bit j (LSB first).
inline uint8_t pack8(const uint8_t* flags) {
  uint64_t x;
  std::memcpy(&x, flags, 8);
  return static_cast<uint8_t>((x * 0x0102040810204080ull) >> 56);
}

// Pack the flags of elements [s, s + len) into the bit array; see Note [CPU codec loops].
inline void store_bits(uint8_t* bits, uint8_t* f, int64_t s, int64_t len) {
  std::memset(f + len, 0, 8);  // flags past the block are 0: a tail byte's high bits start cleared
  int64_t k = 0;
  if (s & 7) {  // finish the byte the previous block of this tile began
    const int64_t lead = std::min<int64_t>(len, 8 - (s & 7));
    uint32_t b = 0;
    for (int64_t j = 0; j < lead; ++j) b |= static_cast<uint32_t>(f[j]) << ((s + j) & 7);
    bits[s >> 3] = static_cast<uint8_t>(bits[s >> 3] | b);
    k = lead;
  }
  for (; k < len; k += 8) bits[(s + k) >> 3] = pack8(f + k);
}

// One int8 or sign block of `len` elements starting at element `s`. Returns 1 when one was bad.
template <bool SIGN>
int encode_block(const EncodeParams& p, int64_t s, int64_t len, int64_t blk, Scratch& sc) {
  float* v = sc.v.data();
  float* e = sc.e.data();
  if (p.residual_in != nullptr) load_block(p.grad + s, p.residual_in + s, v, e, len);
  else std::memcpy(v, p.grad + s, static_cast<size_t>(len) * sizeof(float));
  float* ro = p.residual_out ? p.residual_out + s : nullptr;
  if constexpr (SIGN) {
    const float scale = math::sign_scale(block_abs_sum(v, len), len);
    p.out.scales[blk] = scale;
    uint8_t* f = sc.flags.data();
    const int bad = ro ? sign_codes<true>(v, e, scale, f, ro, len) : sign_codes<false>(v, e, scale, f, nullptr, len);
    store_bits(static_cast<uint8_t*>(p.out.codes), f, s, len);
    return bad;
  } else {
    const float scale = math::int8_scale(block_absmax(v, len));
    p.out.scales[blk] = scale;
    int8_t* q = static_cast<int8_t*>(p.out.codes) + s;
    return ro ? int8_codes<true>(v, e, scale, q, ro, len) : int8_codes<false>(v, e, scale, q, nullptr, len);
  }
}

int64_t gcd64(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

void encode_blocks(const EncodeParams& p) {
  const int64_t n = p.out.n;
  const int64_t block = p.out.block;
  const bool sign = p.out.codec == Codec::kSign;
  const int64_t nblocks = ceil_div(n, block);
  // Blocks per tile: byte-aligned tiles for sign, and at least ~kTile elements per tile.
  int64_t per = sign ? 8 / gcd64(block, 8) : 1;
  per *= std::max<int64_t>(1, kTile / (per * block));
  const int64_t tiles = ceil_div(nblocks, per);
  int bad_any = 0;
#pragma omp parallel num_threads(threads_for(n, p.num_threads)) reduction(| : bad_any)
  {
    Scratch scratch(std::min(block, n));
    int bad = 0;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t b_end = std::min(nblocks, (t + 1) * per);
      for (int64_t blk = t * per; blk < b_end; ++blk) {
        const int64_t s = blk * block;
        const int64_t len = std::min(block, n - s);
        bad |= sign ? encode_block<true>(p, s, len, blk, scratch) : encode_block<false>(p, s, len, blk, scratch);
      }
    }
    bad_any |= bad;
  }
  if (bad_any && p.nonfinite != nullptr) *p.nonfinite = 1;
}

// ---- decode ---------------------------------------------------------------------------------

template <DType D, bool ACC>
void decode_cast_loop(const typename math::Convert<D>::storage* __restrict codes, float alpha, float* __restrict out,
                      int64_t len) {
  using C = math::Convert<D>;
  for (int64_t i = 0; i < len; ++i) out[i] = math::decode_store(out[i], alpha, C::load(codes[i]), ACC);
}

template <DType D>
void decode_cast(const DecodeParams& p) {
  const int64_t n = p.in.n;
  const int64_t tiles = ceil_div(n, kTile);
#pragma omp parallel for schedule(static) num_threads(threads_for(n, p.num_threads))
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t * kTile, len = std::min(n, b + kTile) - b;
    const auto* codes = static_cast<const typename math::Convert<D>::storage*>(p.in.codes) + b;
    if (p.accumulate) decode_cast_loop<D, true>(codes, p.alpha, p.out + b, len);
    else decode_cast_loop<D, false>(codes, p.alpha, p.out + b, len);
  }
}

template <bool ACC>
void decode_int8_loop(const int8_t* __restrict q, float scale, float alpha, float* __restrict out, int64_t len) {
  for (int64_t i = 0; i < len; ++i) out[i] = math::decode_store(out[i], alpha, math::int8_dequantize(q[i], scale), ACC);
}

// f[i] != 0 is the sign bit of element i (see expand_bits).
template <bool ACC>
void decode_sign_loop(const uint8_t* __restrict f, float scale, float alpha, float* __restrict out, int64_t len) {
  for (int64_t i = 0; i < len; ++i) out[i] = math::decode_store(out[i], alpha, math::sign_decode(f[i] != 0, scale), ACC);
}

// Unpack the bytes holding elements [s, s + len) into one flag byte per element, starting with
// element round_down(s, 8): byte j of the bit array becomes flags [8j', 8j' + 8), flag t nonzero
// exactly when bit t is set (the byte replicated 8 times, masked with bit t in byte t).
inline void expand_bits(const uint8_t* bits, int64_t s, int64_t len, uint8_t* f) {
  const int64_t b0 = s >> 3, b1 = (s + len + 7) >> 3;
  for (int64_t j = b0; j < b1; ++j) {
    const uint64_t x = (bits[j] * 0x0101010101010101ull) & 0x8040201008040201ull;
    std::memcpy(f + 8 * (j - b0), &x, 8);
  }
}

template <bool SIGN, bool ACC>
void decode_blocks_t(const DecodeParams& p) {
  const int64_t n = p.in.n;
  const int64_t block = p.in.block;
  const int64_t nblocks = ceil_div(n, block);
#pragma omp parallel num_threads(threads_for(n, p.num_threads))
  {
  std::vector<uint8_t> flags(SIGN ? static_cast<size_t>(std::min(block, n)) + 16 : 0);
  uint8_t* f = flags.data();
#pragma omp for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t s = blk * block, len = std::min(n, s + block) - s;
    const float scale = p.in.scales[blk];
    if constexpr (SIGN) {
      expand_bits(static_cast<const uint8_t*>(p.in.codes), s, len, f);
      decode_sign_loop<ACC>(f + (s & 7), scale, p.alpha, p.out + s, len);
    } else {
      decode_int8_loop<ACC>(static_cast<const int8_t*>(p.in.codes) + s, scale, p.alpha, p.out + s, len);
    }
  }
  }
}

void decode_blocks(const DecodeParams& p) {
  const bool sign = p.in.codec == Codec::kSign;
  if (sign) p.accumulate ? decode_blocks_t<true, true>(p) : decode_blocks_t<true, false>(p);
  else p.accumulate ? decode_blocks_t<false, true>(p) : decode_blocks_t<false, false>(p);
}

// Top-k: zero (unless accumulating), then scatter. Out-of-range indices are skipped: a corrupt
// payload never writes outside `out` (ops/codecs.py reports it as an error before we get here).
void decode_topk(const DecodeParams& p) {
  const int64_t n = p.in.n, k = p.in.k;
  const float* vals = static_cast<const float*>(p.in.codes);
  const int32_t* idx = p.in.indices;
  float* out = p.out;
  const float alpha = p.alpha;
  const bool acc = p.accumulate;
  if (!acc) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n, p.num_threads))
    for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
  }
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = idx[j];
    if (i < 0 || i >= n) continue;
    out[i] = math::decode_store(out[i], alpha, vals[j], acc);
  }
}

}  // namespace

void encode_cpu(const EncodeParams& p) {
  PYASYNC_CHECK_ARG(p.out.n >= 0, "element count must be >= 0");
  if (p.out.n == 0) return;
  PYASYNC_CHECK_ARG(p.grad != nullptr && p.out.codes != nullptr, "encode needs grad and codes");
  PYASYNC_CHECK_ARG(p.mask_out == nullptr || p.out.codec == Codec::kTopK, "mask_out is for the top-k codec only");
  switch (p.out.codec) {
    case Codec::kNone: return encode_cast<DType::kFloat32>(p);
    case Codec::kFP16: return encode_cast<DType::kFloat16>(p);
    case Codec::kBF16: return encode_cast<DType::kBFloat16>(p);
    case Codec::kInt8:
    case Codec::kSign:
      PYASYNC_CHECK_ARG(p.out.block > 0 && p.out.scales != nullptr, "int8/sign encode needs block > 0 and scales");
      return encode_blocks(p);
    case Codec::kTopK: return topk_encode_cpu(p);
  }
  PYASYNC_CHECK_ARG(false, "unknown codec");
}

void decode_cpu(const DecodeParams& p) {
  PYASYNC_CHECK_ARG(p.in.n >= 0, "element count must be >= 0");
  if (p.in.n == 0) return;
  PYASYNC_CHECK_ARG(p.out != nullptr && p.in.codes != nullptr, "decode needs codes and out");
  switch (p.in.codec) {
    case Codec::kNone: return decode_cast<DType::kFloat32>(p);
    case Codec::kFP16: return decode_cast<DType::kFloat16>(p);
    case Codec::kBF16: return decode_cast<DType::kBFloat16>(p);
    case Codec::kInt8:
    case Codec::kSign:
      PYASYNC_CHECK_ARG(p.in.block > 0 && p.in.scales != nullptr, "int8/sign decode needs block > 0 and scales");
      return decode_blocks(p);
    case Codec::kTopK:
      PYASYNC_CHECK_ARG(p.in.k >= 1 && p.in.k <= p.in.n && p.in.indices != nullptr, "top-k decode needs 1 <= k <= n");
      return decode_topk(p);
  }
  PYASYNC_CHECK_ARG(false, "unknown codec");
}

}  // namespace pyasync
