// Plain parameter structs: the whole contract between the bindings and the kernels.
// Every launcher has the same shape on both sides:
//   void <op>_cpu(const <Op>Params&);   void <op>_cuda(const <Op>Params&, cudaStream_t);
// Pointers are raw device or host addresses (the caller keeps the tensors alive); sizes are int64.
#pragma once

#include <cstdint>

#include "pyasync/common.h"

namespace pyasync {

// ----------------------------------------------------------------------------------------------
// Bucketing (csrc/cpu/flatten.cpp, csrc/cuda/flatten.cu)

// Copy many tensors into one contiguous bucket, multiplying by `scale` on the way (Reducer-style).
struct FlattenParams {
  const uint64_t* srcs;    // host array[count]: address of each source tensor; 0 means "all zeros"
  const int64_t* numels;   // host array[count]: elements of each source tensor
  const int64_t* offsets;  // host array[count]: element offset of each tensor inside the bucket
  int32_t count;           // number of tensors
  DType src_dtype;         // element type of every source
  DType dst_dtype;         // element type of the bucket
  void* bucket;            // destination, at least max(offsets[i] + numels[i]) elements
  float scale;             // every element is multiplied by this (1.0f: plain copy)
  int32_t* nonfinite;      // nullable; set to 1 when any source element is NaN or +-Inf
  int32_t num_threads;     // CPU threads; 0: the default (see resolve_num_threads)
};

// Copy the bucket elements [begin, end) (held contiguously at `src`) back into the tensors that
// overlap that range; tensor i covers bucket elements [offsets[i], offsets[i] + numels[i]).
struct UnflattenParams {
  const uint64_t* dsts;    // host array[count]: address of each destination tensor
  const int64_t* numels;   // host array[count]: elements of each destination tensor
  const int64_t* offsets;  // host array[count]: element offset of each tensor inside the bucket
  int32_t count;           // number of tensors
  DType src_dtype;         // element type of the bucket slice
  DType dst_dtype;         // element type of every destination
  const void* src;         // bucket slice; src[0] is bucket element `begin`
  int64_t begin;           // first bucket element held in src
  int64_t end;             // one past the last bucket element held in src
  int32_t num_threads;     // CPU threads; 0: the default
};

// ----------------------------------------------------------------------------------------------
// Compression (csrc/cpu/codecs.cpp + topk.cpp, csrc/cuda/codecs.cu + topk.cu)

// An encoded gradient slice. Which fields are used depends on the codec:
//   kNone: codes = n fp32;  kFP16/kBF16: codes = n uint16;  kInt8: codes = n int8 + ceil(n/block)
//   scales;  kSign: codes = ceil(n/8) bytes + ceil(n/block) scales;  kTopK: codes = k fp32 values +
//   k int32 indices.
struct Payload {
  Codec codec;        // the encoding
  void* codes;        // element codes or top-k values (see above)
  float* scales;      // int8 / sign: one fp32 scale per block; otherwise null
  int32_t* indices;   // top-k: k indices, ascending; otherwise null
  int64_t n;          // elements of the dense tensor
  int64_t k;          // top-k: number of kept elements (1 <= k <= n); otherwise 0
  int32_t block;      // int8 / sign: block size in elements (> 0); otherwise 0
};

// Encode v = grad + residual_in into `out`, with error feedback residual_out = v - decode(out).
struct EncodeParams {
  const float* grad;          // n fp32 gradient values
  const float* residual_in;   // nullable: no error feedback (then residual_out must be null)
  float* residual_out;        // nullable; may alias residual_in (in place)
  Payload out;                // destination; out.n is the element count
  int32_t* nonfinite;         // nullable; set to 1 when grad holds NaN or +-Inf (never cleared)
  void* workspace;            // top-k scratch of topk_workspace_bytes(n, k) bytes (CUDA; CPU may be null)
  int64_t workspace_bytes;    // size of workspace in bytes
  int32_t num_threads;        // CPU threads; 0: the default
  float* mask_out;            // top-k only, nullable: zeroed where an element is sent (factor masking,
                              // Note [Momentum correction for top-k] in math/topk.h)
};

// The worker's momentum step before a top-k encode: u_out = mu * u_in + grad, and x_out the value
// error feedback accumulates (Note [Momentum correction for top-k] in math/topk.h).
struct VelocityParams {
  const float* grad;          // n fp32 gradient values
  const float* u_in;          // n fp32: the velocity before this step
  float* u_out;               // n fp32: the new velocity (may alias u_in)
  float* x_out;               // nullable: the accumulated value; null: x is u_out (needs nesterov false)
  float mu;                   // the momentum
  bool nesterov;              // x = grad + mu * u_out instead of u_out
  int64_t n;                  // elements
  int32_t num_threads;        // CPU threads; 0: the default
};

// out = (accumulate ? out : 0) + alpha * decode(in)
struct DecodeParams {
  Payload in;                 // the encoded slice (read only)
  float* out;                 // in.n fp32 values
  float alpha;                // multiplies the decoded values
  bool accumulate;            // add into out instead of overwriting it
  int32_t num_threads;        // CPU threads; 0: the default
};

// ----------------------------------------------------------------------------------------------
// Apply-to-shard (csrc/cpu/apply.cpp, csrc/cuda/apply.cu); math in math/optim.h

enum class OptimKind : int32_t { kSGD = 0, kAdam = 1, kDelayedNesterov = 2 };

struct OptimParams {
  OptimKind kind;               // SGD, Adam (AdamW: decoupled_weight_decay) or delayed Nesterov
  float lr;                     // learning rate
  float weight_decay;           // L2 (SGD, Adam) or decoupled (AdamW) weight decay
  bool maximize;                // ascend instead of descend
  // SGD
  float momentum;               // 0: no momentum buffer
  float dampening;              // torch.optim.SGD dampening
  bool nesterov;                // Nesterov momentum
  bool first_step;              // momentum buffer is initialised to the gradient (torch's None buffer)
  // Adam / AdamW
  float beta1;                  // first-moment decay
  float beta2;                  // second-moment decay
  float eps;                    // denominator epsilon
  bool decoupled_weight_decay;  // AdamW
  float step_size;              // lr / (1 - beta1^step), computed on the host in double
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step), computed on the host in double
  // Delayed Nesterov (the outer step of asynchronous local steps): lr, momentum and
  bool close_round;             // this update closes a round: the momentum step is taken
  // Derived scalars torch.optim computes in Python double before rounding to fp32 (bindings fill them)
  float one_minus_dampening;    // SGD: 1 - dampening
  float one_minus_beta1;        // Adam: 1 - beta1 (the lerp weight)
  float one_minus_beta2;        // Adam: 1 - beta2 (the addcmul value)
  float decay_factor;           // AdamW: 1 - lr * weight_decay
  float lr_momentum;            // delayed Nesterov: lr * momentum
};

