// Fused decode + optimizer step on an fp32 master shard, CPU. See Note [Fused apply] (math/optim.h)
// and Note [CPU apply tiles] below.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "pyasync/common.h"
#include "pyasync/launchers.h"
#include "pyasync/math/cast.h"
#include "pyasync/math/int8.h"
#include "pyasync/math/optim.h"
#include "pyasync/math/sign.h"
#include "pyasync/params.h"

namespace pyasync {
namespace {

// Note [CPU apply tiles]
// The shard is cut into tiles of kTile elements. Each tile is done in two passes over an L1-resident
// buffer: (1) gather: g = dense_scale * dense + grad_scale * decode(payload), specialised on the codec
// and on which terms are present; (2) step: the optimizer update of math/optim.h, specialised on the
// optimizer. With delay compensation on (dc_lambda > 0) a third pass sits between them,
// g = math::dc_compensate(g, lambda, param, dc_held) over the same tile (See Note [Delay compensation formula]);
// it is chosen once per call, so with dc_lambda == 0 the loop is today's two passes and dc_held is
// never read. All passes are branch-free inner loops that the compiler vectorises, and the two
// dispatches are made once per call (function pointers chosen outside the loop), so the number of
// instantiations is the sum of the two axes, not their product. Blockwise codecs (int8, sign) walk
// the tile in segments that lie inside one scale block, so the scale is a loop constant and no
// per-element division is needed. Results do not depend on the thread count: every element is
// computed by the same instructions whichever thread owns its tile. Vectorising the Adam loop needs
// -fno-math-errno (CMakeLists.txt) for sqrtf, and its bool flags as constants (step_adam below).
// Checked with -fopt-info-vec: every gather and step loop vectorises (AVX-512 on the dev machine).

constexpr int64_t kTile = 2048;                // elements per tile (8 KiB of fp32 gradient)
constexpr int64_t kMinTilesPerThread = 16;     // below this a thread costs more than it saves

using GatherFn = void (*)(const ApplyParams&, int64_t begin, int64_t end, float* g);
using StepFn = void (*)(const OptimParams&, const float* g, float* p, float* s1, float* s2, int64_t m);

// Decoded payload element i (scale: the block's scale for int8 / sign, unused otherwise).
template <Codec C>
inline float load_code(const void* codes, int64_t i, float scale);
template <>
inline float load_code<Codec::kNone>(const void* codes, int64_t i, float) {
  return static_cast<const float*>(codes)[i];
}
template <>
inline float load_code<Codec::kFP16>(const void* codes, int64_t i, float) {
  return math::fp16_to_float(static_cast<const uint16_t*>(codes)[i]);
}
template <>
inline float load_code<Codec::kBF16>(const void* codes, int64_t i, float) {
  return math::bf16_to_float(static_cast<const uint16_t*>(codes)[i]);
}
template <>
inline float load_code<Codec::kInt8>(const void* codes, int64_t i, float scale) {
  return math::int8_dequantize(static_cast<const int8_t*>(codes)[i], scale);
}
template <>
inline float load_code<Codec::kSign>(const void* codes, int64_t i, float scale) {
  return math::sign_decode(math::sign_get_bit(static_cast<const uint8_t*>(codes), i), scale);
}

constexpr bool is_blockwise(Codec c) { return c == Codec::kInt8 || c == Codec::kSign; }

// g[0, e-b) = dense_scale * dense[b, e) + grad_scale * decode(payload)[b, e), all in one scale block.
template <Codec C, bool kPayload, bool kDense>
inline void gather_segment(const ApplyParams& p, int64_t b, int64_t e, float scale, float* __restrict g) {
  const void* codes = p.grad.codes;
  const float* __restrict dense = p.dense;
  const float gs = p.grad_scale;
  const float ds = p.dense_scale;
  for (int64_t i = b; i < e; ++i) {
    float x;
    if constexpr (kPayload && kDense) {
      x = ds * dense[i] + gs * load_code<C>(codes, i, scale);
    } else if constexpr (kPayload) {
      x = gs * load_code<C>(codes, i, scale);
    } else {
      x = ds * dense[i];
    }
    g[i - b] = x;
  }
}

// Sign codes: element i is bit i % 8 of byte i / 8 (math::sign_get_bit). Whole bytes are expanded 8
// elements at a time, which vectorises; the partial bytes at the ends go element by element.
template <bool kDense>
inline void gather_sign_segment(const ApplyParams& p, int64_t b, int64_t e, float scale, float* __restrict g) {
  const int64_t b8 = std::min(e, (b + 7) & ~int64_t{7});
  const int64_t e8 = std::max(b8, e & ~int64_t{7});
  gather_segment<Codec::kSign, true, kDense>(p, b, b8, scale, g);
  const uint8_t* __restrict bits = static_cast<const uint8_t*>(p.grad.codes);
  const float* __restrict dense = p.dense;
  const float gs = p.grad_scale;
  const float ds = p.dense_scale;
  float* __restrict out = g + (b8 - b);
  for (int64_t q = b8 >> 3; q < (e8 >> 3); ++q) {
    const uint32_t byte = bits[q];
    for (int t = 0; t < 8; ++t) {
      const int64_t i = (q << 3) + t;
      const float x = gs * math::sign_decode((byte >> t) & 1u, scale);
      out[i - b8] = kDense ? ds * dense[i] + x : x;
    }
  }
  gather_segment<Codec::kSign, true, kDense>(p, e8, e, scale, g + (e8 - b));
}

template <Codec C, bool kPayload, bool kDense>
void gather(const ApplyParams& p, int64_t b, int64_t e, float* g) {
  if constexpr (kPayload && is_blockwise(C)) {
    const int64_t block = p.grad.block;
    int64_t blk = b / block;
    for (int64_t s = b; s < e; ++blk) {
      const int64_t se = std::min(e, (blk + 1) * block);
      if constexpr (C == Codec::kSign) {
        gather_sign_segment<kDense>(p, s, se, p.grad.scales[blk], g + (s - b));
      } else {
        gather_segment<C, kPayload, kDense>(p, s, se, p.grad.scales[blk], g + (s - b));
      }
      s = se;
    }
  } else {
    gather_segment<C, kPayload, kDense>(p, b, e, 0.0f, g);
  }
}

// g[j] = g[j] + lambda * g[j] * g[j] * (w[j] - held[j]) on one tile: See Note [Delay compensation formula].
void compensate(float lambda, const float* __restrict w, const float* __restrict held, float* __restrict g,
                int64_t m) {
  for (int64_t j = 0; j < m; ++j) g[j] = math::dc_compensate(g[j], lambda, w[j], held[j]);
}

// SGD without momentum: the local copy with momentum == 0 lets the compiler drop the buffer branch.
void step_sgd_plain(const OptimParams& o_in, const float* __restrict g, float* __restrict p, float*, float*,
                    int64_t m) {
  OptimParams o = o_in;
  o.momentum = 0.0f;
  for (int64_t j = 0; j < m; ++j) {
    float pj = p[j];  // locals, so the flag branches if-convert into selects
    math::sgd_step(o, g[j], pj, nullptr);
    p[j] = pj;
  }
}

void step_sgd_momentum(const OptimParams& o_in, const float* __restrict g, float* __restrict p,
                       float* __restrict buf, float*, int64_t m) {
  const OptimParams o = o_in;
  for (int64_t j = 0; j < m; ++j) {
    float pj = p[j], bj = buf[j];
    math::sgd_step(o, g[j], pj, &bj);
    p[j] = pj;
    buf[j] = bj;
  }
}

// Adam: GCC does not vectorise a select on a bool field, so the two bool flags become template
// constants in the local copy (float-valued conditions such as weight_decay != 0 vectorise as is).
template <bool kMaximize, bool kDecoupled>
void step_adam(const OptimParams& o_in, const float* __restrict g, float* __restrict p, float* __restrict s1,
               float* __restrict s2, int64_t m) {
  OptimParams o = o_in;
  o.maximize = kMaximize;
  o.decoupled_weight_decay = kDecoupled;
  for (int64_t j = 0; j < m; ++j) {
    float pj = p[j], mj = s1[j], vj = s2[j];
    math::adam_step(o, g[j], pj, mj, vj);
    p[j] = pj;
    s1[j] = mj;
    s2[j] = vj;
  }
}

// Delayed Nesterov (Note [Delayed Nesterov]): state1 the momentum, state2 the round's accumulator; the
// round flag becomes a template constant so that neither loop branches per element.
template <bool kClose>
void step_delayed_nesterov(const OptimParams& o_in, const float* __restrict g, float* __restrict p,
                           float* __restrict s1, float* __restrict s2, int64_t m) {
  OptimParams o = o_in;
  o.close_round = kClose;
  for (int64_t j = 0; j < m; ++j) {
    float pj = p[j], mj = s1[j], aj = s2[j];
    math::delayed_nesterov_step(o, g[j], pj, mj, aj);
    p[j] = pj;
    s1[j] = mj;
    s2[j] = aj;
  }
}

template <Codec C>
GatherFn pick_gather(bool payload, bool dense) {
  if (!payload) return &gather<C, false, true>;
  return dense ? &gather<C, true, true> : &gather<C, true, false>;
}

GatherFn gather_for(const ApplyParams& p) {
  const bool payload = p.grad.codes != nullptr;
  const bool dense = p.dense != nullptr;
  if (!payload) return &gather<Codec::kNone, false, true>;
  PYASYNC_DISPATCH_INLINE_CODEC(p.grad.codec, return pick_gather<C>(payload, dense));
}

StepFn step_for(const OptimParams& o) {
  if (o.kind == OptimKind::kDelayedNesterov) {
    return o.close_round ? &step_delayed_nesterov<true> : &step_delayed_nesterov<false>;
  }
  if (o.kind == OptimKind::kAdam) {
    if (o.maximize) return o.decoupled_weight_decay ? &step_adam<true, true> : &step_adam<true, false>;
    return o.decoupled_weight_decay ? &step_adam<false, true> : &step_adam<false, false>;
  }
  return o.momentum != 0.0f ? &step_sgd_momentum : &step_sgd_plain;
}

void check(const ApplyParams& p) {
  const Payload& g = p.grad;
  PYASYNC_CHECK_ARG(g.n >= 0, "apply: element count must be >= 0");
  PYASYNC_CHECK_ARG(p.param != nullptr || g.n == 0, "apply: param is null");
  PYASYNC_CHECK_ARG(g.codes != nullptr || p.dense != nullptr, "apply: needs a payload, a dense gradient or both");
  if (g.codes != nullptr && is_blockwise(g.codec)) {
    PYASYNC_CHECK_ARG(g.block > 0, "apply: int8/sign payload needs block > 0");
    PYASYNC_CHECK_ARG(g.scales != nullptr || g.n == 0, "apply: int8/sign payload needs scales");
  }
  if (p.opt.kind == OptimKind::kAdam || p.opt.kind == OptimKind::kDelayedNesterov) {
    PYASYNC_CHECK_ARG((p.state1 != nullptr && p.state2 != nullptr) || g.n == 0,
                      "apply: Adam and delayed Nesterov need state1 and state2");
  } else if (p.opt.momentum != 0.0f) {
    PYASYNC_CHECK_ARG(p.state1 != nullptr || g.n == 0, "apply: SGD with momentum needs a momentum buffer");
  }
  PYASYNC_CHECK_ARG(std::isfinite(p.dc_lambda) && p.dc_lambda >= 0.0f, "apply: dc_lambda must be finite and >= 0");
  PYASYNC_CHECK_ARG(p.dc_lambda == 0.0f || p.dc_held != nullptr || g.n == 0, "apply: dc_lambda > 0 needs dc_held");
}

}  // namespace

void apply_cpu(const ApplyParams& p) {
  check(p);
  const int64_t n = p.grad.n;
  if (n == 0) return;
  const GatherFn gather_fn = gather_for(p);
  const StepFn step_fn = step_for(p.opt);
  const int64_t tiles = ceil_div(n, kTile);
  const int64_t useful = std::max<int64_t>(1, tiles / kMinTilesPerThread);
  const int threads = static_cast<int>(std::min<int64_t>(resolve_num_threads(p.num_threads), useful));
  float* const param = p.param;
  float* const s1 = p.state1;
  float* const s2 = p.state2;
  const float dc_lambda = p.dc_lambda;
  const float* const dc_held = dc_lambda != 0.0f ? p.dc_held : nullptr;  // null: no compensation pass
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float g[kTile];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t b = t * kTile;
      const int64_t e = std::min(n, b + kTile);
      gather_fn(p, b, e, g);
      if (dc_held != nullptr) compensate(dc_lambda, param + b, dc_held + b, g, e - b);
      step_fn(p.opt, g, param + b, s1 ? s1 + b : nullptr, s2 ? s2 + b : nullptr, e - b);
    }
  }
}

}  // namespace pyasync
