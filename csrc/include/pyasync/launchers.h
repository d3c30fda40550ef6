// Every kernel launcher of the core, CPU and CUDA. Bindings call these and nothing else.
#pragma once

#include <cstdint>

#include "pyasync/params.h"

namespace pyasync {

// The CUDA stream, as an opaque handle, so this header needs no CUDA include.
using StreamHandle = void*;

void flatten_cpu(const FlattenParams& p);
void unflatten_cpu(const UnflattenParams& p);
void encode_cpu(const EncodeParams& p);   // dispatches on p.out.codec (top-k: topk_encode_cpu)
void decode_cpu(const DecodeParams& p);
void topk_encode_cpu(const EncodeParams& p);
void apply_cpu(const ApplyParams& p);
void dgc_velocity_cpu(const VelocityParams& p);

// Scratch bytes the CUDA top-k encode needs for n elements and k kept (host computation).
int64_t topk_workspace_bytes(int64_t n, int64_t k);

#if defined(PYASYNC_WITH_CUDA)
void flatten_cuda(const FlattenParams& p, StreamHandle stream);
void unflatten_cuda(const UnflattenParams& p, StreamHandle stream);
void encode_cuda(const EncodeParams& p, StreamHandle stream);
void decode_cuda(const DecodeParams& p, StreamHandle stream);
void topk_encode_cuda(const EncodeParams& p, StreamHandle stream);
void apply_cuda(const ApplyParams& p, StreamHandle stream);
void dgc_velocity_cuda(const VelocityParams& p, StreamHandle stream);
// Number of usable CUDA devices; 0 when no driver or no device. Never throws.
int cuda_device_count();
#endif

}  // namespace pyasync