// One optimizer step on an fp32 shard from g = dense_scale * dense + grad_scale * decode(grad),
// delay-compensated first when dc_lambda > 0 (math/optim.h).
// Top-k is not decoded here: the ops layer scatters it into `dense` first (see ops/apply.py).
struct ApplyParams {
  Payload grad;         // encoded gradient (codec kTopK not allowed); grad.codes null: no payload
  float grad_scale;     // multiplies the decoded payload (e.g. 1/n, a staleness lr scale)
  const float* dense;   // nullable: an fp32 gradient (e.g. the sum of earlier pushes)
  float dense_scale;    // multiplies dense
  const float* dc_held; // grad.n fp32: weights the pusher held when it computed g; read only if dc_lambda > 0
  float dc_lambda;      // delay compensation, >= 0 and finite; 0: off. See Note [Delay compensation formula]
  float* param;         // grad.n fp32 master values, updated in place
  float* state1;        // SGD: momentum buffer (null when momentum == 0); Adam: exp_avg; delayed Nesterov: momentum
  float* state2;        // Adam: exp_avg_sq; SGD: null; delayed Nesterov: the round's accumulated gradient
  OptimParams opt;      // the optimizer and its scalars
  int32_t num_threads;  // CPU threads; 0: the default
};

}  // namespace pyasync
