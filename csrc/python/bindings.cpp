// The only pybind11 file. Raw addresses (uintptr_t) and int64 sizes in, nothing out; the GIL is
// released around every kernel. Validation of tensors happens in pyasync/ops (Python), which knows
// dtypes and devices; the core re-checks what would otherwise corrupt memory.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "pyasync/common.h"
#include "pyasync/launchers.h"
#include "pyasync/params.h"

namespace py = pybind11;
using pyasync::Codec;
using pyasync::DType;

namespace {

using addr = uintptr_t;


template <typename T>
T* ptr(addr a) {
  return reinterpret_cast<T*>(a);
}

pyasync::Payload make_payload(int32_t codec, addr codes, addr scales, addr indices, int64_t n, int64_t k,
                              int32_t block) {
  PYASYNC_CHECK_ARG(codec >= 0 && codec <= 5, "unknown codec id " + std::to_string(codec));
  PYASYNC_CHECK_ARG(n >= 0, "element count must be >= 0");
  const Codec c = static_cast<Codec>(codec);
  if (c == Codec::kInt8 || c == Codec::kSign) PYASYNC_CHECK_ARG(block > 0, "block must be > 0");
  if (c == Codec::kTopK) PYASYNC_CHECK_ARG(k >= 1 && k <= n, "top-k needs 1 <= k <= n");
  return pyasync::Payload{c, ptr<void>(codes), ptr<float>(scales), ptr<int32_t>(indices), n, k, block};
}

DType make_dtype(int32_t d) {
  PYASYNC_CHECK_ARG(d >= 0 && d <= 2, "unknown dtype id " + std::to_string(d));
  return static_cast<DType>(d);
}

void check_table(const std::vector<uint64_t>& a, const std::vector<int64_t>& n, const std::vector<int64_t>& o) {
  PYASYNC_CHECK_ARG(a.size() == n.size() && a.size() == o.size(),
                    "address, numel and offset tables must have the same length");
  for (size_t i = 0; i < n.size(); ++i) PYASYNC_CHECK_ARG(n[i] >= 0 && o[i] >= 0, "negative numel or offset");
}

pyasync::FlattenParams flatten_params(const std::vector<uint64_t>& srcs, const std::vector<int64_t>& numels,
                                      const std::vector<int64_t>& offsets, int32_t src_dtype,
                                      int32_t dst_dtype, addr bucket, float scale, addr nonfinite,
                                      int32_t num_threads) {
  check_table(srcs, numels, offsets);
  return pyasync::FlattenParams{srcs.data(), numels.data(), offsets.data(), static_cast<int32_t>(srcs.size()),
                                make_dtype(src_dtype), make_dtype(dst_dtype), ptr<void>(bucket), scale,
                                ptr<int32_t>(nonfinite), num_threads};
}

pyasync::UnflattenParams unflatten_params(const std::vector<uint64_t>& dsts, const std::vector<int64_t>& numels,
                                          const std::vector<int64_t>& offsets, int32_t src_dtype,
                                          int32_t dst_dtype, addr src, int64_t begin, int64_t end,
                                          int32_t num_threads) {
  check_table(dsts, numels, offsets);
  PYASYNC_CHECK_ARG(0 <= begin && begin <= end, "unflatten needs 0 <= begin <= end");
  return pyasync::UnflattenParams{dsts.data(), numels.data(), offsets.data(), static_cast<int32_t>(dsts.size()),
                                  make_dtype(src_dtype), make_dtype(dst_dtype), ptr<const void>(src), begin, end,
                                  num_threads};
}

pyasync::EncodeParams encode_params(addr grad, addr residual_in, addr residual_out, int32_t codec, addr codes,
                                    addr scales, addr indices, int64_t n, int64_t k, int32_t block,
                                    addr nonfinite, addr workspace, int64_t workspace_bytes,
                                    int32_t num_threads, addr mask_out) {
  PYASYNC_CHECK_ARG(residual_in != 0 || residual_out == 0, "residual_out given without residual_in");
  return pyasync::EncodeParams{ptr<const float>(grad),
                               ptr<const float>(residual_in),
                               ptr<float>(residual_out),
                               make_payload(codec, codes, scales, indices, n, k, block),
                               ptr<int32_t>(nonfinite),
                               ptr<void>(workspace),
                               workspace_bytes,
                               num_threads,
                               ptr<float>(mask_out)};
}

pyasync::VelocityParams velocity_params(addr grad, addr u_in, addr u_out, addr x_out, float mu, bool nesterov,
                                        int64_t n, int32_t num_threads) {
  PYASYNC_CHECK_ARG(n >= 0, "element count must be >= 0");
  PYASYNC_CHECK_ARG(std::isfinite(mu) && mu >= 0.0f && mu < 1.0f, "momentum must be in [0, 1)");
  return pyasync::VelocityParams{ptr<const float>(grad), ptr<const float>(u_in), ptr<float>(u_out), ptr<float>(x_out),
                                 mu, nesterov, n, num_threads};
}

pyasync::DecodeParams decode_params(int32_t codec, addr codes, addr scales, addr indices, int64_t n, int64_t k,
                                    int32_t block, addr out, float alpha, bool accumulate, int32_t num_threads) {
  return pyasync::DecodeParams{make_payload(codec, codes, scales, indices, n, k, block), ptr<float>(out), alpha,
                               accumulate, num_threads};
}

pyasync::ApplyParams apply_params(int32_t codec, addr codes, addr scales, int64_t n, int32_t block,
                                  float grad_scale, addr dense, float dense_scale, addr param, addr state1,
                                  addr state2, const py::dict& opt, float dc_lambda, addr dc_held,
                                  int32_t num_threads) {
  PYASYNC_CHECK_ARG(codec != static_cast<int32_t>(Codec::kTopK),
                    "apply does not decode top-k; scatter it into `dense` first");
  pyasync::Payload g = make_payload(codec, codes, scales, 0, n, 0, block);
  pyasync::OptimParams o{};
  const std::string kind = opt["kind"].cast<std::string>();
  PYASYNC_CHECK_ARG(kind == "sgd" || kind == "adam" || kind == "delayed_nesterov",
                    "optimizer kind must be 'sgd', 'adam' or 'delayed_nesterov'");
  o.kind = kind == "sgd"    ? pyasync::OptimKind::kSGD
           : kind == "adam" ? pyasync::OptimKind::kAdam
                            : pyasync::OptimKind::kDelayedNesterov;
  auto f = [&](const char* key, float dflt) { return opt.contains(key) ? opt[key].cast<float>() : dflt; };
  auto b = [&](const char* key) { return opt.contains(key) ? opt[key].cast<bool>() : false; };
  o.lr = f("lr", 0.0f);
  o.weight_decay = f("weight_decay", 0.0f);
  o.maximize = b("maximize");
  o.momentum = f("momentum", 0.0f);
  o.dampening = f("dampening", 0.0f);
  o.nesterov = b("nesterov");
  o.first_step = b("first_step");
  o.beta1 = f("beta1", 0.9f);
  o.beta2 = f("beta2", 0.999f);
  o.eps = f("eps", 1e-8f);
  o.decoupled_weight_decay = b("decoupled_weight_decay");
  o.step_size = f("step_size", 0.0f);
  o.bias_correction2_sqrt = f("bias_correction2_sqrt", 1.0f);
  o.close_round = b("close_round");
  // torch rounds these from Python doubles: 1 - 0.999 in double differs from 1.0f - 0.999f by 1e-5.
  auto d = [&](const char* key, double dflt) { return opt.contains(key) ? opt[key].cast<double>() : dflt; };
  o.one_minus_dampening = static_cast<float>(1.0 - d("dampening", 0.0));
  o.one_minus_beta1 = static_cast<float>(1.0 - d("beta1", 0.9));
  o.one_minus_beta2 = static_cast<float>(1.0 - d("beta2", 0.999));
  o.decay_factor = static_cast<float>(1.0 - d("lr", 0.0) * d("weight_decay", 0.0));
  o.lr_momentum = static_cast<float>(d("lr", 0.0) * d("momentum", 0.0));
  if (o.kind == pyasync::OptimKind::kSGD && o.momentum != 0.0f)
    PYASYNC_CHECK_ARG(state1 != 0, "SGD with momentum needs a momentum buffer (state1)");
  if (o.kind != pyasync::OptimKind::kSGD)
    PYASYNC_CHECK_ARG(state1 != 0 && state2 != 0, "Adam and delayed Nesterov need state1 and state2");
  PYASYNC_CHECK_ARG(param != 0, "apply needs a parameter shard");
  PYASYNC_CHECK_ARG(std::isfinite(dc_lambda) && dc_lambda >= 0.0f,
                    "dc_lambda must be finite and >= 0 (0 turns delay compensation off)");
  PYASYNC_CHECK_ARG(dc_lambda == 0.0f || dc_held != 0, "dc_lambda > 0 needs dc_held (the pusher's weights)");
  return pyasync::ApplyParams{g,
                              grad_scale,
                              ptr<const float>(dense),
                              dense_scale,
                              ptr<const float>(dc_held),
                              dc_lambda,
                              ptr<float>(param),
                              ptr<float>(state1),
                              ptr<float>(state2),
                              o,
                              num_threads};
}

#if defined(PYASYNC_WITH_CUDA)
pyasync::StreamHandle stream_of(addr s) {
  static const int devices = pyasync::cuda_device_count();
  if (devices == 0)
    throw std::runtime_error(
        "pyasync: a CUDA kernel was requested but no usable CUDA GPU is visible "
        "(check the driver and CUDA_VISIBLE_DEVICES, or use CPU tensors)");
  return reinterpret_cast<pyasync::StreamHandle>(s);
}
#endif


// Note [Kernel bindings]
// Every kernel is bound twice, `<op>_cpu(args...)` and `<op>_cuda(args..., stream)`, with the same
// argument names: its Params factory turns the Python-facing arguments (addresses, sizes, ids) into
// the plain parameter struct, then the GIL is released around the launcher. def_kernel writes both
// bindings from the factory and the two launchers, so no lambda is written per op and device.
template <typename P, typename... A, typename... Names>
void def_kernel(py::module_& m, const char* cpu_name, [[maybe_unused]] const char* cuda_name, P (*make)(A...),
                void (*cpu)(const P&),
#if defined(PYASYNC_WITH_CUDA)
                void (*cuda)(const P&, pyasync::StreamHandle),
#endif
                const Names&... names) {
  m.def(
      cpu_name,
      [make, cpu](A... a) {
        const P p = make(a...);
        py::gil_scoped_release nogil;
        cpu(p);
      },
      names...);
#if defined(PYASYNC_WITH_CUDA)
  m.def(
      cuda_name,
      [make, cuda](A... a, addr stream) {
        const P p = make(a...);
        const auto s = stream_of(stream);
        py::gil_scoped_release nogil;
        cuda(p, s);
      },
      names..., py::arg("stream"));
#endif
}

#if defined(PYASYNC_WITH_CUDA)
#define PYASYNC_LAUNCHERS(op) &pyasync::op##_cpu, &pyasync::op##_cuda
#else
#define PYASYNC_LAUNCHERS(op) &pyasync::op##_cpu
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyasync core kernels (raw pointers; use pyasync.ops, not this module)";

#if defined(PYASYNC_WITH_CUDA)
  m.def("has_cuda", [] { return true; }, "True when the CUDA kernels were compiled in.");
  m.def("cuda_device_count", &pyasync::cuda_device_count, "Usable CUDA devices (0 without a driver).");
#else
  m.def("has_cuda", [] { return false; }, "True when the CUDA kernels were compiled in.");
  m.def("cuda_device_count", [] { return 0; }, "Usable CUDA devices (0 without a driver).");
#endif
  m.def("set_num_threads", &pyasync::set_num_threads, py::arg("n"),
        "CPU kernel threads for calls that pass num_threads=0; 0 restores the default.");
  m.def("get_num_threads", &pyasync::get_num_threads, "CPU kernel threads a call with num_threads=0 uses.");
  m.def("topk_workspace_bytes", &pyasync::topk_workspace_bytes, py::arg("n"), py::arg("k"),
        "Scratch bytes the top-k encode needs for n elements, k kept.");

#define PYASYNC_FLATTEN_ARGS                                                                                     \
  py::arg("srcs"), py::arg("numels"), py::arg("offsets"), py::arg("src_dtype"), py::arg("dst_dtype"),        \
      py::arg("bucket"), py::arg("scale"), py::arg("nonfinite"), py::arg("num_threads")
#define PYASYNC_UNFLATTEN_ARGS                                                                                   \
  py::arg("dsts"), py::arg("numels"), py::arg("offsets"), py::arg("src_dtype"), py::arg("dst_dtype"),        \
      py::arg("src"), py::arg("begin"), py::arg("end"), py::arg("num_threads")
#define PYASYNC_ENCODE_ARGS                                                                                      \
  py::arg("grad"), py::arg("residual_in"), py::arg("residual_out"), py::arg("codec"), py::arg("codes"),      \
      py::arg("scales"), py::arg("indices"), py::arg("n"), py::arg("k"), py::arg("block"), py::arg("nonfinite"), \
      py::arg("workspace"), py::arg("workspace_bytes"), py::arg("num_threads"), py::arg("mask_out")
#define PYASYNC_DECODE_ARGS                                                                                      \
  py::arg("codec"), py::arg("codes"), py::arg("scales"), py::arg("indices"), py::arg("n"), py::arg("k"),     \
      py::arg("block"), py::arg("out"), py::arg("alpha"), py::arg("accumulate"), py::arg("num_threads")
#define PYASYNC_APPLY_ARGS                                                                                       \
  py::arg("codec"), py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("block"), py::arg("grad_scale"), \
      py::arg("dense"), py::arg("dense_scale"), py::arg("param"), py::arg("state1"), py::arg("state2"),       \
      py::arg("opt"), py::arg("dc_lambda"), py::arg("dc_held"), py::arg("num_threads")

  def_kernel(m, "flatten_cpu", "flatten_cuda", &flatten_params, PYASYNC_LAUNCHERS(flatten), PYASYNC_FLATTEN_ARGS);
  def_kernel(m, "unflatten_cpu", "unflatten_cuda", &unflatten_params, PYASYNC_LAUNCHERS(unflatten),
             PYASYNC_UNFLATTEN_ARGS);
  def_kernel(m, "encode_cpu", "encode_cuda", &encode_params, PYASYNC_LAUNCHERS(encode), PYASYNC_ENCODE_ARGS);
  def_kernel(m, "decode_cpu", "decode_cuda", &decode_params, PYASYNC_LAUNCHERS(decode), PYASYNC_DECODE_ARGS);
  def_kernel(m, "apply_cpu", "apply_cuda", &apply_params, PYASYNC_LAUNCHERS(apply), PYASYNC_APPLY_ARGS);
  def_kernel(m, "dgc_velocity_cpu", "dgc_velocity_cuda", &velocity_params, PYASYNC_LAUNCHERS(dgc_velocity),
             py::arg("grad"), py::arg("u_in"), py::arg("u_out"), py::arg("x_out"), py::arg("mu"), py::arg("nesterov"),
             py::arg("n"), py::arg("num_threads"));
}
